"""Exchanges of DataFrames as users write them: queries the optimizer has touched (filters that tighten
nullability, folded literals and casts, joins, aggregations, unions, window functions, ``selectExpr``,
``coalesce``, every type), through both modes and every partitioner, on classic sessions and Spark Connect.

Each exchange must hand back exactly the input's rows (every consumer all of them for broadcast), with the
input's schema, nullability included, and each row on the consumer :func:`with_channel` names.
"""

from __future__ import annotations

import datetime
import decimal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql import Window
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual
from type_helpers import all_types_df, comparable

import spark_credit_shuffle as scs

pytestmark = pytest.mark.spark

MODES = ["blocking", "pipelined"]


def base_df(spark):
    """Rows with nulls in every column but ``id``, on two partitions."""
    rows = []
    for i in range(40):
        rows.append(
            (
                i,
                None if i % 7 == 3 else i % 5,
                None if i % 4 == 1 else f"s{i % 9}",
                None if i % 6 == 2 else i / 4.0,
                datetime.date(2024, 1, 1) + datetime.timedelta(days=i),
            )
        )
    return spark.createDataFrame(rows, "id long, k int, s string, v double, d date").repartition(2)


def dim_df(spark):
    return spark.createDataFrame([(k, f"name{k}") for k in range(4)], "k int, name string")


# Each shape is a query of the kind users write; every one keeps a unique, non-null long column ``id``.
SHAPES = {
    "filter tightens nullability": lambda spark: base_df(spark).where("s is not null and k is not null"),
    "folded literals and casts": lambda spark: base_df(spark).select(
        "id",
        F.lit("5").cast("int").alias("x"),
        F.to_timestamp(F.lit("2024-03-10 02:30:00")).alias("ts"),
        F.expr("timestamp_ntz'2024-01-01 10:00:00'").alias("tn"),
        F.lit(decimal.Decimal("12.50")).alias("dec"),
        F.array(F.lit(1), F.lit(2)).alias("arr"),
        F.struct(F.lit("a").alias("a"), F.col("k")).alias("st"),
        F.lit(None).cast("string").alias("nothing"),
        F.coalesce("s", F.lit("none")).alias("s_or_none"),
    ),
    "inner join": lambda spark: base_df(spark).join(dim_df(spark), "k"),
    "left join": lambda spark: base_df(spark).join(dim_df(spark), "k", "left"),
    "aggregation": lambda spark: (
        base_df(spark)
        .groupBy("k")
        .agg(F.count("*").alias("n"), F.sum("v").alias("sv"), F.max("s").alias("ms"))
        .withColumn("id", F.coalesce(F.col("k"), F.lit(-1)).cast("long"))
    ),
    "union": lambda spark: (
        base_df(spark)
        .where("id < 20")
        .unionByName(base_df(spark).where("id >= 20").withColumn("id", F.col("id") + 1000))
    ),
    "window function": lambda spark: base_df(spark).withColumn(
        "rank", F.row_number().over(Window.partitionBy("k").orderBy("id"))
    ),
    "selectExpr": lambda spark: base_df(spark).selectExpr(
        "id", "coalesce(s, 'none') as s2", "k * 2 as k2", "upper(s) as su", "v is null as v_missing"
    ),
    "coalesce": lambda spark: base_df(spark).where("v > 1").coalesce(1),
    "every type": lambda spark: comparable(all_types_df(spark, rows=16)),
}


PARTITIONERS = {
    "key_by": lambda: scs.key_by("id"),
    "rebalance": lambda: scs.rebalance(seed=3),
    "rescale": lambda: scs.rescale(),
    "shuffle": lambda: scs.shuffle(seed=5),
    "broadcast": lambda: scs.broadcast(),
    "forward": lambda: scs.forward(),
    "global": lambda: scs.global_(),
    "custom": lambda: scs.custom(lambda keys, n: np.abs(keys.to_numpy(zero_copy_only=False)) % n, "id"),
}


def check_exchange(
    spark, shape: str, partitioner_name: str, mode: str, parallelism: int | None, placement: bool = True
) -> None:
    df = SHAPES[shape](spark)
    partitioner = PARTITIONERS[partitioner_name]()
    if partitioner_name == "forward":
        parallelism = None  # forward: one consumer per producer
    ex = scs.exchange(df, partitioner, parallelism, mode=mode)
    out = ex.df
    assert out.schema == df.schema, f"{shape}: the exchange changed the schema\n{out.schema}\n{df.schema}"
    consumers = ex.plan.num_consumers
    expected = df
    if partitioner_name == "broadcast":
        for _ in range(consumers - 1):
            expected = expected.unionByName(df)
    if not placement or partitioner_name == "broadcast":
        assertDataFrameEqual(out, expected, ignoreNullable=False, rtol=0.0, atol=0.0)
        return
    # one run of the exchange: its rows, and every row on the consumer with_channel names
    landed = out.withColumn("consumer", F.spark_partition_id()).collect()
    rows = [tuple(r)[:-1] for r in landed]
    assertDataFrameEqual(rows, [tuple(r) for r in expected.collect()], rtol=0.0, atol=0.0)
    named = scs.with_channel(df, PARTITIONERS[partitioner_name](), ex.plan.num_consumers, column="consumer")
    assertDataFrameEqual([tuple(r) for r in landed], [tuple(r) for r in named.collect()], rtol=0.0, atol=0.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_query_shape_goes_through_exactly(spark, shape, mode):
    # a different partitioner for each shape, so that the shapes alone cover every partitioner in both modes
    names = list(PARTITIONERS)
    name = names[(list(SHAPES).index(shape) + (mode == "pipelined") * 3) % len(names)]
    check_exchange(spark, shape, name, mode, parallelism=3, placement=False)


@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    shape=st.sampled_from(list(SHAPES)),
    partitioner=st.sampled_from(list(PARTITIONERS)),
    mode=st.sampled_from(MODES),
    parallelism=st.integers(1, 4),
)
def test_any_query_any_partitioner_any_mode_conserves_rows(spark, shape, partitioner, mode, parallelism):
    check_exchange(spark, shape, partitioner, mode, parallelism)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("shape", "partitioner"),
    [
        ("filter tightens nullability", "key_by"),
        ("folded literals and casts", "rebalance"),
        ("union", "custom"),
        ("coalesce", "rescale"),
    ],
)
def test_query_shapes_on_spark_connect(connect_spark, shape, partitioner, mode):
    check_exchange(connect_spark, shape, partitioner, mode, parallelism=2)


@pytest.mark.parametrize("mode", MODES)
def test_the_reported_reproduction_runs_in_both_modes(any_spark, mode):
    spark = any_spark
    df = spark.createDataFrame([(1, None), (2, "a")], "id int, s string").filter("s is not null")
    df = df.withColumn("x", F.lit("5").cast("int")).withColumn("t", F.to_timestamp(F.lit("2024-01-01 00:00:00")))
    df = df.withColumn("tn", F.lit(datetime.datetime(2024, 1, 1)).cast("timestamp_ntz"))
    ex = scs.exchange(df, scs.rebalance(), 2, mode=mode)
    assert ex.df.count() == 1
    assert ex.df.schema == df.schema
    assertDataFrameEqual(ex.df, df, ignoreNullable=False)
