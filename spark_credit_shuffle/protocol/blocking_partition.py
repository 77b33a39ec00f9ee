"""The blocking result partition and its reader (Flink's hash ``BoundedBlockingResultPartition`` and
``BoundedBlockingSubpartitionReader``; docs/flink.md, "Blocking subpartitions").

:class:`BlockingResultPartition` stores every complete buffer of its subpartitions (in memory, or through a
sink: the blocking runtime's Spark shuffle). :class:`BoundedBlockingSubpartitionReader` replays stored
buffers (a finished blocking partition, or the buffers a consumer task fetched from Spark's shuffle) through
the subpartition view interface, so blocking and pipelined exchanges share every reader, queue and input
channel.

Not thread-safe: callers serialise access.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from ..buffers.buffer import Buffer, BufferConsumer, DataType, Payload
from ..buffers.pools import LocalBufferPool, NetworkBufferPool, SegmentRecycler
from ..buffers.sizing import PartitionType
from ..config import NetworkConfig
from ..errors import PartitionNotFoundError, PartitionStateError
from .partition import ResultPartition, partition_buffer_pool
from .subpartition import AvailabilityWithBacklog, BufferAndBacklog, BufferAvailabilityListener, end_of_partition

__all__ = ["BlockingResultPartition", "BoundedBlockingSubpartitionReader", "StoredBuffer"]

_NONE = DataType.NONE


class StoredBuffer(NamedTuple):
    """A buffer of a finished blocking subpartition: its data type and payload (bytes-like)."""

    data_type: DataType
    payload: object


class BlockingResultPartition(ResultPartition):
    """A producer subtask's blocking output (Flink's hash ``BoundedBlockingResultPartition``; docs/flink.md,
    "Blocking subpartitions").

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
        super().__init__(num_subpartitions, buffer_pool, partition_id)
        self._sink = sink
        self._stored: list[list[StoredBuffer]] = [[] for _ in range(num_subpartitions)]
        self._current: list[BufferConsumer | None] = [None] * num_subpartitions
        self.num_data_buffers = [0] * num_subpartitions
        self.num_bytes = [0] * num_subpartitions

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
        pool = partition_buffer_pool(network_pool, num_subpartitions, config, PartitionType.BLOCKING, overdraft=False)
        return cls(num_subpartitions, pool, partition_id=partition_id, sink=sink)

    def request_segment(self, subpartition: int) -> SegmentRecycler:
        self._check_in_produce_state()
        self.buffer_pool.request_buffer_or_raise(subpartition)
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

    def finish(self) -> None:
        self._check_in_produce_state()
        for subpartition in range(self.num_subpartitions):
            self._write_current(subpartition, close=True)
            self._store(subpartition, end_of_partition())
        self.is_finished = True

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

    def _release_subpartitions(self) -> None:
        for subpartition in range(self.num_subpartitions):
            consumer = self._current[subpartition]
            if consumer is not None:
                consumer.close()
                self._current[subpartition] = None
            self._stored[subpartition] = []


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
            self._iterator: Iterator[tuple[DataType, Payload]] = iter(items)
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

    def acknowledge_checkpoint(self, checkpoint_id: int, declined: bool) -> None:
        """The stored result was written whole before any consumer ran: no producer waits for it."""

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
