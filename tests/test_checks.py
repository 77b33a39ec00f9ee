"""Everything the arguments and the schema reveal is refused on the driver, with zero Spark jobs started."""

from __future__ import annotations

import pandas as pd
import pytest
from pyspark.sql import functions as F
from spark_helpers import assert_same_rows, background_job, cluster_job, job_group, job_report, no_spark_jobs

import spark_credit_shuffle as scs
from spark_credit_shuffle.errors import ConfigError, PartitionerError
from spark_credit_shuffle.runtime import blocking, pipelined
from spark_credit_shuffle.runtime.metrics_report import IN_BAND

pytestmark = pytest.mark.spark

MODES = ["blocking", "pipelined"]


@pytest.fixture(scope="module")
def df(spark):
    return spark.createDataFrame(
        [(i, i % 5, (i, f"s{i}"), f"d{i}") for i in range(40)],
        "id long, k int, a struct<b: int, c: string>, `a.b` string",
    ).repartition(2)


@pytest.mark.parametrize("mode", MODES)
def test_bad_arguments_raise_typed_errors_before_any_job(spark, df, mode):
    key = scs.key_by("k")
    with no_spark_jobs(spark):
        with pytest.raises(ConfigError, match=r"invalid value None for argument 'df'.*DataFrame"):
            scs.exchange(None, key, 2, mode)
        with pytest.raises(ConfigError, match=r"argument 'df'.*spark.createDataFrame"):
            scs.exchange(pd.DataFrame({"k": [1, 2]}), key, 2, mode)
        with pytest.raises(ConfigError, match=r"argument 'df'.*exchange_rdd"):
            scs.exchange(df.rdd, key, 2, mode)
        with pytest.raises(ConfigError, match=r"argument 'config'.*NetworkConfig.*keyword arguments"):
            scs.exchange(df, key, 2, mode, config={"buffer_timeout_ms": 10})
        with pytest.raises(ConfigError, match=r"argument 'partitioner'"):
            scs.exchange(df, "k", 2, mode)
        with pytest.raises(ConfigError, match=r"argument 'parallelism'"):
            scs.exchange(df, key, "4", mode)
        with pytest.raises(ConfigError, match=r"argument 'num_producers'"):
            scs.exchange(df, key, 2, mode, num_producers=0)
        with pytest.raises(ConfigError, match=r"argument 'mode'"):
            scs.exchange(df, key, 2, ["blocking"])
        with pytest.raises(ConfigError, match=r"argument 'injection'"):
            scs.exchange(df, key, 2, mode, injection={"fail_once": ("producer", 0)})
        with pytest.raises(ConfigError, match=r"argument 'rdd'"):
            scs.exchange_rdd(df, key, 2, mode)
        with pytest.raises(ConfigError, match=r"argument 'df'"):
            scs.with_channel(None, key, 2)
        with pytest.raises(ConfigError, match=r"argument 'rdd'"):
            scs.rdd_with_channel(df, key, 2)


@pytest.mark.parametrize("mode", MODES)
def test_bad_key_columns_are_refused_before_any_job(spark, df, mode):
    with no_spark_jobs(spark):
        with pytest.raises(PartitionerError, match=r"key column 'nope' is not in the DataFrame; its columns are: id"):
            scs.exchange(df, scs.key_by("nope"), 2, mode)
        with pytest.raises(PartitionerError, match=r"key position 4 is out of range: the DataFrame has 4 columns"):
            scs.exchange(df, scs.key_by(4), 2, mode)
        with pytest.raises(PartitionerError, match=r"key position -5 is out of range"):
            scs.exchange(df, scs.custom(lambda k, n: k.to_numpy() % n, -5), 2, mode)
        with pytest.raises(PartitionerError, match=r"'a.c' is a nested field of column 'a'.*withColumn\('c'"):
            scs.exchange(df, scs.key_by("a.c"), 2, mode)
        with pytest.raises(PartitionerError, match=r"'a.c' is a nested field"):
            scs.exchange(df, scs.key_by(F.col("a.c")), 2, mode)
        with pytest.raises(PartitionerError, match=r"not a plain column reference.*withColumn"):
            scs.key_by(F.col("k") + 1)
        with pytest.raises(PartitionerError, match=r"not a plain column reference"):
            scs.key_by(F.col("k").alias("x"))
        with pytest.raises(PartitionerError, match=r"not a plain column reference"):
            scs.key_by(F.lit(1))
        with pytest.raises(PartitionerError, match=r"'a' has Spark type struct"):
            scs.with_channel(df, scs.key_by("a"), 2)


