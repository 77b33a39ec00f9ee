"""``install_error_hook``: an uncaught Spark exception that carries an exchange task's typed error is reported
with that error first (in a script and in IPython), and every other exception as before."""

from __future__ import annotations

import sys
import textwrap

import pytest
from spark_helpers import TEST_JVM_OPTIONS, WORKER_DAEMON, background_job, job_report

import spark_credit_shuffle as scs
from spark_credit_shuffle.errors import CreditShuffleError

#: A null key in a pipelined exchange whose output is not retryable: ``count()`` fails with Spark's
#: ``Py4JJavaError``, first caught by an IPython shell's cell, then uncaught in the script itself.
SCRIPT = textwrap.dedent(
    f"""
    import os, sys
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from IPython.core.interactiveshell import InteractiveShell
    from pyspark.sql import SparkSession, functions as F
    import spark_credit_shuffle as scs

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", {TEST_JVM_OPTIONS!r})
        .config("spark.python.daemon.module", {WORKER_DAEMON!r})
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("OFF")
    shell = InteractiveShell.instance()
    scs.install_error_hook()
    df = spark.range(0, 100, 1, 2).select("id", F.when(F.col("id") == 50, None).otherwise(F.col("id") % 7).alias("k"))
    ex = scs.exchange(df, scs.key_by("k"), parallelism=2, mode="pipelined", retryable=False)
    shell.user_ns["ex"] = ex
    print("--- ipython ---", file=sys.stderr, flush=True)
    print("--- ipython ---", flush=True)
    shell.run_cell("ex.df.count()")
    print("--- script ---", file=sys.stderr, flush=True)
    ex.df.count()
    """
)

#: The script run as an application beside the tests (``spark_helpers.background_job``: it starts with the run
#: instead of holding a test process while its JVM starts), reporting its exit code and output.
_JOB = background_job(
    __file__,
    "error-hook",
    textwrap.dedent(
        f"""
        import json, subprocess, sys
        from pathlib import Path

        Path("null_key.py").write_text({SCRIPT!r})
        done = subprocess.run([sys.executable, "null_key.py"], capture_output=True, text=True, timeout=180)
        print(json.dumps({{"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}}))
        """
    ),
)


def _after(text: str, marker: str) -> list[str]:
    """The lines of ``text`` after the line ``marker``, up to the next marker."""
    lines = text.splitlines()
    rest = lines[lines.index(marker) + 1 :]
    return rest[: next((i for i, line in enumerate(rest) if line.startswith("--- ")), None)]


@pytest.mark.spark  # it asserts on a Spark application of its own: not in the quick loop
@pytest.mark.timeout(360)
def test_an_uncaught_spark_error_is_reported_with_the_typed_error_first(pytestconfig):
    report = job_report(pytestconfig, _JOB, 240)
    assert report["returncode"] == 1, report["stderr"][-3000:]
    stdout, stderr = report["stdout"], report["stderr"]
    typed = "spark_credit_shuffle.errors.NullKeyError: producer subtask "
    # in a script: the first thing after the action is the typed error, then Spark's traceback, then it again
    script_report = [line for line in _after(stderr, "--- script ---") if line.strip()]
    # (log lines of Spark or of the tasks may come before it: the report is what the hook prints)
    first_typed = next(i for i, line in enumerate(script_report) if line.startswith(typed))
    assert all(not line.startswith(("Traceback", "py4j.")) for line in script_report[:first_typed]), script_report[:8]
    assert "Spark's Py4JJavaError follows" in script_report[first_typed + 1]
    assert script_report[first_typed + 2] == "Traceback (most recent call last):"
    assert any(line.startswith("py4j.protocol.Py4JJavaError") for line in script_report)
    assert script_report[-1].startswith(typed)
    # in IPython: the same line first on stderr, IPython's own traceback (on stdout) after it
    ipython_report = [line for line in _after(stderr, "--- ipython ---") if line.strip()]
    first_typed = next(i for i, line in enumerate(ipython_report) if line.startswith(typed))
    assert all(not line.startswith(("Traceback", "py4j.")) for line in ipython_report[:first_typed]), ipython_report[:8]
    assert ipython_report[-1].startswith(typed), ipython_report[-5:]
    assert "Py4JJavaError" in "\n".join(_after(stdout, "--- ipython ---"))


def test_other_exceptions_are_reported_as_before_and_the_hook_comes_off():
    before = sys.excepthook
    scs.install_error_hook()
    try:
        hook = sys.excepthook
        assert hook is not before
        scs.install_error_hook()  # again: nothing changes
        assert sys.excepthook is hook
        from spark_credit_shuffle.errors import _typed_line

        assert _typed_line(ValueError("nothing of the exchange")) is None
        assert _typed_line(CreditShuffleError("its own traceback names it")) is None
    finally:
        scs.uninstall_error_hook()
    assert sys.excepthook is before
