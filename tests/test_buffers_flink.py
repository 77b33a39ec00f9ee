"""Record writing behaviours from Flink's test suite (docs/flink.md, "Behaviours from Flink's test suite"),
flush rules, counters.

Flink's tests count 4-byte framed records in 32-byte buffers; here a buffer is an Arrow message in
a segment of at least 4 KiB, so the record sizes are chosen to give the same buffer layouts.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from buffer_helpers import ArraySelector, MemoryPartition, read_all, rows_of

from spark_credit_shuffle.buffers import (
    CheckpointBarrier,
    DataType,
    EndOfPartition,
    LatencyMarker,
    RecordReader,
    RecordWriter,
)
from spark_credit_shuffle.errors import ConfigError
from spark_credit_shuffle.partitioners import BroadcastSelector, ConstantSelector, RoundRobinSelector

SEGMENT = 4096
SCHEMA = pa.schema([("id", pa.int64()), ("text", pa.string())])


def rows(ids: list[int], text_len: int = 8) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(ids, pa.int64()), "text": pa.array([f"{i:0{text_len}d}" for i in ids])})


def ids_read(items: list[object]) -> list[int]:
    return rows_of(items, SCHEMA).column("id").to_pylist()


def data_buffers(partition: MemoryPartition, sp: int) -> list:
    return [b for b, _ in partition.drain(sp) if b.data_type is DataType.DATA_BUFFER]


def kinds(partition: MemoryPartition, sp: int) -> list[str]:
    """What is queued in ``sp``: 'schema'/'event' for events, 'data' for data buffers."""
    out = []
    for consumer, _ in partition.queues[sp]:
        if consumer.data_type is DataType.DATA_BUFFER:
            out.append("data")
        else:
            out.append("event")
    return out


# -- Flink's RecordWriter tests (docs/flink.md, "Behaviours from Flink's test suite") --------------------


def test_broadcast_event_no_records():
    """RecordWriterTest#testBroadcastEventNoRecords: an event alone takes no pool buffer."""
    partition = MemoryPartition(4)
    writer = RecordWriter(partition, RoundRobinSelector(4, -1), SEGMENT)
    writer.broadcast_event(CheckpointBarrier(1, 1_700_000_000_000))
    assert partition.segments_requested == [0, 0, 0, 0]
    for sp in range(4):
        assert kinds(partition, sp) == ["event"]
        items, _ = read_all(partition.poll_readable(sp), SCHEMA, sp)
        assert items == [CheckpointBarrier(1, 1_700_000_000_000)]
        assert not partition.is_readable(sp)


@pytest.mark.parametrize("broadcast", [False, True])
def test_broadcast_event_mixed_records(broadcast):
    """RecordWriterTest#testBroadcastEventMixedRecords: records of three sizes round robin, then a barrier.

    The second record spans two segments. Round robin: the queues hold 2, 3, 2 and 1 elements
    besides the schema event, and 4 segments are in use. Broadcast: 3 segments shared by all
    subpartitions (the spanning record starts behind the first one and the third does not fit behind
    its end), so every subpartition sees 3 buffers then the event; both as in Flink's test.
    """
    partition = MemoryPartition(4)
    selector = BroadcastSelector(4) if broadcast else RoundRobinSelector(4, -1)
    writer = RecordWriter(partition, selector, SEGMENT)
    sizes = [1000, 5000, 2000]  # fits, spans two segments, fits
    for i, size in enumerate(sizes):
        writer.emit(pa.record_batch({"id": pa.array([i], pa.int64()), "text": pa.array(["x" * size])}))
    writer.broadcast_event(CheckpointBarrier(7, 0))
    if broadcast:
        assert sum(partition.segments_requested) == writer.num_buffers_out[0] == 3
        for sp in range(4):
            assert kinds(partition, sp) == ["event", "data", "data", "data", "event"]
    else:
        assert partition.segments_requested == [1, 2, 1, 0]
        assert [kinds(partition, sp) for sp in range(4)] == [
            ["event", "data", "event"],
            ["event", "data", "data", "event"],
            ["event", "data", "event"],
            ["event"],
        ]
    assert partition.segments_in_use == sum(partition.segments_requested)  # nothing consumed yet
    for sp in range(4):
        items, _ = read_all(partition.drain(sp), SCHEMA, sp)
        assert items[-1] == CheckpointBarrier(7, 0)
        expected = [0, 1, 2] if broadcast else ([] if sp == 3 else [sp])
        assert ids_read(items) == expected
    assert partition.segments_in_use == 0


