"""Benchmark: the floor under the pipelined path, next to the path itself, per 32 KiB buffer and per task count.

What the least Python can spend to move Arrow network buffers between tasks in processes of their own, and
what the pipelined runtime spends, measured in the same run, at ``--parallelism`` 2 and 4 (one process per
task, all on 127.0.0.1, as Spark's ``local[P]`` runs a pipelined exchange's tasks in P Python workers):

- ``lean path``: one thread per process, no protocol objects, no locks, no other thread. It routes each input
  batch with the exchange's own key-group selector (``key_by("a")``), groups the rows by channel (one stable
  ``take``), cuts every channel's rows into IPC messages of at most one segment at a fixed number of rows
  (from the first batch's bytes per row, with 2% to spare: no per-row size model), serialises them, and sends
  each to its consumer over a plain non-blocking socket (an 8-byte header, ``sendmsg``), at most ``CREDITS``
  buffers in flight per channel; a consumer reads what ``select`` says is there, decodes and validates every message
  (``read_record_batch``, ``validate(full=True)``, as the RecordReader does with untrusted bytes), batches the
  output to 8,192 rows, and returns one credit message per connection per read. Rows for the task's own
  consumer are decoded in place. It stops reading input while a channel has ``CREDITS`` buffers queued;
  nothing else: no backlog, no events, no barriers, no metrics, no flusher, no keep-alives;
- ``lean core``: the same routing, cutting, serialising, decoding and output batching of one task's rows in
  one process, with no socket;
- ``pipelined path``: :class:`~spark_credit_shuffle.runtime.pipelined.task.PipelinedTask` in each process (its
  producer, I/O, consumer and timer threads; all tasks on one executor, so local channels through the
  connection: ``jobs/bench_pipelined_path.py --local``), and its core in place (``jobs/bench_pipelined_path.py``).

Every figure is the CPU of all processes (``getrusage``: every thread, ended ones too, from the first buffer to
the last) divided by the data buffers moved, median of ``--repeat`` rotated rounds. "Beyond the core" is a
path's figure less its own core's: what moving the buffers between processes costs. "Paired" is the median of
each round's own pipelined / lean path ratio, steadier than the ratio of the medians when the machine's speed
drifts between rounds. "Per row" is the same paired ratio of the CPU for the same rows: the lean path cuts each
input batch's rows of a channel on their own, so it sends more, less filled buffers than the pipelined path
(whose open buffer takes the next batch's rows), and its figure per buffer is lower for the same work; the
table prints both paths' buffer counts. Every run checks that every row arrived once.

With ``--spark`` (or ``--only-spark``) both paths also run inside Spark, on ``local[P]`` for the largest
``--parallelism``: the lean tasks as the tasks of a barrier ``mapInArrow`` (the Spark task thread reads the
input, drives the sockets and yields the output), beside an identity ``mapInArrow`` alone, ``repartition`` +
identity ``mapInArrow`` and the pipelined exchange, each path streaming into the sink and retryable (placed by
the exchange's nested rows and identity shuffle): wall time, CPU of the JVM and of the Python workers, the
targets' ratios (of the medians, and paired: the median of each round's own), and the pipelined tasks' CPU per
buffer by thread from their own metrics.

With ``--calls``, one more run of each path and core per task count counts its Python function calls per data
buffer (``sys.setprofile`` on every thread that works for it; calls into C not counted): how much Python a buffer
costs, in a figure that does not drift with the machine's speed as CPU time does, so two versions of a path can be
compared on a noisy machine, and the budget beyond the core split into what sockets cost and what the protocol does.

The last line printed is one JSON object with the headline figures. Run ``python jobs/bench_path_floor.py``
(about two minutes; ``--spark`` adds about two more). The figures and what they say: docs/benchmarks.md,
"The floor under the pipelined path" and its "In Spark".
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from spark_credit_shuffle.jobs.common import TARGET_STREAMING_VS_MAP as TARGET_STREAMING
from spark_credit_shuffle.jobs.common import bench_session, rotated
from spark_credit_shuffle.jobs.lean_path import (
    CALL_CASES,
    CREDITS,
    PORTS_PER_RUN,
    SPARK_CASES,
    THREAD_METRICS,
    free_port_bases,
    lean_core,
    lean_path,
    pipelined_core,
    pipelined_path,
    python_calls,
    spark_floor,
)

__all__ = ["SPARK_CASES", "free_port_bases", "main", "parse_args", "print_spark_floor", "spark_floor"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000, help="rows over all tasks (default 4,000,000)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds, medians reported (default 3)")
    parser.add_argument(
        "--parallelism", type=int, nargs="+", default=[2, 4], help="task counts to measure (default 2 4)"
    )
    parser.add_argument(
        "--spark",
        action="store_true",
        help="also run both paths in Spark barrier stages on local[P] (P the largest --parallelism), beside "
        "mapInArrow alone and repartition + mapInArrow",
    )
    parser.add_argument("--only-spark", action="store_true", help="the Spark part only")
    parser.add_argument(
        "--calls",
        action="store_true",
        help="also count the Python function calls per data buffer of each path and core (one more run each, "
        "not timed): the figure that does not drift with the machine's speed",
    )
    parser.add_argument(
        "--master",
        default=None,
        help="the Spark part's master: local[P] (default) or local-cluster[...] (the lean tasks listen on "
        "127.0.0.1, so one machine only)",
    )
    args = parser.parse_args(argv)
    if any(not 2 <= p <= PORTS_PER_RUN for p in args.parallelism):
        parser.error(f"--parallelism: task counts from 2 to {PORTS_PER_RUN}, got {args.parallelism}")
    if args.master is not None and not args.master.startswith(("local[", "local-cluster[")):
        parser.error(f"--master: local[P] or local-cluster[N,C,M] (one machine), got {args.master!r}")
    if args.calls and args.only_spark:
        parser.error("--calls counts the paths between processes, which --only-spark leaves out")
    if args.rows < 1 or args.repeat < 1:
        parser.error(f"--rows and --repeat: at least 1, got {args.rows} and {args.repeat}")
    return args


def print_spark_floor(figures: dict[str, Any], headline: dict[str, Any]) -> None:
    """The Spark part's table and ratios; its headline figures go into ``headline``."""
    print(f"\nin Spark{'':<24} {'median s':>9} {'JVM CPU s':>10} {'Python CPU s':>13}   runs")
    for name in SPARK_CASES:
        jvm = figures["cpu_jvm_s"].get(name, float("nan"))
        python = figures["cpu_python_s"].get(name, float("nan"))
        runs = ", ".join(f"{v:.2f}" for v in figures["runs"][name])
        print(f"  {name:<30} {figures['seconds'][name]:9.2f} {jvm:10.2f} {python:13.2f}   {runs}")
        key = name.replace(" + ", "_plus_").replace(", ", "_").replace(" ", "_")
        headline[f"spark_seconds_{key}"] = round(figures["seconds"][name], 3)
        if name in figures["cpu_python_s"]:
            headline[f"spark_cpu_python_s_{key}"] = round(figures["cpu_python_s"][name], 3)
            headline[f"spark_cpu_jvm_s_{key}"] = round(figures["cpu_jvm_s"][name], 3)
    ratios, paired = figures["ratios"], figures["ratios_paired"]

    def both(key: str) -> str:  # the ratio of the medians, and the median of each round's own ratio
        return f"{ratios[key]:.2f}x (paired {paired[key]:.2f}x)"

    for form in ("lean", "pipelined"):
        print(
            f"  {form}: streaming {both(f'{form}_streaming_vs_mapinarrow_throughput')} the throughput of "
            f"mapInArrow alone (target >= {TARGET_STREAMING:.2f}x), retryable "
            f"{both(f'{form}_retryable_vs_reference_throughput')} repartition + mapInArrow (target >= 1.0x)"
        )
    print(
        f"  the pipelined exchange against the lean path: streaming {both('pipelined_streaming_vs_lean_throughput')}"
        f", retryable {both('pipelined_retryable_vs_lean_throughput')} the throughput"
    )
    headline.update({f"spark_{k}_ratio": round(v, 3) for k, v in ratios.items()})
    headline.update({f"spark_{k}_ratio_paired": round(v, 3) for k, v in paired.items()})
    per_buffer = figures["pipelined_streaming_us_per_buffer"]
    print(
        f"  pipelined, streaming: {per_buffer['buffers']:,.0f} data buffers, us of CPU per buffer by thread (the "
        "producer's includes reading the input from Spark, the consumer's handing the output to it): "
        + ", ".join(f"{t} {per_buffer[t]:.1f}" for t in THREAD_METRICS)
    )
    for thread in THREAD_METRICS:
        headline[f"spark_pipelined_streaming_{thread.replace(' ', '_').replace('/', '')}_us_per_buffer"] = round(
            per_buffer[thread], 1
        )


