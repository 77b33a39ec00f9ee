"""Partitioners on Spark: with_channel on DataFrames and rdd_with_channel on RDDs (local session, tiny data)."""

from __future__ import annotations

import uuid
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pytest
from pyspark.sql import Row
from pyspark.sql import functions as F

from spark_credit_shuffle import (
    ConfigError,
    PartitionerError,
    UnsupportedKeyTypeError,
    broadcast,
    custom,
    forward,
    global_,
    key_by,
    key_group_channels,
    rdd_with_channel,
    rebalance,
    rescale,
    shuffle,
    with_channel,
)

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def keyed(spark):
    """24 rows of every key type in 3 partitions, with the partition each row is in."""
    data = [
        (i, i - 12, 1000 * i - 5000, 10**12 * i - 7, i % 2 == 0, i / 3 - 2.5, float(i) / 7, f"k{i}é" if i % 5 else "😀")
        for i in range(24)
    ]
    schema = "b byte, s short, i int, l long, flag boolean, f float, d double, name string"
    df = spark.createDataFrame(data, schema).repartition(3).withColumn("producer", F.spark_partition_id())
    return df.cache()


def by_producer(result_rows, key="producer"):
    groups = defaultdict(list)
    for row in result_rows:
        groups[row[key]].append(row)
    return groups


@pytest.mark.parametrize(
    "column, arrow_type",
    [
        ("b", pa.int8()),
        ("s", pa.int16()),
        ("i", pa.int32()),
        ("l", pa.int64()),
        ("flag", pa.bool_()),
        ("f", pa.float32()),
        ("d", pa.float64()),
        ("name", pa.string()),
    ],
)
def test_with_channel_key_by_matches_key_group_channels_for_every_type(keyed, column, arrow_type):
    result = with_channel(keyed, key_by(column), parallelism=5).collect()
    keys = pa.array([row[column] for row in result], type=arrow_type)
    assert [row.channel for row in result] == key_group_channels(keys, 5, 128).tolist()


def test_with_channel_output_schema(keyed):
    result = with_channel(keyed, key_by("i"), parallelism=4, column="target")
    assert result.columns == [*keyed.columns, "target"]
    assert result.schema["target"].dataType.simpleString() == "int"


def test_rebalance_runs_one_selector_per_spark_partition(keyed):
    result = with_channel(keyed, rebalance(seed=42), parallelism=4).collect()
    groups = by_producer(result)
    assert sorted(groups) == [0, 1, 2]
    for producer, producer_rows in groups.items():
        expected = (
            rebalance(seed=42).selector(producer, 3, 4).select_channels(pa.table({"x": [0] * len(producer_rows)}))
        )
        assert [row.channel for row in producer_rows] == expected.tolist()


def test_default_parallelism_is_the_producer_count(keyed):
    result = with_channel(keyed, shuffle(seed=1)).collect()
    assert {row.channel for row in result} <= {0, 1, 2}
    result = with_channel(keyed, forward()).collect()
    assert all(row.channel == row.producer for row in result)


def test_with_channel_on_spark_connect_counts_the_producers_itself(connect_spark):
    df = connect_spark.range(0, 60, 1, 3).withColumn("producer", F.spark_partition_id())
    assert all(row.channel == row.producer for row in with_channel(df, forward()).collect())
    result = with_channel(df, rescale(), parallelism=6).collect()
    assert {(row.producer, row.channel) for row in result} == {(p, 2 * p + i) for p in range(3) for i in range(2)}
    empty = connect_spark.range(0, 0, 1, 3)
    assert with_channel(empty, key_by("id"), parallelism=4).collect() == []


