"""A PySpark worker daemon that starts workers faster where PySpark is installed with pip.

Spark starts its Python workers with ``PYTHONPATH`` led by ``$SPARK_HOME/python/lib/pyspark.zip``, the py4j
zip and the ``spark-core`` jar. With a pip-installed PySpark those files sit inside the installed ``pyspark``
package, which holds the same modules with their compiled bytecode; Python cannot cache bytecode inside a zip,
so every new worker compiles the PySpark modules it imports from source, and every import it makes first
searches the zips and the jar. This daemon drops those files from the path when the installed package they
belong to is importable instead, imports ``pyspark.worker`` once, then runs PySpark's own daemon, whose forked
workers inherit both. On a cluster whose PySpark comes only from ``$SPARK_HOME`` nothing changes.

After each task a reused PySpark worker runs a full garbage collection, which walks every object the
worker holds: with pandas, pyarrow and this package imported, some 80,000 objects and about 40 ms of CPU per task,
more than many small tasks cost themselves. This daemon's workers collect the same garbage, what the task left
in reference cycles, without walking the rest again: each collection ends by freezing the objects that
survived it (``gc.freeze``, which moves them out of the collector's generations), and every
``FULL_COLLECTION_EVERY``-th task's collection unfreezes them first, so that cycles among objects that were
alive at an earlier task's end are also reclaimed, a bounded number of tasks later.

PySpark imports the worker module only after the fork, because a module that starts threads when imported
(pandas, pyarrow) makes the fork unsafe. ``pyspark.worker`` starts none; should a PySpark version import one
that does, this daemon replaces itself with PySpark's own before it forks any worker.

Use: ``spark.python.daemon.module=spark_credit_shuffle.worker.daemon`` when the session starts (docs/configuration.md,
"Faster Python workers"). Starting it imports the package's ``__init__`` and this subpackage only: the package
imports its parts on first use, so nothing that starts a thread is imported before the fork.
"""

from __future__ import annotations

import gc
import os
import sys
from importlib.machinery import PathFinder
from typing import Any

__all__ = ["FULL_COLLECTION_EVERY", "TaskEndCollector", "spark_path_duplicates"]

#: Every this many tasks a worker's collection walks all of its objects again, as PySpark's own does each time.
FULL_COLLECTION_EVERY = 64


def spark_path_duplicates(path: list[str]) -> list[str]:
    """The entries of ``path`` that are files inside an installed ``pyspark`` package found on the rest of
    ``path`` (a pip install's ``pyspark.zip``, py4j zip and jars): the same modules, without bytecode."""
    files = [p for p in path if os.path.isfile(p)]
    spec = PathFinder.find_spec("pyspark", [p for p in path if p not in files])
    if spec is None or spec.origin is None or not os.path.isfile(spec.origin):
        return []  # none, or only a namespace of that name (a directory without the package)
    home = os.path.dirname(os.path.realpath(spec.origin)) + os.sep
    return [p for p in files if os.path.realpath(p).startswith(home)]


class TaskEndCollector:
    """Stands for the ``gc`` module in PySpark's daemon, which calls ``gc.collect()`` after every task of a
    reused worker: the collection walks only what is not frozen, then freezes the survivors (see the module's
    docstring). Everything else is the ``gc`` module's."""

    def __init__(self, full_every: int = FULL_COLLECTION_EVERY) -> None:
        self.full_every = full_every
        self.collections = 0

    def collect(self, generation: int = 2) -> int:
        self.collections += 1
        if self.collections % self.full_every == 0:
            gc.unfreeze()
        found = gc.collect(generation)
        gc.freeze()
        return found

    def __getattr__(self, name: str) -> Any:
        return getattr(gc, name)


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: count what Python knows of
        import threading

        return threading.active_count()


def main() -> None:
    for entry in spark_path_duplicates(sys.path):
        sys.path.remove(entry)
    import pyspark.worker  # noqa: F401  (imported once, before the fork)

    if _threads() > 1:  # a worker module that starts threads: fork from PySpark's own daemon instead
        os.execv(sys.executable, [sys.executable, "-m", "pyspark.daemon", *sys.argv[1:]])
    from pyspark import daemon

    gc.collect()
    gc.freeze()  # what the daemon imported is shared by its workers and never walked by their collections
    daemon.gc = TaskEndCollector()  # type: ignore[assignment]
    daemon.manager()


if __name__ == "__main__":
    main()
