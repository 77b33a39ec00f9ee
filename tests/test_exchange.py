"""The exchange on local Spark: every row arrives once, on the subtask Flink would pick."""

from __future__ import annotations

import collections

import pyarrow as pa
import pytest
from pyspark.sql import functions as F
from spark_helpers import assert_same_rows

import spark_credit_shuffle as scs
from spark_credit_shuffle.errors import (
    ConfigError,
    CreditShuffleError,
    InsufficientNetworkBuffersError,
    PartitionerError,
)
from spark_credit_shuffle.runtime import blocking, pipelined
from spark_credit_shuffle.runtime.metrics_report import IN_BAND, CollectedMetrics, metrics_report
from spark_credit_shuffle.runtime.session import ARROW_BATCH_BYTES_KEY, is_connect
from spark_credit_shuffle.runtime.spark_plans import num_partitions

pytestmark = pytest.mark.spark

MODES = ["blocking", "pipelined"]


def rows_df(spark, n=2000, partitions=3):
    return spark.range(0, n, 1, partitions).select(
        F.col("id").alias("id"),
        (F.col("id") % 17).cast("int").alias("k"),
        F.when(F.col("id") % 5 == 0, None).otherwise(F.concat(F.lit("v"), F.col("id").cast("string"))).alias("s"),
    )


def placed(ex_df):
    return ex_df.withColumn("_subtask", F.spark_partition_id())


def flink_channels(keys, parallelism):
    array = pa.array(keys, pa.int32())
    return scs.key_group_channels(array, parallelism, scs.default_max_parallelism(parallelism)).tolist()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "partitioner",
    [
        scs.key_by("k"),
        scs.rebalance(seed=3),
        scs.rescale(),
        scs.shuffle(seed=5),
        scs.global_(),
        scs.custom(lambda k, n: k.to_numpy() % n, "k"),
    ],
    ids=lambda p: p.name,
)
def test_output_equals_input_as_multiset(spark, mode, partitioner):
    df = rows_df(spark)
    ex = scs.exchange(df, partitioner, parallelism=4, mode=mode)
    assert_same_rows(ex.df, df)
    assert ex.df.rdd.getNumPartitions() == 4


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_delivers_every_row_to_every_consumer(any_spark, mode):
    df = rows_df(any_spark, n=500)
    ex = scs.exchange(df, scs.broadcast(), parallelism=3, mode=mode)
    out = placed(ex.df).collect()  # one run of the exchange; each consumer's rows compared on their own
    for subtask in range(3):
        received = any_spark.createDataFrame([r[:-1] for r in out if r["_subtask"] == subtask], df.schema)
        assert_same_rows(received, df)


@pytest.mark.parametrize("mode", MODES)
def test_key_by_places_each_row_on_flinks_operator_index(any_spark, mode):
    df = rows_df(any_spark)
    ex = scs.exchange(df, scs.key_by("k"), parallelism=4, mode=mode)
    got = placed(ex.df).select("k", "_subtask").distinct().collect()
    keys = [r["k"] for r in got]
    assert [r["_subtask"] for r in got] == flink_channels(keys, 4)
    assert len(keys) == len(set(keys)) == 17


@pytest.mark.parametrize("mode", MODES)
def test_rebalance_spreads_each_producers_rows_within_one(any_spark, mode):
    df = rows_df(any_spark, n=1001, partitions=3).withColumn("_producer", F.spark_partition_id())
    ex = scs.exchange(df, scs.rebalance(), parallelism=4, mode=mode)
    counts = placed(ex.df).groupBy("_producer", "_subtask").count().collect()
    per_producer = collections.defaultdict(list)
    for r in counts:
        per_producer[r["_producer"]].append(r["count"])
    assert len(per_producer) == 3
    for values in per_producer.values():
        assert len(values) == 4 and max(values) - min(values) <= 1


# pipelined mode runs max(S, T) barrier tasks at once: the test session has 4 slots
SHAPES = [(m, s) for m in MODES for s in [(1, 1), (2, 4), (4, 2), (4, 4)]] + [
    ("blocking", (2, 5)),
    ("blocking", (5, 2)),
]


@pytest.mark.parametrize("mode,shape", SHAPES)
def test_parallelism_shapes(spark, mode, shape):
    producers, consumers = shape
    df = rows_df(spark, n=700, partitions=producers)
    for partitioner in (scs.key_by("k"), scs.rebalance(), scs.rescale()):
        ex = scs.exchange(df, partitioner, parallelism=consumers, mode=mode)
        assert_same_rows(ex.df, df)
        assert ex.df.rdd.getNumPartitions() == consumers


