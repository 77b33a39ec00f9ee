"""What both runtimes share: the consumer's output with its metrics cell, and the Spark wrapping.

A consumer task yields the rows it received (the input schema) plus one hidden column that is
null on every data row; its last output row carries, in that column, the metrics of the task
(and of the producers whose metrics reached it). ``finish_plan`` collects those cells with an
``Observation`` (Spark counts the successful attempt of each task once, and it works on Spark
Connect) and filters the metrics rows out again, so the user sees exactly the input schema.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pyarrow as pa

from ..metrics import METRIC_ROW_TYPE, MetricRow, rows_to_arrow

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Observation

    from ..exchange import ExchangePlan

__all__ = ["METRICS_COLUMN", "finish_plan", "metrics_batch", "output_struct_type", "with_metrics_column"]

#: The hidden column that carries metrics out of consumer tasks.
METRICS_COLUMN = "__credit_shuffle_metrics"
_METRICS_TYPE = pa.list_(METRIC_ROW_TYPE)


def output_struct_type(df: DataFrame):
    """Spark type of a consumer stage's output: the input's columns plus the metrics column."""
    from pyspark.sql.types import ArrayType, DoubleType, IntegerType, StringType, StructField, StructType

    if METRICS_COLUMN in df.columns:
        raise ValueError(f"the input already has a column named {METRICS_COLUMN}")
    row = StructType(
        [
            StructField("side", StringType()),
            StructField("subtask", IntegerType()),
            StructField("channel", IntegerType()),
            StructField("metric", StringType()),
            StructField("stat", StringType()),
            StructField("value", DoubleType()),
            StructField("time_ms", DoubleType()),  # timeline samples only; null on summary rows
        ]
    )
    metrics_type = ArrayType(row)
    return StructType([*df.schema.fields, StructField(METRICS_COLUMN, metrics_type, True)])


def output_schema(schema: pa.Schema) -> pa.Schema:
    return schema.append(pa.field(METRICS_COLUMN, _METRICS_TYPE))


def with_metrics_column(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A data batch with a null metrics cell on every row."""
    return pa.RecordBatch.from_arrays(
        [*batch.columns, pa.nulls(batch.num_rows, _METRICS_TYPE)],
        schema=output_schema(batch.schema),
    )


def _zero(t: pa.DataType) -> object:
    """A value of type ``t`` for a column that may not be null (the metrics row's filler)."""
    if pa.types.is_struct(t):
        return {f.name: None if f.nullable else _zero(f.type) for f in t}
    if pa.types.is_fixed_size_list(t):
        return [_zero(t.value_type)] * t.list_size
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        return []
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return ""
    if pa.types.is_fixed_size_binary(t):
        return bytes(t.byte_width)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return b""
    if pa.types.is_boolean(t):
        return False
    if pa.types.is_decimal(t):
        import decimal

        return decimal.Decimal(0)
    if pa.types.is_floating(t):
        return 0.0
    return 0  # integers, dates, times, timestamps, durations


def metrics_batch(schema: pa.Schema, rows: Iterable[MetricRow]) -> pa.RecordBatch:
    """One row whose data columns are null (or zero where the column may not be null) and whose
    metrics cell holds ``rows``; the row is filtered out before the user sees the data."""
    arrays = [pa.nulls(1, f.type) if f.nullable else pa.array([_zero(f.type)], f.type) for f in schema]
    arrays.append(rows_to_arrow([list(rows)]))
    return pa.RecordBatch.from_arrays(arrays, schema=output_schema(schema))


def finish_plan(plan: ExchangePlan, consumed: DataFrame) -> tuple[DataFrame, Observation]:
    """Observe the metrics cells of ``consumed`` and drop them: (user-facing DataFrame, Observation)."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    observation = Observation(plan.name)
    observed = consumed.observe(observation, F.collect_list(METRICS_COLUMN).alias("metrics"))
    out = observed.where(F.col(METRICS_COLUMN).isNull()).drop(METRICS_COLUMN)
    return out, observation
