"""Wire format of the protocol messages: length-prefixed frames with a magic number and a version.

Every frame is ``[frame length:uint32][magic:uint32][version:uint8][message id:uint8][body]``, big-endian,
where the frame length counts the whole frame including its 10-byte header (as Flink's ``NettyMessage``
frames count their 9-byte header). Bodies:

======================  =====================================================================================
message                 body
======================  =====================================================================================
BufferResponse (0)      receiver id:u64, subpartition:u32, sequence number:u32, backlog:u32, data type:u8,
                        compressed:u8, payload size:u32, payload
ErrorResponse (1)       has receiver id:u8, receiver id:u64, message size:u32, message (UTF-8)
PartitionRequest (2)    partition id:u64, subpartition:u32, receiver id:u64, credit:u32, local:u8
AckCheckpoint (3)       checkpoint id:u64 (> 0), receiver id:u64, declined:u8
CancelPartition (4)     receiver id:u64
CloseRequest (5)        (empty)
AddCredit (6)           credit:u32 (> 0), receiver id:u64
ResumeConsumption (7)   receiver id:u64
AckAllUserRecords (8)   receiver id:u64
BacklogAnnounce (9)     backlog:u32, receiver id:u64
NewBufferSize (10)      buffer size:u32, receiver id:u64
Hello (12)              nonce (32 bytes)
RecycleBuffers (13)     count:u32 (> 0), receiver id:u64
AuthChallenge (14)      nonce (32 bytes), proof (32 bytes)
AuthResponse (15)       proof (32 bytes)
======================  =====================================================================================

The handshake's three messages (:mod:`~spark_credit_shuffle.protocol.handshake`) carry nonces and HMACs,
never the secret. Version 2 of the protocol is the one with that handshake (version 1 sent the secret in
its ``Hello``); a peer of the other version is refused at its first frame.

Input from the wire is untrusted. :class:`FrameDecoder` checks the declared length against its maximum
before it waits for (let alone allocates) the frame, checks magic, version and message id as soon as
their bytes are there, and checks that every body is exactly as long as its declared sizes say. Any
violation raises :class:`~spark_credit_shuffle.errors.ProtocolError`, after which the decoder refuses
further input (the connection must be closed).

Encoding a :class:`BufferResponse` returns the header and the payload as separate chunks, so the payload
is never copied before it reaches the socket (``socket.sendmsg`` takes the list as is); decoding does not
copy it either, unless its frame arrived in pieces (then once, out of their assembly).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from ..buffers.buffer import DataType, Payload
from ..config import DEFAULT_SEGMENT_SIZE
from ..errors import ProtocolError
from .handshake import NONCE_BYTES, PROOF_BYTES
from .messages import (
    AckAllUserRecordsProcessed,
    AcknowledgeCheckpoint,
    AddCredit,
    AuthChallenge,
    AuthResponse,
    BacklogAnnouncement,
    BufferResponse,
    CancelPartitionRequest,
    CloseRequest,
    ErrorResponse,
    Hello,
    Message,
    NewBufferSize,
    PartitionRequest,
    RecycleBuffers,
    ResumeConsumption,
)

__all__ = [
    "FRAME_HEADER_LENGTH",
    "HEADER_ROOM",
    "MAGIC_NUMBER",
    "MAX_ERROR_MESSAGE_BYTES",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "FrameDecoder",
    "buffer_response_header",
    "default_max_frame_length",
    "encode",
    "encode_to_bytes",
    "encoded_size",
]

#: Our own magic number ("CSHF", credit shuffle frame); Flink's is 0xBADC0FFE.
MAGIC_NUMBER: Final = 0x43534846
PROTOCOL_VERSION: Final = 2
FRAME_HEADER_LENGTH: Final = 10
#: Bytes a frame may need beyond one segment of payload (headers, error messages, events).
HEADER_ROOM: Final = 1024
MAX_ERROR_MESSAGE_BYTES: Final = 900
_U32_MAX: Final = (1 << 32) - 1

_FRAME = struct.Struct(">IIBB")
_BUFFER_RESPONSE = struct.Struct(">IIBBQIIIBBI")  # frame header + buffer response header
_BUFFER_RESPONSE_BODY = struct.Struct(">QIIIBBI")
_ERROR = struct.Struct(">BQI")
_PARTITION_REQUEST = struct.Struct(">QIQIB")
_RECEIVER = struct.Struct(">Q")
_INT_RECEIVER = struct.Struct(">IQ")
_ACK_CHECKPOINT = struct.Struct(">QQB")


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


#: Returned by :meth:`FrameDecoder.next_message` while the next frame is incomplete (h11's sentinel).
NEED_DATA: Final = _NeedData()

_DATA_TYPES = {int(t): t for t in DataType}
#: The data types by their byte, for the decoder's hot path (every value below the length is one).
_DATA_TYPE_OF = tuple(DataType(i) for i in range(len(DataType)))
_NUM_DATA_TYPES = len(_DATA_TYPE_OF)
_new_tuple = tuple.__new__  # NamedTuples without their Python-level __new__ on the hot path


def default_max_frame_length(segment_size: int) -> int:
    """The largest frame a connection accepts: one segment of payload plus :data:`HEADER_ROOM`."""
    return segment_size + HEADER_ROOM


# -- encoding ---------------------------------------------------------------------------------------


def _frame(msg_id: int, body: bytes) -> list[Payload]:
    return [_FRAME.pack(FRAME_HEADER_LENGTH + len(body), MAGIC_NUMBER, PROTOCOL_VERSION, msg_id) + body]


def _encode_buffer_response(m: BufferResponse) -> list[Payload]:
    size = len(m.payload)
    header = _BUFFER_RESPONSE.pack(
        FRAME_HEADER_LENGTH + _BUFFER_RESPONSE_BODY.size + size,
        MAGIC_NUMBER,
        PROTOCOL_VERSION,
        0,
        m.receiver_id,
        m.subpartition,
        m.sequence_number,
        m.backlog,
        int(m.data_type),
        1 if m.is_compressed else 0,
        size,
    )
    return [header, m.payload] if size else [header]


def buffer_response_header(
    receiver_id: int, subpartition: int, sequence_number: int, backlog: int, data_type: int, size: int
) -> bytes:
    """The frame header and BufferResponse header of an uncompressed buffer of ``size`` payload bytes: what a
    transport sends before the payload itself (header-only encoding, no message object). A field out of its
    wire range raises :class:`ProtocolError`."""
    try:
        return _BUFFER_RESPONSE.pack(
            FRAME_HEADER_LENGTH + _BUFFER_RESPONSE_BODY.size + size,
            MAGIC_NUMBER,
            PROTOCOL_VERSION,
            0,
            receiver_id,
            subpartition,
            sequence_number,
            backlog,
            data_type,
            0,
            size,
        )
    except struct.error as exc:
        raise ProtocolError(f"cannot encode a BufferResponse: a field is out of its wire range ({exc})") from None


def _encode_error(m: ErrorResponse) -> list[Payload]:
    text = m.message.encode("utf-8", "replace")[:MAX_ERROR_MESSAGE_BYTES]
    has_id = m.receiver_id is not None
    return _frame(1, _ERROR.pack(1 if has_id else 0, m.receiver_id if has_id else 0, len(text)) + text)


def _fixed(name: str, value: bytes, size: int) -> bytes:
    value = bytes(value)
    if len(value) != size:
        raise ProtocolError(f"{name} is {len(value)} bytes; it must be exactly {size}")
    return value


def _encode_hello(m: Hello) -> list[Payload]:
    return _frame(12, _fixed("Hello nonce", m.nonce, NONCE_BYTES))


def _encode_challenge(m: AuthChallenge) -> list[Payload]:
    return _frame(
        14, _fixed("AuthChallenge nonce", m.nonce, NONCE_BYTES) + _fixed("AuthChallenge proof", m.proof, PROOF_BYTES)
    )


def _encode(m: Message) -> list[Payload]:
    """The frame of ``m``; the message ids follow Flink's ``NettyMessage`` numbering (the handshake's: free
    ones)."""
    match m:
        case BufferResponse():
            return _encode_buffer_response(m)
        case AddCredit():
            return _frame(6, _INT_RECEIVER.pack(m.credit, m.receiver_id))
        case ErrorResponse():
            return _encode_error(m)
        case PartitionRequest():
            return _frame(
                2, _PARTITION_REQUEST.pack(m.partition_id, m.subpartition, m.receiver_id, m.credit, 1 if m.local else 0)
            )
        case CancelPartitionRequest():
            return _frame(4, _RECEIVER.pack(m.receiver_id))
        case CloseRequest():
            return _frame(5, b"")
        case ResumeConsumption():
            return _frame(7, _RECEIVER.pack(m.receiver_id))
        case AckAllUserRecordsProcessed():
            return _frame(8, _RECEIVER.pack(m.receiver_id))
        case BacklogAnnouncement():
            return _frame(9, _INT_RECEIVER.pack(m.backlog, m.receiver_id))
        case NewBufferSize():
            return _frame(10, _INT_RECEIVER.pack(m.buffer_size, m.receiver_id))
        case RecycleBuffers():
            return _frame(13, _INT_RECEIVER.pack(m.count, m.receiver_id))
        case AcknowledgeCheckpoint():
            return _frame(3, _ACK_CHECKPOINT.pack(m.checkpoint_id, m.receiver_id, 1 if m.declined else 0))
        case Hello():
            return _encode_hello(m)
        case AuthChallenge():
            return _encode_challenge(m)
        case AuthResponse():
            return _frame(15, _fixed("AuthResponse proof", m.proof, PROOF_BYTES))
        case _:
            raise ProtocolError(f"cannot encode {type(m).__name__}: not a protocol message")


def encode(message: Message) -> list[Payload]:
    """The frame of ``message`` as a list of bytes-like chunks (header, then payload for a BufferResponse).

    The payload is passed through uncopied; send the chunks in order (``socket.sendmsg(chunks)``).
    A field out of its wire range raises :class:`ProtocolError`.
    """
    try:
        return _encode(message)
    except struct.error as exc:
        raise ProtocolError(f"cannot encode {message!r}: a field is out of its wire range ({exc})") from None


def encode_to_bytes(message: Message) -> bytes:
    """The frame of ``message`` as one ``bytes`` object (copies the payload; for tests and small messages)."""
    return b"".join(bytes(chunk) for chunk in encode(message))


def encoded_size(message: Message) -> int:
    """Bytes the frame of ``message`` occupies on the wire (a field out of its wire range raises
    :class:`ProtocolError`, as :func:`encode` does)."""
    if type(message) is AddCredit:  # the most frequent message after BufferResponse: fixed size, fields checked
        try:
            _INT_RECEIVER.pack(message.credit, message.receiver_id)
        except struct.error as exc:
            raise ProtocolError(f"cannot encode {message!r}: a field is out of its wire range ({exc})") from None
        return _ADD_CREDIT_FRAME
    if isinstance(message, BufferResponse):
        return FRAME_HEADER_LENGTH + _BUFFER_RESPONSE_BODY.size + len(message.payload)
    return sum(len(chunk) for chunk in encode(message))


_ADD_CREDIT_FRAME = FRAME_HEADER_LENGTH + _INT_RECEIVER.size


# -- decoding ---------------------------------------------------------------------------------------


def _expect(body: memoryview, size: int, name: str) -> None:
    if len(body) != size:
        raise ProtocolError(f"{name} body is {len(body)} bytes, expected exactly {size}")


def _decode_buffer_response(body: memoryview, copy: bool = True) -> BufferResponse:
    if len(body) < _BUFFER_RESPONSE_BODY.size:
        raise ProtocolError(
            f"BufferResponse body is {len(body)} bytes, shorter than its {_BUFFER_RESPONSE_BODY.size}-byte header"
        )
    receiver_id, subpartition, seq, backlog, data_type, compressed, size = _BUFFER_RESPONSE_BODY.unpack_from(body)
    if size != len(body) - _BUFFER_RESPONSE_BODY.size:
        raise ProtocolError(
            f"BufferResponse declares {size} payload bytes but its frame holds {len(body) - _BUFFER_RESPONSE_BODY.size}"
        )
    dt = _DATA_TYPES.get(data_type)
    if dt is None or dt is DataType.NONE:
        raise ProtocolError(f"BufferResponse has unknown data type {data_type}")
    if compressed > 1:
        raise ProtocolError(f"BufferResponse has compressed flag {compressed}, allowed is 0 or 1")
    view = body[_BUFFER_RESPONSE_BODY.size :]
    payload: Payload = bytes(view) if copy else view
    return BufferResponse(receiver_id, subpartition, seq, backlog, dt, compressed == 1, payload)


def _decode_error(body: memoryview) -> ErrorResponse:
    if len(body) < _ERROR.size:
        raise ProtocolError(f"ErrorResponse body is {len(body)} bytes, shorter than its {_ERROR.size}-byte header")
    has_id, receiver_id, size = _ERROR.unpack_from(body)
    if has_id > 1:
        raise ProtocolError(f"ErrorResponse has receiver-id flag {has_id}, allowed is 0 or 1")
    if size != len(body) - _ERROR.size:
        raise ProtocolError(
            f"ErrorResponse declares {size} message bytes but its frame holds {len(body) - _ERROR.size}"
        )
    text = bytes(body[_ERROR.size :]).decode("utf-8", "replace")
    return ErrorResponse(text, receiver_id if has_id else None)


def _decode_partition_request(body: memoryview) -> PartitionRequest:
    _expect(body, _PARTITION_REQUEST.size, "PartitionRequest")
    partition_id, subpartition, receiver_id, credit, local = _PARTITION_REQUEST.unpack_from(body)
    if local > 1:
        raise ProtocolError(f"PartitionRequest has local flag {local}, allowed is 0 or 1")
    return PartitionRequest(receiver_id, subpartition, credit, partition_id, local == 1)


def _receiver_only(cls: Callable[[int], Message], name: str) -> Callable[[memoryview], Message]:
    def decode(body: memoryview) -> Message:
        _expect(body, _RECEIVER.size, name)
        return cls(_RECEIVER.unpack_from(body)[0])

    return decode


def _decode_close(body: memoryview) -> CloseRequest:
    _expect(body, 0, "CloseRequest")
    return CloseRequest()


def _decode_add_credit(body: memoryview) -> AddCredit:
    _expect(body, _INT_RECEIVER.size, "AddCredit")
    credit, receiver_id = _INT_RECEIVER.unpack_from(body)
    if credit == 0:
        raise ProtocolError("AddCredit announces 0 credit; the announced credit must be > 0")
    return AddCredit(receiver_id, credit)


def _decode_recycle_buffers(body: memoryview) -> RecycleBuffers:
    _expect(body, _INT_RECEIVER.size, "RecycleBuffers")
    count, receiver_id = _INT_RECEIVER.unpack_from(body)
    if count == 0:
        raise ProtocolError("RecycleBuffers recycles 0 buffers; the count must be > 0")
    return RecycleBuffers(receiver_id, count)


def _decode_backlog(body: memoryview) -> BacklogAnnouncement:
    _expect(body, _INT_RECEIVER.size, "BacklogAnnouncement")
    backlog, receiver_id = _INT_RECEIVER.unpack_from(body)
    return BacklogAnnouncement(receiver_id, backlog)


def _decode_new_buffer_size(body: memoryview) -> NewBufferSize:
    _expect(body, _INT_RECEIVER.size, "NewBufferSize")
    size, receiver_id = _INT_RECEIVER.unpack_from(body)
    return NewBufferSize(receiver_id, size)


def _decode_acknowledge_checkpoint(body: memoryview) -> AcknowledgeCheckpoint:
    _expect(body, _ACK_CHECKPOINT.size, "AcknowledgeCheckpoint")
    checkpoint_id, receiver_id, declined = _ACK_CHECKPOINT.unpack_from(body)
    if checkpoint_id == 0:
        raise ProtocolError("AcknowledgeCheckpoint names checkpoint 0; checkpoint ids start at 1")
    if declined > 1:
        raise ProtocolError(f"AcknowledgeCheckpoint has declined flag {declined}, allowed is 0 or 1")
    return AcknowledgeCheckpoint(receiver_id, checkpoint_id, declined == 1)


def _decode_hello(body: memoryview) -> Hello:
    _expect(body, NONCE_BYTES, "Hello")
    return Hello(bytes(body))


def _decode_challenge(body: memoryview) -> AuthChallenge:
    _expect(body, NONCE_BYTES + PROOF_BYTES, "AuthChallenge")
    return AuthChallenge(bytes(body[:NONCE_BYTES]), bytes(body[NONCE_BYTES:]))


def _decode_response(body: memoryview) -> AuthResponse:
    _expect(body, PROOF_BYTES, "AuthResponse")
    return AuthResponse(bytes(body))


_DECODERS: dict[int, Callable[[memoryview], Message]] = {
    0: _decode_buffer_response,
    1: _decode_error,
    2: _decode_partition_request,
    3: _decode_acknowledge_checkpoint,
    4: _receiver_only(CancelPartitionRequest, "CancelPartitionRequest"),
    5: _decode_close,
    6: _decode_add_credit,
    7: _receiver_only(ResumeConsumption, "ResumeConsumption"),
    8: _receiver_only(AckAllUserRecordsProcessed, "AckAllUserRecordsProcessed"),
    9: _decode_backlog,
    10: _decode_new_buffer_size,
    12: _decode_hello,
    13: _decode_recycle_buffers,
    14: _decode_challenge,
    15: _decode_response,
}


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get whole messages back.

    Keeps at most one partial frame (never more than ``max_frame_length`` bytes of it) between calls.
    After a :class:`ProtocolError` every further call raises it again: close the connection.

    A payload is copied only if its frame arrived in pieces: one whole inside the ``bytes`` it came in
    is a read-only view of them; a frame cut between two calls is assembled from the pieces, and its
    payload copied out of the assembly. A view keeps the whole read it came in alive: on a connection
    whose buffers are consumed in the order they arrived (one channel per connection, as between two
    tasks), that is at most one read's bytes beyond the payloads still queued.
    """

    def __init__(self, max_frame_length: int = default_max_frame_length(DEFAULT_SEGMENT_SIZE)) -> None:
        if max_frame_length < FRAME_HEADER_LENGTH + _BUFFER_RESPONSE_BODY.size:
            raise ValueError(f"max_frame_length must be at least {FRAME_HEADER_LENGTH + _BUFFER_RESPONSE_BODY.size}")
        self.max_frame_length = max_frame_length
        self._partial = bytearray()  # the start of a frame that has not arrived whole
        self._error: ProtocolError | None = None
        self._pending: list[Message] = []

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete frame held since the last complete one."""
        return len(self._partial)

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Take ``data`` and return every message it completes, in order (an empty list: need more data)."""
        self._raise_if_failed()
        out = self._pending
        self._pending = []
        if not data:
            return out
        if not isinstance(data, bytes):  # memory that may change after this call: payloads must not point into it
            data = bytes(data)
        size = len(data)
        pos = self._complete_partial(data, out) if self._partial else 0
        if pos == size:
            return out
        view = memoryview(data)  # not released: the payloads are views of it
        unpack_buffer_response = _BUFFER_RESPONSE.unpack_from
        header_size = _BUFFER_RESPONSE.size
        max_length = self.max_frame_length
        append = out.append
        while True:
            # the common frame, a whole BufferResponse of a known data type that passes every check: one unpack,
            # no message decoder; anything else (or any check failing) takes the general path, which raises
            available = size - pos
            if available >= header_size and data[pos + 9] == 0:
                length, magic, version, _, receiver_id, sub, seq, backlog, data_type, compressed, payload_size = (
                    unpack_buffer_response(data, pos)
                )
                if (
                    header_size <= length <= available
                    and length <= max_length
                    and magic == MAGIC_NUMBER
                    and version == PROTOCOL_VERSION
                    and payload_size == length - header_size
                    and compressed <= 1
                    and 0 < data_type < _NUM_DATA_TYPES
                ):
                    append(
                        _new_tuple(
                            BufferResponse,
                            (
                                receiver_id,
                                sub,
                                seq,
                                backlog,
                                _DATA_TYPE_OF[data_type],
                                compressed == 1,
                                view[pos + header_size : pos + length],
                            ),
                        )
                    )
                    pos += length
                    continue
            parsed = self._parse_one(view, pos, size, copy=False)
            if parsed is None:
                break
            message, pos = parsed
            append(message)
        if pos < size:  # the start of the next frame: its header was checked as far as it came
            self._partial += data[pos:]
        return out

    def next_message(self) -> Message | _NeedData:
        """The next complete message from the data received so far, or :data:`NEED_DATA`."""
        if self._pending:
            return self._pending.pop(0)
        return NEED_DATA

    def close(self) -> None:
        """The stream ended: raise :class:`ProtocolError` if it ended inside a frame."""
        self._raise_if_failed()
        if self.pending_bytes:
            self._fail(f"connection closed inside a frame: {self.pending_bytes} bytes of an incomplete frame")

    # -- internals ---------------------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, message: str) -> None:
        self._error = ProtocolError(message)
        raise self._error

    def _complete_partial(self, data: bytes, out: list[Message]) -> int:
        """Add to the partial frame the bytes of ``data`` it still needs (no more: never beyond the frame's
        declared length); decode it if whole. Returns how many bytes of ``data`` it took."""
        partial = self._partial
        taken = 0
        size = len(data)
        while taken < size:
            have = len(partial)
            if have < 4:
                need = 4 - have
            else:
                (length,) = struct.unpack_from(">I", partial, 0)
                need = length - have
            chunk = data[taken : taken + need]
            partial += chunk
            taken += len(chunk)
            with memoryview(partial) as view:
                parsed = self._parse_one(view, 0, len(partial), copy=True)
            if parsed is not None:
                out.append(parsed[0])
                partial.clear()
                return taken
        return taken

    def _parse_one(self, buf: memoryview, pos: int, end: int, *, copy: bool) -> tuple[Message, int] | None:
        """The message of the frame at ``pos`` of ``buf[:end]`` and where the next frame starts, or None if it
        is incomplete; its header is checked as far as it is there. ``copy``: a payload is copied out of
        ``buf`` (which will change) instead of viewed."""
        available = end - pos
        if available < 4:
            return None
        (length,) = struct.unpack_from(">I", buf, pos)
        if length < FRAME_HEADER_LENGTH:
            self._fail(f"frame length {length} is shorter than the {FRAME_HEADER_LENGTH}-byte frame header")
        if length > self.max_frame_length:
            self._fail(f"frame length {length} exceeds the maximum frame length {self.max_frame_length}")
        if available >= 8:
            (magic,) = struct.unpack_from(">I", buf, pos + 4)
            if magic != MAGIC_NUMBER:
                self._fail(f"network stream corrupted: magic number {magic:#010x}, expected {MAGIC_NUMBER:#010x}")
        if available >= FRAME_HEADER_LENGTH:
            version = buf[pos + 8]
            msg_id = buf[pos + 9]
            if version != PROTOCOL_VERSION:
                self._fail(f"unsupported protocol version {version}, this side speaks {PROTOCOL_VERSION}")
            if msg_id not in _DECODERS:
                self._fail(f"unknown message id {msg_id}")
        if available < length:
            return None
        msg_id = buf[pos + 9]
        body = buf[pos + FRAME_HEADER_LENGTH : pos + length]
        try:
            message = _decode_buffer_response(body, copy) if msg_id == 0 else _DECODERS[msg_id](body)
        except ProtocolError as exc:
            self._error = exc
            raise
        finally:
            if copy:
                body.release()
        return message, pos + length
