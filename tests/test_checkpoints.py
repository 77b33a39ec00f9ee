"""Checkpoint barriers through the exchange: producers inject them, consumers align (or capture channel
state), rows out stay exactly rows in, and the checkpoints show in the metrics, the timeline and
``Exchange.checkpoints()``."""

from __future__ import annotations

import time

import pytest
from exchange_helpers import SCHEMA as BLOCKING_SCHEMA
from exchange_helpers import expected_placement, inputs, make_plan, metric, producer_batches, run_blocking, table
from pyspark.sql import functions as F
from spark_helpers import assert_same_rows

import spark_credit_shuffle as scs
from spark_credit_shuffle.buffers.format import CheckpointOptions
from spark_credit_shuffle.engine.checkpoints import CheckpointTrigger
from spark_credit_shuffle.errors import ConfigError
from spark_credit_shuffle.metrics import CONSUMER, PRODUCER
from spark_credit_shuffle.runtime.exchange_plan import ExchangePlan, Injection
from spark_credit_shuffle.runtime.pipelined import run_in_threads

MODES = {
    "aligned": {},
    "unaligned": {"unaligned_checkpoints": True},
    "aligned-with-timeout": {"unaligned_checkpoints": True, "aligned_checkpoint_timeout_ms": 2},
}


def test_settings_have_flinks_names_and_are_checked():
    config = scs.NetworkConfig()
    assert config.checkpoint_interval_ms == 0  # off by default, as in Flink
    assert (
        scs.NetworkConfig.settings()["checkpoint_interval_ms"].metadata["flink"] == "execution.checkpointing.interval"
    )
    assert (
        scs.NetworkConfig.from_conf({"spark.creditShuffle.checkpointIntervalMs": "100ms"}).checkpoint_interval_ms == 100
    )
    options = scs.NetworkConfig(unaligned_checkpoints=True, aligned_checkpoint_timeout_ms=30).checkpoint_options
    assert options.is_timeoutable and options.aligned_checkpoint_timeout_ms == 30
    assert scs.NetworkConfig(unaligned_checkpoints=True).checkpoint_options.is_unaligned
    with pytest.raises(ConfigError, match="checkpoint_interval_ms"):
        scs.NetworkConfig(checkpoint_interval_ms=-5)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_pipelined_rows_are_conserved_and_checkpoints_complete_behind_a_slow_consumer(mode):
    # consumer 0 sleeps per row, so the run lasts several checkpoint intervals and barriers queue behind data
    plan = make_plan(
        scs.key_by("k"),
        3,
        3,
        injection=Injection(consumer_delay_s=((0, 3e-5),)),
        checkpoint_interval_ms=10,
        max_buffers_per_channel=4,
        floating_buffers_per_gate=2,
        **MODES[mode],
    )
    data = inputs(3, 6000)
    received, rows = run_in_threads(plan, data)
    for c, want in enumerate(expected_placement(plan, data)):
        assert table(received[c]).sort_by("id").equals(want)
    barriers_out = sum(r.value for r in metric(rows, PRODUCER, "numCheckpointBarriersOut"))
    assert barriers_out > 0
    completed = {r.subtask: r.value for r in metric(rows, CONSUMER, "numberOfCompletedCheckpoints")}
    assert set(completed) == {0, 1, 2} and sum(completed.values()) > 0
    # one checkpoint at a time: no consumer fails one, each completes 1, 2, 3... in turn, and no producer ran
    # more than one checkpoint ahead of its consumers (a consumer that finished holds no producer back)
    assert all(r.value == 0 for r in metric(rows, CONSUMER, "numberOfFailedCheckpoints"))
    ids = metric(rows, CONSUMER, "checkpointId", stat="checkpoint")
    for c in range(3):
        assert sorted(r.value for r in ids if r.subtask == c) == list(range(1, int(completed[c]) + 1))
    assert all(r.value <= max(completed.values()) + 1 for r in metric(rows, PRODUCER, "numCheckpointBarriersOut"))
    per_checkpoint = metric(rows, CONSUMER, stat="checkpoint")
    unaligned = [r.value for r in per_checkpoint if r.metric == "unalignedCheckpoint"]
    persisted = sum(r.value for r in metric(rows, CONSUMER, "bytesPersistedDuringAlignment", "total"))
    output_state = sum(r.value for r in metric(rows, PRODUCER, "resultSubpartitionStateBytes", "total"))
    if mode == "aligned":
        assert unaligned and not any(unaligned) and persisted == 0  # aligned: nothing captured
        assert not metric(rows, PRODUCER, "resultSubpartitionStateBytes")
    elif mode == "unaligned":
        assert unaligned and all(unaligned) and persisted > 0  # overtaken buffers were captured
        # on both sides: the buffers queued for the slow consumer when a barrier overtook them
        assert output_state > 0
    assert all(r.value >= 0 for r in per_checkpoint if r.metric == "checkpointAlignmentTime")
    timeline = [r for r in rows if r.metric == "checkpointBarrier"]
    assert {r.side for r in timeline} == {PRODUCER, CONSUMER} and all(r.time_ms for r in timeline)


