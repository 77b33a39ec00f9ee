"""Channels between tasks of one executor are local in the pipelined exchange, as between two tasks of one
Flink TaskManager: no credit and no exclusive buffers; the producer's pool bounds what they hold.

The tasks run as threads over real sockets (``run_in_threads`` with ``executors``), and once as a Spark job
on ``local-cluster`` (two executors of two slots, a subprocess), where Spark decides the placement; that
cluster encrypts its own traffic (``spark.network.crypto.enabled``), so the exchange runs TLS between its
executors' processes too.
"""

from __future__ import annotations

import textwrap

import pytest
from spark_helpers import run_job_script
from test_pipelined import expected_placement, inputs, make_plan, table

import spark_credit_shuffle as scs
from spark_credit_shuffle.metrics import CONSUMER, PRODUCER
from spark_credit_shuffle.runtime.pipelined import run_in_threads
from spark_credit_shuffle.runtime.plan import Injection

pytestmark = pytest.mark.timeout(180)


def _check_exact(plan, data, received) -> None:
    for c, want in enumerate(expected_placement(plan, data)):
        assert table(received[c]).sort_by("id").equals(want)


def _timeline(rows, side, subtask, metric):
    return [r for r in rows if r.time_ms is not None and (r.side, r.subtask, r.metric) == (side, subtask, metric)]


@pytest.mark.parametrize("executors", [(0, 0, 0), (0, 1, 0), (0, 1, 2)], ids=["one", "two", "three"])
def test_tasks_sharing_an_executor_exchange_every_row_exactly_over_local_channels(executors):
    plan = make_plan(scs.key_by("k"), 3, 3, metrics_sample_interval_ms=5)
    data = inputs(3, 6000)
    received, rows = run_in_threads(plan, data, executors=list(executors))
    _check_exact(plan, data, received)
    for c in range(3):  # credits are sampled on remote channels only: those from another executor
        remote = {p for p in range(3) if executors[p] != executors[c]}
        assert {r.channel for r in _timeline(rows, CONSUMER, c, "credit")} == remote
        assert {r.channel for r in _timeline(rows, PRODUCER, c, "credit")} == remote


def test_a_slow_consumer_on_a_local_channel_backpressures_through_the_producers_pool():
    # given every task on one executor and consumer 0 slow (40 us per row): no channel has credit, so only
    # the producers' pools (4 buffers per subpartition) can hold them back
    plan = make_plan(
        scs.key_by("k"),
        3,
        3,
        injection=Injection(consumer_delay_s=((0, 4e-5),)),
        max_buffers_per_channel=4,
        metrics_sample_interval_ms=2,
    )
    data = inputs(3, 8000)
    received, rows = run_in_threads(plan, data, executors=[0, 0, 0])
    _check_exact(plan, data, received)
    assert not [r for r in rows if r.metric == "credit"]
    back_pressured = sum(r.value for r in rows if r.metric == "accumulateBackPressuredTimeMs" and r.side == PRODUCER)
    assert back_pressured > 0
    # what each producer held for the slow consumer never exceeded its subpartition limit (plus the
    # overdraft a writer may take to finish the rows it was given)
    limit = plan.config.max_buffers_per_channel + plan.config.max_overdraft_buffers_per_gate
    for p in range(3):
        queued = [r.value for r in _timeline(rows, PRODUCER, p, "outputQueueLength") if r.channel == 0]
        assert queued and max(queued) <= limit
    # the consumers took no floating buffers: a local channel brings its own (the producer's)
    assert all(r.value == 0 for r in rows if r.metric == "inputFloatingBuffersUsage")


def test_local_channels_task_setting_makes_every_channel_between_tasks_remote():
    plan = make_plan(scs.rebalance(), 2, 2, local_channels="task", metrics_sample_interval_ms=5)
    data = inputs(2, 3000)
    received, rows = run_in_threads(plan, data, executors=[0, 0])
    assert sum(b.num_rows for batches in received for b in batches) == 6000
    assert {r.channel for r in _timeline(rows, CONSUMER, 0, "credit")} == {1}
    assert {r.channel for r in _timeline(rows, CONSUMER, 1, "credit")} == {0}


