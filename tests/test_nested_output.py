"""The retryable form's placement: the consumers' rows travel Spark's shuffle as nested rows."""

from __future__ import annotations

import pyarrow as pa
import pytest
from chispa import assert_df_equality
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import functions as F
from test_pipelined import spark_rows

import spark_credit_shuffle as scs
from spark_credit_shuffle.runtime import nested_output
from spark_credit_shuffle.runtime.nested_output import nest

SCHEMA = pa.schema([("a", pa.int64()), ("s", pa.string())])


def nested_cells(batches: list[pa.RecordBatch]) -> list[list[dict]]:
    return [cell for batch in batches for cell in batch.column(1).to_pylist()]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    offset=st.integers(0, 5),
    limit=st.sampled_from([256, 4096, 1 << 30]),
)
def test_nesting_keeps_every_row_in_order_and_bounds_a_nested_rows_bytes(sizes, offset, limit):
    rows = [{"a": i, "s": "x" * (i % 17) if i % 5 else None} for i in range(sum(sizes) + offset)]
    whole = pa.RecordBatch.from_pylist(rows, schema=SCHEMA)
    batches, start = [], offset
    for size in sizes:  # slices with offsets, as decoded and joined batches are
        batches.append(whole.slice(start, size))
        start += size
    previous = nested_output.NESTED_ROW_BYTES
    nested_output.NESTED_ROW_BYTES = limit
    try:
        out = list(nest(iter(batches), 3, "t", "rows"))
    finally:
        nested_output.NESTED_ROW_BYTES = previous
    cells = nested_cells(out)
    assert [row for cell in cells for row in cell] == rows[offset:]
    assert all(cell for cell in cells)  # no empty nested row
    assert all(batch.column(0).to_pylist() == [3] * batch.num_rows for batch in out)
    if limit == 1 << 30:  # one nested row per batch with rows
        assert len(cells) == sum(1 for size in sizes if size)
    else:
        for cell in cells:
            assert pa.RecordBatch.from_pylist(cell, schema=SCHEMA).nbytes <= 2 * limit + 64


@pytest.mark.spark
def test_the_retryable_output_shuffles_one_nested_row_per_output_batch(spark):
    df = spark_rows(spark, 5000, 2)
    ex = scs.exchange(df, scs.key_by("k"), mode="pipelined")
    plan = ex.df._jdf.queryExecution().executedPlan().toString()
    assert "inline(" in plan and plan.count("Exchange") == 1 and plan.count("MapInArrow") == 1
    got = ex.df.withColumn("_subtask", F.spark_partition_id())
    assert_df_equality(got.drop("_subtask"), df, ignore_row_order=True)
    keys = sorted({(r["k"], r["_subtask"]) for r in got.collect()})
    assert [s for _, s in keys] == scs.key_group_channels(pa.array([k for k, _ in keys], pa.int32()), 2, 128).tolist()
    assert ex.df.schema == df.schema  # names, types and nullability as they came in
    assert ex.df.limit(7).count() == 7  # a job over some partitions only: the shuffle's reader