@pytest.mark.parametrize("mode", ["aligned", "unaligned"])
def test_blocking_mode_aligns_one_barrier_at_the_end_of_each_producer(mode):
    config = scs.NetworkConfig(segment_size=4096, checkpoint_interval_ms=100, **MODES[mode])
    plan = ExchangePlan("test", "blocking", scs.rebalance(seed=2), 3, 2, 128, config, BLOCKING_SCHEMA)
    batches = {p: producer_batches(p, 1500, 0) for p in range(3)}
    outputs = run_blocking(plan, batches)
    ids = sorted(i for data, _ in outputs.values() for i in data.column("id").to_pylist())
    assert ids == sorted(i for p in range(3) for b in batches[p] for i in b.column("id").to_pylist())
    for consumer, (_, rows) in outputs.items():
        checkpoint_ids = [
            r["value"]
            for r in rows
            if r["metric"] == "checkpointId" and r["side"] == CONSUMER and r["subtask"] == consumer
        ]
        assert checkpoint_ids == [1.0]
    # as docs/network.md lists it: one barrier out per producer
    barriers_out = {
        r["subtask"]: r["value"]
        for _, rows in outputs.values()
        for r in rows
        if r["metric"] == "numCheckpointBarriersOut" and r["side"] == PRODUCER
    }
    assert barriers_out == {0: 1.0, 1: 1.0, 2: 1.0}


@pytest.mark.parametrize("mode", ["blocking", "pipelined"])
def test_rows_out_are_rows_in_with_checkpoints_on_spark(spark, mode):
    df = spark.range(0, 20_000, 1, 3).select(F.col("id"), (F.col("id") % 13).cast("int").alias("k"))
    # consumer 0 reads its ~7000 rows in about 0.7 s and back-pressures the producers (4 KiB buffers), so
    # they are still writing at dozens of checkpoint instants
    slow = Injection(consumer_delay_s=((0, 1e-4),))
    ex = scs.exchange(
        df,
        scs.key_by("k"),
        parallelism=3,
        mode=mode,
        injection=slow,
        checkpoint_interval_ms=10,
        unaligned_checkpoints=True,
        segment_size=4096,
    )
    assert_same_rows(ex.df, df)
    checkpoints = ex.checkpoints().collect()
    assert checkpoints and {r.subtask for r in checkpoints} <= {0, 1, 2}
    assert all(r.alignment == "unaligned" and r.alignment_time_ms >= 0 for r in checkpoints)
    counts = ex.metrics().where(F.col("metric") == "numberOfCompletedCheckpoints").collect()  # counts are doubles
    assert sorted(r.subtask for r in counts) == [0, 1, 2]
    assert sum(r.value for r in counts) == len(checkpoints)
    if mode == "blocking":
        assert sorted(r.subtask for r in checkpoints) == [0, 1, 2]  # one checkpoint per consumer subtask


def test_producers_armed_with_the_same_start_agree_on_their_first_checkpoint():
    # given two producers' triggers, one armed later than the other, with the latest start any task announced
    started_ms = time.time_ns() // 1_000_000
    first, second = (
        CheckpointTrigger(subtask, 60_000, CheckpointOptions(), time.time_ns, time.monotonic) for subtask in (0, 1)
    )
    assert not first.is_due()  # not armed: no barrier, whatever the time
    first.arm(started_ms)
    time.sleep(0.01)
    second.arm(started_ms)
    # then neither fires before the instant of their first checkpoint, the second after the last start
    assert not first.is_due() and not second.is_due()
    assert first.seconds_until_next() > 60 and second.seconds_until_next() > 60
    assert first.instant == second.instant == started_ms // 60_000 + 1
    # and both name it alike: checkpoint ids count from 1
    assert first.next_barrier().id == second.next_barrier().id == 1