def test_broadcast_emit_record():
    """RecordWriterTest#testBroadcastEmitRecord: broadcast rows take one set of buffers for all subpartitions."""
    partition = MemoryPartition(4)
    writer = RecordWriter(partition, BroadcastSelector(4), SEGMENT)
    for i in range(8):  # 8 rows of ~1.5 KB: two per segment
        writer.emit(pa.record_batch({"id": pa.array([i], pa.int64()), "text": pa.array(["y" * 1500])}))
    writer.finish()
    assert sum(partition.segments_requested) == partition.segments_requested[0] == 4  # all against subpartition 0
    assert writer.num_buffers_out == [4, 4, 4, 4]  # a broadcast buffer counts once per subpartition
    per_sp = [data_buffers(partition, sp) for sp in range(4)]
    assert all(len(buffers) == 4 for buffers in per_sp)
    for i in range(4):  # the same bytes object, not a copy per channel
        assert len({id(buffers[i].data) for buffers in per_sp}) == 1
    assert writer.num_bytes_out == [sum(b.size for b in per_sp[0])] * 4
    for sp in range(4):
        items, _ = read_all([(b, i) for i, b in enumerate([_schema_buffer(writer), *per_sp[sp]])], SCHEMA, sp)
        assert ids_read(items) == list(range(8))
    assert partition.segments_in_use == 0


def _schema_buffer(writer: RecordWriter):
    from spark_credit_shuffle.buffers import SchemaEvent, encode_event

    return encode_event(SchemaEvent(writer.schema))


def test_is_available_or_not():
    """RecordWriterTest#testIsAvailableOrNot: the writer is available while the pool has a segment."""
    partition = MemoryPartition(1, pool_size=1)
    writer = RecordWriter(partition, ConstantSelector(1, 0), SEGMENT)
    assert writer.is_available()
    writer.emit(rows([1]))
    assert not writer.is_available()
    writer.finish()
    read_all(partition.drain(0), SCHEMA)  # reading recycles the segment
    assert writer.is_available()


def test_broadcast_emit_on_a_channel_selector_writer_copies_rows_into_every_channels_own_buffer():
    """ChannelSelectorRecordWriter#broadcastEmit emits the record to each channel: one pool buffer per channel,
    and unicast and broadcast rows share each channel's open buffer (no mode switch finishes it)."""
    n = 8
    selector = ArraySelector(n, [np.array([i % n]) for i in range(n)])
    partition = MemoryPartition(n)
    writer = RecordWriter(partition, selector, SEGMENT)
    for i in range(n):
        writer.emit(rows([i]))  # to subpartition i
        writer.broadcast_emit(rows([100 + i]))  # to all, copied
    writer.finish()
    assert partition.segments_requested == [1] * n  # one buffer of its own per channel
    assert writer.num_records_out == [n + 1] * n
    per_sp = [partition.drain(sp) for sp in range(n)]
    datas = [[b for b, _ in buffers if b.data_type is DataType.DATA_BUFFER] for buffers in per_sp]
    assert len({id(d[0].data) for d in datas}) == n  # not one shared bytes object
    for sp in range(n):
        items, _ = read_all(per_sp[sp], SCHEMA, sp)
        assert ids_read(items) == [100 + i for i in range(sp)] + [sp] + [100 + i for i in range(sp, n)]
    assert partition.segments_in_use == 0


def test_random_emit_and_buffer_recycling():
    """BroadcastRecordWriterTest#testRandomEmitAndBufferRecycling: a shared segment returns after the last reader."""
    partition = MemoryPartition(2)
    writer = RecordWriter(partition, BroadcastSelector(2), SEGMENT)
    writer.broadcast_emit(rows([1, 2, 3]))
    writer.broadcast_event(CheckpointBarrier(1, 0))  # finishes the shared builder
    assert partition.segments_in_use == 1
    read_all(partition.drain(0), SCHEMA, 0)
    assert partition.segments_in_use == 1  # subpartition 1 still holds it
    read_all(partition.drain(1), SCHEMA, 1)
    assert partition.segments_in_use == 0


