"""Property tests: rows written through RecordWriter come out of RecordReader per channel, in order.

Random schemas (integers, floats, strings incl. empty and larger than a segment, binary, nulls,
lists, structs, maps, timestamps, decimals), random segment sizes, random selectors, and random
interleavings of flushes, events and reads. For every channel the rows read equal the rows routed
to it, in order, with the events in their place; no payload exceeds the segment.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from buffer_helpers import (
    ArraySelector,
    MemoryPartition,
    RecordingSelector,
    random_batch,
    schema_strategy,
    split_batch,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark_credit_shuffle.buffers import (
    CheckpointBarrier,
    DataType,
    EndOfPartition,
    IpcSizeModel,
    LatencyMarker,
    RecordReader,
    RecordWriter,
)
from spark_credit_shuffle.buffers.format import CHUNK_HEADER
from spark_credit_shuffle.buffers.size_model import compact
from spark_credit_shuffle.partitioners import ConstantSelector, RoundRobinSelector, ShuffleSelector

SEGMENTS = st.one_of(st.sampled_from([4096, 8192, 16384, 32768, 65536]), st.integers(4096, 70_000))
PROPERTY = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Exchange:
    """A writer over a MemoryPartition, its readers, and what each channel is expected to receive."""

    def __init__(self, num_channels: int, selector, segment_size: int, flush_always: bool = False) -> None:
        self.partition = MemoryPartition(num_channels)
        self.selector = RecordingSelector(selector)
        self.writer = RecordWriter(self.partition, self.selector, segment_size, flush_always=flush_always)
        self.segment_size = segment_size
        self.n = num_channels
        self.expected: list[list[object]] = [[] for _ in range(num_channels)]
        self.received: list[list[object]] = [[] for _ in range(num_channels)]
        self.readers = [RecordReader(None, sp) for sp in range(num_channels)]
        self.data_bytes = [0] * num_channels

    def emit(self, batch: pa.RecordBatch) -> None:
        self.writer.emit(batch)
        if self.selector.is_broadcast:
            for sp in range(self.n):
                self.expected[sp].append(batch)
            return
        channels = self.selector.chosen[-1] if batch.num_rows else np.zeros(0, np.int32)
        for sp in range(self.n):
            # compacted first: pyarrow's filter misreads a sliced fixed-size list of fixed-size lists
            self.expected[sp].append(compact(batch).filter(pa.array(channels == sp)))

    def broadcast_emit(self, batch: pa.RecordBatch) -> None:
        self.writer.broadcast_emit(batch)
        for sp in range(self.n):
            self.expected[sp].append(batch)

    def broadcast_event(self, event) -> None:
        self.writer.broadcast_event(event)
        for sp in range(self.n):
            self.expected[sp].append(event)

    def emit_event(self, event, sp: int) -> None:
        self.writer.emit_event(event, sp)
        self.expected[sp].append(event)

    def read(self, sp: int, polled) -> None:
        for buffer, sequence in polled:
            if buffer.data_type is DataType.DATA_BUFFER:
                assert 0 < buffer.size <= self.segment_size, f"payload of {buffer.size} bytes"
                assert buffer.size % 8 == 0
                self.data_bytes[sp] += buffer.size
            self.received[sp].extend(self.readers[sp].feed(buffer, sequence))

    def finish_and_check(self) -> None:
        self.writer.finish()
        for sp in range(self.n):
            self.expected[sp].append(EndOfPartition())
            self.read(sp, self.partition.drain(sp))
            assert not self.partition.queues[sp]
            schema = self.writer.schema
            assert _segments(self.received[sp], schema) == _segments(self.expected[sp], schema), f"channel {sp}"
            rows = sum(b.num_rows for b in self.expected[sp] if isinstance(b, pa.RecordBatch))
            assert self.writer.num_records_out[sp] == rows == self.readers[sp].num_records_in
            assert self.writer.num_bytes_out[sp] == self.data_bytes[sp]
            assert self.writer.num_buffers_out[sp] == len(self.partition.partial_lengths[sp])
            assert self.readers[sp].is_finished
        assert self.partition.segments_in_use == 0


def _segments(items: list[object], schema: pa.Schema | None) -> list[object]:
    """Rows between events as one list of Python rows per stretch, and the events themselves."""
    out: list[object] = []
    rows: list[dict] = []
    for item in items:
        if isinstance(item, pa.RecordBatch):
            rows.extend(item.to_pylist())
        else:
            out.append(rows)
            out.append(item)
            rows = []
    out.append(rows)
    return out


def _selector(kind: str, n: int, seed: int, sizes: list[int]):
    if kind == "round_robin":
        return RoundRobinSelector(n, seed % (n + 1) - 1)
    if kind == "shuffle":
        return ShuffleSelector(n, seed)
    if kind == "constant":
        return ConstantSelector(n, seed % n)
    rng = np.random.default_rng(seed)  # skewed: channel 0 takes most rows
    weights = rng.random(n) ** 3
    weights /= weights.sum()
    return ArraySelector(n, [rng.choice(n, size=size, p=weights) for size in sizes if size])


ACTIONS = st.sampled_from(["none", "flush", "flush_all", "barrier", "marker", "poll", "poll_all"])
OPS = st.lists(
    st.tuples(ACTIONS, st.integers(0, 7)),
    min_size=1,
    max_size=8,
)


@PROPERTY
@given(
    schema=schema_strategy(),
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(0, 250),
    cuts=st.lists(st.integers(0, 250), max_size=5),
    segment=SEGMENTS,
    channels=st.integers(1, 5),
    kind=st.sampled_from(["round_robin", "shuffle", "constant", "skewed"]),
    ops=OPS,
    flush_always=st.booleans(),
    null_rate=st.sampled_from([0.0, 0.3]),
    big_rate=st.sampled_from([0.0, 0.0, 0.02]),
)
def test_rows_read_per_channel_equal_rows_routed_in_order(
    schema, seed, rows, cuts, segment, channels, kind, ops, flush_always, null_rate, big_rate
):
    batch = random_batch(schema, rows, seed, null_rate, big=segment * 2, big_rate=big_rate)
    batches = split_batch(batch, cuts)
    selector = _selector(kind, channels, seed, [b.num_rows for b in batches])
    ex = Exchange(channels, selector, segment, flush_always)
    checkpoint = 0
    for i, piece in enumerate(batches):
        ex.emit(piece)
        op, arg = ops[i % len(ops)]
        sp = arg % channels
        if op == "flush":
            ex.writer.flush(sp)
        elif op == "flush_all":
            ex.writer.flush_all()
        elif op == "barrier":
            checkpoint += 1
            ex.broadcast_event(CheckpointBarrier(checkpoint, 1_700_000_000_000 + i))
        elif op == "marker":
            ex.emit_event(LatencyMarker(1_700_000_000_000_000_000 + i, arg), sp)
        elif op == "poll":
            ex.read(sp, ex.partition.poll_readable(sp))
        elif op == "poll_all":
            for c in range(channels):
                ex.read(c, ex.partition.drain(c))
    ex.finish_and_check()


@PROPERTY
@given(
    schema=schema_strategy(),
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 120),
    cuts=st.lists(st.integers(0, 120), max_size=5),
    segment=SEGMENTS,
    channels=st.integers(1, 4),
    modes=st.lists(st.booleans(), min_size=1, max_size=6),
    polls=st.lists(st.integers(0, 3), max_size=6),
    big_rate=st.sampled_from([0.0, 0.03]),
)
def test_broadcast_and_unicast_rows_interleave_in_order(
    schema, seed, rows, cuts, segment, channels, modes, polls, big_rate
):
    batch = random_batch(schema, rows, seed, 0.2, big=segment * 2, big_rate=big_rate)
    batches = split_batch(batch, cuts)
    ex = Exchange(channels, RoundRobinSelector(channels, -1), segment)
    for i, piece in enumerate(batches):
        if modes[i % len(modes)]:
            ex.broadcast_emit(piece)
        else:
            ex.emit(piece)
        if polls:
            sp = polls[i % len(polls)] % channels
            ex.writer.flush(sp)
            ex.read(sp, ex.partition.poll_readable(sp))  # one reader keeps up, the others lag
    ex.finish_and_check()


@PROPERTY
@given(
    schema=schema_strategy(),
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 150),
    cuts=st.lists(st.integers(0, 150), max_size=6),
    segment=SEGMENTS,
    channels=st.integers(1, 4),
    broadcast=st.booleans(),
)
def test_flush_always_leaves_no_row_waiting(schema, seed, rows, cuts, segment, channels, broadcast):
    batch = random_batch(schema, rows, seed, 0.2, big=segment * 2, big_rate=0.02)
    ex = Exchange(channels, ShuffleSelector(channels, seed), segment, flush_always=True)
    for piece in split_batch(batch, cuts):
        if broadcast:
            ex.broadcast_emit(piece)
        else:
            ex.emit(piece)
        for sp in range(channels):
            ex.read(sp, ex.partition.poll_readable(sp))
            got = [r for b in ex.received[sp] if isinstance(b, pa.RecordBatch) for r in b.to_pylist()]
            want = [r for b in ex.expected[sp] for r in b.to_pylist()]
            assert got == want
    ex.finish_and_check()


@PROPERTY
@given(
    schema=schema_strategy(),
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 200),
    segment=SEGMENTS,
    span=st.tuples(st.integers(0, 200), st.integers(0, 200)),
    big_rate=st.sampled_from([0.0, 0.05]),
    take=st.booleans(),
)
def test_size_model_bounds_the_serialised_chunk(schema, seed, rows, segment, span, big_rate, take):
    batch = random_batch(schema, rows, seed, 0.3, big=segment, big_rate=big_rate)
    if take:  # fresh, exactly sized buffers, as the writer's grouping take makes them
        batch = batch.take(pa.array(np.random.default_rng(seed).permutation(rows)))
    model = IpcSizeModel(schema, segment)
    cum = model.cumulative_bits(batch)
    overhead = model.overhead(batch)
    a, b = sorted(s % (rows + 1) for s in span)
    if a == b:
        b = min(a + 1, rows)
        a = b - 1
    bound = overhead + -(-int(cum[b] - cum[a]) // 8)
    actual = CHUNK_HEADER.size + model.serialize(batch.slice(a, b - a), bound).size
    assert actual <= bound
    # and close enough to fill buffers: the per-row part over-counts by at most a validity bit per field
    # and an empty nested child's offset
    assert int(cum[b] - cum[a]) // 8 <= actual + (b - a) * (len(schema) + 64) // 8 + 64


class _UnderEstimate(IpcSizeModel):
    """A size model that claims rows cost a quarter of their size (an estimate that is off)."""

    def overhead(self, src: pa.RecordBatch) -> int:
        return 32

    def cumulative_bits(self, batch: pa.RecordBatch) -> np.ndarray:
        return super().cumulative_bits(batch) // 4


@PROPERTY
@given(
    schema=schema_strategy(),
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 200),
    cuts=st.lists(st.integers(0, 200), max_size=4),
    segment=SEGMENTS,
    channels=st.integers(1, 3),
    flush_each=st.booleans(),
    broadcast=st.booleans(),
)
def test_wrong_estimates_never_exceed_the_segment(schema, seed, rows, cuts, segment, channels, flush_each, broadcast):
    batch = random_batch(schema, rows, seed, 0.2, big=segment * 2, big_rate=0.02)
    ex = Exchange(channels, RoundRobinSelector(channels, 0), segment)
    ex.writer._set_schema(schema)
    ex.writer._model = _UnderEstimate(schema, segment)  # the writer must correct it by measuring
    for i, piece in enumerate(split_batch(batch, cuts)):
        if broadcast and i % 2:
            ex.broadcast_emit(piece)
        else:
            ex.emit(piece)
        if flush_each:
            ex.writer.flush_all()
            ex.read(i % channels, ex.partition.poll_readable(i % channels))
    ex.finish_and_check()


def test_sliced_fixed_size_lists_of_fixed_size_lists_keep_their_rows():
    """pyarrow's take and filter read a slice of such a column from the wrong place; the writer routes
    rows with take, so it copies such batches from offset 0 first."""
    inner = pa.FixedSizeListArray.from_arrays(pa.array(range(1, 13), pa.int8()).slice(1), 1)
    column = pa.FixedSizeListArray.from_arrays(inner.slice(1), 2)  # inner list array at an offset
    batch = pa.record_batch([column], names=["c0"]).slice(1)
    rows = batch.column(0).to_pylist()
    assert rows == [[[5], [6]], [[7], [8]], [[9], [10]], [[11], [12]]]
    ex = Exchange(2, RoundRobinSelector(2), 4096)
    ex.emit(batch)
    ex.finish_and_check()
    received = [
        r
        for sp in range(2)
        for item in ex.received[sp]
        if isinstance(item, pa.RecordBatch)
        for r in item.column(0).to_pylist()
    ]
    assert sorted(received) == sorted(rows)
