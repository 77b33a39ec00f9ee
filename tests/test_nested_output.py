"""The retryable form's placement: the consumers' rows travel Spark's shuffle as nested rows."""

from __future__ import annotations

import pyarrow as pa
import pytest
from exchange_helpers import spark_rows
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import functions as F
from spark_helpers import assert_same_rows

import spark_credit_shuffle as scs
from spark_credit_shuffle.runtime.pipelined import nested_output
from spark_credit_shuffle.runtime.pipelined.nested_output import columnar_layout, nest

SCHEMA = pa.schema([("a", pa.int64()), ("s", pa.string())])


def nested_cells(batches: list[pa.RecordBatch], columnar: bool = False) -> list[list[dict]]:
    if not columnar:
        return [cell for batch in batches for cell in batch.column(1).to_pylist()]
    cells = []
    for batch in batches:  # one array per column: the rows are the columns' elements side by side
        columns = [batch.column(i).to_pylist() for i in range(1, batch.num_columns)]
        names = SCHEMA.names
        for values in zip(*columns, strict=True):
            cells.append([dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)])
    return cells


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    offset=st.integers(0, 5),
    limit=st.sampled_from([256, 4096, 1 << 30]),
    columnar=st.booleans(),
)
def test_nesting_keeps_every_row_in_order_and_bounds_a_nested_rows_bytes(sizes, offset, limit, columnar):
    rows = [{"a": i, "s": "x" * (i % 17) if i % 5 else None} for i in range(sum(sizes) + offset)]
    whole = pa.RecordBatch.from_pylist(rows, schema=SCHEMA)
    batches, start = [], offset
    for size in sizes:  # slices with offsets, as decoded and joined batches are
        batches.append(whole.slice(start, size))
        start += size
    previous = nested_output.NESTED_ROW_BYTES
    nested_output.NESTED_ROW_BYTES = limit
    try:
        out = list(nest(iter(batches), 3, "t", "rows", columnar))
    finally:
        nested_output.NESTED_ROW_BYTES = previous
    cells = nested_cells(out, columnar)
    if columnar:
        assert out == [] or out[0].schema.names == ["t", "rows_0", "rows_1"]
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
    ansi = spark.conf.get("spark.sql.ansi.enabled") == "true"
    unnest = "posexplode(" if columnar_layout(df.schema, ansi) else "inline("
    assert unnest in plan and plan.count("Exchange") == 1 and plan.count("MapInArrow") == 1
    got = ex.df.withColumn("_subtask", F.spark_partition_id())
    assert_same_rows(got.drop("_subtask"), df)
    keys = sorted({(r["k"], r["_subtask"]) for r in got.collect()})
    assert [s for _, s in keys] == scs.key_group_channels(pa.array([k for k, _ in keys], pa.int32()), 2, 128).tolist()
    assert ex.df.schema == df.schema  # names, types and nullability as they came in
    assert ex.df.limit(7).count() == 7  # a job over some partitions only: the shuffle's reader


@pytest.mark.spark
@pytest.mark.parametrize(
    ("ansi", "non_nullable", "unnest"),
    [("true", 2, "posexplode("), ("false", 2, "inline("), ("false", 1, "posexplode(")],
)
def test_the_nested_layout_gives_back_the_input_schema_and_rows_exactly(spark, ansi, non_nullable, unnest):
    """One array per column unless that would lose a column's nullability (Spark's element at a position is
    nullable outside ANSI mode): then one array of rows. Either way rows, nulls and schema come back exact."""
    previous = spark.conf.get("spark.sql.ansi.enabled")
    spark.conf.set("spark.sql.ansi.enabled", ansi)
    try:
        some = F.col("id") % 5 > 0
        k = F.col("id").cast("int")
        df = spark.range(0, 3000, 1, 2).select(
            (k if non_nullable == 2 else F.when(some, k)).alias("k"),
            F.when(some, F.concat(F.lit("row-"), F.col("id").cast("string"))).alias("s"),
            F.when(F.col("id") % 3 > 0, F.array(F.col("id"), F.lit(None).cast("long"))).alias("xs"),
            F.col("id"),  # non-nullable, and not the first column: the one exploded
        )
        assert sum(not f.nullable for f in df.schema) == non_nullable
        assert columnar_layout(df.schema, ansi == "true") == (unnest == "posexplode(")
        ex = scs.exchange(df, scs.rebalance(), parallelism=2, mode="pipelined")
        assert unnest in ex.df._jdf.queryExecution().executedPlan().toString()
        assert ex.df.schema == df.schema  # names, types and nullability as they came in
        assert_same_rows(ex.df, df)
        assert ex.df.where("s is null").count() == 600  # every null where it was
        assert len(ex.df.take(3)) == 3 and ex.df.limit(7).count() == 7
    finally:
        spark.conf.set("spark.sql.ansi.enabled", previous)


def test_the_columnar_layout_is_chosen_where_it_keeps_nullability():
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    def schema(*nullable: bool) -> StructType:
        return StructType([StructField(f"c{i}", LongType() if i else StringType(), n) for i, n in enumerate(nullable)])

    assert columnar_layout(schema(False, False), ansi=True)
    assert not columnar_layout(schema(False, False), ansi=False)
    assert columnar_layout(schema(True, False, True), ansi=False)  # one non-nullable column: exploded
    assert columnar_layout(schema(True, True), ansi=False)
    assert not columnar_layout(StructType([]), ansi=True)  # no column to explode
