"""The producer half of a subtask: its RecordWriter and result partition, the flush / keep-alive / latency
marker schedule, the backpressure wait, its gauges and metric rows."""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pyarrow as pa

from ..buffers.format import CheckpointBarrier, KeepAlive, LatencyMarker, encode_event
from ..buffers.writer import RecordWriter
from ..errors import ExchangeTimeoutError, SchemaMismatchError
from ..metrics import PRODUCER, SAMPLE, MetricRow, RateMeter, TaskMetrics, TimelineSampler
from .rules import Fail, Gauges, Settings, TimeAccount, Wait

__all__ = ["SEGMENT_HOLD_TIME", "Flusher", "ProducerEngine", "conform", "subpartition_gauges", "timed_recycler"]

#: A producer's mean time, in ms, from the writer's request of a network buffer to its segment's return to the
#: pool (``stat = "mean"``): the buffer filling, queued in its subpartition, on the wire, read by its consumer
#: and recycled (a local channel's segment) or credited back. No Flink metric: what a buffer's round trip costs,
#: from which the simulation's transport delay is calibrated (:mod:`spark_credit_shuffle.simulation.calibrate`).
SEGMENT_HOLD_TIME = "segmentHoldTimeMs"


def timed_recycler(
    recycler: Callable[[], None],
    on_returned: Callable[[float], None],
    requested: float,
    lock: AbstractContextManager[object] | None = None,
) -> Callable[[], None]:
    """A segment's ``recycler`` that then calls ``on_returned(requested)`` (the time, on the caller's clock, at
    which the writer requested the segment: how long it was held, :meth:`ProducerEngine.segment_returned`),
    both under ``lock`` if given (a segment may come back on another thread than the one that writes)."""
    if lock is None:

        def recycle() -> None:
            recycler()
            on_returned(requested)

        return recycle

    def recycle_locked() -> None:
        with lock:
            recycler()
            on_returned(requested)

    return recycle_locked


def conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` with the exchange's ``schema``: the columns Spark hands a task carry the nullability of the
    plan it executes, which the optimizer tightens (a filter ``s IS NOT NULL``, a folded literal), and may
    name a timestamp's zone otherwise; the exchange's channels carry the schema it was planned with. Only
    the field labels change (no copy of the data); a batch whose types differ otherwise raises
    :class:`SchemaMismatchError` naming both schemas."""
    if batch.schema is schema or batch.schema.equals(schema):
        return batch
    try:
        return batch.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        raise SchemaMismatchError(
            f"the rows Spark hands the producer have the schema\n{batch.schema}\nwhich does not convert to the "
            f"schema the exchange was planned with\n{schema}\n({exc})"
        ) from None


class Flusher:
    """The output flusher's schedule (Flink's ``OutputFlusher``): due every ``flush_interval`` from ``now``
    (buffer timeout > 0), never otherwise; a late call is due once and the next time is from then."""

    __slots__ = ("interval", "next_at")

    def __init__(self, settings: Settings, now: float) -> None:
        self.interval = settings.flush_interval
        self.next_at = now + self.interval if self.interval else float("inf")

    def due(self, now: float) -> bool:
        """True if a flush is due at ``now`` (the schedule moves on)."""
        interval = self.interval
        if interval is None or now < self.next_at:
            return False
        self.next_at = max(self.next_at + interval, now)
        return True


def subpartition_gauges(partition: Any, consumers: list[int], credits: dict[int, int]) -> Gauges:
    """``backlog`` and ``outputQueueLength`` of every subpartition of a pipelined result partition, and
    ``credit`` where ``credits`` has it (remote readers only); channel: the consumer it feeds."""
    for sp, (sub, consumer) in enumerate(zip(partition.subpartitions, consumers)):
        yield "backlog", consumer, float(sub.get_buffers_in_backlog())
        yield "outputQueueLength", consumer, float(sub.queue_length())
        if sp in credits:  # remote channels only: local channels read without credit
            yield "credit", consumer, float(credits[sp])


class ProducerEngine:
    """Producer subtask ``subtask``: its RecordWriter over ``partition`` (a result partition, or a writer
    interface around one), ``consumers[sp]`` the consumer subtask subpartition ``sp`` feeds.

    ``partition_writer`` is what the writer writes to (default: ``partition``; the pipelined runtime
    passes one that takes its lock). ``resumable``: the writer stops at the first buffer its pool cannot
    give (:meth:`write` returns False) instead of taking it anyway.
    """

    def __init__(
        self,
        subtask: int,
        partition: Any,
        selector: Any,
        consumers: list[int],
        settings: Settings,
        segment_size: int,
        schema: pa.Schema | None,
        now: float,
        *,
        partition_writer: Any = None,
        resumable: bool = False,
    ) -> None:
        self.subtask = subtask
        self.partition = partition
        self.consumers = consumers
        self.settings = settings
        self.schema = schema
        self.writer = RecordWriter(
            partition_writer if partition_writer is not None else partition,
            selector,
            segment_size,
            flush_always=settings.flush_always,
            schema=schema,
            resumable=resumable,
        )
        self._emit = self.writer.broadcast_emit if selector.is_broadcast else self.writer.emit
        self.metrics = TaskMetrics(PRODUCER, subtask)
        self.time = TimeAccount(now)
        self.timeline = TimelineSampler(PRODUCER, subtask, settings.timeline_interval_ms)
        self.is_finished = False  # the writer finished: nothing more is written
        self.waiting_since: float | None = None  # set while back-pressured
        self.waiting_hard = False  # the wait is in the middle of an input (hard back-pressure)
        #: outputQueueLength over the samples (a blocking partition has no queue to sample)
        self._queues = None if settings.blocking else QueueLengthSamples(partition, len(consumers))
        self._records_out = RateMeter()
        self._rng = random.Random(subtask)
        self.flusher = Flusher(settings, now)
        #: The seconds each segment the writer took was held before it came back, summed, and how many came back.
        self._held_s = 0.0
        self._held = 0
        self.next_heartbeat = now + settings.heartbeat_interval
        marker = settings.latency_interval
        self.next_marker = now + marker if marker else float("inf")

    # -- input --

    def write(self, batch: pa.RecordBatch) -> bool:
        """Write ``batch``; False if the writer stopped at a buffer its pool cannot give (then wait until
        :meth:`is_available` and call :meth:`resume`). A batch is first given the engine's schema (see
        :func:`conform`)."""
        if self.schema is not None:
            batch = conform(batch, self.schema)
        return bool(self._emit(batch))

    def segment_returned(self, held_s: float) -> None:
        """A segment the writer took came back to the pool ``held_s`` seconds after it was requested (the
        runtime's or the simulation's clock): the mean is :data:`SEGMENT_HOLD_TIME`."""
        self._held_s += held_s
        self._held += 1

    def resume(self) -> bool:
        """Write on where :meth:`write` stopped; True once the batch is written whole."""
        return bool(self.writer.resume())

    def finish(self) -> None:
        """The end of the input: the open buffers and the end of partition go out."""
        self.writer.finish()
        self.is_finished = True

    def is_available(self) -> bool:
        return bool(self.partition.is_available())

    def inject_after_finish(self, barrier: CheckpointBarrier) -> int:
        """Put the unaligned ``barrier`` into every subpartition of the finished partition that its consumer
        has not read to the end; returns how many took it (see
        ``PipelinedResultPartition.add_priority_event_after_finish``)."""
        partition = self.partition
        return sum(
            bool(partition.add_priority_event_after_finish(sp, encode_event(barrier)))
            for sp in range(partition.num_subpartitions)
        )

    def takes_part_in_checkpoints_after_finish(self) -> bool:
        """Finished, with a pipelined partition whose consumers have not all read it to the end: unaligned
        barriers still overtake what they have left."""
        partition = self.partition
        return (
            self.is_finished
            and not self.settings.blocking
            and not partition.is_released
            and any(sub.has_reader for sub in partition.subpartitions)
        )

    # -- backpressure --

    def begin_wait(self, now: float, *, hard: bool = False) -> None:
        """Back-pressure begins: before taking the next input (soft, Flink's mailbox waiting for the writer to be
        available) or, ``hard``, in the middle of an input the writer could not write whole (Flink's
        ``requestBufferBuilderBlocking``)."""
        self.waiting_since = now
        self.waiting_hard = hard

    def check_wait(self, now: float, last_progress: float, describe: Callable[[float], str]) -> Wait | Fail:
        """The backpressure wait begun at :meth:`begin_wait`: how long more, or the timeout
        (``buffers_request_timeout_ms`` without progress, ``last_progress`` being the last time a segment came
        back, a data buffer went out or a consumer granted credit; ``describe(waited)`` says who holds the
        buffers)."""
        started = self.waiting_since if self.waiting_since is not None else now
        since = now - max(last_progress, started)
        timeout = self.settings.buffer_wait_timeout
        if since >= timeout:
            return Fail(ExchangeTimeoutError(describe(now - started)))
        return Wait(now + timeout - since)

    def end_wait(self, now: float) -> None:
        if self.waiting_since is not None:
            self.time.add_back_pressure(now - self.waiting_since, hard=self.waiting_hard)
            self.waiting_since = None

    # -- timer: flusher, keep-alives, latency markers --

    def next_timer(self) -> float:
        """When :meth:`on_timer` has something to do (inf once finished)."""
        if self.is_finished:
            return float("inf")
        return min(self.flusher.next_at, self.next_heartbeat, self.next_marker)

    def on_timer(self, now: float, wall_ns: int) -> None:
        """Flush, send keep-alives and a latency marker (stamped ``wall_ns``) if due at ``now``."""
        if self.is_finished:
            return
        writer = self.writer
        if self.flusher.due(now):
            writer.flush_all()
        if now >= self.next_heartbeat:
            self.send_liveness_markers()
            self.next_heartbeat = now + self.settings.heartbeat_interval
        marker = self.settings.latency_interval
        if marker is not None and now >= self.next_marker:  # a record to one random channel (Flink's randomEmit)
            sp = self._rng.randrange(writer.num_subpartitions)
            writer.emit_latency_marker(LatencyMarker(wall_ns, self.subtask), sp)
            self.next_marker = max(self.next_marker + marker, now)

    def send_liveness_markers(self) -> None:
        """A :class:`KeepAlive` priority event on every idle subpartition: tells its consumer this producer is
        alive. It overtakes the queued data and needs no credit, and it finishes and flushes no buffer, so
        with buffer timeout -1 partly filled buffers still move only when full, on events or at the end.

        A subpartition with a buffer or event its reader can take gets none (Flink has no data-plane
        keep-alive at all): what is queued tells its consumer the producer is alive, or, when the consumer
        gave no credit, the consumer holds this channel's data in its exclusive buffers itself. Sent there
        anyway, out of band every quarter of the timeout, keep-alives lengthened a slow consumer's
        alignments (the simulation's checkpoint demo, 200 virtual s: 63 against 44 ms). A receiver without
        exclusive buffers may be left without credit by its gate, so its subpartition always gets one."""
        partition = self.partition
        if partition.is_finished or partition.is_released:
            return
        for sp, sub in enumerate(partition.subpartitions):
            if sub.receiver_exclusive_buffers_per_channel and sub.is_data_available():
                continue
            partition.add_event(sp, encode_event(KeepAlive()))

    # -- gauges and metrics --

    def sample_output(self) -> None:
        """outPoolUsage and the queue length of every subpartition, after every slice of input written: the
        moments the queues are longest."""
        partition = self.partition
        self.metrics.sample("outPoolUsage", partition.out_pool_usage)
        if self.settings.blocking:
            return
        assert self._queues is not None  # pipelined (blocking returned above)
        self._queues.sample()

    def gauges(self, now: float, credits: dict[int, int]) -> Gauges:
        """The producer's timeline gauges at ``now``; ``credits[sp]``: the credit of remote subpartitions (see
        :mod:`spark_credit_shuffle.metrics` for what each mode samples)."""
        partition, writer = self.partition, self.writer
        if self.settings.blocking:  # nothing is consumed before the producer stage ends
            yield "outPoolUsage", None, partition.out_pool_usage
            yield "isBackPressured", None, 0.0 if partition.is_available() else 1.0
            for name, value in self.time.window_gauges(now):
                yield name, None, value
            yield "numRecordsOutPerSecond", None, self._records_out.rate(sum(writer.num_records_out), now)
            for sp, consumer in enumerate(self.consumers):  # a blocking subpartition's backlog: every buffer stored
                yield "backlog", consumer, float(partition.num_data_buffers[sp])
            return
        waiting = self.waiting_since
        yield "outPoolUsage", None, partition.out_pool_usage
        yield "isBackPressured", None, 1.0 if waiting is not None or not partition.is_available() else 0.0
        for name, value in self.time.window_gauges(now, waiting, self.waiting_hard):
            yield name, None, value
        yield "numRecordsOutPerSecond", None, self._records_out.rate(sum(writer.num_records_out), now)
        yield from subpartition_gauges(partition, self.consumers, credits)

    def progress(self, stamp_ms: float | None) -> list[MetricRow]:
        """The producer's counters so far, over all its subpartitions, as rows of a sample taken at
        ``stamp_ms`` (what the live monitor adds to each timeline sample)."""
        writer = self.writer
        return [
            MetricRow(PRODUCER, self.subtask, None, metric, SAMPLE, float(sum(values)), stamp_ms)
            for metric, values in (
                ("numRecordsOut", writer.num_records_out),
                ("numBuffersOut", writer.num_buffers_out),
                ("numBytesOut", writer.num_bytes_out),
            )
        ]

    def metric_rows(self, now: float) -> list[MetricRow]:
        """Counters per subpartition, gauge statistics; pipelined: queue lengths and time metrics."""
        writer = self.writer
        per_subpartition = {
            "numRecordsOut": writer.num_records_out,
            "numBytesOut": writer.num_bytes_out,
            "numBuffersOut": writer.num_buffers_out,
        }
        rows = self.metrics.rows(per_subpartition, self.consumers)
        if self.settings.blocking:
            return [*rows, *self.time.rows(PRODUCER, self.subtask, now)]
        assert self._queues is not None  # pipelined (blocking returned above)
        queue_max, queue_sum, samples = self._queues.totals()  # Python ints: int / int as before
        samples = max(1, samples)
        subtask = self.subtask
        for sp, consumer in enumerate(self.consumers):
            rows.append(MetricRow(PRODUCER, subtask, consumer, "outputQueueLength", "max", float(queue_max[sp])))
            rows.append(MetricRow(PRODUCER, subtask, consumer, "outputQueueLength", "mean", queue_sum[sp] / samples))
        rows.extend(self.time.rows(PRODUCER, self.subtask, now))
        if self._held:
            rows.append(MetricRow(PRODUCER, subtask, None, SEGMENT_HOLD_TIME, "mean", self._held_s * 1e3 / self._held))
        return rows


class QueueLengthSamples:
    """The length of every subpartition's queue, summed and maxed over the samples (``outputQueueLength``).

    The partition tells which queues may have changed since the last sample
    (:meth:`~spark_credit_shuffle.protocol.partition.PipelinedResultPartition.track_queue_changes`), so a sample
    reads only those: each queue keeps the length it had at its last change and the sample from which it held,
    and its sum gains ``length x samples held`` when it changes again (or when :meth:`totals` is read), its
    maximum the length that held for at least one sample. Constant per sample in the subpartitions; the sums
    and maxima are exactly those of reading every queue at every sample."""

    def __init__(self, partition: Any, n: int) -> None:
        self.samples = 0
        self._changed, self._queues = partition.track_queue_changes()
        self._length = list(map(len, self._queues))  # the length since sample ``_since`` + 1 ...
        self._since = [0] * n  # ... and the samples summed into ``_sum`` so far
        self._sum = [0] * n
        self._max = [0] * n
        self._changed.clear()

    def sample(self) -> None:
        self.samples += 1
        changed = self._changed
        if not changed:
            return
        before = self.samples - 1  # the samples taken before this one
        queues, length, since, sums, maxima = self._queues, self._length, self._since, self._sum, self._max
        for sp in changed:
            now = len(queues[sp])
            old = length[sp]
            if now != old:
                held = before - since[sp]
                if held:  # the old length was sampled ``held`` times
                    sums[sp] += old * held
                    if old > maxima[sp]:
                        maxima[sp] = old
                since[sp] = before
                length[sp] = now
        changed.clear()

    def totals(self) -> tuple[list[int], list[int], int]:
        """(maximum, sum, samples) per subpartition so far, as Python ints."""
        samples = self.samples
        maxima, sums = list(self._max), list(self._sum)
        for sp, (length, since) in enumerate(zip(self._length, self._since)):
            held = samples - since
            if held:
                sums[sp] += length * held
                if length > maxima[sp]:
                    maxima[sp] = length
        return maxima, sums, samples
