"""The network buffer and the writer/reader halves of one segment, shared by every layer.

A *segment* is one unit of network memory (``NetworkConfig.segment_size`` bytes), taken from a
buffer pool. A ``BufferBuilder`` writes into a segment; its ``BufferConsumer`` sits in a
subpartition queue and hands the bytes written so far to the network as read-only
:class:`Buffer` slices. A flush before the segment is full therefore sends a slice and the
producer keeps writing into the same segment, as Flink does. The segment goes back to its pool
once the builder is finished and every slice built from it has been recycled.

The Arrow record-batch builder of :mod:`spark_credit_shuffle.buffers.writer` and the byte
builder below implement the same consumer protocol, so subpartitions, the protocol core and
the transports never look inside a payload. A complete buffer (an event, a buffer cut full, a
stored one) is its own consumer, finished from the start: no wrapper per buffer.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "Buffer",
    "BufferConsumer",
    "ByteBufferBuilder",
    "DataType",
    "Payload",
    "SegmentLease",
]

Recycler = Callable[[], None]
#: The bytes of a buffer: any bytes-like object, never copied on the way (an Arrow buffer of a record batch,
#: a slice of a segment, the bytes a socket read).
Payload: TypeAlias = "bytes | bytearray | memoryview | pa.Buffer"


class DataType(enum.IntEnum):
    """Flink's ``Buffer.DataType``; the ordinal is the ``dataType`` byte on the wire."""

    NONE = 0
    DATA_BUFFER = 1
    EVENT_BUFFER = 2
    PRIORITIZED_EVENT_BUFFER = 3
    ALIGNED_CHECKPOINT_BARRIER = 4
    TIMEOUTABLE_ALIGNED_CHECKPOINT_BARRIER = 5
    RECOVERY_COMPLETION = 6
    END_OF_SEGMENT = 7
    DATA_BUFFER_WITH_CLEAR_END = 8
    END_OF_DATA = 9
    END_OF_PARTITION = 10
    RECOVERY_METADATA = 11

    @property
    def is_buffer(self) -> bool:
        """Data (flow-controlled, needs a credit) rather than an event."""
        return self in (DataType.DATA_BUFFER, DataType.DATA_BUFFER_WITH_CLEAR_END)

    @property
    def is_event(self) -> bool:
        return self is not DataType.NONE and not self.is_buffer

    @property
    def has_priority(self) -> bool:
        return self is DataType.PRIORITIZED_EVENT_BUFFER

    @property
    def is_blocking_upstream(self) -> bool:
        return self in (
            DataType.ALIGNED_CHECKPOINT_BARRIER,
            DataType.TIMEOUTABLE_ALIGNED_CHECKPOINT_BARRIER,
            DataType.RECOVERY_COMPLETION,
        )


class Buffer:
    """One read-only network buffer (or a slice of one segment) as it crosses a channel.

    ``data`` is any bytes-like object (``bytes``, ``memoryview``, ``pyarrow.Buffer``); it is
    never copied here. ``recycle()`` must be called exactly once by whoever consumed the buffer
    last; it returns the buffer's memory to the pool it came from. Extra calls are ignored.
    """

    __slots__ = ("_recycler", "data", "data_type")

    def __init__(self, data_type: DataType, data: Payload, recycler: Recycler | None = None) -> None:
        self.data_type = data_type
        self.data = data
        self._recycler = recycler

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def is_buffer(self) -> bool:
        return self.data_type.is_buffer

    def recycle(self) -> None:
        recycler, self._recycler = self._recycler, None
        if recycler is not None:
            recycler()

    # A complete buffer (an event, a full buffer, a stored one) is its own BufferConsumer, finished from
    # the start: queues add it as it is, and drop it as soon as they have built it.

    def is_finished(self) -> bool:
        return True

    def is_data_available(self) -> bool:
        return len(self.data) > 0

    def unread_bytes(self) -> int:
        return len(self.data)

    def build(self) -> Buffer:
        """The buffer itself (a queue builds a finished consumer once, then drops it)."""
        return self

    def close(self) -> None:
        """Dropped unread (its subpartition was released): the memory goes back."""
        self.recycle()

    def __repr__(self) -> str:
        return f"Buffer({self.data_type.name}, {self.size} bytes)"


