"""Result subpartitions: where a producer's buffers wait for their consumer (docs/flink.md, "Result
partitions").

:class:`PipelinedSubpartition` is Flink's queue of buffer consumers and events with its exact backlog,
flush and notification rules. Consumers read a subpartition through a *view* (``get_next_buffer``,
``get_availability_and_backlog``), which tells its :class:`BufferAvailabilityListener` (a network reader or
a local input channel) when data appears.
The partitions that own subpartitions are in :mod:`spark_credit_shuffle.protocol.partition`; a blocking
partition's subpartitions are read through the same view interface
(:mod:`spark_credit_shuffle.protocol.blocking_partition`).

One Flink class, :class:`PipelinedSubpartition` with its backlog, flush, priority-event and
barrier-timeout rules, makes this module a little over 500 lines.

Not thread-safe: callers serialise access (one lock per task in a threaded runtime).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

from ..buffers.buffer import Buffer, BufferConsumer, DataType
from ..buffers.format import (
    CheckpointBarrier,
    MalformedPayload,
    decode_event_payload,
    encode_event,
    is_keep_alive,
)
from ..errors import PartitionStateError
from ._flags import HAS_PRIORITY, IS_BLOCKING_UPSTREAM, IS_BUFFER, IS_EVENT

__all__ = [
    "ADD_BUFFER_ERROR_CODE",
    "DEFAULT_BUFFER_SIZE",
    "AvailabilityWithBacklog",
    "BufferAndBacklog",
    "BufferAvailabilityListener",
    "OutputChannelStateWriter",
    "PipelinedSubpartition",
    "PipelinedSubpartitionView",
    "ResultSubpartitionView",
    "SubpartitionParent",
]

#: ``PipelinedSubpartition.add`` returns this when the subpartition is finished or released.
ADD_BUFFER_ERROR_CODE = -1
#: The desired buffer size while debloating is off (Flink's Integer.MAX_VALUE).
DEFAULT_BUFFER_SIZE = (1 << 31) - 1

_NONE = DataType.NONE


class BufferAndBacklog(NamedTuple):
    """A buffer polled from a subpartition view, with the backlog left behind it and the next data type."""

    buffer: Buffer
    backlog: int
    next_data_type: DataType
    sequence_number: int

    @property
    def is_data_available(self) -> bool:
        """Something else can be polled right away."""
        return self.next_data_type is not _NONE


class AvailabilityWithBacklog(NamedTuple):
    is_available: bool
    backlog: int


_NOT_AVAILABLE = AvailabilityWithBacklog(False, 0)
# NamedTuple construction goes through a Python-level __new__; the hot paths build them with tuple.__new__.
_new_tuple = tuple.__new__


@runtime_checkable
class BufferAvailabilityListener(Protocol):
    """Told when a subpartition view has something to poll (Flink's ``BufferAvailabilityListener``)."""

    def notify_data_available(self) -> None: ...

    def notify_priority_event(self, sequence_number: int) -> None: ...


class ResultSubpartitionView(Protocol):
    """What a reader polls (Flink's ``ResultSubpartitionView``)."""

    def get_next_buffer(self) -> BufferAndBacklog | None: ...

    def get_availability_and_backlog(self, credit_available: bool) -> AvailabilityWithBacklog: ...

    def resume_consumption(self) -> None: ...

    def release_all_resources(self) -> None: ...

    @property
    def is_released(self) -> bool: ...

    @property
    def failure_cause(self) -> BaseException | None: ...

    def notify_new_buffer_size(self, size: int) -> None: ...

    def acknowledge_all_data_processed(self) -> None: ...

    def acknowledge_checkpoint(self, checkpoint_id: int, declined: bool) -> None: ...

    def queue_length(self) -> int: ...


class SubpartitionParent(Protocol):
    """What a pipelined subpartition tells the partition it belongs to (Flink's ``parent``)."""

    def on_consumed_subpartition(self, subpartition: int) -> None: ...

    def on_subpartition_all_data_processed(self, subpartition: int) -> None: ...

    def on_checkpoint_acknowledged(self, subpartition: int, checkpoint_id: int, declined: bool) -> None: ...


def end_of_partition() -> Buffer:
    """The END_OF_PARTITION buffer a finished subpartition ends with."""
    return Buffer(DataType.END_OF_PARTITION, b"")


#: Flink's ``ChannelStateWriter.addOutputData`` for the output side: called with (checkpoint id,
#: subpartition index, the sizes in bytes of the data buffers an unaligned barrier overtook there, in queue
#: order). The output channel state is counted, not stored.
OutputChannelStateWriter = Callable[[int, int, list[int]], None]


def _checkpoint_barrier(consumer: BufferConsumer) -> CheckpointBarrier | None:
    """The checkpoint barrier a queued event carries, or None (another event, or bytes that do not decode)."""
    if not isinstance(consumer, Buffer):  # events are complete buffers; a builder's consumer holds data
        return None
    try:
        event = decode_event_payload(consumer.data_type, consumer.data)
    except MalformedPayload:
        return None
    return event if isinstance(event, CheckpointBarrier) else None


# -- pipelined subpartition -----------------------------------------------------------------------------


class PipelinedSubpartition:
    """One subpartition of a pipelined partition (Flink's ``PipelinedSubpartition``; docs/flink.md,
    "Pipelined subpartitions").

    A queue of buffer consumers, priority events first. ``buffers_in_backlog`` counts
    the data buffers in it; the reported backlog excludes the last data buffer while it may still be
    written. The reader is notified when the first *finished* element appears (adding the second element,
    or a lone element known to be finished), on a flush of unread data, and on finish. As in Flink, a
    consumer added before its builder finished is only known to be finished after the next ``build()``.
    """

    def __init__(self, index: int, parent: SubpartitionParent | None = None, receiver_exclusive_buffers: int = 2):
        self.index = index
        self.parent = parent
        self.receiver_exclusive_buffers_per_channel = receiver_exclusive_buffers
        self._buffers: deque[BufferConsumer] = deque()
        self._num_priority = 0
        self._tail_known_finished = False
        self.buffers_in_backlog = 0
        self.is_finished = False
        self.is_released = False
        self.flush_requested = False
        self.is_blocked = False
        #: Data-available notifications that flushes gave the reader (in Flink, each a task handed to a network
        #: thread: with buffer timeout 0, one per record whenever the reader has caught up).
        self.flush_notifications = 0
        self._sequence_number = 0
        self._buffer_size = DEFAULT_BUFFER_SIZE
        self._view: PipelinedSubpartitionView | None = None
        self._view_created = False
        #: Where the data buffers an unaligned barrier overtakes go (output channel state); None: not kept.
        self.channel_state_writer: OutputChannelStateWriter | None = None
        #: If set (:meth:`PipelinedResultPartition.track_queue_changes`), this subpartition's index goes in
        #: whenever its queue may have changed length: a sampler reads only the queues that changed.
        self.queue_changes: set[int] | None = None

    # -- writing --

    def add(self, consumer: BufferConsumer, partial_record_length: int = 0, *, finish: bool = False) -> int:
        """Queue ``consumer``; return the desired buffer size, or -1 if finished or released (the
        consumer is then closed). ``partial_record_length`` is part of Flink's contract (it serves
        unaligned checkpoints, which this stack does not take) and is not kept."""
        data_type = consumer.data_type
        if self.is_released or (self.is_finished and not (HAS_PRIORITY[data_type] and self._view is not None)):
            # after finish only a priority event still goes in, while a reader reads: ahead of what it has not
            # polled yet (END_OF_PARTITION included), or behind it, to overtake it in the consumer's queue
            # (the barrier of a checkpoint a finished producer still takes part in)
            consumer.close()
            return ADD_BUFFER_ERROR_CODE
        if self.queue_changes is not None:
            self.queue_changes.add(self.index)
        buffers = self._buffers
        if HAS_PRIORITY[data_type]:
            self._insert_priority(consumer)
            if self.channel_state_writer is not None and data_type is DataType.PRIORITIZED_EVENT_BUFFER:
                barrier = _checkpoint_barrier(consumer)
                if barrier is not None:  # an unaligned barrier: what it overtook is output channel state
                    self._persist_overtaken(barrier.id, len(buffers))
        else:
            buffers.append(consumer)
            self._tail_known_finished = type(consumer) is Buffer
            if IS_BUFFER[data_type]:
                self.buffers_in_backlog += 1
        view = self._view
        if finish:
            self.is_finished = True
            if view is not None:
                view.notify_data_available()
        elif view is not None and not (self.flush_requested or self.is_blocked):
            # notify when the first finished element appears (Flink: getNumberOfFinishedBuffers() == 1)
            n = len(buffers)
            if n == 2 or (n == 1 and self._tail_known_finished):
                view.notify_data_available()
        return self._buffer_size

    def _insert_priority(self, consumer: BufferConsumer) -> None:
        """A priority event goes before every non-priority element (a barrier also before the keep-alives
        there); the reader hears of every unaligned barrier as a priority event, of a keep-alive as data."""
        buffers = self._buffers
        position = self._num_priority
        keep_alive = is_keep_alive(consumer.data_type, getattr(consumer, "data", b""))
        if not keep_alive:  # a barrier goes ahead of the keep-alives queued ahead of the data too
            while position and is_keep_alive(
                buffers[position - 1].data_type, getattr(buffers[position - 1], "data", b"")
            ):
                position -= 1
        buffers.insert(position, consumer)
        self._num_priority += 1
        if len(buffers) == 1:
            self._tail_known_finished = True
        if not self.is_blocked and self._view is not None:
            if not keep_alive:
                # every barrier, also behind a keep-alive at the head: the reader moves the channel ahead
                self._view.notify_priority_event(self._sequence_number)
            elif self._num_priority == 1:
                self._view.notify_data_available()  # ahead in this queue, not ahead of other channels

    def _persist_overtaken(self, checkpoint_id: int, end: int) -> list[int]:
        """Hand the sizes of the data buffers queued between the priority elements and position ``end`` to
        the channel state writer (Flink's ``addOutputData`` in ``processPriorityBuffer``); returns them."""
        buffers = self._buffers
        sizes = [
            size
            for k in range(self._num_priority, end)
            if IS_BUFFER[buffers[k].data_type] and (size := buffers[k].unread_bytes())
        ]
        if sizes and self.channel_state_writer is not None:
            self.channel_state_writer(checkpoint_id, self.index, sizes)
        return sizes

    def aligned_barrier_timeout(self, checkpoint_id: int) -> list[int] | None:
        """The aligned checkpoint ``checkpoint_id`` timed out (Flink's ``alignedBarrierTimeout``): if its
        timeoutable barrier is still queued here, it becomes an unaligned barrier at the head, as a priority
        event, and the data buffers it overtook are output channel state (their sizes are returned and
        written). None if the barrier was already sent (or never added): nothing changes."""
        buffers = self._buffers
        for position in range(self._num_priority, len(buffers)):
            consumer = buffers[position]
            if consumer.data_type is DataType.TIMEOUTABLE_ALIGNED_CHECKPOINT_BARRIER:
                barrier = _checkpoint_barrier(consumer)
                if barrier is not None and barrier.id == checkpoint_id:
                    break
        else:
            return None
        if self.queue_changes is not None:
            self.queue_changes.add(self.index)
        sizes = self._persist_overtaken(checkpoint_id, position)
        del buffers[position]
        if position == len(buffers):  # it was the tail; what preceded it was finished before it was added
            self._tail_known_finished = True
        unaligned = CheckpointBarrier(barrier.id, barrier.timestamp, barrier.options.to_unaligned())
        self._insert_priority(encode_event(unaligned))
        return sizes

    def _finished_count(self) -> int:
        n = len(self._buffers)
        if n == 1:
            return 1 if self._tail_known_finished else 0
        return n - 1 if n else 0

    def notify_tail_finished(self) -> None:
        """The writer finished the builder whose consumer is last in the queue: it is a finished buffer now,
        which a reader may take (Flink learns this only from the next add or flush, so a producer stopped
        by its per-channel limit with that buffer alone in the queue would wait for its own buffer).

        For a receiver without exclusive buffers the backlog then counts it too: such a channel gets credit
        only for announced backlog, and the buffer is not one that may still be written."""
        buffers = self._buffers
        if not buffers or self._tail_known_finished or not IS_BUFFER[buffers[-1].data_type]:
            return
        self._tail_known_finished = True
        view = self._view
        if len(buffers) == 1 and view is not None and not (self.flush_requested or self.is_blocked):
            view.notify_data_available()

    def finish(self) -> int:
        """Append END_OF_PARTITION and notify the reader; nothing can be added afterwards."""
        return self.add(end_of_partition(), 0, finish=True)

    def flush(self) -> None:
        """Make the data queued so far consumable, including the unfinished last buffer."""
        buffers = self._buffers
        if not buffers or self.flush_requested:
            return
        data_in_last = len(buffers) == 1 and buffers[-1].is_data_available()
        notify = not self.is_blocked and data_in_last
        self.flush_requested = len(buffers) > 1 or data_in_last
        if notify and self._view is not None:
            self.flush_notifications += 1
            self._view.notify_data_available()

    def release(self) -> None:
        """Drop every queued consumer (their segments return to the pool) and refuse further adds."""
        if self.is_released:
            return
        for consumer in self._buffers:
            consumer.close()
        self._buffers.clear()
        if self.queue_changes is not None:
            self.queue_changes.add(self.index)
        self._num_priority = 0
        self.buffers_in_backlog = 0
        self.is_released = True
        view, self._view = self._view, None
        if view is not None:
            view.release_all_resources()

    def set_buffer_size(self, size: int) -> None:
        """Debloating: the desired size of new buffers (returned by :meth:`add`)."""
        if size <= 0:
            raise ValueError(f"buffer size must be > 0, got {size}")
        self._buffer_size = size

    # -- reading --

    def create_read_view(self, listener: BufferAvailabilityListener) -> PipelinedSubpartitionView:
        """The one view of this subpartition (a second one raises :class:`PartitionStateError`)."""
        if self.is_released:
            raise PartitionStateError(f"subpartition {self.index} is released")
        if self._view_created:
            raise PartitionStateError(f"subpartition {self.index} is being (or already has been) consumed")
        self._view_created = True
        view = PipelinedSubpartitionView(self, listener)
        self._view = view
        if self._buffers and (self._finished_count() > 0 or self.flush_requested or self.is_finished):
            view.notify_data_available()
        return view

    def poll_buffer(self) -> BufferAndBacklog | None:
        """The next buffer for the network or a local channel (Flink's ``pollBuffer``), or None."""
        if self.is_blocked:
            return None
        buffers = self._buffers
        if not buffers:
            self.flush_requested = False
            return None
        if self.queue_changes is not None:
            self.queue_changes.add(self.index)
        head = buffers[0]
        buffer: Buffer | None
        if type(head) is Buffer and not self._num_priority:
            # the common case: a complete buffer, its own consumer (_poll_head does the rest)
            buffers.popleft()
            buffer = head
            if not buffers:
                self.flush_requested = False
            data_type = buffer.data_type
            if IS_BUFFER[data_type]:
                self.buffers_in_backlog -= 1
                if not len(buffer.data) and self.receiver_exclusive_buffers_per_channel:
                    buffer.recycle()
                    return self.poll_buffer()
            elif IS_BLOCKING_UPSTREAM[data_type]:
                self.is_blocked = True
        else:
            buffer = self._poll_head()
            if buffer is None:
                return None
            if IS_BLOCKING_UPSTREAM[buffer.data_type]:
                self.is_blocked = True
        sequence = self._sequence_number
        self._sequence_number = sequence + 1
        if self.is_blocked or not buffers:
            return _new_tuple(BufferAndBacklog, (buffer, 0, _NONE, sequence))
        flush_requested = self.flush_requested
        in_backlog = self.buffers_in_backlog
        if (
            not (
                flush_requested
                or self.is_finished
                or (self._tail_known_finished and not self.receiver_exclusive_buffers_per_channel)
                or not IS_BUFFER[buffers[-1].data_type]
            )
            and in_backlog
        ):
            in_backlog -= 1  # the last data buffer may still be written
        if flush_requested or len(buffers) > 1 or self._tail_known_finished:
            return _new_tuple(BufferAndBacklog, (buffer, in_backlog, buffers[0].data_type, sequence))
        return _new_tuple(BufferAndBacklog, (buffer, in_backlog, _NONE, sequence))

    def _poll_head(self) -> Buffer | None:
        """Build from the head until a non-empty buffer or an event comes out (the loop of Flink's
        ``pollBuffer``); finished consumers leave the queue."""
        buffers = self._buffers
        while buffers:
            consumer = buffers[0]
            buffer = consumer.build()
            finished = consumer.is_finished()
            if len(buffers) == 1:
                self.flush_requested = False
                self._tail_known_finished = finished
            if finished:
                buffers.popleft()
                if self._num_priority:
                    self._num_priority -= 1
                if IS_BUFFER[consumer.data_type]:
                    self.buffers_in_backlog -= 1
                if self.receiver_exclusive_buffers_per_channel == 0:
                    return buffer  # even empty: a receiver without exclusive buffers must get its credit back
            if len(buffer.data) or not IS_BUFFER[buffer.data_type]:
                return buffer
            buffer.recycle()
            if not finished:
                return None
        return None

    def is_data_available(self) -> bool:
        """Something can be polled with credit (Flink's ``isDataAvailableUnsafe``)."""
        return not self.is_blocked and (self.flush_requested or self._finished_count() > 0)

    def next_data_type(self) -> DataType:
        """Type of the head of the queue, NONE if empty."""
        return self._buffers[0].data_type if self._buffers else _NONE

    def get_buffers_in_backlog(self) -> int:
        """The backlog a reader reports: data buffers that can be sent, excluding one still being written."""
        buffers = self._buffers
        if self.is_blocked or not buffers:
            return 0
        if (
            self.flush_requested
            or self.is_finished
            or (self._tail_known_finished and not self.receiver_exclusive_buffers_per_channel)
            or not IS_BUFFER[buffers[-1].data_type]
        ):
            return self.buffers_in_backlog
        return max(self.buffers_in_backlog - 1, 0)

    def get_availability_and_backlog(self, credit_available: bool) -> AvailabilityWithBacklog:
        """With credit: data available; without: the head is an event (events need no credit)."""
        buffers = self._buffers
        if self.is_blocked or not buffers:
            return _NOT_AVAILABLE
        flush_requested = self.flush_requested
        in_backlog = self.buffers_in_backlog
        if not (
            flush_requested
            or self.is_finished
            or (self._tail_known_finished and not self.receiver_exclusive_buffers_per_channel)
            or not IS_BUFFER[buffers[-1].data_type]
        ):
            in_backlog = in_backlog - 1 if in_backlog > 0 else 0
        if credit_available:
            available = flush_requested or len(buffers) > 1 or self._tail_known_finished
        else:
            available = IS_EVENT[buffers[0].data_type]
        return _new_tuple(AvailabilityWithBacklog, (available, in_backlog))

    def resume_consumption(self) -> None:
        """Unblock after an upstream-blocking event (aligned barrier) was consumed."""
        if not self.is_blocked:
            raise PartitionStateError(f"subpartition {self.index} should be blocked to resume consumption")
        self.is_blocked = False

    def on_view_released(self) -> None:
        self._view = None
        if self.parent is not None:
            self.parent.on_consumed_subpartition(self.index)

    @property
    def has_reader(self) -> bool:
        """A reader reads this subpartition (its view was created and not released)."""
        return self._view is not None and not self.is_released

    @property
    def is_sent_to_reader(self) -> bool:
        """Finished, and its reader (still there) polled everything, END_OF_PARTITION included."""
        return self.is_finished and not self._buffers and self._view is not None and not self.is_released

    # -- metrics --

    def queue_length(self) -> int:
        """Elements queued: data, events and the open buffer (``outputQueueLength`` of one subpartition)."""
        return len(self._buffers)

    def __repr__(self) -> str:
        return (
            f"PipelinedSubpartition(index={self.index}, queued={len(self._buffers)}, backlog="
            f"{self.buffers_in_backlog}, flush_requested={self.flush_requested}, finished={self.is_finished}, "
            f"blocked={self.is_blocked}, released={self.is_released})"
        )


class PipelinedSubpartitionView:
    """The read view of one pipelined subpartition; forwards to it and to its listener."""

    __slots__ = (
        "_listener",
        "_released",
        "failure_cause",
        "get_availability_and_backlog",
        "get_next_buffer",
        "notify_data_available",
        "parent",
    )

    def __init__(self, parent: PipelinedSubpartition, listener: BufferAvailabilityListener) -> None:
        self.parent = parent
        self._listener = listener
        self._released = False
        self.failure_cause: BaseException | None = None
        #: The next buffer, or None (the subpartition's ``poll_buffer``, bound directly: it is the hot path).
        self.get_next_buffer: Callable[[], BufferAndBacklog | None] = parent.poll_buffer
        #: Tell the listener that data is available (bound directly, as above).
        self.notify_data_available: Callable[[], None] = listener.notify_data_available
        #: With credit: data available; without: an event at the head (bound directly, as above).
        self.get_availability_and_backlog: Callable[[bool], AvailabilityWithBacklog] = (
            parent.get_availability_and_backlog
        )

    def notify_priority_event(self, sequence_number: int) -> None:
        self._listener.notify_priority_event(sequence_number)

    def resume_consumption(self) -> None:
        self.parent.resume_consumption()

    def notify_new_buffer_size(self, size: int) -> None:
        self.parent.set_buffer_size(size)

    def acknowledge_all_data_processed(self) -> None:
        if self.parent.parent is not None:
            self.parent.parent.on_subpartition_all_data_processed(self.parent.index)

    def acknowledge_checkpoint(self, checkpoint_id: int, declined: bool) -> None:
        if self.parent.parent is not None:
            self.parent.parent.on_checkpoint_acknowledged(self.parent.index, checkpoint_id, declined)

    def release_all_resources(self) -> None:
        """The consumer is done (or gone): counts as consumption; releases the subpartition."""
        if self._released:
            return
        self._released = True
        self.parent.release()
        self.parent.on_view_released()

    @property
    def is_released(self) -> bool:
        return self._released or self.parent.is_released

    def queue_length(self) -> int:
        return self.parent.queue_length()

    @property
    def backlog(self) -> int:
        return self.parent.get_buffers_in_backlog()
