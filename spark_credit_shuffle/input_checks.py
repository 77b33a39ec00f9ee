"""The checks of what a user passes to the exchange and to the partitioners on Spark data: a DataFrame, a
partitioner and its key columns. Each raises a typed error naming the argument before any Spark job starts;
:mod:`.exchange` and :mod:`.dataframe` both call them."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, PartitionerError, UnsupportedInputError, UnsupportedKeyTypeError
from .partitioners import SUPPORTED_KEY_TYPES, CustomPartitionerWrapper, KeyGroupStreamPartitioner, Partitioner
from .partitioners.partitioner import identifier_parts

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

#: The Spark types a key column may have (those whose Java hashCode is reproduced bit-exactly).
_SPARK_KEY_TYPES = (
    "ByteType",
    "ShortType",
    "IntegerType",
    "LongType",
    "BooleanType",
    "FloatType",
    "DoubleType",
    "StringType",
)

__all__ = [
    "check_dataframe",
    "check_partitioner",
    "key_columns_of",
    "plain_names",
    "renamed_keys",
    "resolve_key_columns",
    "short",
]


def check_partitioner(partitioner: object) -> Partitioner:
    if not isinstance(partitioner, Partitioner):
        raise ConfigError(
            "partitioner",
            partitioner,
            "a Partitioner such as key_by('k'), rebalance(), rescale(), shuffle(), broadcast(), forward(), "
            "global_() or custom(fn, 'k')",
            kind="argument",
        )
    return partitioner


def key_columns_of(partitioner: Partitioner) -> tuple[Any, ...]:
    if isinstance(partitioner, (KeyGroupStreamPartitioner, CustomPartitionerWrapper)):
        return partitioner.columns
    return ()


def check_dataframe(df: object, setting: str = "df") -> DataFrame:
    """``df`` if it is a PySpark DataFrame (classic or Spark Connect), else a :class:`ConfigError` naming
    ``setting`` and what it got (a pandas DataFrame, None, ...). A streaming DataFrame raises
    :class:`UnsupportedInputError`: an exchange moves a finished set of rows, so a stream is exchanged one
    micro-batch at a time, in ``foreachBatch``."""
    try:
        from pyspark.sql import DataFrame
    except ImportError:
        raise ConfigError(
            setting, short(df), "a pyspark.sql.DataFrame", "pyspark is not installed", kind="argument"
        ) from None
    if isinstance(df, DataFrame):
        if df.isStreaming:
            raise UnsupportedInputError(
                f"{setting} is a streaming DataFrame; an exchange runs on the rows of a batch DataFrame. Exchange "
                f"each micro-batch of the stream in foreachBatch: {setting}.writeStream.foreachBatch(lambda batch, "
                f"batch_id: scs.exchange(batch, partitioner, ...).df.write.mode('append').parquet(path)).start()"
            )
        return df
    detail = ""
    if type(df).__module__.split(".")[0] in ("pandas", "pyarrow", "polars"):
        detail = "make it a Spark DataFrame first: spark.createDataFrame(data)"
    elif df is not None and hasattr(df, "mapPartitions"):
        detail = (
            "this is an RDD: exchange it with exchange_rdd(rdd, partitioner, ...) (rdd_with_channel for with_channel)"
        )
    raise ConfigError(setting, short(df), "a pyspark.sql.DataFrame (classic or Spark Connect)", detail, kind="argument")


def short(value: object) -> object:
    """``value`` if its repr is short, else its type (a pandas DataFrame's repr is its whole table)."""
    text = repr(value)
    return value if len(text) <= 80 and "\n" not in text else type(value)


def resolve_key_columns(df: DataFrame, partitioner: Partitioner) -> Partitioner:
    """``partitioner`` with its key columns checked against ``df``'s schema, on the driver, before any job.

    A key column is a top-level column: by name (exactly as in ``df.columns``, or as one backticked
    identifier) or by position (``-n <= i < n``). A missing column or a position out of range raises
    :class:`PartitionerError`, a nested field (``"a.b"`` of a struct ``a``) too, saying to add it as a column
    first; for ``key_by`` a Spark type that has no bit-exact Java hashCode here (binary, decimal, date,
    timestamp, nested types, ...) raises :class:`UnsupportedKeyTypeError` naming the column and its type.
    Returns the partitioner with every key named as the DataFrame names it.
    """
    columns = key_columns_of(partitioner)
    if not columns:
        return partitioner
    fields = df.schema.fields
    names = [f.name for f in fields]
    resolved: list[Any] = []
    for column in columns:
        if isinstance(column, int):
            if not -len(names) <= column < len(names):
                raise PartitionerError(
                    f"key position {column} is out of range: the DataFrame has {len(names)} columns "
                    f"({', '.join(names)}); positions run from {-len(names)} to {len(names) - 1}"
                )
            field = fields[column]
            resolved.append(column)
        else:
            field = _top_level_field(fields, column)
            resolved.append(field.name)
        if isinstance(partitioner, KeyGroupStreamPartitioner) and type(field.dataType).__name__ not in _SPARK_KEY_TYPES:
            raise UnsupportedKeyTypeError(
                f"key column {field.name!r} has Spark type {field.dataType.simpleString()}, which cannot be a "
                f"key (its Java hashCode is not reproduced bit-exactly here; cast it, e.g. to string or long, "
                f"in a column of its own). Accepted key types: {', '.join(_SPARK_KEY_TYPES)} "
                f"(as Arrow: {SUPPORTED_KEY_TYPES})"
            )
    if tuple(resolved) == tuple(columns):
        return partitioner
    return dataclasses.replace(partitioner, columns=tuple(resolved))  # type: ignore[type-var]  # keyed partitioners are dataclasses


def plain_names(names: list[str]) -> list[str]:
    """``names`` with every name that holds a dot or a backtick replaced by a plain one not among them."""
    taken = set(names)
    plain = []
    for i, name in enumerate(names):
        if "." in name or "`" in name:
            candidate = re.sub(r"[.`]", "_", name)
            while candidate in taken:
                candidate = f"{candidate}_{i}"
            taken.add(candidate)
            name = candidate
        plain.append(name)
    return plain


def renamed_keys(partitioner: Partitioner, renamed: dict[str, str]) -> Partitioner:
    columns = getattr(partitioner, "columns", None)
    if not columns:
        return partitioner
    keys = tuple(renamed.get(c, c) if isinstance(c, str) else c for c in columns)
    return dataclasses.replace(partitioner, columns=keys)  # type: ignore[type-var]  # keyed partitioners are dataclasses


def _top_level_field(fields: Sequence[Any], column: str) -> Any:
    by_name = {f.name: f for f in fields}
    if column in by_name:
        return by_name[column]
    parts = identifier_parts(column)
    if len(parts) == 1 and parts[0] in by_name:  # `name`
        return by_name[parts[0]]
    if len(parts) > 1 and parts[0] in by_name:
        raise PartitionerError(
            f"key column {column!r} is a nested field of column {parts[0]!r}: keys are top-level columns; add it "
            f"as a column first, e.g. df.withColumn('{parts[-1]}', F.col('{column}')), and key by that name"
        )
    raise PartitionerError(f"key column {column!r} is not in the DataFrame; its columns are: {', '.join(by_name)}")
