"""The messages of the network protocol (Flink's ``NettyMessage`` family), as frozen dataclasses
(BufferResponse and AddCredit, built for every buffer or few, are NamedTuples).

Server to client: :class:`BufferResponse`, :class:`ErrorResponse`, :class:`BacklogAnnouncement`.
Client to server: :class:`PartitionRequest`, :class:`CancelPartitionRequest`, :class:`CloseRequest`,
:class:`AddCredit`, :class:`ResumeConsumption`, :class:`AckAllUserRecordsProcessed`,
:class:`NewBufferSize`, :class:`RecycleBuffers`, :class:`AcknowledgeCheckpoint`, and the handshake that proves
both sides know the
exchange's secret without sending it: :class:`Hello` (client, a fresh nonce), :class:`AuthChallenge` (server,
its own nonce and its proof) and :class:`AuthResponse` (client, its proof), the first messages of every
connection whose server expects a secret (Flink has no such messages; its connections are authenticated by
mutual TLS if at all, ``security.ssl.internal.enabled``; here TLS comes below them when it is on, see
:mod:`spark_credit_shuffle.transport.tls`, and :mod:`spark_credit_shuffle.protocol.handshake` says what
is proven).

A *local* channel (``PartitionRequest(local=True)``) joins two tasks of one executor that run in different
processes: it has no credit and no buffers of its own, as Flink's ``LocalInputChannel``; the producer keeps
each data buffer's segment (counted in its pool) until the consumer recycled the buffer and said so with
:class:`RecycleBuffers` (Flink's local channel recycles into the producer's pool by a direct call).

A *receiver id* identifies one input channel on a connection (Flink's 16-byte ``InputChannelID``); here it
is an unsigned 64-bit integer chosen by the consumer. The message ids on the wire follow Flink's numbering
(:mod:`spark_credit_shuffle.protocol.codec` holds them); the handshake's messages take free ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..buffers.buffer import DataType, Payload

__all__ = [
    "MAX_RECEIVER_ID",
    "AckAllUserRecordsProcessed",
    "AcknowledgeCheckpoint",
    "AddCredit",
    "AuthChallenge",
    "AuthResponse",
    "BacklogAnnouncement",
    "BufferResponse",
    "CancelPartitionRequest",
    "ClientMessage",
    "CloseRequest",
    "ErrorResponse",
    "Hello",
    "Message",
    "NewBufferSize",
    "PartitionRequest",
    "RecycleBuffers",
    "ResumeConsumption",
    "ServerMessage",
]

#: Receiver ids are unsigned 64-bit integers on the wire.
MAX_RECEIVER_ID = (1 << 64) - 1


class BufferResponse(NamedTuple):
    """One buffer or event for one input channel (server to client).

    ``backlog`` is the sender's backlog measured after this buffer was taken (docs/flink.md, "Pipelined
    subpartitions"); ``payload`` is any bytes-like object and is never copied by the protocol objects. A
    data buffer consumed one credit of its channel; events consume none. A tuple (as AddCredit): a sender
    builds one per buffer, and a tuple is built in one step (``tuple.__new__(BufferResponse, fields)`` on the
    hot path).
    """

    receiver_id: int
    subpartition: int
    sequence_number: int
    backlog: int
    data_type: DataType
    is_compressed: bool
    payload: Payload

    @property
    def size(self) -> int:
        """Payload bytes."""
        return len(self.payload)

    @property
    def is_buffer(self) -> bool:
        """Data (credit-backed) rather than an event."""
        return self.data_type.is_buffer


@dataclass(frozen=True, slots=True)
class ErrorResponse:
    """An error reported by the server: fatal for the whole connection when ``receiver_id`` is None,
    otherwise for that one channel."""

    message: str
    receiver_id: int | None = None

    @property
    def is_fatal(self) -> bool:
        return self.receiver_id is None


@dataclass(frozen=True, slots=True)
class PartitionRequest:
    """Open channel ``receiver_id`` on ``subpartition`` of partition ``partition_id`` with ``credit``
    initial credits (the channel's exclusive buffers; 0 in the model without credits).

    ``local``: the channel is a local one (both tasks in one executor): no credit; the server keeps each
    data buffer's segment until a :class:`RecycleBuffers` for it arrives."""

    receiver_id: int
    subpartition: int
    credit: int
    partition_id: int = 0
    local: bool = False


@dataclass(frozen=True, slots=True)
class CancelPartitionRequest:
    """The consumer no longer reads ``receiver_id``: the server drops its reader and releases the view."""

    receiver_id: int


@dataclass(frozen=True, slots=True)
class CloseRequest:
    """The consumer closes the connection: the server releases every reader of it."""


class AddCredit(NamedTuple):
    """``credit`` more receive buffers are reserved for ``receiver_id`` (always > 0). A tuple, as
    BufferResponse: a receiver sends one for every few buffers it recycles."""

    receiver_id: int
    credit: int


@dataclass(frozen=True, slots=True)
class ResumeConsumption:
    """Unblock the subpartition after an aligned checkpoint barrier (or any upstream-blocking event)."""

    receiver_id: int


@dataclass(frozen=True, slots=True)
class AckAllUserRecordsProcessed:
    """The consumer processed every record up to ``EndOfData`` of this channel."""

    receiver_id: int


@dataclass(frozen=True, slots=True)
class BacklogAnnouncement:
    """The sender's backlog for a channel without exclusive buffers (initial credit 0) that has no credit."""

    receiver_id: int
    backlog: int


@dataclass(frozen=True, slots=True)
class NewBufferSize:
    """Buffer debloating: the desired size in bytes of the buffers sent to ``receiver_id``."""

    receiver_id: int
    buffer_size: int


@dataclass(frozen=True, slots=True)
class AcknowledgeCheckpoint:
    """The consumer behind ``receiver_id`` ended checkpoint ``checkpoint_id``: completed it, or ``declined``
    it (aborted). Flink's tasks acknowledge or decline a checkpoint to the JobManager's checkpoint
    coordinator (``AcknowledgeCheckpoint``, ``DeclineCheckpoint``), which triggers the next one only once no
    checkpoint is pending (``execution.checkpointing.max-concurrent-checkpoints``, 1 by default). Here there is
    no coordinator between the tasks: each producer triggers its own barriers, and holds the next one back
    until every consumer it feeds acknowledged the last (see :class:`~spark_credit_shuffle.engine.checkpoints.
    CheckpointTrigger`). The message goes upstream on the channel, as Flink's ``TaskEventRequest`` does."""

    receiver_id: int
    checkpoint_id: int
    declined: bool = False


@dataclass(frozen=True, slots=True)
class RecycleBuffers:
    """The consumer of local channel ``receiver_id`` recycled its next ``count`` data buffers (always > 0):
    the producer returns their segments to its pool, in the order it sent them."""

    receiver_id: int
    count: int


@dataclass(frozen=True, slots=True)
class Hello:
    """First message of a connection from the client: a fresh random ``nonce`` (the server's challenge to
    prove follows; nothing secret travels)."""

    nonce: bytes


@dataclass(frozen=True, slots=True)
class AuthChallenge:
    """The server's answer to :class:`Hello`: its own fresh ``nonce`` and its ``proof`` that it knows the
    exchange's secret (an HMAC over both nonces, see :mod:`~spark_credit_shuffle.protocol.handshake`)."""

    nonce: bytes
    proof: bytes


@dataclass(frozen=True, slots=True)
class AuthResponse:
    """The client's ``proof`` that it knows the exchange's secret, over the server's nonce and its own; the
    last message before the server accepts any other."""

    proof: bytes


ServerMessage = BufferResponse | ErrorResponse | BacklogAnnouncement | AuthChallenge
ClientMessage = (
    PartitionRequest
    | CancelPartitionRequest
    | CloseRequest
    | AddCredit
    | ResumeConsumption
    | AckAllUserRecordsProcessed
    | NewBufferSize
    | RecycleBuffers
    | AcknowledgeCheckpoint
    | Hello
    | AuthResponse
)
Message = ServerMessage | ClientMessage
