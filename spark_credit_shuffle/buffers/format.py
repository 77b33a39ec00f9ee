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

:class:`IpcSizeModel` is the writer's vectorised, pessimistic model of how many bytes a run of
rows takes as one chunk, so that buffers can be cut at segment boundaries before serialising.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import ClassVar

import numpy as np
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
    "IpcSizeModel",
    "KeepAlive",
    "LatencyMarker",
    "SchemaEvent",
    "barrier_data_type",
    "compact",
    "decode_event",
    "encode_event",
    "encode_marker_chunk",
    "pack_chunk_header",
    "unsupported_type",
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


# -- size model -------------------------------------------------------------------------------------


def unsupported_type(schema: pa.Schema) -> str | None:
    """A description of the first field whose type the buffers cannot carry, or None if all can.

    Dictionary arrays need dictionary messages, and view, union and run-end encoded arrays have no
    per-row size bound (their serialised slices may carry whole shared data buffers).
    """
    for field in schema:
        problem = _unsupported(field.type)
        if problem is not None:
            return f"field {field.name!r} of type {field.type}: {problem}"
    return None


def _unsupported(t: pa.DataType) -> str | None:
    if isinstance(t, pa.BaseExtensionType):
        return _unsupported(t.storage_type)
    if pa.types.is_dictionary(t):
        return "dictionary types are not supported (cast to the value type)"
    if pa.types.is_union(t) or pa.types.is_run_end_encoded(t):
        return f"{t} is not supported"
    if pa.types.is_binary_view(t) or pa.types.is_string_view(t) or pa.types.is_list_view(t):
        return "view types are not supported (cast to string, binary or list)"
    if pa.types.is_large_list_view(t):
        return "view types are not supported (cast to large_list)"
    if pa.types.is_map(t):
        return _unsupported(t.key_type) or _unsupported(t.item_type)
    if _is_list_like(t) or pa.types.is_fixed_size_list(t):
        return _unsupported(t.value_type)
    if pa.types.is_struct(t):
        for i in range(t.num_fields):
            problem = _unsupported(t.field(i).type)
            if problem is not None:
                return problem
    return None


def _is_list_like(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t))


def _offset_width(t: pa.DataType) -> int:
    large = pa.types.is_large_string(t) or pa.types.is_large_binary(t) or pa.types.is_large_list(t)
    return 8 if large else 4


def _is_var_width(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t)
    )


def _offsets(arr: pa.Array, n: int, width: int) -> np.ndarray:
    """The ``n + 1`` offsets of ``arr`` (a var-width or list array), honouring its slice offset."""
    dtype = np.int64 if width == 8 else np.int32
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=n + 1, offset=arr.offset * width)


