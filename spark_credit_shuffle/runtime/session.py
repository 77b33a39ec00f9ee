"""Which kind of SparkSession the exchange runs on, and what it can learn from it on the driver.

The session's executors and task slots are read here, once, for the planner (network memory per executor)
and the pipelined runtime (enough slots for a barrier stage); :func:`is_connect` and :func:`spark_context`
live in the bottom layer (:mod:`spark_credit_shuffle._pyspark`, so that the config can ask them too) and
are importable from here.

A classic session has a driver JVM in this process (``SparkContext``, accumulators, RDDs); a Spark
Connect session (``SparkSession.builder.remote(...)``, ``SPARK_REMOTE``, Databricks' shared and
serverless compute) is a client of a remote driver and has none of them. Every place in the package that
needs the SparkContext asks :func:`spark_context` and takes the Connect path when it returns None, so
nothing touches the JVM on a Connect session.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from .._pyspark import is_connect, spark_context
from ..errors import CreditShuffleError, WorkerPythonError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = [
    "ARROW_BATCH_BYTES_KEY",
    "ansi_mode",
    "available_slots",
    "barrier_refusal",
    "bound_arrow_batches",
    "check_worker_python",
    "configured_executors",
    "dynamic_allocation",
    "executor_slots",
    "is_connect",
    "num_partitions",
    "physical_plan",
    "registered_executors",
    "spark_context",
    "task_partition_id",
    "wait_for_executors",
    "worker_python",
    "worker_python_problem",
]

_log = logging.getLogger(__name__)

#: Spark's bound on the bytes of one Arrow batch it hands a Python task (its default: 64 MiB).
ARROW_BATCH_BYTES_KEY = "spark.sql.execution.arrow.maxBytesPerBatch"

_LOCAL = re.compile(r"^local(?:\[(\*|\d+)(?:\s*,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*(?:,[^\]]*)?\]$")


def _partition_ids(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """One row per task, its partition id, whatever the partition holds (also when it is empty)."""
    for _ in batches:  # none: every row was dropped in the JVM
        pass
    yield pa.record_batch([pa.array([task_partition_id()], pa.int32())], names=["partition"])


def task_partition_id() -> int:
    """The partition of the Spark task this runs in; :class:`CreditShuffleError` outside of a task."""
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        raise CreditShuffleError("this function runs inside a Spark task only (no TaskContext here)")
    return context.partitionId()


def _count_partitions(df: DataFrame, drop_rows: bool) -> int:
    from pyspark.sql import functions as F

    projected = df.select(F.lit(0).alias("partition"))
    if drop_rows:
        projected = projected.where(F.spark_partition_id() < 0)
    ids = [r.partition for r in projected.mapInArrow(_partition_ids, "partition int").collect()]
    if sorted(ids) != list(range(len(ids))):  # one row per task, ids 0..n-1
        raise CreditShuffleError(f"counting the input's partitions gave the task ids {sorted(ids)}")
    return len(ids)


def num_partitions(df: DataFrame) -> int:
    """How many partitions ``df`` has: the producer subtasks of an exchange over it.

    A classic session reads it from the plan (``df.rdd.getNumPartitions()``; no job runs, except the
    stages adaptive query execution runs to plan what follows them). Spark Connect has no such call, so
    it runs one small Spark job: every task of ``df``'s plan reports its partition id. The job reads no
    column (it projects ``df`` to a constant, so column pruning skips every column of the scan) and drops
    every row in the JVM before the Python worker, whose task yields just its id, empty partitions
    included: it costs what Spark spends to run ``df``'s plan without its columns (on this project's test
    machine about 0.3 s for 20 M rows, 4 partitions, from ``range`` or Parquet). Spark folds a filter
    over local data (``createDataFrame`` from Python objects) at planning time, which leaves no task at
    all; when the first count finds none, a second one keeps the rows (local data is small).
    """
    sc = spark_context(df.sparkSession)
    if sc is not None:
        return df.rdd.getNumPartitions()
    return _count_partitions(df, drop_rows=True) or _count_partitions(df, drop_rows=False)


def bound_arrow_batches(spark: Any, max_bytes: int) -> bool:
    """Have Spark hand Python tasks Arrow batches of at most ``max_bytes`` (its
    ``spark.sql.execution.arrow.maxBytesPerBatch``), unless the session sets that bound itself.

    Spark cuts a Python task's input after 10,000 rows or 64 MiB. Rows of whole network buffers
    (32 KiB each by default) reach the byte bound first: a consumer task of the blocking exchange would
    get its input in 64 MiB batches, which its Python worker holds whole, and which the JVM builds by
    growing its Arrow vectors over and over (a batch of a few MiB costs the JVM about half as much
    CPU per byte). The bound is a session setting, so it holds for every Python task of the session
    that gets batches larger than it; rows of ordinary width (10,000 rows under ``max_bytes``) are cut
    as before. Returns whether it set the bound: False when the session already has one (the user's
    choice is kept) or does not allow it to be set (a managed runtime's restriction; the exchange
    still runs, with Spark's batches).
    """
    from pyspark.errors import PySparkException  # the base of classic (captured) and Connect errors

    conf = spark.conf
    if conf.get(ARROW_BATCH_BYTES_KEY, None) is not None:
        return False
    try:
        conf.set(ARROW_BATCH_BYTES_KEY, f"{int(max_bytes)}b")
    except PySparkException as exc:
        _log.warning("could not set %s (%s); Spark's default bound applies", ARROW_BATCH_BYTES_KEY, exc)
        return False
    return True


# -- what a barrier stage over a DataFrame meets ---------------------------------------------------------

#: Physical operators whose RDD has another partition count than its input's (a union's is the sum of its
#: inputs', a coalesce's fewer, a cartesian product's the product): Spark runs no barrier stage whose RDD chain
#: holds one (``BarrierJobUnsupportedRDDChainException``: every RDD of a barrier stage must have as many
#: partitions as the stage has tasks).
_CHAIN_BREAKERS = frozenset({"Union", "Coalesce", "CartesianProduct"})
#: Operators below which another stage (a shuffle, a broadcast) produces the rows.
_STAGE_BOUNDARIES = frozenset(
    {"Exchange", "BroadcastExchange", "ReusedExchange", "ShuffleQueryStage", "BroadcastQueryStage"}
)
_PLAN_LINE = re.compile(r"^([ :+\-|]*)(?:\*\(\d+\) )?([A-Za-z]\w*)")


def physical_plan(df: DataFrame) -> str:
    """The physical plan Spark would run for ``df``, as ``explain()`` prints it (no job runs)."""
    sc = spark_context(df.sparkSession)
    if sc is not None:
        return str(df._jdf.queryExecution().simpleString())
    return str(df._explain_string(mode="simple"))  # type: ignore[operator]  # Connect's DataFrame has it


def stage_operators(plan: str) -> list[str]:
    """The operators of physical plan text ``plan`` (``explain()``'s tree) that run in the stage producing
    its output: every node not below a shuffle or broadcast exchange (cached relations included: their RDDs
    are part of the chain)."""
    lines = plan.split("== Physical Plan ==", 1)[-1].strip("\n").splitlines()
    found: list[str] = []
    below: list[tuple[int, bool]] = []  # (indent, beyond a stage boundary) of the current node's ancestors
    for line in lines:
        if not line.strip():
            break
        match = _PLAN_LINE.match(line)
        if match is None:
            continue
        indent, name = len(match.group(1)), match.group(2)
        while below and below[-1][0] >= indent:
            below.pop()
        beyond = bool(below) and below[-1][1]
        if not beyond:
            found.append(name)
        below.append((indent, beyond or name in _STAGE_BOUNDARIES))
    return found


def barrier_refusal(df: DataFrame) -> str | None:
    """The operator of ``df``'s last stage for which Spark would refuse a barrier stage reading ``df``
    directly (``Union``, ``Coalesce``, ``CartesianProduct``); None if there is none."""
    try:
        plan = physical_plan(df)
    except Exception as exc:  # a plan that cannot be shown here: let Spark decide at the action
        _log.info("could not read the physical plan of the exchange's input (%s)", exc)
        return None
    return next((name for name in stage_operators(plan) if name in _CHAIN_BREAKERS), None)


def dynamic_allocation(spark: Any) -> bool:
    """True if the session runs with dynamic allocation, under which Spark runs no barrier stage
    (``BarrierJobRunWithDynamicAllocationException``); Spark ignores the setting in local mode."""
    enabled = str(spark.conf.get("spark.dynamicAllocation.enabled", "false") or "false").strip().lower()
    return enabled == "true" and _LOCAL.match(_master(spark)) is None


def ansi_mode(spark: Any) -> bool:
    """True if ``spark`` runs in ANSI mode (``spark.sql.ansi.enabled``, on by default in Spark 4)."""
    return str(spark.conf.get("spark.sql.ansi.enabled", "true")).strip().lower() == "true"


# -- executors and task slots ----------------------------------------------------------------------------


def _master(spark: Any) -> str:
    return (spark.conf.get("spark.master", "local[*]") or "local[*]").strip()


def executor_slots(spark: Any) -> int:
    """Tasks one executor runs at once: its cores / ``spark.task.cpus``. The cores: N for ``local[N]``
    (the machine's for ``local[*]``, 1 for ``local``), C for ``local-cluster[E, C, M]``, otherwise
    ``spark.executor.cores`` (1 if unset)."""
    conf = spark.conf
    master = _master(spark)
    task_cpus = int(conf.get("spark.task.cpus", "1") or 1)
    cluster = _LOCAL_CLUSTER.match(master)
    local = _LOCAL.match(master)
    if cluster:
        cores = int(cluster.group(2))
    elif local:
        n = local.group(1)
        cores = 1 if master == "local" else (os.cpu_count() or 1) if n == "*" else int(n)
    else:
        cores = int(conf.get("spark.executor.cores", "1") or 1)
    return max(1, cores // task_cpus)


def configured_executors(spark: Any) -> int | None:
    """Executors the session is configured with: 1 in local mode, E for ``local-cluster[E, C, M]``,
    otherwise ``spark.executor.instances``; None when that is unset (dynamic allocation)."""
    master = _master(spark)
    cluster = _LOCAL_CLUSTER.match(master)
    if cluster:
        return int(cluster.group(1))
    if _LOCAL.match(master):
        return 1
    with contextlib.suppress(ValueError, TypeError):
        count = int(spark.conf.get("spark.executor.instances", "0") or 0)
        if count > 0:
            return count
    return None


def available_slots(spark: Any) -> tuple[int, int, int] | None:
    """(total task slots, executors, slots per executor) of the session's cluster; None if unknown.

    Local mode: one executor; ``local-cluster[E, C, M]``: E executors. A cluster: the registered
    executors (the driver excluded) on a classic session, else (Spark Connect, or none registered yet)
    ``spark.executor.instances``. Slots per executor: :func:`executor_slots`.
    """
    per = executor_slots(spark)
    master = _master(spark)
    executors = 0
    if not (_LOCAL.match(master) or _LOCAL_CLUSTER.match(master)):
        executors = registered_executors(spark) or 0
    if executors <= 0:
        executors = configured_executors(spark) or 0
    if executors <= 0:
        return None
    return executors * per, executors, per


def wait_for_executors(
    slots_needed: int, per: int, registered: Callable[[], int | None], timeout_s: float, poll_s: float = 0.05
) -> int:
    """Executors registered once they offer ``slots_needed`` task slots (``per`` each), or the number registered
    when ``timeout_s`` seconds have passed: ``registered()`` reports them (None: unknown now, counted as none)."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = registered() or 0
        if count * per >= slots_needed or time.monotonic() >= deadline:
            return count
        time.sleep(poll_s)


def registered_executors(spark: Any) -> int | None:
    """Executors registered with the driver now (the driver excluded) on a classic session of a cluster
    (``local-cluster`` or a cluster manager): they register some seconds after the session starts, one by
    one. None in local mode (its one executor is the driver) and on Spark Connect (no driver here)."""
    if _LOCAL.match(_master(spark)):
        return None
    sc = spark_context(spark)
    if sc is None:
        return None
    try:
        return max(0, int(sc._jsc.sc().getExecutorMemoryStatus().size()) - 1)
    except Exception:
        return None


# -- the Python the workers start --------------------------------------------------------------------------

#: What each interpreter a local session's workers would start lacks (None: nothing), by its absolute path:
#: asked once per interpreter and driver process (a probe costs some 0.3 s).
_PYTHON_PROBES: dict[str, str | None] = {}
#: The probe: what a task of the exchange imports first, and the Python version PySpark compares.
_PROBE = "import sys, pyarrow, spark_credit_shuffle; print('%d.%d' % sys.version_info[:2])"
#: A probe that has not answered by then is not waited for (the check is skipped, not failed).
_PROBE_TIMEOUT_S = 60.0


def worker_python(spark: Any) -> str | None:
    """The interpreter Spark starts ``spark``'s Python workers with, when they run on this machine (``local``
    and ``local-cluster`` masters of a classic session): the ``PYSPARK_PYTHON`` the SparkContext read when it
    started (``python3``, found on ``PATH``, when unset; spark-submit sets it from ``spark.pyspark.python``).
    None on a cluster, whose executors' Python is not the driver's to check, and on Spark Connect, whose
    server starts them."""
    sc = spark_context(spark)
    if sc is None:
        return None
    master = _master(spark)
    if not (_LOCAL.match(master) or _LOCAL_CLUSTER.match(master)):
        return None
    return str(getattr(sc, "pythonExec", None) or "python3")


def worker_python_problem(python: str) -> str | None:
    """What keeps the interpreter ``python`` (a path, or a command found on ``PATH``) from running the
    exchange's tasks: missing, cannot import pyarrow or this package, or another Python version than this
    driver's (PySpark refuses such a worker); None if nothing does. This interpreter needs no asking; another
    is asked once per process, in a subprocess that imports what a task imports, with this process's
    environment (a local worker's, but for PySpark's own path)."""
    path = shutil.which(python)
    if path is None:
        return "is not an executable file nor a command on PATH"
    path = os.path.abspath(path)
    if sys.executable and path == os.path.abspath(sys.executable):
        return None
    if path not in _PYTHON_PROBES:
        _PYTHON_PROBES[path] = _probe(path)
    return _PYTHON_PROBES[path]


def _probe(path: str) -> str | None:
    try:
        done = subprocess.run(
            [path, "-c", _PROBE], capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        _log.info("%s did not answer within %.0f s; not checking the workers' Python", path, _PROBE_TIMEOUT_S)
        return None
    except OSError as exc:
        return f"cannot be started ({exc})"
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit code {done.returncode}"
        missing = "pyarrow" if "pyarrow" in last else "spark_credit_shuffle" if "spark_credit_shuffle" in last else None
        return (
            f"cannot import {missing} ({last})"
            if missing
            else f"cannot import pyarrow and spark_credit_shuffle ({last})"
        )
    version = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if version != mine:
        return f"runs Python {version}, and PySpark refuses workers of another version than the driver's ({mine})"
    return None


def check_worker_python(spark: Any) -> None:
    """Raise :class:`WorkerPythonError` if the Python workers ``spark`` starts on this machine could not run
    an exchange's tasks, before any job: without it, running a script with a virtual environment's Python
    (not activated) starts the workers with the ``python3`` on ``PATH``, and the user meets, tens of seconds
    later, one worker traceback per task attempt. Local masters only (see :func:`worker_python`); each
    interpreter is asked once per process (:func:`worker_python_problem`)."""
    python = worker_python(spark)
    if python is None:
        return
    problem = worker_python_problem(python)
    if problem is None:
        return
    if os.environ.get("PYSPARK_PYTHON") == python:
        chosen_by = "PYSPARK_PYTHON"
    elif python == "python3":
        chosen_by = "the python3 on PATH: PYSPARK_PYTHON is not set"
    else:
        chosen_by = "the PYSPARK_PYTHON the session started with"
    executable = sys.executable or "python3"
    fix = (
        f"export PYSPARK_PYTHON={executable} (or os.environ['PYSPARK_PYTHON'] = sys.executable before "
        "SparkSession.builder...getOrCreate(); spark-submit: --conf spark.pyspark.python=...), then start the "
        "session again: a running session keeps the Python it started with"
    )
    found = shutil.which(python)
    raise WorkerPythonError(python, os.path.abspath(found) if found else None, problem, chosen_by, fix)
