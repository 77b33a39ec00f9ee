"""The blocking exchange (Flink's BLOCKING result partitions) as two Spark stages.

Producer stage: each input partition is a producer subtask; ``mapInArrow`` runs its rows through
the RecordWriter into a blocking result partition, whose finished buffers are written, as they
complete, to Spark's shuffle: one row per network buffer (consumer channel, producer, sequence
number, data type, payload), placed by ``repartitionById`` (on pyspark 4.0 its equivalent: see
:func:`~.common.place_by`) so that shuffle partition *i* holds exactly the buffers for consumer
subtask *i*.

Consumer stage: each shuffle partition is a consumer subtask. It replays the stored buffers of
each producer through the credit-based protocol core, in process: a subpartition per producer
channel on the sending side, a remote input channel with exclusive buffers and the gate's floating
pool on the receiving side, credits, backlog and AddCredit as on the wire. A data buffer moves
only into a receiver buffer reserved for it, and the RecordReader turns received buffers back into
rows. The storage order of Spark's shuffle is the only thing that differs from Flink: the whole
result is produced before any consumer starts, which is the point of blocking mode.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import numpy as np
import pyarrow as pa

from ..buffers.compression import STORED_COMPRESSED_FLAG, BufferCompressor
from ..buffers.format import CheckpointBarrier
from ..engine import ProducerEngine, Settings
from ..errors import PartitionerError
from ..metrics import PRODUCER, MetricRow, executor_row
from ..protocol.blocking_partition import BlockingResultPartition, StoredBuffer
from ..protocol.partition import partition_buffer_pool
from ..protocol.pools import NetworkBufferPool
from ..protocol.sizing import PartitionType
from .common import CollectedMetrics, MetricsReport, finish_plan, in_subtask, metrics_report, place_by
from .consumer import consume_partition, timed_batches
from .monitor import task_monitor, watch
from .session import bound_arrow_batches

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from .plan import ExchangePlan

__all__ = ["STORAGE_SCHEMA", "build", "consume_partition", "produce_partition"]

#: One row per stored network buffer.
STORAGE_SCHEMA = pa.schema(
    [
        ("channel", pa.int32()),  # consumer subtask the buffer is for
        ("producer", pa.int32()),  # producer subtask that wrote it
        ("seq", pa.int32()),  # sequence number within (producer, channel)
        ("data_type", pa.int8()),  # DataType ordinal; METRICS_TYPE for the producer's metrics
        ("payload", pa.binary()),
    ]
)
STORAGE_DDL = "channel int, producer int, seq int, data_type tinyint, payload binary"
#: Not a Flink data type: the row that carries a producer's metrics to a consumer of its output.
METRICS_TYPE = -1
#: Stored buffers are handed to Spark in batches of about this many payload bytes (fewer, larger
#: batches than one per input batch; memory stays a few MiB).
_STORAGE_BATCH_BYTES = 4 << 20
#: The consumer stage gets its stored buffers from Spark in Arrow batches of at most this many bytes
#: (see :func:`~.session.bound_arrow_batches`): a 4 MiB bound took its stage from 1.4-1.7 s to about
#: 1.1 s per 10 M rows, against 1.13-1.18 s with 16 MiB, 1.26 s with 32 MiB and 1.14-1.15 s with 1 or 2 MiB.
CONSUMER_INPUT_BATCH_BYTES = 4 << 20
#: A producer's metric rows travel as JSON lists of these fields, in this order.
_METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(MetricRow))


def _storage_batch(rows: list[tuple[int, int, int, int, int]], data: bytearray) -> pa.RecordBatch:
    """The stored buffers ``rows`` (channel, producer, seq, data type, payload length) whose payloads are
    ``data``, one after the other."""
    channel, producer, seq, data_type, lengths = zip(*rows)
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    payload = pa.Array.from_buffers(pa.binary(), len(rows), [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    return pa.RecordBatch.from_arrays(
        [
            pa.array(channel, pa.int32()),
            pa.array(producer, pa.int32()),
            pa.array(seq, pa.int32()),
            pa.array(data_type, pa.int8()),
            payload,
        ],
        schema=STORAGE_SCHEMA,
    )


def produce_partition(
    batches: Iterator[pa.RecordBatch],
    producer: int,
    plan: ExchangePlan,
    network: NetworkBufferPool | None = None,
) -> Iterator[pa.RecordBatch]:
    """Producer subtask ``producer``: its rows in, its stored network buffers out (STORAGE_SCHEMA).

    ``network`` is the executor's network buffer pool the partition's pool is taken from (default: a
    fresh one of ``plan.config``'s network memory; pass one to inspect what the task reserves).
    """
    if plan.injection is not None:
        plan.injection.maybe_fail(PRODUCER, producer)
    num_producers, num_consumers = plan.num_producers, plan.num_consumers
    consumers = plan.partitioner.consumers_of(producer, num_producers, num_consumers)
    selector = plan.partitioner.selector(producer, num_producers, num_consumers, plan.max_parallelism)
    n = len(consumers)
    config = plan.config
    if network is None:
        network = NetworkBufferPool.from_config(config)
    pool = partition_buffer_pool(network, n, config, PartitionType.BLOCKING)
    out: list[tuple[int, int, int, int, int]] = []
    data = bytearray()  # the payloads of ``out``, one after the other
    seqs = [0] * n

    compressor = (
        BufferCompressor(config.compression_codec)
        if config.blocking_shuffle_compression and config.compression_codec != "none"
        else None
    )
    stored_bytes = [0] * n

    def store(subpartition: int, buffer: StoredBuffer) -> None:
        seq = seqs[subpartition]
        seqs[subpartition] = seq + 1
        before = len(data)
        data_type = int(buffer.data_type)
        payload = cast("bytes | memoryview", buffer.payload)
        compressed = compressor.compress(payload) if compressor is not None and buffer.data_type.is_buffer else None
        if compressed is not None:  # a data buffer, smaller compressed (Flink's BufferCompressor)
            payload = compressed
            data_type |= STORED_COMPRESSED_FLAG
        data.extend(payload)  # the segment's bytes, copied once
        stored_bytes[subpartition] += len(data) - before
        out.append((consumers[subpartition], producer, seq, data_type, len(data) - before))

    partition = BlockingResultPartition(n, pool, partition_id=producer, sink=store)
    settings = Settings.of(config, blocking=True)
    engine = ProducerEngine(
        producer, partition, selector, consumers, settings, config.segment_size, plan.schema, time.monotonic()
    )
    timeline = engine.timeline
    monitor = task_monitor(plan.monitor)
    if monitor is not None:
        watch(monitor, engine)

    def sample(now: float) -> None:
        timeline.record(lambda: engine.gauges(now, {}), now, time.time() * 1000.0)

    try:
        sample(time.monotonic())
        for batch in timed_batches(batches, engine.time):  # the wait for the next input batch is idle time
            if batch.num_rows:
                engine.write(batch)
                engine.sample_output()
                now = time.monotonic()
                if timeline.due(now):
                    sample(now)
            if len(data) >= _STORAGE_BATCH_BYTES:
                yield _storage_batch(out, data)
                out = []
                data = bytearray()  # the batch handed to Spark keeps the old one
        barriers_out: list[MetricRow] = []
        if config.checkpoint_interval_ms > 0:  # blocking mode: one barrier at the end of each producer
            engine.writer.broadcast_event(CheckpointBarrier(1, time.time_ns() // 1_000_000, config.checkpoint_options))
            barriers_out.append(MetricRow(PRODUCER, producer, None, "numCheckpointBarriersOut", "total", 1.0))
        engine.finish()
        engine.sample_output()
        sample(time.monotonic())
        engine.time.stop(time.monotonic())
        stored = [
            MetricRow(PRODUCER, producer, c, "numBytesStored", "total", float(b))
            for c, b in zip(consumers, stored_bytes)
        ]
        where = executor_row(PRODUCER, producer, socket.gethostname())
        metric_rows = [*engine.metric_rows(time.monotonic()), *barriers_out, *stored, where, *timeline.timeline_rows()]
        rows = [[getattr(r, f) for f in _METRIC_FIELDS] for r in metric_rows]
        metrics = json.dumps(rows).encode()
        data.extend(metrics)
        out.append((consumers[0], producer, -1, METRICS_TYPE, len(metrics)))
        yield _storage_batch(out, data)
        partition.release()
    finally:
        if monitor is not None:
            monitor.close()


def _partition_id() -> int:
    """The partition of the Spark task running this (only ever called inside one)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        raise RuntimeError("not inside a Spark task")
    return int(ctx.partitionId())


def build(
    plan: ExchangePlan, df: DataFrame, *, report: MetricsReport | None = None
) -> tuple[DataFrame, CollectedMetrics]:
    """The lazy Spark plan of a blocking exchange: (user-facing DataFrame, its metrics after an action).

    ``report``: how consumer tasks report metrics (default: :func:`~.common.metrics_report`'s choice).
    """
    report = (report if report is not None else metrics_report(df.sparkSession)).beside(df.columns)
    bound_arrow_batches(df.sparkSession, CONSUMER_INPUT_BATCH_BYTES)

    def produce(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        producer = _partition_id()
        try:
            yield from produce_partition(batches, producer, plan)
        except PartitionerError as exc:
            raise in_subtask(exc, PRODUCER, producer) from None

    def consume(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield from consume_partition(batches, _partition_id(), plan, report=report)

    label = plan.name.replace("-", "_")
    produce.__name__ = f"credit_shuffle_produce_{label}"
    consume.__name__ = f"credit_shuffle_consume_{label}"
    stored = df.mapInArrow(produce, STORAGE_DDL)
    placed = place_by(stored, plan.num_consumers, "channel")
    consumed = placed.mapInArrow(consume, report.output_type(df))
    return finish_plan(plan, consumed, report)
