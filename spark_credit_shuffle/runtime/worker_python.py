"""The Python interpreter a local session's workers start, checked on the driver before any job: one that cannot
import pyarrow and this package fails every task, tens of seconds later, with one worker traceback per attempt."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from typing import Any

from .._pyspark import spark_context
from ..errors import WorkerPythonError
from .executors import on_this_machine

__all__ = ["check_worker_python", "worker_python", "worker_python_problem"]

_log = logging.getLogger(__name__)

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
    if not on_this_machine(spark):
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
