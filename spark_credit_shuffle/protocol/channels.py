"""Input channels: where a consumer subtask's buffers arrive, one channel per producer subtask
(Flink's ``InputChannel`` family; docs/flink.md, "Receiver side" and "Local channels").

:class:`InputChannel` is what the gate reads of any channel. :class:`RemoteInputChannel` with its
:class:`BufferManager` holds the channel's exclusive buffers (its initial credit) and asks the gate's
floating pool for more according to the backlog the sender announces; every buffer it obtains becomes
credit, announced to the sender with AddCredit through its :class:`PartitionRequestClient` (the client
handler of its connection). A received data buffer occupies one of these buffers until the consumer
recycles it. The channel without credit, reading a producer of the same executor, is
:class:`~spark_credit_shuffle.protocol.local_channel.LocalInputChannel`.

With ``credit_based=False`` (the model before Flink 1.5) channels have no exclusive buffers and announce
no credit; a data buffer takes a buffer from its gate's pool on arrival.

Not thread-safe: callers serialise access.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from ..buffers.buffer import Buffer, DataType
from ..buffers.format import is_keep_alive
from ..buffers.pools import LocalBufferPool, NetworkBufferPool
from ..buffers.sizing import GateBuffersSpec
from ..errors import BufferReorderingError, CreditShuffleError
from ._flags import HAS_PRIORITY, IS_BLOCKING_UPSTREAM, IS_BUFFER

__all__ = [
    "BufferManager",
    "BufferTally",
    "InputChannel",
    "InputChannelError",
    "InputGate",
    "PartitionRequestClient",
    "RemoteInputChannel",
]

_END_OF_PARTITION = DataType.END_OF_PARTITION


class InputChannelError(CreditShuffleError):
    """An input channel failed (its error surfaces on the consumer's next poll). ``remote``: the typed error
    the producer failed with, when it reported one (Flink's ``ErrorResponse`` carrying the producer's cause):
    the first cause of a failed exchange, which a consumer raises instead of its own knock-on failure."""

    remote: CreditShuffleError | None = None


class InputChannel(Protocol):
    """What the gate reads of a channel, remote or local (Flink's abstract ``InputChannel``)."""

    channel_index: int
    is_queued: bool
    is_released: bool
    received_end_of_partition: bool
    num_buffers_in: int
    num_bytes_in: int
    initial_credit: int

    @property
    def is_local(self) -> bool: ...

    @property
    def queue_size_bytes(self) -> int: ...

    def setup(self) -> None: ...

    def request_subpartition(self) -> None: ...

    def get_next_buffer(self) -> tuple[Buffer, bool, int] | None:
        """(buffer, more available, sequence number), or None; raises the channel's error if it failed."""

    def resume_consumption(self) -> None: ...

    def acknowledge_all_records_processed(self) -> None: ...

    def announce_buffer_size(self, size: int) -> None: ...

    def acknowledge_checkpoint(self, checkpoint_id: int, declined: bool) -> None: ...

    def release_all_resources(self) -> None: ...

    def queue_length(self) -> int: ...

    def buffers_in_use_count(self) -> int: ...


class InputGate(Protocol):
    """What a channel uses of its gate (Flink's ``SingleInputGate`` as its channels see it)."""

    credit_based: bool
    spec: GateBuffersSpec
    network_pool: NetworkBufferPool
    buffer_pool: LocalBufferPool

    def notify_channel_non_empty(self, channel: InputChannel) -> None: ...

    def notify_priority_event(self, channel: InputChannel) -> None: ...


class PartitionRequestClient(Protocol):
    """What a remote channel asks of its connection (Flink's ``PartitionRequestClient``); implemented by
    :class:`~spark_credit_shuffle.protocol.client.CreditBasedPartitionRequestClientHandler`."""

    def request_subpartition(self, channel: RemoteInputChannel) -> None: ...

    def notify_credit_available(self, channel: RemoteInputChannel) -> None: ...

    def resume_consumption(self, channel: RemoteInputChannel) -> None: ...

    def acknowledge_all_records_processed(self, channel: RemoteInputChannel) -> None: ...

    def notify_new_buffer_size(self, channel: RemoteInputChannel, size: int) -> None: ...

    def acknowledge_checkpoint(self, channel: RemoteInputChannel, checkpoint_id: int, declined: bool) -> None: ...

    def close_channel(self, channel: RemoteInputChannel) -> None: ...


# -- remote channel -----------------------------------------------------------------------------------


class BufferTally:
    """The unused exclusive and floating buffers of every remote channel of one gate, summed as they change,
    so the gate's buffer usage gauges (sampled on every data buffer) cost the same whatever its channels."""

    __slots__ = ("channels", "exclusive", "floating")

    def __init__(self) -> None:
        self.channels = 0  # the buffer managers that add to it
        self.exclusive = 0
        self.floating = 0


class BufferManager:
    """The buffers of one remote channel (Flink's ``BufferManager`` + ``AvailableBufferQueue``).

    Counts the channel's unused exclusive and floating buffers, ``num_required_buffers`` (backlog +
    initial credit) and whether it waits for a floating buffer of the gate's pool; the counts of unused
    buffers are added to the gate's :class:`BufferTally` as they change.
    """

    __slots__ = (
        "_exclusive",
        "_floating",
        "channel",
        "floating_pool",
        "global_pool",
        "is_waiting_for_floating_buffers",
        "num_required_buffers",
        "tally",
    )

    def __init__(
        self,
        channel: RemoteInputChannel,
        global_pool: NetworkBufferPool,
        floating_pool: LocalBufferPool,
        tally: BufferTally | None = None,
    ):
        self.channel = channel
        self.global_pool = global_pool
        self.floating_pool = floating_pool
        self.tally = tally if tally is not None else BufferTally()
        self.tally.channels += 1
        self._exclusive = 0  # unused exclusive buffers
        self._floating = 0  # unused floating buffers
        self.num_required_buffers = 0
        self.is_waiting_for_floating_buffers = False

    @property
    def num_exclusive(self) -> int:
        """Unused exclusive buffers."""
        return self._exclusive

    @num_exclusive.setter
    def num_exclusive(self, value: int) -> None:
        self.tally.exclusive += value - self._exclusive
        self._exclusive = value

    @property
    def num_floating(self) -> int:
        """Unused floating buffers."""
        return self._floating

    @num_floating.setter
    def num_floating(self, value: int) -> None:
        self.tally.floating += value - self._floating
        self._floating = value

    @property
    def num_available_buffers(self) -> int:
        """Unused buffers (exclusive + floating), each reserved for one data buffer of this channel."""
        return self.num_exclusive + self.num_floating

    def request_exclusive_buffers(self, n: int) -> None:
        """Take ``n`` exclusive (unpooled) segments from the global pool."""
        self.global_pool.request_unpooled_segments(n)
        self.num_exclusive += n

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
        gate: InputGate,
        channel_index: int,
        receiver_id: int,
        *,
        partition_id: int = 0,
        subpartition: int = 0,
        connection: PartitionRequestClient | None = None,
    ) -> None:
        self.gate = gate
        self.channel_index = channel_index
        self.receiver_id = receiver_id
        self.partition_id = partition_id
        self.subpartition = subpartition
        self.connection = connection
        self.credit_based = gate.credit_based
        self.initial_credit = gate.spec.exclusive_per_channel if gate.credit_based else 0
        self.buffer_manager = BufferManager(
            self, gate.network_pool, gate.buffer_pool, getattr(gate, "buffer_tally", None)
        )
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
        #: The sender's backlog as announced before an upstream-blocking barrier, until consumption resumes
        #: (what :meth:`buffers_in_use_count` counts meanwhile), else None.
        self.backlog_before_block: int | None = None

    # -- setup --

    def setup(self, *, exclusive_granted: bool = False) -> None:
        """Take the exclusive buffers (raises InsufficientNetworkBuffersError if they do not fit).

        ``exclusive_granted``: the gate already took them from the network buffer pool, with those of its
        other channels in one request (:meth:`SingleInputGate.setup`); the channel only counts them."""
        if self.is_set_up:
            return
        self.is_set_up = True
        if self.initial_credit:
            if exclusive_granted:
                self.buffer_manager.num_exclusive += self.initial_credit
            else:
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
            if IS_BLOCKING_UPSTREAM[buffer.data_type]:
                self.backlog_before_block = max(0, self.buffer_manager.num_required_buffers - self.initial_credit)
            self._on_event(buffer, sequence_number)
        if backlog >= 0 and self.credit_based:
            manager = self.buffer_manager
            required = backlog + self.initial_credit
            if manager.is_waiting_for_floating_buffers or manager.num_exclusive + manager.num_floating >= required:
                manager.num_required_buffers = required  # nothing to request (the common case)
            else:
                self.notify_buffer_available(manager.request_floating_buffers(required))

    def _on_event(self, buffer: Buffer, sequence_number: int) -> None:
        """Queue an event: priority events (unaligned barriers) before everything else, in the order they came,
        and the gate hears of the channel as a priority channel; a keep-alive queues as any event."""
        data_type = buffer.data_type
        if IS_BLOCKING_UPSTREAM[data_type]:
            self._on_blocking_upstream()
        queue = self.received_buffers
        was_empty = not queue
        if HAS_PRIORITY[data_type] and not is_keep_alive(data_type, buffer.data):
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
        self.num_bytes_in += len(buffer.data)
        self.num_buffers_in += 1
        return buffer, bool(queue), sequence_number

    def resume_consumption(self) -> None:
        """After an upstream-blocking event: ResumeConsumption to the sender."""
        self.backlog_before_block = None
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

    def acknowledge_checkpoint(self, checkpoint_id: int, declined: bool) -> None:
        if self.connection is not None and not self.is_released:
            self.connection.acknowledge_checkpoint(self, checkpoint_id, declined)

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
        return sum(len(buffer.data) for buffer, _ in self.received_buffers)

    def buffers_in_use_count(self) -> int:
        """Queued buffers + the sender's backlog as known here (Flink's ``getBuffersInUseCount``), what buffer
        debloating divides its target by.

        A sender blocked behind an aligned barrier announces a backlog of 0 with it (Flink's
        ``getBuffersInBacklogUnsafe``), though its subpartition keeps its queue and fills on until the
        consumer resumes consumption; until then the backlog announced before the barrier counts instead.
        Unlike Flink: there the count drops during every alignment, and behind a slow consumer with
        checkpoints back to back (a third of the time) those samples ask for buffers several times larger,
        so the debloater's average settles well above the target (1.7-3x its start delay in the
        simulation's checkpoint demo, 0.85-1.2x with this count)."""
        backlog = max(0, self.buffer_manager.num_required_buffers - self.initial_credit)
        if self.backlog_before_block is not None and self.backlog_before_block > backlog:
            backlog = self.backlog_before_block
        return len(self.received_buffers) + backlog

    def __repr__(self) -> str:
        return (
            f"RemoteInputChannel(index={self.channel_index}, receiver_id={self.receiver_id}, "
            f"queued={len(self.received_buffers)}, unannounced={self.unannounced_credit}, "
            f"expected_seq={self.expected_sequence_number}, {self.buffer_manager!r})"
        )