class _Clock:
    """A wall clock (epoch ms) and a monotonic one (s) that move only when told."""

    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def wall_ns(self) -> int:
        return self.now_ms * 1_000_000

    def monotonic(self) -> float:
        return self.now_ms / 1000.0


def test_a_producer_injects_the_next_checkpoint_only_once_every_consumer_ended_the_last():
    # given a trigger every 10 ms whose consumers acknowledged checkpoints up to `acked`, armed at 1,000,000 ms
    clock, acked = _Clock(1_000_000), [0]
    trigger = CheckpointTrigger(
        0, 10, CheckpointOptions(), clock.wall_ns, clock.monotonic, lambda i: acked[0] >= i, timeout_ms=1000
    )
    trigger.arm(clock.now_ms - 200)
    # the first checkpoint waits for no one
    assert trigger.is_due() and trigger.next_barrier().id == 1
    # at the next instant, with checkpoint 1 still aligning somewhere, the second is held back, and looked for
    # again a tenth of the interval later
    clock.now_ms += 10
    assert not trigger.is_due() and trigger.seconds_until_next() == pytest.approx(0.001)
    # once every consumer ended checkpoint 1 (42 ms later), checkpoint 2 goes at once: no id is skipped, and
    # the instants missed meanwhile are not caught up one by one
    clock.now_ms += 42
    acked[0] = 1
    assert trigger.is_due() and trigger.next_barrier().id == 2
    acked[0] = 2
    assert not trigger.is_due() and 0 < trigger.seconds_until_next() <= 0.010
    clock.now_ms += 10
    assert trigger.is_due() and trigger.next_barrier().id == 3
    # a checkpoint no consumer acknowledges within the checkpoint timeout is given up: the next one goes anyway
    clock.now_ms += 999
    assert not trigger.is_due()
    clock.now_ms += 1
    assert trigger.is_due() and trigger.next_barrier().id == 4


def test_a_late_timer_injects_the_next_checkpoint_at_once_and_does_not_burst_to_catch_up():
    # given a trigger armed long ago (its timer woke far behind the instants of several checkpoints)
    clock = _Clock(1_000_000)
    trigger = CheckpointTrigger(0, 10, CheckpointOptions(), clock.wall_ns, clock.monotonic)
    trigger.arm(clock.now_ms - 10_000)
    # then it injects the next checkpoint at once, and the one after at the next instant
    assert trigger.is_due() and trigger.seconds_until_next() == 0
    assert trigger.next_barrier().id == 1
    assert not trigger.is_due() and trigger.seconds_until_next() == pytest.approx(0.010)
    clock.now_ms += 10
    assert trigger.next_barrier().id == 2


def test_a_barrier_no_subpartition_took_after_the_finish_is_not_counted():
    # given a finished producer's unaligned trigger, due
    clock = _Clock(1_000_000)
    trigger = CheckpointTrigger(
        0, 10, scs.NetworkConfig(unaligned_checkpoints=True).checkpoint_options, clock.wall_ns, clock.monotonic
    )
    trigger.arm(clock.now_ms - 10_000)
    # when every consumer released its subpartition meanwhile (none takes the barrier)
    assert trigger.inject_after_finish(lambda barrier: 0) == 0
    # then nothing went out: not counted, not recorded, and its id is still the next one
    assert trigger.num_barriers == 0 and not trigger.rows and trigger.last_id == 0
    assert trigger.metric_rows()[0].value == 0
    # and a barrier that one subpartition took is counted once, with that id
    seen = []
    assert trigger.inject_after_finish(lambda barrier: seen.append(barrier.id) or 1) == 1
    assert seen == [1] and trigger.num_barriers == 1 and [r.value for r in trigger.rows] == [1.0]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_barriers_out_are_exactly_the_barriers_the_consumers_received(mode):
    # consumer 0 sleeps per row behind small pools, so the producers are back-pressured through many checkpoint
    # instants; with unaligned barriers the finished producers still inject them while consumer 0 reads on
    plan = make_plan(
        scs.key_by("k"),
        3,
        3,
        injection=Injection(consumer_delay_s=((0, 1e-4),)),
        checkpoint_interval_ms=10,
        max_buffers_per_channel=4,
        floating_buffers_per_gate=2,
        **MODES[mode],
    )
    _, rows = run_in_threads(plan, inputs(3, 6000))
    out = {r.subtask: r.value for r in metric(rows, PRODUCER, "numCheckpointBarriersOut")}
    injected = {
        p: len([r for r in rows if r.metric == "checkpointBarrier" and r.side == PRODUCER and r.subtask == p])
        for p in range(3)
    }
    received: dict[int, dict[int, set[int]]] = {p: {c: set() for c in range(3)} for p in range(3)}
    for r in metric(rows, CONSUMER, "checkpointBarrier"):
        received[r.channel][r.subtask].add(int(r.value))
    assert sum(out.values()) > 0
    for p in range(3):
        counts = {c: len(ids) for c, ids in received[p].items()}
        assert out[p] == injected[p], (p, out, injected)  # every barrier counted is one the producer recorded
        if mode != "unaligned":  # aligned barriers queue before the end of partition: every consumer gets each
            assert set(counts.values()) == {out[p]}, (p, out, counts)
        else:
            # each went into a subpartition a consumer still read: the consumer that read longest received them
            # all, but for a last one that followed an end of partition it had consumed just before its
            # release of the subpartition reached the producer (a consumer drops a barrier behind its end)
            assert out[p] - 1 <= max(counts.values()) <= out[p], (p, out, counts)


