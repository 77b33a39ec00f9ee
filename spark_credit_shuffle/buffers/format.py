"""The bytes inside a network buffer: data chunks, fragments of spanning rows, and events.

A **data buffer** (``DataType.DATA_BUFFER``) holds one or more *chunks* back to back. A chunk is a
24-byte header followed by its body:

======  =====  ==================================================================
offset  type   field
======  =====  ==================================================================
0       u16    magic ``0x4353`` (``b"SC"``)
2       u8     format version (1)
3       u8     flags (0: rows; 1: a latency marker record, see below)
4       u32    rows in the chunk (1 for the fragments of a spanning row)
8       u32    fragment index
12      u32    fragment count (1: the body is a whole Arrow message)
16      u32    body length in bytes
20      u32    reserved (0)
======  =====  ==================================================================

The body of an unfragmented chunk is ONE Arrow IPC record-batch message (no schema: the schema
travels once per channel as a :class:`SchemaEvent`). A row too large for one segment is serialised
as a one-row message and cut into fragments ``0 .. n-1`` of at most ``segment_size - 24`` bytes,
each the body of a chunk in its own buffer, as Flink's spanning records are. A buffer usually holds
one chunk; it holds several when a builder handed out a flushed slice and was written further
before a lagging (broadcast) reader read it, or when a spanning row starts behind other rows.
Every chunk length is a multiple of 8, so each Arrow message starts 8-byte aligned.

A **latency marker** travels as a record, as Flink's ``LatencyMarker`` (``randomEmit``): a chunk with
flag 1, 0 rows and the marker's event payload (16 bytes) as its body, written into the open buffer of
one subpartition behind its rows; it finishes no buffer and moves when its buffer moves.

**Events** are whole buffers of their own (Flink's ``EventSerializer``): ``EndOfPartition`` is
``Buffer(DataType.END_OF_PARTITION, b"")``; the others are ``DataType.EVENT_BUFFER`` buffers whose
payload is a 4-byte event header (magic, version, kind) and the event's fields. :class:`KeepAlive` is
a ``PRIORITIZED_EVENT_BUFFER``: it overtakes the queued data, needs no credit and finishes no buffer.
A :class:`CheckpointBarrier` takes the data type of its alignment, as in Flink's ``EventSerializer``:
``ALIGNED_CHECKPOINT_BARRIER`` (blocks its subpartition once sent), ``TIMEOUTABLE_ALIGNED_CHECKPOINT_BARRIER``
(aligned with a timeout), ``PRIORITIZED_EVENT_BUFFER`` (unaligned: it overtakes the queued data) or
``EVENT_BUFFER`` (at least once: neither blocks nor overtakes).

The channel, the sequence number and the data type travel outside the payload (the protocol's
``BufferResponse`` or the blocking runtime's columns).

How many bytes a run of rows takes as one chunk is :mod:`spark_credit_shuffle.buffers.size_model`.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import ClassVar

import pyarrow as pa

from ..config import AlignmentType, CheckpointOptions
from ..errors import BufferDecodeError
from .buffer import Buffer, DataType, Payload

__all__ = [
    "CHUNK_HEADER",
    "FORMAT_VERSION",
    "MAGIC",
    "AlignmentType",
    "CancelCheckpointMarker",
    "CheckpointBarrier",
    "CheckpointOptions",
    "EndOfPartition",
    "Event",
    "KeepAlive",
    "LatencyMarker",
    "SchemaEvent",
    "barrier_data_type",
    "decode_event",
    "encode_event",
    "encode_marker_chunk",
    "is_keep_alive",
    "pack_chunk_header",
]

MAGIC = 0x4353
FORMAT_VERSION = 1
#: ``<HBBIIIII``: magic, version, flags, rows, fragment index, fragment count, body length, reserved.
CHUNK_HEADER = struct.Struct("<HBBIIIII")
_CHUNK_HEADER_PACK = CHUNK_HEADER.pack

#: ``<HBB``: magic, version, event kind.
_EVENT_HEADER = struct.Struct("<HBB")
#: ``<qqBq``: checkpoint id, timestamp (ms), alignment type, aligned checkpoint timeout (ms, -1: none).
_BARRIER = struct.Struct("<qqBq")
_CANCEL = struct.Struct("<q")
_LATENCY = struct.Struct("<qi")
#: Chunk flag of a latency marker record.
MARKER_FLAG = 1


def pack_chunk_header(num_rows: int, body_length: int, fragment_index: int = 0, fragment_count: int = 1) -> bytes:
    """The 24-byte header of one chunk."""
    return _CHUNK_HEADER_PACK(MAGIC, FORMAT_VERSION, 0, num_rows, fragment_index, fragment_count, body_length, 0)


# -- events ---------------------------------------------------------------------------------------


class Event:
    """Base of the events that travel in a channel between data buffers."""

    __slots__ = ()
    KIND: ClassVar[int] = 0


@dataclasses.dataclass(frozen=True, slots=True)
class SchemaEvent(Event):
    """The Arrow schema of a channel's data buffers, sent once before the first of them.

    Flink needs no such event (both ends know the serializer); Arrow messages carry no schema,
    so the writer sends it once per subpartition instead of once per buffer.
    """

    schema: pa.Schema
    KIND: ClassVar[int] = 1


@dataclasses.dataclass(frozen=True, slots=True)
class EndOfPartition(Event):
    """Flink's ``EndOfPartitionEvent``: the producer finished; always the last buffer of a channel."""

    KIND: ClassVar[int] = 2


