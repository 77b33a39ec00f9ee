"""Checkpoint alignment demo: alignment time per checkpoint behind one slow consumer of a keyed exchange.

Two parts. **Simulation** (virtual clock, the real protocol core): 4 producers on 4 hosts feed 4 consumers
on 2 hosts all-to-all; consumer 0 reads at ``--sim-slow-rate`` (0.5 MB/s), the others 16 times faster.
Every ``--interval-ms`` each producer injects a barrier; the run is repeated with credit-based flow control
and with the pre-1.5 model without credits (a full receiver pauses its whole connection), aligned and
unaligned. **Spark** (pipelined mode, real TCP): ``--parallelism`` producers key their rows to as many
consumers, all of producer 0's rows on one hot key that goes to consumer 0, which sleeps ``--delay-ms``
per row; the exchange runs with aligned and with unaligned
barriers every ``--interval-ms``, ``--repeat`` rounds interleaved. The alignment time of a checkpoint is
Flink's ``checkpointAlignmentTime``: first barrier to last on a consumer subtask. Prints the tables, writes a
PNG with ``--png`` and ends with one JSON line of the headline figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from spark_credit_shuffle.cli import conf_pair, positive_int

SIM_CASES = [(credit, unaligned) for credit in (True, False) for unaligned in (False, True)]


def _label(credit: bool, unaligned: bool) -> str:
    return f"{'credits' if credit else 'no credits'}, {'unaligned' if unaligned else 'aligned'}"


def simulated(interval_ms: int, slow_rate: float, duration: float) -> dict[tuple[bool, bool], dict[str, Any]]:
    """Mean alignment time (ms) per checkpoint of the slow consumer and of the others, per case."""
    from spark_credit_shuffle import NetworkConfig
    from spark_credit_shuffle.simulation import simulate

    out = {}
    for credit, unaligned in SIM_CASES:
        config = NetworkConfig(credit_based=credit, checkpoint_interval_ms=interval_ms, unaligned_checkpoints=unaligned)
        report = simulate(
            config,
            num_producers=4,
            num_consumers=4,
            producer_rate=[4 * slow_rate, 6 * slow_rate, 8 * slow_rate, 10 * slow_rate],
            consumer_rate=[slow_rate] + [16 * slow_rate] * 3,
            duration=duration,
            producer_hosts=[0, 1, 2, 3],
            consumer_hosts=[4, 4, 5, 5],
        )
        slow = [c.alignment_time_ns / 1e6 for c in report.consumers[0].checkpoints]
        rest = [c.alignment_time_ns / 1e6 for s in report.consumers[1:] for c in s.checkpoints]
        everyone = slow + rest
        out[(credit, unaligned)] = {
            "slow_ms": statistics.fmean(slow) if slow else 0.0,
            "others_ms": statistics.fmean(rest) if rest else 0.0,
            "all_ms": statistics.fmean(everyone) if everyone else 0.0,
            "slow_checkpoints": len(slow),
        }
    return out


def checkpoint_times(ex: Any) -> dict[int, list[float]]:
    """Alignment times (ms) of the completed checkpoints per consumer subtask."""
    out: dict[int, list[float]] = {}
    for row in ex.checkpoint_rows():
        out.setdefault(row["subtask"], []).append(row["alignment_time_ms"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=positive_int, default=6000, help="rows per producer subtask (6,000)")
    parser.add_argument("--parallelism", type=positive_int, default=3, help="producers and consumers (3)")
    parser.add_argument("--delay-ms", type=float, default=0.5, help="consumer 0's sleep per row, ms (0.5)")
    parser.add_argument("--interval-ms", type=positive_int, default=100, help="checkpoint interval, ms (100)")
    parser.add_argument("--repeat", type=positive_int, default=1, help="rounds of aligned and unaligned (1)")
    parser.add_argument("--segment-size", default="4kb", help="network buffer size (4kb)")
    parser.add_argument("--sim-duration", type=float, default=5.0, help="virtual seconds per simulation (5)")
    parser.add_argument(
        "--sim-slow-rate", type=float, default=500_000.0, help="the simulated slow consumer, bytes/s (500,000)"
    )
    parser.add_argument("--skip-spark", action="store_true", help="only the simulation")
    parser.add_argument("--png", help="write a bar chart of the alignment times here")
    parser.add_argument("--master", help="Spark master under plain python (default local[4])")
    parser.add_argument(
        "--conf", action="append", type=conf_pair, default=[], metavar="KEY=VALUE", help="Spark or exchange setting"
    )
    args = parser.parse_args(argv)
    if args.delay_ms <= 0:
        parser.error("--delay-ms: allowed is a delay > 0 ms")
    if not (args.sim_duration > 0 and args.sim_slow_rate > 0):
        parser.error("--sim-duration and --sim-slow-rate: allowed are values > 0")

    sim = simulated(args.interval_ms, args.sim_slow_rate, args.sim_duration)
    print("simulation: mean checkpointAlignmentTime per checkpoint, ms (virtual time)")
    print(f"{'case':<24} {'slow consumer':>14} {'others':>8} {'all':>8} {'slow done':>10}")
    for case, values in sim.items():
        print(
            f"{_label(*case):<24} {values['slow_ms']:>14.2f} {values['others_ms']:>8.2f} {values['all_ms']:>8.2f} "
            f"{values['slow_checkpoints']:>10}"
        )

    spark_results: dict[str, list[dict[int, list[float]]]] = {"aligned": [], "unaligned": []}
    if not args.skip_spark:
        import pyarrow as pa
        from pyspark.sql import functions as F

        import spark_credit_shuffle as scs
        from spark_credit_shuffle.cli import job_session

        spark, created = job_session(
            "spark_credit_shuffle checkpoint alignment demo", args.master or "local[4]", args.conf
        )
        n = args.parallelism
        # keyed, with a hot key: every row of producer 0 goes to consumer 0, so that channel carries far more
        # than consumer 0's other channels (its queue is deep when a barrier is injected, theirs shallow)
        max_parallelism = scs.default_max_parallelism(n)
        keys = pa.array(range(1000), pa.int32())
        hot = scs.key_group_channels(keys, n, max_parallelism).tolist().index(0)
        df = spark.range(0, n * args.rows, 1, n).select(
            F.col("id"),
            F.when(F.col("id") < args.rows, F.lit(hot)).otherwise(F.col("id") % 97).cast("int").alias("k"),
            F.lit("x" * 40).alias("payload"),
        )
        slow = scs.Injection(consumer_delay_s=((0, args.delay_ms / 1000.0),))
        cases = (("aligned", False), ("unaligned", True))
        runs = [case for _ in range(args.repeat) for case in cases]
        try:
            for step, (mode, unaligned) in enumerate(runs, 1):
                started = time.perf_counter()
                ex = scs.exchange(
                    df,
                    scs.key_by("k"),
                    parallelism=n,
                    mode="pipelined",
                    injection=slow,
                    segment_size=args.segment_size,
                    checkpoint_interval_ms=args.interval_ms,
                    unaligned_checkpoints=unaligned,
                )
                count = ex.df.count()
                if count != n * args.rows:
                    raise RuntimeError(f"{mode}: {count} rows came out of {n * args.rows}")
                times = checkpoint_times(ex)
                spark_results[mode].append(times)
                done = sum(len(v) for v in times.values())
                print(
                    f"[{step}/{len(runs)}] spark {mode}: {count} rows in {time.perf_counter() - started:.2f} s, "
                    f"{done} checkpoints completed",
                    flush=True,
                )
        finally:
            if created:
                spark.stop()

    def values_of(mode: str, subtask: int | None) -> list[float]:
        return [
            t for times in spark_results[mode] for s, v in times.items() if subtask is None or s == subtask for t in v
        ]

    def mean_of(mode: str, subtask: int | None) -> float:
        values = values_of(mode, subtask)
        return statistics.fmean(values) if values else 0.0

    def median_of(mode: str, subtask: int | None) -> float:
        values = values_of(mode, subtask)
        return statistics.median(values) if values else 0.0

    headline: dict[str, Any] = {
        "interval_ms": args.interval_ms,
        "sim_aligned_credits_ms": round(sim[(True, False)]["all_ms"], 3),
        "sim_aligned_no_credits_ms": round(sim[(False, False)]["all_ms"], 3),
        "sim_unaligned_credits_ms": round(sim[(True, True)]["all_ms"], 3),
        "sim_unaligned_no_credits_ms": round(sim[(False, True)]["all_ms"], 3),
        "sim_slow_unaligned_credits_ms": round(sim[(True, True)]["slow_ms"], 3),
        "sim_slow_unaligned_no_credits_ms": round(sim[(False, True)]["slow_ms"], 3),
    }
    if not args.skip_spark:
        aligned_slow, unaligned_slow = mean_of("aligned", 0), mean_of("unaligned", 0)
        print()
        print("spark, pipelined: checkpointAlignmentTime per checkpoint, ms")
        print(f"{'barriers':<10} {'consumer 0 mean':>16} {'median':>8} {'all mean':>9} {'median':>8}")
        for mode in ("aligned", "unaligned"):
            print(
                f"{mode:<10} {mean_of(mode, 0):>16.2f} {median_of(mode, 0):>8.2f} {mean_of(mode, None):>9.2f} "
                f"{median_of(mode, None):>8.2f}"
            )
        headline.update(
            {
                "spark_aligned_slow_ms": round(aligned_slow, 3),
                "spark_unaligned_slow_ms": round(unaligned_slow, 3),
                "spark_aligned_slow_median_ms": round(median_of("aligned", 0), 3),
                "spark_unaligned_slow_median_ms": round(median_of("unaligned", 0), 3),
                "spark_aligned_all_ms": round(mean_of("aligned", None), 3),
                "spark_unaligned_all_ms": round(mean_of("unaligned", None), 3),
                "spark_aligned_over_unaligned_slow": round(aligned_slow / unaligned_slow, 2)
                if unaligned_slow
                else None,
            }
        )
    if args.png:
        from spark_credit_shuffle import plot

        categories = ["sim aligned", "sim unaligned"]
        series = {
            "credits": [sim[(True, False)]["all_ms"], sim[(True, True)]["all_ms"]],
            "no credits (simulation only)": [sim[(False, False)]["all_ms"], sim[(False, True)]["all_ms"]],
        }
        if not args.skip_spark:  # Spark's pipelined mode always has credits; its slow consumer 0
            categories += ["spark aligned (consumer 0)", "spark unaligned (consumer 0)"]
            series["credits"] += [mean_of("aligned", 0), mean_of("unaligned", 0)]
            series["no credits (simulation only)"] += [0.0, 0.0]
        plot.bar_chart(
            categories,
            series,
            ylabel="alignment time per checkpoint, ms",
            title="checkpointAlignmentTime behind one slow consumer",
            path=args.png,
        )
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
