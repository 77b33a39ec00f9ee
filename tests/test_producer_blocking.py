"""A producer blocks when its LocalBufferPool is exhausted (Flink's ``requestBufferBuilderBlocking``), sans IO.

The resumable RecordWriter stops at the first new buffer its pipelined partition cannot give and writes on
from there once buffers come back; it never holds more than the pool size plus the overdraft, nor more than
the executor's network buffers.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from buffer_helpers import rows_of

from spark_credit_shuffle.buffers import KeepAlive, LatencyMarker, RecordReader, RecordWriter, encode_event
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.partitioners import ConstantSelector, RoundRobinSelector
from spark_credit_shuffle.protocol import NetworkBufferPool, PipelinedResultPartition

SEGMENT = 4096
SCHEMA = pa.schema([("id", pa.int64()), ("text", pa.string())])


def rows(start: int, n: int, text_len: int) -> pa.RecordBatch:
    return pa.record_batch(
        {"id": pa.array(range(start, start + n), pa.int64()), "text": pa.array(["x" * text_len] * n)}, schema=SCHEMA
    )


class Listener:
    def __init__(self) -> None:
        self.notified = 0

    def notify_data_available(self) -> None:
        self.notified += 1

    def notify_priority_event(self, sequence_number: int) -> None:
        self.notified += 1


def pipelined(channels: int, total: int = 1024, **settings) -> tuple[PipelinedResultPartition, NetworkBufferPool]:
    config = NetworkConfig(segment_size=SEGMENT, **settings)
    network = NetworkBufferPool(total, SEGMENT)
    return PipelinedResultPartition.create(network, channels, config), network


class Consumers:
    """One view and one RecordReader per subpartition; ``drain`` reads what is consumable and recycles it."""

    def __init__(self, partition: PipelinedResultPartition) -> None:
        n = partition.num_subpartitions
        self.listeners = [Listener() for _ in range(n)]
        self.views = [partition.create_subpartition_view(sp, self.listeners[sp]) for sp in range(n)]
        self.readers = [RecordReader(SCHEMA, channel=sp) for sp in range(n)]
        self.items: list[list] = [[] for _ in range(n)]

    def drain(self) -> int:
        """Poll as a reader does: after a notification, and on while the last poll said more is available."""
        polled = 0
        for sp, view in enumerate(self.views):
            listener = self.listeners[sp]
            while listener.notified:
                listener.notified = 0
                while (nxt := view.get_next_buffer()) is not None:
                    polled += 1
                    self.items[sp].extend(self.readers[sp].feed(nxt.buffer, nxt.sequence_number))
                    if not nxt.is_data_available:
                        break
        return polled

    def ids(self, sp: int) -> list[int]:
        batches = [b for b in self.items[sp] if isinstance(b, pa.RecordBatch)]
        return rows_of(batches, SCHEMA).column("id").to_pylist() if batches else []


def test_producer_with_nothing_consumed_holds_at_most_pool_size_plus_overdraft():
    # given a pipelined partition of 2 subpartitions (pool size 2 * 2 + 8 = 12, overdraft 5) and a resumable
    # writer, and 40 rows of 3000 bytes (one buffer each)
    partition, _ = pipelined(2, max_overdraft_buffers_per_gate=5)
    pool = partition.buffer_pool
    assert pool.current_pool_size == 12
    writer = RecordWriter(partition, RoundRobinSelector(2, -1), SEGMENT, resumable=True)
    # when they are written one batch of one row at a time while nothing is consumed
    stopped_at = None
    for i in range(40):
        if not writer.emit(rows(i, 1, 3000)):
            stopped_at = i
            break
        assert pool.num_used <= 12
    # then the writer stopped at a buffer it could not get, holding no more than the pool size
    assert stopped_at is not None and writer.has_pending_write
    assert pool.num_used <= 12 + 5
    assert not writer.resume()  # nothing came back: it still waits


def test_one_large_batch_never_borrows_beyond_the_executors_network_buffers():
    # given an executor with 20 network buffers, a partition of 4 subpartitions on it and a resumable writer
    partition, network = pipelined(4, total=20)
    pool = partition.buffer_pool
    writer = RecordWriter(partition, RoundRobinSelector(4, -1), SEGMENT, resumable=True)
    consumers = Consumers(partition)
    # when one 400-row batch of 1000-byte rows (about 100 buffers) is written, consuming only while it waits
    done = writer.emit(rows(0, 400, 1000))
    peak = pool.num_used
    rounds = 0
    while not done:
        assert network.num_available >= 0
        assert pool.num_used <= pool.current_pool_size + pool.max_overdraft_buffers
        consumers.drain()
        done = writer.resume()
        peak = max(peak, pool.num_used)
        rounds += 1
    writer.finish()
    consumers.drain()
    # then it waited several times, never held more than the network has, and every row arrived once, in order
    assert rounds > 1 and peak <= network.total
    assert [consumers.ids(sp) for sp in range(4)] == [list(range(sp, 400, 4)) for sp in range(4)]


def test_a_spanning_row_finishes_in_the_overdraft_and_the_next_row_waits():
    # given a one-subpartition partition whose pool (size 2) is full of finished buffers nobody consumed
    partition, _ = pipelined(1, max_overdraft_buffers_per_gate=3, buffers_per_channel=1, floating_buffers_per_gate=1)
    pool = partition.buffer_pool
    assert pool.current_pool_size == 2
    writer = RecordWriter(partition, ConstantSelector(1, 0), SEGMENT, resumable=True)
    consumers = Consumers(partition)
    assert writer.emit(rows(0, 1, 3000))  # one buffer; the pool still has one free
    # when a row of 10,000 bytes (three fragments) starts in the last free buffer
    assert writer.emit(rows(1, 1, 10_000))
    # then it is finished in the overdraft, within size + overdraft, and the pool is unavailable
    assert 2 < pool.num_used <= 2 + 3 and not partition.is_available()
    # and the next row waits until buffers come back
    assert not writer.emit(rows(2, 1, 3000))
    consumers.drain()
    assert writer.resume()
    writer.finish()
    consumers.drain()
    assert consumers.ids(0) == [0, 1, 2]


def test_one_buffer_per_channel_does_not_stop_the_writer_on_its_own_open_buffer():
    # given max_buffers_per_channel = 1: the only buffer a subpartition may hold is the one being written
    partition, _ = pipelined(2, max_buffers_per_channel=1)
    writer = RecordWriter(partition, RoundRobinSelector(2, -1), SEGMENT, resumable=True)
    # when a few small rows go into both subpartitions' open buffers
    assert writer.emit(rows(0, 10, 10))
    # then the partition stays available: the open buffers do not count against the limit ...
    assert partition.is_available()
    # ... but a finished buffer not yet consumed does: the writer stops at the next new buffer
    assert not writer.emit(rows(10, 100, 100))
    assert not partition.is_available() and writer.has_pending_write


def test_latency_marker_is_a_record_that_finishes_no_buffer():
    # given a partition with buffer timeout -1 semantics (no flusher) and a partly filled buffer
    partition, _ = pipelined(1)
    writer = RecordWriter(partition, ConstantSelector(1, 0), SEGMENT, resumable=True)
    consumers = Consumers(partition)
    writer.emit(rows(0, 5, 10))
    consumers.drain()  # only the schema event
    # when a latency marker and a keep-alive are written
    assert writer.emit_latency_marker(LatencyMarker(123, 0), 0)
    partition.add_event(0, encode_event(KeepAlive()))
    consumers.drain()
    # then the consumer got the keep-alive, but neither the rows nor the marker: the buffer is not finished
    assert consumers.ids(0) == []
    assert [type(i).__name__ for i in consumers.items[0]] == ["KeepAlive"]
    # and once the buffer is finished, the marker arrives behind the rows written before it
    writer.emit(rows(5, 1, 10))
    writer.finish()
    consumers.drain()
    kinds = [type(i).__name__ for i in consumers.items[0]]
    assert kinds[1:] == ["RecordBatch", "LatencyMarker", "RecordBatch", "EndOfPartition"]
    assert consumers.ids(0) == list(range(6))
    assert LatencyMarker(123, 0) in consumers.items[0]


@pytest.mark.parametrize("resumable", [False, True])
def test_an_event_while_a_batch_is_half_written_is_refused(resumable):
    # given a resumable writer stopped in a batch
    partition, _ = pipelined(1, buffers_per_channel=1, floating_buffers_per_gate=1)
    writer = RecordWriter(partition, ConstantSelector(1, 0), SEGMENT, resumable=resumable)
    done = writer.emit(rows(0, 50, 1000))
    if resumable:
        # when an event or the end comes, then it is refused: the rest of the batch goes first
        assert not done
        with pytest.raises(RuntimeError, match="resume"):
            writer.finish()
    else:
        assert done  # a writer that is not resumable takes what it needs (the blocking runtime's)
