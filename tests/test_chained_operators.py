"""Operators chained into an exchange's tasks (``Exchange.map_in_pandas``, ``exchange(..., before=..., after=...)``):
the user's function runs in the consumer (or producer) subtask's own task, on exactly the rows that subtask
received (or read), in both modes, on classic Spark and Spark Connect; what it yields is checked against its
declared schema; bad arguments are refused before any job."""

from __future__ import annotations

import sys

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F
from spark_helpers import assert_same_rows, no_spark_jobs

import spark_credit_shuffle as scs
from spark_credit_shuffle.metrics import CONSUMER, PRODUCER

MODES = ["blocking", "pipelined"]

# the functions of this module travel by value, as a notebook's or a script's do (the workers cannot import it)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def tagged(frames):
    """Each row with the partition of the task that ran this function: the consumer subtask, when chained."""
    from pyspark import TaskContext

    part = TaskContext.get().partitionId()
    for frame in frames:
        yield frame.assign(part=part)


def expected_channels(spark, df, consumers):
    rows = scs.with_channel(df, scs.key_by("k"), parallelism=consumers).collect()
    return {(r["id"], r["k"]): r["channel"] for r in rows}


@pytest.mark.spark
@pytest.mark.parametrize("mode", MODES)
def test_a_chained_operator_runs_in_each_consumer_task_on_what_it_received(any_spark, mode):
    df = any_spark.range(0, 3000, 1, 2).select("id", (F.col("id") % 17).alias("k"))
    ex = scs.exchange(df, scs.key_by("k"), 3, mode=mode)
    out = ex.map_in_pandas(tagged, "id long, k long, part int")
    got = out.select("id", "k", "part", F.spark_partition_id().alias("partition")).collect()
    assert sorted(r["id"] for r in got) == list(range(3000))  # every row once
    channels = expected_channels(any_spark, df, 3)
    assert all(r["part"] == channels[(r["id"], r["k"])] == r["partition"] for r in got)  # in consumer i's task
    assert scs.exchange_of(out) is ex
    consumers = [s for s in ex.summary_rows() if s.side == CONSUMER]
    assert sum(s.records for s in consumers) == 3000 and len(consumers) == 3


@pytest.mark.spark
@pytest.mark.parametrize("mode", MODES)
def test_an_arrow_operator_may_change_the_schema_and_its_types_are_cast_safely(spark, mode):
    def doubled(batches):
        for batch in batches:
            ids = batch.column("id")
            # int32 where the schema says long: a safe cast, as mapInArrow's users expect to write
            yield pa.RecordBatch.from_arrays([pc.cast(ids, pa.int32()), pc.multiply(ids, 2)], names=["id", "twice"])

    df = spark.range(0, 500, 1, 2)
    out = scs.exchange(df, scs.rebalance(), 2, mode=mode).map_in_arrow(doubled, "id long, twice long")
    expected = spark.range(0, 500).select("id", (F.col("id") * 2).alias("twice"))
    assert_same_rows(out, expected, ignore_nullable=True)


@pytest.mark.spark
@pytest.mark.parametrize("mode", MODES)
def test_an_operator_chained_before_runs_on_the_producers_input_and_the_keys_are_its_columns(spark, mode):
    def keyed(frames):
        from pyspark import TaskContext

        producer = TaskContext.get().partitionId()
        for frame in frames:
            kept = frame[frame["id"] % 3 != 0]  # a filter chained into the producer
            yield kept.assign(bucket=kept["id"] % 5, producer=producer)

    df = spark.range(0, 900, 1, 3)
    ex = scs.exchange(
        df,
        scs.key_by("bucket"),
        2,
        mode=mode,
        before=scs.map_in_pandas(keyed, "id long, bucket long, producer int"),
    )
    got = ex.df.select("*", F.spark_partition_id().alias("consumer")).collect()
    assert sorted(r["id"] for r in got) == [i for i in range(900) if i % 3]
    source = {i: p for p in range(3) for i in range(p * 300, (p + 1) * 300)}  # range's partitions
    assert all(r["producer"] == source[r["id"]] for r in got)  # ran in producer subtask p's task
    key_channels = scs.key_group_channels(pa.array(list(range(5)), pa.int64()), parallelism=2, max_parallelism=128)
    assert all(r["consumer"] == key_channels[r["bucket"]] for r in got)  # placed by the operator's column
    produced = {s.subtask: s.records for s in ex.summary_rows() if s.side == PRODUCER}
    assert sum(produced.values()) == 600


