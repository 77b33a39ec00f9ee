"""Consumer-side checkpoint barrier handling, as Flink's ``SingleCheckpointBarrierHandler`` does it.

A consumer subtask reads N input channels. Each producer puts a :class:`CheckpointBarrier` with the same
checkpoint id into every one of its subpartitions; the consumer's handler sees the barriers arrive one
channel at a time and decides what happens to the channels in between:

* **Aligned** (``ALIGNED_CHECKPOINT_BARRIER``): the channel that delivered barrier *n* gets no more data
  (its subpartition blocked itself when it sent the barrier, see ``PipelinedSubpartition.poll_buffer``)
  until barrier *n* arrived on every open channel. Then the checkpoint completes and every blocked channel
  is resumed (``ResumeConsumption``). The time from the first to the last barrier is
  ``checkpointAlignmentTime``.
* **Unaligned** (``PRIORITIZED_EVENT_BUFFER``): the barrier overtook the buffers queued ahead of it. The
  checkpoint starts at the first barrier; from then on, every buffer consumed on a channel that is still
  *before* its barrier is captured as **channel state** (Flink's ``ChannelStatePersister``): on a channel
  whose barrier has not arrived, every buffer; on a channel whose barrier overtook buffers, those whose
  sequence number is lower than the barrier's. Nothing blocks.
* **Aligned with timeout** (``TIMEOUTABLE_ALIGNED_CHECKPOINT_BARRIER``): aligned, until the alignment has
  taken longer than the barrier's ``aligned_checkpoint_timeout_ms``; then it switches to unaligned: the
  blocked channels resume and the channels still before their barrier start capturing.

``EndOfPartition`` closes a channel for good: it no longer counts for alignment, so a barrier after it on
the other channels completes alignment (and an ``EndOfPartition`` on the last missing channel does). A
barrier of a later checkpoint aborts an incomplete one (subsumed), as does a :class:`CancelCheckpointMarker`
for it; barriers of aborted or completed checkpoints are ignored (a blocked channel is resumed at once).

Sequence numbers are each channel's own order of its buffers and barriers as the producer added them
(the order the consumer would see without overtaking). Sans-IO: the caller passes ``now_ns`` (wall-clock
nanoseconds since the epoch, to compare with a barrier's millisecond timestamp) and carries out the
returned :class:`ResumeConsumption` channel indices; nothing here reads a clock.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from ..buffers.format import AlignmentType, CancelCheckpointMarker, CheckpointBarrier
from ..errors import ProtocolError

__all__ = [
    "AbortedCheckpoint",
    "BarrierHandlerState",
    "ChannelStatePersister",
    "CheckpointStatus",
    "CompletedCheckpoint",
    "SingleCheckpointBarrierHandler",
]

#: Called with (checkpoint id, channel, sequence number, size in bytes) for each captured buffer
#: (Flink's ``ChannelStateWriter.addInputData``).
ChannelStateWriter = Callable[[int, int, int, int], None]


class BarrierHandlerState(enum.Enum):
    """Flink's ``BarrierHandlerState`` implementations, one per name."""

    WAITING_FOR_FIRST_BARRIER = "WaitingForFirstBarrier"
    COLLECTING_BARRIERS = "CollectingBarriers"
    COLLECTING_BARRIERS_UNALIGNED = "CollectingBarriersUnaligned"


class CheckpointStatus(enum.Enum):
    """Flink's ``ChannelStatePersister.CheckpointStatus``."""

    COMPLETED = "completed"
    BARRIER_PENDING = "barrier pending"
    BARRIER_RECEIVED = "barrier received"


@dataclasses.dataclass(frozen=True, slots=True)
class CompletedCheckpoint:
    """A checkpoint whose barriers arrived on every open channel of this consumer subtask."""

    checkpoint_id: int
    #: ``ALIGNED`` or ``UNALIGNED`` (an aligned-with-timeout checkpoint that timed out is ``UNALIGNED``).
    alignment: AlignmentType
    timed_out: bool
    #: ``checkpointAlignmentTime``: first barrier to last barrier on this subtask.
    alignment_time_ns: int
    #: ``checkpointStartDelayNanos``: the barrier's trigger timestamp to its first arrival here.
    start_delay_ns: int
    #: Channel state captured (unaligned) up to completion: buffers and their bytes (overtaken buffers
    #: consumed later count in ``SingleCheckpointBarrierHandler.channel_state_bytes``).
    persisted_buffers: int
    persisted_bytes: int
    #: ``now_ns`` of the first and the last barrier.
    start_ns: int
    end_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class AbortedCheckpoint:
    """A checkpoint this subtask gave up: subsumed by a later barrier, or cancelled by a marker."""

    checkpoint_id: int
    reason: str