@pytest.mark.parametrize("mode", MODES)
def test_keys_as_column_references_positions_and_backticked_names(spark, df, mode):
    by_name = scs.with_channel(df, scs.key_by("k"), 3, column="subtask")
    for key in (scs.key_by(F.col("k")), scs.key_by(df["k"]), scs.key_by(df.k), scs.key_by(1), scs.key_by("`k`")):
        ex = scs.exchange(df, key, 3, mode)
        assert ex.plan.partitioner.columns in (("k",), (1,))
        assert_same_rows(ex.df.withColumn("subtask", F.spark_partition_id()), by_name)
    dotted = scs.exchange(df, scs.key_by(F.col("`a.b`")), 3, mode)  # a top-level column named a.b
    expected = scs.with_channel(df, scs.key_by("`a.b`"), 3, column="subtask")
    assert_same_rows(dotted.df.withColumn("subtask", F.spark_partition_id()), expected)


@pytest.mark.parametrize("mode", MODES)
def test_users_columns_named_like_internal_columns_travel_unchanged(spark, mode):
    """Columns named like the hidden ones (the placement tag, the in-band metrics column, with_channel's)."""
    df = spark.range(0, 60, 1, 2).select(
        F.col("id"),
        (F.col("id") % 7).alias("__credit_shuffle_subtask"),
        F.concat(F.lit("m"), F.col("id").cast("string")).alias("__credit_shuffle_metrics"),
        (-F.col("id")).alias("__credit_shuffle_subtask_1"),
        (F.col("id") % 2 == 0).alias("channel"),
    )
    for key in ("__credit_shuffle_subtask", "__credit_shuffle_metrics"):
        ex = scs.exchange(df, scs.key_by(key), parallelism=3, mode=mode)  # 2 -> 3: the input is placed too
        assert_same_rows(ex.df, df)
        expected = scs.with_channel(df, scs.key_by(key), 3, column="subtask")
        assert_same_rows(ex.df.withColumn("subtask", F.spark_partition_id()), expected)
        assert sum(r.value for r in ex.metric_rows() if r.metric == "numRecordsIn") == 60
    build = blocking.build if mode == "blocking" else pipelined.build
    out, collected = build(scs.exchange(df, scs.rebalance(seed=1), parallelism=3, mode=mode).plan, df, report=IN_BAND)
    assert_same_rows(out, df)
    assert sum(r.value for r in collected.rows() if r.metric == "numRecordsIn") == 60


# -- failures every retry repeats ------------------------------------------------------------------------


def with_a_null_key(spark):
    return spark.range(0, 600, 1, 3).select(
        "id", F.when(F.col("id") == 450, None).otherwise(F.col("id") % 7).alias("k")
    )


def test_null_key_fails_a_pipelined_exchange_once_with_the_typed_error(spark):
    ex = scs.exchange(with_a_null_key(spark), scs.key_by("k"), parallelism=3, mode="pipelined")
    with job_group(spark) as attempts, pytest.raises(Exception) as info:
        ex.df.count()
    message = str(info.value)
    assert "NullKeyError: producer subtask 2: key column 'k' has 1 null value(s)" in message
    assert attempts and max(attempts) == 0, f"the barrier stage ran again: attempts {attempts}"


