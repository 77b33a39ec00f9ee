"""A blocking consumer subtask: stored buffers in, through the credit protocol, rows out.

The buffers of each producer arrive from Spark's shuffle in the order they were stored. Each
producer's buffers are queued in a subpartition on the sending side of an in-process connection
(the storage plays the producer, as Flink's blocking subpartition reader does), and reach the
input gate only as BufferResponses that a credit allowed: the gate's exclusive and floating
buffers bound what is held on the receiving side, backlog and AddCredit flow as on the wire.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from ..buffers import DataType
from ..buffers.format import Event
from ..buffers.reader import RecordReader
from ..errors import ProtocolError
from ..metrics import CONSUMER, GaugeStats, MetricRow, RateMeter, TaskMetrics, TimelineSampler
from ..protocol.channels import RemoteInputChannel
from ..protocol.gate import SingleInputGate
from ..protocol.pools import NetworkBufferPool
from ..transport.memory import StoredBuffersExchange
from .checkpoints import CHECKPOINT_EVENTS, ConsumerCheckpoints
from .common import IN_BAND, MetricsReport, combine

if TYPE_CHECKING:
    from .plan import ExchangePlan

__all__ = ["consume_partition"]

#: Output batches are combined up to about this many bytes before they go back to Spark.
_OUTPUT_BATCH_BYTES = 4 << 20
_METRICS_TYPE = -1


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

    metrics = TaskMetrics(CONSUMER, consumer)
    producer_metrics: list[MetricRow] = []
    pending: list[pa.RecordBatch] = []
    pending_bytes = 0
    started = time.perf_counter()
    timeline = TimelineSampler(CONSUMER, consumer, config.metrics_sample_interval_ms)
    records_in = RateMeter()

    sample_gauges = GateGauges(gate, metrics)
    checkpoints = ConsumerCheckpoints(consumer, producers) if config.checkpoint_interval_ms > 0 else None

    def gauges() -> Iterator[tuple[str, int | None, float]]:
        for name, value in zip(GateGauges.NAMES, sample_gauges.values()):
            yield name, None, value
        yield "numRecordsInPerSecond", None, records_in.rate(sum(r.num_records_in for r in readers))
        for index, (channel, p) in enumerate(zip(gate.channels, producers)):
            assert isinstance(channel, RemoteInputChannel)  # the replay reads every producer as a remote channel
            yield "credit", p, float(replay.sender_credit(index))
            yield "unannouncedCredit", p, float(channel.unannounced_credit)
            yield "backlog", p, float(max(0, channel.sender_backlog))
            yield "inputQueueLength", p, float(channel.queue_length())

    timeline.record(gauges)

    poll = replay.poll
    due = timeline.due

    def pump() -> Iterator[pa.RecordBatch]:
        nonlocal pending_bytes
        while True:
            polled = 0
            while (item := poll()) is not None:
                polled += 1
                sample_gauges()
                if due():
                    timeline.record(gauges)
                channel = item.channel_index
                if checkpoints is not None and item.buffer.is_buffer:
                    checkpoints.handler.process_buffer(channel, item.sequence_number, len(item.buffer.data))
                for out in readers[channel].feed(item.buffer, item.sequence_number):
                    if not isinstance(out, Event):  # a record batch
                        if out.num_rows:
                            if delay:
                                time.sleep(delay * out.num_rows)
                            pending.append(out)
                            pending_bytes += out.get_total_buffer_size()  # nbytes costs ~15 µs a call
                    elif checkpoints is not None and isinstance(out, CHECKPOINT_EVENTS):
                        for resumed in checkpoints.on_event(channel, out, item.sequence_number):
                            gate.resume_consumption(resumed)
                if pending_bytes >= _OUTPUT_BATCH_BYTES:
                    yield report.data(combine(pending))
                    pending.clear()
                    pending_bytes = 0
            if not polled:
                return

    add = replay.add
    data_types = {int(t): t for t in DataType}
    try:
        for batch in batches:
            if not batch.num_rows:
                continue
            for producer, data_type, payload in stored_buffers(batch):
                if data_type == _METRICS_TYPE:
                    producer_metrics.extend(MetricRow(*row) for row in json.loads(payload.to_pybytes()))
                    continue
                channel = channel_of.get(producer)
                kind = data_types.get(data_type)
                if channel is None or kind is None:
                    what = f"producer {producer}, not an input" if channel is None else f"data type {data_type}"
                    raise ProtocolError(f"consumer {consumer} got a stored buffer from {what}")
                add(channel, kind, payload)
            yield from pump()
        yield from pump()
        timeline.record(gauges)
        if not gate.is_finished:
            missing = [producers[i] for i, r in enumerate(readers) if not r.is_finished]
            raise ProtocolError(
                f"consumer {consumer}: no end of partition from producers {missing}; their output is incomplete"
            )
        if pending:
            yield report.data(combine(pending))
    finally:
        replay.close()

    for i, p in enumerate(producers):
        reader = readers[i]
        metrics.count("numRecordsIn", reader.num_records_in, p)
        metrics.count("numBytesIn", reader.num_bytes_in, p)
        metrics.count("numBuffersIn", reader.num_buffers_in, p)
    metrics.set("accumulateBusyTimeMs", (time.perf_counter() - started) * 1000.0)
    checkpoint_rows = checkpoints.metric_rows() if checkpoints is not None else []
    yield from report.last(
        plan.schema, [*producer_metrics, *metrics.rows(), *checkpoint_rows, *timeline.timeline_rows()]
    )


def stored_buffers(batch: pa.RecordBatch) -> Iterator[tuple[int, int, pa.Buffer]]:
    """(producer, data type, payload) of every stored-buffer row of ``batch`` (STORAGE_SCHEMA).

    Payloads are zero-copy, read-only slices of the batch's binary column: Spark hands each batch
    to the task in memory of its own that nothing writes to again, so the RecordReader may decode
    straight from it (a writable buffer would be copied first). Offsets out of order or outside the
    column's data are a :class:`ProtocolError`, never a read outside it.
    """
    n = batch.num_rows
    producers = batch.column(1).to_numpy(zero_copy_only=False).tolist()
    data_types = batch.column(3).to_numpy(zero_copy_only=False).tolist()
    payload = batch.column(4)
    if payload.null_count:
        raise ProtocolError("a stored buffer without a payload (null)")
    _validity, offsets_buffer, data = payload.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int32, count=n + 1, offset=payload.offset * 4)
    size = data.size if data is not None else 0
    if n and (offsets[0] < 0 or offsets[-1] > size or bool(np.any(offsets[1:] < offsets[:-1]))):
        raise ProtocolError("stored-buffer payload offsets out of order or outside the column's data")
    if data is None:
        data = pa.py_buffer(b"")
    elif data.is_mutable:
        data = pa.foreign_buffer(data.address, data.size, base=data)  # a read-only view of the same memory
    starts = offsets.tolist()
    return zip(producers, data_types, [data.slice(a, b - a) for a, b in itertools.pairwise(starts)])


class GateGauges:
    """Samples the gate's inPoolUsage, inputExclusiveBuffersUsage and inputFloatingBuffersUsage in one
    pass over its remote channels (the values of the gate's properties of those names, computed
    once per buffer instead of three passes each)."""

    __slots__ = ("_exclusive", "_exclusive_total", "_floating", "_in_pool", "_managers", "_pool")

    #: The gauges' names, in the order :meth:`values` returns them.
    NAMES = ("inPoolUsage", "inputExclusiveBuffersUsage", "inputFloatingBuffersUsage")

    def __init__(self, gate: SingleInputGate, metrics: TaskMetrics) -> None:
        remote = [c for c in gate.channels if isinstance(c, RemoteInputChannel)]
        self._managers = [(c.buffer_manager, c.initial_credit) for c in remote]
        self._exclusive_total = sum(c.initial_credit for c in remote)
        self._pool = gate.buffer_pool
        self._in_pool, self._exclusive, self._floating = (
            metrics.gauges.setdefault(name, GaugeStats()) for name in self.NAMES
        )

    def values(self) -> tuple[float, float, float]:
        """(inPoolUsage, inputExclusiveBuffersUsage, inputFloatingBuffersUsage) now."""
        exclusive_used = unused_floating = 0
        for manager, initial in self._managers:
            unused = manager.num_exclusive
            if initial > unused:
                exclusive_used += initial - unused
            unused_floating += manager.num_floating
        pool = self._pool
        floating_used = pool.num_used - unused_floating
        if floating_used < 0:
            floating_used = 0
        size = pool.current_pool_size
        exclusive_total = self._exclusive_total
        denominator = size + exclusive_total
        return (
            (floating_used + exclusive_used) / denominator if denominator else 0.0,
            exclusive_used / exclusive_total if exclusive_total else 0.0,
            floating_used / size if size else 0.0,
        )

    def __call__(self) -> None:
        in_pool, exclusive, floating = self.values()
        self._in_pool.sample(in_pool)
        self._exclusive.sample(exclusive)
        self._floating.sample(floating)
