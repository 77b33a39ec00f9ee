"""The task engine on a virtual clock, and the same engine under the pipelined runtime (threads, real TCP).

The engine (``engine/``) reads no clock: every rule takes ``now``. Here a small event loop drives a
producer half and two consumer halves on virtual time, with a slow consumer and a buffer timeout, and the
buffer cuts it makes are compared with the cuts the pipelined runtime makes for the same input.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pytest

import spark_credit_shuffle as scs
from spark_credit_shuffle.buffers.reader import RecordReader
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.engine import (
    ConsumerEngine,
    Fail,
    LingerOver,
    ProducerEngine,
    Settings,
    Wait,
)
from spark_credit_shuffle.errors import ExchangeTimeoutError
from spark_credit_shuffle.exchange import ExchangePlan, Injection
from spark_credit_shuffle.protocol import NetworkBufferPool, PipelinedResultPartition, SingleInputGate
from spark_credit_shuffle.runtime.pipelined import TaskOptions, run_in_threads

pytestmark = pytest.mark.timeout(120)

SCHEMA = pa.schema([("id", pa.int64()), ("k", pa.int32()), ("s", pa.string())])
#: 4 KiB buffers, a flush every 50 ms, a long silence timeout (keep-alives every 2.5 s are events only).
SETTINGS = {"segment_size": 4096, "buffer_timeout_ms": 50, "partition_request_timeout_ms": 10_000}
GROUPS = 4
GROUP_ROWS = 1000
GAP_S = 0.5  # between two input batches: longer than a flush period plus the slow consumer's work on a batch
DELAY_S = 2e-4  # the slow consumer: 0.2 ms per row, about 0.1 s per batch of one consumer's ~500 rows


def make_plan(injection: Injection | None = None) -> ExchangePlan:
    config = NetworkConfig(**SETTINGS)
    return ExchangePlan("engine-cuts", "pipelined", scs.key_by("k"), 1, 2, 128, config, SCHEMA, injection)


def groups() -> list[pa.RecordBatch]:
    """GROUPS input batches of GROUP_ROWS rows, keys 0..40: each consumer gets several segments' worth."""
    rng = np.random.default_rng(3)
    out = []
    for g in range(GROUPS):
        ids = np.arange(g * GROUP_ROWS, (g + 1) * GROUP_ROWS, dtype=np.int64)
        keys = rng.integers(0, 41, GROUP_ROWS).astype(np.int32)
        words = pa.array([f"v{i:012d}" for i in ids], pa.string())
        out.append(pa.RecordBatch.from_arrays([pa.array(ids), pa.array(keys), words], schema=SCHEMA))
    return out


def virtual_cuts(plan: ExchangePlan) -> tuple[list[list[int]], ProducerEngine]:
    """Rows per buffer each consumer received, the engine driven on a virtual clock: input batch ``g`` at
    ``g * GAP_S``, the producer's timer when it asks, each consumer taking its next buffer once it has spent
    ``DELAY_S`` per row of the previous one."""
    config = plan.config
    settings = Settings.of(config, output_batch_rows=0)
    network = NetworkBufferPool.from_config(config)
    partition = PipelinedResultPartition.create(network, 2, config, partition_id=0, bounded=True)
    selector = plan.partitioner.selector(0, 1, 2, plan.max_parallelism)
    producer = ProducerEngine(
        0, partition, selector, [0, 1], settings, config.segment_size, SCHEMA, 0.0, resumable=True
    )
    consumers = []
    for c in range(2):
        gate = SingleInputGate(network, 1, config, num_remote_channels=0)
        gate.local_channel(0, partition, partition_id=0, subpartition=c)
        gate.setup()
        gate.request_partitions()
        consumer = ConsumerEngine(c, gate, [RecordReader(SCHEMA, channel=0)], [0], settings, 0.0)
        consumer.start(0.0, 0)
        consumers.append(consumer)
    inputs = groups()
    cuts: list[list[int]] = [[], []]
    busy_until = [0.0, 0.0]
    done = [False, False]
    next_input, writing = 0.0, None  # the batch the writer stopped in (back-pressured), if any
    now = 0.0
    while not all(done):
        if writing is None and next_input <= now and not producer.is_finished:
            if inputs:
                writing = inputs.pop(0)
                finished = producer.write(writing)
            else:
                producer.finish()
                finished = True
            next_input = now + GAP_S
        elif writing is not None and producer.is_available():
            finished = producer.resume()
        else:
            finished = writing is None
        producer.sample_output()
        if finished:
            writing = None
        if producer.next_timer() <= now:
            producer.on_timer(now, 0)
        wakes = [next_input if not producer.is_finished else float("inf"), producer.next_timer()]
        for c, consumer in enumerate(consumers):
            while not done[c] and busy_until[c] <= now:
                step = consumer.next(now)
                if step is None:
                    done[c] = True
                elif isinstance(step, Fail):
                    raise step.error
                elif isinstance(step, (Wait, LingerOver)):
                    break
                else:
                    batches, _ = consumer.take(step, 0)
                    rows = sum(b.num_rows for b in batches)
                    if rows:
                        cuts[c].append(rows)
                        busy_until[c] = now + DELAY_S * rows
            if busy_until[c] > now:
                wakes.append(busy_until[c])
        later = [t for t in wakes if t > now]
        if not later and all(done):
            break
        assert later, "the virtual run stalled"
        now = min(later)
    return cuts, producer


