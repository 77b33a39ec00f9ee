"""The metrics timeline: gauges sampled per subtask over time, shipped like the summary metrics, and
the plot helpers that draw them."""

from __future__ import annotations

import collections

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import functions as F

import spark_credit_shuffle as scs
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import ConfigError
from spark_credit_shuffle.metrics import MAX_TIMELINE_POINTS, SAMPLE, MetricRow, TimelineSampler
from spark_credit_shuffle.plot import (
    DEFAULT_TIMELINE_METRICS,
    METRIC_LABELS,
    bar_chart,
    line_chart,
    plot_metrics,
    plot_timeline,
    plot_timeout_sweep,
)
from spark_credit_shuffle.runtime.blocking import consume_partition, produce_partition
from spark_credit_shuffle.runtime.exchange_plan import ExchangePlan, Injection

SCHEMA = pa.schema([("id", pa.int64()), ("k", pa.int32())])
PNG = b"\x89PNG\r\n\x1a\n"


def _batches(producer: int, rows: int = 4000, per_batch: int = 250) -> list[pa.RecordBatch]:
    ids = pa.array(range(producer * rows, (producer + 1) * rows), pa.int64())
    batch = pa.RecordBatch.from_arrays([ids, pc.cast(pc.bit_wise_and(ids, 7), pa.int32())], schema=SCHEMA)
    return [batch.slice(i, per_batch) for i in range(0, rows, per_batch)]


def _run_blocking(config: NetworkConfig, injection: Injection | None = None, producers: int = 2, consumers: int = 2):
    """The blocking runtime's task functions in process: (rows received per consumer, every metric row)."""
    plan = ExchangePlan("timeline", "blocking", scs.rebalance(seed=1), producers, consumers, 128, config, SCHEMA)
    plan = ExchangePlan(**{**plan.__dict__, "injection": injection})
    stored = [b for p in range(producers) for b in produce_partition(iter(_batches(p)), p, plan)]
    table = pa.Table.from_batches(stored)
    received, rows = {}, []
    for c in range(consumers):
        out = list(consume_partition(iter(table.filter(pc.equal(table["channel"], c)).to_batches()), c, plan))
        received[c] = sum(b.num_rows for b in out[:-1])
        for cell in out[-1].column(out[-1].num_columns - 1).to_pylist():
            rows.extend(MetricRow(**r) for r in cell)
    return received, rows


def test_sampler_records_rows_with_time_and_stays_bounded():
    sampler = TimelineSampler("producer", 3, interval_ms=1)
    assert sampler.due()  # nothing sampled yet
    for i in range(MAX_TIMELINE_POINTS + 10):
        sampler.record(lambda i=i: [("outPoolUsage", None, i / 10), ("backlog", 1, float(i))])
    rows = sampler.timeline_rows()
    assert sampler.num_samples <= MAX_TIMELINE_POINTS
    assert sampler.interval == pytest.approx(0.002)  # thinned once: every other sample kept, interval doubled
    assert {r.stat for r in rows} == {SAMPLE} and {r.side for r in rows} == {"producer"}
    assert {r.subtask for r in rows} == {3}
    times = [r.time_ms for r in rows if r.metric == "outPoolUsage"]
    assert times == sorted(times) and all(t > 0 for t in times)
    assert [r.value for r in rows if r.metric == "backlog"][:3] == [0.0, 2.0, 4.0]
    assert next(r.channel for r in rows if r.metric == "backlog") == 1

    off = TimelineSampler("consumer", 0, interval_ms=0)
    off.record(lambda: [("inPoolUsage", None, 1.0)])
    assert not off.due() and off.timeline_rows() == []


