"""Benchmark: backpressure with bounded producer pools, on local Spark, as ratios measured in one run.

Three cases (``--case``, default all):

- ``tight``: the legal tight configuration ``segment_size=4096, max_buffers_per_channel=1``. 20,000 rows
  (``--rows``) through a pipelined ``key_by`` exchange with it and with the defaults (target: within 2x),
  and a 4 -> 4 broadcast with it, pipelined and blocking (target: pipelined within 5x of blocking).
- ``timeout``: buffer timeout 0 (a flush after every slice of at most 64 rows a writer appends,
  docs/network.md, "Backpressure: bounded producer pools") against 1 ms, pipelined, ``--timeout-rows`` rows
  (Flink 2.3 measured 1.4-2.4x slower at 0).
- ``memory``: a pipelined exchange whose consumer subtask 0 runs a chained step sleeping 1 ms per row, at 1x
  and 10x input (``--slow-rows``), Spark's Arrow batches of ``--batch-rows`` rows in both: the worst task's
  peak resident and Arrow-allocated memory, which must stay flat.

Every case runs its variants interleaved ``--repeat`` times after one warm-up and reports medians. Prints a
table per case and, as its last line, one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from spark_credit_shuffle.jobs.common import bench_session, cached_rows, interleaved

TIGHT = {"segment_size": 4096, "max_buffers_per_channel": 1}
TARGET_TIGHT = 2.0
TARGET_BROADCAST = 5.0
TARGET_MEMORY_GROWTH = 0.10


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("tight", "timeout", "memory", "all"), default="all")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--timeout-rows", type=int, default=400_000)
    parser.add_argument("--slow-rows", type=int, default=200_000, help="rows of the 10x run of the memory case")
    parser.add_argument("--batch-rows", type=int, default=500, help="Spark's Arrow batch rows in the memory case")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--master", default="local[4]")
    args = parser.parse_args(argv)
    if min(args.rows, args.timeout_rows, args.slow_rows) < 10 or args.repeat < 1:
        parser.error("row counts must be >= 10 and --repeat >= 1")
    return args


def run(df: Any, partitioner: Any, parallelism: int, mode: str, **settings: Any) -> tuple[float, Any]:
    import spark_credit_shuffle as scs

    started = time.perf_counter()
    ex = scs.exchange(df, partitioner, parallelism, mode=mode, retryable=False, **settings)
    ex.df.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - started, ex


def tight(spark: Any, args: argparse.Namespace) -> dict[str, Any]:
    import spark_credit_shuffle as scs

    keyed = cached_rows(spark, args.rows, 2, "ac")
    four = cached_rows(spark, args.rows, 4, "ac")
    medians = interleaved(
        {
            "key_by 2 -> 2, defaults": lambda: run(keyed, scs.key_by("a"), 2, "pipelined")[0],
            "key_by 2 -> 2, tight": lambda: run(keyed, scs.key_by("a"), 2, "pipelined", **TIGHT)[0],
            "broadcast 4 -> 4, tight, pipelined": lambda: run(four, scs.broadcast(), 4, "pipelined", **TIGHT)[0],
            "broadcast 4 -> 4, tight, blocking": lambda: run(four, scs.broadcast(), 4, "blocking", **TIGHT)[0],
        },
        args.repeat,
    )
    print(f"\ntight configuration {TIGHT}, {args.rows:,} rows (median of {args.repeat})")
    for name, seconds in medians.items():
        print(f"  {name:<38} {seconds:7.2f} s")
    tight_ratio = medians["key_by 2 -> 2, tight"] / medians["key_by 2 -> 2, defaults"]
    broadcast_ratio = medians["broadcast 4 -> 4, tight, pipelined"] / medians["broadcast 4 -> 4, tight, blocking"]
    print(f"  tight / defaults (pipelined): {tight_ratio:.2f}x (target within {TARGET_TIGHT:.0f}x)")
    print(f"  broadcast pipelined / blocking: {broadcast_ratio:.2f}x (target within {TARGET_BROADCAST:.0f}x)")
    keyed.unpersist()
    four.unpersist()
    return {
        "tight_vs_default": round(tight_ratio, 3),
        "tight_broadcast_pipelined_vs_blocking": round(broadcast_ratio, 3),
    }


def timeout(spark: Any, args: argparse.Namespace) -> dict[str, Any]:
    import spark_credit_shuffle as scs

    df = cached_rows(spark, args.timeout_rows, 2, "ac")
    medians = interleaved(
        {
            f"buffer timeout {ms} ms": (lambda ms=ms: run(df, scs.key_by("a"), 2, "pipelined", buffer_timeout_ms=ms)[0])
            for ms in (0, 1)
        },
        args.repeat,
    )
    print(f"\nbuffer timeout 0 vs 1 ms, pipelined key_by 2 -> 2, {args.timeout_rows:,} rows (median of {args.repeat})")
    for name, seconds in medians.items():
        print(f"  {name:<20} {seconds:7.2f} s  {args.timeout_rows / seconds:12,.0f} rows/s")
    ratio = medians["buffer timeout 0 ms"] / medians["buffer timeout 1 ms"]
    print(f"  timeout 0 / timeout 1 ms: {ratio:.2f}x the time (Flink 2.3: 1.4-2.4x)")
    df.unpersist()
    return {"timeout_0_vs_1ms": round(ratio, 3)}


def memory(spark: Any, args: argparse.Namespace) -> dict[str, Any]:
    import spark_credit_shuffle as scs
    from spark_credit_shuffle.jobs.common import slow_on

    # a producer holds one input batch beside its bounded buffers: Spark's batches of the same size in both
    # runs (the 1x input already fills whole batches), so what could grow is only what the exchange holds
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", str(args.batch_rows))
    peaks: dict[str, tuple[float, float]] = {}
    for label, rows in (("1x", max(10, args.slow_rows // 10)), ("10x", args.slow_rows)):
        df = cached_rows(spark, rows, 2, "ac")
        slow = scs.map_in_pandas(slow_on(0, 0.001), df.schema)  # the user's slow step, chained into consumer 0
        _, ex = run(df, scs.rebalance(seed=1), 2, "pipelined", after=slow)
        values = {(r.metric, r.stat): [] for r in ex.metric_rows()}
        for r in ex.metric_rows():
            values[(r.metric, r.stat)].append(r.value)
        peaks[label] = (
            max(values.get(("taskRssBytes", "max"), [0.0])),
            max(values.get(("taskArrowAllocatedBytes", "max"), [0.0])),
        )
        df.unpersist()
    rss_growth = peaks["10x"][0] / peaks["1x"][0] - 1 if peaks["1x"][0] else float("nan")
    arrow_growth = peaks["10x"][1] / peaks["1x"][1] - 1 if peaks["1x"][1] else float("nan")
    print(f"\npeak task memory, consumer 0 slowed to 1 ms per row: {args.slow_rows // 10:,} rows vs {args.slow_rows:,}")
    for label in ("1x", "10x"):
        rss, arrow = peaks[label]
        print(f"  {label:>3}: resident {rss / 2**20:8.1f} MiB, Arrow allocated {arrow / 2**20:7.2f} MiB")
    print(f"  growth: resident {rss_growth:+.1%}, Arrow {arrow_growth:+.1%} (target within {TARGET_MEMORY_GROWTH:.0%})")
    return {
        "slow_consumer_rss_mib_1x": round(peaks["1x"][0] / 2**20, 1),
        "slow_consumer_rss_mib_10x": round(peaks["10x"][0] / 2**20, 1),
        "slow_consumer_rss_ratio": round(peaks["10x"][0] / peaks["1x"][0], 3) if peaks["1x"][0] else None,
        "slow_consumer_arrow_ratio": round(peaks["10x"][1] / peaks["1x"][1], 3) if peaks["1x"][1] else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spark, created = bench_session("bench_backpressure", args.master)
    headline: dict[str, Any] = {}
    cases = {"tight": tight, "timeout": timeout, "memory": memory}
    try:
        for name, case in cases.items():
            if args.case in (name, "all"):
                headline.update(case(spark, args))
    finally:
        if created:
            spark.stop()
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