def print_calls(calls: dict[int, dict[str, float]], headline: dict[str, Any]) -> None:
    """The table of Python function calls per data buffer, by task count; its figures go into ``headline``."""
    print("\nPython function calls per data buffer (one counted run each, every thread of a path counted)")
    print("  P   lean core   lean path   beyond   pipelined core   pipelined path   beyond   path / lean path")
    for parallelism, counted in calls.items():
        lean_beyond = counted["lean path"] - counted["lean core"]
        beyond = counted["pipelined path"] - counted["pipelined core"]
        print(
            f"{parallelism:3d} {counted['lean core']:11.1f} {counted['lean path']:11.1f} {lean_beyond:8.1f} "
            f"{counted['pipelined core']:16.1f} {counted['pipelined path']:16.1f} {beyond:8.1f} "
            f"{counted['pipelined path'] / counted['lean path']:17.1f}x"
        )
        for case in CALL_CASES:
            headline[f"p{parallelism}_{case.replace(' ', '_')}_calls_per_buffer"] = round(counted[case], 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"{args.rows:,} rows over P tasks in processes of their own, key_by('a'), 32 KiB buffers, "
        f"{CREDITS} in flight per channel; CPU of all processes per data buffer, median of {args.repeat} rounds"
    )
    figures: dict[int, dict[str, list[tuple[float, int]]]] = {}
    ports = free_port_bases()
    for parallelism in [] if args.only_spark else args.parallelism:
        rows = args.rows // parallelism
        cases = {
            "lean core": lambda p=parallelism, r=rows: lean_core(p, r),
            "lean path": lambda p=parallelism, r=rows: lean_path(p, r, next(ports)),
            "pipelined core": lambda p=parallelism, r=rows: pipelined_core(p, r),
            "pipelined path": lambda p=parallelism, r=rows: pipelined_path(p, r),
        }
        got: dict[str, list[tuple[float, int]]] = {name: [] for name in cases}
        for round_ in range(args.repeat):  # rotated, so that no case always runs first or last
            for name in rotated(list(cases), round_):
                got[name].append(cases[name]())
        figures[parallelism] = got
    if figures:
        print()
        print(
            "  P   lean core   lean path   beyond   pipelined core   pipelined path   beyond   path / lean path"
            "   paired   per row"
        )
    headline: dict[str, Any] = {"rows": args.rows, "credits_per_channel": CREDITS, "unit": "us of CPU per buffer"}
    for parallelism, got in figures.items():
        med = {name: statistics.median(us for us, _ in values) for name, values in got.items()}
        lean_beyond = med["lean path"] - med["lean core"]
        beyond = med["pipelined path"] - med["pipelined core"]
        ratio = med["pipelined path"] / med["lean path"]
        # each round's own ratio (its two paths ran minutes apart at most): steadier than the ratio of the medians
        # when the machine's speed drifts between rounds
        pairs = list(zip(got["pipelined path"], got["lean path"], strict=True))
        paired = statistics.median(p / lean for (p, _), (lean, _) in pairs)
        # the same, per row moved: the CPU of all processes for the same rows (the lean path cuts more buffers)
        per_row = statistics.median(p * pb / (lean * lb) for (p, pb), (lean, lb) in pairs)
        print(
            f"{parallelism:3d} {med['lean core']:10.1f} {med['lean path']:11.1f} {lean_beyond:8.1f} "
            f"{med['pipelined core']:16.1f} {med['pipelined path']:16.1f} {beyond:8.1f} {ratio:18.2f}x"
            f" {paired:7.2f}x {per_row:8.2f}x"
        )
        print("      runs: " + "; ".join(f"{n} " + ", ".join(f"{us:.0f}" for us, _ in vs) for n, vs in got.items()))
        buffers = {name: statistics.median(b for _, b in values) for name, values in got.items()}
        print(
            "      data buffers: "
            + ", ".join(f"{name} {count:,.0f}" for name, count in buffers.items())
            + f" (the lean path {buffers['lean path'] / buffers['pipelined path']:.3f}x the pipelined path's)"
        )
        headline[f"p{parallelism}_lean_buffers"] = int(buffers["lean path"])
        headline[f"p{parallelism}_pipelined_buffers"] = int(buffers["pipelined path"])
        headline[f"p{parallelism}_pipelined_vs_lean_path_ratio_per_row"] = round(per_row, 2)
        headline[f"p{parallelism}_lean_core_us"] = round(med["lean core"], 1)
        headline[f"p{parallelism}_lean_path_us"] = round(med["lean path"], 1)
        headline[f"p{parallelism}_lean_beyond_core_us"] = round(lean_beyond, 1)
        headline[f"p{parallelism}_pipelined_core_us"] = round(med["pipelined core"], 1)
        headline[f"p{parallelism}_pipelined_path_us"] = round(med["pipelined path"], 1)
        headline[f"p{parallelism}_pipelined_beyond_core_us"] = round(beyond, 1)
        headline[f"p{parallelism}_pipelined_vs_lean_path_ratio"] = round(ratio, 2)
        headline[f"p{parallelism}_pipelined_vs_lean_path_ratio_paired"] = round(paired, 2)
    if args.calls:  # parse_args refused it with --only-spark
        print_calls({p: python_calls(p, args.rows // p, next(ports)) for p in args.parallelism}, headline)
    if args.spark or args.only_spark:
        tasks = max(args.parallelism)
        spark, created = bench_session(
            "bench_path_floor", args.master or f"local[{tasks}]", driver_memory="4g", shuffle_partitions=tasks
        )
        print(f"\n{args.rows:,} rows on {tasks} tasks in Spark ({spark.sparkContext.master}), medians of {args.repeat}")
        try:
            print_spark_floor(spark_floor(spark, args.rows, tasks, args.repeat, ports), headline)
        finally:
            if created:
                spark.stop()
    print(json.dumps(headline, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
