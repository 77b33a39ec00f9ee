"""The sans-IO core enforces Flink's memory bounds itself: no call hands out a segment beyond a
LocalBufferPool's size plus its overdraft, nor beyond the NetworkBufferPool's total. A caller that writes
while no buffer can be had gets what Flink's non-blocking request gives: nothing written, a resumable
remainder, or a typed error (``NoBufferAvailableError``); never new memory."""

from __future__ import annotations

import contextlib

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark_credit_shuffle.buffers import CheckpointBarrier, DataType, RecordReader, RecordWriter
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import NoBufferAvailableError
from spark_credit_shuffle.partitioners import RoundRobinSelector
from spark_credit_shuffle.protocol import NetworkBufferPool, PipelinedResultPartition

SCHEMA = pa.schema([("id", pa.int64()), ("text", pa.string())])


class Listener:
    def __init__(self) -> None:
        self.notified = 0

    def notify_data_available(self) -> None:
        self.notified += 1

    def notify_priority_event(self, sequence_number: int) -> None:
        self.notified += 1


def rows(start: int, n: int, text_len: int) -> pa.RecordBatch:
    return pa.record_batch(
        {"id": pa.array(range(start, start + n), pa.int64()), "text": pa.array(["x" * text_len] * n)}, schema=SCHEMA
    )


def within_bounds(partitions: list[PipelinedResultPartition], network: NetworkBufferPool) -> None:
    for partition in partitions:
        pool = partition.buffer_pool
        assert pool.num_requested <= pool.current_pool_size + pool.max_overdraft_buffers
    assert sum(p.buffer_pool.num_requested for p in partitions) <= network.total
    assert 0 <= network.num_available <= network.total


def drain_bytes(views: list, received: list[bytearray]) -> None:
    for sp, view in enumerate(views):
        while (nxt := view.get_next_buffer()) is not None:
            if nxt.buffer.data_type is DataType.DATA_BUFFER:
                received[sp] += bytes(nxt.buffer.data)
            nxt.buffer.recycle()


def test_emit_record_without_consumption_stops_within_network_memory_and_resumes():
    # given 20 network buffers of 32 KiB and a pipelined partition of 2 subpartitions (size 12, overdraft 20)
    config = NetworkConfig()
    network = NetworkBufferPool(20, config.segment_size)
    partition = PipelinedResultPartition.create(network, 2, config)
    records = [bytes([i]) * config.segment_size for i in range(40)]
    # when 40 records of one segment each are emitted while nothing is consumed
    written = 0
    for record in records:
        if not partition.emit_record(record, written % 2):
            break
        written += 1
        within_bounds([partition], network)
    # then the partition stopped within its pool, far from 40 segments, and keeps the record it could not write
    assert written < 40 and partition.buffer_pool.num_used <= 12
    assert partition.has_pending_record(written % 2)
    assert not partition.resume_record(written % 2)  # nothing came back: still nothing to write it into
    views = [partition.create_subpartition_view(sp, Listener()) for sp in range(2)]
    received = [bytearray(), bytearray()]
    # and once the consumers read, every record goes out exactly once, in order
    sp = written % 2
    while True:
        drain_bytes(views, received)
        if partition.resume_record(sp):
            written += 1
            if written == len(records):
                break
            sp = written % 2
            if partition.emit_record(records[written], sp):
                continue
        within_bounds([partition], network)
    partition.finish()
    drain_bytes(views, received)
    assert [bytes(r) for r in received] == [b"".join(records[sp::2]) for sp in range(2)]


def test_a_record_larger_than_size_plus_overdraft_is_a_resumable_remainder():
    # given a pool of size 2 and overdraft 1 on 10 network buffers of 4 KiB
    config = NetworkConfig(
        segment_size=4096, buffers_per_channel=1, floating_buffers_per_gate=1, max_overdraft_buffers_per_gate=1
    )
    network = NetworkBufferPool(10, 4096)
    partition = PipelinedResultPartition.create(network, 1, config)
    view = partition.create_subpartition_view(0, Listener())
    record = bytes(range(256)) * 64  # 16 KiB: four segments, more than size + overdraft
    # when it is emitted with nothing consumed, it stops at three segments and keeps the rest
    assert not partition.emit_record(record, 0)
    assert partition.buffer_pool.num_used == 3
    received = [bytearray()]
    while not partition.resume_record(0):
        drain_bytes([view], received)
    partition.finish()
    drain_bytes([view], received)
    # then the record arrived whole, once
    assert bytes(received[0]) == record


