"""Summary and diagnosis of a run: Flink's back-pressure status per subtask, where backpressure starts, data
skew told apart; from metric rows alone, and from real exchanges on Spark."""

from __future__ import annotations

import dataclasses

import pytest
from pyspark.sql import functions as F

import spark_credit_shuffle as scs
from spark_credit_shuffle.diagnosis import HIGH, LOW, OK, back_pressure_status, diagnose, summarize
from spark_credit_shuffle.metrics import CONSUMER, PRODUCER, MetricRow


def test_flinks_back_pressure_levels():
    assert [back_pressure_status(v) for v in (0.0, 100.0, 100.1, 500.0, 500.1, 1000.0)] == [
        OK,
        OK,
        LOW,
        LOW,
        HIGH,
        HIGH,
    ]
    assert back_pressure_status(None) is None


def run_rows(records_in, back_pressured, busy, records_out=None):
    """Metric rows of a run: per consumer ``records_in`` (over two channels) and busy ms/s, per producer its
    back-pressured ms/s."""
    rows = []
    for p, bp in enumerate(back_pressured):
        out = (records_out or [sum(records_in) // len(back_pressured)] * len(back_pressured))[p]
        rows += [
            MetricRow(PRODUCER, p, 0, "numRecordsOut", "total", float(out)),
            MetricRow(PRODUCER, p, None, "backPressuredTimeMsPerSecond", "mean", bp),
            MetricRow(PRODUCER, p, None, "busyTimeMsPerSecond", "mean", 1000.0 - bp),
            MetricRow(PRODUCER, p, None, "accumulateBusyTimeMs", "total", 2000.0 - 2 * bp),
            MetricRow(PRODUCER, p, None, "accumulateBackPressuredTimeMs", "total", 2 * bp),
            MetricRow(PRODUCER, p, None, "outPoolUsage", "max", 1.0 if bp else 0.2),
            MetricRow(PRODUCER, p, None, "outPoolUsage", "sample", 0.5, 12.0),  # a timeline row: left out
        ]
    for c, (n, b) in enumerate(zip(records_in, busy)):
        rows += [
            MetricRow(CONSUMER, c, 0, "numRecordsIn", "total", float(n // 2)),
            MetricRow(CONSUMER, c, 1, "numRecordsIn", "total", float(n - n // 2)),
            MetricRow(CONSUMER, c, None, "busyTimeMsPerSecond", "mean", b),
            MetricRow(CONSUMER, c, None, "backPressuredTimeMsPerSecond", "mean", 0.0),
        ]
    return rows


def test_summary_sums_channels_and_rates_from_the_subtasks_life():
    summaries = summarize(run_rows([300, 100], back_pressured=[800.0, 0.0], busy=[990.0, 40.0]))
    assert [(s.side, s.subtask) for s in summaries] == [(PRODUCER, 0), (PRODUCER, 1), (CONSUMER, 0), (CONSUMER, 1)]
    p0, p1, c0, c1 = summaries
    assert (p0.records, p0.back_pressure, p0.pool_usage_max) == (200, HIGH, 1.0)
    assert p0.records_per_second == pytest.approx(200 / 2.0)  # 2000 ms of life
    assert (p1.back_pressure, c0.records, c1.records) == (OK, 300, 100)
    assert isinstance(c0.records, int) and c0.records_per_second is None  # no life time reported


def test_backpressure_starts_at_the_busy_consumer_the_back_pressured_producers_send_to():
    d = diagnose(summarize(run_rows([200, 200], back_pressured=[700.0, 300.0], busy=[50.0, 995.0])))
    assert (d.verdict, d.origin, d.back_pressured) == ("backpressure", 1, (0, 1))
    assert "backpressure starts at consumer subtask 1" in str(d) and "skew" not in str(d)


def test_a_skewed_consumer_nearly_as_busy_as_the_busiest_is_where_backpressure_starts():
    d = diagnose(summarize(run_rows([900, 100, 100], back_pressured=[600.0, 300.0, 0.0], busy=[900.0, 944.0, 10.0])))
    assert (d.verdict, d.origin) == ("backpressure", 0) and "the cause is data skew" in str(d)


def test_skew_beside_a_busier_consumer_is_named_too():
    """The busiest consumer is where backpressure starts; a skewed one well below it (on a loaded machine busy
    times crowd together) is still named, as skew."""
    d = diagnose(summarize(run_rows([900, 100, 100], back_pressured=[600.0, 300.0, 0.0], busy=[500.0, 944.0, 10.0])))
    assert (d.verdict, d.origin) == ("backpressure", 1) and "the cause is data skew" not in str(d)
    assert "there is data skew too: consumer subtask 0 receives 2.5x" in str(d)


def test_skew_is_named_as_the_cause_of_backpressure_or_alone():
    d = diagnose(summarize(run_rows([900, 100, 100], back_pressured=[900.0, 0.0, 0.0], busy=[999.0, 10.0, 10.0])))
    assert (d.verdict, d.origin) == ("backpressure", 0) and d.skew == pytest.approx(900 / (1100 / 3))
    assert "the cause is data skew" in str(d)
    d = diagnose(summarize(run_rows([900, 100, 100], back_pressured=[0.0, 0.0, 0.0], busy=[300.0, 30.0, 30.0])))
    assert (d.verdict, d.origin, d.back_pressured) == ("skew", 0, ())


def test_a_slow_consumer_where_nothing_measures_backpressure_is_a_straggler():
    def blocking_run(busy_ms):
        rows = [MetricRow(PRODUCER, p, 0, "numRecordsOut", "total", 500.0) for p in range(2)]
        for c, ms in enumerate(busy_ms):
            rows.append(MetricRow(CONSUMER, c, 0, "numRecordsIn", "total", 500.0))
            rows.append(MetricRow(CONSUMER, c, None, "accumulateBusyTimeMs", "total", ms))
        return summarize(rows)

    d = diagnose(blocking_run([3100.0, 210.0]))
    assert (d.verdict, d.origin) == ("straggler", 0) and "consumer subtask 0 was busy 3.10 s" in str(d)
    assert diagnose(blocking_run([260.0, 210.0])).verdict == "ok"
    assert diagnose(blocking_run([60.0, 5.0])).verdict == "ok"  # too short to tell


def test_a_healthy_run_and_an_idle_one():
    d = diagnose(summarize(run_rows([500, 520], back_pressured=[20.0, 0.0], busy=[400.0, 410.0])))
    assert d.verdict == "ok" and d.origin is None
    assert diagnose(summarize(run_rows([0, 0], back_pressured=[0.0, 0.0], busy=[0.0, 0.0]))).verdict == "idle"
    assert diagnose([]).verdict == "idle"


def timed_rows(producers, consumers, records=1000, seconds=4.0):
    """Metric rows of a pipelined run of ``seconds``: ``producers`` and ``consumers`` as (busy, idle,
    back-pressured) ms/s."""
    rows = []
    for side, times, metric in ((PRODUCER, producers, "numRecordsOut"), (CONSUMER, consumers, "numRecordsIn")):
        for i, (busy, idle, bp) in enumerate(times):
            rows += [
                MetricRow(side, i, 0, metric, "total", float(records)),
                MetricRow(side, i, None, "busyTimeMsPerSecond", "mean", busy),
                MetricRow(side, i, None, "idleTimeMsPerSecond", "mean", idle),
                MetricRow(side, i, None, "backPressuredTimeMsPerSecond", "mean", bp),
                MetricRow(side, i, None, "accumulateBusyTimeMs", "total", seconds * busy),
                MetricRow(side, i, None, "accumulateIdleTimeMs", "total", seconds * idle),
                MetricRow(side, i, None, "accumulateBackPressuredTimeMs", "total", seconds * bp),
            ]
    return rows


PRESSED = [(100.0, 50.0, 850.0)] * 4


def test_backpressure_no_single_consumer_explains_names_no_consumer():
    """Four tasks sharing two cores: every consumer partly busy, partly idle, the producers waiting (LOW)."""
    consumers = [(486.0, 421.0, 93.0), (380.0, 567.0, 53.0), (687.0, 206.0, 107.0), (558.0, 442.0, 0.0)]
    producers = [(786.0, 30.0, 184.0), (498.0, 30.0, 472.0), (658.0, 33.0, 309.0), (551.0, 34.0, 415.0)]
    d = diagnose(summarize(timed_rows(producers, consumers)))
    assert (d.verdict, d.origin, d.back_pressured) == ("spread", None, (0, 1, 2, 3))
    assert "no single consumer explains" in d.text and "consumer subtask" not in d.text
    assert d.figures["consumers_busy_ms_per_second"] == pytest.approx(522.0)


def test_a_busy_consumer_whose_peers_starve_is_the_origin_and_its_figures_come_with_it():
    consumers = [(33.0, 967.0, 0.0), (36.0, 964.0, 0.0), (997.0, 3.0, 0.0), (27.0, 973.0, 0.0)]
    d = diagnose(summarize(timed_rows(PRESSED, consumers)))
    assert (d.verdict, d.origin) == ("backpressure", 2)
    assert d.figures["origin_busy_ms_per_second"] == 997.0 and d.figures["others_idle_ms_per_second"] == 967.0
    assert "wait for data (964-973 ms/s idle)" in d.text
    # twice as busy as the others while they wait for data more than they work: still the origin
    loaded = [(450.0, 500.0, 50.0), (420.0, 560.0, 20.0), (990.0, 10.0, 0.0), (400.0, 550.0, 50.0)]
    assert diagnose(summarize(timed_rows(PRESSED, loaded))).verdict == "backpressure"
    # but busy alone is not enough: the others busy too, hardly idle, is a loaded machine, not a slow consumer
    crowded = [(600.0, 100.0, 0.0), (580.0, 120.0, 0.0), (990.0, 10.0, 0.0), (560.0, 140.0, 0.0)]
    assert diagnose(summarize(timed_rows(PRESSED, crowded))).origin is None


def test_a_consumer_waiting_to_hand_on_its_output_points_downstream():
    consumers = [(25.0, 783.0, 193.0), (37.0, 810.0, 154.0), (31.0, 73.0, 897.0), (28.0, 884.0, 88.0)]
    d = diagnose(summarize(timed_rows(PRESSED, consumers)))
    assert (d.verdict, d.origin) == ("downstream", 2)
    assert "the step that follows the exchange on partition 2 is slow" in d.text
    assert d.figures["origin_back_pressured_ms_per_second"] == 897.0
    everywhere = [(80.0, 250.0, 670.0), (40.0, 330.0, 630.0), (90.0, 313.0, 597.0), (65.0, 528.0, 407.0)]
    d = diagnose(summarize(timed_rows(PRESSED, everywhere)))
    assert (d.verdict, d.origin) == ("downstream", None) and "no one partition stands out" in d.text


def test_a_skewed_consumer_that_works_most_is_the_origin_even_when_its_output_waits():
    """The hot key's consumer spends its time decoding and handing its rows on; the others starve."""
    consumers = [(109.0, 891.0, 0.0), (17.0, 972.0, 11.0), (31.0, 969.0, 0.0), (215.0, 371.0, 414.0)]
    rows = [  # consumer 3 receives 80% of the rows
        dataclasses.replace(r, value=8000.0 if r.subtask == 3 else 700.0)
        if (r.side, r.metric) == (CONSUMER, "numRecordsIn")
        else r
        for r in timed_rows(PRESSED, consumers)
    ]
    d = diagnose(summarize(rows))
    assert (d.verdict, d.origin) == ("backpressure", 3) and "the cause is data skew" in d.text


def test_busy_producers_and_idle_consumers_are_source_bound_but_a_healthy_run_is_ok():
    busy_producers = [(960.0, 30.0, 10.0)] * 4
    d = diagnose(summarize(timed_rows(busy_producers, [(25.0, 975.0, 0.0)] * 4)))
    assert (d.verdict, d.origin, d.back_pressured) == ("source-bound", None, ())
    assert "the producers are busy" in d.text
    # producers waiting for Spark's input is how a healthy run looks too (Spark's hand-over sets the pace): ok,
    # with that said
    waiting_producers = [(80.0, 910.0, 10.0)] * 4
    d = diagnose(summarize(timed_rows(waiting_producers, [(25.0, 975.0, 0.0)] * 4)))
    assert d.verdict == "ok" and "the producers waited for their input 910 ms/s" in d.text
    healthy = diagnose(summarize(timed_rows([(800.0, 150.0, 50.0)] * 4, [(300.0, 650.0, 50.0)] * 4)))
    assert healthy.verdict == "ok"
    blocking = diagnose(summarize(timed_rows(busy_producers, [(25.0, 975.0, 0.0)] * 4)), mode="blocking")
    assert blocking.verdict == "ok"  # its consumers start after its producers ended: idle says nothing of them
    # the same rates over a run of 20 ms (a small query's producers, each writing one input batch as it came)
    # are too short to tell: producers busy 19 ms are no slow source
    short = diagnose(summarize(timed_rows(busy_producers, [(25.0, 975.0, 0.0)] * 4, seconds=0.02)))
    assert short.verdict == "ok"


# -- on Spark ------------------------------------------------------------------------------------------


def rows_df(spark, n):
    return spark.range(0, n, 1, 2).select("id", (F.col("id") % 101).cast("int").alias("k"))


@pytest.mark.spark
def test_the_readme_quick_start_query_is_ok_whatever_its_tasks_rates(spark):
    """The README's quick start, small: its producers live a few ms, their rates of busy time say nothing, and
    the diagnosis of this healthy run is ok (it was once called source-bound from such rates)."""
    df = spark.range(0, 20_000, 1, 4).select("id", (F.col("id") % 1000).alias("user_id"))
    for _ in range(3):
        ex = scs.exchange(df, scs.key_by("user_id"), parallelism=4, mode="pipelined")
        assert ex.df.count() == 20_000
        d = ex.diagnose()
        assert d.verdict == "ok", (d.text, ex.summary_rows())


@pytest.mark.spark
def test_a_slow_consumer_is_where_backpressure_starts(spark):
    # consumer 0 takes 0.1 ms per row; rebalance sends it half of every producer's rows (3 s of its time), far
    # more than the buffers in flight hold: the producers wait for buffers most of their time
    ex = scs.exchange(
        rows_df(spark, 60_000),
        scs.rebalance(),
        2,
        mode="pipelined",
        injection=scs.Injection(consumer_delay_s=((0, 0.0001),)),
        segment_size="4kb",
    )
    assert ex.df.count() == 60_000
    summary = {(r.side, r.subtask): r for r in ex.summary(full=True).collect()}
    assert {summary[(PRODUCER, p)].back_pressure for p in (0, 1)} == {HIGH}
    assert sum(summary[(CONSUMER, c)].records for c in (0, 1)) == 60_000
    assert isinstance(summary[(CONSUMER, 0)].records, int)
    executors = {r.executor for r in summary.values()}  # local mode: one executor, named by its host:port
    assert len(executors) == 1 and next(iter(executors)).rsplit(":", 1)[-1].isdigit(), executors
    diagnosis = ex.diagnose()
    assert (diagnosis.verdict, diagnosis.origin, diagnosis.back_pressured) == ("backpressure", 0, (0, 1))
    assert diagnosis.executor == summary[(CONSUMER, 0)].executor and f"(on {diagnosis.executor})" in str(diagnosis)


@pytest.mark.spark
def test_a_slow_consumer_in_blocking_mode_is_the_straggler(spark):
    # consumer 0 sleeps 1 ms per row (3 s for its 3,000), far above what the other consumer's rows cost even
    # when the machine is busy: a consumer's busy time includes the time Spark takes to read its output, which
    # a busy machine or a pause of the JVM stretches
    ex = scs.exchange(
        rows_df(spark, 6_000),
        scs.rebalance(),
        2,
        mode="blocking",
        injection=scs.Injection(consumer_delay_s=((0, 0.001),)),
    )
    assert ex.df.count() == 6_000
    diagnosis = ex.diagnose()
    assert (diagnosis.verdict, diagnosis.origin) == ("straggler", 0), (diagnosis, ex.summary_rows())


@pytest.mark.spark
@pytest.mark.parametrize("mode", ["blocking", "pipelined"])
def test_skewed_keys_are_skew_and_an_even_exchange_is_ok(spark, mode):
    df = rows_df(spark, 6000).withColumn("hot", F.when(F.col("id") % 10 < 8, F.lit(7)).otherwise(F.col("k")))
    skewed = scs.exchange(df, scs.key_by("hot"), 3, mode=mode)
    skewed.df.count()
    diagnosis = skewed.diagnose()
    assert diagnosis.verdict == "skew" and diagnosis.skew >= 2.0, diagnosis
    even = scs.exchange(df, scs.rebalance(), 3, mode=mode)
    even.df.count()
    assert even.diagnose().verdict == "ok", even.diagnose()
    if mode == "pipelined":
        assert {r.back_pressure for r in even.summary().where("side = 'producer'").collect()} == {OK}


# -- from a DataFrame to its exchange ---------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.parametrize("mode", ["blocking", "pipelined"])
def test_the_dataframe_method_and_the_exchange_found_from_a_result(any_spark, mode):
    scs.install_dataframe_method()  # importing the package adds no method to PySpark's DataFrame: this call does
    df = any_spark.range(0, 1000, 1, 2).select("id", (F.col("id") % 7).alias("k"))
    result = df.creditShuffle(scs.key_by("k"), 3, mode).where("id >= 0")
    assert result.count() == 1000
    ex = scs.exchange_of(result)
    assert (ex.plan.num_consumers, ex.plan.mode) == (3, mode)
    assert sum(s.records for s in ex.summary_rows() if s.side == CONSUMER) == 1000
    assert ex.diagnose().verdict in ("ok", "skew")
    chained = df.transform(scs.exchanged(scs.rebalance(), 2, mode)).transform(scs.exchanged(scs.key_by("k"), 2, mode))
    assert [e.plan.partitioner.name for e in scs.exchanges_of(chained)] == ["HASH", "REBALANCE"]  # outermost first
    with pytest.raises(scs.ConfigError, match=r"its plan holds 2 exchanges"):
        scs.exchange_of(chained)
    with pytest.raises(scs.ConfigError, match=r"its plan holds no exchange"):
        scs.exchange_of(df)


def test_the_dataframe_method_never_replaces_an_existing_one(spark):
    scs.install_dataframe_method()
    with pytest.raises(scs.ConfigError, match=r"it has that attribute already"):
        scs.install_dataframe_method("filter")
    scs.install_dataframe_method()  # again under its own name: allowed, the same method
    assert spark.range(3).creditShuffle(scs.rebalance(), 1).count() == 3


@pytest.mark.spark
def test_the_readme_quick_start_runs(spark, tmp_path, monkeypatch, capsys):
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("## Quick start")
    code = readme[readme.index("```python\n", start) + len("```python\n") :]
    code = code[: code.index("```")]
    code = code.replace("1_000_000", "20_000")  # small data; the session is the tests' (getOrCreate returns it)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    exec(compile(code, "README quick start", "exec"), {})
    assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert "back_pressure" in out and ("ok:" in out or "skew" in out or "backpressure starts" in out)
