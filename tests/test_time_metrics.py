"""Flink's time metrics: busy, idle and back-pressured time per second (soft and hard back-pressure apart),
over the side's life in ``metrics()`` and over a sliding minute in the timeline, in both modes; and the bytes
and buffers a consumer took from local and from remote channels."""

from __future__ import annotations

import pytest
from exchange_helpers import SCHEMA as BLOCKING_SCHEMA
from exchange_helpers import inputs, make_plan, producer_batches, run_blocking

import spark_credit_shuffle as scs
from spark_credit_shuffle.engine import TimeAccount
from spark_credit_shuffle.engine.rules import TIME_WINDOW_S
from spark_credit_shuffle.metrics import CONSUMER, PRODUCER
from spark_credit_shuffle.runtime.exchange_plan import ExchangePlan, Injection
from spark_credit_shuffle.runtime.pipelined import run_in_threads

IDENTITY = ("busyTimeMsPerSecond", "idleTimeMsPerSecond", "backPressuredTimeMsPerSecond")


def test_the_timeline_gauges_are_per_second_over_the_last_minute_and_the_summary_over_the_life():
    # given a side idle for its first minute, then back-pressured half of each second for a minute
    account = TimeAccount(0.0)
    list(account.window_gauges(30.0, None))
    account.add_idle(60.0)
    list(account.window_gauges(60.0))
    for second in range(60):
        account.add_back_pressure(0.5, hard=second % 2 == 0)
    gauges = dict(account.window_gauges(60.0 + TIME_WINDOW_S))
    # then the timeline's gauges show the last minute alone: no idle time, half of it back-pressured
    assert gauges["idleTimeMsPerSecond"] == pytest.approx(0.0)
    assert gauges["backPressuredTimeMsPerSecond"] == pytest.approx(500.0)
    assert gauges["softBackPressuredTimeMsPerSecond"] == pytest.approx(250.0)
    assert gauges["hardBackPressuredTimeMsPerSecond"] == pytest.approx(250.0)
    assert sum(gauges[m] for m in IDENTITY) == pytest.approx(1000.0)
    # and the summary the whole two minutes, with the longest single wait of each kind
    account.stop(120.0)
    rows = {(r.metric, r.stat): r.value for r in account.rows(PRODUCER, 0, 120.0)}
    assert rows[("idleTimeMsPerSecond", "mean")] == pytest.approx(500.0)
    assert rows[("backPressuredTimeMsPerSecond", "mean")] == pytest.approx(250.0)
    assert rows[("busyTimeMsPerSecond", "mean")] == pytest.approx(250.0)
    assert rows[("maxSoftBackPressureTimeMs", "max")] == rows[("maxHardBackPressureTimeMs", "max")] == 500.0


def _summary(rows, side: str, subtask: int) -> dict[str, float]:
    return {
        r.metric: r.value
        for r in rows
        if r.side == side and r.subtask == subtask and r.time_ms is None and r.channel is None
    }


def test_pipelined_sides_keep_flinks_identity_and_count_local_and_remote_input():
    # given a slow consumer 0 (its producers are back-pressured: each sends it several times what 4 KiB buffers in
    # flight hold), every channel remote but a task's own
    plan = make_plan(
        scs.rebalance(),
        3,
        3,
        injection=Injection(consumer_delay_s=((0, 5e-5),)),
        local_channels="task",
        segment_size="4kb",
    )
    _, rows = run_in_threads(plan, inputs(3, 20_000))
    for side in (PRODUCER, CONSUMER):
        for subtask in range(3):
            summary = _summary(rows, side, subtask)
            # then busy + idle + back-pressured = 1000 ms per second over each side's life (Flink's identity)
            assert sum(summary[m] for m in IDENTITY) == pytest.approx(1000.0, abs=1.0)
            parts = summary["softBackPressuredTimeMsPerSecond"] + summary["hardBackPressuredTimeMsPerSecond"]
            assert parts == pytest.approx(summary["backPressuredTimeMsPerSecond"], abs=1.0)
    # and in every timeline sample too
    samples: dict[tuple, float] = {}
    for r in rows:
        if r.time_ms is not None and r.metric in IDENTITY:
            key = (r.side, r.subtask, r.time_ms)
            samples[key] = samples.get(key, 0.0) + r.value
    assert samples and all(v == pytest.approx(1000.0, abs=1e-6) for v in samples.values())
    assert max(_summary(rows, PRODUCER, p)["backPressuredTimeMsPerSecond"] for p in range(3)) > 0
    # and each consumer read its own subpartition locally and the two others remotely
    for consumer in range(3):
        summary = _summary(rows, CONSUMER, consumer)
        assert summary["numBytesInLocal"] > 0 and summary["numBytesInRemote"] > summary["numBytesInLocal"]
        assert summary["numBuffersInLocal"] > 0 and summary["numBuffersInRemote"] > 0


def test_blocking_sides_report_time_metrics_and_read_every_channel_remotely():
    config = scs.NetworkConfig(segment_size=4096)
    plan = ExchangePlan("test", "blocking", scs.rebalance(seed=2), 2, 2, 128, config, BLOCKING_SCHEMA)
    outputs = run_blocking(plan, {p: producer_batches(p, 1500, 0) for p in range(2)})
    for consumer, (_, rows) in outputs.items():
        by_task: dict[tuple[str, int], dict[str, float]] = {}
        for r in rows:
            if r["time_ms"] is None and r["channel"] is None:
                by_task.setdefault((r["side"], r["subtask"]), {})[r["metric"]] = r["value"]
        for (side, _), summary in by_task.items():
            assert sum(summary[m] for m in IDENTITY) == pytest.approx(1000.0, abs=1.0), side
            if side == PRODUCER:
                assert summary["backPressuredTimeMsPerSecond"] == 0.0  # a blocking producer never waits
            else:  # a consumer waits only while its output is not taken (here: never long)
                assert 0.0 <= summary["backPressuredTimeMsPerSecond"] < 1000.0
        mine = by_task[(CONSUMER, consumer)]
        assert mine["numBytesInLocal"] == 0 and mine["numBytesInRemote"] > 0
        assert mine["numBuffersInLocal"] == 0 and mine["numBuffersInRemote"] > 0