def barrier_data_type(options: CheckpointOptions) -> DataType:
    """The buffer data type a barrier with ``options`` travels as (Flink's ``EventSerializer``)."""
    if options.alignment is AlignmentType.UNALIGNED:
        return DataType.PRIORITIZED_EVENT_BUFFER
    if options.alignment is AlignmentType.AT_LEAST_ONCE:
        return DataType.EVENT_BUFFER
    if options.is_timeoutable:
        return DataType.TIMEOUTABLE_ALIGNED_CHECKPOINT_BARRIER
    return DataType.ALIGNED_CHECKPOINT_BARRIER


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointBarrier(Event):
    """Flink's ``CheckpointBarrier``: checkpoint ``id``, its trigger ``timestamp`` (ms since the epoch) and
    its :class:`CheckpointOptions` (aligned by default, as Flink's default checkpoints are)."""

    id: int
    timestamp: int
    options: CheckpointOptions = CheckpointOptions()
    KIND: ClassVar[int] = 3


@dataclasses.dataclass(frozen=True, slots=True)
class CancelCheckpointMarker(Event):
    """Flink's ``CancelCheckpointMarker``: checkpoint ``checkpoint_id`` was aborted upstream; a consumer
    aligning it stops and unblocks its channels."""

    checkpoint_id: int
    KIND: ClassVar[int] = 6


@dataclasses.dataclass(frozen=True, slots=True)
class LatencyMarker(Event):
    """Flink's ``LatencyMarker``: when it was created and by which producer subtask.

    ``timestamp`` is wall-clock nanoseconds since the epoch (``time.time_ns()``); Flink uses
    milliseconds, nanoseconds let a benchmark see sub-millisecond latencies.
    """

    timestamp: int
    subtask_index: int
    KIND: ClassVar[int] = 4


@dataclasses.dataclass(frozen=True, slots=True)
class KeepAlive(Event):
    """The producer is alive: sent to every subpartition every few seconds as a priority event, outside the
    data path (no credit, no buffer finished or flushed), so a consumer can tell a producer that waits
    (for credit, or for its buffers to fill with buffer timeout -1) from one that is gone. Flink has no
    such event: its TaskManagers heartbeat through the JobManager."""

    KIND: ClassVar[int] = 5


#: The whole payload of a keep-alive: the event header alone.
_KEEP_ALIVE_PAYLOAD = _EVENT_HEADER.pack(MAGIC, FORMAT_VERSION, KeepAlive.KIND)


def encode_marker_chunk(marker: LatencyMarker) -> bytes:
    """The chunk of a latency marker record (flag 1, no rows), to be written behind a buffer's rows."""
    body = _EVENT_HEADER.pack(MAGIC, FORMAT_VERSION, LatencyMarker.KIND) + _LATENCY.pack(
        marker.timestamp, marker.subtask_index
    )
    return _CHUNK_HEADER_PACK(MAGIC, FORMAT_VERSION, MARKER_FLAG, 0, 0, 1, len(body), 0) + body


def encode_event(event: Event) -> Buffer:
    """The unpooled buffer that carries ``event`` (a fresh one per call; events own no segment)."""
    if isinstance(event, EndOfPartition):
        return Buffer(DataType.END_OF_PARTITION, b"")
    head = _EVENT_HEADER.pack(MAGIC, FORMAT_VERSION, event.KIND)
    if isinstance(event, SchemaEvent):
        body = event.schema.serialize().to_pybytes()
    elif isinstance(event, CheckpointBarrier):
        options = event.options
        body = _BARRIER.pack(event.id, event.timestamp, options.alignment, options.aligned_checkpoint_timeout_ms)
        return Buffer(barrier_data_type(options), head + body)
    elif isinstance(event, CancelCheckpointMarker):
        body = _CANCEL.pack(event.checkpoint_id)
    elif isinstance(event, LatencyMarker):
        body = _LATENCY.pack(event.timestamp, event.subtask_index)
    elif isinstance(event, KeepAlive):
        return Buffer(DataType.PRIORITIZED_EVENT_BUFFER, head)
    else:
        raise TypeError(
            f"cannot encode {event!r}: events are SchemaEvent, EndOfPartition, CheckpointBarrier, "
            "CancelCheckpointMarker, LatencyMarker or KeepAlive"
        )
    return Buffer(DataType.EVENT_BUFFER, head + body)