@pytest.mark.spark
def test_the_dataframe_method_and_exchanged_take_operators(any_spark):
    scs.install_dataframe_method()
    df = any_spark.range(0, 400, 1, 2).select("id", (F.col("id") % 7).alias("k"))
    out = df.creditShuffle(
        scs.key_by("k"), 2, "pipelined", after=scs.map_in_pandas(tagged, "id long, k long, part int")
    )
    assert sorted(r["id"] for r in out.where("part = 0 or part = 1").collect()) == list(range(400))
    assert scs.exchange_of(out).plan.after[0].name == "tagged"
    step = scs.exchanged(scs.rebalance(), 2, after=[scs.map_in_pandas(tagged, "id long, k long, part int")])
    assert df.transform(step).count() == 400


@pytest.mark.spark
def test_bad_operators_are_refused_before_any_job(spark):
    df = spark.range(0, 10, 1, 2).select("id", (F.col("id") % 3).alias("k"))
    with no_spark_jobs(spark):
        with pytest.raises(scs.ConfigError, match=r"argument 'after'"):
            scs.exchange(df, scs.rebalance(), 2, after=lambda frames: frames)
        with pytest.raises(scs.ConfigError, match=r"argument 'schema'.*of operator tagged"):
            scs.exchange(df, scs.rebalance(), 2, after=scs.map_in_pandas(tagged, "id lonk"))
        with pytest.raises(scs.ConfigError, match=r"argument 'schema'"):
            scs.map_in_pandas(tagged, 42)
        with pytest.raises(scs.ConfigError, match=r"argument 'fn'"):
            scs.map_in_arrow("not a function", "id long")
        with pytest.raises(scs.PartitionerError, match=r"k"):  # the key must be a column of the operator's output
            scs.exchange(df, scs.key_by("k"), 2, before=scs.map_in_pandas(tagged, "id long"))


@pytest.mark.spark
@pytest.mark.parametrize("mode", MODES)
def test_output_that_does_not_fit_the_declared_schema_is_a_typed_error(spark, mode):
    def wrong(frames):
        for frame in frames:
            yield frame.rename(columns={"id": "ident"})

    out = scs.exchange(spark.range(0, 50, 1, 2), scs.rebalance(), 2, mode=mode).map_in_pandas(wrong, "id long")
    expected = r"chained operator wrong yielded columns \['ident'\]"
    with pytest.raises(scs.ChainedOperatorError, match=expected), scs.typed_errors():
        out.count()


@pytest.mark.spark
def test_a_consumer_without_input_still_runs_its_operator(spark):
    """A partition function sees every partition, an empty one too (mapInPandas calls it per partition)."""

    def counted(frames):
        import pandas as pd
        from pyspark import TaskContext

        yield pd.DataFrame({"part": [TaskContext.get().partitionId()], "rows": [sum(len(f) for f in frames)]})

    df = spark.range(0, 100, 1, 2).select("id", F.lit(1).alias("k"))  # one key: one consumer gets every row
    out = scs.exchange(df, scs.key_by("k"), 3, mode="pipelined").map_in_pandas(counted, "part int, rows long")
    got = sorted((r["part"], r["rows"]) for r in out.collect())
    assert [p for p, _ in got] == [0, 1, 2] and sum(n for _, n in got) == 100