def test_rescale_follows_the_pointwise_wiring(keyed):
    result = with_channel(keyed, rescale(), parallelism=6).collect()
    for producer, producer_rows in by_producer(result).items():
        channels = [row.channel for row in producer_rows]
        first, second = 2 * producer, 2 * producer + 1
        assert channels == [first, second] * (len(channels) // 2) + [first] * (len(channels) % 2)
    narrowed = with_channel(keyed, rescale(), parallelism=1).collect()
    assert {row.channel for row in narrowed} == {0}


def test_broadcast_yields_each_row_once_per_consumer(keyed):
    result = with_channel(keyed, broadcast(), parallelism=4).collect()
    assert len(result) == 4 * keyed.count()
    per_row = defaultdict(list)
    for row in result:
        per_row[row.i].append(row.channel)
    assert all(sorted(channels) == [0, 1, 2, 3] for channels in per_row.values())


def test_global_and_custom(keyed):
    assert {row.channel for row in with_channel(keyed, global_(), parallelism=3).collect()} == {0}
    result = with_channel(keyed, custom(lambda k, n: np.abs(k) % n, "i", as_numpy=True), parallelism=4).collect()
    assert [row.channel for row in result] == [abs(row.i) % 4 for row in result]


def test_null_keys_zero_on_a_dataframe(spark):
    df = spark.createDataFrame([(1,), (None,), (3,)], "k int").coalesce(1)
    result = with_channel(df, key_by("k", null_keys="zero"), parallelism=2).collect()
    expected = key_group_channels(pa.array([1, 0, 3], type=pa.int32()), 2, 128).tolist()
    assert [row.channel for row in result] == expected


def test_null_keys_fail_the_task_naming_the_column(spark):
    df = spark.createDataFrame([(1,), (None,)], "user_id int").coalesce(1)
    with pytest.raises(Exception, match=r"NullKeyError.*'user_id'"):
        with_channel(df, key_by("user_id"), parallelism=2).collect()


def test_max_parallelism_precedence_keyword_over_conf_over_default(spark, keyed):
    keys = None
    try:
        spark.conf.set("spark.creditShuffle.maxParallelism", "256")
        from_conf = with_channel(keyed, key_by("l"), parallelism=7).collect()
        keys = pa.array([row.l for row in from_conf], type=pa.int64())
        assert [row.channel for row in from_conf] == key_group_channels(keys, 7, 256).tolist()
        keyword = with_channel(keyed, key_by("l"), parallelism=7, max_parallelism=1000).collect()
        assert [row.channel for row in keyword] == key_group_channels(keys, 7, 1000).tolist()
        own = with_channel(keyed, key_by("l", max_parallelism=4096), parallelism=7, max_parallelism=1000).collect()
        assert [row.channel for row in own] == key_group_channels(keys, 7, 4096).tolist()
        spark.conf.set("spark.creditShuffle.maxParallelism", "40000")
        with pytest.raises(ConfigError, match=r"maxParallelism|max_parallelism"):
            with_channel(keyed, key_by("l"), parallelism=7)
    finally:
        spark.conf.unset("spark.creditShuffle.maxParallelism")
    default = with_channel(keyed, key_by("l"), parallelism=7).collect()
    assert [row.channel for row in default] == key_group_channels(keys, 7, 128).tolist()


def test_errors_are_raised_before_any_spark_job(spark, keyed):
    sc = spark.sparkContext
    group = f"no-jobs-{uuid.uuid4()}"
    sc.setJobGroup(group, "errors before launch")
    try:
        with pytest.raises(PartitionerError, match=r"Forward partitioning does not allow change of parallelism"):
            with_channel(keyed, forward(), parallelism=5)
        with pytest.raises(ConfigError, match=r"at most max_parallelism"):
            with_channel(keyed, key_by("i"), parallelism=300, max_parallelism=256)
        with pytest.raises(ConfigError, match=r"at most max_parallelism"):
            with_channel(keyed, key_by("i", max_parallelism=128), parallelism=129)
        with pytest.raises(PartitionerError, match=r"'nope' is not in the DataFrame"):
            with_channel(keyed, key_by("nope"), parallelism=2)
        with pytest.raises(ConfigError, match=r"'channel'"):
            with_channel(with_channel(keyed, global_(), parallelism=2), global_(), parallelism=2)
        with pytest.raises(ConfigError, match=r"partitioner"):
            with_channel(keyed, "hash", parallelism=2)
        assert list(sc.statusTracker().getJobIdsForGroup(group)) == []
        # a stated producer count below the real one can only be caught in the tasks: that one does run
        sc.setJobGroup(f"{group}-task", "runs")
        with pytest.raises(Exception, match=r"PartitionerError.*num_producers is 2"):
            with_channel(keyed, rescale(), parallelism=4, num_producers=2).collect()
        assert list(sc.statusTracker().getJobIdsForGroup(f"{group}-task")) != []  # the tracker does see jobs
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)


