"""The server side of one input channel: a subpartition view read with the channel's credit (Flink's
``CreditBasedSequenceNumberingViewReader`` and its kinds; docs/flink.md, "Sender side").

:class:`CreditBasedSequenceNumberingViewReader` sends a data buffer only with a credit and numbers what it
sends; :class:`SequenceNumberingViewReader` is the reader of the model without credits, and
:class:`LocalChannelViewReader` the reader of a local channel in another process of the executor, which
holds each data buffer's segment until the consumer recycled it. They tell their :class:`ReaderQueue`
(the connection's :class:`~spark_credit_shuffle.protocol.sender.PartitionRequestQueue`) when they can send.

Not thread-safe: callers serialise access.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Protocol

from ..buffers.buffer import Buffer, DataType
from ..errors import ProtocolError
from ._flags import IS_BUFFER, IS_EVENT
from .subpartition import AvailabilityWithBacklog, BufferAndBacklog, BufferAvailabilityListener, ResultSubpartitionView

__all__ = [
    "BufferAndAvailability",
    "CreditBasedSequenceNumberingViewReader",
    "LocalChannelViewReader",
    "PartitionProvider",
    "ReaderQueue",
    "SequenceNumberingViewReader",
]

_NONE = DataType.NONE


class ReaderQueue(Protocol):
    """What a reader tells the queue of its connection (Flink's ``PartitionRequestQueue``)."""

    def notify_reader_non_empty(self, reader: CreditBasedSequenceNumberingViewReader) -> None: ...

    def enqueue_available_reader(self, reader: CreditBasedSequenceNumberingViewReader) -> None: ...


#: What a reader polled: (buffer, whether the reader can send again right away, the sender's backlog,
#: sequence number). A plain tuple: the queue unpacks one per buffer, and a NamedTuple costs a second
#: object each time.
BufferAndAvailability = tuple[Buffer, bool, int, int]


class PartitionProvider(Protocol):
    """Where readers get their views: a :class:`ResultPartitionManager` or any object with this method."""

    def create_subpartition_view(
        self, partition_id: int, subpartition: int, listener: BufferAvailabilityListener
    ) -> ResultSubpartitionView: ...


class CreditBasedSequenceNumberingViewReader:
    """The server side of one input channel: a subpartition view plus the channel's credit
    (docs/flink.md, "Sender side").

    ``initial_credit`` is the credit of the PartitionRequest (the receiver's exclusive buffers).
    :meth:`get_next_buffer` takes one credit per data buffer; going below zero is a protocol violation.
    """

    __slots__ = (
        "initial_credit",
        "is_registered_as_available",
        "notify_data_available",
        "num_credits_available",
        "partition_id",
        "queue",
        "receiver_id",
        "subpartition",
        "view",
    )

    credit_based = True
    #: Whether the segments of the data buffers it sends stay held until the consumer recycles them.
    holds_buffers = False

    def __init__(self, receiver_id: int, initial_credit: int, queue: ReaderQueue) -> None:
        if initial_credit < 0:
            raise ProtocolError(f"receiver {receiver_id}: initial credit {initial_credit} is negative")
        self.receiver_id = receiver_id
        self.initial_credit = initial_credit
        self.num_credits_available = initial_credit
        self.is_registered_as_available = False
        self.queue = queue
        self.view: ResultSubpartitionView | None = None
        self.partition_id = 0
        self.subpartition = 0
        #: BufferAvailabilityListener: the view has data; the queue decides whether the reader can send
        #: (a partial, not a method: the view calls it for nearly every buffer).
        self.notify_data_available: Callable[[], None] = partial(queue.notify_reader_non_empty, self)

    def request_subpartition_view(self, provider: PartitionProvider, partition_id: int, subpartition: int) -> None:
        """Create the view (raises :class:`PartitionNotFoundError` if the partition is unknown)."""
        self.partition_id = partition_id
        self.subpartition = subpartition
        self.view = provider.create_subpartition_view(partition_id, subpartition, self)
        self.queue.enqueue_available_reader(self)

    # -- BufferAvailabilityListener --

    def notify_priority_event(self, sequence_number: int) -> None:
        self.notify_data_available()

    # -- inbound control --

    def add_credit(self, credit: int) -> None:
        self.num_credits_available += credit

    def resume_consumption(self) -> None:
        """After an upstream-blocking event: with initial credit 0 both sides reset credit to 0."""
        if self.initial_credit == 0:
            self.num_credits_available = 0
        if self.view is not None:
            self.view.resume_consumption()

    def acknowledge_all_records_processed(self) -> None:
        if self.view is not None:
            self.view.acknowledge_all_data_processed()

    def notify_new_buffer_size(self, size: int) -> None:
        if self.view is not None:
            self.view.notify_new_buffer_size(size)

    def acknowledge_checkpoint(self, checkpoint_id: int, declined: bool) -> None:
        if self.view is not None:
            self.view.acknowledge_checkpoint(checkpoint_id, declined)

    # -- sending --

    def get_availability_and_backlog(self) -> AvailabilityWithBacklog:
        if self.view is None:
            return AvailabilityWithBacklog(False, 0)
        return self.view.get_availability_and_backlog(self.num_credits_available > 0)

    def need_announce_backlog(self) -> bool:
        """A channel without exclusive buffers learns the backlog only from a BacklogAnnouncement."""
        return self.initial_credit == 0 and self.num_credits_available == 0

    def get_next_buffer(self) -> BufferAndAvailability | None:
        view = self.view
        if view is None:
            return None
        nxt: BufferAndBacklog | None = view.get_next_buffer()
        if nxt is None:
            return None
        buffer, backlog, next_type, sequence_number = nxt
        credits = self.num_credits_available
        if IS_BUFFER[buffer.data_type]:
            credits -= 1
            if credits < 0:
                raise ProtocolError(f"receiver {self.receiver_id}: data buffer polled with no credit available")
            self.num_credits_available = credits
        more = IS_EVENT[next_type] or (credits > 0 and IS_BUFFER[next_type])
        return buffer, more, backlog, sequence_number

    # -- lifecycle --

    @property
    def is_released(self) -> bool:
        return self.view is not None and self.view.is_released

    @property
    def failure_cause(self) -> BaseException | None:
        return getattr(self.view, "failure_cause", None) if self.view is not None else None

    def release_all_resources(self) -> None:
        if self.view is not None:
            self.view.release_all_resources()

    @property
    def backlog(self) -> int:
        """The backlog the reader would report now."""
        return self.get_availability_and_backlog().backlog

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(receiver_id={self.receiver_id}, subpartition={self.subpartition}, "
            f"credits={self.num_credits_available}, registered={self.is_registered_as_available})"
        )


class SequenceNumberingViewReader(CreditBasedSequenceNumberingViewReader):
    """The reader of the model without credits (Flink <= 1.4): sends whenever its view has data."""

    __slots__ = ()

    credit_based = False

    def __init__(self, receiver_id: int, initial_credit: int, queue: ReaderQueue) -> None:
        super().__init__(receiver_id, 0, queue)

    def add_credit(self, credit: int) -> None:
        """Credits mean nothing here."""

    def get_availability_and_backlog(self) -> AvailabilityWithBacklog:
        if self.view is None:
            return AvailabilityWithBacklog(False, 0)
        return self.view.get_availability_and_backlog(True)

    def need_announce_backlog(self) -> bool:
        return False

    def get_next_buffer(self) -> BufferAndAvailability | None:
        if self.view is None:
            return None
        nxt = self.view.get_next_buffer()
        if nxt is None:
            return None
        return nxt.buffer, nxt.next_data_type is not _NONE, nxt.backlog, nxt.sequence_number


class LocalChannelViewReader(SequenceNumberingViewReader):
    """The server side of a local channel: two tasks of one executor in different processes (Flink's
    ``LocalInputChannel`` reading the producer's view, with the connection as the path for the bytes).

    No credit: it sends whenever its view has data, as a local channel reads whenever the subpartition has
    some. The segment of every data buffer it sends stays held, counted in the producer's LocalBufferPool
    (and against its subpartition's ``max_buffers_per_channel``), until the consumer recycled the buffer:
    :meth:`recycle` returns the oldest held segments to the pool. So what a slow consumer of a local
    channel holds is bounded by the producer's pool, and backpressure shows as the producer's pool
    filling, not as missing credit. Releasing the reader returns every held segment.
    """

    __slots__ = ("held",)

    holds_buffers = True

    def __init__(self, receiver_id: int, initial_credit: int, queue: ReaderQueue) -> None:
        super().__init__(receiver_id, 0, queue)
        #: The data buffers sent and not yet recycled by the consumer, oldest first.
        self.held: deque[Buffer] = deque()

    def recycle(self, count: int) -> None:
        """The consumer recycled its next ``count`` data buffers: return their segments to the pool."""
        held = self.held
        if not 0 < count <= len(held):
            raise ProtocolError(
                f"receiver {self.receiver_id}: RecycleBuffers of {count} buffers, but {len(held)} are held for it"
            )
        for _ in range(count):
            held.popleft().recycle()

    def release_all_resources(self) -> None:
        held = self.held
        while held:
            held.popleft().recycle()
        super().release_all_resources()
