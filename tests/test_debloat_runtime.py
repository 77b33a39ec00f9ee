"""Buffer debloating live (FLIP-183): consumers measure their throughput, announce the buffer size that holds
``buffer_debloat_target_ms`` of in-flight data, and their producers cut new buffers at it; in the pipelined
runtime and in the simulation, off by default as in Flink."""

from __future__ import annotations

import statistics

import pyarrow as pa
import pytest
from exchange_helpers import expected_placement, inputs, make_plan, table

import spark_credit_shuffle as scs
from spark_credit_shuffle.buffers import DataType, RecordReader, RecordWriter
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.metrics import CONSUMER
from spark_credit_shuffle.partitioners import RoundRobinSelector
from spark_credit_shuffle.protocol import NetworkBufferPool, PipelinedResultPartition
from spark_credit_shuffle.runtime.exchange_plan import Injection
from spark_credit_shuffle.runtime.pipelined import run_in_threads
from spark_credit_shuffle.simulation import simulate


class Listener:
    def notify_data_available(self) -> None: ...

    def notify_priority_event(self, sequence_number: int) -> None: ...


def test_settings_are_flinks_and_off_by_default():
    config = NetworkConfig()
    assert not config.buffer_debloat_enabled
    assert (config.buffer_debloat_target_ms, config.buffer_debloat_period_ms) == (1000, 200)
    assert (config.buffer_debloat_samples, config.buffer_debloat_threshold_percentages) == (20, 25)
    flink = {n: f.metadata["flink"] for n, f in NetworkConfig.settings().items()}
    assert flink["buffer_debloat_enabled"] == "taskmanager.network.memory.buffer-debloat.enabled"
    with pytest.raises(scs.ConfigError, match="buffer_debloat_threshold_percentages"):
        NetworkConfig(buffer_debloat_threshold_percentages=120)


def _writer_with_buffer_size(size: int):
    """(the view of the one subpartition, a RecordWriter, the rows' schema) of a partition of 32 KiB segments
    whose consumer announced ``size``-byte buffers (NewBufferSize)."""
    config = NetworkConfig(segment_size=32768)
    network = NetworkBufferPool(1024, config.segment_size)
    partition = PipelinedResultPartition.create(network, 1, config)
    view = partition.create_subpartition_view(0, Listener())
    partition.subpartitions[0].set_buffer_size(size)
    writer = RecordWriter(partition, RoundRobinSelector(1, -1), config.segment_size)
    return view, writer, pa.schema([("id", pa.int64()), ("s", pa.string())])


def _read_all(view, schema: pa.Schema) -> tuple[list[int], list[pa.RecordBatch]]:
    """(the sizes of the data buffers in the view, in order; the batches they decode to)."""
    reader = RecordReader(schema)
    sizes, got = [], []
    while (nxt := view.get_next_buffer()) is not None:
        if nxt.buffer.data_type is DataType.DATA_BUFFER:
            sizes.append(nxt.buffer.size)
        got += [b for b in reader.feed(nxt.buffer, nxt.sequence_number) if isinstance(b, pa.RecordBatch)]
    return sizes, got


def test_the_writer_cuts_new_buffers_at_the_size_the_consumer_announced():
    # given a subpartition whose consumer asked for 1 KiB buffers (NewBufferSize)
    view, writer, schema = _writer_with_buffer_size(1024)
    ids = list(range(3000))
    strings = ["x" * (5000 if i == 1500 else 8) for i in ids]  # one row larger than 1 KiB
    writer.emit(pa.record_batch({"id": ids, "s": strings}, schema=schema))
    writer.finish()
    sizes, got = _read_all(view, schema)
    # then the buffers are about 1 KiB (the first may still be a full one: the size applies from the next
    # buffer on), the large row's buffer grew to hold it, and every row arrived in order
    assert sum(1 for s in sizes if s <= 1024) >= len(sizes) - 3
    assert max(sizes) >= 5000
    assert pa.Table.from_batches(got).column("id").to_pylist() == ids