class ChannelStatePersister:
    """Flink's ``ChannelStatePersister`` for one input channel: decides which consumed buffers belong to
    the channel state of which unaligned checkpoint.

    One entry per checkpoint still capturing here: ``BARRIER_PENDING`` (its barrier has not arrived:
    every consumed buffer is in flight at the checkpoint) or ``BARRIER_RECEIVED`` at sequence number *b*
    (the barrier overtook the buffers numbered below *b*; the entry ends at the first buffer above *b*).
    A buffer overtaken by two checkpoints' barriers belongs to both channel states, once to each.
    """

    __slots__ = ("_entries", "channel")

    def __init__(self, channel: int) -> None:
        self.channel = channel
        #: [checkpoint id, status, barrier sequence number] (mutable: the status and number change in place)
        self._entries: list[list[Any]] = []

    def status(self, checkpoint_id: int) -> CheckpointStatus:
        for entry in self._entries:
            if entry[0] == checkpoint_id:
                return entry[1]  # type: ignore[no-any-return]  # entries hold a CheckpointStatus there
        return CheckpointStatus.COMPLETED

    @property
    def is_persisting(self) -> bool:
        return bool(self._entries)

    def start_persisting(self, checkpoint_id: int) -> None:
        """The checkpoint started and this channel's barrier has not arrived: capture from now on."""
        self._entries.append([checkpoint_id, CheckpointStatus.BARRIER_PENDING, -1])

    def check_for_barrier(self, checkpoint_id: int, sequence_number: int) -> None:
        """This channel's barrier arrived: only the buffers it overtook (lower sequence numbers) remain."""
        for entry in self._entries:
            if entry[0] == checkpoint_id and entry[1] is CheckpointStatus.BARRIER_PENDING:
                entry[1] = CheckpointStatus.BARRIER_RECEIVED
                entry[2] = sequence_number

    def stop_persisting(self, checkpoint_id: int | None = None, pending_only: bool = False) -> None:
        """Stop capturing for ``checkpoint_id`` (every checkpoint if None); ``pending_only`` keeps the
        entries whose barrier arrived (their overtaken buffers are still to come)."""
        self._entries = [
            e
            for e in self._entries
            if not (
                (checkpoint_id is None or e[0] == checkpoint_id)
                and (not pending_only or e[1] is CheckpointStatus.BARRIER_PENDING)
            )
        ]

    def maybe_persist(self, sequence_number: int) -> list[int]:
        """The checkpoints whose channel state the buffer numbered ``sequence_number``, consumed now, is in."""
        hits: list[int] = []
        keep: list[list[Any]] = []
        for entry in self._entries:
            if entry[1] is CheckpointStatus.BARRIER_PENDING or sequence_number < entry[2]:
                hits.append(entry[0])
                keep.append(entry)
            # else: a buffer behind the barrier: every overtaken one was consumed, the entry ends
        self._entries = keep
        return hits