def runtime_cuts(plan: ExchangePlan) -> list[list[int]]:
    """Rows per buffer each consumer received from the pipelined runtime (threads, real TCP, the slow
    consumer sleeping ``DELAY_S`` per row), the input batches ``GAP_S`` apart."""
    cuts: list[list[int]] = [[], []]

    def paced():
        for batch in groups():
            yield batch
            time.sleep(GAP_S)

    run_in_threads(
        plan,
        [paced()],
        options=TaskOptions(output_batch_rows=0, sample_memory_ms=0),
        on_batch=lambda consumer, batch: cuts[consumer].append(batch.num_rows),
    )
    return cuts


def test_the_engine_cuts_the_same_buffers_on_a_virtual_clock_and_under_the_pipelined_runtime():
    """Given one producer keying 4 batches of 1,000 rows to two slow consumers (0.2 ms per row), 4 KiB
    segments and a 50 ms buffer timeout, when the engine runs on a virtual clock and under the pipelined
    runtime (threads, real TCP: consumer 0 reads its own task's subpartition, consumer 1 over a remote,
    credit-based channel), then every consumer receives the same buffers in both, row for row.

    Why the cuts are deterministic: a buffer is cut when its segment is full (the writer's size model
    decides where, from the rows alone) or when the flusher hands the consumer what the open buffer holds.
    Each input batch is written by one ``emit`` under the writer's lock, so the flusher never cuts inside a
    batch (the pools hold a whole batch: no backpressure stop); the batches come 0.5 s apart, longer than a
    flush period plus the slow consumer's work on one batch, so by the next batch the flusher has handed on
    the rest of the previous one and the consumer has taken it. Each batch thus ends as its full segments
    plus one flushed remainder per consumer, whatever the machine's speed. Keep-alives are priority events
    and cut nothing; latency markers are off."""
    virtual, producer = virtual_cuts(make_plan())
    assert [sum(c) for c in virtual] == _rows_per_consumer()
    full = max(max(c) for c in virtual)
    assert any(n < full for c in virtual for n in c), "some buffers were cut by the flusher"
    queue_max = {r.channel: r.value for r in producer.metric_rows(10.0) if r.metric == "outputQueueLength"}
    assert max(queue_max.values()) > 1, "the slow consumers let buffers queue up"

    slow = Injection(consumer_delay_s=((0, DELAY_S), (1, DELAY_S)))
    assert runtime_cuts(make_plan(slow)) == virtual


def _rows_per_consumer() -> list[int]:
    channels = np.concatenate(
        [np.asarray(scs.key_group_channels(b.column(1), parallelism=2, max_parallelism=128)) for b in groups()]
    )
    return [int((channels == c).sum()) for c in range(2)]


def test_a_silent_channel_fails_at_the_timeout_and_not_before():
    """Given a consumer whose producer writes nothing and sends no keep-alive, when the virtual clock passes
    partition_request_timeout_ms, then the engine fails with the timeout naming the producer and the
    setting; until then it asks to be woken at the deadline."""
    plan = make_plan()
    config = plan.config
    settings = Settings.of(config)
    network = NetworkBufferPool.from_config(config)
    partition = PipelinedResultPartition.create(network, 2, config, partition_id=0, bounded=True)
    gate = SingleInputGate(network, 1, config, num_remote_channels=0)
    gate.local_channel(0, partition, partition_id=0, subpartition=1)
    gate.setup()
    gate.request_partitions()
    consumer = ConsumerEngine(1, gate, [RecordReader(SCHEMA, channel=0)], [0], settings, 0.0)
    consumer.start(100.0, 0)
    assert consumer.next(104.0) == Wait(110.0)
    step = consumer.next(110.0)
    assert isinstance(step, Fail) and isinstance(step.error, ExchangeTimeoutError)
    assert "waited 10000 ms for data from producer subtask 0" in str(step.error)
    assert "partition_request_timeout_ms=10000" in str(step.error)


