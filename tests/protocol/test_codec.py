"""Wire codec: round trips, incremental decoding, and untrusted input (fuzz, truncation, oversized lengths)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_credit_shuffle.buffers.buffer import DataType
from spark_credit_shuffle.errors import ProtocolError
from spark_credit_shuffle.protocol import (
    NEED_DATA,
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
    FrameDecoder,
    Hello,
    NewBufferSize,
    PartitionRequest,
    RecycleBuffers,
    ResumeConsumption,
    encode,
    encode_to_bytes,
    encoded_size,
)
from spark_credit_shuffle.protocol.codec import (
    FRAME_HEADER_LENGTH,
    MAGIC_NUMBER,
    PROTOCOL_VERSION,
    buffer_response_header,
)

MAX_FRAME = 32 * 1024 + 1024
u64 = st.integers(0, (1 << 64) - 1)
u32 = st.integers(0, (1 << 32) - 1)
data_types = st.sampled_from([t for t in DataType if t is not DataType.NONE])

messages = st.one_of(
    st.builds(BufferResponse, u64, u32, u32, u32, data_types, st.booleans(), st.binary(max_size=2048)),
    st.builds(ErrorResponse, st.text(max_size=200), st.one_of(st.none(), u64)),
    st.builds(PartitionRequest, u64, u32, u32, u64, st.booleans()),
    st.builds(RecycleBuffers, u64, st.integers(1, (1 << 32) - 1)),
    st.builds(CancelPartitionRequest, u64),
    st.just(CloseRequest()),
    st.builds(AddCredit, u64, st.integers(1, (1 << 32) - 1)),
    st.builds(ResumeConsumption, u64),
    st.builds(AckAllUserRecordsProcessed, u64),
    st.builds(BacklogAnnouncement, u64, u32),
    st.builds(NewBufferSize, u64, u32),
    st.builds(AcknowledgeCheckpoint, u64, st.integers(1, (1 << 64) - 1), st.booleans()),
    st.builds(Hello, st.binary(min_size=32, max_size=32)),
    st.builds(AuthChallenge, st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32)),
    st.builds(AuthResponse, st.binary(min_size=32, max_size=32)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(messages, max_size=8), st.data())
def test_round_trip_in_any_chunking(sent, data):
    wire = b"".join(encode_to_bytes(m) for m in sent)
    assert len(wire) == sum(encoded_size(m) for m in sent)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    decoder = FrameDecoder(MAX_FRAME)
    received = []
    start = 0
    for cut in [*cuts, len(wire)]:
        received.extend(decoder.receive_data(wire[start:cut]))
        start = cut
    assert received == sent
    assert decoder.pending_bytes == 0
    decoder.close()


def test_buffer_response_payload_is_not_copied_when_encoding():
    payload = bytearray(b"x" * 1000)
    chunks = encode(BufferResponse(1, 2, 3, 4, DataType.DATA_BUFFER, False, payload))
    assert len(chunks) == 2 and chunks[1] is payload
    assert len(chunks[0]) == FRAME_HEADER_LENGTH + 26


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, (1 << 64) - 1),
    st.integers(0, (1 << 32) - 1),
    st.integers(0, (1 << 32) - 1),
    st.integers(0, (1 << 32) - 1),
    st.sampled_from([t for t in DataType if t is not DataType.NONE]),
    st.binary(max_size=64),
)
def test_the_header_only_encoding_is_the_message_encoding(receiver, subpartition, seq, backlog, data_type, payload):
    # given a BufferResponse as a transport sends it: its header alone, then its payload as it is
    header = buffer_response_header(receiver, subpartition, seq, backlog, data_type, len(payload))
    message = BufferResponse(receiver, subpartition, seq, backlog, data_type, False, payload)
    # then the bytes are those of the message's own encoding, and they decode to the message
    assert header + payload == encode_to_bytes(message)
    (decoded,) = FrameDecoder(MAX_FRAME).receive_data(header + payload)
    assert decoded[:6] == message[:6] and bytes(decoded.payload) == payload
    with pytest.raises(ProtocolError, match="out of its wire range"):
        buffer_response_header(-1, subpartition, seq, backlog, data_type, len(payload))


def test_next_message_returns_need_data_until_a_frame_is_complete():
    frame = encode_to_bytes(AddCredit(5, 3))
    decoder = FrameDecoder(MAX_FRAME)
    assert decoder.next_message() is NEED_DATA
    for byte in frame[:-1]:
        assert decoder.receive_data(bytes([byte])) == []
    assert decoder.next_message() is NEED_DATA
    assert decoder.receive_data(frame[-1:]) == [AddCredit(5, 3)]


def test_a_payload_that_arrived_whole_is_a_view_and_one_cut_by_the_wire_is_assembled():
    first = BufferResponse(1, 0, 0, 0, DataType.DATA_BUFFER, False, b"a" * 3000)
    second = BufferResponse(1, 0, 1, 0, DataType.DATA_BUFFER, False, b"b" * 3000)
    wire = encode_to_bytes(first) + encode_to_bytes(second)
    cut = len(wire) - 1000  # the second frame arrives in two pieces
    decoder = FrameDecoder(MAX_FRAME)
    head = wire[:cut]
    (whole,) = decoder.receive_data(head)
    assert isinstance(whole.payload, memoryview) and whole.payload.obj is head  # no copy: a view of what came
    assert whole == first and decoder.pending_bytes == cut - encoded_size(first)
    (assembled,) = decoder.receive_data(wire[cut:])
    assert assembled == second and decoder.pending_bytes == 0


def test_a_payload_never_points_into_memory_the_caller_may_reuse():
    message = BufferResponse(1, 0, 0, 0, DataType.DATA_BUFFER, False, b"x" * 100)
    receive_buffer = bytearray(encode_to_bytes(message))
    (decoded,) = FrameDecoder(MAX_FRAME).receive_data(memoryview(receive_buffer))
    receive_buffer[:] = b"\0" * len(receive_buffer)  # the caller reads the next bytes into the same memory
    assert decoded == message


def _frame(msg_id: int, body: bytes, *, magic: int = MAGIC_NUMBER, version: int = PROTOCOL_VERSION, length=None):
    length = FRAME_HEADER_LENGTH + len(body) if length is None else length
    return struct.pack(">IIBB", length, magic, version, msg_id) + body


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (_frame(5, b"", magic=0xBADC0FFE), "magic"),
        (_frame(5, b"", version=9), "version"),
        (_frame(11, b""), "unknown message id"),
        (_frame(200, b""), "unknown message id"),
        (struct.pack(">I", 1 << 31), "exceeds the maximum frame length"),
        (struct.pack(">I", 3), "shorter than"),
        (_frame(5, b"x"), "CloseRequest body"),
        (_frame(6, struct.pack(">IQ", 0, 1)), "0 credit"),
        (_frame(4, b"\x00" * 7), "CancelPartitionRequest body"),
        (_frame(0, struct.pack(">QIIIBBI", 1, 0, 0, 0, 1, 0, 100) + b"x" * 10), "declares 100 payload bytes"),
        (_frame(0, struct.pack(">QIIIBBI", 1, 0, 0, 0, 0, 0, 0)), "unknown data type"),
        (_frame(0, struct.pack(">QIIIBBI", 1, 0, 0, 0, 99, 0, 0)), "unknown data type"),
        (_frame(0, struct.pack(">QIIIBBI", 1, 0, 0, 0, 1, 7, 0)), "compressed flag"),
        (_frame(0, b"\x00" * 5), "shorter than its"),
        (_frame(1, struct.pack(">BQI", 1, 1, 50) + b"abc"), "declares 50 message bytes"),
        (_frame(1, struct.pack(">BQI", 3, 1, 0)), "receiver-id flag"),
        (_frame(12, b"x" * 12), "Hello body is 12 bytes, expected exactly 32"),
        (_frame(15, b"x" * 40), "AuthResponse body is 40 bytes"),
    ],
)
def test_bad_frames_raise_protocol_error(wire, match):
    decoder = FrameDecoder(MAX_FRAME)
    with pytest.raises(ProtocolError, match=match):
        decoder.receive_data(wire)
    with pytest.raises(ProtocolError):  # poisoned: the connection must be closed
        decoder.receive_data(encode_to_bytes(CloseRequest()))


def test_oversized_length_fails_before_the_frame_arrives():
    decoder = FrameDecoder(4096)
    with pytest.raises(ProtocolError, match="exceeds the maximum frame length 4096"):
        decoder.receive_data(struct.pack(">I", 4097))
    assert FrameDecoder(4096).receive_data(struct.pack(">I", 4096)) == []  # at the limit: waits for it


def test_truncated_stream_raises_on_close():
    frame = encode_to_bytes(PartitionRequest(1, 2, 3, 4))
    decoder = FrameDecoder(MAX_FRAME)
    assert decoder.receive_data(frame[:-1]) == []
    with pytest.raises(ProtocolError, match="inside a frame"):
        decoder.close()


def test_encoding_out_of_range_fields_raises_protocol_error():
    with pytest.raises(ProtocolError, match="out of its wire range"):
        encode(AddCredit(-1, 2))
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode("not a message")  # type: ignore[arg-type]


def test_the_handshake_frames_have_fixed_sizes_and_carry_no_secret():
    assert len(encode_to_bytes(Hello(b"n" * 32))) == FRAME_HEADER_LENGTH + 32
    assert len(encode_to_bytes(AuthChallenge(b"n" * 32, b"p" * 32))) == FRAME_HEADER_LENGTH + 64
    assert len(encode_to_bytes(AuthResponse(b"p" * 32))) == FRAME_HEADER_LENGTH + 32
    with pytest.raises(ProtocolError, match="exactly 32"):
        encode(Hello(b"short"))
    long_hello = bytearray(encode_to_bytes(Hello(b"n" * 32)) + b"x")
    long_hello[3] += 1  # a frame one byte longer than a Hello may be
    with pytest.raises(ProtocolError, match="expected exactly 32"):
        FrameDecoder(MAX_FRAME).receive_data(bytes(long_hello))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600), st.integers(1, 64))
def test_fuzz_random_bytes(garbage, chunk):
    decoder = FrameDecoder(1024)
    try:
        for start in range(0, len(garbage), chunk):
            decoder.receive_data(garbage[start : start + chunk])
        assert decoder.pending_bytes <= 1024
        decoder.next_message()
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(messages, st.data())
def test_fuzz_mutated_frames(message, data):
    wire = bytearray(encode_to_bytes(message))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(wire) - 1))
        wire[position] = data.draw(st.integers(0, 255))
    truncate = data.draw(st.integers(0, len(wire)))
    decoder = FrameDecoder(MAX_FRAME)
    try:
        decoded = decoder.receive_data(bytes(wire[:truncate]))
        for m in decoded:
            encode(m)  # whatever decodes is a well-formed message again
        decoder.close()
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(FRAME_HEADER_LENGTH + 27, (1 << 32) - 1))
def test_fuzz_declared_lengths_never_allocate_beyond_the_maximum(length):
    decoder = FrameDecoder(MAX_FRAME)
    try:
        result = decoder.receive_data(struct.pack(">IIBB", length, MAGIC_NUMBER, PROTOCOL_VERSION, 0))
        assert result == [] and length <= MAX_FRAME
        assert decoder.pending_bytes == FRAME_HEADER_LENGTH
    except ProtocolError:
        assert length > MAX_FRAME


def test_a_partition_request_with_a_local_flag_other_than_0_or_1_is_refused():
    frame = bytearray(encode_to_bytes(PartitionRequest(1, 2, 0, 4, True)))
    assert FrameDecoder(MAX_FRAME).receive_data(bytes(frame)) == [PartitionRequest(1, 2, 0, 4, True)]
    frame[-1] = 2
    with pytest.raises(ProtocolError, match="local flag 2"):
        FrameDecoder(MAX_FRAME).receive_data(bytes(frame))
    ack = bytearray(encode_to_bytes(AcknowledgeCheckpoint(3, 5, True)))
    assert FrameDecoder(MAX_FRAME).receive_data(bytes(ack)) == [AcknowledgeCheckpoint(3, 5, True)]
    ack[-1] = 2
    with pytest.raises(ProtocolError, match="declined flag 2"):
        FrameDecoder(MAX_FRAME).receive_data(bytes(ack))
    ack = bytearray(encode_to_bytes(AcknowledgeCheckpoint(3, 5)))
    ack[FRAME_HEADER_LENGTH : FRAME_HEADER_LENGTH + 8] = bytes(8)
    with pytest.raises(ProtocolError, match="checkpoint 0"):
        FrameDecoder(MAX_FRAME).receive_data(bytes(ack))
    zero = bytearray(encode_to_bytes(RecycleBuffers(9, 1)))
    zero[FRAME_HEADER_LENGTH : FRAME_HEADER_LENGTH + 4] = b"\0\0\0\0"
    with pytest.raises(ProtocolError, match="recycles 0 buffers"):
        FrameDecoder(MAX_FRAME).receive_data(bytes(zero))
