"""What the simulation at hundreds of tasks relies on beyond its exact results (tests/test_simulation_exact.py):
a gate's exclusive buffers taken in one request leave the network buffer pool and every channel as the
per-channel requests do (and a request that does not fit fails as they do); a builder's rows kept as
``(batch, offset, length)`` serialise to the bytes their slices do; a schema event decoded once per payload still
checks each channel's schema; the RecordWriter's modules keep its names; a large run with the garbage collector
paused gives the figures of one without it. No wall-clock time is asserted."""

from __future__ import annotations

import gc

import pyarrow as pa
import pytest

from spark_credit_shuffle.buffers.buffer import Buffer, DataType
from spark_credit_shuffle.buffers.builder import BufferBuilder
from spark_credit_shuffle.buffers.format import SchemaEvent, encode_event
from spark_credit_shuffle.buffers.pools import NetworkBufferPool
from spark_credit_shuffle.buffers.reader import RecordReader
from spark_credit_shuffle.buffers.size_model import IpcSizeModel
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import BufferDecodeError, InsufficientNetworkBuffersError
from spark_credit_shuffle.protocol import CreditBasedPartitionRequestClientHandler, SingleInputGate
from spark_credit_shuffle.simulation import model, simulate

SCHEMA = pa.schema([("seq", pa.int64()), ("payload", pa.binary())])


def _gate(network: NetworkBufferPool, channels: int, *, batched: bool) -> SingleInputGate:
    config = NetworkConfig()
    gate = SingleInputGate(network, channels, config)
    client = CreditBasedPartitionRequestClientHandler()
    for index in range(channels):
        gate.remote_channel(index, index + 1, client)
    if not batched:  # every channel requests its own exclusive buffers first, as Flink's channels do
        for channel in gate.channels:
            channel.setup()
    gate.setup()
    return gate


def _pool_state(network: NetworkBufferPool) -> tuple:
    pools = tuple((p.num_buffers, p.num_requested, p.num_available_segments) for p in network.buffer_pools)
    return network.num_available, network.num_unpooled, network.num_total_required_buffers, pools


@pytest.mark.parametrize("channels", [1, 2, 7, 40])
def test_a_gates_exclusive_buffers_in_one_request_leave_what_per_channel_requests_leave(channels):
    one, each = NetworkBufferPool(400, 32 * 1024), NetworkBufferPool(400, 32 * 1024)
    for network in (one, each):  # another pool already there, resized by every redistribution
        network.create_buffer_pool(4, 64)
    batched, alone = _gate(one, channels, batched=True), _gate(each, channels, batched=False)
    assert _pool_state(one) == _pool_state(each)
    assert [c.buffer_manager.num_exclusive for c in batched.channels] == [2] * channels
    assert [c.buffer_manager.num_exclusive for c in alone.channels] == [2] * channels
    assert batched.buffer_tally.exclusive == alone.buffer_tally.exclusive == 2 * channels


def test_exclusive_buffers_that_do_not_fit_fail_as_the_per_channel_requests_do():
    network = NetworkBufferPool(10, 32 * 1024)  # 1 floating + 2 exclusive each: the fifth channel does not fit
    with pytest.raises(InsufficientNetworkBuffersError):
        _gate(network, 5, batched=True)
    assert network.num_unpooled == 8  # the channels before the one that did not fit took theirs, as before


def test_rows_kept_as_runs_serialise_as_their_slices():
    batch = pa.RecordBatch.from_arrays([pa.array(range(10), pa.int64()), pa.array([b"ab"] * 10)], schema=SCHEMA)
    model = IpcSizeModel(SCHEMA, 32 * 1024)
    runs, slices = BufferBuilder(32 * 1024, model), BufferBuilder(32 * 1024, model)
    for offset, length in ((0, 3), (5, 2), (9, 1)):
        assert runs.append_if_fits(batch, offset, length, 8, 64, 1)
        slices.append(batch.slice(offset, length), 8, 64)
    assert runs.finish() == slices.finish()
    assert runs.create_buffer_consumer().build().data == slices.create_buffer_consumer().build().data


def test_a_schema_event_decoded_once_still_checks_every_channels_schema():
    payload = encode_event(SchemaEvent(SCHEMA)).data
    assert isinstance(payload, bytes)
    for channel in range(3):  # the same payload on every channel: decoded once, each reader set up
        reader = RecordReader(SCHEMA, channel=channel)
        assert reader.feed(Buffer(DataType.EVENT_BUFFER, payload), 0) == []
        assert reader.schema is SCHEMA
    other = RecordReader(pa.schema([("seq", pa.int32())]), channel=9)
    with pytest.raises(BufferDecodeError, match="differs from the expected schema"):
        other.feed(Buffer(DataType.EVENT_BUFFER, payload), 0)


def test_the_record_writers_modules_keep_its_names():
    from spark_credit_shuffle.buffers import RecordWriter as exported
    from spark_credit_shuffle.buffers.writer import FLUSH_ALWAYS_ROWS, RecordWriter, ResultPartitionWriter
    from spark_credit_shuffle.buffers.writer_cutting import BufferCutting
    from spark_credit_shuffle.buffers.writer_events import WriterEvents

    assert (
        exported is RecordWriter and issubclass(RecordWriter, WriterEvents) and issubclass(WriterEvents, BufferCutting)
    )
    assert ResultPartitionWriter.__name__ == "ResultPartitionWriter" and FLUSH_ALWAYS_ROWS == 64


def _large_run() -> tuple:
    """A run of 64 x 64 channels (the size from which a run freezes its topology and pauses the collector)."""
    hosts = [i // 8 for i in range(64)]
    report = simulate(
        num_producers=64,
        num_consumers=64,
        producer_rate=20e6,
        consumer_rate=40e6,
        producer_hosts=hosts,
        consumer_hosts=hosts,
        latency=100e-6,
        bytes_per_producer=140_000,  # about two records per channel, all delivered
        extra_buffers_per_host=256,
    )
    return report.steps, report.messages, report.data_intact, report.rows, report.timeline


def test_a_large_run_with_the_collector_paused_gives_the_figures_of_one_without(monkeypatch):
    """The collector paused while a large topology is built and run, and what the run kept handed to the oldest
    generation after it: the same figures and rows as with the collector running throughout, and the collector
    as it was (enabled, its thresholds, nothing left frozen), also after a build that failed."""
    before = (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count())
    paused = _large_run()
    assert (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()) == before
    with pytest.raises(InsufficientNetworkBuffersError):  # building fails: the collector is enabled again
        simulate(num_producers=64, num_consumers=64, producer_rate=1e6, consumer_rate=1e6, duration=0.01)
    assert (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()) == before
    monkeypatch.setattr(model, "_FREEZE_FROM_CHANNELS", 10**9)  # this size as a small one: nothing paused
    running = _large_run()
    assert paused[:3] == running[:3] and paused[2] is True
    assert paused[3] == running[3] and paused[4] == running[4]
