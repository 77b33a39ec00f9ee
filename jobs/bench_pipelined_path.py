"""Benchmark: the per-buffer CPU budget of the pipelined path, by stage and thread, without Spark.

``--tasks`` pipelined tasks (:class:`~spark_credit_shuffle.runtime.pipelined.task.PipelinedTask`, as a Spark barrier
task runs them) each in a process of its own, on 127.0.0.1, exchange ``--rows`` rows per task (``a`` long,
``b`` int, ``c`` a 20-character string, as ``jobs/bench_exchange.py``) by ``key_by("a")`` in network buffers
of 32 KiB: every task produces and consumes, so each moves about ``1 / tasks`` of its buffers to itself and
the rest to the others (remote channels; ``--local`` puts all tasks on one executor: local channels through
the connection, Flink's ``LocalInputChannel`` across processes). The input is built before the clock starts.

It measures CPU per thread (``time.thread_time``; the task's own metrics: its input, loop and output
threads, see :mod:`spark_credit_shuffle.runtime.pipelined.loop`, and the process for the rest), divided by the
data buffers the exchange moved:

- ``--repeat`` plain runs: the headline figures (medians), untouched by any measurement inside;
- one profiled run: every stage's own CPU (exclusive of the stages it calls), per thread, from timers
  wrapped around the functions that make up each stage (producer: slice + IPC write, enqueue, notify;
  sender: poll, encode, write; receiver: read, decode, dispatch, enqueue; consumer: poll, decode, output;
  credit and recycle messages each way). Each timed call costs about the ``timer overhead`` printed with
  the table, which lands in the stages;
- with ``--calls``, one more run counting every thread's Python function calls per buffer: the figure to
  compare changes by when the machine's speed drifts (as ``jobs/bench_protocol.py --bytecodes``); the plain
  runs also count the processes' context switches per buffer (``getrusage``: waits and preemptions);
- ``exchange core in place`` (as ``jobs/bench_exchange.py``): the same rows through the RecordWriter, a
  pipelined result partition, a gate reading every subpartition, the RecordReaders and the output batching
  in one thread, with no network and no other thread; its CPU per buffer is the floor the path's cost is
  counted from ("beyond the core in place").

Every run checks that every row arrived once (row count and the sum of ``a``). The last line printed is
one JSON object with the headline figures. Run ``python jobs/bench_pipelined_path.py --calls`` (about half a
minute); ``--tasks 4 --rows 1000000`` for four tasks, ``--local`` for local channels between processes. The
figures and what they say: docs/benchmarks.md, "Pipelined path budget".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from typing import Any

from spark_credit_shuffle.jobs.pipelined_path import buffers_of, core_in_place, run_exchange, stage_table, thread_cpu_s


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2, help="pipelined tasks, one process each (default 2)")
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows each task produces (default 2,000,000)")
    parser.add_argument("--repeat", type=int, default=3, help="plain runs, medians reported (default 3)")
    parser.add_argument("--local", action="store_true", help="all tasks on one executor: local channels")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled run (no stage table)")
    parser.add_argument(
        "--calls",
        action="store_true",
        help="one more run counting the Python function calls of every thread (the figure to compare changes by "
        "when the machine's speed drifts)",
    )
    args = parser.parse_args(argv)
    for name in ("tasks", "rows", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"{args.tasks} pipelined tasks in processes of their own, {args.rows:,} rows each, key_by('a'), "
        f"32 KiB buffers, {'local channels (one executor)' if args.local else 'remote channels'}"
    )
    core_runs = []
    plain_runs = []
    for _ in range(args.repeat):  # rotated: core, exchange, core, exchange ...
        core_runs.append(core_in_place(args.tasks, args.rows))
        plain_runs.append(run_exchange(args.tasks, args.rows, args.local))
    core_us = statistics.median(cpu / max(1, b) * 1e6 for cpu, _, b in core_runs)
    core_write_us = statistics.median(w / max(1, b) * 1e6 for _, w, b in core_runs)
    per_role: dict[str, list[float]] = defaultdict(list)
    walls = []
    switches: dict[str, list[float]] = defaultdict(list)
    for run in plain_runs:
        out, remote, local = buffers_of(run)
        for role, seconds in thread_cpu_s(run).items():
            per_role[role].append(seconds / out * 1e6)
        walls.append(run["wall_s"])
        for kind in ("voluntary", "involuntary"):
            switches[kind].append(sum(t["metrics"][f"{kind}Switches"] for t in run["tasks"]) / out)
    out, remote, local = buffers_of(plain_runs[-1])
    med = {role: statistics.median(values) for role, values in per_role.items()}
    print(f"data buffers: {out:,} sent; received {remote:,} over remote channels, {local:,} local or own")
    print(f"\nplain runs (median of {args.repeat}), us of CPU per data buffer, all tasks:")
    for role in ("input", "loop", "output", "rest", "total"):
        values = " / ".join(f"{v:.1f}" for v in per_role[role])
        print(f"  {role:14s} {med[role]:7.1f}   ({values})")
    print(f"  core in place  {core_us:7.1f}   (one thread, no network: the floor)")
    print(
        f"    of which the writer (slice + IPC write) {core_write_us:.1f}, the rest (read, decode, output) "
        f"{core_us - core_write_us:.1f}"
    )
    vol, invol = (statistics.median(switches[k]) for k in ("voluntary", "involuntary"))
    print(f"  context switches per data buffer, all threads: {vol:.2f} voluntary (waits), {invol:.2f} involuntary")
    by_thread = {
        role: statistics.median(
            sum(t["switches"].get(role, 0) for t in run["tasks"]) / buffers_of(run)[0] for run in plain_runs
        )
        for role in ("input", "loop", "output")
    }
    print("    voluntary, by thread: " + ", ".join(f"{role} {value:.2f}" for role, value in by_thread.items()))
    beyond = med["total"] - core_us
    print(f"  beyond the core in place: {beyond:.1f} us per buffer; wall {statistics.median(walls):.2f} s")
    headline: dict[str, Any] = {
        "tasks": args.tasks,
        "rows_per_task": args.rows,
        "local_channels": args.local,
        "buffers": out,
        "buffers_remote": remote,
        "us_per_buffer_input_thread": round(med["input"], 1),
        "us_per_buffer_loop_thread": round(med["loop"], 1),
        "us_per_buffer_output_thread": round(med["output"], 1),
        "us_per_buffer_rest": round(med["rest"], 1),
        "us_per_buffer_total": round(med["total"], 1),
        "us_per_buffer_core_in_place": round(core_us, 1),
        "us_per_buffer_core_writer": round(core_write_us, 1),
        "us_per_buffer_beyond_core": round(beyond, 1),
        "wall_s": round(statistics.median(walls), 2),
        "voluntary_switches_per_buffer": round(vol, 2),
        **{f"voluntary_switches_per_buffer_{role}": round(value, 2) for role, value in by_thread.items()},
    }
    if not args.no_profile:
        run = run_exchange(args.tasks, args.rows, args.local, profile="stages")
        buffers = buffers_of(run)[0]
        rows, overhead = stage_table(run, buffers)
        print(f"\nprofiled run: own CPU of each stage, us per data buffer (timer overhead {overhead:.2f} us per call;")
        print("  'net': less that overhead per timed call)")
        print(f"  {'thread':9s} {'stage':42s} {'us/buffer':>9s} {'net':>6s} {'calls/buffer':>12s}")
        for role, label, us, calls in rows:
            net = max(0.0, us - calls * overhead)
            print(f"  {role:9s} {label:42s} {us:9.1f} {net:6.1f} {calls:12.2f}")
        headline["profiled_us_per_buffer_total"] = round(thread_cpu_s(run)["total"] / buffers * 1e6, 1)
    if args.calls:
        run = run_exchange(args.tasks, args.rows, args.local, profile="calls")
        buffers = buffers_of(run)[0]
        counted: dict[str, int] = defaultdict(int)
        for task in run["tasks"]:
            for role, count in task["python_calls"].items():
                counted[role] += count
        print("\nPython function calls per data buffer, all tasks:")
        for role in ("input", "loop", "output"):
            print(f"  {role:9s} {counted.get(role, 0) / buffers:7.1f}")
            headline[f"python_calls_per_buffer_{role}"] = round(counted.get(role, 0) / buffers, 1)
        headline["python_calls_per_buffer"] = round(sum(counted.values()) / buffers, 1)
        print(f"  {'total':9s} {headline['python_calls_per_buffer']:7.1f}")
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