@pytest.mark.parametrize("mode", MODES)
def test_skew_empty_partitions_and_large_rows(spark, mode):
    big = "x" * (100 * 1024)  # three segments per row
    df = spark.createDataFrame([(1, big + str(i)) for i in range(7)] + [(1, None), (1, "")], "k int, s string")
    # every row on producer 0: producers 1-3 have empty partitions
    df = df.withColumn("_p", F.lit(0)).repartitionById(4, "_p").drop("_p")
    ex = scs.exchange(df, scs.key_by("k"), parallelism=4, mode=mode)
    assert_same_rows(ex.df, df)
    sizes = placed(ex.df).groupBy("_subtask").count().collect()
    assert [(r["_subtask"], r["count"]) for r in sizes] == [(flink_channels([1], 4)[0], 9)]


@pytest.mark.parametrize("mode", MODES)
def test_metrics_count_every_record_and_buffer_once(any_spark, mode):
    """On Spark Connect the metrics travel in band (no accumulators there): the same numbers."""
    df = rows_df(any_spark, n=3000)
    ex = scs.exchange(df, scs.key_by("k"), parallelism=4, mode=mode)
    assert ex.df.count() == 3000
    m = {(r.side, r.subtask, r.channel, r.metric, r.stat): r.value for r in ex.metric_rows()}
    records_out = sum(v for (side, _, _, metric, _), v in m.items() if metric == "numRecordsOut")
    records_in = sum(v for (side, _, _, metric, _), v in m.items() if metric == "numRecordsIn")
    buffers_out = sum(v for (side, _, _, metric, _), v in m.items() if metric == "numBuffersOut")
    buffers_in = sum(v for (side, _, _, metric, _), v in m.items() if metric == "numBuffersIn")
    assert records_out == records_in == 3000
    assert buffers_out > 0 and buffers_in >= buffers_out
    for side, metric in [("producer", "outPoolUsage"), ("consumer", "inPoolUsage")]:
        values = [v for (s, _, _, name, stat), v in m.items() if s == side and name == metric and stat == "max"]
        if mode == "pipelined" and side == "consumer":  # local mode: one executor, every channel local, so
            assert values and all(v == 0.0 for v in values)  # a gate's buffers stay unused (the producers' hold)
            continue
        assert values and all(v > 0.0 for v in values), (side, metric, values)
    frame = ex.metrics()
    assert frame.columns == ["exchange", "mode", "side", "subtask", "channel", "metric", "stat", "value"]
    assert frame.where(F.col("metric") == "numRecordsIn").agg(F.sum("value")).first()[0] == 3000


@pytest.mark.parametrize("mode", MODES)
def test_metrics_in_band_as_on_spark_connect_equal_the_accumulated_ones(spark, mode):
    """Without accumulators (Spark Connect) the metrics ride a hidden column that the user never sees."""
    df = rows_df(spark, n=2000)
    ex = scs.exchange(df, scs.key_by("k"), parallelism=4, mode=mode)
    build = blocking.build if mode == "blocking" else pipelined.build
    out, collected = build(ex.plan, df, report=IN_BAND)
    assert out.columns == ex.df.columns == df.columns
    assert_same_rows(out, df)
    ex.df.write.format("noop").mode("overwrite").save()

    def records(rows):
        return sorted(
            (r.side, r.subtask, r.channel, r.metric, r.value)
            for r in rows
            if r.metric in ("numRecordsIn", "numRecordsOut")
        )

    in_band, accumulated = records(collected.rows()), records(ex.metric_rows())
    assert in_band == accumulated
    assert sum(v for side, *_, v in accumulated if side == "consumer") == 2000


def test_metrics_before_any_action_say_what_to_run(spark):
    ex = scs.exchange(rows_df(spark, n=10), scs.key_by("k"), parallelism=2)
    with pytest.raises(CreditShuffleError, match="no action has run"):
        ex.metrics()


def test_each_consumer_reports_its_first_stage_and_that_stages_latest_attempt(spark):
    report = metrics_report(spark)
    assert not report.in_band

    def rows(subtask, value):
        return [("consumer", subtask, None, "numRecordsIn", "count", value, None)]

    # (stage id, partition, task attempt id, rows): stage 7 ran subtask 0 twice (a retry); stage 9 is a
    # later action, which ran subtask 1 for the first time
    report.accumulator.add([(7, 0, 30, rows(0, 1.0)), (9, 0, 50, rows(0, 3.0)), (7, 0, 41, rows(0, 2.0))])
    report.accumulator.add([(9, 1, 51, rows(1, 4.0))])
    assert [(r.subtask, r.value) for r in CollectedMetrics(report).rows()] == [(0, 2.0), (1, 4.0)]