def test_custom_partitioner_raising_fails_a_pipelined_exchange_once(spark):
    def explode(keys, n):
        raise ZeroDivisionError("no channel for you")

    df = spark.range(0, 300, 1, 2)
    ex = scs.exchange(df, scs.custom(explode, "id"), parallelism=2, mode="pipelined")
    with job_group(spark) as attempts, pytest.raises(Exception) as info:
        ex.df.collect()
    assert "PartitionerError: producer subtask" in str(info.value)
    assert "custom partitioner " in str(info.value) and "raised ZeroDivisionError: no channel for you" in str(
        info.value
    )
    assert attempts and max(attempts) == 0, f"the barrier stage ran again: attempts {attempts}"


def test_null_key_in_blocking_mode_names_column_and_subtask(spark):
    ex = scs.exchange(with_a_null_key(spark), scs.key_by("k"), parallelism=3, mode="blocking")
    with pytest.raises(Exception, match=r"NullKeyError: producer subtask 2: key column 'k' has 1 null value"):
        ex.df.count()


def test_spark_connect_column_references_are_keys_too():
    """Spark Connect's Column class (built without a server: it is only an expression here)."""
    pytest.importorskip("grpc", reason="Spark Connect's client needs pyspark[connect]")
    from pyspark.sql.connect import functions as CF

    assert scs.key_by(CF.col("k")).columns == ("k",)
    assert scs.key_by(CF.col("`a.b`"), CF.col("a.b")).columns == ("a.b", "a.b")
    with pytest.raises(PartitionerError, match=r"not a plain column reference"):
        scs.key_by(CF.col("k") + 1)


# -- what users meet on ordinary sessions and inputs: refused before any job, typed, with the way out --


@pytest.mark.parametrize("mode", MODES)
def test_a_streaming_input_is_refused_with_foreach_batch_named(spark, mode):
    stream = spark.readStream.format("rate").option("rowsPerSecond", 10).load()
    with no_spark_jobs(spark):
        with pytest.raises(scs.UnsupportedInputError, match=r"streaming DataFrame.*foreachBatch"):
            scs.exchange(stream, scs.rebalance(), 2, mode)
        with pytest.raises(scs.UnsupportedInputError, match=r"foreachBatch"):
            scs.with_channel(stream, scs.rebalance(), 2)


def test_more_producers_than_slots_names_the_partitions_and_num_producers(spark):
    df = spark.range(0, 100, 1, 6)  # local[4, 2]: 4 task slots
    with no_spark_jobs(spark):
        with pytest.raises(scs.InsufficientSlotsError, match=r"has 6 partitions.*num_producers=N with N <= 4"):
            scs.exchange(df, scs.rebalance(), 2, "pipelined")
        with pytest.raises(scs.InsufficientSlotsError, match=r"lower the parallelism") as info:
            scs.exchange(df, scs.rebalance(), 6, "pipelined", num_producers=2)
        assert "num_producers=N" not in str(info.value)
    ex = scs.exchange(df, scs.rebalance(), 2, "pipelined", num_producers=4)  # the way out it names works
    assert ex.df.count() == 100


@pytest.mark.parametrize(
    ("key", "nearest"),
    [
        ("spark.creditshuffle.bufferTimeoutMs", "spark.creditShuffle.bufferTimeoutMs"),  # the prefix's case
        ("spark.creditShuffle.bufferTimeotMs", "spark.creditShuffle.bufferTimeoutMs"),  # a typo
        ("spark.creditShuffle.buffersperchannel", "spark.creditShuffle.buffersPerChannel"),
    ],
)
def test_a_misspelt_conf_key_names_the_nearest_setting_before_any_job(spark, df, key, nearest):
    spark.conf.set(key, "5")
    try:
        with no_spark_jobs(spark), pytest.raises(scs.UnknownSettingError) as info:
            scs.exchange(df, scs.rebalance(), 2)
    finally:
        spark.conf.unset(key)
    assert str(info.value) == f"unknown setting '{key}'; did you mean '{nearest}'?"
    assert info.value.nearest == nearest