class SingleCheckpointBarrierHandler:
    """One consumer subtask's barrier alignment over ``num_channels`` input channels (module docstring)."""

    def __init__(self, num_channels: int, channel_state_writer: ChannelStateWriter | None = None) -> None:
        if num_channels < 1:
            raise ValueError(f"num_channels must be at least 1, got {num_channels}")
        self.num_channels = num_channels
        self.state = BarrierHandlerState.WAITING_FOR_FIRST_BARRIER
        self._writer = channel_state_writer
        self._persisters = [ChannelStatePersister(c) for c in range(num_channels)]
        self._closed: set[int] = set()
        self._received: set[int] = set()  # channels that delivered the pending checkpoint's barrier
        self._blocked: set[int] = set()
        #: The highest checkpoint id seen (pending, completed or aborted); lower or equal ids are done.
        self.current_checkpoint_id = -1
        self._pending = False
        self._options_timeout_ms = -1
        self._timed_out = False
        self._start_ns = 0
        self._start_delay_ns = 0
        self._persisted_buffers = 0
        self._persisted_bytes = 0
        self.completed: list[CompletedCheckpoint] = []
        #: Channel state bytes per checkpoint, including overtaken buffers consumed after it completed.
        self.channel_state_bytes: dict[int, int] = {}
        self.aborted: list[AbortedCheckpoint] = []

    # -- queries -----------------------------------------------------------------------------------

    def is_blocked(self, channel: int) -> bool:
        """The channel delivered the pending aligned barrier and gets no data until alignment ends."""
        return channel in self._blocked

    @property
    def blocked_channels(self) -> frozenset[int]:
        return frozenset(self._blocked)

    @property
    def pending_checkpoint_id(self) -> int | None:
        return self.current_checkpoint_id if self._pending else None

    @property
    def is_checkpoint_pending(self) -> bool:
        return self._pending

    # -- inputs ------------------------------------------------------------------------------------

    def process_barrier(
        self, channel: int, barrier: CheckpointBarrier, now_ns: int, sequence_number: int = -1
    ) -> tuple[int, ...]:
        """Barrier ``barrier`` arrived on ``channel``; returns the channels to resume (``ResumeConsumption``)."""
        self._check_channel(channel)
        if channel in self._closed:
            raise ProtocolError(f"checkpoint barrier {barrier.id} on channel {channel} after its EndOfPartition")
        blocks = not barrier.options.is_unaligned and barrier.options.alignment is not AlignmentType.AT_LEAST_ONCE
        resume: list[int] = []
        if barrier.id < self.current_checkpoint_id or (barrier.id == self.current_checkpoint_id and not self._pending):
            return (channel,) if blocks else ()  # a finished or aborted checkpoint's barrier: let it pass
        if barrier.id > self.current_checkpoint_id:
            if self._pending:
                resume += self._abort(f"subsumed by checkpoint {barrier.id}")
            self._start(barrier, now_ns)
        elif channel in self._received:
            raise ProtocolError(f"channel {channel} delivered checkpoint barrier {barrier.id} twice")
        self._received.add(channel)
        if self.state is BarrierHandlerState.COLLECTING_BARRIERS and barrier.options.is_unaligned:
            resume += self._switch_to_unaligned(now_ns, timed_out=False)  # an unaligned barrier overtook
        if self.state is BarrierHandlerState.COLLECTING_BARRIERS:
            if blocks:
                self._blocked.add(channel)
        else:
            self._persisters[channel].check_for_barrier(barrier.id, sequence_number)
            if blocks:
                resume.append(channel)
        resume += self._check_completion(now_ns)
        if self._pending:
            resume += self.check_alignment_timeout(now_ns)
        return tuple(resume)

    def process_buffer(self, channel: int, sequence_number: int, size: int) -> bool:
        """A data buffer of ``size`` bytes was consumed from ``channel``; True if captured as channel state."""
        if channel in self._blocked:
            raise ProtocolError(f"channel {channel} delivered data while blocked by checkpoint barrier")
        persister = self._persisters[channel]
        if not persister.is_persisting:
            return False
        checkpoints = persister.maybe_persist(sequence_number)
        for checkpoint_id in checkpoints:
            self.channel_state_bytes[checkpoint_id] = self.channel_state_bytes.get(checkpoint_id, 0) + size
            if self._writer is not None:
                self._writer(checkpoint_id, channel, sequence_number, size)
        if self._pending and self.current_checkpoint_id in checkpoints:
            self._persisted_buffers += 1
            self._persisted_bytes += size
        return bool(checkpoints)

    def process_end_of_partition(self, channel: int, now_ns: int) -> tuple[int, ...]:
        """``channel`` finished: it no longer counts for alignment (may complete the pending one)."""
        self._check_channel(channel)
        self._closed.add(channel)
        self._persisters[channel].stop_persisting()  # nothing follows EndOfPartition
        return tuple(self._check_completion(now_ns)) if self._pending else ()

    def process_cancellation_barrier(
        self, channel: int, marker: CancelCheckpointMarker, now_ns: int
    ) -> tuple[int, ...]:
        """A ``CancelCheckpointMarker`` arrived: abort that checkpoint if it is pending or not yet started."""
        self._check_channel(channel)
        checkpoint_id = marker.checkpoint_id
        if checkpoint_id < self.current_checkpoint_id or (
            checkpoint_id == self.current_checkpoint_id and not self._pending
        ):
            return ()
        resume: list[int] = []
        if checkpoint_id > self.current_checkpoint_id:
            if self._pending:
                resume += self._abort(f"subsumed by checkpoint {checkpoint_id}")
            self.current_checkpoint_id = checkpoint_id
            self.aborted.append(AbortedCheckpoint(checkpoint_id, f"cancelled upstream (channel {channel})"))
            return tuple(resume)
        resume += self._abort(f"cancelled upstream (channel {channel})")
        return tuple(resume)

    def check_alignment_timeout(self, now_ns: int) -> tuple[int, ...]:
        """Switch a timeoutable aligned checkpoint to unaligned once alignment took longer than its timeout
        (the caller's timer calls this; every input does too)."""
        if (
            self.state is BarrierHandlerState.COLLECTING_BARRIERS
            and self._options_timeout_ms >= 0
            and now_ns - self._start_ns > self._options_timeout_ms * 1_000_000
        ):
            return tuple(self._switch_to_unaligned(now_ns, timed_out=True))
        return ()

    # -- internals ---------------------------------------------------------------------------------

    def _check_channel(self, channel: int) -> None:
        if not 0 <= channel < self.num_channels:
            raise ProtocolError(f"channel {channel} outside [0, {self.num_channels})")

    def _start(self, barrier: CheckpointBarrier, now_ns: int) -> None:
        self.current_checkpoint_id = barrier.id
        self._pending = True
        self._timed_out = False
        self._start_ns = now_ns
        self._start_delay_ns = max(0, now_ns - barrier.timestamp * 1_000_000)
        self._persisted_buffers = self._persisted_bytes = 0
        self._options_timeout_ms = barrier.options.aligned_checkpoint_timeout_ms
        self._received.clear()
        if barrier.options.is_unaligned:
            self.state = BarrierHandlerState.COLLECTING_BARRIERS_UNALIGNED
            self._start_persisting()
        else:
            self.state = BarrierHandlerState.COLLECTING_BARRIERS

    def _start_persisting(self) -> None:
        for channel, persister in enumerate(self._persisters):
            if channel not in self._closed and channel not in self._received:
                persister.start_persisting(self.current_checkpoint_id)

    def _switch_to_unaligned(self, now_ns: int, timed_out: bool) -> list[int]:
        self.state = BarrierHandlerState.COLLECTING_BARRIERS_UNALIGNED
        self._timed_out = timed_out
        self._start_persisting()
        resume = sorted(self._blocked)
        self._blocked.clear()
        return resume

    def _check_completion(self, now_ns: int) -> list[int]:
        if any(c not in self._received and c not in self._closed for c in range(self.num_channels)):
            return []
        unaligned = self.state is BarrierHandlerState.COLLECTING_BARRIERS_UNALIGNED
        self.completed.append(
            CompletedCheckpoint(
                self.current_checkpoint_id,
                AlignmentType.UNALIGNED if unaligned else AlignmentType.ALIGNED,
                self._timed_out,
                now_ns - self._start_ns,
                self._start_delay_ns,
                self._persisted_buffers,
                self._persisted_bytes,
                self._start_ns,
                now_ns,
            )
        )
        return self._finish()

    def _abort(self, reason: str) -> list[int]:
        self.aborted.append(AbortedCheckpoint(self.current_checkpoint_id, reason))
        for persister in self._persisters:
            persister.stop_persisting(self.current_checkpoint_id)
        self.channel_state_bytes.pop(self.current_checkpoint_id, None)
        return self._finish()

    def _finish(self) -> list[int]:
        """Back to waiting: nothing pending, no channel blocked; channels stop capturing once their barrier
        arrived (those still before it keep capturing the buffers it overtakes)."""
        self._pending = False
        self.state = BarrierHandlerState.WAITING_FOR_FIRST_BARRIER
        for persister in self._persisters:
            persister.stop_persisting(self.current_checkpoint_id, pending_only=True)
        resume = sorted(self._blocked)
        self._blocked.clear()
        self._received.clear()
        return resume
