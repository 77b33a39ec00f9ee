"""The sender side of a connection: the queue of readers that can send, and the server handler that turns
inbound messages into calls on them (docs/flink.md, "Sender side"; the readers, one per requested
subpartition, are :mod:`spark_credit_shuffle.protocol.readers`).

The connection objects are sans-IO. A transport feeds :class:`PartitionRequestServerHandler` the bytes
(``receive_data``) or messages (``receive_message``) it received, and pulls what to send with
``next_message()`` / ``data_to_send()`` whenever it can write; pulling one message at a time while the
link is writable is Flink's "one message in flight". The :attr:`PartitionRequestQueue.listener` hook
tells an event-driven transport that something became sendable.

A data buffer is written only by a reader with a credit, and costs that credit; events are free. A
buffer's segment goes back to its pool as soon as its :class:`BufferResponse` is handed to the transport
(the message keeps the payload alive until it is written), except on a local channel
(:class:`LocalChannelViewReader`): there the segment stays held, counted in the producer's pool, until
the consumer recycled the buffer and said so with :class:`RecycleBuffers`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..config import DEFAULT_SEGMENT_SIZE
from ..errors import PartitionNotFoundError, PartitionStateError, ProtocolError
from ._flags import IS_BUFFER
from .codec import FrameDecoder, default_max_frame_length, encode
from .handshake import ServerHandshake
from .messages import (
    AckAllUserRecordsProcessed,
    AcknowledgeCheckpoint,
    AddCredit,
    AuthChallenge,
    BacklogAnnouncement,
    BufferResponse,
    CancelPartitionRequest,
    CloseRequest,
    ErrorResponse,
    Message,
    NewBufferSize,
    PartitionRequest,
    RecycleBuffers,
    ResumeConsumption,
    ServerMessage,
)
from .partition import ResultPartitionManager
from .readers import (
    CreditBasedSequenceNumberingViewReader,
    LocalChannelViewReader,
    PartitionProvider,
    SequenceNumberingViewReader,
)

__all__ = ["PartitionRequestQueue", "PartitionRequestServerHandler"]

_new_tuple = tuple.__new__  # NamedTuples without their Python-level __new__ on the hot path


class PartitionRequestQueue:
    """The outbound side of one server connection (Flink's ``PartitionRequestQueue``).

    ``all_readers`` by receiver id; ``available_readers`` is the FIFO of readers that can send now. A reader
    is enqueued on a data notification, AddCredit or ResumeConsumption if it is available; a credit-less
    reader of a channel without exclusive buffers gets a BacklogAnnouncement instead. Each
    :meth:`next_message` polls one reader and re-queues it at the tail if it can send more (round robin).
    """

    def __init__(self) -> None:
        self.all_readers: dict[int, CreditBasedSequenceNumberingViewReader] = {}
        self.available_readers: deque[CreditBasedSequenceNumberingViewReader] = deque()
        self._outbox: deque[ServerMessage] = deque()
        #: Called when the queue goes from nothing to send to something to send.
        self.listener: Callable[[], None] | None = None
        self.is_closed = False
        #: A fatal ErrorResponse was queued (Flink's ``fatalError``): what the client sent before it read the
        #: error (credits, acknowledgements for the readers just released) is ignored, not a protocol error.
        self.fatal_error = False

    def notify_reader_created(self, reader: CreditBasedSequenceNumberingViewReader) -> None:
        if reader.receiver_id in self.all_readers:
            raise ProtocolError(f"receiver id {reader.receiver_id} requested a partition twice on one connection")
        self.all_readers[reader.receiver_id] = reader

    def enqueue_available_reader(self, reader: CreditBasedSequenceNumberingViewReader) -> None:
        if reader.is_registered_as_available or self.is_closed:
            return
        view = reader.view
        if view is None:
            return
        available, backlog = view.get_availability_and_backlog(
            reader.num_credits_available > 0 or not reader.credit_based
        )
        if not available:
            if backlog > 0 and reader.need_announce_backlog():
                self._send_control(BacklogAnnouncement(reader.receiver_id, backlog))
            return
        self._register_available(reader)

    def notify_reader_non_empty(self, reader: CreditBasedSequenceNumberingViewReader) -> None:
        """A reader's view has new data (its availability listener). A reader holding credit can send at
        once: a view notifies only after a finished element, a flush or an event reached its head (a
        blocked view's END_OF_PARTITION aside, which then polls as nothing). Without credit, the view
        decides (events only, or a backlog announcement)."""
        if reader.num_credits_available > 0 and reader.credit_based:
            if not (reader.is_registered_as_available or self.is_closed or reader.view is None):
                self._register_available(reader)
        else:
            self.enqueue_available_reader(reader)

    def _register_available(self, reader: CreditBasedSequenceNumberingViewReader) -> None:
        was_idle = not self.available_readers and not self._outbox
        reader.is_registered_as_available = True
        self.available_readers.append(reader)
        if was_idle and self.listener is not None:
            self.listener()

    def _send_control(self, message: ServerMessage) -> None:
        was_idle = not self.available_readers and not self._outbox
        self._outbox.append(message)
        if was_idle and self.listener is not None:
            self.listener()

    def add_credit_or_resume_consumption(
        self, receiver_id: int, operation: Callable[[CreditBasedSequenceNumberingViewReader], None]
    ) -> None:
        """Apply ``operation`` to the reader (unknown ids are ignored, as in Flink) and try to enqueue it."""
        reader = self.all_readers.get(receiver_id)
        if reader is None:
            return
        operation(reader)
        self.enqueue_available_reader(reader)

    def cancel(self, receiver_id: int) -> None:
        """CancelPartitionRequest: drop the reader and release its view."""
        reader = self.all_readers.pop(receiver_id, None)
        if reader is None:
            return
        if reader.is_registered_as_available:
            self.available_readers.remove(reader)
            reader.is_registered_as_available = False
        reader.release_all_resources()

    def release_all_resources(self) -> None:
        """CloseRequest or connection loss: release every reader."""
        self.is_closed = True
        readers = list(self.all_readers.values())
        self.all_readers.clear()
        self.available_readers.clear()
        for reader in readers:
            reader.is_registered_as_available = False
            reader.release_all_resources()

    def notify_fatal_error(self, message: str) -> None:
        """A handler error: release all readers and send a fatal ErrorResponse (then close)."""
        self.release_all_resources()
        self.fatal_error = True
        self._outbox.clear()
        self._outbox.append(ErrorResponse(message, None))
        if self.listener is not None:
            self.listener()

    def has_data(self) -> bool:
        """Something may be sendable now (a call to :meth:`next_message` may still return None)."""
        return bool(self._outbox or self.available_readers)

    def next_message(self) -> ServerMessage | None:
        """The next message to write, or None (Flink's ``writeAndFlushNextMessageIfPossible``, one step)."""
        if self._outbox:
            return self._outbox.popleft()
        available = self.available_readers
        while available:
            reader = available[0]
            polled = reader.get_next_buffer()
            if polled is None:
                available.popleft()
                reader.is_registered_as_available = False
                if reader.is_released:
                    cause = reader.failure_cause
                    if cause is not None:
                        return ErrorResponse(str(cause), reader.receiver_id)
                continue
            buffer, more, backlog, sequence_number = polled
            if more:  # round robin: to the tail
                available.rotate(-1)
            else:
                available.popleft()
                reader.is_registered_as_available = False
            data_type = buffer.data_type
            message = _new_tuple(
                BufferResponse,
                (reader.receiver_id, reader.subpartition, sequence_number, backlog, data_type, False, buffer.data),
            )
            if reader.holds_buffers and IS_BUFFER[data_type] and isinstance(reader, LocalChannelViewReader):
                reader.held.append(buffer)  # a local channel: held until recycled
            else:
                buffer.recycle()  # the message keeps the payload; the segment is free for the producer
            return message
        return None


class PartitionRequestServerHandler:
    """The server end of one connection: decodes and routes inbound messages, queues outbound ones.

    ``partitions`` provides subpartition views (usually a :class:`ResultPartitionManager`). With a
    ``secret``, the connection starts with the handshake of :mod:`~spark_credit_shuffle.protocol.handshake`
    (the client's :class:`Hello`, this side's :class:`AuthChallenge`, the client's :class:`AuthResponse`);
    anything else before it completes, or a proof that does not verify, raises :class:`ProtocolError` (the
    transport then closes the connection). ``credit_based=False`` serves the model without credits.
    A request for a partition not registered yet waits until it is (if ``partitions`` is a manager) or
    until :meth:`fail_pending_requests` answers it with PartitionNotFound (the runtime calls it on its
    partition request timeout).
    """

    def __init__(
        self,
        partitions: PartitionProvider,
        *,
        credit_based: bool = True,
        secret: bytes | None = None,
        max_frame_length: int = default_max_frame_length(DEFAULT_SEGMENT_SIZE),
    ) -> None:
        self.partitions = partitions
        self.credit_based = credit_based
        self.queue = PartitionRequestQueue()
        self._handshake = ServerHandshake(secret) if secret is not None else None
        self._challenge: AuthChallenge | None = None
        self.is_authenticated = secret is None
        self._decoder = FrameDecoder(max_frame_length)
        self._pending: dict[int, tuple[PartitionRequest, Callable[[], None]]] = {}
        self.is_closed = False
        #: The next message to send, or None (bound to the queue's: the hot path; during the handshake its
        #: challenge, then nothing until the client proved the secret).
        self.next_message: Callable[[], ServerMessage | None] = self.queue.next_message
        #: Something may be sendable now (bound to the queue's, as above).
        self.has_data: Callable[[], bool] = self.queue.has_data
        if self._handshake is not None:
            self.next_message = self._next_handshake_message
            self.has_data = self._has_handshake_message

    def _next_handshake_message(self) -> ServerMessage | None:
        challenge, self._challenge = self._challenge, None
        return challenge

    def _has_handshake_message(self) -> bool:
        return self._challenge is not None

    # -- inbound --

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from the wire; raises :class:`ProtocolError` on a bad frame or message."""
        for message in self._decoder.receive_data(data):
            self.receive_message(message)

    def connection_closed(self) -> None:
        """The peer went away: release every reader (and complain about a partial frame)."""
        self.queue.release_all_resources()
        self.is_closed = True
        self._decoder.close()

    def receive_message(self, message: Message) -> None:
        """One decoded message from the client."""
        if not self.is_authenticated:
            self._authenticate(message)
            return
        queue = self.queue
        match message:
            case AddCredit():
                credit = message.credit
                if credit <= 0:
                    raise ProtocolError(f"AddCredit for receiver {message.receiver_id} announces {credit} credit")
                reader = self._obtain_reader(message.receiver_id, "AddCredit")
                if reader is not None:
                    reader.num_credits_available += credit
                    if not reader.is_registered_as_available:
                        queue.enqueue_available_reader(reader)
            case PartitionRequest():
                self._on_partition_request(message)
            case CancelPartitionRequest():
                self._drop_pending(message.receiver_id)
                queue.cancel(message.receiver_id)
            case CloseRequest():
                for receiver_id in list(self._pending):
                    self._drop_pending(receiver_id)
                queue.release_all_resources()
                self.is_closed = True
            case ResumeConsumption():
                if self._obtain_reader(message.receiver_id, "ResumeConsumption") is not None:
                    queue.add_credit_or_resume_consumption(message.receiver_id, lambda r: r.resume_consumption())
            case AckAllUserRecordsProcessed():
                reader = self._obtain_reader(message.receiver_id, "AckAllUserRecordsProcessed")
                if reader is not None:
                    reader.acknowledge_all_records_processed()
            case NewBufferSize():
                # a consumer announces its buffer size to every upstream, ready or not: unknown ids are ignored
                reader = queue.all_readers.get(message.receiver_id)
                if reader is not None:
                    reader.notify_new_buffer_size(message.buffer_size)
            case RecycleBuffers():
                self._on_recycle_buffers(message)
            case AcknowledgeCheckpoint():
                # a consumer acknowledges to every upstream, whose reader may be gone already: ignored then
                reader = queue.all_readers.get(message.receiver_id)
                if reader is not None:
                    reader.acknowledge_checkpoint(message.checkpoint_id, message.declined)
            case _:
                raise ProtocolError(f"unexpected {type(message).__name__} from a client")

    def _authenticate(self, message: Message) -> None:
        """One message of the handshake: answer the Hello with the challenge, or check the response."""
        handshake = self._handshake
        assert handshake is not None  # unauthenticated only with a secret
        challenge = handshake.on_message(message)
        if challenge is not None:
            self._challenge = challenge
            listener = self.queue.listener
            if listener is not None:
                listener()
            return
        self.is_authenticated = True
        self.next_message = self.queue.next_message
        self.has_data = self.queue.has_data
        if self.queue.has_data() and self.queue.listener is not None:
            self.queue.listener()

    def _on_recycle_buffers(self, message: RecycleBuffers) -> None:
        reader = self.queue.all_readers.get(message.receiver_id)
        if reader is None:  # cancelled meanwhile: releasing it returned every held segment
            return
        if not isinstance(reader, LocalChannelViewReader):
            raise ProtocolError(f"RecycleBuffers for receiver {message.receiver_id}, which is not a local channel")
        reader.recycle(message.count)

    def _obtain_reader(self, receiver_id: int, what: str) -> CreditBasedSequenceNumberingViewReader | None:
        """The reader of ``receiver_id``, as Flink's ``obtainReader``: a message naming a receiver that never
        requested a partition on this connection (or was cancelled) is a protocol error. A receiver whose
        request waits for its partition to be registered has no reader yet, and after a fatal error none has
        one: None."""
        reader = self.queue.all_readers.get(receiver_id)
        if reader is None and receiver_id not in self._pending and not self.queue.fatal_error:
            raise ProtocolError(f"{what} for receiver {receiver_id}, which has no partition request on this connection")
        return reader

    def _on_partition_request(self, request: PartitionRequest) -> None:
        if request.receiver_id in self._pending:
            raise ProtocolError(f"receiver id {request.receiver_id} requested a partition twice on one connection")
        if request.local:
            reader_type: type[CreditBasedSequenceNumberingViewReader] = LocalChannelViewReader
        elif self.credit_based:
            reader_type = CreditBasedSequenceNumberingViewReader
        else:
            reader_type = SequenceNumberingViewReader
        reader = reader_type(request.receiver_id, request.credit, self.queue)
        self.queue.notify_reader_created(reader)
        try:
            reader.request_subpartition_view(self.partitions, request.partition_id, request.subpartition)
        except PartitionNotFoundError as exc:
            if isinstance(self.partitions, ResultPartitionManager) and request.partition_id not in self.partitions:
                self.queue.all_readers.pop(request.receiver_id, None)
                callback = self._retry_callback(request)
                self._pending[request.receiver_id] = (request, callback)
                self.partitions.wait_for(request.partition_id, callback)
            else:
                self.queue.all_readers.pop(request.receiver_id, None)
                self.queue._send_control(ErrorResponse(str(exc), request.receiver_id))
        except PartitionStateError as exc:
            self.queue.all_readers.pop(request.receiver_id, None)
            self.queue._send_control(ErrorResponse(str(exc), request.receiver_id))

    def _retry_callback(self, request: PartitionRequest) -> Callable[[], None]:
        def retry() -> None:
            if self._pending.pop(request.receiver_id, None) is not None and not self.is_closed:
                self._on_partition_request(request)

        return retry

    def _drop_pending(self, receiver_id: int) -> None:
        entry = self._pending.pop(receiver_id, None)
        if entry is not None and isinstance(self.partitions, ResultPartitionManager):
            self.partitions.cancel_wait(entry[0].partition_id, entry[1])

    @property
    def pending_partition_requests(self) -> list[PartitionRequest]:
        """Requests waiting for their partition to be registered."""
        return [request for request, _ in self._pending.values()]

    def fail_pending_requests(self) -> None:
        """Answer every waiting request with a PartitionNotFound ErrorResponse (its timeout expired)."""
        for receiver_id in list(self._pending):
            request = self._pending[receiver_id][0]
            self._drop_pending(receiver_id)
            error = PartitionNotFoundError(request.partition_id, request.subpartition)
            self.queue._send_control(ErrorResponse(str(error), receiver_id))

    # -- outbound --

    def data_to_send(self, max_messages: int | None = None) -> list[object]:
        """Encoded frames of the next messages (all that are sendable, or at most ``max_messages``)."""
        chunks: list[object] = []
        count = 0
        while max_messages is None or count < max_messages:
            message = self.queue.next_message()
            if message is None:
                break
            chunks.extend(encode(message))
            count += 1
        return chunks
