"""Sweeps of simulations: a grid of points, run one per Spark task, equal to the same points run alone (a
simulation runs on virtual time: where it runs changes nothing but its wall time)."""

from __future__ import annotations

import json

import pytest

import spark_credit_shuffle as scs
from spark_credit_shuffle.errors import ConfigError
from spark_credit_shuffle.plot import plot_sweep
from spark_credit_shuffle.simulation.sweep import SWEEP_FIELDS, grid, run_points, sweep, sweep_frame

#: 2 -> 2 on one host, one slow consumer, every byte delivered (the run ends when all is consumed).
BASE = {
    "num_producers": 2,
    "num_consumers": 2,
    "producer_rate": 20e6,
    "consumer_rate": [5e6, 40e6],
    "bytes_per_producer": 2_000_000,
    "latency": 100e-6,
    "producer_hosts": [0, 1],
    "consumer_hosts": [0, 1],
}
#: The figures that depend on the virtual run only (not ``wall_s``).
EXACT = [f for f in SWEEP_FIELDS if f != "wall_s"]


def eight_points():
    return grid(BASE, buffer_timeout_ms=[0, 1, 10, 100], credit_based=[True, False])


def test_the_grid_is_the_product_of_its_axes_over_the_base():
    points = eight_points()
    assert [p.index for p in points] == list(range(8))
    assert [(p.axes["buffer_timeout_ms"], p.axes["credit_based"]) for p in points] == [
        (t, c) for t in (0, 1, 10, 100) for c in (True, False)
    ]
    assert points[3].settings == {"buffer_timeout_ms": 1, "credit_based": False}
    assert points[3].params == BASE
    assert points[3].label == "buffer_timeout_ms=1, credit_based=false"


def test_bad_axes_are_refused_before_anything_runs():
    with pytest.raises(
        scs.ConfigError, match=r"'buffer_timeot_ms' for argument 'axes'.*did you mean 'buffer_timeout_ms'"
    ):
        grid(BASE, buffer_timeot_ms=[1])
    with pytest.raises(scs.ConfigError, match=r"'buffer_timeout_ms'.*non-empty list"):
        grid(BASE, buffer_timeout_ms=[])
    with pytest.raises(scs.ConfigError, match=r"'segment_size'"):  # NetworkConfig's own check, per point
        grid(BASE, segment_size=[32768, 3])


def test_a_sweep_of_eight_on_spark_equals_the_eight_run_alone(any_spark):
    points = eight_points()
    alone = sweep_frame(run_points(points))
    result = sweep(any_spark, points)
    on_spark = sweep_frame(result)
    assert list(on_spark["index"]) == list(range(8))
    assert on_spark[["index", "label", "buffer_timeout_ms", "credit_based", *EXACT]].equals(
        alone[["index", "label", "buffer_timeout_ms", "credit_based", *EXACT]]
    )
    assert on_spark["data_intact"].all() and on_spark["buffers_returned"].all() and on_spark["finished"].all()
    # the slow consumer (5 MB/s of 20) holds the producers back, with credits or without
    assert (on_spark["producers_back_pressured_ms_per_s"] > 100).all()
    figure = plot_sweep(on_spark, "buffer_timeout_ms", hue="credit_based", logx=True)
    assert len(figure.axes[0].lines) == 2


def test_the_command_runs_a_sweep_in_this_process_and_refuses_a_bad_axis_before_running(capsys):
    from spark_credit_shuffle.cli import main

    base = {"num_producers": 2, "num_consumers": 2, "producer_rate": 20e6, "consumer_rate": [5e6, 40e6]}
    base["bytes_per_producer"] = 2_000_000
    args = [a for name, value in base.items() for a in ("--set", f"{name}={json.dumps(value)}")]
    axes = ["--axis", "buffer_timeout_ms=0,100", "--axis", "credit_based=true,false"]
    assert main(["sweep", "--local", *args, *axes]) == 0
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    alone = sweep_frame(run_points(grid(base, buffer_timeout_ms=[0, 100], credit_based=[True, False])))
    assert headline["points"] == 4
    assert [r["throughput_mb_per_s"] for r in headline["rows"]] == pytest.approx(list(alone["throughput_mb_per_s"]))
    assert all(r["data_intact"] for r in headline["rows"])
    with pytest.raises(SystemExit) as refused:
        main(["sweep", "--local", *args, "--axis", "buffer_timeot_ms=0,1"])
    assert refused.value.code == 2 and "did you mean 'buffer_timeout_ms'" in capsys.readouterr().err