def test_blocking_tasks_sample_pools_backlog_and_credits():
    config = NetworkConfig(segment_size="4kb", metrics_sample_interval_ms=1)
    received, rows = _run_blocking(config, Injection(consumer_delay_s=((0, 0.00002),)))
    assert sum(received.values()) == 2 * 4000
    timeline = [r for r in rows if r.time_ms is not None]
    summary = [r for r in rows if r.time_ms is None]
    assert {r.stat for r in timeline} == {SAMPLE} and SAMPLE not in {r.stat for r in summary}
    # the summary metrics are what they were: exact counts
    assert sum(r.value for r in summary if r.metric == "numRecordsIn") == 8000

    by_task = collections.defaultdict(set)
    for r in timeline:
        by_task[(r.side, r.subtask)].add(r.metric)
    time_gauges = {
        "busyTimeMsPerSecond",
        "idleTimeMsPerSecond",
        "backPressuredTimeMsPerSecond",
        "softBackPressuredTimeMsPerSecond",
        "hardBackPressuredTimeMsPerSecond",
    }
    producer_metrics = {"outPoolUsage", "isBackPressured", "numRecordsOutPerSecond", "backlog", *time_gauges}
    consumer_metrics = {
        "inPoolUsage",
        "inputExclusiveBuffersUsage",
        "inputFloatingBuffersUsage",
        "numRecordsInPerSecond",
        "isBackPressured",  # waiting to hand its output on
        "credit",
        "unannouncedCredit",
        "backlog",
        "inputQueueLength",
        *time_gauges,
    }
    assert by_task == {
        ("producer", 0): producer_metrics,
        ("producer", 1): producer_metrics,
        ("consumer", 0): consumer_metrics,
        ("consumer", 1): consumer_metrics,
    }
    for (side, subtask), _ in by_task.items():
        mine = [r for r in timeline if (r.side, r.subtask) == (side, subtask)]
        stamps = sorted({r.time_ms for r in mine})
        assert len(stamps) >= 2  # at least the first and the last moment of the task
        per_channel = {r.channel for r in mine if r.metric == "backlog"}
        assert per_channel == {0, 1}  # producer: the consumer of each subpartition; consumer: each producer
        for r in mine:
            if r.metric.endswith("Usage"):
                assert 0.0 <= r.value <= 1.5, r
            if r.metric in ("credit", "backlog", "inputQueueLength", "isBackPressured"):
                assert r.value >= 0 and r.value == int(r.value), r
    # a blocking subpartition's backlog only grows while the producer writes, and ends at its buffer count
    for p in (0, 1):
        for c in (0, 1):
            series = [r.value for r in sorted(timeline, key=lambda r: r.time_ms)
                      if (r.side, r.subtask, r.metric, r.channel) == ("producer", p, "backlog", c)]  # fmt: skip
            assert series == sorted(series) and series[-1] > 0
            out = [r.value for r in summary if (r.side, r.subtask, r.metric, r.channel) == ("producer", p,
                   "numBuffersOut", c)]  # fmt: skip
            assert series[-1] >= out[0]
    # the consumer's credits never exceed the buffers it can hold for a channel
    cap = config.buffers_per_channel + config.floating_buffers_per_gate
    assert all(r.value <= cap for r in timeline if r.metric == "credit")


def test_timeline_off_costs_nothing_and_changes_nothing():
    received, rows = _run_blocking(NetworkConfig(metrics_sample_interval_ms=0))
    assert sum(received.values()) == 8000
    assert rows and all(r.time_ms is None for r in rows)
    with pytest.raises(ConfigError, match="metrics_sample_interval_ms"):
        NetworkConfig(metrics_sample_interval_ms=-5)
    assert NetworkConfig.from_conf({"spark.creditShuffle.metricsSampleIntervalMs": "1 s"}).metrics_sample_interval_ms
    assert NetworkConfig().metrics_sample_interval_ms == 100


def test_plots_return_figures_and_write_pngs(tmp_path):
    _, rows = _run_blocking(NetworkConfig(segment_size="4kb", metrics_sample_interval_ms=1))
    timeline = [r for r in rows if r.time_ms is not None]
    fig = plot_timeline(timeline, path=tmp_path / "timeline.png")
    # a panel per default metric that moved in the run, named in words with its unit and Flink's name; the
    # metrics that stayed 0 are listed under the figure instead of drawn empty
    present = {r.metric for r in timeline}
    moving = {r.metric for r in timeline if r.value != 0}
    drawn = [m for m in DEFAULT_TIMELINE_METRICS if m in moving]
    if "backPressuredTimeMsPerSecond" in present and "isBackPressured" in drawn:
        drawn.remove("isBackPressured")
    assert [ax.get_ylabel().split("\n[")[1].split(",")[0].rstrip("]") for ax in fig.axes] == drawn
    assert fig.axes[0].get_ylabel() == f"{METRIC_LABELS['outPoolUsage']}\n[outPoolUsage]"
    zero = [m for m in DEFAULT_TIMELINE_METRICS if m in present and m not in moving]
    assert zero and fig.get_supxlabel() == "always 0 in this run, not drawn: " + ", ".join(zero)
    assert len(fig.axes[0].get_lines()) == 2  # one line per producer subtask
    assert all(ax.get_legend() is not None for ax in fig.axes)
    assert (tmp_path / "timeline.png").read_bytes().startswith(PNG)

    fig = plot_timeline(timeline, ["credit"], side="consumer", per_channel=True)
    assert len(fig.axes) == 1 and len(fig.axes[0].get_lines()) == 4  # 2 consumers x 2 channels

    summary = [r for r in rows if r.time_ms is None]
    fig = plot_metrics(summary, "numRecordsIn", path=tmp_path / "bars.png")
    heights = collections.defaultdict(float)
    for patch in fig.axes[0].patches:
        heights[round(patch.get_x(), 3)] += patch.get_height()
    assert sum(heights.values()) == 8000 and len(heights) == 2
    assert (tmp_path / "bars.png").read_bytes().startswith(PNG)

    with pytest.raises(ConfigError, match="numRecordsIn/total"):
        plot_metrics(summary, "noSuchMetric")
    with pytest.raises(ConfigError, match="credit"):
        plot_timeline(timeline, ["noSuchMetric"])
    with pytest.raises(ConfigError, match="timeline"):
        plot_timeline(summary)
    fig = bar_chart(["a", "b"], {"with": [1.0, 2.0], "without": [2.0, 1.0]}, path=tmp_path / "b.png")
    assert len(fig.axes[0].patches) == 4
    fig = line_chart([0, 1, 10], {"throughput": [1.0, 2.0, 3.0]}, logx=True)
    assert len(fig.axes[0].get_lines()) == 1
    with pytest.raises(ConfigError):
        bar_chart(["a"], {"x": [1.0, 2.0]})