@pytest.mark.parametrize(
    ("segment", "records"),
    [
        # every record spans several buffers
        (4096, [("x" * 20_000) for _ in range(5)]),
        # records aligned with buffer ends: each fills its segment exactly (found by measuring)
        (4096, "aligned"),
        # unaligned small records
        (4096, [("z" * (i % 31)) for i in range(248)]),
        # 10 000 random records in the smallest segment
        (4096, "random"),
        # 32 KiB buffers with alternating small and very large records
        (32768, [("s" * 3) if i % 2 == 0 else ("L" * (100_000 + 7 * i)) for i in range(12)]),
    ],
)
def test_spanning_record_serialization(segment, records):
    """SpanningRecordSerializationTest: round trips with records of every size relative to the segment."""
    if records == "random":
        rng = np.random.default_rng(12)
        records = ["r" * int(n) for n in rng.integers(0, 12_000, size=10_000) * (rng.random(10_000) < 0.01)]
    elif records == "aligned":
        records = [_aligned_record(segment)] * 16
    batch = pa.record_batch({"id": pa.array(range(len(records)), pa.int64()), "text": pa.array(records)})
    partition = MemoryPartition(1)
    writer = RecordWriter(partition, ConstantSelector(1, 0), segment)
    for piece in (batch.slice(i, 7) for i in range(0, batch.num_rows, 7)):
        writer.emit(piece)
    writer.finish()
    buffers = partition.drain(0)
    assert all(b.size <= segment for b, _ in buffers)
    items, reader = read_all(buffers, SCHEMA)
    assert rows_of(items, SCHEMA).equals(pa.Table.from_batches([batch]))
    assert reader.num_records_in == len(records)
    assert partition.segments_in_use == 0


def _aligned_record(segment: int) -> str:
    """A text whose one-row chunk fills ``segment`` exactly (so buffers end where records end)."""
    from spark_credit_shuffle.buffers.format import CHUNK_HEADER

    base = CHUNK_HEADER.size + rows([0], 8).serialize().size  # 8 text bytes, no padding
    return "a" * (8 + segment - base)


def test_aligned_records_fill_whole_segments():
    """Records that fit a segment exactly give one full buffer each, none spanning (SpanningRecordSerializationTest)."""
    segment = 4096
    partition = MemoryPartition(1)
    writer = RecordWriter(partition, ConstantSelector(1, 0), segment)
    record = _aligned_record(segment)
    writer.emit(pa.record_batch({"id": pa.array(range(6), pa.int64()), "text": pa.array([record] * 6)}))
    writer.finish()
    data = [b for b, _ in partition.drain(0) if b.data_type is DataType.DATA_BUFFER]
    assert [b.size for b in data] == [segment] * 6


def test_partial_record_then_last_record_from_buffer():
    """SpillingAdaptiveSpanningRecordDeserializer: PARTIAL while a row spans, the row with its last buffer;
    one buffer holding two chunks gives both (INTERMEDIATE then LAST)."""
    partition = MemoryPartition(1)
    writer = RecordWriter(partition, ConstantSelector(1, 0), SEGMENT)
    writer.emit(pa.record_batch({"id": pa.array([1], pa.int64()), "text": pa.array(["q" * 10_000])}))
    writer.finish()
    reader = RecordReader(SCHEMA, 0)
    buffers = partition.drain(0)
    assert reader.feed(*buffers[0]) == []  # schema
    data = [item for item in buffers[1:-1]]
    assert len(data) == 3
    assert reader.feed(*data[0]) == [] and reader.has_partial_record
    assert reader.feed(*data[1]) == [] and reader.has_partial_record
    (row,) = reader.feed(*data[2])
    assert not reader.has_partial_record
    assert row.column("text")[0].as_py() == "q" * 10_000
    assert reader.feed(*buffers[-1]) == [EndOfPartition()]


