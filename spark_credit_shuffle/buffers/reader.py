"""RecordReader: one input channel's buffers back into Arrow record batches and events, in order.

The reader is Flink's per-channel record deserializer: it keeps the fragments of a spanning row
until the last one arrives, surfaces events where they are in the stream, and counts what came in.
Every payload is untrusted: a header or length that does not add up, fragments out of order, a
schema other than the channel's, or an Arrow message that does not decode or validate raises
:class:`~spark_credit_shuffle.errors.BufferDecodeError` naming the channel and sequence number,
before anything is allocated from a declared length. Every decoded batch goes through Arrow's full
validation (sizes, every offset monotone and in bounds at every depth, null counts, UTF-8, decimal
precision): a corrupted buffer cannot crash a later reader of the batch. Checking only the structure
(offsets and sizes, not UTF-8) was measured to save about 2 µs of the ~6 µs a 32 KiB buffer's
validation costs, too little to give up the value checks for.

Decoded batches reference the payload's memory when it is immutable (``bytes``, a read-only
``pyarrow.Buffer``); mutable payloads (``bytearray``, writable views) are copied first, because
their memory may be reused once the buffer is recycled.
"""

from __future__ import annotations

import struct

import pyarrow as pa

from ..errors import BufferDecodeError
from .buffer import Buffer, DataType, Payload
from .format import (
    CHUNK_HEADER,
    FORMAT_VERSION,
    MAGIC,
    MARKER_FLAG,
    EndOfPartition,
    Event,
    LatencyMarker,
    MalformedPayload,
    SchemaEvent,
    check_magic,
    decode_event_payload,
)
from .size_model import measure_metadata, unsupported_type

__all__ = ["RecordReader"]

_HEADER = CHUNK_HEADER.size
_unpack_header = CHUNK_HEADER.unpack_from
_PREFIX = struct.Struct("<Ii")  # Arrow IPC: continuation marker, metadata length
_CONTINUATION = 0xFFFFFFFF
_DATA = DataType.DATA_BUFFER
_DATA_CLEAR_END = DataType.DATA_BUFFER_WITH_CLEAR_END
#: Schema events already decoded, by payload (``bytes`` only): every channel of a gate starts with its producer's
#: schema event, the same bytes for every channel of that producer, so decoding it once per channel was a
#: large part of a gate's set-up at hundreds of channels. Bounded; cleared when full.
_SCHEMA_EVENTS: dict[bytes, SchemaEvent] = {}
#: What a channel's schema implies (an unsupported type, the exact metadata bound), by schema identity: the
#: readers of a gate share their expected schema object. Holds the schema, so an id is never reused meanwhile.
_SCHEMA_FACTS: dict[int, tuple[pa.Schema, str | None, int]] = {}
_CACHE_ENTRIES = 64


