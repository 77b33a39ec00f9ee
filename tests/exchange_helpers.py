"""An exchange's plan, input, expected placement and metric rows, shared by the tests of both runtimes: the
plan ``exchange()`` would build without a SparkSession, a blocking exchange run in process, and the rows a
pipelined test feeds its producers or builds as a DataFrame."""

from __future__ import annotations

import collections

import numpy as np
import pyarrow as pa
from pyspark.sql import functions as F

from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.runtime.blocking import STORAGE_SCHEMA, produce_partition
from spark_credit_shuffle.runtime.blocking.consumer_stage import consume_partition
from spark_credit_shuffle.runtime.exchange_plan import ExchangePlan
from spark_credit_shuffle.runtime.metrics_report import METRICS_COLUMN

#: The rows of every test exchange here: an id, a key, a string.
SCHEMA = pa.schema([("id", pa.int64()), ("k", pa.int32()), ("s", pa.string())])

#: Network settings that keep an in-process exchange's buffers small and its timeouts short.
FAST = {"segment_size": 4096, "partition_request_timeout_ms": 5000}


def make_plan(partitioner, producers, consumers, injection=None, **settings) -> ExchangePlan:
    """The plan exchange() would build, without a SparkSession."""
    config = NetworkConfig(**{**FAST, **settings})
    resolve = getattr(partitioner, "resolve_max_parallelism", None)  # key_by's own max parallelism wins
    max_parallelism = (
        resolve(consumers, config.max_parallelism) if resolve else config.resolve_max_parallelism(consumers)
    )
    return ExchangePlan(
        name="test-pipelined",
        mode="pipelined",
        partitioner=partitioner,
        num_producers=producers,
        num_consumers=consumers,
        max_parallelism=max_parallelism,
        config=config,
        schema=SCHEMA,
        injection=injection,
    )


def inputs(producers: int, rows: int, batch_rows: int = 500, seed: int = 0) -> list[list[pa.RecordBatch]]:
    """``rows`` rows per producer, ids unique across producers, keys 0..40, some null strings."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(producers):
        ids = np.arange(p * rows, (p + 1) * rows, dtype=np.int64)
        keys = rng.integers(0, 41, rows).astype(np.int32)
        words = pa.array([None if i % 7 == 0 else f"v{i:012d}" for i in ids], pa.string())
        batch = pa.RecordBatch.from_arrays([pa.array(ids), pa.array(keys), words], schema=SCHEMA)
        out.append([batch.slice(i, batch_rows) for i in range(0, rows, batch_rows)])
    return out


def table(batches) -> pa.Table:
    """Record batches of :data:`SCHEMA` as one table."""
    return pa.Table.from_batches(list(batches), schema=SCHEMA)


def expected_placement(plan, data) -> list[pa.Table]:
    """What each consumer must receive: each producer's rows routed by a fresh copy of its selector."""
    per_consumer = [[] for _ in range(plan.num_consumers)]
    for p, batches in enumerate(data):
        consumers = plan.partitioner.consumers_of(p, plan.num_producers, plan.num_consumers)
        selector = plan.partitioner.selector(p, plan.num_producers, plan.num_consumers, plan.max_parallelism)
        for batch in batches:
            if selector.is_broadcast:
                for c in consumers:
                    per_consumer[c].append(batch)
                continue
            channels = np.asarray(selector.select_channels(batch))
            for sp, c in enumerate(consumers):
                per_consumer[c].append(batch.filter(pa.array(channels == sp)))
    return [table(b).sort_by("id") for b in per_consumer]


def metric(rows, side=None, name=None, stat=None):
    """The metric rows of ``side``, ``name`` and ``stat`` (None: any)."""
    return [
        r
        for r in rows
        if (side is None or r.side == side) and (name is None or r.metric == name) and (stat is None or r.stat == stat)
    ]


def producer_batches(producer: int, rows: int, big_every: int) -> list[pa.RecordBatch]:
    """Producer ``producer``'s ``rows`` rows in two batches: ids unique across producers, keys 0..12, some null
    strings and, every ``big_every``-th row (0: none), one of 40,000 characters."""
    ids = list(range(producer * 100_000, producer * 100_000 + rows))
    strings = [("x" * 40_000 if big_every and i % big_every == 0 else f"v{i}") if i % 7 else None for i in ids]
    batch = pa.RecordBatch.from_pydict({"id": ids, "k": [i % 13 for i in ids], "s": strings}, schema=SCHEMA)
    half = rows // 2
    return [batch.slice(0, half), batch.slice(half)]


def run_blocking(plan: ExchangePlan, inputs: dict[int, list[pa.RecordBatch]]):
    """A blocking exchange in process: every producer's stored rows shuffled by channel as Spark would, then
    replayed by every consumer; each consumer's (rows, metric rows)."""
    shuffled: dict[int, list[pa.RecordBatch]] = collections.defaultdict(list)
    for producer in range(plan.num_producers):
        for stored in produce_partition(iter(inputs[producer]), producer, plan):
            assert stored.schema == STORAGE_SCHEMA
            channels = stored.column("channel").to_pylist()
            for channel in set(channels):
                mask = pa.array([c == channel for c in channels])
                shuffled[channel].append(stored.filter(mask))
    outputs = {}
    for consumer in range(plan.num_consumers):
        batches = list(consume_partition(iter(shuffled[consumer]), consumer, plan))
        table = pa.Table.from_batches(batches)
        metrics_cells = [c for c in table.column(METRICS_COLUMN).to_pylist() if c is not None]
        data = table.filter(pa.compute.is_null(table.column(METRICS_COLUMN))).drop_columns([METRICS_COLUMN])
        outputs[consumer] = (data, [row for cell in metrics_cells for row in cell])
    return outputs


def spark_rows(spark, n, partitions):
    """``n`` rows of :data:`SCHEMA` on ``partitions`` partitions of ``spark``: ids, keys 0..22, strings."""
    return spark.range(0, n, 1, partitions).select(
        F.col("id"),
        (F.col("id") % 23).cast("int").alias("k"),
        F.concat(F.lit("row-"), F.col("id").cast("string")).alias("s"),
    )