def test_one_large_batch_through_a_writer_that_cannot_wait_raises_and_keeps_its_place():
    # given a partition of 2 subpartitions of 4 KiB segments (size 12, overdraft 20) and a writer that does not
    # stop for backpressure (resumable=False)
    config = NetworkConfig(segment_size=4096)
    network = NetworkBufferPool(1024, 4096)
    partition = PipelinedResultPartition.create(network, 2, config)
    pool = partition.buffer_pool
    assert pool.current_pool_size == 12 and pool.max_overdraft_buffers == 20
    writer = RecordWriter(partition, RoundRobinSelector(2, -1), 4096)
    # when one 400-row batch of about 170 KB (some 50 segments) is emitted while nothing is consumed
    with pytest.raises(NoBufferAvailableError, match=r"size 12 \+ overdraft 20"):
        writer.emit(rows(0, 400, 400))
    # then it holds no more than size + overdraft, and writes on from where it stopped once buffers come back
    assert pool.num_used <= 12 + 20 and writer.has_pending_write
    views = [partition.create_subpartition_view(sp, Listener()) for sp in range(2)]
    readers = [RecordReader(SCHEMA, channel=sp) for sp in range(2)]
    got: list[list[int]] = [[], []]

    def drain() -> None:
        for sp, v in enumerate(views):
            while (nxt := v.get_next_buffer()) is not None:
                for item in readers[sp].feed(nxt.buffer, nxt.sequence_number):
                    if isinstance(item, pa.RecordBatch):
                        got[sp].extend(item.column("id").to_pylist())

    done = False
    while not done:
        drain()
        with contextlib.suppress(NoBufferAvailableError):  # not all of it fits yet: read more first
            done = writer.resume()
        assert pool.num_used <= 12 + 20
    writer.finish()
    drain()
    assert got == [list(range(0, 400, 2)), list(range(1, 400, 2))]


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.integers(0, 2), st.integers(1, 20_000)),
        st.tuples(st.just("rows"), st.integers(1, 60), st.sampled_from([10, 500, 3000, 9000])),
        st.tuples(st.just("resume"), st.just(0), st.just(0)),
        st.tuples(st.just("flush"), st.just(0), st.just(0)),
        st.tuples(st.just("barrier"), st.just(0), st.just(0)),
        st.tuples(st.just("consume"), st.just(0), st.just(0)),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=_OPS,
    total=st.integers(8, 40),
    overdraft=st.integers(0, 6),
    resumable=st.booleans(),
)
def test_no_sequence_of_requests_and_writes_exceeds_the_pool_or_network_memory(ops, total, overdraft, resumable):
    """Any sequence of raw records, Arrow batches (rows smaller and larger than a segment), resumes, flushes
    and barriers: after every step each pool holds at most its size + overdraft and the executor no more than
    its network buffers; consumed at the end, every row and byte arrived once, in order."""
    config = NetworkConfig(segment_size=4096, max_overdraft_buffers_per_gate=overdraft)
    network = NetworkBufferPool(total, 4096)
    raw = PipelinedResultPartition.create(network, 3, config, partition_id=0)
    arrow = PipelinedResultPartition.create(network, 2, config, partition_id=1)
    writer = RecordWriter(arrow, RoundRobinSelector(2, -1), 4096, resumable=resumable)
    raw_views = [raw.create_subpartition_view(sp, Listener()) for sp in range(3)]
    arrow_views = [arrow.create_subpartition_view(sp, Listener()) for sp in range(2)]
    readers = [RecordReader(SCHEMA, channel=sp) for sp in range(2)]
    sent_raw: list[bytearray] = [bytearray() for _ in range(3)]
    got_raw: list[bytearray] = [bytearray() for _ in range(3)]
    got_ids: list[list[int]] = [[], []]
    next_id = 0
    counter = 0

    def consume() -> None:
        drain_bytes(raw_views, got_raw)
        for sp, view in enumerate(arrow_views):
            while (nxt := view.get_next_buffer()) is not None:
                blocking = nxt.buffer.data_type.is_blocking_upstream
                for item in readers[sp].feed(nxt.buffer, nxt.sequence_number):
                    if isinstance(item, pa.RecordBatch):
                        got_ids[sp].extend(item.column("id").to_pylist())
                if blocking:  # an aligned barrier blocked the subpartition: the checkpoint is done here
                    view.resume_consumption()

    def write_on() -> bool:
        try:
            done = writer.resume()
        except NoBufferAvailableError:
            return False
        return all(raw.resume_record(sp) for sp in range(3)) and done

    for op, a, b in ops:
        if op == "record" and not raw.has_pending_record(a):
            counter += 1
            record = bytes([counter % 256]) * b
            sent_raw[a] += record
            raw.emit_record(record, a)
        elif op == "rows" and not writer.has_pending_write:
            batch = rows(next_id, a, b)
            next_id += a
            try:
                writer.emit(batch)
            except NoBufferAvailableError:
                assert not resumable  # a resumable writer stops instead
        elif op == "resume":
            write_on()
        elif op == "flush":
            writer.flush_all()
            raw.flush_all()
        elif op == "barrier":
            writer.broadcast_event(CheckpointBarrier(counter, 0))
        elif op == "consume":
            consume()
        within_bounds([raw, arrow], network)
    for _ in range(10_000):
        consume()
        if write_on():
            break
        within_bounds([raw, arrow], network)
    else:
        pytest.fail("the writers never finished with everything consumed")
    writer.finish()
    raw.finish()
    consume()
    assert [bytes(g) for g in got_raw] == [bytes(s) for s in sent_raw]
    assert sorted(got_ids[0] + got_ids[1]) == list(range(next_id))  # each row once
    assert all(ids == sorted(ids) for ids in got_ids)  # in order on each channel