class _Node:
    """Per-type piece of the size model: constant bits per row plus a per-row variable part."""

    __slots__ = ("buffers", "children", "const_bits", "kind", "offset_width", "type")

    def __init__(self, t: pa.DataType, nullable: bool) -> None:
        if isinstance(t, pa.BaseExtensionType):
            t = t.storage_type
        self.type = t
        self.children: list[_Node] = []
        self.offset_width = 0
        validity = 1 if nullable and not pa.types.is_null(t) else 0
        self.buffers = 1 if not pa.types.is_null(t) else 0  # the validity buffer, present even when empty
        if pa.types.is_null(t):
            self.kind, self.const_bits = "fixed", 0
        elif _is_var_width(t):
            self.kind, self.offset_width = "var", _offset_width(t)
            self.const_bits = validity + 8 * self.offset_width
            self.buffers += 2
        elif _is_list_like(t):
            self.kind, self.offset_width = "list", _offset_width(t)
            self.const_bits = validity + 8 * self.offset_width
            self.buffers += 1
            entries = pa.struct([t.key_field, t.item_field]) if pa.types.is_map(t) else t.value_type
            nullable_values = False if pa.types.is_map(t) else t.value_field.nullable
            self.children = [_Node(entries, nullable_values)]
        elif pa.types.is_fixed_size_list(t):
            self.kind, self.const_bits = "fixed_list", validity
            self.children = [_Node(t.value_type, t.value_field.nullable)]
        elif pa.types.is_struct(t):
            self.kind, self.const_bits = "struct", validity
            self.children = [_Node(t.field(i).type, t.field(i).nullable) for i in range(t.num_fields)]
        else:  # every remaining supported type has a fixed bit width (bool: 1 bit per row)
            self.kind, self.const_bits = "fixed", validity + t.bit_width
            self.buffers += 1

    @property
    def is_constant(self) -> bool:
        """Every row of this type costs the same number of bits."""
        if self.kind == "fixed":
            return True
        if self.kind in ("struct", "fixed_list"):
            return all(child.is_constant for child in self.children)
        return False

    def constant_bits(self) -> int:
        """Bits per row when :attr:`is_constant`."""
        if self.kind == "struct":
            return self.const_bits + sum(child.constant_bits() for child in self.children)
        if self.kind == "fixed_list":
            return self.const_bits + int(self.type.list_size) * self.children[0].constant_bits()
        return self.const_bits

    def has_offsets(self) -> bool:
        """This node or one below it has an offsets buffer."""
        return bool(self.offset_width) or any(child.has_offsets() for child in self.children)

    def has_nested_list(self) -> bool:
        """A list-like node sits at or below this one with an offsets buffer below it."""
        if self.kind in ("list", "fixed_list") and any(child.has_offsets() for child in self.children):
            return True
        return any(child.has_nested_list() for child in self.children)

    def count_buffers(self) -> tuple[int, int]:
        """(number of buffers, number of offsets buffers) in this type's IPC layout."""
        buffers, offsets = self.buffers, 1 if self.offset_width else 0
        for child in self.children:
            b, o = child.count_buffers()
            buffers, offsets = buffers + b, offsets + o
        return buffers, offsets

    def row_bits(self, arr: pa.Array) -> np.ndarray:
        """Bits each row of ``arr`` costs at most, as an int64 array (variable types only)."""
        if isinstance(arr.type, pa.BaseExtensionType):
            arr = arr.storage
        n = len(arr)
        if self.kind == "var":
            o = _offsets(arr, n, self.offset_width)
            return np.diff(o).astype(np.int64) * 8 + self.const_bits
        if self.kind == "list":
            o = _offsets(arr, n, self.offset_width).astype(np.int64)
            return self._sum_children(arr.values, o) + self.const_bits
        if self.kind == "fixed_list":
            k = self.type.list_size
            o = (
                np.arange(arr.offset * k, (arr.offset + n) * k + 1, k, dtype=np.int64)
                if k
                else np.zeros(n + 1, np.int64)
            )
            return self._sum_children(arr.values, o) + self.const_bits
        # struct (with at least one variable child)
        total = np.full(n, self.const_bits, dtype=np.int64)
        for i, child in enumerate(self.children):
            if child.is_constant:
                total += child.constant_bits()
            else:
                total += child.row_bits(arr.field(i))
        return total

    def _sum_children(self, values: pa.Array, o: np.ndarray) -> np.ndarray:
        """Per parent row, the bits of its child elements ``values[o[i]:o[i+1]]``."""
        child = self.children[0]
        if child.is_constant:
            return np.diff(o) * child.constant_bits()
        lo, hi = int(o[0]), int(o[-1])
        bits = child.row_bits(values.slice(lo, hi - lo))
        cum = np.zeros(len(bits) + 1, dtype=np.int64)
        np.cumsum(bits, out=cum[1:])
        sizes: np.ndarray = cum[o[1:] - lo] - cum[o[:-1] - lo]
        return sizes


