"""A blocking consumer subtask: stored buffers in, through the credit protocol, rows out.

The buffers of each producer arrive from Spark's shuffle in the order they were stored. Each
producer's buffers are queued in a subpartition on the sending side of an in-process connection
(the storage plays the producer, as Flink's blocking subpartition reader does), and reach the
input gate only as BufferResponses that a credit allowed: the gate's exclusive and floating
buffers bound what is held on the receiving side, backlog and AddCredit flow as on the wire.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pyarrow as pa

from ..buffers import DataType
from ..buffers.reader import RecordReader
from ..errors import ProtocolError
from ..metrics import CONSUMER, MetricRow, RateMeter, TaskMetrics, TimelineSampler
from ..protocol.pools import NetworkBufferPool
from ..transport.memory import StoredBuffersExchange
from .common import metrics_batch, with_metrics_column

if TYPE_CHECKING:
    from ..exchange import ExchangePlan

__all__ = ["consume_partition"]

#: Output batches are combined up to about this many bytes before they go back to Spark.
_OUTPUT_BATCH_BYTES = 4 << 20
_METRICS_TYPE = -1


def consume_partition(
    batches: Iterator[pa.RecordBatch],
    consumer: int,
    plan: ExchangePlan,
    network: NetworkBufferPool | None = None,
) -> Iterator[pa.RecordBatch]:
    """Consumer subtask ``consumer``: stored buffers in (STORAGE_SCHEMA), its received rows out.

    ``network`` is the executor's network buffer pool the gate's buffers are taken from (default: a
    fresh one of ``plan.config``'s network memory; pass one to inspect what the task reserves).
    """
    injection = plan.injection
    if injection is not None:
        injection.maybe_fail(CONSUMER, consumer)
    delay = injection.delay_of(consumer) if injection is not None else 0.0
    config = plan.config
    producers = plan.partitioner.producers_of(consumer, plan.num_producers, plan.num_consumers)

    replay = StoredBuffersExchange(config, len(producers), network_pool=network)
    gate = replay.gate
    channel_of = {p: i for i, p in enumerate(producers)}
    readers = [RecordReader(plan.schema, channel=p) for p in producers]

    metrics = TaskMetrics(CONSUMER, consumer)
    producer_metrics: list[MetricRow] = []
    pending: list[pa.RecordBatch] = []
    pending_bytes = 0
    started = time.perf_counter()
    timeline = TimelineSampler(CONSUMER, consumer, config.metrics_sample_interval_ms)
    records_in = RateMeter()

    def gauges() -> Iterator[tuple[str, int | None, float]]:
        yield "inPoolUsage", None, gate.in_pool_usage
        yield "inputExclusiveBuffersUsage", None, gate.input_exclusive_buffers_usage
        yield "inputFloatingBuffersUsage", None, gate.input_floating_buffers_usage
        yield "numRecordsInPerSecond", None, records_in.rate(sum(r.num_records_in for r in readers))
        for index, (channel, p) in enumerate(zip(gate.channels, producers)):
            yield "credit", p, float(replay.sender_credit(index))
            yield "unannouncedCredit", p, float(channel.unannounced_credit)  # type: ignore[union-attr]
            yield "backlog", p, float(max(0, channel.sender_backlog))  # type: ignore[union-attr]
            yield "inputQueueLength", p, float(channel.queue_length())  # type: ignore[union-attr]

    timeline.record(gauges)

    def pump() -> Iterator[pa.RecordBatch]:
        nonlocal pending_bytes
        while True:
            polled = 0
            while (item := replay.poll()) is not None:
                polled += 1
                metrics.sample("inPoolUsage", gate.in_pool_usage)
                metrics.sample("inputExclusiveBuffersUsage", gate.input_exclusive_buffers_usage)
                metrics.sample("inputFloatingBuffersUsage", gate.input_floating_buffers_usage)
                if timeline.due():
                    timeline.record(gauges)
                for out in readers[item.channel_index].feed(item.buffer, item.sequence_number):
                    if isinstance(out, pa.RecordBatch) and out.num_rows:
                        if delay:
                            time.sleep(delay * out.num_rows)
                        pending.append(out)
                        pending_bytes += out.nbytes
                if pending_bytes >= _OUTPUT_BATCH_BYTES:
                    yield _combine(pending)
                    pending.clear()
                    pending_bytes = 0
            if not polled:
                return

    try:
        for batch in batches:
            columns = batch.to_pydict() if batch.num_rows else None
            if columns is None:
                continue
            for producer, data_type, payload in zip(columns["producer"], columns["data_type"], columns["payload"]):
                if data_type == _METRICS_TYPE:
                    producer_metrics.extend(MetricRow(**row) for row in json.loads(payload))
                    continue
                channel = channel_of.get(producer)
                if channel is None:
                    raise ProtocolError(f"consumer {consumer} got a buffer from producer {producer}, not an input")
                replay.add(channel, DataType(data_type), payload)
            yield from pump()
        yield from pump()
        timeline.record(gauges)
        if not gate.is_finished:
            missing = [producers[i] for i, r in enumerate(readers) if not r.is_finished]
            raise ProtocolError(
                f"consumer {consumer}: no end of partition from producers {missing}; their output is incomplete"
            )
        if pending:
            yield _combine(pending)
    finally:
        replay.close()

    for i, p in enumerate(producers):
        reader = readers[i]
        metrics.count("numRecordsIn", reader.num_records_in, p)
        metrics.count("numBytesIn", reader.num_bytes_in, p)
        metrics.count("numBuffersIn", reader.num_buffers_in, p)
    metrics.set("accumulateBusyTimeMs", (time.perf_counter() - started) * 1000.0)
    yield metrics_batch(plan.schema, [*producer_metrics, *metrics.rows(), *timeline.timeline_rows()])


def _combine(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    if len(batches) == 1:
        return with_metrics_column(batches[0])
    table = pa.Table.from_batches(batches).combine_chunks()
    return with_metrics_column(table.to_batches()[0])
