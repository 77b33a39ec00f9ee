"""The buffer format and the RecordReader's defences: every malformed buffer is a typed error.

Corrupted headers, truncated payloads, fragments out of order or missing, a schema other than the
channel's, and bytes that do not decode give ``BufferDecodeError`` naming the channel and the
sequence number, never a crash, a hang or an allocation sized by a declared length.
"""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pytest
from buffer_helpers import MemoryPartition, random_batch, schema_strategy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark_credit_shuffle.buffers import (
    AlignmentType,
    Buffer,
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointOptions,
    DataType,
    EndOfPartition,
    LatencyMarker,
    RecordReader,
    RecordWriter,
    SchemaEvent,
    decode_event,
    encode_event,
)
from spark_credit_shuffle.buffers.format import CHUNK_HEADER, pack_chunk_header
from spark_credit_shuffle.errors import BufferDecodeError
from spark_credit_shuffle.partitioners import ConstantSelector

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("tags", pa.list_(pa.int32()))])
SEGMENT = 4096
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def written(batch: pa.RecordBatch, segment: int = SEGMENT) -> list[Buffer]:
    """Every buffer of one channel, in order: schema event, data buffers, end of partition."""
    partition = MemoryPartition(1)
    writer = RecordWriter(partition, ConstantSelector(1, 0), segment)
    writer.emit(batch)
    writer.finish()
    return [buffer for buffer, _ in partition.drain(0)]


def sample(n: int = 300, big: int = 0) -> pa.RecordBatch:
    names = [f"name-{i}" for i in range(n)]
    if big:
        names[n // 2] = "B" * big
    tags = [list(range(i % 4)) for i in range(n)]
    return pa.record_batch(
        {"id": pa.array(range(n), pa.int64()), "name": pa.array(names), "tags": pa.array(tags, pa.list_(pa.int32()))}
    )


def with_payload(buffer: Buffer, payload: bytes) -> Buffer:
    return Buffer(buffer.data_type, payload)


def feed_all(reader: RecordReader, buffers: list[Buffer], start: int = 0) -> list[object]:
    out: list[object] = []
    for i, buffer in enumerate(buffers):
        out.extend(reader.feed(buffer, start + i))
    return out


# -- events ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        CheckpointBarrier(42, 1_700_000_000_123),
        CheckpointBarrier(-1, 0),
        CheckpointBarrier(3, 5, CheckpointOptions(AlignmentType.UNALIGNED)),
        CheckpointBarrier(4, 6, CheckpointOptions(AlignmentType.ALIGNED, 250)),
        CheckpointBarrier(5, 7, CheckpointOptions(AlignmentType.AT_LEAST_ONCE)),
        CancelCheckpointMarker(9),
        LatencyMarker(1_700_000_000_123_456_789, 3),
        EndOfPartition(),
        SchemaEvent(SCHEMA),
        SchemaEvent(pa.schema([pa.field("m", pa.map_(pa.string(), pa.float64()), nullable=False)], {"k": "v"})),
    ],
)
def test_events_round_trip(event):
    buffer = encode_event(event)
    if isinstance(event, EndOfPartition):
        expected_type = DataType.END_OF_PARTITION
    elif isinstance(event, CheckpointBarrier):  # the barrier's data type follows its alignment, as in Flink
        expected_type = {
            (AlignmentType.ALIGNED, -1): DataType.ALIGNED_CHECKPOINT_BARRIER,
            (AlignmentType.ALIGNED, 250): DataType.TIMEOUTABLE_ALIGNED_CHECKPOINT_BARRIER,
            (AlignmentType.UNALIGNED, -1): DataType.PRIORITIZED_EVENT_BUFFER,
            (AlignmentType.AT_LEAST_ONCE, -1): DataType.EVENT_BUFFER,
        }[(event.options.alignment, event.options.aligned_checkpoint_timeout_ms)]
    else:
        expected_type = DataType.EVENT_BUFFER
    assert buffer.data_type is expected_type
    assert decode_event(buffer.data_type, buffer.data) == event


