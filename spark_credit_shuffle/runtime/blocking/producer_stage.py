"""A blocking producer subtask: its rows through the RecordWriter into a blocking result partition, whose
finished buffers are stored, as they complete, in Spark's shuffle."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import pyarrow as pa

from ...buffers.compression import STORED_COMPRESSED_FLAG, BufferCompressor
from ...buffers.format import CheckpointBarrier
from ...buffers.pools import NetworkBufferPool
from ...buffers.sizing import PartitionType
from ...engine import ProducerEngine, Settings
from ...metrics import PRODUCER, MetricRow, executor_row, rows_to_bytes
from ...protocol.blocking_partition import BlockingResultPartition, StoredBuffer
from ...protocol.partition import partition_buffer_pool
from ..chain import apply_chain
from ..monitor import task_monitor, watch
from .input import timed_batches
from .storage import METRICS_TYPE, STORAGE_BATCH_BYTES, storage_batch

if TYPE_CHECKING:
    from ..exchange_plan import ExchangePlan

__all__ = ["produce_partition"]


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
        # the wait for the next input batch is idle time; a chained operator's work is busy time
        inputs = timed_batches(batches, engine.time)
        for batch in apply_chain(plan.before, inputs) if plan.before else inputs:
            if batch.num_rows:
                engine.write(batch)
                engine.sample_output()
                now = time.monotonic()
                if timeline.due(now):
                    sample(now)
            if len(data) >= STORAGE_BATCH_BYTES:
                yield storage_batch(out, data)
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
        metrics = rows_to_bytes(metric_rows)
        data.extend(metrics)
        out.append((consumers[0], producer, -1, METRICS_TYPE, len(metrics)))
        yield storage_batch(out, data)
        partition.release()
    finally:
        if monitor is not None:
            monitor.close()