def is_keep_alive(data_type: DataType, payload: Payload) -> bool:
    """The buffer is a :class:`KeepAlive` (a priority event that carries no checkpoint): the consumer side
    queues it as an ordinary event, so it never moves its channel ahead of the others at the gate."""
    return (
        data_type is DataType.PRIORITIZED_EVENT_BUFFER
        and len(payload) == _EVENT_HEADER.size
        and bytes(payload) == _KEEP_ALIVE_PAYLOAD
    )


class MalformedPayload(ValueError):
    """A payload that does not decode; the reader turns it into a ``BufferDecodeError`` naming the channel."""


def decode_event(data_type: DataType, payload: Payload) -> Event:
    """The event in a buffer of ``data_type`` with ``payload``; :class:`BufferDecodeError` if it is none."""
    try:
        return decode_event_payload(data_type, payload)
    except MalformedPayload as exc:
        raise BufferDecodeError(str(exc)) from None


def decode_event_payload(data_type: DataType, payload: Payload) -> Event:
    """:func:`decode_event`, raising :class:`MalformedPayload` (no channel context) on bad bytes."""
    view = memoryview(payload).cast("B")
    if data_type is DataType.END_OF_PARTITION:
        if len(view):
            raise MalformedPayload(f"end-of-partition buffer carries {len(view)} payload bytes, expected none")
        return EndOfPartition()
    if len(view) < _EVENT_HEADER.size:
        raise MalformedPayload(
            f"event buffer of {len(view)} bytes is shorter than its {_EVENT_HEADER.size}-byte header"
        )
    magic, version, kind = _EVENT_HEADER.unpack_from(view)
    check_magic(magic, version)
    body = view[_EVENT_HEADER.size :]
    if kind == SchemaEvent.KIND:
        try:
            return SchemaEvent(pa.ipc.read_schema(pa.py_buffer(body)))
        except Exception as exc:  # any Arrow failure on untrusted bytes is a decode error
            raise MalformedPayload(f"schema event does not decode: {exc}") from None
    if kind == CheckpointBarrier.KIND:
        _check_size("checkpoint barrier", body, _BARRIER.size)
        checkpoint_id, timestamp, alignment, timeout = _BARRIER.unpack(body)
        if alignment not in _ALIGNMENTS:
            raise MalformedPayload(f"checkpoint barrier with unknown alignment type {alignment} (known: 0, 1, 2)")
        options = CheckpointOptions(_ALIGNMENTS[alignment], timeout if alignment == AlignmentType.ALIGNED else -1)
        if timeout < -1 or barrier_data_type(options) is not data_type:
            raise MalformedPayload(
                f"checkpoint barrier {checkpoint_id} with alignment {options.alignment.name} and timeout {timeout} "
                f"arrived as {data_type.name}, expected {barrier_data_type(options).name}"
            )
        return CheckpointBarrier(checkpoint_id, timestamp, options)
    if kind == CancelCheckpointMarker.KIND:
        _check_size("cancel checkpoint marker", body, _CANCEL.size)
        return CancelCheckpointMarker(*_CANCEL.unpack(body))
    if kind == LatencyMarker.KIND:
        _check_size("latency marker", body, _LATENCY.size)
        return LatencyMarker(*_LATENCY.unpack(body))
    if kind == KeepAlive.KIND:
        _check_size("keep-alive", body, 0)
        return KeepAlive()
    raise MalformedPayload(
        f"unknown event kind {kind} (known: 1 schema, 3 checkpoint barrier, 4 latency marker, 5 keep-alive, "
        "6 cancel checkpoint marker)"
    )


_ALIGNMENTS = {int(a): a for a in AlignmentType}


def check_magic(magic: int, version: int) -> None:
    """Raise :class:`MalformedPayload` unless ``magic`` and ``version`` are this format's."""
    if magic != MAGIC:
        raise MalformedPayload(f"bad magic 0x{magic:04x}, expected 0x{MAGIC:04x}")
    if version != FORMAT_VERSION:
        raise MalformedPayload(f"unsupported format version {version}, this reader reads version {FORMAT_VERSION}")


def _check_size(what: str, body: memoryview, expected: int) -> None:
    if len(body) != expected:
        raise MalformedPayload(f"{what} event body has {len(body)} bytes, expected {expected}")
