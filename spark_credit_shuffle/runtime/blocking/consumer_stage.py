"""A blocking consumer subtask: stored buffers in, through the credit protocol, rows out.

The buffers of each producer arrive from Spark's shuffle in the order they were stored. Each
producer's buffers are queued in a subpartition on the sending side of an in-process connection
(the storage plays the producer, as Flink's blocking subpartition reader does), and reach the
input gate only as BufferResponses that a credit allowed: the gate's exclusive and floating
buffers bound what is held on the receiving side, backlog and AddCredit flow as on the wire.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pyarrow as pa

from ...buffers import DataType
from ...buffers.compression import STORED_COMPRESSED_FLAG, BufferDecompressor
from ...buffers.pools import NetworkBufferPool
from ...buffers.reader import RecordReader
from ...engine import ConsumerEngine, Settings, combine
from ...engine.checkpoints import ConsumerCheckpoints
from ...errors import ProtocolError
from ...metrics import CONSUMER, MetricRow, executor_row, rows_from_bytes
from ...transport.in_memory import StoredBuffersExchange
from ..chain import apply_chain
from ..handoff import handed_on
from ..metrics_report import IN_BAND, MetricsReport
from ..monitor import task_monitor, watch
from .input import timed_batches
from .storage import METRICS_TYPE, stored_buffers

if TYPE_CHECKING:
    from ..exchange_plan import ExchangePlan

__all__ = ["consume_partition"]

#: Output batches are combined up to about this many bytes before they go back to Spark.
_OUTPUT_BATCH_BYTES = 4 << 20


def consume_partition(
    batches: Iterator[pa.RecordBatch],
    consumer: int,
    plan: ExchangePlan,
    network: NetworkBufferPool | None = None,
    report: MetricsReport = IN_BAND,
) -> Iterator[pa.RecordBatch]:
    """Consumer subtask ``consumer``: stored buffers in (STORAGE_SCHEMA), its received rows out.

    ``network`` is the executor's network buffer pool the gate's buffers are taken from (default: a
    fresh one of ``plan.config``'s network memory; pass one to inspect what the task reserves).
    ``report`` carries the task's metrics to the driver (default: in band, as the last output row).
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

    producer_metrics: list[MetricRow] = []
    pending: list[pa.RecordBatch] = []
    pending_bytes = 0
    checkpoints = ConsumerCheckpoints(consumer, producers, time.time_ns) if config.checkpoint_interval_ms > 0 else None
    engine = ConsumerEngine(
        consumer,
        gate,
        readers,
        producers,
        Settings.of(config, blocking=True),
        time.monotonic(),
        checkpoints=checkpoints,
    )
    engine.start(time.monotonic(), time.time_ns())
    sample_gauges = engine.gate_gauges
    assert sample_gauges is not None
    timeline = engine.timeline
    monitor = task_monitor(plan.monitor)
    if monitor is not None:
        watch(monitor, engine)
    sender_credit = replay.sender_credit

    def sample(now: float) -> None:
        timeline.record(lambda: engine.gauges(now, sender_credit), now, time.time() * 1000.0)

    sample(time.monotonic())
    poll = replay.poll
    take = engine.take
    due = timeline.due
    monotonic = time.monotonic

    def pump() -> Iterator[pa.RecordBatch]:
        nonlocal pending_bytes
        while True:
            polled = 0
            while (item := poll()) is not None:
                polled += 1
                sample_gauges()
                now = monotonic()
                if due(now):
                    sample(now)
                batches, resume = take(item, 0)
                for resumed in resume:
                    gate.resume_consumption(resumed)
                for out in batches:
                    if out.num_rows:
                        if delay:
                            time.sleep(delay * out.num_rows)
                        pending.append(out)
                        pending_bytes += out.get_total_buffer_size()  # nbytes costs ~15 µs a call
                if pending_bytes >= _OUTPUT_BATCH_BYTES:
                    yield combine(pending)
                    pending.clear()
                    pending_bytes = 0
            if not polled:
                return

    add = replay.add
    decompressor = BufferDecompressor(
        plan.config.compression_codec if plan.config.compression_codec != "none" else "lz4", plan.config.segment_size
    )
    data_types = {int(t): t for t in DataType}

    def received() -> Iterator[pa.RecordBatch]:
        """The rows the consumer decodes, in output batches."""
        for batch in timed_batches(batches, engine.time):  # the wait for the next stored batch is idle time
            if not batch.num_rows:
                continue
            for producer, data_type, payload in stored_buffers(batch):
                if data_type == METRICS_TYPE:
                    producer_metrics.extend(rows_from_bytes(payload))
                    continue
                if data_type & STORED_COMPRESSED_FLAG:  # compressed by its producer: decompressed here
                    payload = decompressor.decompress(payload)
                    data_type &= ~STORED_COMPRESSED_FLAG
                channel = channel_of.get(producer)
                kind = data_types.get(data_type)
                if channel is None or kind is None:
                    what = f"producer {producer}, not an input" if channel is None else f"data type {data_type}"
                    raise ProtocolError(f"consumer {consumer} got a stored buffer from {what}")
                add(channel, kind, payload)
            yield from pump()
        yield from pump()
        sample(time.monotonic())
        if not gate.is_finished:
            missing = [producers[i] for i, r in enumerate(readers) if not r.is_finished]
            raise ProtocolError(
                f"consumer {consumer}: no end of partition from producers {missing}; their output is incomplete"
            )
        if pending:
            yield combine(pending)

    outputs = apply_chain(plan.after, received()) if plan.after else received()
    try:
        # decoded (and through the chained operators) on a thread of its own, handed to Spark here: the
        # consumer's waits while Spark does not take its output are its back-pressured time
        for out in handed_on(
            outputs,
            lambda: engine.begin_output_wait(monotonic()),
            lambda: engine.end_output_wait(monotonic()),
            f"credit-shuffle-consumer-{consumer}",
        ):
            yield report.data(out)
    finally:
        replay.close()
        if monitor is not None:
            monitor.close()

    engine.time.stop(time.monotonic())
    rows = [*engine.metric_rows(time.monotonic()), executor_row(CONSUMER, consumer, socket.gethostname())]
    yield from report.last(plan.output_schema, [*producer_metrics, *rows, *timeline.timeline_rows()])
