"""The client end of a connection: Flink's ``CreditBasedPartitionRequestClientHandler`` and
``NettyPartitionRequestClient`` (docs/flink.md, "Receiver side" and "Without credits").

:class:`CreditBasedPartitionRequestClientHandler` routes inbound messages to channels by receiver id and
queues the outbound ones; it is the :class:`~spark_credit_shuffle.protocol.channels.PartitionRequestClient`
of its remote channels. A local channel whose producer runs in another process of the same executor reads a
:class:`ConnectionSubpartitionView` of the handler: the producer keeps each data buffer's segment in its
pool until the consumer recycled the buffer, which :class:`RecycleBuffers` tells it.

In the model without credits (``credit_based=False``) a data buffer that finds no free buffer in its gate's
pool is staged, and the handler stops reading the whole connection until a buffer is recycled.

Not thread-safe: callers serialise access.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..buffers.buffer import Buffer, DataType, Payload
from ..buffers.format import is_keep_alive
from ..buffers.pools import LocalBufferPool
from ..config import DEFAULT_SEGMENT_SIZE
from ..errors import BufferReorderingError, ProtocolError, error_in_text
from ._flags import HAS_PRIORITY, IS_BUFFER
from .channels import InputChannelError, RemoteInputChannel
from .codec import FrameDecoder, default_max_frame_length, encode
from .handshake import ClientHandshake
from .local_channel import LocalInputChannel
from .messages import (
    AckAllUserRecordsProcessed,
    AcknowledgeCheckpoint,
    AddCredit,
    AuthResponse,
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
from .subpartition import BufferAndBacklog

__all__ = ["ConnectionSubpartitionView", "CreditBasedPartitionRequestClientHandler"]

_new_tuple = tuple.__new__  # NamedTuples without their Python-level __new__ on the hot path
_NONE = DataType.NONE


class ConnectionSubpartitionView:
    """A producer's subpartition in another process of the same executor, read through a connection: the
    view a :class:`LocalInputChannel` reads when producer and consumer share an executor but not a process.

    Buffers arrive as BufferResponses with no credit (the server sends whenever it has data) and are queued
    here; the producer keeps the segment of each data buffer in its pool meanwhile. Recycling a data buffer
    counts it; the count goes to the producer as :class:`RecycleBuffers` (built when sent, so recycles made
    while the link is busy go out as one message), and the producer returns that many segments to its pool.
    Sequence numbers are checked (the wire is untrusted); empty data buffers are recycled at once. A priority
    event (an unaligned checkpoint barrier) goes ahead of the received buffers not yet read, as in a remote
    channel's queue (Flink's ``LocalInputChannel`` reads the producer's subpartition, where it is already at
    the head): it overtakes every buffer not yet consumed, here as in the producer's queue.
    """

    __slots__ = (
        "_num_priority",
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
        self._num_priority = 0
        self.expected_sequence_number = 0
        self.unannounced_recycled = 0
        self.error: BaseException | None = None
        self.is_released = False

    # -- network side --

    def on_buffer(self, data_type: DataType, payload: Payload, sequence_number: int, backlog: int) -> None:
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
            if not len(payload):
                self._recycle_one()  # nothing to read; the producer's segment goes back at once
                return
            buffer = Buffer(data_type, payload, self._recycle_one)
        else:
            buffer = Buffer(data_type, payload)
            if HAS_PRIORITY[data_type] and not is_keep_alive(data_type, payload):
                self._queue.insert(self._num_priority, (buffer, sequence_number, backlog))
                self._num_priority += 1
                if self._num_priority == 1:
                    self.listener.notify_priority_event(sequence_number)
                return
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
        if self._num_priority:
            self._num_priority -= 1
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

    def acknowledge_checkpoint(self, checkpoint_id: int, declined: bool) -> None:
        if not self.is_released:
            self.connection._enqueue(AcknowledgeCheckpoint(self.receiver_id, checkpoint_id, declined))

    def release_all_resources(self) -> None:
        """Drop what is queued and cancel the request (the producer then returns every held segment)."""
        if self.is_released:
            return
        self.is_released = True
        self._queue.clear()
        self._num_priority = 0
        self.connection.close_receiver(self.receiver_id)

    def __repr__(self) -> str:
        return (
            f"ConnectionSubpartitionView(receiver_id={self.receiver_id}, queued={len(self._queue)}, "
            f"unannounced_recycled={self.unannounced_recycled}, expected_seq={self.expected_sequence_number})"
        )


# -- client handler -----------------------------------------------------------------------------------


class CreditBasedPartitionRequestClientHandler:
    """The client end of one connection (Flink's ``CreditBasedPartitionRequestClientHandler`` and
    ``NettyPartitionRequestClient``): channels by receiver id, inbound routing, outbound FIFO.

    Outbound AddCredit messages are built when pulled, with the credit accumulated by then, so credit
    gathered while the link is busy goes out as one message. With a ``secret`` the connection starts with
    the handshake of :mod:`~spark_credit_shuffle.protocol.handshake`: :class:`Hello` goes out first, and
    nothing else (requests and credit wait in order) until the server proved the secret in its
    :class:`AuthChallenge` and this side's :class:`AuthResponse` is on its way. Releasing the last channel
    sends CloseRequest, any other one CancelPartitionRequest.

    In the model without credits (``credit_based=False``) a data buffer that finds no free buffer in its
    gate's pool is staged, and :attr:`is_reading` turns False: the transport must stop delivering input
    for the *whole connection* until a recycled buffer lets the staged messages through.
    """

    def __init__(
        self,
        *,
        credit_based: bool = True,
        secret: bytes | None = None,
        max_frame_length: int = default_max_frame_length(DEFAULT_SEGMENT_SIZE),
        peer: str = "the producer",
    ) -> None:
        self.credit_based = credit_based
        #: Who the connection leads to, as the channels' errors name it ("producer subtask 2 at host:port").
        self.peer = peer
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
        self._handshake = ClientHandshake(secret) if secret is not None else None
        #: The handshake's next message to send (the Hello, then the response), while it runs.
        self._handshake_out: Hello | AuthResponse | None = None
        if self._handshake is not None:
            self._handshake_out = self._handshake.hello
            self.next_message = self._next_handshake_message  # type: ignore[method-assign]  # until authenticated
            self.has_data = self._has_handshake_message  # type: ignore[method-assign]

    @property
    def is_authenticated(self) -> bool:
        """Whether the server proved the secret (always, without one)."""
        return self._handshake is None or self._handshake.done

    def _next_handshake_message(self) -> ClientMessage | None:
        message, self._handshake_out = self._handshake_out, None
        if message is not None and isinstance(message, AuthResponse):  # the last one: the queue is next
            del self.next_message
            del self.has_data
        return message

    def _has_handshake_message(self) -> bool:
        return self._handshake_out is not None

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

    def acknowledge_checkpoint(self, channel: RemoteInputChannel, checkpoint_id: int, declined: bool) -> None:
        self._enqueue(AcknowledgeCheckpoint(channel.receiver_id, checkpoint_id, declined))

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
            match item:
                case RemoteInputChannel():  # credit gathered since it was queued, as one AddCredit
                    if item.is_released:
                        continue
                    credit = item.get_and_reset_unannounced_credit()
                    if credit:
                        return _new_tuple(AddCredit, (item.receiver_id, credit))
                case ConnectionSubpartitionView():  # recycles gathered since it was queued, as one message
                    count = item.get_and_reset_unannounced_recycled()
                    if count and not item.is_released:
                        return RecycleBuffers(item.receiver_id, count)
                case _:
                    return item
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
        """Bytes from the wire; raises :class:`ProtocolError` on a bad frame.

        Once the handshake is done, a BufferResponse (nearly every message) goes straight to its channel,
        without :meth:`receive_message`'s dispatch: one call less per buffer on the I/O thread."""
        on_buffer_response = self._on_buffer_response
        for message in self._decoder.receive_data(data):
            if type(message) is BufferResponse and (self._handshake is None or self._handshake.done):
                on_buffer_response(message)
            else:
                self.receive_message(message)

    def receive_message(self, message: Message) -> None:
        """One decoded message from the server."""
        if self._handshake is not None and not self._handshake.done:
            self._handshake_out = self._handshake.on_challenge(message)  # raises unless the server proved it
            if self.listener is not None:
                self.listener()
            return
        match message:
            case BufferResponse():
                self._on_buffer_response(message)
            case BacklogAnnouncement():
                channel = self.input_channels.get(message.receiver_id)
                if channel is not None and not channel.is_released:
                    channel.on_sender_backlog(message.backlog)
            case ErrorResponse():
                self._on_error_response(message)
            case _:
                raise ProtocolError(f"unexpected {type(message).__name__} from a server")

    def _on_buffer_response(self, message: BufferResponse) -> None:
        receiver_id, _, sequence_number, backlog, data_type, _, payload = message
        if self.local_views:
            view = self.local_views.get(receiver_id)
            if view is not None:  # a local channel: no credit, no receive buffer of the gate
                view.on_buffer(data_type, payload, sequence_number, backlog)
                return
        if self.credit_based:
            channel = self.input_channels.get(receiver_id)
            if (
                channel is not None and IS_BUFFER[data_type] and not channel.is_released and len(payload)
            ):  # the common case, inline: a data buffer into a credit-backed channel buffer
                recycler = channel.buffer_manager.request_buffer()
                if recycler is not None:
                    channel.on_buffer(Buffer(data_type, payload, recycler), sequence_number, backlog)
                    return
                channel.buffer_manager.num_required_buffers += 1  # undo; the slow path takes it again
            self._decode_buffer_response(message)
        elif self._staged or not self._decode_without_credit(message):
            self._staged.append(message)
            self._pause()

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
        if not len(payload):
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
        if IS_BUFFER[message.data_type] and len(message.payload):
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
        error = InputChannelError(f"{self.peer}: remote error: {message.message}")
        error.remote = error_in_text(message.message)  # the producer's own typed failure, if it sent one
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
        error = InputChannelError(f"connection to {self.peer} closed")
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