def test_a_simulation_calibrated_on_a_run_takes_its_rates_sizes_and_placement():
    from spark_credit_shuffle.diagnosis import SubtaskSummary
    from spark_credit_shuffle.simulation.calibrate import from_summaries, measured, predicted

    def summary(side, i, records, nbytes, rate, busy_ms, bp, executor):
        # a life of records / rate seconds, busy busy_ms of it, back-pressured bp ms per second
        return SubtaskSummary(side, i, executor, records, nbytes // 32768 + 1, nbytes, rate, busy_ms,
                              None, None, bp, None, None, None)  # fmt: skip

    runs = [
        summary("producer", 0, 10_000, 1_000_000, 10_000.0, 200.0, 500.0, "a"),  # 1 s, free half of it
        summary("producer", 1, 10_000, 1_000_000, 10_000.0, 200.0, 0.0, "b"),
        summary("consumer", 0, 10_000, 1_000_000, 10_000.0, 500.0, 0.0, "a"),
        summary("consumer", 1, 10_000, 1_000_000, 5_000.0, 1000.0, 0.0, "b"),  # 2 s of life
    ]
    point = from_summaries(runs, {"segment_size": 4096})
    params = point.params
    assert params["producer_rate"] == [2_000_000.0, 1_000_000.0]  # bytes over the time not back-pressured
    assert params["consumer_rate"] == [2_000_000.0, 1_000_000.0]  # bytes over busy time
    assert params["record_size"] == 100 and params["bytes_per_producer"] == [1e6, 1e6]
    assert params["producer_hosts"] == [0, 1] and params["consumer_hosts"] == [0, 1]
    assert measured(runs) == {"throughput_mb_per_s": 1.0, "producers_back_pressured_ms_per_s": 250.0}
    report = point.run()
    assert report.data_intact and report.buffers_returned
    figures = predicted(report)
    assert figures["throughput_mb_per_s"] > 0 and 0 <= figures["producers_back_pressured_ms_per_s"] <= 1000


@pytest.mark.parametrize(
    ("transport", "knob", "truth"),
    [("bandwidth", "host_bandwidth", 8e6), ("bandwidth", "host_bandwidth", 15e6), ("latency", "latency", 3e-3)],
)
def test_the_transport_is_fitted_to_the_segments_measured_hold_time(transport, knob, truth):
    """A run whose hosts move 8 or 15 MB/s over all their connections (or whose buffers take 3 ms each way), with
    4 KiB segments, so that the transport, not a rate, sets the pace: its producers' segment hold time, given to
    the fit, gives the transport back, and with it the run's throughput and back-pressure (which the fit never
    looked at)."""
    from spark_credit_shuffle.engine.producer import SEGMENT_HOLD_TIME
    from spark_credit_shuffle.simulation.calibrate import BASE_LATENCY, MAX_HOST_BANDWIDTH, fit_transport, predicted
    from spark_credit_shuffle.simulation.sweep import SweepPoint

    settings = {"segment_size": 4096}
    params = {**BASE, "consumer_rate": 40e6, "processes": "subtask", "latency": BASE_LATENCY}
    slow_transport = SweepPoint(0, settings, {**params, knob: truth}).run()
    holds = sorted(r.value for r in slow_transport.rows if r.side == "producer" and r.metric == SEGMENT_HOLD_TIME)
    assert len(holds) == 2 and holds[0] > 2.0  # ms: held while the transport moved it and its credit back
    hold_s = (holds[0] + holds[1]) / 2 / 1e3  # the median of two
    fitted = fit_transport(SweepPoint(0, settings, params), hold_s, transport)
    assert fitted.params[knob] == pytest.approx(truth, rel=0.15)
    got, want = predicted(fitted.run()), predicted(slow_transport)
    assert want["producers_back_pressured_ms_per_s"] > 250
    assert got["throughput_mb_per_s"] == pytest.approx(want["throughput_mb_per_s"], rel=0.15)
    assert got["producers_back_pressured_ms_per_s"] == pytest.approx(
        want["producers_back_pressured_ms_per_s"], rel=0.15
    )
    # a hold shorter than the fastest transport gives: the fastest is kept
    fastest = fit_transport(SweepPoint(0, settings, params), 1e-6, transport).params[knob]
    assert fastest == (None if transport == "bandwidth" else BASE_LATENCY)
    assert MAX_HOST_BANDWIDTH > 1e9
    with pytest.raises(ConfigError, match="transport"):
        fit_transport(SweepPoint(0, settings, params), hold_s, "wire")


def test_a_real_exchange_measures_its_segments_hold_time_and_calibrates_a_simulation_with_it(any_spark):
    """On a classic session and on Spark Connect, a filtered input as the optimizer leaves it."""
    from spark_credit_shuffle.engine.producer import SEGMENT_HOLD_TIME
    from spark_credit_shuffle.simulation.calibrate import BASE_LATENCY, MAX_HOST_BANDWIDTH, from_exchange

    spark = any_spark
    rows = spark.range(0, 24_000, 1, 2).filter("id % 6 != 5")  # 20,000 rows
    ex = scs.exchange(rows, scs.rebalance(), 2, mode="pipelined", segment_size="4kb")
    assert ex.df.count() == 20_000
    holds = {r.subtask: r.value for r in ex.metric_rows() if r.metric == SEGMENT_HOLD_TIME}
    assert set(holds) == {0, 1} and all(0 < ms < 60_000 for ms in holds.values())  # every producer's, in ms
    point = from_exchange(ex)
    assert point.params["latency"] == BASE_LATENCY and point.params["processes"] == "subtask"
    bandwidth = point.params["host_bandwidth"]  # fitted: bytes per second, or None where the transport holds nothing
    assert bandwidth is None or 1e5 < bandwidth <= MAX_HOST_BANDWIDTH
    # the producers write Spark's input batches whole, and every subtask starts when the real one did
    assert point.params["batch_records"] == int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch"))
    starts = point.params["producer_start"] + point.params["consumer_start"]
    assert min(starts) == 0.0 and all(0 <= t < 60 for t in starts)
    report = point.run()
    assert report.finished and report.data_intact