def test_errors_before_launch(any_spark):
    df = rows_df(any_spark, n=10)
    with pytest.raises(ConfigError, match="max_parallelism"):
        scs.exchange(df, scs.key_by("k", max_parallelism=8), parallelism=16)
    with pytest.raises(PartitionerError, match="rebalance"):
        scs.exchange(df, scs.forward(), parallelism=5)
    with pytest.raises(InsufficientNetworkBuffersError, match="networkMemory"):
        scs.exchange(df, scs.key_by("k"), parallelism=400, network_memory="4 MiB", max_parallelism=1024)
    with pytest.raises(ConfigError, match="mode"):
        scs.exchange(df, scs.key_by("k"), mode="streaming")


RETRIES = [("classic", mode, side) for mode in MODES for side in ("producer", "consumer")] + [
    ("connect", "blocking", "producer"),
    ("connect", "pipelined", "consumer"),
]


@pytest.mark.parametrize("session,mode,side", RETRIES)
def test_task_failing_once_is_retried_and_output_and_metrics_stay_exact(request, tmp_path, session, mode, side):
    spark = request.getfixturevalue("spark" if session == "classic" else "connect_spark")
    df = rows_df(spark, n=1500)
    injection = scs.Injection(fail_once=(side, 1), marker_dir=str(tmp_path))
    ex = scs.exchange(df, scs.key_by("k"), parallelism=3, mode=mode, injection=injection)
    assert_same_rows(ex.df, df)
    assert (tmp_path / f"failed-{side}-1").exists()  # the first attempt really failed
    rows = ex.metric_rows()
    assert sum(r.value for r in rows if r.metric == "numRecordsOut") == 1500
    assert sum(r.value for r in rows if r.metric == "numRecordsIn") == 1500
    consumers = {r.subtask for r in rows if r.side == "consumer"}
    producers = {r.subtask for r in rows if r.side == "producer"}
    assert consumers == {0, 1, 2} and producers == {0, 1, 2}


@pytest.mark.parametrize("session", ["classic", "connect"])
def test_blocking_exchange_bounds_the_arrow_batches_of_its_consumers_unless_the_session_does(request, session):
    spark = request.getfixturevalue("spark" if session == "classic" else "connect_spark")
    before = spark.conf.get(ARROW_BATCH_BYTES_KEY, None)
    df = rows_df(spark, n=300)
    try:
        spark.conf.unset(ARROW_BATCH_BYTES_KEY)
        scs.exchange(df, scs.key_by("k"), parallelism=2, mode="pipelined")
        assert spark.conf.get(ARROW_BATCH_BYTES_KEY, None) is None  # only the blocking consumers need it
        ex = scs.exchange(df, scs.key_by("k"), parallelism=2, mode="blocking")
        assert spark.conf.get(ARROW_BATCH_BYTES_KEY, None) == f"{blocking.CONSUMER_INPUT_BATCH_BYTES}b"
        assert_same_rows(ex.df, df)
        spark.conf.set(ARROW_BATCH_BYTES_KEY, "64k")  # the session's own bound is kept
        ex = scs.exchange(df, scs.key_by("k"), parallelism=2, mode="blocking")
        assert spark.conf.get(ARROW_BATCH_BYTES_KEY, None) == "64k"
        assert_same_rows(ex.df, df)
    finally:
        if before is None:
            spark.conf.unset(ARROW_BATCH_BYTES_KEY)
        else:
            spark.conf.set(ARROW_BATCH_BYTES_KEY, before)


def test_jobs_and_stages_are_labelled_with_the_exchange(spark, capsys):
    ex = scs.exchange(rows_df(spark, n=50), scs.rebalance(), parallelism=2)
    sc = spark.sparkContext
    before = sc.getLocalProperty("spark.job.description")
    with ex.labelled():
        assert sc.getLocalProperty("spark.job.description") == ex.plan.describe()
        assert "REBALANCE blocking exchange, 3 -> 2 subtasks" in ex.plan.describe()
        ex.df.count()
    assert sc.getLocalProperty("spark.job.description") == before
    ex.df.explain()
    plan_text = capsys.readouterr().out
    assert f"credit_shuffle_produce_{ex.name.replace('-', '_')}" in plan_text
    assert f"credit_shuffle_consume_{ex.name.replace('-', '_')}" in plan_text