class IpcSizeModel:
    """A pessimistic, vectorised model of the bytes a run of rows takes as one chunk.

    For rows ``a..b`` of a batch ``src``::

        header + len(serialize(rows)) <= overhead(src) + ceil((cum[b] - cum[a]) / 8)

    with ``cum = cumulative_bits(src)`` and ``overhead = overhead(src)``. Per row it counts each
    column's fixed width, the bytes of variable-width values and their offsets, one validity bit
    per nullable field, and nested types recursively. Per chunk it counts the header, the
    record-batch metadata (measured once for the schema) and, per buffer, the 8-byte padding and
    bitmap rounding and the one extra offset. Arrow's IPC writer truncates a sliced buffer only
    when it is larger than the slice needs rounded up to 64 bytes, so a buffer of ``src`` smaller
    than ``small_buffer`` bytes may be written whole: 56 more bytes each. The writer cuts buffers
    on these numbers; the builder checks the real size.
    """

    def __init__(self, schema: pa.Schema, segment_size: int = 1 << 16) -> None:
        problem = unsupported_type(schema)
        if problem is not None:
            raise TypeError(
                f"cannot write {problem}; supported are null, boolean, numeric, decimal, temporal, "
                "(large) string and binary, fixed-size binary, (large/fixed-size) list, map and struct types"
            )
        self.schema = schema
        self._nodes = [_Node(field.type, field.nullable) for field in schema]
        self._const_bits = sum(node.constant_bits() for node in self._nodes if node.is_constant)
        self._variable = [(i, node) for i, node in enumerate(self._nodes) if not node.is_constant]
        slack = 0
        for node in self._nodes:
            buffers, offsets = node.count_buffers()
            # per buffer: up to 7 bytes of padding plus under 1 byte of bitmap rounding;
            # per offsets buffer: the one offset more than there are rows (8 bytes at most)
            slack += 8 * buffers + 8 * offsets
        if not self._variable and self._const_bits == 0:
            self._const_bits = 1  # rows without bytes: still bound the rows per buffer
        self.metadata_bytes = measure_metadata(schema) + 8  # 8 bytes of margin
        #: Bytes every chunk costs beyond its rows: header, metadata and per-buffer slack.
        self.chunk_overhead = CHUNK_HEADER.size + self.metadata_bytes + slack
        #: Source buffers up to this size may be written whole into a chunk of a segment.
        self.small_buffer = segment_size + 128
        #: Rows of this schema may hold empty nested arrays, which Arrow serialises with their
        #: whole unsliced offsets buffer; such rows are compacted before serialising (see :meth:`serialize`).
        self.has_nested_lists = any(node.has_nested_list() for node in self._nodes)

    def overhead(self, src: pa.RecordBatch) -> int:
        """Bytes a chunk of rows sliced from ``src`` costs beyond its rows (see the class doc)."""
        limit = self.small_buffer
        small = 0
        for column in src.columns:
            for buffer in column.buffers():
                if buffer is not None and buffer.size <= limit:
                    small += 1
        return self.chunk_overhead + 56 * small

    def cumulative_bits(self, batch: pa.RecordBatch) -> np.ndarray:
        """``cum[j]``: bits rows ``0..j-1`` of ``batch`` cost at most (length ``num_rows + 1``)."""
        n = batch.num_rows
        cum = np.arange(0, (n + 1) * self._const_bits, self._const_bits, dtype=np.int64) if self._const_bits else None
        if cum is None:
            cum = np.zeros(n + 1, dtype=np.int64)
        for i, node in self._variable:
            column = batch.column(i)
            if isinstance(column.type, pa.BaseExtensionType):
                column = column.storage
            if node.kind == "var":  # the common case: the offsets give the cumulative bytes directly
                o = _offsets(column, n, node.offset_width)
                cum += (o - o[0]).astype(np.int64) * 8
                cum += np.arange(0, (n + 1) * node.const_bits, node.const_bits, dtype=np.int64)
            else:
                bits = node.row_bits(column)
                cum[1:] += np.cumsum(bits)
        return cum

    def serialize(self, rows: pa.RecordBatch, bound: int | None = None) -> pa.Buffer:
        """The Arrow IPC message of ``rows``; ``bound``: the chunk bytes the model allowed them.

        Arrow's IPC writer writes the whole offsets buffer of an array sliced to zero length (a
        nested list whose rows are all empty); when the chunk comes out larger than ``bound``
        (default: the model's bound for ``rows``), the rows are compacted (copied with ``take``)
        and serialised again.
        """
        message = rows.serialize()
        if self.has_nested_lists:
            if bound is None:
                bound = self.overhead(rows) + -(-int(self.cumulative_bits(rows)[-1]) // 8)
            if CHUNK_HEADER.size + message.size > bound:
                message = compact(rows).serialize()
        return message


def takes_wrong_rows(data_type: pa.DataType) -> bool:
    """``data_type`` holds a fixed-size list of fixed-size lists, whose rows pyarrow 26's ``take`` and
    ``filter`` read from the wrong place when the inner list array starts at an offset (a slice)."""
    if pa.types.is_fixed_size_list(data_type) and pa.types.is_fixed_size_list(data_type.value_type):
        return True
    return any(takes_wrong_rows(data_type.field(i).type) for i in range(data_type.num_fields))


def compact(rows: pa.RecordBatch) -> pa.RecordBatch:
    """A copy of ``rows`` whose arrays hold exactly their rows' data (no shared or sliced buffers).

    Each column is concatenated on its own, which copies it from its offset. Not ``take``: pyarrow 26
    takes the wrong elements from a sliced fixed-size list of fixed-size lists (the next row's).
    """
    return pa.RecordBatch.from_arrays([pa.concat_arrays([column]) for column in rows.columns], schema=rows.schema)


def measure_metadata(schema: pa.Schema) -> int:
    """Bytes of a record-batch message of ``schema`` before its body.

    Continuation marker, metadata length and the padded flatbuffer; the flatbuffer has the same
    size for every non-empty record batch of a schema (a scalar field at 0, such as the body
    length of a batch without buffers, is left out and makes it smaller).
    """
    arrays = [pa.nulls(1, field.type) for field in schema]
    message = pa.RecordBatch.from_arrays(arrays, schema=schema).serialize()
    body = pa.ipc.read_message(message).body
    return int(message.size - (body.size if body is not None else 0))