def test_the_timeout_sweep_picture_has_throughput_and_latency_per_timeout(tmp_path):
    timeouts = [0, 1, 10, 100, -1]
    fig = plot_timeout_sweep(
        timeouts, [10.0, 30.0, 32.0, 33.0, 33.0], [0.2, 1.1, 6.0, None, 40.0], [0.9, 3.0, 12.0, None, 90.0],
        path=tmp_path / "sweep.png",
    )  # fmt: skip
    top, bottom = fig.axes
    assert [round(p.get_height()) for p in top.patches] == [10, 30, 32, 33, 33]
    assert [t.get_text() for t in bottom.get_xticklabels()] == ["0 ms", "1 ms", "10 ms", "100 ms", "off (-1)"]
    p50, p99 = bottom.get_lines()
    assert list(p50.get_xdata()) == list(p99.get_xdata()) == [0, 1, 2, 4]  # no markers, no latency point
    assert (tmp_path / "sweep.png").read_bytes().startswith(PNG)
    with pytest.raises(ConfigError, match="one throughput"):
        plot_timeout_sweep(timeouts, [1.0], [1.0], [1.0])


@pytest.mark.spark
@pytest.mark.parametrize("session", ["classic", "connect"])
@pytest.mark.parametrize("mode", ["blocking", "pipelined"])
def test_exchange_timeline_is_a_dataframe_next_to_the_stable_metrics(request, tmp_path, session, mode):
    spark = request.getfixturevalue("spark" if session == "classic" else "connect_spark")
    df = spark.range(0, 3000, 1, 2).select(F.col("id"), (F.col("id") % 11).cast("int").alias("k"))
    ex = scs.exchange(
        df,
        scs.key_by("k"),
        parallelism=2,
        mode=mode,
        metrics_sample_interval_ms=2,
        segment_size="4kb",
        injection=Injection(consumer_delay_s=((0, 0.00005),)),
        local_channels="task",  # local mode has one executor: credits only on channels forced remote
    )
    assert ex.df.count() == 3000
    metrics = ex.metrics()
    assert metrics.columns == ["exchange", "mode", "side", "subtask", "channel", "metric", "stat", "value"]
    assert metrics.where(F.col("stat") == SAMPLE).count() == 0
    timeline = ex.timeline()
    assert timeline.columns == [*metrics.columns, "time_ms"]
    assert timeline.where(F.col("time_ms").isNull() | (F.col("stat") != SAMPLE)).count() == 0
    tasks = {(r["side"], r["subtask"]) for r in timeline.select("side", "subtask").distinct().collect()}
    assert tasks == {("producer", 0), ("producer", 1), ("consumer", 0), ("consumer", 1)}
    assert {r["mode"] for r in timeline.select("mode").distinct().collect()} == {mode}
    samples = timeline.groupBy("side", "subtask").agg(F.countDistinct("time_ms").alias("n")).collect()
    assert all(r["n"] >= 2 for r in samples)  # every task sampled at least at its start and its end
    names = {r["metric"] for r in timeline.select("metric").distinct().collect()}
    assert {"outPoolUsage", "isBackPressured", "backlog", "inPoolUsage", "credit", "numRecordsInPerSecond"} <= names
    fig = plot_timeline(ex, path=tmp_path / "t.png")
    assert fig.axes and (tmp_path / "t.png").exists()
    fig = plot_metrics(ex, "numBuffersOut", side="producer")
    assert sum(p.get_height() for p in fig.axes[0].patches) == sum(
        r.value for r in ex.metric_rows() if r.metric == "numBuffersOut"
    )