@pytest.mark.parametrize(
    ("data_type", "payload", "message"),
    [
        (DataType.END_OF_PARTITION, b"x", "expected none"),
        (DataType.EVENT_BUFFER, b"SC", "shorter than"),
        (DataType.EVENT_BUFFER, encode_event(CheckpointBarrier(1, 2)).data, "expected ALIGNED_CHECKPOINT_BARRIER"),
        (
            DataType.ALIGNED_CHECKPOINT_BARRIER,
            bytes(encode_event(CheckpointBarrier(1, 2)).data)[:-9] + b"\x07" + b"\xff" * 8,
            "unknown alignment type 7",
        ),
        (DataType.EVENT_BUFFER, struct.pack("<HBB", 0x1234, 1, 3) + bytes(16), "bad magic"),
        (DataType.EVENT_BUFFER, struct.pack("<HBB", 0x4353, 9, 3) + bytes(16), "version 9"),
        (DataType.EVENT_BUFFER, struct.pack("<HBB", 0x4353, 1, 77), "unknown event kind 77"),
        (DataType.EVENT_BUFFER, struct.pack("<HBB", 0x4353, 1, 3) + bytes(15), "25"),
        (DataType.EVENT_BUFFER, struct.pack("<HBB", 0x4353, 1, 4) + bytes(13), "12"),
        (DataType.EVENT_BUFFER, struct.pack("<HBB", 0x4353, 1, 1) + b"not a schema", "schema event"),
    ],
)
def test_decode_event_rejects_malformed_payloads(data_type, payload, message):
    with pytest.raises(BufferDecodeError, match=message):
        decode_event(data_type, payload)


def test_chunk_header_layout():
    header = pack_chunk_header(7, 4000, 2, 5)
    assert len(header) == CHUNK_HEADER.size == 24
    assert CHUNK_HEADER.unpack(header) == (0x4353, 1, 0, 7, 2, 5, 4000, 0)


# -- data buffers ---------------------------------------------------------------------------------------


def test_errors_name_channel_and_sequence_number_and_recycle_the_buffer():
    buffers = written(sample())
    reader = RecordReader(SCHEMA, channel=6)
    reader.feed(buffers[0], 100)
    recycled = []
    bad = Buffer(DataType.DATA_BUFFER, b"\x00" * 64, lambda: recycled.append(True))
    with pytest.raises(BufferDecodeError) as info:
        reader.feed(bad, 101)
    assert (info.value.channel, info.value.sequence_number) == (6, 101)
    assert "channel 6, sequence number 101" in str(info.value)
    assert recycled == [True]


@pytest.mark.parametrize("position", range(CHUNK_HEADER.size))
def test_any_corrupted_header_byte_is_an_error(position):
    buffers = written(sample())
    data = next(b for b in buffers if b.data_type is DataType.DATA_BUFFER)
    payload = bytearray(data.data)
    assert CHUNK_HEADER.unpack_from(payload)[3] > 1  # a chunk of several rows
    for flip in (0x01, 0x80, 0xFF):
        corrupted = bytearray(payload)
        corrupted[position] ^= flip
        reader = RecordReader(SCHEMA, 0)
        reader.feed(buffers[0], 0)
        with pytest.raises(BufferDecodeError):
            reader.feed(with_payload(data, bytes(corrupted)), 1)


@FUZZ
@given(schema=schema_strategy(), seed=st.integers(0, 2**32 - 1), cut=st.integers(1, 1 << 20))
def test_truncated_payloads_are_errors(schema, seed, cut):
    buffers = written(random_batch(schema, 40, seed, 0.3))
    data = [b for b in buffers if b.data_type is DataType.DATA_BUFFER]
    target = data[seed % len(data)]
    size = target.size
    reader = RecordReader(schema, 3)
    reader.feed(buffers[0], 0)
    for earlier in data[: seed % len(data)]:
        reader.feed(earlier, 1)
    with pytest.raises(BufferDecodeError, match="channel 3"):
        reader.feed(with_payload(target, bytes(target.data)[: cut % size]), 2) if cut % size else _raise_empty()


def _raise_empty():
    raise BufferDecodeError("an empty slice is no data", 3, 2)


@FUZZ
@given(
    schema=schema_strategy(),
    seed=st.integers(0, 2**32 - 1),
    flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), min_size=1, max_size=3),
)
def test_flipped_bytes_give_an_error_or_a_valid_batch(schema, seed, flips):
    """A flip anywhere either fails to decode (typed error) or decodes to a structurally valid batch:
    values carry no checksum (as Flink's buffers: TCP checks them), structure is always validated."""
    buffers = written(random_batch(schema, 60, seed, 0.3))
    data = [b for b in buffers if b.data_type is DataType.DATA_BUFFER]
    target = data[seed % len(data)]
    payload = bytearray(target.data)
    for position, value in flips:
        payload[position % len(payload)] ^= value
    reader = RecordReader(schema, 0)
    reader.feed(buffers[0], 0)
    for earlier in data[: seed % len(data)]:
        reader.feed(earlier, 1)
    try:
        out = reader.feed(with_payload(target, bytes(payload)), 2)
    except BufferDecodeError:
        return
    for item in out:
        item.validate(full=True)
        assert item.schema.equals(schema)
        pa.ipc.read_record_batch(item.serialize(), schema).validate(full=True)  # every byte can be read


