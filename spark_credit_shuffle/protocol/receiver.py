"""The receiver side: input channels, their buffer accounting, the input gate, and the client handler of a
connection (§5.3-§5.5 and §6 of the reference).

:class:`RemoteInputChannel` with its :class:`BufferManager` holds the channel's exclusive buffers (its
initial credit) and asks the gate's floating pool for more according to the backlog the sender announces;
every buffer it obtains becomes credit, announced to the sender with AddCredit. A received data buffer
occupies one of these buffers until the consumer recycles it. :class:`LocalInputChannel` reads a
producer's subpartition of the same executor with no credit and no buffers of its own: in the same
process directly (no copy), or, for a producer in another process of the executor, through a connection
(:class:`ConnectionSubpartitionView`): the producer keeps each data buffer's segment in its pool until
the consumer recycled the buffer, which :class:`RecycleBuffers` tells it, so the producer's pool bounds
what the channel holds on both sides. :class:`SingleInputGate` reads
its channels round robin. :class:`CreditBasedPartitionRequestClientHandler` is the client end of one
connection: it routes inbound messages to channels by receiver id and queues the outbound ones.

With ``credit_based=False`` (the model before Flink 1.5) channels have no exclusive buffers and announce
no credit; a data buffer takes a buffer from its gate's pool on arrival, and when there is none the
client handler stages the message and stops reading the whole connection until a buffer is recycled.

Not thread-safe: callers serialise access.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from ..buffers.buffer import Buffer, DataType
from ..config import NetworkConfig
from ..errors import BufferReorderingError, CreditShuffleError, ProtocolError
from ._flags import HAS_PRIORITY, IS_BLOCKING_UPSTREAM, IS_BUFFER
from .codec import FrameDecoder, default_max_frame_length, encode
from .messages import (
    AckAllUserRecordsProcessed,
    AddCredit,
    BacklogAnnouncement,
    BufferResponse,
    CancelPartitionRequest,
    ClientMessage,
    CloseRequest,
    ErrorResponse,
    Hello,
    Message,
    NewBufferSize,
    PartitionRequest,
    RecycleBuffers,
    ResumeConsumption,
)
from .partition import BufferAndBacklog, ResultPartitionManager
from .pools import GateBuffersSpec, LocalBufferPool, NetworkBufferPool, input_gate_buffers_spec

__all__ = [
    "BufferManager",
    "BufferOrEvent",
    "ConnectionSubpartitionView",
    "CreditBasedPartitionRequestClientHandler",
    "InputChannelError",
    "LocalInputChannel",
    "RemoteInputChannel",
    "SingleInputGate",
]

_END_OF_PARTITION = DataType.END_OF_PARTITION
_new_tuple = tuple.__new__  # NamedTuples without their Python-level __new__ on the hot path
_NONE = DataType.NONE


class InputChannelError(CreditShuffleError):
    """An input channel failed (its error surfaces on the consumer's next poll)."""


class BufferOrEvent(NamedTuple):
    """What the gate hands its consumer: a buffer, its channel and sequence number, and whether the gate
    has more right away. The consumer must ``buffer.recycle()`` it when done."""

    buffer: Buffer
    channel_index: int
    sequence_number: int
    more_available: bool


# -- remote channel -----------------------------------------------------------------------------------


class BufferManager:
    """The buffers of one remote channel (Flink's ``BufferManager`` + ``AvailableBufferQueue``).

    Counts the channel's unused exclusive and floating buffers, ``num_required_buffers`` (backlog +
    initial credit) and whether it waits for a floating buffer of the gate's pool.
    """

    __slots__ = (
        "channel",
        "floating_pool",
        "global_pool",
        "is_waiting_for_floating_buffers",
        "num_exclusive",
        "num_exclusive_total",
        "num_floating",
        "num_required_buffers",
    )

    def __init__(self, channel: RemoteInputChannel, global_pool: NetworkBufferPool, floating_pool: LocalBufferPool):
        self.channel = channel
        self.global_pool = global_pool
        self.floating_pool = floating_pool
        self.num_exclusive = 0  # unused exclusive buffers
        self.num_floating = 0  # unused floating buffers
        self.num_exclusive_total = 0
        self.num_required_buffers = 0
        self.is_waiting_for_floating_buffers = False

    @property
    def num_available_buffers(self) -> int:
        """Unused buffers (exclusive + floating), each reserved for one data buffer of this channel."""
        return self.num_exclusive + self.num_floating

    def request_exclusive_buffers(self, n: int) -> None:
        """Take ``n`` exclusive (unpooled) segments from the global pool."""
        self.global_pool.request_unpooled_segments(n)
        self.num_exclusive += n
        self.num_exclusive_total += n

    def request_buffer(self) -> Callable[[], None] | None:
        """Take an unused buffer for an arriving data buffer, floating first; its recycler, or None."""
        self.num_required_buffers -= 1
        if self.num_floating:
            self.num_floating -= 1
            return self.floating_pool.recycle
        if self.num_exclusive:
            self.num_exclusive -= 1
            return self.recycle_exclusive
        return None

    def request_floating_buffers(self, num_required: int) -> int:
        """Set the required count and take floating buffers up to it; the number taken."""
        if self.channel.is_released:
            return 0
        self.num_required_buffers = num_required
        return self._try_request_buffers()

    def _try_request_buffers(self) -> int:
        missing = self.num_required_buffers - self.num_exclusive - self.num_floating
        if missing <= 0 or self.is_waiting_for_floating_buffers:
            return 0
        pool = self.floating_pool
        taken = 0
        while taken < missing and not pool.is_destroyed:
            if pool.request_buffer():
                taken += 1
            elif pool.add_buffer_listener(self):
                self.is_waiting_for_floating_buffers = True
                break
        self.num_floating += taken
        return taken

    def recycle_exclusive(self) -> None:
        """The consumer is done with a buffer that occupied an exclusive one."""
        if self.channel.is_released:
            self.num_exclusive_total -= 1
            self.global_pool.recycle_unpooled_segments(1)
            return
        self.num_exclusive += 1
        if self.num_exclusive + self.num_floating > self.num_required_buffers and self.num_floating:
            self.num_floating -= 1
            self.floating_pool.recycle()
        else:
            self.channel.notify_buffer_available(1)

    def notify_buffer_available(self) -> bool:
        """BufferListener: a floating buffer is offered; take it if still needed, then try for more."""
        self.is_waiting_for_floating_buffers = False
        channel = self.channel
        if channel.is_released or self.num_exclusive + self.num_floating >= self.num_required_buffers:
            return False
        self.num_floating += 1
        count = 1 + self._try_request_buffers()
        channel.notify_buffer_available(count)
        return True

    def release_floating_buffers(self) -> None:
        """Give every unused floating buffer back to the gate's pool."""
        self.floating_pool.remove_buffer_listener(self)
        self.is_waiting_for_floating_buffers = False
        while self.num_floating:
            self.num_floating -= 1
            self.floating_pool.recycle()

    def release_all_buffers(self) -> None:
        """Channel released: unused exclusive buffers to the global pool, unused floating ones to the gate."""
        if self.num_exclusive:
            n, self.num_exclusive = self.num_exclusive, 0
            self.num_exclusive_total -= n
            self.global_pool.recycle_unpooled_segments(n)
        self.release_floating_buffers()

    def __repr__(self) -> str:
        return (
            f"BufferManager(exclusive={self.num_exclusive}, floating={self.num_floating}, "
            f"required={self.num_required_buffers}, waiting={self.is_waiting_for_floating_buffers})"
        )


class RemoteInputChannel:
    """An input channel fed over a connection (Flink's ``RemoteInputChannel``).

    Set up with ``initial_credit`` exclusive buffers; requests its subpartition with that credit; checks
    sequence numbers; turns the backlog of every BufferResponse into floating-buffer requests and the
    buffers it gets into credit.
    """

    is_local = False

    def __init__(
        self,
        gate: SingleInputGate,
        channel_index: int,
        receiver_id: int,
        *,
        partition_id: int = 0,
        subpartition: int = 0,
        connection: CreditBasedPartitionRequestClientHandler | None = None,
    ) -> None:
        self.gate = gate
        self.channel_index = channel_index
        self.receiver_id = receiver_id
        self.partition_id = partition_id
        self.subpartition = subpartition
        self.connection = connection
        self.credit_based = gate.credit_based
        self.initial_credit = gate.spec.exclusive_per_channel if gate.credit_based else 0
        self.buffer_manager = BufferManager(self, gate.network_pool, gate.buffer_pool)
        self.unannounced_credit = 0
        self.expected_sequence_number = 0
        self.received_buffers: deque[tuple[Buffer, int]] = deque()
        self._num_priority = 0
        self.error: BaseException | None = None
        self.is_released = False
        self.is_queued = False
        self.received_end_of_partition = False
        self.num_buffers_in = 0
        self.num_bytes_in = 0
        self.is_set_up = False

    # -- setup --

    def setup(self) -> None:
        """Take the exclusive buffers (raises InsufficientNetworkBuffersError if they do not fit)."""
        if self.is_set_up:
            return
        self.is_set_up = True
        if self.initial_credit:
            self.buffer_manager.request_exclusive_buffers(self.initial_credit)

    def request_subpartition(self) -> None:
        """Queue the PartitionRequest (credit = initial credit) on the channel's connection."""
        if self.connection is None:
            raise InputChannelError(f"channel {self.channel_index} has no connection")
        self.setup()
        self.connection.request_subpartition(self)

    # -- network side --

    def request_buffer(self) -> Callable[[], None] | None:
        """A receive buffer for an arriving data buffer: its recycler, or None if none is free."""
        if self.credit_based:
            return self.buffer_manager.request_buffer()
        pool = self.gate.buffer_pool
        if pool.request_buffer():
            return pool.recycle
        return None

    def on_buffer(self, buffer: Buffer, sequence_number: int, backlog: int) -> None:
        """A buffer or event arrived (already holding its receive buffer, if data)."""
        if self.is_released:
            buffer.recycle()
            return
        if sequence_number != self.expected_sequence_number:
            buffer.recycle()
            self.on_error(BufferReorderingError(self.expected_sequence_number, sequence_number, self.channel_index))
            return
        self.expected_sequence_number = sequence_number + 1
        if IS_BUFFER[buffer.data_type]:
            queue = self.received_buffers
            queue.append((buffer, sequence_number))
            if len(queue) == 1:
                self.gate.notify_channel_non_empty(self)
        else:
            self._on_event(buffer, sequence_number)
        if backlog >= 0 and self.credit_based:
            manager = self.buffer_manager
            required = backlog + self.initial_credit
            if manager.is_waiting_for_floating_buffers or manager.num_exclusive + manager.num_floating >= required:
                manager.num_required_buffers = required  # nothing to request (the common case)
            else:
                self.notify_buffer_available(manager.request_floating_buffers(required))

    def _on_event(self, buffer: Buffer, sequence_number: int) -> None:
        """Queue an event: priority events before everything else, in the order they came."""
        data_type = buffer.data_type
        if IS_BLOCKING_UPSTREAM[data_type]:
            self._on_blocking_upstream()
        queue = self.received_buffers
        was_empty = not queue
        if HAS_PRIORITY[data_type]:
            queue.insert(self._num_priority, (buffer, sequence_number))
            self._num_priority += 1
            if self._num_priority == 1:
                self.gate.notify_priority_event(self)
                return
        else:
            queue.append((buffer, sequence_number))
            if data_type is _END_OF_PARTITION:
                self.received_end_of_partition = True
        if was_empty:
            self.gate.notify_channel_non_empty(self)

    def on_empty_buffer(self, sequence_number: int, backlog: int) -> None:
        """An empty data buffer (sent so a channel without exclusive buffers can drop its credit)."""
        if self.is_released:
            return
        if sequence_number != self.expected_sequence_number:
            self.on_error(BufferReorderingError(self.expected_sequence_number, sequence_number, self.channel_index))
            return
        self.expected_sequence_number += 1
        if self.credit_based:
            # the sender spent a credit on it, so it used one of the buffers reserved for this channel:
            # take that buffer and give it back at once, as if the empty buffer had been consumed
            recycler = self.buffer_manager.request_buffer()
            if recycler is not None:
                recycler()
            if backlog >= 0:
                self.on_sender_backlog(backlog)

    def on_sender_backlog(self, backlog: int) -> None:
        """Request floating buffers for ``backlog`` + initial credit; announce what was obtained."""
        self.notify_buffer_available(self.buffer_manager.request_floating_buffers(backlog + self.initial_credit))

    def _on_blocking_upstream(self) -> None:
        if self.initial_credit == 0 and self.credit_based:
            self.unannounced_credit = 0
            self.buffer_manager.num_required_buffers = 0
            self.buffer_manager.release_floating_buffers()

    def notify_buffer_available(self, num_buffers: int) -> None:
        """``num_buffers`` more buffers are reserved for the sender: credit, announced by AddCredit."""
        if num_buffers <= 0 or not self.credit_based:
            return
        before = self.unannounced_credit
        self.unannounced_credit = before + num_buffers
        if before == 0 and self.connection is not None and not self.is_released:
            self.connection.notify_credit_available(self)

    def get_and_reset_unannounced_credit(self) -> int:
        credit, self.unannounced_credit = self.unannounced_credit, 0
        return credit

    def on_error(self, cause: BaseException) -> None:
        """Fail the channel; the consumer sees ``cause`` on its next poll of this channel."""
        if self.error is None:
            self.error = cause
        self.gate.notify_channel_non_empty(self)

    # -- consumer side --

    def get_next_buffer(self) -> tuple[Buffer, bool, int] | None:
        """(buffer, more available, sequence number), or None; raises the channel's error if it failed."""
        if self.error is not None:
            raise self.error
        queue = self.received_buffers
        if not queue:
            return None
        buffer, sequence_number = queue.popleft()
        if self._num_priority:
            self._num_priority -= 1
        self.num_bytes_in += len(buffer.data)  # type: ignore[arg-type]
        self.num_buffers_in += 1
        return buffer, bool(queue), sequence_number

    def resume_consumption(self) -> None:
        """After an upstream-blocking event: ResumeConsumption to the sender."""
        if self.initial_credit == 0:
            self.unannounced_credit = 0
        if self.connection is not None and not self.is_released:
            self.connection.resume_consumption(self)

    def acknowledge_all_records_processed(self) -> None:
        if self.connection is not None and not self.is_released:
            self.connection.acknowledge_all_records_processed(self)

    def announce_buffer_size(self, size: int) -> None:
        if self.connection is not None and not self.is_released:
            self.connection.notify_new_buffer_size(self, size)

    def release_all_resources(self) -> None:
        """Release every buffer (queued ones too) and cancel the request (or close the connection)."""
        if self.is_released:
            return
        self.is_released = True
        queue = self.received_buffers
        while queue:
            queue.popleft()[0].recycle()
        self.buffer_manager.release_all_buffers()
        if self.connection is not None:
            self.connection.close_channel(self)

    # -- metrics --

    @property
    def num_available_buffers(self) -> int:
        """Unused buffers reserved for this channel (exclusive + floating)."""
        return self.buffer_manager.num_available_buffers

    @property
    def num_floating_buffers_available(self) -> int:
        return self.buffer_manager.num_floating

    @property
    def num_required_buffers(self) -> int:
        return self.buffer_manager.num_required_buffers

    @property
    def sender_backlog(self) -> int:
        """The sender's backlog as last announced (required buffers minus the initial credit)."""
        return self.buffer_manager.num_required_buffers - self.initial_credit

    @property
    def is_waiting_for_floating_buffers(self) -> bool:
        return self.buffer_manager.is_waiting_for_floating_buffers

    def queue_length(self) -> int:
        """Received buffers not yet polled (``inputQueueLength`` of this channel)."""
        return len(self.received_buffers)

    @property
    def queue_size_bytes(self) -> int:
        """Bytes of the received buffers not yet polled (``inputQueueSize`` of this channel)."""
        return sum(len(buffer.data) for buffer, _ in self.received_buffers)  # type: ignore[arg-type]

    @property
    def exclusive_buffers_used(self) -> int:
        return max(0, self.initial_credit - self.buffer_manager.num_exclusive)

    def buffers_in_use_count(self) -> int:
        """Queued buffers + the sender's backlog as known here (Flink's ``getBuffersInUseCount``)."""
        return len(self.received_buffers) + max(0, self.buffer_manager.num_required_buffers - self.initial_credit)

    def __repr__(self) -> str:
        return (
            f"RemoteInputChannel(index={self.channel_index}, receiver_id={self.receiver_id}, "
            f"queued={len(self.received_buffers)}, unannounced={self.unannounced_credit}, "
            f"expected_seq={self.expected_sequence_number}, {self.buffer_manager!r})"
        )


# -- local channel ------------------------------------------------------------------------------------


class LocalInputChannel:
    """An input channel reading a subpartition of the same process directly (Flink's ``LocalInputChannel``).

    No credits and no buffers of its own: it hands the consumer slices of the producer's segments, which
    go back to the producer's pool when recycled, so backpressure shows as the producer's pool filling.
    Empty data buffers are skipped.

    ``partition_provider`` is a partition or a :class:`ResultPartitionManager` of this process, or the
    :class:`CreditBasedPartitionRequestClientHandler` of a connection to another process of the same
    executor; then the channel reads a :class:`ConnectionSubpartitionView` registered as ``receiver_id``.
    """

    is_local = True

    def __init__(
        self,
        gate: SingleInputGate,
        channel_index: int,
        partition_provider: object,
        *,
        partition_id: int = 0,
        subpartition: int = 0,
        receiver_id: int = 0,
    ) -> None:
        self.gate = gate
        self.channel_index = channel_index
        self.partition_provider = partition_provider
        self.partition_id = partition_id
        self.subpartition = subpartition
        self.receiver_id = receiver_id
        self.view = None
        self.error: BaseException | None = None
        self.is_released = False
        self.is_queued = False
        self.received_end_of_partition = False
        self.num_buffers_in = 0
        self.num_bytes_in = 0
        self.initial_credit = 0

    def setup(self) -> None:
        """Local channels take no buffers."""

    def request_subpartition(self) -> None:
        """Open the producer's subpartition view."""
        if self.view is not None:
            return
        provider = self.partition_provider
        if isinstance(provider, ResultPartitionManager):
            self.view = provider.create_subpartition_view(self.partition_id, self.subpartition, self)
        elif isinstance(provider, CreditBasedPartitionRequestClientHandler):
            self.view = provider.request_local_subpartition(  # type: ignore[assignment]
                self.receiver_id, self.partition_id, self.subpartition, self
            )
        else:  # a partition: create_subpartition_view(subpartition, listener)
            self.view = provider.create_subpartition_view(self.subpartition, self)  # type: ignore[attr-defined]
        self.gate.notify_channel_non_empty(self)

    def notify_data_available(self) -> None:
        if self.view is not None:
            self.gate.notify_channel_non_empty(self)

    def notify_priority_event(self, sequence_number: int) -> None:
        if self.view is not None:
            self.gate.notify_priority_event(self)

    def get_next_buffer(self) -> tuple[Buffer, bool, int] | None:
        if self.error is not None:
            raise self.error
        view = self.view
        if view is None or self.is_released:
            return None
        nxt = view.get_next_buffer()
        while nxt is not None and not len(nxt.buffer.data) and IS_BUFFER[nxt.buffer.data_type]:
            nxt.buffer.recycle()
            self.num_buffers_in += 1
            nxt = view.get_next_buffer()
        if nxt is None:
            if view.is_released and not self.received_end_of_partition:
                raise InputChannelError(f"local channel {self.channel_index}: the producer's subpartition was released")
            return None
        buffer = nxt.buffer
        self.num_buffers_in += 1
        self.num_bytes_in += len(buffer.data)  # type: ignore[arg-type]
        if buffer.data_type is _END_OF_PARTITION:
            self.received_end_of_partition = True
        return buffer, nxt.next_data_type is not _NONE, nxt.sequence_number

    def resume_consumption(self) -> None:
        """Unblock the subpartition after an aligned barrier; if data waits behind it, the gate hears of
        this channel again (Flink's ``LocalInputChannel.resumeConsumption``)."""
        view = self.view
        if view is not None:
            view.resume_consumption()
            self.gate.notify_channel_non_empty(self)  # a poll that finds nothing just drops the channel

    def acknowledge_all_records_processed(self) -> None:
        if self.view is not None:
            self.view.acknowledge_all_data_processed()

    def announce_buffer_size(self, size: int) -> None:
        if self.view is not None:
            self.view.notify_new_buffer_size(size)

    def release_all_resources(self) -> None:
        if self.is_released:
            return
        self.is_released = True
        if self.view is not None:
            self.view.release_all_resources()

    def queue_length(self) -> int:
        """The producer subpartition's queue length (as Flink reports for local channels)."""
        return self.view.queue_length() if self.view is not None else 0

    def buffers_in_use_count(self) -> int:
        """Buffers queued in the producer's subpartition (a local channel holds none of its own)."""
        return self.queue_length()

    queue_size_bytes = 0
    exclusive_buffers_used = 0


class ConnectionSubpartitionView:
    """A producer's subpartition in another process of the same executor, read through a connection: the
    view a :class:`LocalInputChannel` reads when producer and consumer share an executor but not a process.

    Buffers arrive as BufferResponses with no credit (the server sends whenever it has data) and are queued
    here; the producer keeps the segment of each data buffer in its pool meanwhile. Recycling a data buffer
    counts it; the count goes to the producer as :class:`RecycleBuffers` (built when sent, so recycles made
    while the link is busy go out as one message), and the producer returns that many segments to its pool.
    Sequence numbers are checked (the wire is untrusted); empty data buffers are recycled at once.
    """

    __slots__ = (
        "_queue",
        "connection",
        "error",
        "expected_sequence_number",
        "is_released",
        "listener",
        "receiver_id",
        "unannounced_recycled",
    )

    def __init__(
        self, receiver_id: int, connection: CreditBasedPartitionRequestClientHandler, listener: LocalInputChannel
    ) -> None:
        self.receiver_id = receiver_id
        self.connection = connection
        self.listener = listener
        self._queue: deque[tuple[Buffer, int, int]] = deque()
        self.expected_sequence_number = 0
        self.unannounced_recycled = 0
        self.error: BaseException | None = None
        self.is_released = False

    # -- network side --

    def on_buffer(self, data_type: DataType, payload: object, sequence_number: int, backlog: int) -> None:
        """A BufferResponse for this channel arrived."""
        if self.is_released:
            return
        if sequence_number != self.expected_sequence_number:
            self.on_error(
                BufferReorderingError(self.expected_sequence_number, sequence_number, self.listener.channel_index)
            )
            return
        self.expected_sequence_number = sequence_number + 1
        if IS_BUFFER[data_type]:
            if not len(payload):  # type: ignore[arg-type]
                self._recycle_one()  # nothing to read; the producer's segment goes back at once
                return
            buffer = Buffer(data_type, payload, self._recycle_one)
        else:
            buffer = Buffer(data_type, payload)
        queue = self._queue
        queue.append((buffer, sequence_number, backlog))
        if len(queue) == 1:
            self.listener.notify_data_available()

    def on_error(self, cause: BaseException) -> None:
        if self.error is None:
            self.error = cause
        self.listener.notify_data_available()

    def _recycle_one(self) -> None:
        if self.is_released:
            return
        before = self.unannounced_recycled
        self.unannounced_recycled = before + 1
        if before == 0:
            self.connection.notify_recycled(self)

    def get_and_reset_unannounced_recycled(self) -> int:
        count, self.unannounced_recycled = self.unannounced_recycled, 0
        return count

    # -- the view a LocalInputChannel reads --

    def get_next_buffer(self) -> BufferAndBacklog | None:
        if self.error is not None:
            raise self.error
        queue = self._queue
        if not queue:
            return None
        buffer, sequence_number, backlog = queue.popleft()
        next_type = queue[0][0].data_type if queue else _NONE
        return _new_tuple(BufferAndBacklog, (buffer, backlog, next_type, sequence_number))

    def queue_length(self) -> int:
        """Buffers received and not yet read."""
        return len(self._queue)

    def resume_consumption(self) -> None:
        if not self.is_released:
            self.connection._enqueue(ResumeConsumption(self.receiver_id))

    def acknowledge_all_data_processed(self) -> None:
        if not self.is_released:
            self.connection._enqueue(AckAllUserRecordsProcessed(self.receiver_id))

    def notify_new_buffer_size(self, size: int) -> None:
        if not self.is_released:
            self.connection._enqueue(NewBufferSize(self.receiver_id, size))

    def release_all_resources(self) -> None:
        """Drop what is queued and cancel the request (the producer then returns every held segment)."""
        if self.is_released:
            return
        self.is_released = True
        self._queue.clear()
        self.connection.close_receiver(self.receiver_id)

    def __repr__(self) -> str:
        return (
            f"ConnectionSubpartitionView(receiver_id={self.receiver_id}, queued={len(self._queue)}, "
            f"unannounced_recycled={self.unannounced_recycled}, expected_seq={self.expected_sequence_number})"
        )


# -- input gate ---------------------------------------------------------------------------------------


class SingleInputGate:
    """One input of a consumer subtask: its channels and the floating buffer pool they share.

    The gate keeps a FIFO of channels with data (priority channels first); :meth:`poll_next` takes the
    head channel's next buffer and re-queues the channel at the tail if it has more (round robin). A
    channel that delivered END_OF_PARTITION is released; the gate is finished when all are.
    """

    def __init__(
        self,
        network_pool: NetworkBufferPool,
        num_channels: int,
        config: NetworkConfig,
        *,
        num_remote_channels: int | None = None,
        gate_index: int = 0,
        blocking: bool = False,
        buffer_pool: LocalBufferPool | None = None,
    ) -> None:
        self.network_pool = network_pool
        self.config = config
        self.gate_index = gate_index
        self.credit_based = config.credit_based
        self.num_channels = num_channels
        self.spec: GateBuffersSpec = input_gate_buffers_spec(
            num_channels, config, num_remote_channels=num_remote_channels, blocking=blocking
        )
        if buffer_pool is None:
            buffer_pool = network_pool.create_buffer_pool(self.spec.floating_min, self.spec.floating_max)
        #: The gate's floating buffers (all its buffers in the model without credits).
        self.buffer_pool = buffer_pool
        self.channels: list[RemoteInputChannel | LocalInputChannel | None] = [None] * num_channels
        self._channels_with_data: deque[RemoteInputChannel | LocalInputChannel] = deque()
        self._num_priority_channels = 0
        self.num_finished_channels = 0
        self.is_closed = False
        #: Called when the gate goes from nothing to poll to something to poll.
        self.listener: Callable[[], None] | None = None

    # -- wiring --

    def remote_channel(
        self,
        channel_index: int,
        receiver_id: int,
        connection: CreditBasedPartitionRequestClientHandler,
        *,
        partition_id: int = 0,
        subpartition: int = 0,
    ) -> RemoteInputChannel:
        """Create remote channel ``channel_index`` on ``connection``."""
        channel = RemoteInputChannel(
            self,
            channel_index,
            receiver_id,
            partition_id=partition_id,
            subpartition=subpartition,
            connection=connection,
        )
        self._set_channel(channel)
        connection.add_input_channel(channel)
        return channel

    def local_channel(
        self,
        channel_index: int,
        partition_provider: object,
        *,
        partition_id: int = 0,
        subpartition: int = 0,
        receiver_id: int = 0,
    ) -> LocalInputChannel:
        """Create local channel ``channel_index`` reading ``partition_provider``: a partition or a manager of
        this process, or the client handler of a connection to another process of the executor (then
        ``receiver_id`` names the channel on that connection)."""
        channel = LocalInputChannel(
            self,
            channel_index,
            partition_provider,
            partition_id=partition_id,
            subpartition=subpartition,
            receiver_id=receiver_id,
        )
        self._set_channel(channel)
        return channel

    def _set_channel(self, channel: RemoteInputChannel | LocalInputChannel) -> None:
        if not 0 <= channel.channel_index < self.num_channels:
            raise ValueError(f"channel index {channel.channel_index} outside [0, {self.num_channels})")
        if self.channels[channel.channel_index] is not None:
            raise ValueError(f"channel {channel.channel_index} is already set")
        self.channels[channel.channel_index] = channel

    def setup(self) -> None:
        """Reserve one floating buffer, then the exclusive buffers of every remote channel (FLINK-24035)."""
        self.buffer_pool.reserve_segments(1)
        for channel in self.channels:
            if channel is not None:
                channel.setup()

    def request_partitions(self) -> None:
        """Send every channel's partition request (set up first if needed)."""
        missing = [i for i, c in enumerate(self.channels) if c is None]
        if missing:
            raise ValueError(f"channels {missing} of the gate were never created")
        self.setup()
        for channel in self.channels:
            channel.request_subpartition()  # type: ignore[union-attr]

    # -- notifications from channels --

    def notify_channel_non_empty(self, channel: RemoteInputChannel | LocalInputChannel) -> None:
        if channel.is_queued or self.is_closed:
            return
        channel.is_queued = True
        was_empty = not self._channels_with_data
        self._channels_with_data.append(channel)
        if was_empty and self.listener is not None:
            self.listener()

    def notify_priority_event(self, channel: RemoteInputChannel | LocalInputChannel) -> None:
        if self.is_closed:
            return
        queue = self._channels_with_data
        was_empty = not queue
        if channel.is_queued:
            queue.remove(channel)
        channel.is_queued = True
        queue.appendleft(channel)
        if was_empty and self.listener is not None:
            self.listener()

    # -- consuming --

    def has_data(self) -> bool:
        """Some channel may have a buffer (a poll may still return None)."""
        return bool(self._channels_with_data)

    def poll_next(self) -> BufferOrEvent | None:
        """The next buffer or event of any channel, round robin; None if none is there now.

        Raises the error of a failed channel.
        """
        queue = self._channels_with_data
        while queue:
            channel = queue[0]
            result = channel.get_next_buffer()
            if result is None:
                queue.popleft()
                channel.is_queued = False
                continue
            buffer, more, sequence_number = result
            if more:  # round robin: to the tail
                queue.rotate(-1)
            else:
                queue.popleft()
                channel.is_queued = False
            if buffer.data_type is _END_OF_PARTITION:
                self.num_finished_channels += 1
                channel.release_all_resources()
            return _new_tuple(BufferOrEvent, (buffer, channel.channel_index, sequence_number, bool(queue)))
        return None

    @property
    def is_finished(self) -> bool:
        """Every channel delivered END_OF_PARTITION."""
        return self.num_finished_channels == self.num_channels

    def resume_consumption(self, channel_index: int) -> None:
        self.channels[channel_index].resume_consumption()  # type: ignore[union-attr]

    def buffers_in_use_count(self) -> int:
        """Buffers holding this gate's data, queued or announced as backlog (what debloating sizes)."""
        return sum(c.buffers_in_use_count() for c in self.channels if c is not None)

    def announce_buffer_size(self, size: int) -> None:
        """Ask every producer to cut new buffers at ``size`` bytes (``NewBufferSize``; debloating)."""
        if size <= 0:
            raise ValueError(f"buffer size must be > 0, got {size}")
        for channel in self.channels:
            if channel is not None:
                channel.announce_buffer_size(size)

    def close(self) -> None:
        """Release every channel and destroy the floating pool (buffers in use return when recycled)."""
        if self.is_closed:
            return
        for channel in self.channels:
            if channel is not None:
                channel.release_all_resources()
        self.is_closed = True
        self._channels_with_data.clear()
        self.buffer_pool.lazy_destroy()

    # -- metrics (§7) --

    def _remote(self) -> list[RemoteInputChannel]:
        return [c for c in self.channels if isinstance(c, RemoteInputChannel)]

    @property
    def input_exclusive_buffers_usage(self) -> float:
        remote = self._remote()
        total = sum(c.initial_credit for c in remote)
        if total == 0:
            return 0.0
        return sum(max(0, c.initial_credit - c.buffer_manager.num_exclusive) for c in remote) / total

    def _floating_used(self) -> int:
        unused_floating = sum(c.buffer_manager.num_floating for c in self._remote())
        return max(0, self.buffer_pool.num_used - unused_floating)

    @property
    def input_floating_buffers_usage(self) -> float:
        size = self.buffer_pool.current_pool_size
        return self._floating_used() / size if size else 0.0

    @property
    def in_pool_usage(self) -> float:
        remote = self._remote()
        exclusive_total = sum(c.initial_credit for c in remote)
        exclusive_used = sum(max(0, c.initial_credit - c.buffer_manager.num_exclusive) for c in remote)
        denominator = self.buffer_pool.current_pool_size + exclusive_total
        return (self._floating_used() + exclusive_used) / denominator if denominator else 0.0

    def input_queue_length(self) -> int:
        return sum(c.queue_length() for c in self.channels if c is not None)

    def input_queue_size(self) -> int:
        return sum(c.queue_size_bytes for c in self.channels if c is not None)

    def _sum_in(self, local: bool, attribute: str) -> int:
        return sum(getattr(c, attribute) for c in self.channels if c is not None and c.is_local == local)

    @property
    def num_buffers_in_local(self) -> int:
        return self._sum_in(True, "num_buffers_in")

    @property
    def num_buffers_in_remote(self) -> int:
        return self._sum_in(False, "num_buffers_in")

    @property
    def num_bytes_in_local(self) -> int:
        return self._sum_in(True, "num_bytes_in")

    @property
    def num_bytes_in_remote(self) -> int:
        return self._sum_in(False, "num_bytes_in")


# -- client handler -----------------------------------------------------------------------------------


class CreditBasedPartitionRequestClientHandler:
    """The client end of one connection (Flink's ``CreditBasedPartitionRequestClientHandler`` and
    ``NettyPartitionRequestClient``): channels by receiver id, inbound routing, outbound FIFO.

    Outbound AddCredit messages are built when pulled, with the credit accumulated by then, so credit
    gathered while the link is busy goes out as one message. With a ``secret`` the first outbound message
    is :class:`Hello`. Releasing the last channel sends CloseRequest, any other one CancelPartitionRequest.

    In the model without credits (``credit_based=False``) a data buffer that finds no free buffer in its
    gate's pool is staged, and :attr:`is_reading` turns False: the transport must stop delivering input
    for the *whole connection* until a recycled buffer lets the staged messages through.
    """

    def __init__(
        self,
        *,
        credit_based: bool = True,
        secret: bytes | None = None,
        max_frame_length: int = default_max_frame_length(32 * 1024),
    ) -> None:
        self.credit_based = credit_based
        self.input_channels: dict[int, RemoteInputChannel] = {}
        #: The local channels on this connection (producer and consumer share an executor), by receiver id.
        self.local_views: dict[int, ConnectionSubpartitionView] = {}
        self._outbound: deque[ClientMessage | RemoteInputChannel | ConnectionSubpartitionView] = deque()
        self._decoder = FrameDecoder(max_frame_length)
        self._staged: deque[BufferResponse] = deque()
        self._waiting_pool: LocalBufferPool | None = None
        self.is_reading = True
        self.is_closed = False
        self.fatal_error: BaseException | None = None
        #: Called when the handler goes from nothing to send to something to send, or resumes reading.
        self.listener: Callable[[], None] | None = None
        self.num_times_paused = 0
        if secret is not None:
            self._outbound.append(Hello(secret))

    # -- channels and outbound --

    def add_input_channel(self, channel: RemoteInputChannel) -> None:
        if channel.receiver_id in self.input_channels or channel.receiver_id in self.local_views:
            raise ValueError(f"receiver id {channel.receiver_id} is already used on this connection")
        self.input_channels[channel.receiver_id] = channel
        channel.connection = self

    def request_local_subpartition(
        self, receiver_id: int, partition_id: int, subpartition: int, listener: LocalInputChannel
    ) -> ConnectionSubpartitionView:
        """Open a local channel on this connection: the view ``listener`` reads, and its PartitionRequest."""
        if receiver_id in self.input_channels or receiver_id in self.local_views:
            raise ValueError(f"receiver id {receiver_id} is already used on this connection")
        view = ConnectionSubpartitionView(receiver_id, self, listener)
        self.local_views[receiver_id] = view
        self._enqueue(PartitionRequest(receiver_id, subpartition, 0, partition_id, True))
        return view

    def _enqueue(self, item: ClientMessage | RemoteInputChannel | ConnectionSubpartitionView) -> None:
        was_idle = not self._outbound
        self._outbound.append(item)
        if was_idle and self.listener is not None:
            self.listener()

    def request_subpartition(self, channel: RemoteInputChannel) -> None:
        if channel.receiver_id not in self.input_channels:
            self.add_input_channel(channel)
        self._enqueue(
            PartitionRequest(channel.receiver_id, channel.subpartition, channel.initial_credit, channel.partition_id)
        )

    #: A channel has unannounced credit: queue it; its AddCredit is made when it is sent.
    notify_credit_available = _enqueue
    #: A local channel's view has recycles to announce: queue it; its RecycleBuffers is made when sent.
    notify_recycled = _enqueue

    def resume_consumption(self, channel: RemoteInputChannel) -> None:
        self._enqueue(ResumeConsumption(channel.receiver_id))

    def acknowledge_all_records_processed(self, channel: RemoteInputChannel) -> None:
        self._enqueue(AckAllUserRecordsProcessed(channel.receiver_id))

    def notify_new_buffer_size(self, channel: RemoteInputChannel, size: int) -> None:
        self._enqueue(NewBufferSize(channel.receiver_id, size))

    def close_channel(self, channel: RemoteInputChannel) -> None:
        """The channel is released: cancel its request, or close the connection if it was the last."""
        self.close_receiver(channel.receiver_id)

    def close_receiver(self, receiver_id: int) -> None:
        """Channel ``receiver_id`` (remote or local) is released: cancel its request, or close the
        connection if it was the last."""
        found = self.input_channels.pop(receiver_id, None) or self.local_views.pop(receiver_id, None)
        if found is None or self.is_closed:
            return
        if self.input_channels or self.local_views:
            self._enqueue(CancelPartitionRequest(receiver_id))
        else:
            self._enqueue(CloseRequest())
            self.is_closed = True

    def has_data(self) -> bool:
        return bool(self._outbound)

    def next_message(self) -> ClientMessage | None:
        """The next message to send, or None."""
        outbound = self._outbound
        while outbound:
            item = outbound.popleft()
            if type(item) is RemoteInputChannel:
                if item.is_released:
                    continue
                credit = item.get_and_reset_unannounced_credit()
                if credit == 0:
                    continue
                return _new_tuple(AddCredit, (item.receiver_id, credit))
            if type(item) is ConnectionSubpartitionView:
                count = item.get_and_reset_unannounced_recycled()
                if count == 0 or item.is_released:
                    continue
                return RecycleBuffers(item.receiver_id, count)
            return item  # type: ignore[return-value]
        return None

    def data_to_send(self, max_messages: int | None = None) -> list[object]:
        chunks: list[object] = []
        count = 0
        while max_messages is None or count < max_messages:
            message = self.next_message()
            if message is None:
                break
            chunks.extend(encode(message))
            count += 1
        return chunks

    # -- inbound --

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from the wire; raises :class:`ProtocolError` on a bad frame."""
        for message in self._decoder.receive_data(data):
            self.receive_message(message)

    def receive_message(self, message: Message) -> None:
        """One decoded message from the server."""
        kind = type(message)
        if kind is BufferResponse:
            if self.local_views:
                view = self.local_views.get(message[0])  # type: ignore[index]
                if view is not None:  # a local channel: no credit, no receive buffer of the gate
                    _, _, sequence_number, backlog, data_type, _, payload = message  # type: ignore[misc]
                    view.on_buffer(data_type, payload, sequence_number, backlog)
                    return
            if self.credit_based:
                receiver_id, _, sequence_number, backlog, data_type, _, payload = message  # type: ignore[misc]
                channel = self.input_channels.get(receiver_id)
                if (
                    channel is not None and IS_BUFFER[data_type] and not channel.is_released and len(payload)
                ):  # the common case, inline: a data buffer into a credit-backed channel buffer
                    recycler = channel.buffer_manager.request_buffer()
                    if recycler is not None:
                        channel.on_buffer(Buffer(data_type, payload, recycler), sequence_number, backlog)
                        return
                    channel.buffer_manager.num_required_buffers += 1  # undo; the slow path takes it again
                self._decode_buffer_response(message)  # type: ignore[arg-type]
            elif self._staged or not self._decode_without_credit(message):  # type: ignore[arg-type]
                self._staged.append(message)  # type: ignore[arg-type]
                self._pause()
        elif kind is BacklogAnnouncement:
            channel = self.input_channels.get(message.receiver_id)
            if channel is not None and not channel.is_released:
                channel.on_sender_backlog(message.backlog)
        elif kind is ErrorResponse:
            self._on_error_response(message)  # type: ignore[arg-type]
        else:
            raise ProtocolError(f"unexpected {kind.__name__} from a server")

    def _decode_buffer_response(self, message: BufferResponse) -> None:
        channel = self.input_channels.get(message.receiver_id)
        if channel is None or channel.is_released:
            if channel is None and not self.is_closed:
                self._enqueue(CancelPartitionRequest(message.receiver_id))
            return
        data_type = message.data_type
        payload = message.payload
        if not IS_BUFFER[data_type]:  # events get an unpooled buffer of their own
            channel.on_buffer(Buffer(data_type, payload), message.sequence_number, message.backlog)
            return
        if not len(payload):  # type: ignore[arg-type]
            channel.on_empty_buffer(message.sequence_number, message.backlog)
            return
        recycler = channel.buffer_manager.request_buffer()
        if recycler is None:
            channel.on_error(
                ProtocolError(
                    f"channel {channel.channel_index}: the read buffer is null in credit-based input channel "
                    f"(a data buffer arrived with no credit reserved for it)"
                )
            )
            return
        channel.on_buffer(Buffer(data_type, payload, recycler), message.sequence_number, message.backlog)

    def _decode_without_credit(self, message: BufferResponse) -> bool:
        """Old model: take a buffer of the channel's gate pool; False if none is free (stage and pause)."""
        channel = self.input_channels.get(message.receiver_id)
        if channel is None or channel.is_released:
            if channel is None and not self.is_closed:
                self._enqueue(CancelPartitionRequest(message.receiver_id))
            return True
        if IS_BUFFER[message.data_type] and len(message.payload):  # type: ignore[arg-type]
            pool = channel.gate.buffer_pool
            if not pool.request_buffer():
                if pool.add_buffer_listener(self):
                    self._waiting_pool = pool
                    return False
                if not pool.request_buffer():  # a segment appeared between the two calls
                    return False
            buffer = Buffer(message.data_type, message.payload, pool.recycle)
        else:
            buffer = Buffer(message.data_type, message.payload)
        channel.on_buffer(buffer, message.sequence_number, -1)
        return True

    def notify_buffer_available(self) -> bool:
        """BufferListener (old model): a gate pool offers a buffer for the head staged message."""
        self._waiting_pool = None
        if not self._staged:
            return False
        message = self._staged.popleft()
        channel = self.input_channels.get(message.receiver_id)
        if channel is None or channel.is_released:
            self._drain_staged()
            return False
        pool = channel.gate.buffer_pool
        channel.on_buffer(Buffer(message.data_type, message.payload, pool.recycle), message.sequence_number, -1)
        self._drain_staged()
        return True

    def _drain_staged(self) -> None:
        staged = self._staged
        while staged:
            if not self._decode_without_credit(staged[0]):
                return
            staged.popleft()
        if not self.is_reading:
            self.is_reading = True
            if self.listener is not None:
                self.listener()

    def _pause(self) -> None:
        if self.is_reading:
            self.is_reading = False
            self.num_times_paused += 1
        if self._waiting_pool is None and self._staged:
            # the head could not even register (pool destroyed or a race): retry it now
            self._drain_staged()

    def _on_error_response(self, message: ErrorResponse) -> None:
        error = InputChannelError(f"remote error: {message.message}")
        if message.receiver_id is None:
            self.fatal_error = error
            for channel in list(self.input_channels.values()):
                channel.on_error(error)
            for view in list(self.local_views.values()):
                view.on_error(error)
        else:
            target = self.input_channels.get(message.receiver_id) or self.local_views.get(message.receiver_id)
            if target is not None:
                target.on_error(error)

    def connection_closed(self) -> None:
        """The connection went away: fail every channel still open."""
        error = InputChannelError("connection to the producer closed")
        for channel in list(self.input_channels.values()):
            if not channel.is_released and not channel.received_end_of_partition:
                channel.on_error(error)
        for view in list(self.local_views.values()):
            if not view.is_released and not view.listener.received_end_of_partition:
                view.on_error(error)
        self._decoder.close()

    @property
    def num_staged(self) -> int:
        return len(self._staged)
