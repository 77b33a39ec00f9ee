"""The pipelined exchange's retryable output: the consumers' rows placed on their partitions as nested rows.

Spark re-runs a barrier stage after a failure only if it feeds a shuffle (see :mod:`.pipelined`), so the
retryable form places the consumers' output with one identity shuffle. Spark's shuffle costs per row
(serialise, sort by partition, compress, read back), so the consumer tasks hand Spark few, large rows:
one per output batch of at most :data:`NESTED_ROW_BYTES`, holding the task's index and the batch's rows.
Spark converts them from Arrow as it converts any column, its shuffle moves each as one record, and the
JVM turns them back into rows: no second Python hop.

Two layouts of a nested row (:func:`columnar_layout` chooses):

- columnar (the default): one array per column, ``array<long>``, ``array<string>``, ...; ``posexplode``
  of one column and the element at that position of the others give the rows back. Spark stores an array
  of longs as 8 bytes per element where a struct element costs a row of its own (a null bitmap and 8 bytes
  per field): for (long, int, 20-character string) 44 bytes per row against 64 before compression;
- rows: one ``array<struct<...>>``, turned back by ``inline``. Kept where the columnar layout could not
  give the input's nullability back: Spark marks the element at a position nullable unless its ANSI mode
  is on (``spark.sql.ansi.enabled``, the default of Spark 4), so with ANSI off and more than one
  non-nullable column the rows layout is used (the column that is exploded keeps its nullability either
  way); and for a schema without columns.

Measured on 10 M rows of (long, int, 20-character string), 4 partitions, ``local[4]``, medians of 3 in one
run: an identity ``mapInArrow`` followed by an identity shuffle of its rows 5.43 s, of nested rows (rows
layout) then ``inline`` 4.85 s; Arrow IPC streams in binary cells, shuffled and decoded by a second
``mapInArrow``, 5.42 s (the second Python hop costs what the smaller shuffle saves). The columnar layout
against the rows layout in the exchange: see docs/benchmarks.md, "Retryable output: columnar nested rows".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["NESTED_ROW_BYTES", "columnar_layout", "nest", "nested_spark_type", "unnest"]

#: At most about this many bytes of values go into one nested row (Spark keeps a row in one piece of memory:
#: large output batches are cut into several rows).
NESTED_ROW_BYTES = 8 << 20
#: The nested row's element field, as Spark names the element of an ``ArrayType`` in Arrow.
_ELEMENT = "element"


def columnar_layout(schema: Any, ansi: bool) -> bool:
    """True if the nested rows of Spark ``schema`` take the columnar layout (one array per column): the
    schema has a column, and the rows come back with its exact nullability (``ansi``: Spark's ANSI mode is
    on, or at most one column is non-nullable: that one is exploded)."""
    fields = list(schema.fields)
    return bool(fields) and (ansi or sum(not f.nullable for f in fields) <= 1)


def _array_name(column: str, i: int) -> str:
    return f"{column}_{i}"


def _exploded(schema: Any) -> int:
    """The column whose array ``posexplode`` turns back into rows: the first non-nullable one (its
    nullability survives the explode), else the first."""
    return next((i for i, f in enumerate(schema.fields) if not f.nullable), 0)


def nested_spark_type(schema: Any, tag: str, column: str, columnar: bool = False) -> Any:
    """The Spark type of the nested rows: ``tag`` (the partition the rows go to) and, columnar, one array
    per column of ``schema`` (``column_0``, ``column_1``, ...), else ``column``, an array of ``schema``'s
    rows."""
    from pyspark.sql.types import ArrayType, IntegerType, StructField, StructType

    tag_field = StructField(tag, IntegerType(), False)
    if columnar:
        return StructType(
            [tag_field]
            + [
                StructField(_array_name(column, i), ArrayType(f.dataType, containsNull=f.nullable), False)
                for i, f in enumerate(schema.fields)
            ]
        )
    return StructType([tag_field, StructField(column, ArrayType(schema, containsNull=False), False)])


def _pieces(batch: pa.RecordBatch) -> tuple[list[int], pa.Array]:
    """Where the nested rows of ``batch`` start, and their offsets: rows of equal counts, each of about
    :data:`NESTED_ROW_BYTES` at most."""
    rows = batch.num_rows
    pieces = max(1, min(rows, -(-batch.nbytes // NESTED_ROW_BYTES)))
    step = -(-rows // pieces)
    starts = list(range(0, rows, step))
    return starts, pa.array([*starts, rows], pa.int32())


def nest(
    batches: Iterator[pa.RecordBatch], partition: int, tag: str, column: str, columnar: bool = False
) -> Iterator[pa.RecordBatch]:
    """``batches`` as nested rows for ``partition`` (see :func:`nested_spark_type`); each batch of more than
    :data:`NESTED_ROW_BYTES` becomes several rows of equal row counts, so that a row stays about that size.
    No values are copied: the arrays are the batch's buffers under new offsets."""
    schema: pa.Schema | None = None
    for batch in batches:
        if not batch.num_rows:
            continue
        if schema is None or batch.schema is not schema:
            schema = batch.schema
            tag_field = pa.field(tag, pa.int32(), nullable=False)
            if columnar:
                list_types = [pa.list_(pa.field(_ELEMENT, f.type, nullable=f.nullable)) for f in schema]
                out_schema = pa.schema(
                    [tag_field]
                    + [pa.field(_array_name(column, i), t, nullable=False) for i, t in enumerate(list_types)]
                )
            else:
                element = pa.struct(list(schema))
                list_type = pa.list_(pa.field(_ELEMENT, element, nullable=False))
                out_schema = pa.schema([tag_field, pa.field(column, list_type, nullable=False)])
        starts, offsets = _pieces(batch)
        tags = pa.array([partition] * len(starts), pa.int32())
        if columnar:
            arrays = [
                pa.ListArray.from_arrays(offsets, values, type=t)
                for values, t in zip(batch.columns, list_types, strict=True)
            ]
        else:
            structs = pa.StructArray.from_arrays(batch.columns, fields=list(schema))
            arrays = [pa.ListArray.from_arrays(offsets, structs, type=list_type)]
        yield pa.RecordBatch.from_arrays([tags, *arrays], schema=out_schema)


def unnest(df: DataFrame, column: str, schema: Any = None, columnar: bool = False) -> DataFrame:
    """``df``'s nested rows back as rows of ``schema`` (the Spark schema they were nested from), in the JVM:
    columnar, ``posexplode`` of one column's array and the element at that position of the others;
    else ``inline`` of ``column``."""
    from pyspark.sql import functions as F

    if not columnar:
        return df.select(F.inline(F.col(f"`{column}`")))
    names = [_array_name(column, i) for i in range(len(schema.fields))]
    exploded = _exploded(schema)
    position = f"{column}_position"
    rows = df.select(
        F.posexplode(F.col(f"`{names[exploded]}`")).alias(position, names[exploded]),
        *[F.col(f"`{name}`") for i, name in enumerate(names) if i != exploded],
    )
    at = F.col(f"`{position}`")
    return rows.select(
        *[
            (F.col(f"`{name}`") if i == exploded else F.col(f"`{name}`")[at]).alias(field.name)
            for i, (name, field) in enumerate(zip(names, schema.fields, strict=True))
        ]
    )