class RecordReader:
    """Decodes the buffers of one input channel (Flink's ``SpillingAdaptiveSpanningRecordDeserializer``).

    ``schema`` is the schema the channel must carry (None: take it from the channel's schema
    event); ``channel`` names the channel in errors. ``validate`` runs Arrow's full validation on
    every decoded batch (offsets in bounds, UTF-8), so a corrupted buffer cannot crash a later
    reader of the batch; turn it off only for payloads that never left the process.
    """

    def __init__(self, schema: pa.Schema | None = None, channel: int = 0, *, validate: bool = True) -> None:
        self.channel = channel
        self.validate = validate
        self._expected = schema
        self._schema: pa.Schema | None = None
        self._max_metadata = 0
        self._pieces: list[pa.Buffer] = []
        self._fragment_count = 0
        self._ended = False
        self.num_records_in = 0
        self.num_bytes_in = 0
        self.num_buffers_in = 0

    @property
    def schema(self) -> pa.Schema | None:
        """The channel's schema, once its schema event arrived."""
        return self._schema

    @property
    def is_finished(self) -> bool:
        """End of partition was read; nothing may follow it."""
        return self._ended

    @property
    def has_partial_record(self) -> bool:
        """Fragments of a spanning row arrived and the rest is still to come (Flink's PARTIAL_RECORD)."""
        return bool(self._pieces)

    def feed(self, buffer: Buffer, sequence_number: int) -> list[pa.RecordBatch | Event]:
        """Decode ``buffer`` (the channel's buffer ``sequence_number``) and recycle it.

        Returns the record batches and events it completes, in stream order: nothing while a
        spanning row is incomplete, the row when its last fragment arrives.
        """
        try:
            if self._ended:
                raise MalformedPayload(f"{buffer.data_type.name} buffer after the end of partition")
            data_type = buffer.data_type
            data = buffer.data
            size = len(data)
            self.num_buffers_in += 1
            self.num_bytes_in += size
            if data_type is _DATA or data_type is _DATA_CLEAR_END:
                if self._schema is None:
                    raise MalformedPayload("data buffer before the channel's schema event")
                if not size:
                    return []
                payload = _immutable(data)
                if size > _HEADER and not self._pieces:  # the usual buffer: one whole chunk
                    magic, version, flags, rows, index, count, length, reserved = _unpack_header(payload)
                    if (
                        length + _HEADER == size
                        and count == 1
                        and index == 0
                        and magic == MAGIC
                        and version == FORMAT_VERSION
                        and not flags
                        and not reserved
                    ):
                        return [self._decode_message(payload.slice(_HEADER, length), rows)]
                return self._decode_data(payload, size)
            return self._decode_event(data_type, data)
        except MalformedPayload as exc:
            raise BufferDecodeError(str(exc), self.channel, sequence_number) from None
        finally:
            buffer.recycle()

    def _decode_event(self, data_type: DataType, data: object) -> list[pa.RecordBatch | Event]:
        if not data_type.is_event:
            raise MalformedPayload(f"buffer of data type {data_type.name} carries neither data nor an event")
        if self._pieces and data_type is not DataType.PRIORITIZED_EVENT_BUFFER:  # priority events overtake data
            raise MalformedPayload(
                f"{data_type.name} event inside a spanning row: fragment {len(self._pieces)} of "
                f"{self._fragment_count} is missing"
            )
        cached = _SCHEMA_EVENTS.get(data) if type(data) is bytes and data_type is DataType.EVENT_BUFFER else None
        if cached is not None:
            self._set_schema(cached.schema)
            return []
        event = decode_event_payload(data_type, data)
        if isinstance(event, SchemaEvent):
            if type(data) is bytes:
                if len(_SCHEMA_EVENTS) >= _CACHE_ENTRIES:
                    _SCHEMA_EVENTS.clear()
                _SCHEMA_EVENTS[data] = event
            self._set_schema(event.schema)
            return []
        if isinstance(event, EndOfPartition):
            self._ended = True
        return [event]

    def _set_schema(self, schema: pa.Schema) -> None:
        expected = self._expected if self._expected is not None else self._schema
        if expected is not None and not schema.equals(expected):
            raise MalformedPayload(f"channel schema\n{schema}\ndiffers from the expected schema\n{expected}")
        if self._schema is None:
            problem, max_metadata = _schema_facts(expected if expected is not None else schema)
            if problem is not None:
                raise MalformedPayload(f"schema event carries an unsupported {problem}")
            self._schema = expected if expected is not None else schema
            self._max_metadata = max_metadata

    def _decode_data(self, payload: pa.Buffer, size: int) -> list[pa.RecordBatch | Event]:
        out: list[pa.RecordBatch | Event] = []
        offset = 0
        while offset < size:
            if size - offset < _HEADER:
                raise MalformedPayload(f"{size - offset} bytes at offset {offset} are too short for a chunk header")
            magic, version, flags, rows, index, count, length, reserved = _unpack_header(payload, offset)
            if magic != MAGIC or version != FORMAT_VERSION or reserved or (flags and flags != MARKER_FLAG):
                _bad_header(magic, version, flags, reserved, offset)
            start = offset + _HEADER
            offset = start + length
            if length == 0 or offset > size:
                raise MalformedPayload(
                    f"chunk at offset {start - _HEADER} declares a body of {length} bytes; "
                    f"the payload has {size - start} after its header"
                )
            body = payload.slice(start, length)
            if flags:  # a latency marker record
                if rows or count != 1 or index or self._pieces:
                    raise MalformedPayload(
                        f"latency marker chunk at offset {start - _HEADER} is malformed or inside a spanning row"
                    )
                marker = decode_event_payload(DataType.EVENT_BUFFER, body)
                if not isinstance(marker, LatencyMarker):
                    raise MalformedPayload(f"marker chunk at offset {start - _HEADER} carries {type(marker).__name__}")
                out.append(marker)
            elif count == 1 and index == 0:
                if self._pieces:
                    raise MalformedPayload(
                        f"fragment {len(self._pieces)} of {self._fragment_count} is missing: "
                        "a whole chunk arrived inside a spanning row"
                    )
                out.append(self._decode_message(body, rows))
            else:
                batch = self._add_fragment(body, rows, index, count)
                if batch is not None:
                    out.append(batch)
        return out

    def _add_fragment(self, body: pa.Buffer, rows: int, index: int, count: int) -> pa.RecordBatch | None:
        expected = len(self._pieces)
        if rows != 1 or count < 2 or index != expected or (expected and count != self._fragment_count):
            wanted = f"fragment {expected} of {self._fragment_count}" if expected else "fragment 0 of a spanning row"
            raise MalformedPayload(f"expected {wanted}, got fragment {index} of {count} with {rows} rows")
        self._pieces.append(body)
        self._fragment_count = count
        if index < count - 1:
            return None
        pieces, self._pieces, self._fragment_count = self._pieces, [], 0
        message = pa.py_buffer(b"".join(pieces))  # as large as the bytes that actually arrived
        return self._decode_message(message, 1)

    def _decode_message(self, body: pa.Buffer, rows: int) -> pa.RecordBatch:
        if body.size < _PREFIX.size:
            raise MalformedPayload(f"Arrow message of {body.size} bytes is shorter than its prefix")
        continuation, metadata = _PREFIX.unpack_from(body)
        if continuation != _CONTINUATION or not 0 < metadata + _PREFIX.size <= min(self._max_metadata, body.size):
            raise MalformedPayload(
                f"Arrow message prefix (0x{continuation:08x}, metadata {metadata} bytes) is not a record batch "
                f"of this schema (metadata at most {self._max_metadata - _PREFIX.size} bytes)"
            )
        try:
            batch = pa.ipc.read_record_batch(body, self._schema)
            if self.validate:
                batch.validate(full=True)
        except Exception as exc:  # any Arrow failure on untrusted bytes is a decode error
            raise MalformedPayload(f"Arrow record batch does not decode: {exc}") from None
        if batch.num_rows != rows:
            raise MalformedPayload(f"chunk header declares {rows} rows, its Arrow message holds {batch.num_rows}")
        self.num_records_in += rows
        return batch


