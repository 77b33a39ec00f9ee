"""A simulated consumer subtask: the task engine's consumer half (:class:`ConsumerEngine`) reading and decoding
its gate at a rate on the virtual clock, aligning checkpoint barriers with credits as current Flink does and
without as Flink did before credits (see :mod:`.checkpoints`)."""

from __future__ import annotations

import functools
from collections import deque

import pyarrow as pa

from ..buffers.buffer import Buffer, DataType
from ..buffers.format import CheckpointBarrier, barrier_data_type, decode_event
from ..buffers.reader import RecordReader
from ..engine import ConsumerEngine, Fail, Wait
from ..engine.checkpoints import ConsumerCheckpoints
from ..errors import BufferDecodeError
from ..metrics import MetricRow
from ..protocol.gate import BufferOrEvent, SingleInputGate
from .clock import Context
from .simulated_producer import RECORD_OVERHEAD, RECORD_SCHEMA

__all__ = ["SimulatedConsumer"]


def _keep() -> None:
    """The recycler the engine's reader calls: the consumer recycles the buffer itself once processed."""


class SimulatedConsumer:
    """Reads its gate through the task engine's consumer half and spends ``records' bytes / rate`` virtual
    seconds on each data buffer, plus the simulation's ``buffer_cost`` for the buffer's header and Arrow
    metadata, before recycling it (the rate is the operator's, who processes records, not Arrow framing).

    Channel ``c`` reads subpartition ``subpartitions[c]`` of producer ``producers[c]``, which has
    ``fan_out[c]`` subpartitions: its rows carry ``seq`` ``subpartitions[c]``, ``+ fan_out[c]``, ... in
    order, which the decoded batches are checked against. Without credits, aligned checkpoints align at
    the consumer (see :func:`.checkpoints.barrier_buffer`): what a channel blocked by the pending alignment
    delivers is spilled (its network buffer recycled at once, the spill assumed free) and replayed before
    new input when the alignment ends."""

    def __init__(
        self,
        sim: Context,
        index: int,
        gate: SingleInputGate,
        rate: float,
        producers: list[int],
        subpartitions: list[int],
        fan_out: list[int],
        record_size: int,
    ) -> None:
        self.sim = sim
        self.index = index
        self.gate = gate
        self.rate = rate
        self.producers = producers
        n = len(producers)
        #: Bytes of the data buffers each channel delivered (the report's ``numDataBytesIn``).
        self.bytes_per_channel = [0] * n
        self.records_per_channel = [0] * n
        self.in_order = [True] * n
        self._next_seq = list(subpartitions)
        self._step = list(fan_out)
        self._payload_size = max(0, record_size - RECORD_OVERHEAD)
        self._record_size = record_size
        self.busy = False
        self.finished = False
        self.finish_time: float | None = None
        self.scheduled = False
        clock = sim.clock
        records = ConsumerCheckpoints(index, producers, clock_ns=lambda: round(clock.now * 1e9))
        self.checkpoints = records.handler
        self.engine = ConsumerEngine(
            index,
            gate,
            [RecordReader(RECORD_SCHEMA, channel=p) for p in producers],
            producers,
            sim.settings,
            0.0,
            checkpoints=records,
        )
        self._idle_since: float | None = None
        self._wake: int | None = None
        self._wake_at = float("inf")
        #: Model without credits: spilled items (buffer, channel, sequence number) of blocked channels, and the
        #: spilled items to replay before the gate.
        self.aligns_by_spilling = not sim.config.credit_based
        self.barrier_data_type = barrier_data_type(sim.config.checkpoint_options)
        self.spilled: deque[BufferOrEvent] = deque()
        self.replay: deque[BufferOrEvent] = deque()
        self.spilled_bytes = 0
        gate.listener = self._on_data

    def start(self, now: float) -> None:
        """The channels were requested: the engine's silence rule and time accounts start now (and its buffer
        debloating's period, if on)."""
        self.engine.start(now, round(now * 1e9))
        if self.engine.debloat is not None:
            self.sim.clock.schedule(self.engine.debloat.next_at, self._debloat)

    def _debloat(self, now: float) -> None:
        """The buffer debloating timer (Flink's ``StreamTask.scheduleBufferDebloater``), every period."""
        debloat = self.engine.debloat
        if debloat is None or self.finished or self.engine.gate.is_closed:
            return
        debloat.on_timer(now)
        self.sim.clock.schedule(debloat.next_at, self._debloat)

    @property
    def checkpoint_done(self) -> int:
        """The last checkpoint this consumer aligned (the one pending not counted)."""
        handler = self.checkpoints
        return handler.current_checkpoint_id - (1 if handler.is_checkpoint_pending else 0)

    def _on_data(self) -> None:
        if not self.busy and not self.finished and not self.scheduled:
            self.scheduled = True
            self.sim.clock.schedule(self.sim.clock.now, self.consume)

    def _on_wake(self, now: float) -> None:
        self._wake, self._wake_at = None, float("inf")
        if not self.busy and not self.finished:
            self.consume(now)

    def consume(self, now: float) -> None:
        self.scheduled = False
        engine = self.engine
        while not self.busy and not self.finished:
            if self.replay:
                polled = self.replay.popleft()
            else:
                step = engine.next(now)
                if step is None:  # every channel ended
                    if not self.spilled:
                        self._finish(now)
                    return
                if isinstance(step, Wait):
                    self._idle(now, step.until)
                    return
                if isinstance(step, Fail):  # a channel silent for partition_request_timeout_ms
                    raise step.error
                assert isinstance(step, BufferOrEvent)  # no linger is asked for
                polled = step
                if polled.buffer.is_buffer:  # each look at the gate takes one buffer here
                    engine.sample_gauges()
                if self._idle_since is not None:
                    engine.time.idle += now - self._idle_since
                    self._idle_since = engine.time.idle_since = None
            channel, buffer = polled.channel_index, polled.buffer
            if self.aligns_by_spilling and self.checkpoints.is_blocked(channel):
                self._spill(polled)
                continue
            if buffer.data_type.is_buffer:
                size = buffer.size
                self.bytes_per_channel[channel] += size
                batches, resume = engine.take(polled, round(now * 1e9), _keep)  # recycled once processed
                rows = self._check(channel, batches)
                self._resume(resume, now)
                self.busy = True
                cost = rows * self._record_size / self.rate + self.sim.buffer_cost
                self.sim.clock.schedule(now + cost, functools.partial(self._done, buffer=buffer))
                return
            if (
                self.aligns_by_spilling and buffer.data_type is DataType.EVENT_BUFFER and self._is_barrier(buffer)
            ):  # an aligned barrier travels as a plain event here: the handler sees it as what it is
                polled = polled._replace(buffer=Buffer(self.barrier_data_type, buffer.data))
            _, resume = engine.take(polled, round(now * 1e9), buffer.recycle)
            self._resume(resume, now)

    def _is_barrier(self, buffer: Buffer) -> bool:
        """Whether the plain event ``buffer`` is an aligned barrier of the model without credits."""
        try:
            return isinstance(decode_event(self.barrier_data_type, buffer.data), CheckpointBarrier)
        except BufferDecodeError:
            return False

    def _idle(self, now: float, until: float) -> None:
        """Nothing to read: idle time runs, and the engine's silence rule is checked again at ``until``."""
        if self._idle_since is None:
            self._idle_since = self.engine.time.idle_since = now
        if until < self._wake_at:
            self.sim.clock.cancel(self._wake)
            self._wake, self._wake_at = self.sim.clock.schedule(until, self._on_wake), until

    def _check(self, channel: int, batches: list[pa.RecordBatch]) -> int:
        """The decoded rows continue their channel's ``seq`` in order, each with its whole payload; how many
        rows ``batches`` hold.

        A buffer holds a few rows at scale (two or three per channel per flush at 800 tasks), so the values are
        read through memoryviews and compared as Python lists: cheaper per buffer than NumPy's per-call cost."""
        step, size = self._step[channel], self._payload_size
        total = 0
        for batch in batches:
            rows = batch.num_rows
            first = self._next_seq[channel]
            seq, payload = batch.columns
            if seq.null_count or payload.null_count:
                intact = False
            else:
                s, p = seq.offset, payload.offset
                values = memoryview(seq.buffers()[1]).cast("B").cast("q")[s : s + rows]
                offsets = memoryview(payload.buffers()[1]).cast("B").cast("i")
                intact = offsets[p + rows] - offsets[p] == rows * size and values.tolist() == list(
                    range(first, first + rows * step, step)
                )
            if not intact:
                self.in_order[channel] = False
            self._next_seq[channel] = first + rows * step
            self.records_per_channel[channel] += rows
            total += rows
        return total

    def _resume(self, channels: tuple[int, ...], now: float) -> None:
        """The barrier handler released ``channels``: resume their subpartitions (with credits) or replay
        what was spilled while they were blocked (without)."""
        if channels:
            self.engine.resumed(channels, now)
        if not self.aligns_by_spilling:
            for channel in channels:
                self.gate.resume_consumption(channel)
        elif self.spilled and not self.checkpoints.blocked_channels:
            self.spilled.extend(self.replay)  # the newer spill first, then what was still to replay
            self.replay, self.spilled = self.spilled, deque()

    def _spill(self, polled: BufferOrEvent) -> None:
        buffer = polled.buffer
        if buffer.data_type.is_buffer:
            spilled = Buffer(buffer.data_type, bytes(buffer.data))
            self.spilled_bytes += spilled.size
            buffer.recycle()
            polled = polled._replace(buffer=spilled)
        self.spilled.append(polled)

    def _done(self, now: float, buffer: Buffer) -> None:
        buffer.recycle()
        self.busy = False
        self.consume(now)

    def metric_rows(self, end: float) -> list[MetricRow]:
        """The engine's metric rows at the ``end`` of the run (idle time still going on ends there)."""
        if self._idle_since is not None:
            self.engine.time.idle += end - self._idle_since
            self._idle_since = self.engine.time.idle_since = None
        self.engine.time.stop(end)
        return self.engine.metric_rows(end)

    def _finish(self, now: float) -> None:
        self.finished = True
        self.finish_time = now
        self.engine.time.stop(now)
        self.sim.clock.cancel(self._wake)
        self._wake = None
        self.gate.close()