_LOCAL_CLUSTER_JOB = textwrap.dedent(
    """
    import json, os, sys
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession, functions as F
    import spark_credit_shuffle as scs

    spark = (
        SparkSession.builder.master("local-cluster[2,2,1024]")
        .config("spark.ui.enabled", "false")
        .config("spark.executor.memory", "512m")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
        .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "3")
        .config("spark.authenticate", "true")  # a cluster that encrypts its own traffic (crypto needs auth)
        .config("spark.authenticate.secret", os.urandom(16).hex())
        .config("spark.network.crypto.enabled", "true")
        .getOrCreate()
    )
    import time
    df = spark.range(0, 100000, 1, 4).select(F.col("id"), (F.col("id") % 97).cast("int").alias("k"))
    # consumer 0: 0.2 ms per row, about 5 s for its quarter of the rows (long against the producers' own
    # work even on a busy machine), each producer's share of which is several times what 4 KiB buffers in
    # flight hold
    slow = scs.Injection(consumer_delay_s=((0, 0.0002),))
    samples = []
    ex = scs.exchange(df, scs.key_by("k"), parallelism=4, mode="pipelined", metrics_sample_interval_ms=5,
                      injection=slow, segment_size="4kb", monitor=lambda rows: samples.append(time.monotonic()))
    rows = ex.df.groupBy(F.spark_partition_id().alias("p")).agg(F.count("*").alias("n"),
                                                                 F.sum("id").alias("s")).collect()
    finished = time.monotonic()
    live = sum(1 for at in samples if at < finished)  # the samples that came while the action ran
    credit = {(r["subtask"], r["channel"]) for r in ex.timeline().where("metric = 'credit' and side = 'consumer'")
              .select("subtask", "channel").distinct().collect()}
    diagnosis = ex.diagnose()
    out = {"rows": sum(r["n"] for r in rows), "sum": sum(r["s"] for r in rows), "credit_channels": sorted(credit),
           "tls": ex.plan.tls, "executors": {f"{s.side} {s.subtask}": s.executor for s in ex.summary_rows()},
           "verdict": diagnosis.verdict, "origin": diagnosis.origin, "origin_executor": diagnosis.executor,
           "text": str(diagnosis), "live": live,
           "levels": sorted(s.back_pressure for s in ex.summary_rows() if s.side == "producer")}
    # a hot key (skew) and an even spread (ok), on the same two executors
    hot = df.withColumn("hot", F.when(F.col("id") % 10 < 8, F.lit(7)).otherwise(F.col("k")))
    skewed = scs.exchange(hot, scs.key_by("hot"), parallelism=4, mode="pipelined")
    skewed.df.count()
    even = scs.exchange(df, scs.rebalance(), parallelism=4, mode="pipelined")
    even.df.count()
    out.update(skew=str(skewed.diagnose()), skew_ratio=skewed.diagnose().skew, even=even.diagnose().verdict)
    spark.stop()
    print(json.dumps(out))
    """
)


@pytest.mark.spark
def test_on_local_cluster_channels_between_executors_are_remote_run_tls_and_backpressure_is_found(
    tmp_path,
):
    out = run_job_script(tmp_path, _LOCAL_CLUSTER_JOB, 170)
    assert out["rows"] == 100000 and out["sum"] == sum(range(100000))
    assert out["tls"]  # spark.network.crypto.enabled: the exchange's connections run TLS without being asked
    # two executors of two slots run the four tasks: each consumer reads the two producers of the other
    # executor remotely (with credit) and its neighbour on its own executor through a local channel
    remote = out["credit_channels"]
    per_consumer = {c: [p for s, p in remote if s == c] for c in range(4)}
    assert all(len(ps) == 2 for ps in per_consumer.values()), remote
    # where backpressure starts and on which executor: consumer 0 (slowed), named by its executor's host:port
    executors = out["executors"]
    assert len(executors) == 8 and len(set(executors.values())) == 2, executors  # two executors, four tasks
    assert all(e.rsplit(":", 1)[-1].isdigit() for e in executors.values()), executors
    assert (out["verdict"], out["origin"]) == ("backpressure", 0), out["text"]
    assert out["levels"].count("HIGH") >= 3, out["levels"]  # the producers sending to consumer 0 mostly wait
    assert out["live"] >= 3  # samples reached the driver while the action ran
    # the hot key: skew, alone or as the cause of the backpressure it makes; the even spread: ok
    assert out["skew_ratio"] >= 2.0 and ("data skew" in out["skew"]), out["skew"]
    assert out["even"] == "ok"
    assert out["origin_executor"] == executors["consumer 0"] and f"(on {out['origin_executor']})" in out["text"]