def _string_message(offsets: list[int], data: bytes) -> bytes:
    """A data payload of SCHEMA whose ``name`` column has exactly these offsets and bytes."""
    names = pa.StringArray.from_buffers(
        len(offsets) - 1, pa.py_buffer(np.array(offsets, np.int32).tobytes()), pa.py_buffer(data)
    )
    ids = pa.array(range(len(offsets) - 1), pa.int64())
    tags = pa.array([[]] * (len(offsets) - 1), pa.list_(pa.int32()))
    message = pa.RecordBatch.from_arrays([ids, names, tags], schema=SCHEMA).serialize().to_pybytes()
    return pack_chunk_header(len(offsets) - 1, len(message)) + message


@pytest.mark.parametrize(
    "offsets",
    [
        [0, 6, 3, 10],  # not monotone, first and last in bounds (what Arrow's cheap validation lets through)
        [0, 4, 90, 10],  # a middle offset past the data
        [0, -8, 4, 10],  # a negative one
    ],
)
def test_offsets_out_of_order_or_bounds_are_errors(offsets):
    reader = RecordReader(SCHEMA, 4)
    reader.feed(written(sample())[0], 0)
    with pytest.raises(BufferDecodeError, match="channel 4, sequence number 1"):
        reader.feed(Buffer(DataType.DATA_BUFFER, _string_message(offsets, b"abcdefghij")), 1)
    reader = RecordReader(SCHEMA, 4)
    reader.feed(written(sample())[0], 0)
    (batch,) = reader.feed(Buffer(DataType.DATA_BUFFER, _string_message([0, 3, 6, 10], b"abcdefghij")), 1)
    assert batch.column("name").to_pylist() == ["abc", "def", "ghij"]


def test_list_offsets_out_of_order_or_bounds_are_errors():
    values = pa.array(range(6), pa.int32())
    for offsets in ([0, 4, 2, 6], [0, 2, 9, 6]):
        tags = pa.ListArray.from_buffers(
            pa.list_(pa.int32()), 3, [None, pa.py_buffer(np.array(offsets, np.int32).tobytes())], children=[values]
        )
        batch = pa.RecordBatch.from_arrays(
            [pa.array([1, 2, 3], pa.int64()), pa.array(["a", "b", "c"]), tags], schema=SCHEMA
        )
        message = batch.serialize().to_pybytes()
        reader = RecordReader(SCHEMA, 0)
        reader.feed(written(sample())[0], 0)
        with pytest.raises(BufferDecodeError, match="does not decode"):
            reader.feed(Buffer(DataType.DATA_BUFFER, pack_chunk_header(3, len(message)) + message), 1)


def test_invalid_utf8_is_an_error():
    reader = RecordReader(SCHEMA, 0)
    reader.feed(written(sample())[0], 0)
    with pytest.raises(BufferDecodeError, match="does not decode"):
        reader.feed(Buffer(DataType.DATA_BUFFER, _string_message([0, 3, 6, 10], b"ab\xffdefghij")), 1)


def test_fragments_out_of_order_missing_or_repeated_are_errors():
    buffers = written(sample(20, big=3 * SEGMENT))
    fragments = [i for i, b in enumerate(buffers) if b.data_type is DataType.DATA_BUFFER]
    assert len(fragments) >= 4
    schema_event = buffers[0]

    def run(order: list[int]) -> None:
        reader = RecordReader(SCHEMA, 2)
        reader.feed(schema_event, 0)
        for seq, i in enumerate(order, start=1):
            reader.feed(Buffer(buffers[i].data_type, buffers[i].data), seq)

    run(list(range(1, len(buffers))))  # in order: fine
    body = list(range(1, len(buffers) - 1))
    swapped = body[:]
    swapped[1], swapped[2] = swapped[2], swapped[1]
    with pytest.raises(BufferDecodeError, match="fragment"):
        run(swapped)
    with pytest.raises(BufferDecodeError, match="fragment"):
        run(body[:2] + body[3:])  # one missing
    with pytest.raises(BufferDecodeError, match="fragment"):
        run(body[:3] + body[2:])  # one repeated
    with pytest.raises(BufferDecodeError, match="inside a spanning row"):
        run([*body[:2], len(buffers) - 1])  # end of partition inside the spanning row


def test_wrong_schema_is_an_error():
    buffers = written(sample())
    other = pa.schema([("id", pa.int32())])
    with pytest.raises(BufferDecodeError, match="differs from the expected schema"):
        RecordReader(other, 1).feed(buffers[0], 0)
    # a data buffer of another schema behind this channel's schema event
    foreign = written(pa.record_batch({"id": pa.array([1, 2], pa.int32())}))
    reader = RecordReader(SCHEMA, 1)
    reader.feed(buffers[0], 0)
    with pytest.raises(BufferDecodeError, match="channel 1, sequence number 1"):
        reader.feed(Buffer(DataType.DATA_BUFFER, foreign[1].data), 1)
    # a second, different schema event on the same channel
    reader = RecordReader(None, 1)
    reader.feed(buffers[0], 0)
    with pytest.raises(BufferDecodeError, match="differs"):
        reader.feed(encode_event(SchemaEvent(other)), 1)


