"""Before any job, a local session whose Python workers would start an interpreter that cannot run the
exchange's tasks (the ``python3`` on PATH while the script runs with a virtual environment's Python) is refused
with a :class:`WorkerPythonError` naming ``PYSPARK_PYTHON`` and the fix; each interpreter is asked once.

The interpreters are real: this one, and a bare virtual environment made here, which has no pyarrow."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import functions as F

import spark_credit_shuffle as scs
from spark_credit_shuffle.errors import ConfigError, WorkerPythonError
from spark_credit_shuffle.runtime.worker_python import (
    _PYTHON_PROBES,
    check_worker_python,
    worker_python,
    worker_python_problem,
)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """The interpreter of a new virtual environment without pip or any package: it cannot import pyarrow."""
    home = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True, timeout=120)
    python = home / "bin" / "python"
    assert python.exists()
    return str(python)


@contextlib.contextmanager
def workers_start(spark, python: str) -> Iterator[None]:
    """The session's Python functions made in the block start ``python`` (what ``PYSPARK_PYTHON`` names when a
    SparkContext starts: PySpark keeps it as ``pythonExec``), then what they started before."""
    sc = spark.sparkContext
    before = sc.pythonExec
    sc.pythonExec = python
    try:
        yield
    finally:
        sc.pythonExec = before


def test_this_interpreter_is_not_asked():
    # given this interpreter, the check answers without a subprocess: nothing is probed, nothing cached
    assert worker_python_problem(sys.executable) is None
    assert os.path.abspath(sys.executable) not in _PYTHON_PROBES


def test_another_interpreter_that_imports_the_package_passes():
    # the virtual environment's python3 is another file name for this interpreter's environment: asked, fine
    other = Path(sys.executable).with_name("python3")
    if not other.exists() or os.path.abspath(other) == os.path.abspath(sys.executable):
        pytest.skip("no other name for this interpreter")
    assert worker_python_problem(str(other)) is None


def test_an_interpreter_without_pyarrow_is_found_out_once(bare_python):
    problem = worker_python_problem(bare_python)
    assert problem is not None and problem.startswith("cannot import pyarrow"), problem
    # asked once per process: the answer is kept, and the second call returns it without asking again
    path = os.path.abspath(bare_python)
    assert _PYTHON_PROBES[path] == problem
    _PYTHON_PROBES[path] = "the kept answer"
    try:
        assert worker_python_problem(bare_python) == "the kept answer"
    finally:
        _PYTHON_PROBES[path] = problem


def test_a_missing_interpreter_is_named():
    assert worker_python_problem("no-such-python-3.99") == "is not an executable file nor a command on PATH"


def test_the_test_session_starts_this_interpreter_and_passes(spark):
    # the tests' local session starts its workers with PYSPARK_PYTHON = this interpreter
    assert worker_python(spark) == sys.executable
    check_worker_python(spark)


def test_a_local_session_whose_workers_lack_pyarrow_is_refused_before_any_job(spark, bare_python):
    df = spark.range(0, 100, 1, 2).select(F.col("id"), (F.col("id") % 7).alias("k"))
    sc = spark.sparkContext
    group = "worker-python-check"
    sc.setJobGroup(group, "no job may start")
    try:
        with workers_start(spark, bare_python), pytest.raises(WorkerPythonError) as info:
            scs.exchange(df, scs.key_by("k"), parallelism=2, mode="blocking")
        jobs = list(sc.statusTracker().getJobIdsForGroup(group))
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
    assert jobs == []
    error = info.value
    assert isinstance(error, ConfigError) and error.setting == "PYSPARK_PYTHON" and error.value == bare_python
    message = str(error)
    assert message.startswith(f"Spark's Python workers would start {bare_python} (the PYSPARK_PYTHON")
    assert "cannot import pyarrow" in message
    assert f"export PYSPARK_PYTHON={sys.executable}" in message and "spark.pyspark.python" in message
    # with_channel runs a Python function on the workers too: refused alike
    with workers_start(spark, bare_python), pytest.raises(WorkerPythonError):
        scs.with_channel(df, scs.key_by("k"), 2)


def test_the_python3_on_path_when_nothing_is_set_is_named_so(spark, bare_python, monkeypatch):
    # given PYSPARK_PYTHON unset (workers start "python3") and a PATH whose python3 is the bare interpreter
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.setenv("PATH", str(Path(bare_python).parent) + os.pathsep + os.environ["PATH"])
    with workers_start(spark, "python3"), pytest.raises(WorkerPythonError) as info:
        check_worker_python(spark)
    assert info.value.python == str(Path(bare_python).with_name("python3"))
    assert "(the python3 on PATH: PYSPARK_PYTHON is not set)" in str(info.value)
