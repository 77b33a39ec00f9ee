"""Demo: a keyed exchange on local Spark with generated data, and what the network stack did.

Runs with ``make run`` (or ``spark-submit jobs/demo.py``). Prints where Flink's key groups put a
few keys, then moves generated rows through a blocking, credit-based exchange and shows the
rows per consumer subtask and the Flink-named metrics of the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=200_000, help="generated rows (default 200000)")
    parser.add_argument("--producers", type=int, default=4, help="producer subtasks = input partitions")
    parser.add_argument("--parallelism", type=int, default=4, help="consumer subtasks")
    parser.add_argument("--mode", choices=("blocking", "pipelined"), default="blocking")
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    import pyarrow as pa
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import spark_credit_shuffle as scs
    from spark_credit_shuffle.runtime.session import spark_context

    builder = SparkSession.builder.appName("spark_credit_shuffle demo")
    if not os.environ.get("PYSPARK_GATEWAY_PORT"):  # plain `python`: no spark-submit chose a master
        builder = builder.master(f"local[{max(args.producers, args.parallelism)}]")
    spark = (
        builder.config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    sc = spark_context(spark)
    if sc is not None:  # Spark Connect: the log level is the server's
        sc.setLogLevel("ERROR")

    print("== Flink key groups (max parallelism 128, parallelism 4)")
    keys = pa.array([0, 1, 2, 42, -1], pa.int32())
    groups = scs.key_groups(keys, 128)
    channels = scs.key_group_channels(keys, 4, 128)
    for k, g, c in zip(keys.to_pylist(), groups.tolist(), channels.tolist()):
        print(f"  Integer {k:>3}: key group {g:>3} -> subtask {c}")

    df = spark.range(0, args.rows, 1, args.producers).select(
        (F.col("id") % 1000).cast("long").alias("user_id"),
        F.col("id").cast("int").alias("seq"),
        F.concat(F.lit("event-"), F.col("id").cast("string")).alias("payload"),
    )
    print(f"\n== keyed exchange of {args.rows} rows, {args.producers} -> {args.parallelism} subtasks, {args.mode}")
    ex = scs.exchange(df, scs.key_by("user_id"), parallelism=args.parallelism, mode=args.mode)
    started = time.perf_counter()
    with ex.labelled():
        per_subtask = ex.df.groupBy(F.spark_partition_id().alias("subtask")).count().orderBy("subtask").collect()
    elapsed = time.perf_counter() - started
    for row in per_subtask:
        print(f"  consumer subtask {row['subtask']}: {row['count']} rows")
    print(f"  total {sum(r['count'] for r in per_subtask)} rows in {elapsed:.2f} s")

    print("\n== network metrics (totals per subtask)")
    m = ex.metrics()
    (
        m.where(F.col("stat") == "total")
        .groupBy("side", "subtask")
        .pivot("metric")
        .agg(F.round(F.sum("value")).cast("long"))  # counts are whole numbers (value: a double for every metric)
        .orderBy("side", "subtask")
        .show(truncate=False)
    )
    print("== buffer usage gauges (max over the run)")
    (
        m.where(F.col("stat") == "max")
        .groupBy("side", "subtask")
        .pivot("metric")
        .agg(F.max("value"))
        .orderBy("side", "subtask")
        .show(truncate=False)
    )
    print("== summary per subtask (Flink's back-pressure status) and where backpressure starts")
    ex.summary().show(truncate=False)  # rounded, narrow; summary(full=True) has every figure unrounded
    print(f"  {ex.diagnose()}")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
