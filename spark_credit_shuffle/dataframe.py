"""Partitioners on Spark data: which consumer subtask Flink would send each row to.

- :func:`with_channel` adds the consumer subtask index of every row of a DataFrame as an int column. The
  producer subtask of a row is the Spark partition it is in. It runs as ``mapInArrow`` (whole Arrow batches,
  vectorised) and uses no ``SparkContext``, so it works on Spark Connect too.
- :func:`rdd_with_channel` pairs every element of an RDD with its consumer subtask: ``(channel, element)``.

Both check everything that can be known up front (key columns and their types, parallelism against max
parallelism, forward between unequal parallelisms) and raise a typed error before any Spark job starts.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from .config import NetworkConfig, check_count
from .errors import ConfigError, PartitionerError, UnsupportedInputError, UnsupportedKeyTypeError
from .partitioners import SUPPORTED_KEY_TYPES, CustomPartitionerWrapper, KeyGroupStreamPartitioner, Partitioner
from .partitioners.partitioner import identifier_parts
from .runtime.session import check_worker_python, num_partitions, task_partition_id

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import DataFrame

__all__ = ["check_dataframe", "rdd_with_channel", "resolve_key_columns", "with_channel"]

_MAX_PARALLELISM_KEY = NetworkConfig.conf_key("max_parallelism")
# Elements of an RDD partition are turned into Arrow key columns this many at a time.
_RDD_BATCH = 1 << 16
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


def _check_partitioner(partitioner: object) -> Partitioner:
    if not isinstance(partitioner, Partitioner):
        raise ConfigError(
            "partitioner",
            partitioner,
            "a Partitioner such as key_by('k'), rebalance(), rescale(), shuffle(), broadcast(), forward(), "
            "global_() or custom(fn, 'k')",
            kind="argument",
        )
    return partitioner


def _key_columns_of(partitioner: Partitioner) -> tuple[Any, ...]:
    if isinstance(partitioner, (KeyGroupStreamPartitioner, CustomPartitionerWrapper)):
        return partitioner.columns
    return ()


def _conf_max_parallelism(conf_value: str | None, max_parallelism: int | None) -> int | None:
    """``max_parallelism`` if given, else the ``spark.creditShuffle.maxParallelism`` value (checked)."""
    if max_parallelism is not None:
        return NetworkConfig(max_parallelism=max_parallelism).max_parallelism
    if conf_value is None:
        return None
    return NetworkConfig.from_conf({_MAX_PARALLELISM_KEY: conf_value}).max_parallelism


def _resolve_counts(
    partitioner: Partitioner, num_producers: int | None, parallelism: int | None, max_parallelism: int | None
) -> tuple[int | None, int]:
    """Check the exchange before launch; returns (num_producers or None if not needed, num_consumers)."""
    if parallelism is None:
        if num_producers is None:
            raise PartitionerError("the consumer parallelism is unknown: pass parallelism (or num_producers)")
        parallelism = num_producers
    if num_producers is None and partitioner.is_pointwise:
        raise PartitionerError(
            f"{partitioner.name} wires producers to consumers pointwise, so it needs the number of producers: "
            "pass num_producers (the DataFrame's partition count; pin it with repartition(n))"
        )
    # all-to-all edges do not depend on the producer count; 1 stands in for it in the checks
    partitioner.validate(num_producers or 1, parallelism)
    if isinstance(partitioner, KeyGroupStreamPartitioner):
        partitioner.resolve_max_parallelism(parallelism, max_parallelism)
    return num_producers, parallelism


def _channel_plan(
    partitioner: Partitioner, producer: int, num_producers: int | None, parallelism: int, max_parallelism: int | None
) -> tuple[np.ndarray, Any]:
    """Consumer of each subpartition and the selector, for one producer (run inside the task)."""
    if num_producers is not None and producer >= num_producers:
        raise PartitionerError(
            f"this data has a partition {producer}, but num_producers is {num_producers}: "
            "pass the DataFrame's real partition count (pin it with repartition(n))"
        )
    producers = num_producers if num_producers is not None else producer + 1
    consumers = np.asarray(partitioner.consumers_of(producer, producers, parallelism), dtype=np.int32)
    selector = partitioner.selector(producer, producers, parallelism, max_parallelism)
    return consumers, selector


def check_dataframe(df: object, setting: str = "df") -> DataFrame:
    """``df`` if it is a PySpark DataFrame (classic or Spark Connect), else a :class:`ConfigError` naming
    ``setting`` and what it got (a pandas DataFrame, None, ...). A streaming DataFrame raises
    :class:`UnsupportedInputError`: an exchange moves a finished set of rows, so a stream is exchanged one
    micro-batch at a time, in ``foreachBatch``."""
    try:
        from pyspark.sql import DataFrame
    except ImportError:
        raise ConfigError(
            setting, _short(df), "a pyspark.sql.DataFrame", "pyspark is not installed", kind="argument"
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
    raise ConfigError(
        setting, _short(df), "a pyspark.sql.DataFrame (classic or Spark Connect)", detail, kind="argument"
    )


def _short(value: object) -> object:
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
    columns = _key_columns_of(partitioner)
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


def _plain_names(names: list[str]) -> list[str]:
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


def _renamed_keys(partitioner: Partitioner, renamed: dict[str, str]) -> Partitioner:
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


def with_channel(
    df: DataFrame,
    partitioner: Partitioner,
    parallelism: int | None = None,
    column: str = "channel",
    max_parallelism: int | None = None,
    num_producers: int | None = None,
) -> DataFrame:
    """``df`` with an int column ``column``: the consumer subtask (in ``[0, parallelism)``) of every row.

    Producer subtask i is the rows of Spark partition i (``spark_partition_id()``), with its own selector
    state, as in Flink. ``parallelism`` is the number of consumers; by default the number of producers.
    Broadcast yields every row once per consumer. For key_by, the max parallelism is the partitioner's own,
    else ``max_parallelism``, else ``spark.creditShuffle.maxParallelism``, else Flink's default.

    The producer count is needed for pointwise partitioners (rescale, forward) and when ``parallelism`` is
    not given; pass ``num_producers`` to state it. Otherwise it is read from the DataFrame: from its plan on
    a classic session (with adaptive query execution Spark may then run the stages that produce ``df``),
    with one small Spark job on Spark Connect (see :func:`~spark_credit_shuffle.runtime.session.num_partitions`).
    """
    from pyspark.sql.types import IntegerType, StructField, StructType

    df = check_dataframe(df)
    partitioner = _check_partitioner(partitioner)
    if not isinstance(column, str) or not column:
        raise ConfigError("column", column, "a non-empty column name", kind="argument")
    if column in df.columns:
        raise ConfigError(
            "column", column, f"a name that is not already a column (the columns are {df.columns})", kind="argument"
        )
    partitioner = resolve_key_columns(df, partitioner)
    check_worker_python(df.sparkSession)  # local masters: the Python the workers start imports this package
    names = df.columns
    plain = _plain_names([*names, column])[:-1]  # none of them the channel column's name
    if plain != names:  # PySpark hands mapInArrow its input as df[name], which reads "a.b" as a nested field
        renamed = _renamed_keys(partitioner, dict(zip(names, plain)))
        out = with_channel(df.toDF(*plain), renamed, parallelism, column, max_parallelism, num_producers)
        return out.toDF(*names, column)
    max_p = _conf_max_parallelism(df.sparkSession.conf.get(_MAX_PARALLELISM_KEY, None), max_parallelism)
    if num_producers is None and (parallelism is None or partitioner.is_pointwise):
        num_producers = num_partitions(df)
        if num_producers == 0:  # no rows to label: check the rest as if producers matched the consumers
            num_producers = 1 if parallelism is None else check_count(parallelism, "parallelism")
    producers, consumers = _resolve_counts(partitioner, num_producers, parallelism, max_p)
    schema = StructType([*df.schema.fields, StructField(column, IntegerType(), nullable=False)])
    field = pa.field(column, pa.int32(), nullable=False)

    def add_channels(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        producer = task_partition_id()
        subpartition_consumers, selector = _channel_plan(partitioner, producer, producers, consumers, max_p)
        for batch in batches:
            if partitioner.is_broadcast:
                for consumer in subpartition_consumers:  # the same columns, once per consumer
                    yield batch.append_column(field, pa.array(np.full(batch.num_rows, consumer, dtype=np.int32)))
            else:
                channels = subpartition_consumers[selector.select_channels(batch)]
                yield batch.append_column(field, pa.array(channels, type=pa.int32()))

    return df.mapInArrow(add_channels, schema)


def _getter(column: Any) -> Callable[[Any], Any]:
    item = operator.itemgetter(column)

    def get(element: Any) -> Any:
        try:
            return item(element)
        except (TypeError, KeyError, IndexError, ValueError):
            if isinstance(column, str) and hasattr(element, column):
                return getattr(element, column)
            raise PartitionerError(
                f"key column {column!r} is not in the element {element!r} (elements are Rows, dicts, or tuples "
                "keyed by position)"
            ) from None

    return get


def rdd_with_channel(
    rdd: RDD[Any],
    partitioner: Partitioner,
    parallelism: int | None = None,
    max_parallelism: int | None = None,
    key_types: pa.DataType | Sequence[pa.DataType] | None = None,
) -> RDD[tuple[int, Any]]:
    """An RDD of ``(channel, element)``: each element with its consumer subtask, producer = its partition.

    Elements are Rows, dicts or tuples; key columns name fields (or positions for tuples). Each partition is
    processed in Arrow batches: only the key values are gathered per element, the selection is vectorised.
    Key types are inferred as Arrow does (a Python int is an int64, so Java Long, like Spark's LongType); pass
    ``key_types`` (one Arrow type per key column) to hash as another Java type, e.g. ``pa.int32()`` for
    Integer. Broadcast pairs every element with every consumer.
    """
    partitioner = _check_partitioner(partitioner)
    if not hasattr(rdd, "mapPartitionsWithIndex"):
        raise ConfigError("rdd", _short(rdd), "a pyspark RDD (for a DataFrame use with_channel)", kind="argument")
    columns = _key_columns_of(partitioner)
    if key_types is not None:
        key_types = [key_types] if isinstance(key_types, pa.DataType) else list(key_types)
        if len(key_types) != len(columns) or not all(isinstance(t, pa.DataType) for t in key_types):
            raise ConfigError(
                "key_types", key_types, f"{len(columns)} pyarrow types, one per key column", kind="argument"
            )
    num_producers = rdd.getNumPartitions()
    conf_value = None
    try:
        from pyspark.sql import SparkSession

        session = SparkSession.getActiveSession()
        conf_value = session.conf.get(_MAX_PARALLELISM_KEY, None) if session is not None else None
    except ImportError:  # pragma: no cover - pyspark is there whenever an RDD is
        pass
    max_p = _conf_max_parallelism(conf_value, max_parallelism)
    producers, consumers = _resolve_counts(partitioner, num_producers, parallelism, max_p)
    names = tuple(str(c) for c in columns)
    # the selector reads the key batch built below, whose columns are named str(column)
    by_name = dataclasses.replace(partitioner, columns=names) if columns else partitioner  # type: ignore[type-var]  # keyed partitioners are dataclasses
    getters = [_getter(c) for c in columns]
    types = key_types or [None] * len(columns)

    def pair(producer: int, elements: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        subpartition_consumers, selector = _channel_plan(by_name, producer, producers, consumers, max_p)
        broadcast_to = subpartition_consumers.tolist()
        iterator = iter(elements)
        while chunk := list(itertools.islice(iterator, _RDD_BATCH)):
            if partitioner.is_broadcast:
                for element in chunk:
                    for consumer in broadcast_to:
                        yield consumer, element
                continue
            if getters:
                arrays = [pa.array([get(e) for e in chunk], type=t) for get, t in zip(getters, types, strict=True)]
                batch = pa.RecordBatch.from_arrays(arrays, names=list(names))
            else:
                batch = pa.record_batch([pa.nulls(len(chunk))], names=["_"])
            channels = subpartition_consumers[selector.select_channels(batch)]
            yield from zip(channels.tolist(), chunk, strict=True)

    return rdd.mapPartitionsWithIndex(pair)
