"""Benchmark: how the pipelined exchange's cost grows with parallelism, next to Spark's own shuffle.

For each parallelism P of ``--parallelism`` (default 2, 4, 8, 16, each on ``local[P]``) and on
``local-cluster[2,2,2048]`` (P = 4, two executors: half of each task's channels remote), one Spark
application of its own (a subprocess of this script) moves ``--rows`` rows (``a`` long, ``b`` int, ``c`` a
20-character string; cached and materialised first) with ``key_by("a")`` over P channels. Cases, each
``write.format("noop")``, in ``--repeat`` rounds rotated as in ``bench_exchange.py``, after a warm-up:

- ``repartition + mapInArrow``: Spark's shuffle and an identity ``mapInArrow`` (the reference);
- ``pipelined, streaming``: the pipelined exchange writing straight into the sink (``retryable=False``);
- ``exchange pipelined``: the pipelined exchange as it comes (retryable).

Reported per P: seconds per million rows (median), the throughput ratios against the reference, and of
the streaming form's last run (the worst task): peak resident memory (``taskRssBytes``) and the network
buffers it held (``usedMemorySegments``), against what the planner says a task needs
(``planner.task_buffers``: required at set-up, and the most its pools can grow to). The last line printed is
one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

#: The two-executor case: two workers of two cores and 2 GiB each (Spark's own test master), parallelism 4.
CLUSTER_MASTER = "local-cluster[2,2,2048]"
CLUSTER_PARALLELISM = 4
CASES = ("repartition + mapInArrow", "pipelined, streaming", "exchange pipelined")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--parallelism", default="2,4,8,16", help="comma-separated parallelisms (local[P] each)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-cluster", action="store_true", help="skip the local-cluster application")
    parser.add_argument("--driver-memory", default="4g")
    parser.add_argument("--executor-memory", default="1g", help="per executor, on the local-cluster master")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: this parallelism
    parser.add_argument("--master", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.levels = [int(p) for p in args.parallelism.split(",")]
    except ValueError:
        parser.error(f"--parallelism takes comma-separated integers, got {args.parallelism!r}")
    if args.rows < 10 or args.repeat < 1 or not args.levels or min(args.levels) < 1:
        parser.error("--rows must be >= 10, --repeat >= 1, every parallelism >= 1")
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One application (``--one P --master M``): the cases' medians and the streaming form's task figures."""
    import spark_credit_shuffle as scs
    from spark_credit_shuffle.jobs.common import bench_session, cached_rows, metric_rows, noop, rotated, timed, worst
    from spark_credit_shuffle.metrics import EXECUTOR, PRODUCER
    from spark_credit_shuffle.planner import task_buffers
    from spark_credit_shuffle.runtime import pipelined

    p = args.one
    spark, created = bench_session(
        "bench_growth",
        args.master or f"local[{p}]",
        driver_memory=args.driver_memory,
        executor_memory=args.executor_memory,
        shuffle_partitions=p,
    )
    df = cached_rows(spark, args.rows, p)

    def identity(batches):  # nested: pickled by value, so workers need not import this script
        yield from batches

    last: list[Any] = []

    def streaming() -> None:
        ex = scs.exchange(df, scs.key_by("a"), p, mode="pipelined")
        out, collected = pipelined.build(ex.plan, df, retryable=False)
        noop(out)
        last[:] = [ex.plan, collected]

    actions = {
        "repartition + mapInArrow": lambda: noop(df.repartition(p, "a").mapInArrow(identity, df.schema)),
        "pipelined, streaming": streaming,
        "exchange pipelined": lambda: noop(scs.exchange(df, scs.key_by("a"), p, mode="pipelined").df),
    }
    cases = list(actions.items())
    for _, action in cases:  # warm-up: Python workers started, code loaded
        action()
    times: dict[str, list[float]] = {name: [] for name in actions}
    for round_ in range(args.repeat):
        for name, action in rotated(cases, round_):
            times[name].append(timed(action, 1)[0])
    plan, collected = last
    rows = metric_rows(collected)
    # where each task ran (its producer half's executor row): channels between tasks of one executor are local
    where = {r["subtask"]: r["stat"] for r in rows if r["metric"] == EXECUTOR and r["side"] == PRODUCER}
    placement = [where.get(i) for i in range(p)]
    halves = [task_buffers(plan, i, placement) for i in range(p)]
    planned = [producer + consumer for producer, consumer in halves]
    result = {
        "parallelism": p,
        "master": spark.conf.get("spark.master"),
        "seconds": {name: statistics.median(ts) for name, ts in times.items()},
        "runs": times,
        "task_peak_rss_mib": round((worst(rows, "taskRssBytes", "max") or 0.0) / 2**20, 1),
        "task_peak_buffers": int(worst(rows, "usedMemorySegments", "max") or 0),
        "planned_buffers_required": max(t.required for t in planned),
        "planned_buffers_maximum": max(t.maximum for t in planned),
    }
    if created:
        spark.stop()
    return result


