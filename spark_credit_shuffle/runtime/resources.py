"""What a task's process uses: resident memory and a thread's CPU seconds (its gauges); and the heap the
garbage collector walks (:func:`freeze_worker_heap`)."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from types import ModuleType

__all__ = ["available_cores", "freeze_worker_heap", "rss_bytes", "thread_cpu_seconds"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system tells it, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rss_bytes() -> int:
    """Resident memory of this process in bytes (0 if it cannot be read)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        try:
            import resource

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        except Exception:
            return 0


def thread_cpu_seconds(thread: threading.Thread | None) -> float | None:
    """CPU seconds a running thread used (Linux), or None."""
    if thread is None or thread.ident is None or not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError):
        return None


def freeze_worker_heap(enabled: bool = True, daemon: ModuleType | None = None) -> bool:
    """Make the collection PySpark's daemon runs after each task of a reused Python worker walk only what that task
    left, as the workers of :mod:`spark_credit_shuffle.worker.daemon` do (docs/configuration.md, "Faster Python
    workers"): each collection freezes the objects that survive it (``gc.freeze``), every 64th walks everything
    again, so a reference cycle is reclaimed at most 64 tasks later. True if this call set it up; False where it is
    set up already (that daemon, or an earlier task of this worker) or the worker was not forked by PySpark's
    daemon.

    A worker holds pyspark, pyarrow and pandas, some hundred thousand objects, and PySpark's collection after each
    task walks all of them: half the Python workers' CPU of an identity ``mapInArrow`` of 4 M rows on
    ``local[4]``, a fifth of a blocking exchange's (docs/benchmarks.md, "Garbage collection in the Python
    workers"). The worker's later tasks, of any kind, keep the saving. ``daemon``: the module whose loop runs
    the worker, by default this process's ``__main__`` (PySpark's daemon runs as ``python -m pyspark.daemon``).
    ``enabled``: the exchange's ``freeze_worker_heap`` setting (False: nothing happens)."""
    if not enabled:
        return False
    module = daemon if daemon is not None else sys.modules.get("__main__")
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "name", None) != "pyspark.daemon" or getattr(module, "gc", None) is not gc:
        return False
    from ..worker.daemon import TaskEndCollector

    module.gc = TaskEndCollector()  # type: ignore[attr-defined]
    return True
