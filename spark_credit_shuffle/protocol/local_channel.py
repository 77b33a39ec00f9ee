"""The input channel without credit (Flink's ``LocalInputChannel``; docs/flink.md, "Local channels").

A :class:`LocalInputChannel` reads a producer's subpartition of the same executor with no credit and no
buffers of its own: in the same process directly (no copy), or, for a producer in another process of the
executor, through a connection (the client handler's
:class:`~spark_credit_shuffle.protocol.client.ConnectionSubpartitionView`): the producer keeps each data
buffer's segment in its pool until the consumer recycled the buffer, so the producer's pool bounds what
the channel holds on both sides.

Not thread-safe: callers serialise access.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..buffers.buffer import Buffer, DataType
from ._flags import IS_BUFFER
from .channels import InputChannelError, InputGate
from .partition import ResultPartition, ResultPartitionManager
from .subpartition import BufferAndBacklog

__all__ = ["LocalInputChannel", "LocalPartitionRequestClient", "LocalSubpartitionView"]

_END_OF_PARTITION = DataType.END_OF_PARTITION
_NONE = DataType.NONE


class LocalSubpartitionView(Protocol):
    """What a local channel reads: a producer's subpartition view (Flink's ``ResultSubpartitionView``), in
    this process or across a connection."""

    @property
    def is_released(self) -> bool: ...

    def get_next_buffer(self) -> BufferAndBacklog | None: ...

    def resume_consumption(self) -> None: ...

    def acknowledge_all_data_processed(self) -> None: ...

    def notify_new_buffer_size(self, size: int) -> None: ...

    def acknowledge_checkpoint(self, checkpoint_id: int, declined: bool) -> None: ...

    def release_all_resources(self) -> None: ...

    def queue_length(self) -> int: ...


@runtime_checkable
class LocalPartitionRequestClient(Protocol):
    """A connection to another process of the same executor that serves a local channel; implemented by
    :class:`~spark_credit_shuffle.protocol.client.CreditBasedPartitionRequestClientHandler`."""

    def request_local_subpartition(
        self, receiver_id: int, partition_id: int, subpartition: int, listener: LocalInputChannel
    ) -> LocalSubpartitionView: ...


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
        gate: InputGate,
        channel_index: int,
        partition_provider: ResultPartitionManager | ResultPartition | LocalPartitionRequestClient,
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
        self.view: LocalSubpartitionView | None = None
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
        match provider:
            case ResultPartitionManager():
                self.view = provider.create_subpartition_view(self.partition_id, self.subpartition, self)
            case ResultPartition():
                self.view = provider.create_subpartition_view(self.subpartition, self)
            case LocalPartitionRequestClient():
                self.view = provider.request_local_subpartition(
                    self.receiver_id, self.partition_id, self.subpartition, self
                )
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
        self.num_bytes_in += len(buffer.data)
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

    def acknowledge_checkpoint(self, checkpoint_id: int, declined: bool) -> None:
        if self.view is not None and not self.is_released:
            self.view.acknowledge_checkpoint(checkpoint_id, declined)

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