def test_a_skewed_run_is_simulated_with_its_channel_shares_and_an_even_one_round_robin():
    from spark_credit_shuffle.metrics import MetricRow
    from spark_credit_shuffle.simulation.calibrate import channel_shares

    def rows(shares):
        per_channel = [
            MetricRow("producer", p, c, "numRecordsOut", "total", float(v))
            for p, row in enumerate(shares)
            for c, v in enumerate(row)
        ]
        return [*per_channel, MetricRow("producer", 0, None, "numRecordsOut", "total", 1e9)]  # a total: not a channel

    assert channel_shares(rows([[800, 100, 100], [340, 330, 330]]), 2, 3) == [[800, 100, 100], [340, 330, 330]]
    assert channel_shares(rows([[334, 333, 333], [330, 340, 330]]), 2, 3) is None  # within 5%: round robin
    assert channel_shares(rows([[0, 0, 0], [800, 100, 100]]), 2, 3) is None  # a producer wrote nothing


def test_start_times_and_span_come_from_each_subtasks_first_and_last_timeline_sample():
    from spark_credit_shuffle.metrics import MetricRow
    from spark_credit_shuffle.simulation.calibrate import measured, span_s, start_times

    def sample(side, subtask, ms):
        return MetricRow(side, subtask, None, "outPoolUsage", "sample", 0.0, ms)

    timeline = [
        sample("producer", 0, 1_000.0),
        sample("producer", 0, 1_900.0),
        sample("producer", 1, 1_250.0),
        sample("consumer", 0, 1_100.0),
        sample("consumer", 0, 2_000.0),  # the last end
        sample("consumer", 1, 1_500.0),
    ]
    assert start_times(timeline, 2, 2) == ([0.0, 0.25], [0.1, 0.5])
    assert span_s(timeline) == 1.0
    assert start_times(timeline, 2, 3) is None  # consumer 2 never sampled: nothing to start it by
    # the throughput over the span: 2 MB in 1 s
    from spark_credit_shuffle.diagnosis import SubtaskSummary

    producers = [
        SubtaskSummary("producer", p, "a", 1_000, 31, 1_000_000, 2_000.0, 100.0, None, None, 0.0, None, None, None)
        for p in (0, 1)
    ]
    assert measured(producers, timeline)["throughput_mb_per_s"] == 2.0
    # sampling off (no timeline rows): over the longest subtask life, 1,000 records at 2,000 a second
    assert measured(producers, [])["throughput_mb_per_s"] == 4.0


def test_a_calibrated_run_at_another_parallelism_keeps_its_bytes_rates_and_transport():
    from spark_credit_shuffle.simulation.calibrate import with_parallelism
    from spark_credit_shuffle.simulation.sweep import SweepPoint

    run = SweepPoint(
        0,
        {"segment_size": 4096},
        {
            **BASE,
            "producer_rate": [10e6, 30e6],
            "consumer_rate": [20e6, 40e6],
            "bytes_per_producer": [1_000_000, 3_000_000],
            "producer_start": [0.0, 0.01],
            "consumer_start": [0.02, 0.0],
            "channel_weights": [[3.0, 1.0], [1.0, 1.0]],
            "processes": "subtask",
            "host_bandwidth": 50e6,
        },
    )
    wider = with_parallelism(run, 4, 3)
    params = wider.params
    assert params["num_producers"] == 4 and params["num_consumers"] == 3
    assert params["bytes_per_producer"] == [1e6] * 4  # the run's 4 MB, spread evenly
    assert params["producer_rate"] == [20e6] * 4 and params["consumer_rate"] == [30e6] * 3  # the medians
    assert params["producer_hosts"] == [0, 1, 0, 1] and params["consumer_hosts"] == [0, 1, 0]  # round robin
    assert params["producer_start"] == [0.0, 0.01, 0.0, 0.01] and params["consumer_start"] == [0.02, 0.0, 0.02]
    assert "channel_weights" not in params and params["host_bandwidth"] == 50e6
    report = wider.run()
    assert report.finished and report.data_intact and report.buffers_returned
    with pytest.raises(ConfigError, match="parallelism"):
        with_parallelism(run, 0)