def test_a_channel_that_ended_is_never_silent_and_the_live_one_still_times_out():
    """Given a consumer of two producers, where producer 0 ends at once and producer 1 stays silent, then the
    consumer waits until producer 1's deadline and fails there naming producer 1, and not, a little later,
    the channel that ended."""
    plan = make_plan()
    config = plan.config
    network = NetworkBufferPool.from_config(config)
    partitions = [PipelinedResultPartition.create(network, 1, config, partition_id=p, bounded=True) for p in range(2)]
    gate = SingleInputGate(network, 2, config, num_remote_channels=0)
    for p, partition in enumerate(partitions):
        gate.local_channel(p, partition, partition_id=p, subpartition=0)
    gate.setup()
    gate.request_partitions()
    readers = [RecordReader(SCHEMA, channel=c) for c in range(2)]
    consumer = ConsumerEngine(0, gate, readers, [0, 1], Settings.of(config), 0.0)
    consumer.start(100.0, 0)
    partitions[0].finish()  # its end of partition is all channel 0 delivers, at 100.5
    step = consumer.next(100.5)
    while not isinstance(step, Wait):
        consumer.take(step, 0)
        step = consumer.next(100.5)
    assert step == Wait(110.0)
    assert consumer.next(109.9) == Wait(110.0)
    for now in (110.0, 111.0):  # past channel 0's last delivery too: it ended, producer 1 is the silent one
        step = consumer.next(now)
        assert isinstance(step, Fail) and "data from producer subtask 1" in str(step.error)


def test_settings_interpret_the_buffer_timeout_once():
    """Given buffer timeouts 0, 50 ms and -1, then the engine's flush rule and default output linger are
    Flink's flush-always, a 50 ms flusher (linger 2 ms at most) and full-buffers-only (linger 2 ms); a
    blocking partition is never flushed."""
    zero = Settings.of(NetworkConfig(buffer_timeout_ms=0))
    assert (zero.flush_always, zero.flush_interval, zero.output_linger) == (True, None, 0.0)
    fifty = Settings.of(NetworkConfig(buffer_timeout_ms=50))
    assert (fifty.flush_always, fifty.flush_interval, fifty.output_linger) == (False, 0.05, 0.002)
    never = Settings.of(NetworkConfig(buffer_timeout_ms=-1))
    assert (never.flush_always, never.flush_interval, never.output_linger) == (False, None, 0.002)
    blocking = Settings.of(NetworkConfig(buffer_timeout_ms=0), blocking=True)
    assert (blocking.flush_always, blocking.flush_interval) == (False, None)