def test_lagging_broadcast_reader_gets_two_chunks_in_one_buffer():
    """A broadcast slice flushed to one reader and written further reaches a lagging reader as one buffer."""
    partition = MemoryPartition(2)
    writer = RecordWriter(partition, BroadcastSelector(2), SEGMENT)
    writer.emit(rows([1, 2]))
    writer.flush_all()
    first = partition.poll_readable(0)  # schema event and the slice [1, 2]
    writer.emit(rows([3]))
    writer.flush_all()
    second = partition.poll_readable(0)  # the slice [3]
    lagging = partition.poll_readable(1)  # schema event and one buffer with both chunks
    assert [b.data_type for b, _ in lagging] == [DataType.EVENT_BUFFER, DataType.DATA_BUFFER]
    items, _ = read_all(lagging, SCHEMA, 1)
    assert [b.num_rows for b in items] == [2, 1]  # INTERMEDIATE then LAST
    assert ids_read(items) == ids_read(read_all(first + second, SCHEMA, 0)[0]) == [1, 2, 3]


# -- flush rules ----------------------------------------------------------------------------------------


def test_flush_hands_out_a_slice_without_finishing_the_buffer():
    """A pipelined flush makes the rows consumable; the producer keeps writing into the same segment."""
    partition = MemoryPartition(1)
    writer = RecordWriter(partition, ConstantSelector(1, 0), SEGMENT)
    reader = RecordReader(SCHEMA, 0)
    writer.emit(rows([1, 2]))
    got = [item for buffer, seq in partition.poll_readable(0) for item in reader.feed(buffer, seq)]
    assert got == []  # only the schema event: the open buffer waits (timeout -1 behaviour)
    writer.flush(0)
    assert partition.is_readable(0)
    got = [item for buffer, seq in partition.poll_readable(0) for item in reader.feed(buffer, seq)]
    assert ids_read(got) == [1, 2]
    assert writer.num_buffers_out == [0]  # flushed, not finished
    writer.emit(rows([3]))
    writer.flush(0)
    got = [item for buffer, seq in partition.poll_readable(0) for item in reader.feed(buffer, seq)]
    assert ids_read(got) == [3]
    assert partition.segments_requested == [1]  # both slices came from the one segment
    assert partition.segments_in_use == 1
    writer.finish()
    assert writer.num_buffers_out == [1]
    for buffer, seq in partition.drain(0):
        reader.feed(buffer, seq)
    assert partition.segments_in_use == 0
    assert writer.num_bytes_out == [reader.num_bytes_in - len(_schema_buffer(writer).data)]


def test_flush_slices_share_the_capacity_of_one_segment():
    """Slices of one segment never add up to more than the segment, per-slice overhead included."""
    partition = MemoryPartition(1)
    writer = RecordWriter(partition, ConstantSelector(1, 0), SEGMENT)
    sizes = []
    for i in range(200):
        writer.emit(rows([i], text_len=40))
        writer.flush(0)
        sizes.extend(b.size for b, _ in partition.poll_readable(0) if b.data_type is DataType.DATA_BUFFER)
    writer.finish()
    sizes.extend(b.size for b, _ in partition.drain(0) if b.data_type is DataType.DATA_BUFFER)
    assert len(sizes) == 200  # one slice per flush
    per_segment = writer.num_bytes_out[0] / writer.num_buffers_out[0]
    assert per_segment <= SEGMENT
    assert sum(sizes) == writer.num_bytes_out[0]
    assert writer.num_buffers_out[0] < 200  # slices of one segment, not a segment per flush


def test_timeout_disabled_only_full_buffers_and_events_move():
    """Buffer timeout -1: rows in a partly filled buffer wait for it to fill, for an event or for finish."""
    partition = MemoryPartition(2)
    writer = RecordWriter(partition, RoundRobinSelector(2, -1), SEGMENT)
    readers = [RecordReader(SCHEMA, sp) for sp in range(2)]

    def read(sp: int) -> list[object]:
        return [item for buffer, seq in partition.poll_readable(sp) for item in readers[sp].feed(buffer, seq)]

    writer.emit(rows(list(range(10))))
    for sp in range(2):
        assert read(sp) == []  # the schema event only; the open buffer with five rows waits
        assert not partition.is_readable(sp) and partition.queues[sp]
    writer.emit(rows(list(range(10, 4000))))  # fills buffers: the finished ones become readable
    first = ids_read(read(0))
    assert first[:5] == [0, 2, 4, 6, 8] and len(first) < 2000  # the last, open buffer still waits
    writer.emit_event(LatencyMarker(123, 0), 1)  # an event finishes the open buffer before it
    items = read(1)
    assert ids_read(items) == list(range(1, 4000, 2)) and items[-1] == LatencyMarker(123, 0)
    writer.finish()
    assert first + ids_read(read(0)) == list(range(0, 4000, 2))


