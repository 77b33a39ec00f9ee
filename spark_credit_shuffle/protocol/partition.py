"""Result partitions and subpartitions: where a producer's buffers wait for their consumer (§3 of the reference).

:class:`PipelinedSubpartition` is Flink's queue of buffer consumers and events with its exact backlog,
flush and notification rules; :class:`PipelinedResultPartition` and :class:`BlockingResultPartition`
implement the ``ResultPartitionWriter`` contract the RecordWriter writes to. Consumers read a subpartition
through a *view* (``get_next_buffer``, ``get_availability_and_backlog``), which tells its
:class:`BufferAvailabilityListener` (a network reader or a local input channel) when data appears.

:class:`BoundedBlockingSubpartitionReader` replays stored buffers (a finished blocking partition, or the
buffers a consumer task fetched from Spark's shuffle) through the same view interface, so blocking and
pipelined exchanges share every reader, queue and input channel.

Not thread-safe: callers serialise access (one lock per task in a threaded runtime).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, Protocol, runtime_checkable

from ..buffers.buffer import Buffer, BufferConsumer, ByteBufferBuilder, DataType
from ..buffers.writer import ResultPartitionWriter
from ..config import NetworkConfig
from ..errors import PartitionNotFoundError, PartitionStateError
from ._flags import HAS_PRIORITY, IS_BLOCKING_UPSTREAM, IS_BUFFER, IS_EVENT
from .pools import LocalBufferPool, NetworkBufferPool, PartitionType, SegmentRecycler, result_partition_pool_size

__all__ = [
    "ADD_BUFFER_ERROR_CODE",
    "DEFAULT_BUFFER_SIZE",
    "AvailabilityWithBacklog",
    "BlockingResultPartition",
    "BoundedBlockingSubpartitionReader",
    "BufferAndBacklog",
    "BufferAvailabilityListener",
    "PipelinedResultPartition",
    "PipelinedSubpartition",
    "PipelinedSubpartitionView",
    "ResultPartitionManager",
    "ResultPartitionWriter",
    "ResultSubpartitionView",
    "StoredBuffer",
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

    def queue_length(self) -> int: ...


def _end_of_partition() -> Buffer:
    return Buffer(DataType.END_OF_PARTITION, b"")


# -- pipelined subpartition -----------------------------------------------------------------------------


class PipelinedSubpartition:
    """One subpartition of a pipelined partition (Flink's ``PipelinedSubpartition``, §3.2).

    A queue of buffer consumers, priority events first. ``buffers_in_backlog`` counts
    the data buffers in it; the reported backlog excludes the last data buffer while it may still be
    written. The reader is notified when the first *finished* element appears (adding the second element,
    or a lone element known to be finished), on a flush of unread data, and on finish. As in Flink, a
    consumer added before its builder finished is only known to be finished after the next ``build()``.
    """

    def __init__(self, index: int, parent: PipelinedResultPartition | None = None, receiver_exclusive_buffers: int = 2):
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
        self._sequence_number = 0
        self._buffer_size = DEFAULT_BUFFER_SIZE
        self._view: PipelinedSubpartitionView | None = None
        self._view_created = False

    # -- writing --

    def add(self, consumer: BufferConsumer, partial_record_length: int = 0, *, finish: bool = False) -> int:
        """Queue ``consumer``; return the desired buffer size, or -1 if finished or released (the
        consumer is then closed). ``partial_record_length`` is part of Flink's contract (it serves
        unaligned checkpoints, which this stack does not take) and is not kept."""
        if self.is_finished or self.is_released:
            consumer.close()
            return ADD_BUFFER_ERROR_CODE
        data_type = consumer.data_type
        buffers = self._buffers
        if HAS_PRIORITY[data_type]:
            self._insert_priority(consumer)
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
        """A priority event goes before every non-priority element; the reader hears of the first one."""
        buffers = self._buffers
        buffers.insert(self._num_priority, consumer)
        self._num_priority += 1
        if len(buffers) == 1:
            self._tail_known_finished = True
        if self._num_priority == 1 and not self.is_blocked and self._view is not None:
            self._view.notify_priority_event(self._sequence_number)

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
        return self.add(_end_of_partition(), 0, finish=True)

    def flush(self) -> None:
        """Make the data queued so far consumable, including the unfinished last buffer."""
        buffers = self._buffers
        if not buffers or self.flush_requested:
            return
        data_in_last = len(buffers) == 1 and buffers[-1].is_data_available()
        notify = not self.is_blocked and data_in_last
        self.flush_requested = len(buffers) > 1 or data_in_last
        if notify and self._view is not None:
            self._view.notify_data_available()

    def release(self) -> None:
        """Drop every queued consumer (their segments return to the pool) and refuse further adds."""
        if self.is_released:
            return
        for consumer in self._buffers:
            consumer.close()
        self._buffers.clear()
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
        head = buffers[0]
        if type(head) is Buffer and not self._num_priority:
            # the common case: a complete buffer, its own consumer (_poll_head does the rest)
            buffers.popleft()
            buffer = head
            if not buffers:
                self.flush_requested = False
            data_type = buffer.data_type
            if IS_BUFFER[data_type]:
                self.buffers_in_backlog -= 1
                if not len(buffer.data) and self.receiver_exclusive_buffers_per_channel:  # type: ignore[arg-type]
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
            if len(buffer.data) or not IS_BUFFER[buffer.data_type]:  # type: ignore[arg-type]
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
    def is_sent_to_reader(self) -> bool:
        """Finished, and its reader (still there) polled everything, END_OF_PARTITION included."""
        return self.is_finished and not self._buffers and self._view is not None and not self.is_released

    # -- metrics --

    def queue_length(self) -> int:
        """Elements queued: data, events and the open buffer (``outputQueueLength`` of one subpartition)."""
        return len(self._buffers)

    @property
    def num_priority_elements(self) -> int:
        return self._num_priority

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


# -- pipelined partition --------------------------------------------------------------------------------


class PipelinedResultPartition:
    """A producer subtask's pipelined output: N subpartitions sharing one LocalBufferPool.

    Implements ``ResultPartitionWriter``. Released (subpartitions dropped, pool destroyed) once every
    subpartition was consumed and the producer called :meth:`close`, as Flink's reference count N + 1.
    """

    def __init__(
        self,
        num_subpartitions: int,
        buffer_pool: LocalBufferPool,
        *,
        partition_id: int = 0,
        receiver_exclusive_buffers: int = 2,
    ) -> None:
        if num_subpartitions < 1:
            raise ValueError(f"num_subpartitions must be >= 1, got {num_subpartitions}")
        if len(buffer_pool.subpartition_buffers_count) < num_subpartitions:
            raise ValueError(
                f"buffer pool counts {len(buffer_pool.subpartition_buffers_count)} subpartitions, "
                f"the partition has {num_subpartitions}"
            )
        self.num_subpartitions = num_subpartitions
        self.partition_id = partition_id
        self.buffer_pool = buffer_pool
        self.subpartitions = [
            PipelinedSubpartition(i, self, receiver_exclusive_buffers) for i in range(num_subpartitions)
        ]
        self.is_finished = False
        self.is_released = False
        self._pending_references = num_subpartitions + 1
        self._producer_closed = False
        #: Flink's LocalBufferPool availability (bound to the pool's: a resumable writer asks before every new buffer).
        self.is_available: Callable[[], bool] = buffer_pool.is_available
        self._consumed = [False] * num_subpartitions
        self._all_data_processed = [False] * num_subpartitions
        self.num_events_out = 0
        self._unicast_builders: list[ByteBufferBuilder | None] = [None] * num_subpartitions

    @classmethod
    def create(
        cls,
        network_pool: NetworkBufferPool,
        num_subpartitions: int,
        config: NetworkConfig,
        *,
        partition_id: int = 0,
        bounded: bool = True,
    ) -> PipelinedResultPartition:
        """A partition with its LocalBufferPool sized as Flink sizes it (PIPELINED_BOUNDED by default):
        min N + 1, max N * buffers_per_channel + floating_buffers_per_gate, max_buffers_per_channel per
        subpartition and the overdraft limit. Raises InsufficientNetworkBuffersError if the minimum does
        not fit."""
        partition_type = PartitionType.PIPELINED_BOUNDED if bounded else PartitionType.PIPELINED
        lo, hi = result_partition_pool_size(num_subpartitions, config, partition_type)
        pool = network_pool.create_buffer_pool(
            lo,
            hi,
            num_subpartitions=num_subpartitions,
            max_buffers_per_channel=config.max_buffers_per_channel,
            max_overdraft_buffers=config.max_overdraft_buffers_per_gate,
        )
        return cls(
            num_subpartitions,
            pool,
            partition_id=partition_id,
            receiver_exclusive_buffers=config.buffers_per_channel if config.credit_based else 1,
        )

    # -- ResultPartitionWriter --

    def request_segment(self, subpartition: int) -> SegmentRecycler:
        """One segment for a new builder of ``subpartition``; never fails (see ``LocalBufferPool``)."""
        if self.is_finished or self.is_released:
            self._check_in_produce_state()
        pool = self.buffer_pool
        if not pool.request_buffer(subpartition):
            pool.request_buffer_forced(subpartition)
        return pool.segment_recyclers[subpartition]

    def add_consumer(self, subpartition: int, consumer: BufferConsumer, partial_record_length: int = 0) -> int:
        """Queue ``consumer``; the subpartition's desired buffer size (debloating), as Flink's ``add``."""
        if self.is_finished or self.is_released:
            self._check_in_produce_state()
        return self.subpartitions[subpartition].add(consumer, partial_record_length)

    def builder_opened(self, subpartition: int) -> None:
        """The writer holds an unfinished buffer of ``subpartition`` (see ``LocalBufferPool.builder_opened``)."""
        self.buffer_pool.builder_opened(subpartition)

    def builder_finished(self, subpartition: int, *, broadcast: bool = False) -> None:
        """The writer's open buffer of ``subpartition`` (or, ``broadcast``, the shared buffer of every
        subpartition, counted against subpartition 0) is finished: it counts against the per-channel limit
        again, and a reader may take it."""
        self.buffer_pool.builder_finished(subpartition)
        for sub in self.subpartitions if broadcast else (self.subpartitions[subpartition],):
            sub.notify_tail_finished()

    def emit_record(self, record: bytes | bytearray | memoryview, subpartition: int) -> None:
        """Append one serialised record to ``subpartition``'s open buffer (Flink's ``emitRecord``).

        A new buffer is trimmed to the larger of the record and the size the consumer announced
        (``NewBufferSize``); a record longer than the room left spans further buffers, each added with the
        length of the record's part it carries; a buffer left exactly full is finished. The Arrow
        :class:`~spark_credit_shuffle.buffers.RecordWriter` is the writer of exchanges; this raw-bytes path
        serves protocol tests and simulations.
        """
        self._check_in_produce_state()
        view = memoryview(record).cast("B")
        builders = self._unicast_builders
        builder = builders[subpartition]
        pool = self.buffer_pool
        if builder is None:
            builder = ByteBufferBuilder(pool.network_pool.segment_size, self.request_segment(subpartition))
            pool.builder_opened(subpartition)
            desired = self.add_consumer(subpartition, builder.create_buffer_consumer())
            builder.trim(max(len(view), desired))
        view = view[builder.append(view) :]
        while view:
            builder.finish()
            self.builder_finished(subpartition)
            builder = ByteBufferBuilder(pool.network_pool.segment_size, self.request_segment(subpartition))
            pool.builder_opened(subpartition)
            taken = builder.append(view)
            view = view[taken:]
            desired = self.add_consumer(subpartition, builder.create_buffer_consumer(), taken)
            builder.trim(max(taken, desired))
        if builder.is_full():
            builder.finish()
            self.builder_finished(subpartition)
            builder = None
        builders[subpartition] = builder

    def add_event(self, subpartition: int, buffer: Buffer) -> None:
        self._check_in_produce_state()
        self.num_events_out += 1
        self.subpartitions[subpartition].add(buffer)

    def flush(self, subpartition: int) -> None:
        self.subpartitions[subpartition].flush()

    def flush_all(self) -> None:
        for subpartition in self.subpartitions:
            subpartition.flush()

    def finish(self) -> None:
        """END_OF_PARTITION into every subpartition (after finishing the buffers :meth:`emit_record` left open)."""
        self._check_in_produce_state()
        builders = self._unicast_builders
        for i, builder in enumerate(builders):
            if builder is not None:
                builder.finish()
                self.buffer_pool.builder_finished(i)
                builders[i] = None
        for subpartition in self.subpartitions:
            subpartition.finish()
        self.is_finished = True

    def is_available(self) -> bool:
        return self.buffer_pool.is_available()

    # -- lifecycle --

    def create_subpartition_view(
        self, subpartition: int, listener: BufferAvailabilityListener
    ) -> PipelinedSubpartitionView:
        if not 0 <= subpartition < self.num_subpartitions:
            raise PartitionNotFoundError(self.partition_id, subpartition)
        if self.is_released:
            raise PartitionStateError(f"result partition {self.partition_id} is released")
        return self.subpartitions[subpartition].create_read_view(listener)

    def on_consumed_subpartition(self, subpartition: int) -> None:
        if self._consumed[subpartition]:
            return
        self._consumed[subpartition] = True
        self._decrement_references()

    def on_subpartition_all_data_processed(self, subpartition: int) -> None:
        self._all_data_processed[subpartition] = True

    @property
    def all_data_processed(self) -> bool:
        """Every consumer acknowledged all user records (AckAllUserRecordsProcessed)."""
        return all(self._all_data_processed)

    def close(self) -> None:
        """The producer is done with the partition; it is released once every subpartition is consumed."""
        if not self._producer_closed:
            self._producer_closed = True
            self._decrement_references()

    def _decrement_references(self) -> None:
        self._pending_references -= 1
        if self._pending_references == 0:
            self.release()

    def release(self) -> None:
        """Drop every queued buffer and destroy the pool (segments in use return as they are recycled)."""
        if self.is_released:
            return
        self.is_released = True
        for subpartition in self.subpartitions:
            subpartition.release()
        self.buffer_pool.lazy_destroy()

    def _check_in_produce_state(self) -> None:
        if self.is_finished:
            raise PartitionStateError(f"result partition {self.partition_id} already finished")
        if self.is_released:
            raise PartitionStateError(f"result partition {self.partition_id} is released")

    # -- metrics (§7) --

    @property
    def out_pool_usage(self) -> float:
        """Used segments / pool size (above 1.0 when overdrafted)."""
        return self.buffer_pool.usage

    def output_queue_length(self) -> int:
        return sum(s.queue_length() for s in self.subpartitions)

    def backlogs(self) -> list[int]:
        """The reported backlog of every subpartition."""
        return [s.get_buffers_in_backlog() for s in self.subpartitions]


# -- blocking partition ---------------------------------------------------------------------------------


class StoredBuffer(NamedTuple):
    """A buffer of a finished blocking subpartition: its data type and payload (bytes-like)."""

    data_type: DataType
    payload: object


class BlockingResultPartition:
    """A producer subtask's blocking output (Flink's hash ``BoundedBlockingResultPartition``, §3.3).

    Every buffer is written to storage as soon as it is complete: a complete :class:`Buffer` when it is
    added; a builder's consumer when the next one is added to its subpartition (the builder before it was
    finished), on flush (the bytes written so far, as its own buffer), and on finish, which also stores
    END_OF_PARTITION. ``sink(subpartition, buffer)``
    receives each stored buffer, which is then recycled; by default the buffers are kept in memory and
    read back by views created after :meth:`finish` (any number of them).
    """

    def __init__(
        self,
        num_subpartitions: int,
        buffer_pool: LocalBufferPool,
        *,
        partition_id: int = 0,
        sink: Callable[[int, StoredBuffer], None] | None = None,
    ) -> None:
        if num_subpartitions < 1:
            raise ValueError(f"num_subpartitions must be >= 1, got {num_subpartitions}")
        self.num_subpartitions = num_subpartitions
        self.partition_id = partition_id
        self.buffer_pool = buffer_pool
        self._sink = sink
        self._stored: list[list[StoredBuffer]] = [[] for _ in range(num_subpartitions)]
        self._current: list[BufferConsumer | None] = [None] * num_subpartitions
        self.num_data_buffers = [0] * num_subpartitions
        self.num_bytes = [0] * num_subpartitions
        self.is_finished = False
        self.is_released = False

    @classmethod
    def create(
        cls,
        network_pool: NetworkBufferPool,
        num_subpartitions: int,
        config: NetworkConfig,
        *,
        partition_id: int = 0,
        sink: Callable[[int, StoredBuffer], None] | None = None,
    ) -> BlockingResultPartition:
        """A partition with its LocalBufferPool sized as Flink's hash BLOCKING partition (min N + 1,
        unbounded max, no overdraft)."""
        lo, hi = result_partition_pool_size(num_subpartitions, config, PartitionType.BLOCKING)
        pool = network_pool.create_buffer_pool(
            lo, hi, num_subpartitions=num_subpartitions, max_buffers_per_channel=config.max_buffers_per_channel
        )
        return cls(num_subpartitions, pool, partition_id=partition_id, sink=sink)

    def request_segment(self, subpartition: int) -> SegmentRecycler:
        self._check_in_produce_state()
        self.buffer_pool.request_buffer_forced(subpartition)
        return self.buffer_pool.segment_recycler(subpartition)

    def add_consumer(self, subpartition: int, consumer: BufferConsumer, partial_record_length: int = 0) -> None:
        self._check_in_produce_state()
        self._write_current(subpartition, close=True)
        if type(consumer) is not Buffer:
            self._current[subpartition] = consumer
        elif consumer.size:  # a complete buffer is stored at once
            self._store(subpartition, consumer)
        else:
            consumer.recycle()

    def add_event(self, subpartition: int, buffer: Buffer) -> None:
        self._check_in_produce_state()
        self._write_current(subpartition, close=True)
        self._store(subpartition, buffer)

    def flush(self, subpartition: int) -> None:
        self._write_current(subpartition, close=False)

    def flush_all(self) -> None:
        for subpartition in range(self.num_subpartitions):
            self._write_current(subpartition, close=False)

    def finish(self) -> None:
        self._check_in_produce_state()
        for subpartition in range(self.num_subpartitions):
            self._write_current(subpartition, close=True)
            self._store(subpartition, _end_of_partition())
        self.is_finished = True

    def is_available(self) -> bool:
        return self.buffer_pool.is_available()

    def _write_current(self, subpartition: int, *, close: bool) -> None:
        consumer = self._current[subpartition]
        if consumer is None:
            return
        if not close:
            if consumer.is_data_available():
                self._store(subpartition, consumer.build())
            return
        last = consumer.build()  # the rest; the segment returns once this slice is recycled
        if not consumer.is_finished():  # a consumer learns that its builder finished on build()
            last.recycle()
            raise PartitionStateError(
                f"subpartition {subpartition}: a buffer was added or the partition finished while the "
                "previous buffer was still being written (finish the builder first)"
            )
        if last.size:
            self._store(subpartition, last)
        else:
            last.recycle()
        consumer.close()
        self._current[subpartition] = None

    def _store(self, subpartition: int, buffer: Buffer) -> None:
        stored = StoredBuffer(buffer.data_type, buffer.data)
        if buffer.data_type.is_buffer:
            self.num_data_buffers[subpartition] += 1
        self.num_bytes[subpartition] += buffer.size
        buffer.recycle()
        if self._sink is not None:
            self._sink(subpartition, stored)
        else:
            self._stored[subpartition].append(stored)

    def stored_buffers(self, subpartition: int) -> list[StoredBuffer]:
        """The buffers stored for ``subpartition`` (empty when a sink took them)."""
        return self._stored[subpartition]

    def create_subpartition_view(
        self, subpartition: int, listener: BufferAvailabilityListener
    ) -> BoundedBlockingSubpartitionReader:
        if not 0 <= subpartition < self.num_subpartitions:
            raise PartitionNotFoundError(self.partition_id, subpartition)
        if not self.is_finished:
            raise PartitionStateError(f"blocking result partition {self.partition_id} is read only once finished")
        if self._sink is not None:
            raise PartitionStateError("the buffers of this partition went to its sink; read them from there")
        return BoundedBlockingSubpartitionReader(
            self._stored[subpartition], listener, num_data_buffers=self.num_data_buffers[subpartition]
        )

    def close(self) -> None:
        """Blocking partitions outlive their producer; released by :meth:`release`."""

    def release(self) -> None:
        if self.is_released:
            return
        self.is_released = True
        for subpartition in range(self.num_subpartitions):
            consumer = self._current[subpartition]
            if consumer is not None:
                consumer.close()
                self._current[subpartition] = None
            self._stored[subpartition] = []
        self.buffer_pool.lazy_destroy()

    def _check_in_produce_state(self) -> None:
        if self.is_finished:
            raise PartitionStateError(f"result partition {self.partition_id} already finished")
        if self.is_released:
            raise PartitionStateError(f"result partition {self.partition_id} is released")

    @property
    def out_pool_usage(self) -> float:
        return self.buffer_pool.usage


class BoundedBlockingSubpartitionReader:
    """A view over stored buffers (Flink's ``BoundedBlockingSubpartitionReader``), reading one ahead.

    ``buffers`` yields :class:`StoredBuffer` (or ``(data_type, payload)`` pairs, or :class:`Buffer`);
    ``num_data_buffers``, when given, lets an iterator stream without being materialised (the backlog is
    the number of data buffers not yet returned). With credit it is available while a buffer is left;
    without credit only when the next one is an event. Returned buffers are unpooled (their payload
    belongs to the storage), so the reader holds no network buffers.
    """

    __slots__ = ("_backlog", "_iterator", "_listener", "_next", "_released", "_sequence_number", "failure_cause")

    def __init__(
        self,
        buffers: Iterable[StoredBuffer | tuple[DataType, object] | Buffer],
        listener: BufferAvailabilityListener | None = None,
        *,
        num_data_buffers: int | None = None,
    ) -> None:
        if num_data_buffers is None:
            items = [self._as_stored(b) for b in buffers]
            num_data_buffers = sum(1 for b in items if b[0].is_buffer)
            self._iterator: Iterator = iter(items)
        else:
            self._iterator = (self._as_stored(b) for b in buffers)
        self._backlog = num_data_buffers
        self._next: tuple[DataType, object] | None = next(self._iterator, None)
        self._listener = listener
        self._released = False
        self._sequence_number = 0
        self.failure_cause: BaseException | None = None
        if listener is not None and self._next is not None:
            listener.notify_data_available()

    @staticmethod
    def _as_stored(item: StoredBuffer | tuple[DataType, object] | Buffer) -> tuple[DataType, object]:
        if isinstance(item, Buffer):
            data = item.data
            item.recycle()
            return (item.data_type, data)
        data_type, payload = item
        return (DataType(data_type), payload)

    def set_listener(self, listener: BufferAvailabilityListener) -> None:
        self._listener = listener
        if self._next is not None:
            listener.notify_data_available()

    def get_next_buffer(self) -> BufferAndBacklog | None:
        current = self._next
        if current is None or self._released:
            return None
        data_type, payload = current
        if data_type.is_buffer:
            self._backlog -= 1
        nxt = self._next = next(self._iterator, None)
        sequence = self._sequence_number
        self._sequence_number = sequence + 1
        return BufferAndBacklog(
            Buffer(data_type, payload), max(self._backlog, 0), nxt[0] if nxt is not None else _NONE, sequence
        )

    def get_availability_and_backlog(self, credit_available: bool) -> AvailabilityWithBacklog:
        nxt = self._next
        if nxt is None or self._released:
            return AvailabilityWithBacklog(False, 0)
        return AvailabilityWithBacklog(credit_available or nxt[0].is_event, max(self._backlog, 0))

    def resume_consumption(self) -> None:
        """Stored buffers never block."""

    def notify_new_buffer_size(self, size: int) -> None:
        """Stored buffers have their size already."""

    def acknowledge_all_data_processed(self) -> None:
        """Nothing waits for it in blocking mode."""

    def release_all_resources(self) -> None:
        self._released = True
        self._next = None

    @property
    def is_released(self) -> bool:
        return self._released

    def queue_length(self) -> int:
        return self._backlog + (1 if self._next is not None and self._next[0].is_event else 0)

    @property
    def backlog(self) -> int:
        return max(self._backlog, 0)


class ResultPartitionManager:
    """The partitions a producer side serves, by partition id (Flink's ``ResultPartitionManager``).

    A request for a partition not registered yet can wait: :meth:`wait_for` registers a callback that runs
    when it is registered.
    """

    def __init__(self) -> None:
        self._partitions: dict[int, object] = {}
        self._waiting: dict[int, list[Callable[[], None]]] = {}

    def register_partition(self, partition: object, partition_id: int | None = None) -> None:
        pid = partition.partition_id if partition_id is None else partition_id  # type: ignore[attr-defined]
        if pid in self._partitions:
            raise PartitionStateError(f"result partition {pid} is already registered")
        self._partitions[pid] = partition
        for callback in self._waiting.pop(pid, []):
            callback()

    def release_partition(self, partition_id: int) -> None:
        partition = self._partitions.pop(partition_id, None)
        if partition is not None and hasattr(partition, "release"):
            partition.release()

    def get_partition(self, partition_id: int) -> object | None:
        return self._partitions.get(partition_id)

    def __contains__(self, partition_id: int) -> bool:
        return partition_id in self._partitions

    def create_subpartition_view(
        self, partition_id: int, subpartition: int, listener: BufferAvailabilityListener
    ) -> ResultSubpartitionView:
        partition = self._partitions.get(partition_id)
        if partition is None:
            raise PartitionNotFoundError(partition_id, subpartition)
        return partition.create_subpartition_view(subpartition, listener)  # type: ignore[attr-defined]

    def wait_for(self, partition_id: int, callback: Callable[[], None]) -> None:
        self._waiting.setdefault(partition_id, []).append(callback)

    def cancel_wait(self, partition_id: int, callback: Callable[[], None]) -> None:
        callbacks = self._waiting.get(partition_id)
        if callbacks and callback in callbacks:
            callbacks.remove(callback)