def _schema_facts(schema: pa.Schema) -> tuple[str | None, int]:
    """:func:`unsupported_type` of ``schema`` and, if it has none, its exact metadata bound (body compression
    or any other extra table makes the metadata longer), once per schema object."""
    facts = _SCHEMA_FACTS.get(id(schema))
    if facts is not None and facts[0] is schema:
        return facts[1], facts[2]
    problem = unsupported_type(schema)
    max_metadata = measure_metadata(schema) if problem is None else 0
    if len(_SCHEMA_FACTS) >= _CACHE_ENTRIES:
        _SCHEMA_FACTS.clear()
    _SCHEMA_FACTS[id(schema)] = (schema, problem, max_metadata)
    return problem, max_metadata


def _immutable(data: Payload) -> pa.Buffer:
    """``data`` as a pyarrow buffer, zero-copy when nobody can change it after recycling."""
    if isinstance(data, bytes):
        return pa.py_buffer(data)
    if isinstance(data, pa.Buffer) and not data.is_mutable:
        return data
    if isinstance(data, memoryview) and isinstance(data.obj, bytes):
        return pa.py_buffer(data)
    return pa.py_buffer(bytes(data))


def _bad_header(magic: int, version: int, flags: int, reserved: int, offset: int) -> None:
    check_magic(magic, version)
    raise MalformedPayload(
        f"chunk header at offset {offset} has reserved bits set (flags {flags}, reserved {reserved})"
    )