def test_the_simulation_samples_the_runtimes_timeline_rows_and_plot_takes_its_report():
    """Given a simulated exchange 2 -> 2 on separate hosts with consumer 0 sixteen times slower, when it
    samples every 10 virtual ms, then its timeline has the runtimes' rows (side, subtask, channel, metric,
    stat 'sample', value, time_ms) with their metric names, the slow consumer's channels show a backlog,
    plot_timeline draws the report as it would an exchange's timeline, and its metric rows are the engine's
    counters."""
    from spark_credit_shuffle.plot import plot_timeline, to_pandas
    from spark_credit_shuffle.simulation import simulate

    report = simulate(
        NetworkConfig(segment_size=4096, buffer_timeout_ms=5),
        num_producers=2,
        num_consumers=2,
        producer_rate=8e6,
        consumer_rate=[0.5e6, 8e6],
        duration=0.5,
        sample_interval=0.01,
    )
    frame = to_pandas(report, timeline=True)
    assert set(frame["stat"]) == {"sample"} and frame["time_ms"].notna().all()
    names = {side: set(frame[frame["side"] == side]["metric"]) for side in ("producer", "consumer")}
    time_gauges = {
        "busyTimeMsPerSecond",
        "idleTimeMsPerSecond",
        "backPressuredTimeMsPerSecond",
        "softBackPressuredTimeMsPerSecond",
        "hardBackPressuredTimeMsPerSecond",
    }
    assert names["producer"] == {
        "outPoolUsage",
        "isBackPressured",
        "numRecordsOutPerSecond",
        "backlog",
        "outputQueueLength",
        "numBytesOut",  # the counter so far, for a window's throughput (SimulationReport.value_at)
        *time_gauges,
    }
    assert names["consumer"] == {
        "numRecordsInPerSecond",
        "inPoolUsage",
        "inputExclusiveBuffersUsage",
        "inputFloatingBuffersUsage",
        "isBackPressured",  # waiting to hand its output on
        "credit",
        "unannouncedCredit",
        "backlog",
        "inputQueueLength",
        "numBytesIn",
        *time_gauges,
    }
    # Flink's identity in every sample of the simulation's timeline: busy + idle + back-pressured = 1000
    sums = frame[frame["metric"].isin(["busyTimeMsPerSecond", "idleTimeMsPerSecond", "backPressuredTimeMsPerSecond"])]
    totals = sums.groupby(["side", "subtask", "time_ms"])["value"].sum()
    assert ((totals - 1000.0).abs() < 1e-6).all()
    # the slow consumer's producers were back-pressured: hard (in the middle of a batch) or soft (before one)
    producer_bp = frame[(frame["side"] == "producer") & (frame["metric"] == "backPressuredTimeMsPerSecond")]
    assert producer_bp["value"].max() > 0
    backlog = frame[(frame["side"] == "producer") & (frame["metric"] == "backlog")]
    assert backlog[backlog["channel"] == 0]["value"].max() > backlog[backlog["channel"] == 1]["value"].max()
    rows = report.metric_rows()
    assert {r.metric for r in rows} >= {"numBytesOut", "numBytesIn", "numBuffersIn", "accumulateBackPressuredTimeMs"}
    # the engine's counters: every record written to a channel by the end was decoded by its consumer, or is
    # still queued (the run stops at 0.5 s with the slow consumer behind)
    out = {(r.subtask, r.channel): r.value for r in rows if r.side == "producer" and r.metric == "numRecordsOut"}
    into = {(r.channel, r.subtask): r.value for r in rows if r.side == "consumer" and r.metric == "numRecordsIn"}
    assert out.keys() == into.keys() and all(0 < into[k] <= out[k] for k in out)
    assert into[(1, 1)] > into[(1, 0)]  # the fast consumer decoded more
    figure = plot_timeline(report, ["outPoolUsage", "backlog", "inPoolUsage"])
    assert len(figure.axes) == 3


def test_the_output_batcher_hands_on_by_rows_and_by_bytes():
    from spark_credit_shuffle.engine.consumer import OUTPUT_BATCH_BYTES, OutputBatcher

    small = pa.record_batch({"s": pa.array(["x"] * 100)})
    batcher = OutputBatcher(target_rows=250, linger=0.01)
    for _ in range(2):
        batcher.add(small)
        assert batcher.ready(True, 0.0) is None  # more is coming: wait for 250 rows
    batcher.add(small)
    assert batcher.ready(True, 0.0).num_rows == 300
    big = pa.record_batch({"s": pa.array(["y" * (OUTPUT_BATCH_BYTES // 2)])})  # rows larger than a segment
    batcher.add(big)
    assert batcher.ready(True, 0.0) is None
    batcher.add(big)
    assert batcher.ready(True, 0.0).num_rows == 2  # by bytes, long before 250 rows
    batcher.add(small)
    assert batcher.ready(False, 1.0) is None and batcher.linger_until == pytest.approx(1.01)  # lingers
    assert batcher.take().num_rows == 100 and not batcher.pending


def test_a_keep_alive_goes_only_to_a_subpartition_with_nothing_its_reader_can_take():
    """Given a producer with a flushed buffer queued for consumer 0 and nothing for consumer 1, when its
    keep-alives are due, only consumer 1's subpartition gets one: consumer 0 has the data to tell it the
    producer is alive, and a keep-alive overtaking that data would only reorder what it receives."""
    config = NetworkConfig(**SETTINGS)
    settings = Settings.of(config, output_batch_rows=0)
    network = NetworkBufferPool.from_config(config)
    partition = PipelinedResultPartition.create(network, 2, config, partition_id=0, bounded=True)
    producer = ProducerEngine(
        0, partition, scs.global_().selector(0, 1, 2, 128), [0, 1], settings, 4096, SCHEMA, 0.0, resumable=True
    )

    class Listener:
        def notify_data_available(self) -> None:
            pass

        def notify_priority_event(self, sequence_number: int) -> None:
            pass

    for sub in partition.subpartitions:
        sub.create_read_view(Listener())
    batch = groups()[0].slice(0, 10)
    assert producer.write(batch)
    producer.writer.flush_all()
    queued = [sub.queue_length() for sub in partition.subpartitions]
    assert partition.subpartitions[0].is_data_available() and queued[1] == 0

    producer.send_liveness_markers()

    assert [sub.queue_length() for sub in partition.subpartitions] == [queued[0], 1]