def test_flush_always_moves_every_row_of_every_batch():
    """Buffer timeout 0: after each emit every row is readable, in buffers of the same segment."""
    partition = MemoryPartition(3)
    writer = RecordWriter(partition, RoundRobinSelector(3, -1), SEGMENT, flush_always=True)
    readers = [RecordReader(SCHEMA, sp) for sp in range(3)]
    seen: list[list[int]] = [[], [], []]
    for start in range(0, 60, 6):
        writer.emit(rows(list(range(start, start + 6))))
        for sp in range(3):
            for buffer, seq in partition.poll_readable(sp):
                seen[sp].extend(ids_read(readers[sp].feed(buffer, seq)))
            assert seen[sp] == list(range(sp, start + 6, 3))
    assert partition.segments_requested == [1, 1, 1]


def test_events_never_overtake_data():
    partition = MemoryPartition(2)
    writer = RecordWriter(partition, RoundRobinSelector(2, -1), SEGMENT)
    writer.emit(rows([0, 1, 2, 3]))
    writer.broadcast_event(CheckpointBarrier(1, 10))
    writer.emit(rows([4, 5]))
    writer.broadcast_event(CheckpointBarrier(2, 20))
    writer.finish()
    for sp in range(2):
        items, _ = read_all(partition.drain(sp), SCHEMA, sp)
        shape = ["rows" if isinstance(i, pa.RecordBatch) else i for i in items]
        assert shape == ["rows", CheckpointBarrier(1, 10), "rows", CheckpointBarrier(2, 20), EndOfPartition()]
        assert ids_read(items) == [sp, sp + 2, sp + 4]


# -- counters and errors --------------------------------------------------------------------------------


def test_counters_count_finished_buffers_per_subpartition():
    partition = MemoryPartition(3)
    writer = RecordWriter(partition, ConstantSelector(3, 1), SEGMENT)
    writer.emit(rows(list(range(500)), text_len=30))
    writer.flush_all()
    finished_before = writer.num_buffers_out[1]
    writer.finish()
    assert writer.num_records_out == [0, 500, 0]
    assert writer.num_buffers_out[0] == writer.num_buffers_out[2] == 0
    assert writer.num_buffers_out[1] == finished_before + 1  # finish() finished the open one
    buffers = partition.drain(1)
    data = [b for b, _ in buffers if b.data_type is DataType.DATA_BUFFER]
    assert writer.num_bytes_out[1] == sum(b.size for b in data)
    _, reader = read_all(buffers, SCHEMA, 1)
    assert reader.num_records_in == 500
    assert reader.num_buffers_in == len(buffers)  # buffers and events, as Flink's numBuffersIn
    assert reader.num_bytes_in == sum(b.size for b, _ in buffers)


def test_rejects_bad_input():
    partition = MemoryPartition(2)
    with pytest.raises(ConfigError, match="segment_size"):
        RecordWriter(partition, RoundRobinSelector(2, -1), 1024)
    with pytest.raises(ConfigError, match="selector"):
        RecordWriter(partition, RoundRobinSelector(3, -1), SEGMENT)
    writer = RecordWriter(partition, RoundRobinSelector(2, -1), SEGMENT)
    writer.emit(rows([1]))
    with pytest.raises(ValueError, match="schema differs"):
        writer.emit(pa.record_batch({"other": pa.array([1])}))
    with pytest.raises(TypeError, match="RecordBatch"):
        writer.emit(pa.table({"id": [1]}))
    with pytest.raises(TypeError, match="finish"):
        writer.broadcast_event(EndOfPartition())
    bad = RecordWriter(MemoryPartition(2), ArraySelector(2, [np.array([0, 5])]), SEGMENT)
    with pytest.raises(ValueError, match="outside"):
        bad.emit(rows([1, 2]))
    with pytest.raises(TypeError, match="dictionary"):
        RecordWriter(MemoryPartition(1), ConstantSelector(1, 0), SEGMENT).emit(
            pa.record_batch({"d": pa.array(["a", "b"]).dictionary_encode()})
        )
    writer.finish()
    with pytest.raises(RuntimeError, match="finished"):
        writer.emit(rows([2]))