def test_a_slow_consumer_announces_smaller_buffers_in_the_pipelined_runtime():
    plan = make_plan(
        scs.key_by("k"),
        2,
        2,
        injection=Injection(consumer_delay_s=((0, 1e-4),)),
        buffer_debloat_enabled=True,
        buffer_debloat_period_ms=20,
        buffer_debloat_target_ms=50,
        metrics_sample_interval_ms=10,
    )
    data = inputs(2, 3000)
    received, rows = run_in_threads(plan, data)
    for c, want in enumerate(expected_placement(plan, data)):
        assert table(received[c]).sort_by("id").equals(want)
    sizes = [r.value for r in rows if r.metric == "debloatedBufferSize" and r.side == CONSUMER and r.subtask == 0]
    assert sizes and min(sizes) < plan.config.segment_size  # it asked for smaller buffers than a segment
    assert any(r.metric == "estimatedTimeToConsumeBuffersMs" for r in rows)


def _slow_consumer(target_ms: int | None, duration: float):
    config = NetworkConfig(
        checkpoint_interval_ms=100,
        buffer_debloat_enabled=target_ms is not None,
        buffer_debloat_target_ms=target_ms or 1000,
    )
    rate = 500_000.0
    return simulate(
        config,
        num_producers=4,
        num_consumers=4,
        producer_rate=[4 * rate, 6 * rate, 8 * rate, 10 * rate],
        consumer_rate=[rate] + [16 * rate] * 3,
        duration=duration,
        producer_hosts=[0, 1, 2, 3],
        consumer_hosts=[4, 4, 5, 5],
        sample_interval=duration / 2,
    )


def test_debloating_bounds_the_start_delay_of_a_slow_consumers_checkpoints_in_the_simulation():
    # the checkpoint demo's slow consumer: 10 buffers of 32 KiB per subpartition ahead of each barrier, drained
    # at 0.5 MB/s, delay an aligned checkpoint's start by seconds; with debloating to 100 ms far less, and the
    # fast consumers (bound to the slow one's pace by round robin) keep their throughput
    off = _slow_consumer(None, 20.0)
    on = _slow_consumer(100, 20.0)

    def median_delay_ms(report) -> float:  # once the buffer size settled: the checkpoints of the second half
        late = [c.start_delay_ms for c in report.checkpoint_records(0) if c.end_ms > 10e3]
        return statistics.median(late)

    def fast_throughput(report) -> float:  # bytes per virtual second of the second half (steady state)
        at_half = {c: report.value_at("consumer", c, "numBytesIn", 10.0) for c in (1, 2, 3)}
        return statistics.fmean((report.value("consumer", c, "numBytesIn") - at_half[c]) / 10.0 for c in (1, 2, 3))

    assert median_delay_ms(off) > 1000
    assert median_delay_ms(on) < 1.5 * 100  # within 1.5x of the target
    assert fast_throughput(on) >= 0.95 * fast_throughput(off)


def test_a_debloated_buffer_grows_to_a_record_it_cannot_hold_and_no_further():
    # given a subpartition whose consumer asked for 512-byte buffers, and rows of about 2 KB each
    view, writer, schema = _writer_with_buffer_size(512)
    writer.emit(pa.record_batch({"id": [0], "s": ["x"]}, schema=schema))  # the first buffer learns the size
    writer.flush_all()
    ids = list(range(1, 41))
    writer.emit(pa.record_batch({"id": ids, "s": ["y" * 2000] * len(ids)}, schema=schema))
    writer.finish()
    sizes, got = _read_all(view, schema)
    # then after the first buffer (opened before the size was known) each row gets a buffer of its own size
    # (Flink trims a new buffer to the larger of the record and the desired size), not a segment that the
    # rows behind it would fill, and every row arrived in order
    assert len(sizes) > 10 and max(sizes[1:]) < 2000 + 1024, sizes
    assert pa.Table.from_batches(got).column("id").to_pylist() == [0, *ids]
