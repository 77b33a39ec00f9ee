"""Identity placement on every supported pyspark: repartitionById, or Spark's hash on a per-partition key."""

from __future__ import annotations

import struct

import mmh3
import numpy as np
import pytest
from pyspark.sql import functions as F
from spark_helpers import assert_same_rows

import spark_credit_shuffle as scs
from spark_credit_shuffle.partitioners.murmur3 import spark_hash_partition_keys, spark_int_hashes
from spark_credit_shuffle.runtime import placement
from spark_credit_shuffle.runtime.placement import place_by


def test_spark_int_hashes_are_murmur3_x86_32_with_seed_42():
    values = np.array([0, 1, -1, 7, 42, 2**31 - 1, -(2**31), 123456789, -987654321], dtype=np.int64)
    expected = [mmh3.hash(struct.pack("<i", int(v)), 42, signed=True) for v in values]
    assert spark_int_hashes(values).tolist() == expected


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 200, 1000])
def test_partition_keys_land_on_their_partition_and_are_the_smallest(n):
    keys = spark_hash_partition_keys(n)
    assert np.mod(spark_int_hashes(keys).astype(np.int64), n).tolist() == list(range(n))
    smaller = np.arange(int(keys.max()), dtype=np.int64)
    partitions = np.mod(spark_int_hashes(smaller).astype(np.int64), n)
    for p, key in enumerate(keys.tolist()):
        assert not (partitions[:key] == p).any()


@pytest.mark.spark
def test_spark_agrees_with_the_hashes(spark):
    values = spark.range(-500, 500, 1, 2).select(F.col("id").cast("int").alias("v"), F.hash(F.col("id").cast("int")))
    got = values.collect()
    assert [r[1] for r in got] == spark_int_hashes(np.array([r[0] for r in got])).tolist()


@pytest.mark.spark
@pytest.mark.parametrize("adaptive", [False, True])
def test_hash_placement_puts_every_row_where_repartition_by_id_does(spark, adaptive):
    previous = spark.conf.get("spark.sql.adaptive.enabled")
    spark.conf.set("spark.sql.adaptive.enabled", str(adaptive).lower())
    try:
        df = spark.range(0, 3000, 1, 3).select("id", (F.col("id") * 7 % 13).cast("int").alias("target"))
        for by_id in (True, False) if placement.has_repartition_by_id(df) else (False,):  # pyspark 4.0: no ById
            placed = place_by(df, 13, "target", by_id=by_id)
            assert placed.columns == ["id", "target"] and placed.rdd.getNumPartitions() == 13
            plan = placed._jdf.queryExecution().optimizedPlan().toString()
            assert ("direct_shuffle_partition_id" in plan) == by_id
            where = placed.withColumn("p", F.spark_partition_id())
            assert where.where(F.col("p") != F.col("target")).count() == 0
            assert_same_rows(placed, df)
    finally:
        spark.conf.set("spark.sql.adaptive.enabled", previous)


@pytest.mark.spark
@pytest.mark.parametrize("mode", ["blocking", "pipelined"])
def test_exchange_without_repartition_by_id_as_on_pyspark_4_0(spark, monkeypatch, mode):
    monkeypatch.setattr(placement, "has_repartition_by_id", lambda df: False)
    df = spark.range(0, 1500, 1, 2).select("id", (F.col("id") % 11).cast("int").alias("k"))
    ex = scs.exchange(df, scs.key_by("k"), parallelism=3, mode=mode)  # 2 -> 3: the input is placed too
    assert "direct_shuffle_partition_id" not in ex.df._jdf.queryExecution().optimizedPlan().toString()
    expected = scs.with_channel(df, scs.key_by("k"), 3, column="subtask")
    assert_same_rows(ex.df.withColumn("subtask", F.spark_partition_id()), expected)
