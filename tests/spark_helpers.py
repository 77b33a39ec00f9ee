"""Helpers for tests on the local SparkSession."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator

#: The JVM options of every Spark JVM the tests start: short-lived JVMs spend less CPU compiling with the
#: client compiler alone.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
#: The tests' Python worker daemon: workers import the installed PySpark's bytecode, not its zip's source.
WORKER_DAEMON = "spark_credit_shuffle_daemon"


@contextlib.contextmanager
def no_spark_jobs(spark) -> Iterator[None]:
    """Assert that the block starts no Spark job (from this thread): its jobs run in a job group of their
    own, which the status tracker must report empty at the end."""
    sc = spark.sparkContext
    group = f"no-jobs-{uuid.uuid4()}"
    sc.setJobGroup(group, "checks before launch")
    try:
        yield
    finally:
        jobs = list(sc.statusTracker().getJobIdsForGroup(group))
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
    assert jobs == [], f"Spark jobs {jobs} were started"


@contextlib.contextmanager
def job_group(spark) -> Iterator[list[int]]:
    """Run the block's Spark jobs in a job group of their own; the list it gives holds, after the block, the
    highest attempt number of every stage those jobs ran (0 for a stage that ran once)."""
    sc = spark.sparkContext
    group = f"group-{uuid.uuid4()}"
    sc.setJobGroup(group, "counted")
    attempts: list[int] = []
    try:
        yield attempts
    finally:
        tracker = sc.statusTracker()
        for job in tracker.getJobIdsForGroup(group):
            info = tracker.getJobInfo(job)
            for stage in info.stageIds if info is not None else []:
                stage_info = tracker.getStageInfo(stage)
                if stage_info is not None:
                    attempts.append(stage_info.currentAttemptId)
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)


@contextlib.contextmanager
def session_conf(spark, key: str, value: str) -> Iterator[None]:
    """Set ``key`` in the shared session's conf for the block, then put back what was there.

    A Spark core setting (``spark.network.crypto.enabled``) is refused by ``spark.conf.set`` unless
    ``spark.sql.legacy.setCommandRejectsSparkCoreConfs`` is false, which the block also sets for its
    duration: the session's conf then says what a cluster started with it would say, which is what the
    package reads (Spark's own connections, set up at start, do not change).
    """
    legacy = "spark.sql.legacy.setCommandRejectsSparkCoreConfs"
    before = {k: spark.conf.get(k, None) for k in (legacy, key)}
    spark.conf.set(legacy, "false")
    spark.conf.set(key, value)
    try:
        yield
    finally:
        for k in (key, legacy):
            if before[k] is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, before[k])


def run_job_script(tmp_path, text: str, timeout_s: float) -> dict:
    """Run ``text`` as a Python script of its own (a Spark application with a session of its own, e.g. on
    ``local-cluster``), classic Spark, with this interpreter as the workers' Python; its last stdout line is a
    JSON object, returned. A non-zero exit fails the test with the end of its stderr."""
    script = tmp_path / "job.py"
    script.write_text(text)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout_s, check=False, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_job_once(tmp_path_factory, name: str, text: str, timeout_s: float) -> dict:
    """:func:`run_job_script` once per test run, whichever test process asks first: the others wait for its
    report (a lock and the report in the run's shared temporary directory). For an application several tests
    assert on, when those tests may run in different test processes (pytest-xdist)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's directory, above each test process's own
    report = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        deadline = time.monotonic() + timeout_s + 30  # the holder's run is bounded by timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another test process held the lock of application {name!r} for over {timeout_s + 30:.0f} s"
                    ) from None
                time.sleep(0.2)
        if not report.exists():
            work = shared / name
            work.mkdir(exist_ok=True)
            report.write_text(json.dumps(run_job_script(work, text, timeout_s)))
    return json.loads(report.read_text())


def cluster_job(master: str, conf: dict[str, str], body: str) -> str:
    """The text of a Spark application of its own for :func:`run_job_script`: a classic session on ``master``
    (e.g. ``local-cluster[2,2,1024]``, executors of 512 MiB, no UI, the tests' JVM and daemon settings) with
    ``conf``, then ``body``, which has ``spark``, ``F`` and ``scs`` at hand and leaves its report in the dict
    ``out``; the application then stops and prints ``out`` as its last line."""
    settings = {
        "spark.ui.enabled": "false",
        "spark.executor.memory": "512m",
        "spark.python.daemon.module": WORKER_DAEMON,
        "spark.driver.extraJavaOptions": TEST_JVM_OPTIONS,
        "spark.executor.extraJavaOptions": TEST_JVM_OPTIONS,
        **conf,
    }
    builder = "".join(f"\n    .config({k!r}, {v!r})" for k, v in settings.items())
    prologue = (
        "import json, os, sys, time\n"
        'os.environ["PYSPARK_PYTHON"] = sys.executable\n'
        'os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"\n'
        "from pyspark.sql import SparkSession, functions as F\n"
        "import spark_credit_shuffle as scs\n\n"
        f"spark = (\n    SparkSession.builder.master({master!r}){builder}\n    .getOrCreate()\n)\n"
    )
    return prologue + textwrap.dedent(body) + "\nspark.stop()\nprint(json.dumps(out))\n"