def test_labelled_on_spark_connect_tags_the_exchanges_jobs(connect_spark):
    ex = scs.exchange(rows_df(connect_spark, n=50), scs.rebalance(), parallelism=2)
    tag = f"credit_shuffle_{ex.name.replace('-', '_')}"
    with ex.labelled():
        assert tag in connect_spark.getTags()
        assert ex.df.count() == 50
    assert tag not in connect_spark.getTags()


@pytest.mark.parametrize("mode", MODES)
def test_the_producer_count_is_the_inputs_partition_count_without_being_told(any_spark, mode):
    """exchange(df, key_by("k"), 4) as on classic Spark: on Spark Connect one small job counts the partitions,
    empty ones included, whatever the plan above the scan (a shuffle, local data)."""
    spark = any_spark
    inputs = {
        "range": (rows_df(spark, n=100, partitions=3), 3),
        "empty partitions": (rows_df(spark, n=100, partitions=4).where(F.col("id") < 10), 4),
        "after a shuffle": (rows_df(spark, n=100, partitions=1).repartition(3), 3),
        "local data": (spark.createDataFrame([(i, i % 17, None) for i in range(2)], "id long, k int, s string"), None),
    }
    for name, (df, partitions) in inputs.items():
        counted = num_partitions(df)
        if partitions is not None:
            assert counted == partitions, name
        if not is_connect(spark):
            assert counted == df.rdd.getNumPartitions(), name
    df, _ = inputs["empty partitions"]
    ex = scs.exchange(df, scs.key_by("k"), 4, mode=mode)
    assert (ex.plan.num_producers, ex.plan.num_consumers) == (4, 4)
    assert_same_rows(ex.df, df)
    assert sorted({r.subtask for r in ex.metric_rows() if r.side == "producer"}) == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", MODES)
def test_an_input_without_partitions_gives_an_empty_exchange(any_spark, mode):
    spark = any_spark
    df = rows_df(spark, n=0, partitions=4)  # no rows, no partitions
    assert num_partitions(df) == 0
    for parallelism, consumers in ((None, 0), (3, 3)):
        ex = scs.exchange(df, scs.key_by("k"), parallelism, mode=mode)
        assert (ex.plan.num_producers, ex.plan.num_consumers) == (0, consumers)
        assert ex.df.schema == df.schema and ex.df.count() == 0
        assert num_partitions(ex.df) == consumers  # partition i is consumer subtask i, which received nothing
        assert ex.metric_rows() == [] and ex.timeline_rows() == []
        assert ex.metrics().count() == 0 and ex.timeline().count() == 0
        assert ex.metrics().columns == ["exchange", "mode", "side", "subtask", "channel", "metric", "stat", "value"]
    with pytest.raises(ConfigError, match="max_parallelism"):  # the arguments are checked all the same
        scs.exchange(df, scs.key_by("k", max_parallelism=8), parallelism=16, mode=mode)


def test_rdd_and_transform_forms(spark):
    rdd = spark.sparkContext.parallelize([(i, i % 17) for i in range(300)], 3)
    ex = scs.exchange_rdd(rdd, scs.key_by("_2"), parallelism=4)
    parts = ex.rdd.glom().collect()
    assert len(parts) == 4
    assert sorted(tuple(r) for part in parts for r in part) == [(i, i % 17) for i in range(300)]
    for subtask, part in enumerate(parts):
        assert all(flink_channels([r[1]], 4)[0] == subtask for r in part)
    df = rows_df(spark, n=100)
    out = df.transform(scs.exchanged(scs.rebalance(seed=1), 2))
    assert_same_rows(out, df)
    assert out.rdd.getNumPartitions() == 2


@pytest.mark.parametrize("mode", MODES)
def test_parallelism_above_32768_is_refused_before_launch(spark, mode):
    # given a DataFrame; when it is exchanged, or its channels computed, for 40,000 consumers
    df = rows_df(spark, n=10, partitions=1)
    for call in (
        lambda: scs.exchange(df, scs.rebalance(), parallelism=40000, mode=mode),
        lambda: scs.with_channel(df, scs.key_by("k"), parallelism=40000),
    ):
        # then a typed error names the parallelism and Flink's bound before any Spark job starts
        with pytest.raises(ConfigError, match=r"40000.*Operator parallelism not within bounds"):
            call()
