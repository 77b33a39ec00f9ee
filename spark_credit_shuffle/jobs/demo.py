"""Demo: a keyed exchange on local Spark with generated data, and what the network stack did.

Runs with ``make run``, ``python -m spark_credit_shuffle.jobs.demo`` or ``spark-submit $(python -m
spark_credit_shuffle job-path demo)``. Prints where Flink's key groups put a few keys, then moves generated
rows through a blocking, credit-based exchange and shows the rows per consumer subtask and the Flink-named
metrics of the run.
"""

from __future__ import annotations

import argparse
import sys
import time

from spark_credit_shuffle.cli import positive_int


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=positive_int, default=200_000, help="generated rows (default 200000)")
    parser.add_argument("--producers", type=positive_int, default=4, help="producer subtasks = input partitions")
    parser.add_argument("--parallelism", type=positive_int, default=4, help="consumer subtasks")
    parser.add_argument("--mode", choices=("blocking", "pipelined"), default="blocking")
    parser.add_argument("--master", help="Spark master under plain python (default local[N])")
    args = parser.parse_args(argv)

    import pyarrow as pa
    from pyspark.sql import functions as F

    import spark_credit_shuffle as scs
    from spark_credit_shuffle.cli import job_session
    from spark_credit_shuffle.jobs.common import events

    width = max(args.producers, args.parallelism)
    spark, created = job_session("spark_credit_shuffle demo", args.master or f"local[{width}]", log_level="ERROR")

    print("== Flink key groups (max parallelism 128, parallelism 4)")
    keys = pa.array([0, 1, 2, 42, -1], pa.int32())
    groups = scs.key_groups(keys, 128)
    channels = scs.key_group_channels(keys, 4, 128)
    for k, g, c in zip(keys.to_pylist(), groups.tolist(), channels.tolist()):
        print(f"  Integer {k:>3}: key group {g:>3} -> subtask {c}")

    df = events(spark, args.rows, args.producers)
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
    if created:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
