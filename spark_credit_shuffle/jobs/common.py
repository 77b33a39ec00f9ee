"""What the jobs and the benchmarks share: their generated data, a benchmark's SparkSession, timing and CPU.

Defined once here so that every script of ``jobs/`` reads and times the same rows the same way, and none of
them imports another script.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from ..cli import job_session

__all__ = [
    "BENCH_CONF",
    "TARGET_STREAMING_VS_MAP",
    "CallCounter",
    "bench_session",
    "cached_rows",
    "events",
    "interleaved",
    "metric_rows",
    "noop",
    "process_tree_cpu",
    "rotated",
    "slow_on",
    "timed",
    "worst",
]

T = TypeVar("T")

#: The target of a streaming pipelined exchange (and of the lean path under it): at least this share of the
#: throughput of an identity ``mapInArrow`` alone (jobs/bench_exchange.py, jobs/bench_path_floor.py).
TARGET_STREAMING_VS_MAP = 0.88

#: A benchmark's own local session: no UI, plans as written (no adaptive execution), barrier stages checked for
#: free slots every second (Spark's default waits 15 s between checks).
BENCH_CONF: tuple[tuple[str, str], ...] = (
    ("spark.ui.enabled", "false"),
    ("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s"),
    ("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "3"),
)


def bench_session(
    app_name: str,
    master: str,
    *,
    driver_memory: str | None = None,
    executor_memory: str | None = None,
    shuffle_partitions: int | None = None,
    conf: Iterable[tuple[str, str]] = (),
) -> tuple[Any, bool]:
    """A benchmark's SparkSession and whether it was created here (:func:`~spark_credit_shuffle.cli.job_session`):
    spark-submit's or the active one as they are, else a local one on ``master`` with :data:`BENCH_CONF`, the
    given memory and shuffle partitions, and its JVM at full speed (no quick start), logging errors only."""
    local = list(BENCH_CONF)
    if driver_memory:
        local.append(("spark.driver.memory", driver_memory))
    if executor_memory:
        local.append(("spark.executor.memory", executor_memory))
    if shuffle_partitions:
        local.append(("spark.sql.shuffle.partitions", str(shuffle_partitions)))
    return job_session(app_name, master, conf, local_conf=local, quick_start=False, log_level="ERROR")


def events(spark: Any, rows: int, partitions: int) -> Any:
    """``rows`` generated events on ``partitions`` partitions: ``user_id`` (long, 1,000 keys), ``seq`` (int) and
    ``payload`` (``event-<id>``): what the exchange job's ``--generate`` and the demo exchange."""
    from pyspark.sql import functions as F

    return spark.range(0, rows, 1, partitions).select(
        (F.col("id") % 1000).cast("long").alias("user_id"),
        F.col("id").cast("int").alias("seq"),
        F.concat(F.lit("event-"), F.col("id").cast("string")).alias("payload"),
    )


def cached_rows(spark: Any, rows: int, partitions: int, columns: str = "abc") -> Any:
    """The benchmarks' input: ``rows`` rows on ``partitions`` partitions, of the columns ``columns`` names among
    ``a`` (long, unique), ``b`` (int, ``a * 7919 mod 1,000,003``) and ``c`` (``a`` as a 20-character string),
    generated deterministically, cached and materialised before anything is timed."""
    from pyspark.sql import functions as F

    every = {
        "a": F.col("id").alias("a"),
        "b": ((F.col("id") * 7919) % 1_000_003).cast("int").alias("b"),
        "c": F.lpad(F.col("id").cast("string"), 20, "x").alias("c"),
    }
    df = spark.range(0, rows, 1, partitions).select(*(every[name] for name in columns))
    df = df.cache()
    df.count()
    return df


def noop(df: Any) -> None:
    """Run ``df`` into Spark's ``noop`` sink: every row computed, nothing written."""
    df.write.format("noop").mode("overwrite").save()


def timed(action: Callable[[], Any], repeat: int) -> tuple[float, list[float]]:
    """Median seconds of ``repeat`` runs of ``action`` (and every run's time)."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times), times


def rotated(items: list[T], round_: int) -> list[T]:
    """``items`` starting at position ``round_``: each round runs every case once (a busy moment of the
    machine hits them alike) and each case takes every position in turn (on this machine a run measured
    up to 20% slower in the position right after another exchange than before it)."""
    k = round_ % len(items)
    return items[k:] + items[:k]


def interleaved(cases: dict[str, Callable[[], float]], repeat: int) -> dict[str, float]:
    """Median seconds per case, the cases run in turn ``repeat`` times after one warm-up round (each action
    returns its own seconds)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(repeat + 1):
        for name, action in cases.items():
            seconds = action()
            if round_:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


class CallCounter:
    """Counts the Python function calls the current thread makes inside ``with`` (``sys.setprofile``; calls into
    C are not counted). The figure to compare two versions of a path by: unlike its CPU time, it does not drift
    with the machine's speed. Counting slows the thread several times over, so counted runs are never timed."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls = 0

    def _count(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.calls += 1

    def __enter__(self) -> CallCounter:
        sys.setprofile(self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


def process_tree_cpu() -> dict[str, float] | None:
    """CPU seconds (user and system, every thread, ended ones too) of this process's descendants, by kind:
    ``jvm`` (Spark's JVMs) and ``python`` (Spark's Python daemon and workers); None without ``/proc``.

    The wall clock of one run on a shared machine moves by up to 2x with the machine's other work; the CPU a
    case used moves much less, so the CPU ratios printed beside the time ratios say what a case costs. A
    process's reaped children count through its own ``cutime``/``cstime``; a worker that exits between two
    readings takes its CPU with it (Spark reuses its Python workers, ``spark.python.worker.reuse``)."""
    if not os.path.isdir("/proc"):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    kind: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        pid = int(entry)
        parent[pid] = int(fields[1])
        cpu[pid] = sum(int(v) for v in fields[11:15]) / tick  # utime, stime, cutime, cstime
        kind[pid] = "jvm" if comm == "java" else "python"
    me = os.getpid()
    out = {"jvm": 0.0, "python": 0.0}
    for pid, seconds in cpu.items():
        ancestor = parent.get(pid)
        while ancestor is not None and ancestor not in (me, 0, 1):
            ancestor = parent.get(ancestor)
        if ancestor == me:
            out[kind[pid]] += seconds
    return out


def metric_rows(collected: Any) -> list[dict[str, Any]]:
    """The metric rows an exchange's run collected, as dicts."""
    return [vars(r) for r in collected.rows()]


def worst(rows: list[dict[str, Any]], metric: str, stat: str) -> float | None:
    """The largest value of ``metric`` (its ``stat``) over every task's rows; None if no row has it."""
    values = [r["value"] for r in rows if r["metric"] == metric and r["stat"] == stat]
    return max(values) if values else None


def slow_on(partition: int, seconds_per_row: float) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """A ``map_in_pandas`` / ``mapInPandas`` function of the user's kind that sleeps ``seconds_per_row`` per row in
    the task of one partition (``-1``: every one) and yields its frames unchanged: the slow step of the demos."""

    def slow(frames: Iterator[Any]) -> Iterator[Any]:
        from pyspark import TaskContext

        context = TaskContext.get()
        mine = partition < 0 or (context is not None and context.partitionId() == partition)
        for frame in frames:
            if mine:
                time.sleep(seconds_per_row * len(frame))
            yield frame

    return slow