def _checkpoint_counts(ex, subtask: int) -> tuple[float, float]:
    counts = {
        r.metric: r.value
        for r in ex.metrics()
        .where((F.col("side") == CONSUMER) & (F.col("subtask") == subtask))
        .where(F.col("metric").isin("numberOfCompletedCheckpoints", "numberOfFailedCheckpoints"))
        .collect()
    }
    return counts.get("numberOfCompletedCheckpoints", 0.0), counts.get("numberOfFailedCheckpoints", 0.0)


@pytest.mark.parametrize("local_channels", ["executor", "task"])
def test_unaligned_barriers_overtake_what_a_slow_consumer_has_not_consumed_on_spark(spark, local_channels):
    # given consumer 0 sleeping 30 us per row (about 10 ms per 4 KiB buffer, so it lags for about a second),
    # unaligned barriers every 25 ms, and local channels between the tasks of the one executor (the default)
    # or every channel remote
    df = spark.range(0, 100_000, 1, 3).select(F.col("id"), (F.col("id") % 13).cast("int").alias("k"))
    delay = 3e-5
    ex = scs.exchange(
        df,
        scs.rebalance(),
        parallelism=3,
        mode="pipelined",
        injection=Injection(consumer_delay_s=((0, delay),)),
        checkpoint_interval_ms=25,
        unaligned_checkpoints=True,
        segment_size=4096,
        local_channels=local_channels,
    )
    assert_same_rows(ex.df, df)
    # then the slow consumer completes at least 90% of its checkpoints (finished producers inject on until
    # their consumers read them to the end)
    completed, failed = _checkpoint_counts(ex, 0)
    assert completed >= 10 and completed / (completed + failed) >= 0.9, (completed, failed)
    # and its barriers overtake what it has queued: they reach it within about a buffer of its work, not
    # behind the up to max_buffers_per_channel (10) buffers per channel it has not consumed
    start_delays = sorted(r.start_delay_ms for r in ex.checkpoints().where("subtask = 0").collect())
    rows_in = {
        r.metric: r.value
        for r in ex.metrics()
        .where("side = 'consumer' and subtask = 0 and metric in ('numRecordsIn', 'numBytesIn')")
        .groupBy("metric")
        .agg(F.sum("value").alias("value"))
        .collect()
    }
    ms_per_buffer = rows_in["numRecordsIn"] / rows_in["numBytesIn"] * 4096 * delay * 1000  # a full buffer's rows
    assert start_delays[len(start_delays) // 2] < 2 * ms_per_buffer, (start_delays, ms_per_buffer)


def test_a_healthy_aligned_run_fails_no_checkpoint_on_spark(spark):
    df = spark.range(0, 600_000, 1, 3).select(F.col("id"), (F.col("id") % 13).cast("int").alias("k"))
    ex = scs.exchange(df, scs.key_by("k"), parallelism=3, mode="pipelined", checkpoint_interval_ms=25)
    assert ex.df.count() == 600_000
    counts = [_checkpoint_counts(ex, c) for c in range(3)]
    assert all(failed == 0 for _, failed in counts), counts
    assert sum(completed for completed, _ in counts) > 0