def test_writer_and_readers_over_the_protocol_partition():
    """The RecordWriter drives the protocol core's PipelinedResultPartition; polling its subpartitions
    and reading gives every row in order, and every segment goes back to the pool."""
    from spark_credit_shuffle.buffers.pools import NetworkBufferPool
    from spark_credit_shuffle.config import NetworkConfig
    from spark_credit_shuffle.protocol import PipelinedResultPartition

    config = NetworkConfig(segment_size=SEGMENT, network_memory=1 << 22)
    network = NetworkBufferPool(config.total_network_buffers, config.segment_size)
    partition = PipelinedResultPartition.create(network, 3, config)
    writer = RecordWriter(partition, RoundRobinSelector(3, -1), SEGMENT)
    readers = [RecordReader(SCHEMA, sp) for sp in range(3)]
    got: list[list[object]] = [[], [], []]

    def poll(sp: int) -> None:
        while (polled := partition.subpartitions[sp].poll_buffer()) is not None:
            got[sp].extend(readers[sp].feed(polled.buffer, polled.sequence_number))

    for start in range(0, 3000, 500):
        writer.emit(rows(list(range(start, start + 500)), text_len=12))
        writer.broadcast_emit(rows([-start]))
        poll(start // 500 % 3)  # one channel at a time keeps up
    writer.broadcast_event(CheckpointBarrier(1, 5))
    writer.finish()
    for sp in range(3):
        poll(sp)  # up to the aligned barrier, which blocks the subpartition until it is resumed
        assert got[sp][-1] == CheckpointBarrier(1, 5) and partition.subpartitions[sp].is_blocked
        partition.subpartitions[sp].resume_consumption()
        poll(sp)
        assert got[sp][-2:] == [CheckpointBarrier(1, 5), EndOfPartition()]
        expected = []
        for start in range(0, 3000, 500):
            expected += [i for i in range(start, start + 500) if i % 3 == sp] + [-start]
        assert ids_read(got[sp]) == expected
    assert partition.buffer_pool.num_requested == partition.buffer_pool.num_available_segments  # all returned


class _LockedPartition:
    """A MemoryPartition whose calls take one lock, as a task serialises its partition."""

    def __init__(self, partition: MemoryPartition, lock) -> None:
        self.partition = partition
        self.lock = lock
        self.num_subpartitions = partition.num_subpartitions

    def __getattr__(self, name):
        method = getattr(self.partition, name)

        def locked(*args, **kwargs):
            with self.lock:
                return method(*args, **kwargs)

        return locked


def test_a_reader_thread_polls_while_the_writer_thread_appends():
    """Builders are shared with the polling thread: slices built while rows are appended lose nothing,
    and every segment returns (its recycler runs outside the builder's lock)."""
    import threading
    import time

    lock = threading.RLock()
    partition = MemoryPartition(3)
    locked = _LockedPartition(partition, lock)
    writer = RecordWriter(locked, RoundRobinSelector(3, -1), SEGMENT)
    readers = [RecordReader(SCHEMA, sp) for sp in range(3)]
    got: list[list[int]] = [[], [], []]
    done = threading.Event()
    errors = []

    def poll() -> None:
        try:
            while True:
                finished = done.is_set()
                idle = True
                for sp in range(3):
                    while True:
                        with lock:
                            polled = partition.poll(sp)
                        if polled is None:
                            break
                        idle = False
                        got[sp].extend(ids_read(readers[sp].feed(*polled)))
                if finished:
                    return
                if idle:
                    time.sleep(0.0002)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=poll)
    thread.start()
    for start in range(0, 12_000, 250):
        writer.emit(rows(list(range(start, start + 250)), text_len=10))
        if start % 1000 == 0:
            writer.flush_all()
    writer.finish()
    done.set()
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors
    for sp in range(3):
        assert got[sp] == list(range(sp, 12_000, 3))
    assert partition.segments_in_use == 0