def test_a_misspelt_keyword_names_the_nearest_setting(spark, df):
    with no_spark_jobs(spark), pytest.raises(scs.UnknownSettingError, match=r"did you mean 'buffer_timeout_ms'"):
        scs.exchange(df, scs.rebalance(), 2, buffer_timeout=5)


def test_metrics_before_any_action_raise_the_same_on_classic_and_connect(any_spark):
    ex = scs.exchange(any_spark.range(0, 10, 1, 2), scs.rebalance(), 2, "blocking")
    with pytest.raises(scs.CreditShuffleError, match="no action has run"):
        ex.metrics()
    ex.df.count()
    assert ex.metrics().where("metric = 'numRecordsIn'").count() > 0


@pytest.mark.parametrize("mode", MODES)
def test_a_null_key_reaches_the_driver_as_the_typed_error(any_spark, mode):
    df = any_spark.range(0, 600, 1, 3).select(
        "id", F.when(F.col("id") == 450, None).otherwise(F.col("id") % 7).alias("k")
    )
    ex = scs.exchange(df, scs.key_by("k"), parallelism=3, mode=mode)
    expected = r"producer subtask 2: key column 'k' has 1 null value"
    with pytest.raises(scs.NullKeyError, match=expected) as info, scs.typed_errors():
        ex.df.count()
    assert info.value.__cause__ is not None  # Spark's own exception stays reachable


@pytest.mark.parametrize("mode", MODES)
def test_an_invalid_utf8_key_names_its_column(spark, mode):
    df = spark.range(0, 40, 1, 2).select(
        "id", F.when(F.col("id") == 7, F.unhex(F.lit("FFFE"))).otherwise(F.lit(b"ok")).cast("string").alias("name")
    )
    ex = scs.exchange(df, scs.key_by("name"), parallelism=2, mode=mode)
    expected = r"key column 'name': string keys must be valid UTF-8"
    with pytest.raises(scs.UnsupportedKeyTypeError, match=expected), scs.typed_errors():
        ex.df.count()


def test_typed_errors_leaves_other_errors_alone(spark):
    with pytest.raises(ZeroDivisionError), scs.typed_errors():
        raise ZeroDivisionError("not the exchange's")
    assert scs.task_error(RuntimeError("no typed error in here")) is None


_DYNAMIC_ALLOCATION_JOB = cluster_job(
    "local-cluster[1,2,1024]",
    {"spark.dynamicAllocation.enabled": "true", "spark.dynamicAllocation.shuffleTracking.enabled": "true"},
    """
    tracker = spark.sparkContext.statusTracker()
    df = spark.range(0, 2000, 1, 2)
    try:
        scs.exchange(df, scs.rebalance(), 2, "pipelined")
        refused = None
    except scs.BarrierStageError as exc:
        refused = str(exc)
    jobs_before_blocking = len(tracker.getJobIdsForGroup(None))
    rows = scs.exchange(df, scs.rebalance(), 2, "blocking").df.count()
    out = {"refused": refused, "jobs": jobs_before_blocking, "rows": rows}
    """,
)
_DYNAMIC_ALLOCATION = background_job(__file__, "dynamic-allocation", _DYNAMIC_ALLOCATION_JOB)


@pytest.mark.timeout(360)
def test_pipelined_mode_under_dynamic_allocation_is_refused_before_any_job_and_blocking_runs(pytestconfig):
    out = job_report(pytestconfig, _DYNAMIC_ALLOCATION, 240)
    assert out["refused"] is not None and "spark.dynamicAllocation.enabled" in out["refused"]
    assert "mode='blocking'" in out["refused"] and "spark.executor.instances" in out["refused"]
    assert out["jobs"] == 0, "the refusal came after a Spark job"
    assert out["rows"] == 2000