@runtime_checkable
class BufferConsumer(Protocol):
    """The reader half of one segment (Flink's ``BufferConsumer``), queued in a subpartition."""

    @property
    def data_type(self) -> DataType: ...

    def is_finished(self) -> bool:
        """The writer will add nothing more to this segment."""

    def is_data_available(self) -> bool:
        """Bytes were written that no ``build()`` has returned yet."""

    def unread_bytes(self) -> int:
        """How many bytes that is (what an unaligned barrier overtaking this consumer persists)."""

    def build(self) -> Buffer:
        """A slice with the bytes written since the last ``build()``; it may be empty (size 0)."""

    def close(self) -> None:
        """Release the segment without reading it further (the subpartition was released)."""


class SegmentLease:
    """Counts the slices built from one segment and recycles the segment when all are back.

    The segment is returned once the builder was finished and every slice recycled, or once
    ``close()`` is called on the consumer.
    """

    __slots__ = ("_finished", "_outstanding", "_recycler")

    def __init__(self, recycler: Recycler | None) -> None:
        self._recycler = recycler
        self._outstanding = 0
        self._finished = False

    def slice_recycler(self) -> Recycler:
        self._outstanding += 1
        return self._slice_returned

    def _slice_returned(self) -> None:
        self._outstanding -= 1
        self._release_if_done()

    def finish(self) -> None:
        self._finished = True
        self._release_if_done()

    def _release_if_done(self) -> None:
        if self._finished and self._outstanding == 0 and self._recycler is not None:
            recycler, self._recycler = self._recycler, None
            recycler()


class ByteBufferBuilder:
    """Writes raw bytes into one segment of ``capacity`` bytes (Flink's ``BufferBuilder``).

    Used for events and in protocol tests; Arrow data goes through the record-batch builder.
    """

    def __init__(self, capacity: int, recycler: Recycler | None = None, data_type: DataType = DataType.DATA_BUFFER):
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.max_capacity = capacity
        self._data = bytearray()
        self._lease = SegmentLease(recycler)
        self._finished = False
        self._consumer: _ByteConsumer | None = None
        self._data_type = data_type

    def append(self, data: bytes | bytearray | memoryview) -> int:
        """Copy as much of ``data`` as fits; return the number of bytes taken."""
        if self._finished:
            raise RuntimeError("append to a finished BufferBuilder")
        room = self.capacity - len(self._data)
        taken = data[:room]
        self._data += taken
        return len(taken)

    def is_full(self) -> bool:
        return len(self._data) >= self.capacity

    def trim(self, size: int) -> None:
        """Lower the usable capacity to ``size`` (debloating), never below what was written nor above the
        segment."""
        self.capacity = min(max(size, len(self._data)), self.max_capacity)

    @property
    def written(self) -> int:
        return len(self._data)

    def finish(self) -> int:
        """Mark the segment finished (idempotent); return the bytes written."""
        self._finished = True
        return len(self._data)

    def is_finished(self) -> bool:
        return self._finished

    def create_buffer_consumer(self) -> BufferConsumer:
        if self._consumer is not None:
            raise RuntimeError("a BufferBuilder has exactly one BufferConsumer")
        self._consumer = _ByteConsumer(self)
        return self._consumer


class _ByteConsumer:
    __slots__ = ("_builder", "_closed", "_read")

    def __init__(self, builder: ByteBufferBuilder) -> None:
        self._builder = builder
        self._read = 0
        self._closed = False

    @property
    def data_type(self) -> DataType:
        return self._builder._data_type

    def is_finished(self) -> bool:
        return self._builder._finished

    def is_data_available(self) -> bool:
        return self._builder.written > self._read

    def unread_bytes(self) -> int:
        return self._builder.written - self._read

    def build(self) -> Buffer:
        end = self._builder.written
        data = bytes(self._builder._data[self._read : end])
        self._read = end
        lease = self._builder._lease
        buffer = Buffer(self.data_type, data, lease.slice_recycler())
        if self._builder._finished:
            lease.finish()
        return buffer

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._builder._lease.finish()
