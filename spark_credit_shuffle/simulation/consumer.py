"""A simulated consumer subtask: reads its gate at a rate and aligns checkpoint barriers, with credits as
current Flink does and without as Flink did before credits (see :mod:`.checkpoints`)."""

from __future__ import annotations

import functools
import hashlib
from collections import deque

from ..buffers.buffer import Buffer, DataType
from ..buffers.format import CheckpointBarrier, barrier_data_type, decode_event
from ..protocol.checkpointing import SingleCheckpointBarrierHandler
from ..protocol.gate import SingleInputGate
from .clock import Context

__all__ = ["SimulatedConsumer"]


class SimulatedConsumer:
    """Reads its gate and spends ``size / rate`` virtual seconds on each data buffer before recycling it.

    Without credits, aligned checkpoints align at the consumer (see :func:`barrier_buffer`): what a
    channel blocked by the pending alignment delivers is spilled (its network buffer recycled at once, the
    spill assumed free) and replayed before new input when the alignment ends."""

    def __init__(self, sim: Context, index: int, gate: SingleInputGate, rate: float, producers: list[int]) -> None:
        self.sim = sim
        self.index = index
        self.gate = gate
        self.rate = rate
        self.producers = producers
        self.digests = [hashlib.blake2b(digest_size=16) for _ in producers]
        self.bytes_per_channel = [0] * len(producers)
        self.buffers_per_channel = [0] * len(producers)
        self.channel_finish_time: list[float | None] = [None] * len(producers)
        self.busy = False
        self.finished = False
        self.finish_time: float | None = None
        self.scheduled = False
        self.checkpoints = SingleCheckpointBarrierHandler(len(producers))
        #: Model without credits: spilled (channel, buffer, sequence number) of blocked channels, and the
        #: spilled items to replay before the gate.
        self.aligns_by_spilling = not sim.config.credit_based
        self.barrier_data_type = barrier_data_type(sim.config.checkpoint_options)
        self.spilled: deque[tuple[int, Buffer, int]] = deque()
        self.replay: deque[tuple[int, Buffer, int]] = deque()
        self.spilled_bytes = 0
        gate.listener = self._on_data

    @property
    def checkpoint_done(self) -> int:
        """The last checkpoint this consumer aligned (the one pending not counted)."""
        handler = self.checkpoints
        return handler.current_checkpoint_id - (1 if handler.is_checkpoint_pending else 0)

    @property
    def bytes_consumed(self) -> int:
        return sum(self.bytes_per_channel)

    def _on_data(self) -> None:
        if not self.busy and not self.finished and not self.scheduled:
            self.scheduled = True
            self.sim.clock.schedule(self.sim.clock.now, self.consume)

    def consume(self, now: float) -> None:
        self.scheduled = False
        while not self.busy and not self.finished:
            if self.replay:
                channel, buffer, sequence_number = self.replay.popleft()
            else:
                boe = self.gate.poll_next()
                if boe is None:
                    if self.gate.is_finished and not self.spilled:
                        self._finish(now)
                    return
                buffer, channel, sequence_number = boe.buffer, boe.channel_index, boe.sequence_number
            if self.aligns_by_spilling and self.checkpoints.is_blocked(channel):
                self._spill(channel, buffer, sequence_number)
                continue
            data_type = buffer.data_type
            if data_type.is_buffer:
                size = buffer.size
                self.checkpoints.process_buffer(channel, sequence_number, size)
                self.digests[channel].update(buffer.data)
                self.bytes_per_channel[channel] += size
                self.buffers_per_channel[channel] += 1
                self.busy = True
                self.sim.clock.schedule(now + size / self.rate, functools.partial(self._done, buffer=buffer))
                return
            if self.aligns_by_spilling and data_type is DataType.EVENT_BUFFER:
                data_type = self.barrier_data_type  # an aligned barrier travels as a plain event here
            event = decode_event(data_type, buffer.data)
            buffer.recycle()
            now_ns = round(now * 1e9)
            if isinstance(event, CheckpointBarrier):
                self._resume(self.checkpoints.process_barrier(channel, event, now_ns, sequence_number))
            elif data_type is DataType.END_OF_PARTITION:
                self.channel_finish_time[channel] = now
                self._resume(self.checkpoints.process_end_of_partition(channel, now_ns))

    def _resume(self, channels: tuple[int, ...]) -> None:
        """The barrier handler released ``channels``: resume their subpartitions (with credits) or replay
        what was spilled while they were blocked (without)."""
        if not self.aligns_by_spilling:
            for channel in channels:
                self.gate.resume_consumption(channel)
        elif self.spilled and not self.checkpoints.blocked_channels:
            self.spilled.extend(self.replay)  # the newer spill first, then what was still to replay
            self.replay, self.spilled = self.spilled, deque()

    def _spill(self, channel: int, buffer: Buffer, sequence_number: int) -> None:
        if buffer.data_type.is_buffer:
            spilled = Buffer(buffer.data_type, bytes(buffer.data))
            self.spilled_bytes += spilled.size
            buffer.recycle()
            buffer = spilled
        self.spilled.append((channel, buffer, sequence_number))

    def _done(self, now: float, buffer: Buffer) -> None:
        buffer.recycle()
        self.busy = False
        self.consume(now)

    def _finish(self, now: float) -> None:
        self.finished = True
        self.finish_time = now
        self.gate.close()
