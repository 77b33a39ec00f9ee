"""Benchmark: how the simulation (``spark_credit_shuffle.simulation.simulate``) scales with the number of tasks.

The configuration of the scale target (docs/benchmarks.md, "Simulation at scale"): ``tasks`` producers and ``tasks``
consumers, all-to-all (``tasks**2`` channels), on ``tasks / 8`` hosts of 8 slots (producer and consumer ``i`` on
host ``i // 8``: a consumer reads the 8 producers of its own host directly, the others over one connection per host
pair), 20 MB/s per producer, 40 MB/s per consumer, 100 us latency, the default ``NetworkConfig``; ``--duration``
virtual seconds per size (default 0.5 s, 0.2 s at 64 tasks, as first measured; 1 s at 800 tasks, the target's run
of about ten minutes). Network memory: the
default (64 MB, 2048 buffers per host) where it holds a host's minimum (16 and 64 tasks), otherwise each host gets
exactly its minimum plus 2048 buffers (``extra_buffers_per_host=2048``; column ``network``).

Each size runs in a subprocess of its own, so its peak resident memory (``ru_maxrss`` of the child) is its own.
Printed per size: tasks, channels, virtual s, wall s and CPU s (the run alone: building the topology and ``run()``,
not the interpreter's start; CPU is steadier than wall time on a shared machine), peak RSS MB, KB per channel (peak
RSS over the channels), wall us per buffer and CPU us per buffer (the data buffers the consumers received). With
``--repeat`` > 1 the figures are medians. The last line printed is one JSON object with the figures of every size.
A run that takes longer than ``--progress`` wall seconds (default 30) prints a progress line on stderr at that
interval: virtual time done, wall and CPU seconds so far, resident memory now and its peak.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

SLOTS = 8
#: The durations per size first measured (virtual seconds); other sizes run 0.5 s unless ``--duration`` says.
DURATIONS = {16: 0.5, 64: 0.2, 128: 0.5, 800: 1.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="16,128,800", help="comma-separated task counts (multiples of 8)")
    parser.add_argument("--duration", type=float, default=None, help="virtual seconds for every size")
    parser.add_argument("--repeat", type=int, default=1, help="runs per size (medians reported)")
    parser.add_argument("--progress", type=float, default=30.0, help="wall seconds between progress lines (0: none)")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: this many tasks
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(t) for t in args.tasks.split(",")]
    except ValueError:
        parser.error(f"--tasks takes comma-separated integers, got {args.tasks!r}")
    if not args.sizes or min(args.sizes) < 1 or args.repeat < 1:
        parser.error("every task count >= 1, --repeat >= 1")
    return args


class Progress:
    """A progress line on stderr at most every ``every`` wall seconds: virtual time, wall and CPU seconds since
    ``start``, resident memory now and the peak so far (what a long run at 800 tasks is doing)."""

    def __init__(self, tasks: int, duration: float, every: float) -> None:
        self.label = f"[{tasks} tasks]"
        self.duration = duration
        self.every = every
        self.start = self.last = time.perf_counter()
        self.cpu = time.process_time()

    def __call__(self, now: float) -> None:
        wall = time.perf_counter()
        if wall - self.last < self.every:
            return
        self.last = wall
        print(
            f"{self.label} virtual {now:.4f} of {self.duration:g} s, wall {wall - self.start:.0f} s, "
            f"CPU {time.process_time() - self.cpu:.0f} s, RSS {_rss_now_mb():.0f} MB (peak {_peak_rss_mb():.0f})",
            file=sys.stderr,
            flush=True,
        )


def _rss_now_mb() -> float:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # not Linux
        return float("nan")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_one(tasks: int, duration: float, progress_every: float = 0.0) -> dict[str, Any]:
    """One run in this process (the child): the figures of one size."""
    from spark_credit_shuffle.errors import InsufficientNetworkBuffersError
    from spark_credit_shuffle.simulation import simulate

    hosts = [i // SLOTS for i in range(tasks)]
    kwargs: dict[str, Any] = {
        "num_producers": tasks,
        "num_consumers": tasks,
        "producer_rate": 20e6,
        "consumer_rate": 40e6,
        "producer_hosts": hosts,
        "consumer_hosts": hosts,
        "latency": 100e-6,
        "duration": duration,
        "max_steps": 10**9,  # the default (2 M events, a guard for tests) ends an 800-task run at 0.33 virtual s
    }
    if progress_every > 0:
        kwargs["progress"] = Progress(tasks, duration, progress_every)
        kwargs["progress_steps"] = 100
    network = "default"
    start, cpu = time.perf_counter(), time.process_time()
    try:
        report = simulate(**kwargs)
    except InsufficientNetworkBuffersError:  # raised while building, before the run: the default is too small
        network = "minimum+2048"
        start, cpu = time.perf_counter(), time.process_time()
        report = simulate(**kwargs, extra_buffers_per_host=2048)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    buffers = sum(r.value for r in report.rows if r.side == "consumer" and r.metric == "numBuffersIn")
    rss_mb = _peak_rss_mb()
    channels = tasks * tasks
    return {
        "tasks": tasks,
        "channels": channels,
        "virtual_s": duration,
        "network": network,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "peak_rss_mb": round(rss_mb, 1),
        "kb_per_channel": round(rss_mb * 1024 / channels, 2),
        "buffers": int(buffers),
        "wall_us_per_buffer": round(wall / buffers * 1e6, 1) if buffers else None,
        "cpu_us_per_buffer": round(cpu / buffers * 1e6, 1) if buffers else None,
        "steps": report.steps,
    }


def measure(tasks: int, duration: float, progress_every: float) -> dict[str, Any]:
    """One size in a subprocess of its own (its progress lines go to this process's stderr)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", str(tasks), "--duration", str(duration)]
    cmd += ["--progress", str(progress_every)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.duration if args.duration is not None else 0.5, args.progress)))
        return 0
    columns = ("tasks", "channels", "virtual_s", "network", "wall_s", "cpu_s", "peak_rss_mb", "kb_per_channel")
    columns += ("buffers", "wall_us_per_buffer", "cpu_us_per_buffer")
    print(" ".join(f"{c:>18}" for c in columns))
    results = []
    for tasks in args.sizes:
        duration = args.duration if args.duration is not None else DURATIONS.get(tasks, 0.5)
        runs = [measure(tasks, duration, args.progress) for _ in range(args.repeat)]
        row = dict(runs[0])
        for key in ("wall_s", "cpu_s", "peak_rss_mb", "kb_per_channel", "wall_us_per_buffer", "cpu_us_per_buffer"):
            values = [r[key] for r in runs if r[key] is not None]
            row[key] = round(statistics.median(values), 2) if values else None
        results.append(row)
        print(" ".join(f"{row[c]!s:>18}" for c in columns), flush=True)
    print(json.dumps({"simulation_scale": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