def test_unsupported_spark_key_types_are_refused_up_front(spark):
    df = spark.createDataFrame([(b"x", 1)], "payload binary, n int")
    with pytest.raises(UnsupportedKeyTypeError, match=r"'payload' has Spark type binary"):
        with_channel(df, key_by("payload"), parallelism=2)


# -- RDDs ------------------------------------------------------------------------------------------


def test_rdd_with_channel_on_rows_dicts_and_tuples(spark):
    sc = spark.sparkContext
    rows = [Row(k=i - 5, v=str(i)) for i in range(12)]
    longs = key_group_channels(pa.array([r.k for r in rows], type=pa.int64()), 4, 128).tolist()
    ints = key_group_channels(pa.array([r.k for r in rows], type=pa.int32()), 4, 128).tolist()
    assert [c for c, _ in rdd_with_channel(sc.parallelize(rows, 3), key_by("k"), parallelism=4).collect()] == longs
    as_int = rdd_with_channel(sc.parallelize(rows, 3), key_by("k"), parallelism=4, key_types=pa.int32()).collect()
    assert [c for c, _ in as_int] == ints
    assert [e for _, e in as_int] == rows
    dicts = [r.asDict() for r in rows]
    assert [c for c, _ in rdd_with_channel(sc.parallelize(dicts, 2), key_by("k"), parallelism=4).collect()] == longs
    tuples = [(r.k, r.v) for r in rows]
    got = rdd_with_channel(sc.parallelize(tuples, 2), key_by(0, 1), parallelism=4).collect()
    expected = key_group_channels([pa.array([t[0] for t in tuples]), pa.array([t[1] for t in tuples])], 4, 128)
    assert [c for c, _ in got] == expected.tolist()


def test_rdd_with_channel_round_robin_per_partition_and_broadcast(spark):
    sc = spark.sparkContext
    rdd = sc.parallelize(range(10), 2)
    got = rdd.mapPartitionsWithIndex(lambda i, it: [(i, x) for x in it]).zip(
        rdd_with_channel(rdd, rebalance(seed=4), parallelism=3)
    )
    per_partition = defaultdict(list)
    for (producer, element), (channel, same) in got.collect():
        assert element == same
        per_partition[producer].append(channel)
    for producer, channels in per_partition.items():
        selector = rebalance(seed=4).selector(producer, 2, 3)
        assert channels == selector.select_channels(pa.table({"x": [0] * len(channels)})).tolist()
    pairs = rdd_with_channel(rdd, broadcast(), parallelism=3).collect()
    assert sorted(pairs) == sorted((c, x) for x in range(10) for c in range(3))


def test_rdd_with_channel_checks_before_running(spark):
    rdd = spark.sparkContext.parallelize(range(4), 2)
    with pytest.raises(PartitionerError, match=r"Forward partitioning"):
        rdd_with_channel(rdd, forward(), parallelism=3)
    with pytest.raises(ConfigError, match=r"key_types"):
        rdd_with_channel(rdd, key_by(0), parallelism=3, key_types=[pa.int32(), pa.int64()])
    with pytest.raises(ConfigError, match=r"at most max_parallelism"):
        rdd_with_channel(rdd, key_by(0), parallelism=3, max_parallelism=2)
