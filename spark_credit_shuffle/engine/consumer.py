"""The consumer half of a subtask: its input gate and RecordReaders, the silence rule, the output linger,
latency markers, checkpoint events, its gauges and metric rows."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from ..buffers.buffer import Buffer
from ..buffers.format import LatencyMarker
from ..buffers.reader import RecordReader
from ..errors import ExchangeTimeoutError
from ..metrics import CONSUMER, SAMPLE, GaugeStats, MetricRow, RateMeter, TaskMetrics, TimelineSampler
from ..protocol import RemoteInputChannel, SingleInputGate
from ..protocol.debloat import DEFAULT_MIN_BUFFER_SIZE, BufferDebloater, ThroughputCalculator
from .checkpoints import CHECKPOINT_EVENTS, ConsumerCheckpoints
from .rules import LINGER_OVER, Fail, Gauges, LingerOver, Settings, TimeAccount, Wait

if TYPE_CHECKING:
    from ..protocol import BufferOrEvent

__all__ = ["ConsumerEngine", "GateGauges", "OutputBatcher", "channel_gauges", "combine"]


def combine(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """The decoded batches a consumer hands on at once, as one batch (a single one as it is)."""
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


#: A channel's last delivery once it ended: it is never silent again, and sets no deadline.
_ENDED = float("inf")

#: Latency samples a consumer keeps.
MAX_LATENCY_SAMPLES = 100_000


#: An output batch holds at most about this many bytes, whatever ``output_batch_rows`` says: rows larger than a
#: segment would otherwise join into one batch of gigabytes, and the consumer's output waiting for Spark is
#: bounded in batches (``runtime/handoff.py``), so wide rows would hold tens of MB there before the consumer
#: waits. 8192 rows of ~110 bytes are below it.
OUTPUT_BATCH_BYTES = 4 << 20


class OutputBatcher:
    """Decoded rows on their way to Spark: joined up to ``target_rows`` (and :data:`OUTPUT_BATCH_BYTES`) when
    they are ready at once, held at most ``linger`` seconds for more when fewer are ready (each output batch
    costs Spark a fixed amount, as a network buffer costs Flink)."""

    __slots__ = ("linger", "linger_until", "pending", "pending_bytes", "pending_rows", "target_rows")

    def __init__(self, target_rows: int, linger: float) -> None:
        self.target_rows = target_rows
        self.linger = linger
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0
        self.pending_bytes = 0
        self.linger_until: float | None = None

    def add(self, batch: pa.RecordBatch) -> None:
        self.pending.append(batch)
        self.pending_rows += batch.num_rows
        self.pending_bytes += batch.get_total_buffer_size()

    def ready(self, more_available: bool, now: float) -> pa.RecordBatch | None:
        """The batch to hand on now, if any: enough rows or bytes, or nothing more ready and no linger."""
        if not self.pending:
            return None
        if (
            self.pending_rows >= self.target_rows
            or self.pending_bytes >= OUTPUT_BATCH_BYTES
            or (not more_available and self.linger <= 0)
        ):
            return self.take()
        if not more_available and self.linger_until is None:
            self.linger_until = now + self.linger
        return None

    def take(self) -> pa.RecordBatch:
        """Every pending row as one batch (the linger ends)."""
        batch = combine(self.pending)
        self.pending, self.pending_rows, self.pending_bytes, self.linger_until = [], 0, 0, None
        return batch


class GateDebloat:
    """Buffer debloating of a consumer's gate (Flink's ``SingleInputGate.triggerDebloating``, FLIP-183).

    The gate's throughput is measured over the time it delivers data (the measurement pauses while the gate
    has nothing); every ``period`` the :class:`BufferDebloater` turns it and the buffers in use into the size
    at which they hold ``target_ms`` of data, and a size that moved enough is announced to every producer
    (``NewBufferSize``), whose next buffers are cut at it. ``debloatedBufferSize`` and
    ``estimatedTimeToConsumeBuffersMs`` are its gauges."""

    __slots__ = ("calculator", "debloater", "gate", "next_at", "period")

    def __init__(self, gate: SingleInputGate, settings: tuple[float, int, int, int], now: float) -> None:
        period, target_ms, samples, threshold = settings
        self.gate = gate
        self.period = period
        self.next_at = now + period
        self.calculator = ThroughputCalculator()
        self.debloater = BufferDebloater(
            gate.network_pool.segment_size,
            target_ms=target_ms,
            min_buffer_size=DEFAULT_MIN_BUFFER_SIZE,
            threshold_percentages=threshold,
            number_of_samples=samples,
        )

    def on_data(self, size: int, now: float) -> None:
        self.calculator.incoming_data_size(size, int(now * 1000))

    def on_idle(self, now: float) -> None:
        self.calculator.pause_measurement(int(now * 1000))

    def on_timer(self, now: float) -> int | None:
        """Recalculate if due at ``now``; the size announced, if one was."""
        if now < self.next_at:
            return None
        self.next_at = max(self.next_at + self.period, now)
        throughput = self.calculator.calculate_throughput(int(now * 1000))
        size = self.debloater.recalculate_buffer_size(throughput, self.gate.buffers_in_use_count())
        if size is not None and not self.gate.is_closed:
            self.gate.announce_buffer_size(size)
        return size

    def gauges(self) -> Iterator[tuple[str, float]]:
        yield "debloatedBufferSize", float(self.debloater.last_buffer_size)
        yield "estimatedTimeToConsumeBuffersMs", float(self.debloater.last_estimated_time_ms)


class ConsumerEngine:
    """Consumer subtask ``subtask``: its gate, ``readers[c]`` decoding channel ``c`` (the producer
    ``producers[c]``), the silence rule, the output linger, latency markers and checkpoint events."""

    def __init__(
        self,
        subtask: int,
        gate: SingleInputGate,
        readers: list[RecordReader],
        producers: list[int],
        settings: Settings,
        now: float,
        *,
        checkpoints: ConsumerCheckpoints | None = None,
    ) -> None:
        self.subtask = subtask
        self.gate = gate
        self.readers = readers
        self.producers = producers
        self.settings = settings
        self.checkpoints = checkpoints
        self.metrics = TaskMetrics(CONSUMER, subtask)
        self.time = TimeAccount(now)
        self.timeline = TimelineSampler(CONSUMER, subtask, settings.timeline_interval_ms)
        self.output = OutputBatcher(settings.output_batch_rows, settings.output_linger)
        #: When each channel last delivered a buffer or event; ``inf`` once it ended (never silent again).
        self.last_delivery: list[float] = [now] * len(producers)
        self.latencies_ms: list[float] = []
        self.started_ns = 0
        self.gate_gauges: GateGauges | None = None
        self._records_in = RateMeter()
        #: The address of producer ``p`` and what its connection saw by ``now``, for the silence message.
        #: Buffer debloating (``buffer_debloat_enabled``, pipelined), else None.
        self.debloat = GateDebloat(gate, settings.debloat, now) if settings.debloat is not None else None
        self.where: Callable[[int], str] = lambda producer: "?"
        self.detail: Callable[[int, float], str] = lambda producer, now: ""
        #: Set while the consumer waits to hand its output on (see :meth:`begin_output_wait`).
        self.output_waiting_since: float | None = None

    def begin_output_wait(self, now: float) -> None:
        """The consumer cannot hand its output on (what follows it in the task has not taken the last rows):
        it waits, back-pressured, as a Flink task whose output is full (``backPressuredTimeMsPerSecond``). It
        reads no input meanwhile, so its buffers stay taken and its producers run out of credit."""
        self.output_waiting_since = now

    def end_output_wait(self, now: float) -> None:
        """The output was taken: the back-pressured wait since :meth:`begin_output_wait` ends (soft: the
        consumer waits before it takes its next input, as Flink's mailbox does)."""
        since = self.output_waiting_since
        if since is not None:
            self.time.add_back_pressure(max(0.0, now - since), hard=False)
            self.output_waiting_since = None

    def start(self, now: float, wall_ns: int) -> None:
        """The channels were requested: the consumer's life, and every channel's silence, start now."""
        self.gate_gauges = GateGauges(self.gate, self.metrics)
        self.last_delivery = [now] * len(self.producers)
        self.time = TimeAccount(now)
        self.started_ns = wall_ns

    # -- the next buffer --

    def next(self, now: float, linger_until: float | None = None) -> BufferOrEvent | Wait | Fail | LingerOver | None:
        """The gate's next buffer or event; None once every channel ended; :data:`LINGER_OVER` once
        ``linger_until`` passed; else :class:`Wait` (until the earliest silence deadline or the linger) or
        :class:`Fail` with the :class:`ExchangeTimeoutError` of the channel silent longest."""
        gate = self.gate
        polled = gate.poll_next()
        if polled is not None:
            self.last_delivery[polled.channel_index] = now
            if self.debloat is not None:
                self.debloat.on_data(polled.buffer.size, now)
            return polled
        if gate.is_finished:
            return None
        if self.debloat is not None:  # nothing to read: the throughput's measurement pauses
            self.debloat.on_idle(now)
        if linger_until is not None and now >= linger_until:
            return LINGER_OVER
        timeout = self.settings.silence_timeout
        last_delivery = self.last_delivery
        oldest = min(last_delivery, default=now)
        if now - oldest < timeout:
            # no channel is silent that long, so none needs a look of its own (this runs whenever the gate
            # empties): the deadline is at the latest the oldest delivery's (a channel that has just ended
            # only brings it forward; the look then goes channel by channel)
            until = oldest + timeout
        else:
            blocked = self.checkpoints.handler.blocked_channels if self.checkpoints is not None else ()
            channels = gate.channels
            for ch, input_channel in enumerate(channels):
                if input_channel is not None and input_channel.is_released:
                    last_delivery[ch] = _ENDED
            live = [(ch, last) for ch, last in enumerate(last_delivery) if channels[ch] is not None and last != _ENDED]
            silent = [(now - last, ch) for ch, last in live if now - last >= timeout and ch not in blocked]
            if silent:  # a channel blocked by an aligned barrier is silent on purpose
                seconds, channel = max(silent)
                producer = self.producers[channel]
                return Fail(
                    ExchangeTimeoutError(
                        self.describe_silence(channel, seconds, self.where(producer), self.detail(producer, now))
                    )
                )
            until = min((last for _, last in live), default=now) + timeout
        if linger_until is not None:
            until = min(until, linger_until)
        return Wait(until)

    def describe_silence(self, channel: int, seconds: float, where: str, detail: str = "") -> str:
        """The message of a silence timeout on ``channel`` (``where``: the producer's address)."""
        producer = self.producers[channel]
        where = "the local channel" if producer == self.subtask else where or "?"
        return (
            f"consumer subtask {self.subtask} waited {seconds * 1000:.0f} ms for data from producer subtask "
            f"{producer} ({where}): nothing arrived on that channel within partition_request_timeout_ms="
            f"{self.settings.partition_request_timeout_ms}{detail}"
        )

    def sample_gauges(self) -> None:
        """Sample the gate's pool gauges (``inPoolUsage`` and its exclusive and floating shares), once each time
        the consumer looks at its gate and it holds data, right after the look's first data buffer: the moment
        the gate holds the most (a pipelined task's loop takes a burst of buffers in one look, a simulated
        consumer one), as a producer samples ``outPoolUsage`` after each slice of input written."""
        if self.gate_gauges is not None:
            self.gate_gauges()

    def resumed(self, channels: tuple[int, ...], now: float) -> None:
        """``channels`` resumed consumption after an aligned barrier: their silence while blocked was the
        alignment's."""
        for channel in channels:
            self.last_delivery[channel] = now

    # -- what a buffer holds --

    def take(
        self, polled: BufferOrEvent, wall_ns: int, recycle: Callable[[], None] | None = None
    ) -> tuple[list[pa.RecordBatch], tuple[int, ...]]:
        """Decode ``polled`` (``recycle`` returns its buffer, default the gate's own): (its data batches, the
        channels to resume after a checkpoint event). Latency markers are measured against ``wall_ns``."""
        buffer = polled.buffer
        channel = polled.channel_index
        checkpoints = self.checkpoints
        resume: tuple[int, ...] = ()
        if checkpoints is not None and buffer.is_buffer:
            checkpoints.handler.process_buffer(channel, polled.sequence_number, buffer.size)
            if checkpoints.handler.is_checkpoint_pending:
                resume = checkpoints.check_timeout()
        if recycle is not None:
            buffer = Buffer(buffer.data_type, buffer.data, recycle)
        batches: list[pa.RecordBatch] = []
        for item in self.readers[channel].feed(buffer, polled.sequence_number):
            if isinstance(item, pa.RecordBatch):
                batches.append(item)
            elif checkpoints is not None and isinstance(item, CHECKPOINT_EVENTS):
                resume += checkpoints.on_event(channel, item, polled.sequence_number)
            elif (
                isinstance(item, LatencyMarker)
                and item.timestamp >= self.started_ns  # markers sent before this consumer asked measure the set-up
                and len(self.latencies_ms) < MAX_LATENCY_SAMPLES
            ):
                self.latencies_ms.append((wall_ns - item.timestamp) / 1e6)
        return batches, resume

    # -- gauges and metrics --

    def gauges(self, now: float, sender_credit: Callable[[int], int] | None = None) -> Gauges:
        """The consumer's timeline gauges at ``now``; ``sender_credit(channel)``: the credit as the sending
        side knows it, where the caller plays that side too (the blocking replay)."""
        assert self.gate_gauges is not None
        for name, value in zip(GateGauges.NAMES, self.gate_gauges.values()):
            yield name, None, value
        yield "numRecordsInPerSecond", None, self._records_in.rate(sum(r.num_records_in for r in self.readers), now)
        waiting = self.output_waiting_since
        for name, value in self.time.window_gauges(now, waiting):
            yield name, None, value
        yield "isBackPressured", None, 0.0 if waiting is None else 1.0
        if self.debloat is not None:
            for name, value in self.debloat.gauges():
                self.metrics.sample(name, value)
                yield name, None, value
        yield from channel_gauges(self.gate, self.producers, sender_credit)

    def progress(self, stamp_ms: float | None) -> list[MetricRow]:
        """The consumer's counters so far, over all its channels, as rows of a sample taken at ``stamp_ms``
        (what the live monitor adds to each timeline sample)."""
        readers = self.readers
        return [
            MetricRow(
                CONSUMER,
                self.subtask,
                None,
                "numRecordsIn",
                SAMPLE,
                float(sum(r.num_records_in for r in readers)),
                stamp_ms,
            ),
            MetricRow(
                CONSUMER,
                self.subtask,
                None,
                "numBuffersIn",
                SAMPLE,
                float(sum(r.num_buffers_in for r in readers)),
                stamp_ms,
            ),
            MetricRow(
                CONSUMER,
                self.subtask,
                None,
                "numBytesIn",
                SAMPLE,
                float(sum(r.num_bytes_in for r in readers)),
                stamp_ms,
            ),
        ]

    def metric_rows(self, now: float) -> list[MetricRow]:
        """Counters per channel, gauge statistics, checkpoints; pipelined: latency and time metrics."""
        metrics, readers = self.metrics, self.readers
        per_channel = {
            "numRecordsIn": [r.num_records_in for r in readers],
            "numBytesIn": [r.num_bytes_in for r in readers],
            "numBuffersIn": [r.num_buffers_in for r in readers],
        }
        gate = self.gate
        metrics.count("numBytesInLocal", gate.num_bytes_in_local)
        metrics.count("numBytesInRemote", gate.num_bytes_in_remote)
        metrics.count("numBuffersInLocal", gate.num_buffers_in_local)
        metrics.count("numBuffersInRemote", gate.num_buffers_in_remote)
        if self.settings.blocking:
            return [
                *metrics.rows(per_channel, self.producers),
                *self.time.rows(CONSUMER, self.subtask, now),
                *(self.checkpoints.metric_rows() if self.checkpoints is not None else ()),
            ]
        metrics.count("numLatencyMarkersIn", len(self.latencies_ms))
        rows = metrics.rows(per_channel, self.producers)
        if self.latencies_ms:
            values = np.asarray(self.latencies_ms)
            for stat, value in (
                ("p50", np.percentile(values, 50)),
                ("p99", np.percentile(values, 99)),
                ("max", values.max()),
                ("mean", values.mean()),
            ):
                rows.append(MetricRow(CONSUMER, self.subtask, None, "latencyMs", stat, float(value)))
        rows.extend(self.time.rows(CONSUMER, self.subtask, now))
        if self.checkpoints is not None:
            rows.extend(self.checkpoints.metric_rows())
        return rows


def channel_gauges(
    gate: SingleInputGate, producers: list[int], sender_credit: Callable[[int], int] | None = None
) -> Gauges:
    """Per channel of ``gate`` (channel: the producer ``producers[c]``): ``credit`` (as the receiver knows
    it, or ``sender_credit(c)``), ``unannouncedCredit`` and ``backlog`` on remote channels, and
    ``inputQueueLength``."""
    for index, (channel, producer) in enumerate(zip(gate.channels, producers)):
        if isinstance(channel, RemoteInputChannel):
            unannounced = channel.unannounced_credit
            credit = (
                sender_credit(index)
                if sender_credit is not None
                else max(0, channel.num_available_buffers - unannounced)
            )
            yield "credit", producer, float(credit)
            yield "unannouncedCredit", producer, float(unannounced)
            yield "backlog", producer, float(max(0, channel.sender_backlog))
        if channel is not None:
            yield "inputQueueLength", producer, float(channel.queue_length())


class GateGauges:
    """Samples the gate's inPoolUsage, inputExclusiveBuffersUsage and inputFloatingBuffersUsage in one
    pass over its remote channels (the values of the gate's properties of those names, computed
    once per buffer instead of three passes each)."""

    __slots__ = ("_exclusive", "_exclusive_total", "_floating", "_in_pool", "_managers", "_pool", "_tally")

    #: The gauges' names, in the order :meth:`values` returns them.
    NAMES = ("inPoolUsage", "inputExclusiveBuffersUsage", "inputFloatingBuffersUsage")

    def __init__(self, gate: SingleInputGate, metrics: TaskMetrics) -> None:
        remote = [c for c in gate.channels if isinstance(c, RemoteInputChannel)]
        self._managers = [(c.buffer_manager, c.initial_credit) for c in remote]
        self._exclusive_total = sum(c.initial_credit for c in remote)
        # The gate's running sums, where they are exactly those of these channels (a channel's unused
        # exclusive buffers never exceed its initial credit); otherwise one walk over the channels per sample.
        tally = getattr(gate, "buffer_tally", None)
        shared = all(c.buffer_manager.tally is tally for c in remote)
        self._tally = tally if tally is not None and shared and tally.channels == len(remote) else None
        self._pool = gate.buffer_pool
        self._in_pool, self._exclusive, self._floating = (
            metrics.gauges.setdefault(name, GaugeStats()) for name in self.NAMES
        )

    def values(self) -> tuple[float, float, float]:
        """(inPoolUsage, inputExclusiveBuffersUsage, inputFloatingBuffersUsage) now."""
        tally = self._tally
        if tally is not None:
            exclusive_used = self._exclusive_total - tally.exclusive
            unused_floating = tally.floating
        else:
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
        """Sample the three gauges (see :meth:`ConsumerEngine.sample_gauges` for when)."""
        for stats, value in zip((self._in_pool, self._exclusive, self._floating), self.values()):
            stats.sample(value)
