"""The input gate: one input of a consumer subtask, its channels and their floating buffers (Flink's
``SingleInputGate``; docs/flink.md, "Gate read order").

The gate reads its channels round robin and sizes the floating pool they share; it creates its channels
(:meth:`SingleInputGate.remote_channel`, :meth:`SingleInputGate.local_channel`) and reports the gate's
Flink metrics (docs/flink.md, "Metrics").

Not thread-safe: callers serialise access.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from ..buffers.buffer import Buffer, DataType
from ..buffers.pools import LocalBufferPool, NetworkBufferPool
from ..buffers.sizing import GateBuffersSpec, input_gate_buffers_spec
from ..config import NetworkConfig
from ..errors import InsufficientNetworkBuffersError, NetworkBuffersNotFreeError
from .channels import BufferTally, InputChannel, RemoteInputChannel
from .client import CreditBasedPartitionRequestClientHandler
from .local_channel import LocalInputChannel, LocalPartitionRequestClient
from .partition import ResultPartition, ResultPartitionManager

__all__ = ["BufferOrEvent", "SingleInputGate"]

_END_OF_PARTITION = DataType.END_OF_PARTITION
_new_tuple = tuple.__new__  # NamedTuples without their Python-level __new__ on the hot path


class BufferOrEvent(NamedTuple):
    """What the gate hands its consumer: a buffer, its channel and sequence number, and whether the gate
    has more right away. The consumer must ``buffer.recycle()`` it when done."""

    buffer: Buffer
    channel_index: int
    sequence_number: int
    more_available: bool


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
        self.channels: list[InputChannel | None] = [None] * num_channels
        #: The unused exclusive and floating buffers of the gate's remote channels, summed as they change.
        self.buffer_tally = BufferTally()
        self._channels_with_data: deque[InputChannel] = deque()
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
        partition_provider: ResultPartitionManager | ResultPartition | LocalPartitionRequestClient,
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

    def _set_channel(self, channel: InputChannel) -> None:
        if not 0 <= channel.channel_index < self.num_channels:
            raise ValueError(f"channel index {channel.channel_index} outside [0, {self.num_channels})")
        if self.channels[channel.channel_index] is not None:
            raise ValueError(f"channel {channel.channel_index} is already set")
        self.channels[channel.channel_index] = channel

    def setup(self) -> None:
        """Reserve one floating buffer, then the exclusive buffers of every remote channel (FLINK-24035).

        The remote channels' exclusive buffers are taken from the network buffer pool in one request (one
        redistribution of its pools, not one per channel: at thousands of channels per host that was most of
        the set-up); if that request fails, every channel requests its own in turn, as Flink's channels do, so
        the error and what was taken before it are those of the per-channel requests."""
        self.buffer_pool.reserve_segments(1)
        remote = [
            c for c in self.channels if isinstance(c, RemoteInputChannel) and not c.is_set_up and c.initial_credit
        ]
        if len(remote) > 1:
            try:
                self.network_pool.request_unpooled_segments(sum(c.initial_credit for c in remote))
            except (InsufficientNetworkBuffersError, NetworkBuffersNotFreeError):
                pass  # nothing was taken: the channels' own requests below raise what they raise
            else:
                for channel in remote:
                    channel.setup(exclusive_granted=True)
        for each in self.channels:
            if each is not None:
                each.setup()

    def request_partitions(self) -> None:
        """Send every channel's partition request (set up first if needed)."""
        channels = [c for c in self.channels if c is not None]
        if len(channels) < self.num_channels:
            missing = [i for i, c in enumerate(self.channels) if c is None]
            raise ValueError(f"channels {missing} of the gate were never created")
        self.setup()
        for channel in channels:
            channel.request_subpartition()

    # -- notifications from channels --

    def notify_channel_non_empty(self, channel: InputChannel) -> None:
        if channel.is_queued or self.is_closed:
            return
        channel.is_queued = True
        was_empty = not self._channels_with_data
        self._channels_with_data.append(channel)
        if was_empty and self.listener is not None:
            self.listener()

    def notify_priority_event(self, channel: InputChannel) -> None:
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
        channel = self.channels[channel_index]
        if channel is None:
            raise ValueError(f"channel {channel_index} of the gate was never created")
        channel.resume_consumption()

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

    def acknowledge_checkpoint(self, checkpoint_id: int, declined: bool = False) -> None:
        """Tell every producer this consumer ended checkpoint ``checkpoint_id`` (``AcknowledgeCheckpoint``)."""
        for channel in self.channels:
            if channel is not None:
                channel.acknowledge_checkpoint(checkpoint_id, declined)

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

    # -- metrics (docs/flink.md, "Metrics") --

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