def run_child(args: argparse.Namespace, p: int, master: str) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--one", str(p), "--master", master]
    command += ["--rows", str(args.rows), "--repeat", str(args.repeat)]
    command += ["--driver-memory", args.driver_memory, "--executor-memory", args.executor_memory]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the application at parallelism {p} on {master} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args)))
        return 0
    runs = [(p, f"local[{p}]") for p in args.levels]
    if not args.no_cluster:
        runs.append((CLUSTER_PARALLELISM, CLUSTER_MASTER))
    print(f"{args.rows:,} rows key_by('a'), medians of {args.repeat} rotated rounds; one application per line")
    header = (
        f"{'master':<24}{'P':>3}  {'s per M rows: reference':>24}{'streaming':>11}{'retryable':>11}"
        f"{'streaming x':>13}{'retryable x':>13}{'peak RSS MiB':>14}{'buffers':>9}{'planned':>13}"
    )
    print(header)
    headline: dict[str, Any] = {"rows": args.rows, "unit": "seconds per million rows; ratios: throughput"}
    for p, master in runs:
        r = run_child(args, p, master)
        per_m = {name: r["seconds"][name] / (args.rows / 1e6) for name in CASES}
        reference = r["seconds"]["repartition + mapInArrow"]
        streaming_x = reference / r["seconds"]["pipelined, streaming"]
        retryable_x = reference / r["seconds"]["exchange pipelined"]
        planned = f"{r['planned_buffers_required']}-{r['planned_buffers_maximum']}"
        print(
            f"{master:<24}{p:>3}  {per_m['repartition + mapInArrow']:>24.3f}{per_m['pipelined, streaming']:>11.3f}"
            f"{per_m['exchange pipelined']:>11.3f}{streaming_x:>13.2f}{retryable_x:>13.2f}"
            f"{r['task_peak_rss_mib']:>14.1f}{r['task_peak_buffers']:>9}{planned:>13}",
            flush=True,
        )
        key = f"p{p}" if master.startswith("local[") else f"cluster_p{p}"
        headline[key] = {
            "reference_s_per_m_rows": round(per_m["repartition + mapInArrow"], 3),
            "streaming_s_per_m_rows": round(per_m["pipelined, streaming"], 3),
            "retryable_s_per_m_rows": round(per_m["exchange pipelined"], 3),
            "streaming_throughput_ratio": round(streaming_x, 3),
            "retryable_throughput_ratio": round(retryable_x, 3),
            "task_peak_rss_mib": r["task_peak_rss_mib"],
            "task_peak_buffers": r["task_peak_buffers"],
            "planned_buffers_required": r["planned_buffers_required"],
            "planned_buffers_maximum": r["planned_buffers_maximum"],
        }
    print(json.dumps(headline, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
