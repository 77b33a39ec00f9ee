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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from .config import NetworkConfig, check_count
from .errors import ConfigError, PartitionerError
from .input_checks import (
    check_dataframe,
    check_partitioner,
    key_columns_of,
    plain_names,
    renamed_keys,
    resolve_key_columns,
    short,
)
from .partitioners import KeyGroupStreamPartitioner, Partitioner
from .runtime.spark_plans import num_partitions, task_partition_id
from .runtime.worker_python import check_worker_python

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import DataFrame

__all__ = ["check_dataframe", "rdd_with_channel", "resolve_key_columns", "with_channel"]

_MAX_PARALLELISM_KEY = NetworkConfig.conf_key("max_parallelism")
# Elements of an RDD partition are turned into Arrow key columns this many at a time.
_RDD_BATCH = 1 << 16


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
    with one small Spark job on Spark Connect (see :func:`~spark_credit_shuffle.runtime.spark_plans.num_partitions`).
    """
    from pyspark.sql.types import IntegerType, StructField, StructType

    df = check_dataframe(df)
    partitioner = check_partitioner(partitioner)
    if not isinstance(column, str) or not column:
        raise ConfigError("column", column, "a non-empty column name", kind="argument")
    if column in df.columns:
        raise ConfigError(
            "column", column, f"a name that is not already a column (the columns are {df.columns})", kind="argument"
        )
    partitioner = resolve_key_columns(df, partitioner)
    check_worker_python(df.sparkSession)  # local masters: the Python the workers start imports this package
    names = df.columns
    plain = plain_names([*names, column])[:-1]  # none of them the channel column's name
    if plain != names:  # PySpark hands mapInArrow its input as df[name], which reads "a.b" as a nested field
        renamed = renamed_keys(partitioner, dict(zip(names, plain)))
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
    partitioner = check_partitioner(partitioner)
    if not hasattr(rdd, "mapPartitionsWithIndex"):
        raise ConfigError("rdd", short(rdd), "a pyspark RDD (for a DataFrame use with_channel)", kind="argument")
    columns = key_columns_of(partitioner)
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