def test_stream_order_errors():
    buffers = written(sample())
    with pytest.raises(BufferDecodeError, match="before the channel's schema event"):
        RecordReader(SCHEMA, 0).feed(buffers[1], 0)
    reader = RecordReader(SCHEMA, 0)
    feed_all(reader, buffers)
    assert reader.is_finished
    with pytest.raises(BufferDecodeError, match="after the end of partition"):
        reader.feed(encode_event(CheckpointBarrier(1, 1)), len(buffers))
    with pytest.raises(BufferDecodeError, match="neither data nor an event"):
        RecordReader(SCHEMA, 0).feed(Buffer(DataType.NONE, b""), 0)
    dictionary = pa.schema([("d", pa.dictionary(pa.int8(), pa.string()))])
    with pytest.raises(BufferDecodeError, match="unsupported"):
        RecordReader(None, 0).feed(encode_event(SchemaEvent(dictionary)), 0)


def test_declared_lengths_are_checked_before_anything_is_allocated():
    buffers = written(sample())
    reader = RecordReader(SCHEMA, 0)
    reader.feed(buffers[0], 0)
    huge = pack_chunk_header(10, 0xFFFFFFFF) + bytes(64)
    with pytest.raises(BufferDecodeError, match="declares a body of 4294967295 bytes"):
        reader.feed(Buffer(DataType.DATA_BUFFER, huge), 1)
    # fragment 0 of 2**32-1: only the bytes that arrive are kept
    fragment = pack_chunk_header(1, 64, 0, 0xFFFFFFFF) + bytes(64)
    assert reader.feed(Buffer(DataType.DATA_BUFFER, fragment), 2) == []
    assert reader.has_partial_record


def test_compressed_or_foreign_arrow_messages_are_rejected():
    """A record batch whose metadata is larger than this schema's (e.g. LZ4 body compression, which
    would make Arrow allocate the declared uncompressed sizes) is refused before Arrow sees it."""
    batch = sample(50)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, SCHEMA, options=pa.ipc.IpcWriteOptions(compression="lz4")) as stream:
        stream.write_batch(batch)
    messages = pa.ipc.MessageReader.open_stream(sink.getvalue())
    messages.read_next_message()  # the schema message
    compressed = messages.read_next_message().serialize().to_pybytes()
    reader = RecordReader(SCHEMA, 0)
    reader.feed(written(batch)[0], 0)
    payload = pack_chunk_header(50, len(compressed)) + compressed
    with pytest.raises(BufferDecodeError, match="not a record batch of this schema"):
        reader.feed(Buffer(DataType.DATA_BUFFER, payload), 1)
    schema_message = SCHEMA.serialize().to_pybytes()
    with pytest.raises(BufferDecodeError):
        reader.feed(Buffer(DataType.DATA_BUFFER, pack_chunk_header(1, len(schema_message)) + schema_message), 2)


def test_mutable_payloads_are_copied_before_recycling():
    buffers = written(sample(10))
    reader = RecordReader(SCHEMA, 0)
    reader.feed(buffers[0], 0)
    memory = bytearray(buffers[1].data)
    (batch,) = reader.feed(Buffer(DataType.DATA_BUFFER, memory), 1)
    memory[:] = bytes(len(memory))  # the segment is reused once recycled
    assert batch.column("id").to_pylist() == list(range(10))


def test_immutable_payloads_are_not_copied():
    buffers = written(sample(10))
    reader = RecordReader(SCHEMA, 0)
    reader.feed(buffers[0], 0)
    payload = buffers[1].data
    (batch,) = reader.feed(buffers[1], 1)
    start = pa.py_buffer(payload).address
    assert start <= batch.column("id").buffers()[1].address < start + len(payload)


def test_reader_counts_what_came_in():
    batch = sample(500)
    buffers = written(batch)
    reader = RecordReader(SCHEMA, 0)
    items = feed_all(reader, buffers)
    assert reader.num_records_in == 500
    assert reader.num_buffers_in == len(buffers)
    assert reader.num_bytes_in == sum(b.size for b in buffers)
    assert pa.Table.from_batches([i for i in items if isinstance(i, pa.RecordBatch)]).equals(
        pa.Table.from_batches([batch])
    )
    assert reader.schema.equals(SCHEMA)
    assert np.all(np.diff(pa.concat_arrays([i.column("id") for i in items[:-1]]).to_numpy()) == 1)
