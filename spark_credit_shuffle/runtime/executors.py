"""The session's executors and task slots, read on the driver once per exchange: for the planner (network memory
per executor) and the pipelined runtime (a task slot for every task of a barrier stage)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable
from typing import Any

from .._pyspark import spark_context

__all__ = [
    "available_slots",
    "configured_executors",
    "dynamic_allocation",
    "executor_slots",
    "master",
    "on_this_machine",
    "registered_executors",
    "wait_for_executors",
]

_LOCAL = re.compile(r"^local(?:\[(\*|\d+)(?:\s*,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*(?:,[^\]]*)?\]$")


def on_this_machine(spark: Any) -> bool:
    """True for ``local`` and ``local-cluster`` masters: the executors (and their Python workers) run here."""
    m = master(spark)
    return bool(_LOCAL.match(m) or _LOCAL_CLUSTER.match(m))


def dynamic_allocation(spark: Any) -> bool:
    """True if the session runs with dynamic allocation, under which Spark runs no barrier stage
    (``BarrierJobRunWithDynamicAllocationException``); Spark ignores the setting in local mode."""
    enabled = str(spark.conf.get("spark.dynamicAllocation.enabled", "false") or "false").strip().lower()
    return enabled == "true" and _LOCAL.match(master(spark)) is None


def master(spark: Any) -> str:
    """The session's master URL (``local[*]`` when unset)."""
    return (spark.conf.get("spark.master", "local[*]") or "local[*]").strip()


def executor_slots(spark: Any) -> int:
    """Tasks one executor runs at once: its cores / ``spark.task.cpus``. The cores: N for ``local[N]``
    (the machine's for ``local[*]``, 1 for ``local``), C for ``local-cluster[E, C, M]``, otherwise
    ``spark.executor.cores`` (1 if unset)."""
    conf = spark.conf
    name = master(spark)
    task_cpus = int(conf.get("spark.task.cpus", "1") or 1)
    cluster = _LOCAL_CLUSTER.match(name)
    local = _LOCAL.match(name)
    if cluster:
        cores = int(cluster.group(2))
    elif local:
        n = local.group(1)
        cores = 1 if name == "local" else (os.cpu_count() or 1) if n == "*" else int(n)
    else:
        cores = int(conf.get("spark.executor.cores", "1") or 1)
    return max(1, cores // task_cpus)


def configured_executors(spark: Any) -> int | None:
    """Executors the session is configured with: 1 in local mode, E for ``local-cluster[E, C, M]``,
    otherwise ``spark.executor.instances``; None when that is unset (dynamic allocation)."""
    name = master(spark)
    cluster = _LOCAL_CLUSTER.match(name)
    if cluster:
        return int(cluster.group(1))
    if _LOCAL.match(name):
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
    name = master(spark)
    executors = 0
    if not (_LOCAL.match(name) or _LOCAL_CLUSTER.match(name)):
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
    if _LOCAL.match(master(spark)):
        return None
    sc = spark_context(spark)
    if sc is None:
        return None
    try:
        return max(0, int(sc._jsc.sc().getExecutorMemoryStatus().size()) - 1)
    except Exception:
        return None
