"""Helpers for tests on the local SparkSession."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chispa import assert_basic_rows_equality
from chispa.row_comparer import are_rows_equal_enhanced
from chispa.rows_comparer import assert_generic_rows_equality
from chispa.schema_comparer import assert_schema_equality

#: The JVM options of every Spark JVM the tests start: short-lived JVMs spend less CPU compiling with the
#: client compiler alone. JVM warnings go to stderr, where Spark's log goes, not into a job's output.
TEST_JVM_OPTIONS_WITHOUT_ARCHIVE = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xlog:disable -Xlog:all=warning:stderr"
#: Spark's classes as a class-data-sharing archive, written by ``make test`` for this virtual environment
#: (``tests/jvm_class_archive.py``): where it exists, every Spark JVM of the tests maps it instead of loading
#: and verifying those classes again.
JVM_CLASS_ARCHIVE = Path(sys.prefix) / "spark-classes.jsa"
TEST_JVM_OPTIONS = TEST_JVM_OPTIONS_WITHOUT_ARCHIVE + (
    f" -XX:SharedArchiveFile={JVM_CLASS_ARCHIVE}" if JVM_CLASS_ARCHIVE.is_file() else ""
)
#: The tests' Python worker daemon: workers import the installed PySpark's bytecode, not its zip's source.
WORKER_DAEMON = "spark_credit_shuffle.worker.daemon"


def _row_order_key(row: Any) -> tuple[tuple[bool, str], ...]:
    """A total order of rows of any column types (nulls last): the canonical order of a multiset of rows."""
    return tuple((value is None, repr(value)) for value in row)


def assert_same_rows(
    actual: Any, expected: Any, *, ignore_nullable: bool = False, allow_nan_equality: bool = False
) -> None:
    """chispa's ``assert_df_equality(actual, expected, ignore_row_order=True, ...)``: the same schema and the
    same multiset of rows, compared and reported by chispa. The rows are put in one order in this process
    instead of by a sort in Spark, so each side runs once: chispa's sort runs each DataFrame a second time for
    the sort's range bounds, and for an exchange that is a second exchange."""
    assert_schema_equality(actual.schema, expected.schema, ignore_nullable=ignore_nullable)
    got = sorted(actual.collect(), key=_row_order_key)
    want = sorted(expected.collect(), key=_row_order_key)
    if allow_nan_equality:
        assert_generic_rows_equality(got, want, are_rows_equal_enhanced, {"allow_nan_equality": True})
    else:
        assert_basic_rows_equality(got, want)


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


#: The applications of their own that test modules declare (:func:`background_job`), by the module's file.
BACKGROUND_JOBS: dict[str, list[tuple[str, str]]] = {}
#: The shells this process started: held so that none is reaped (and warned of as still running) before its end.
_started: list[subprocess.Popen] = []
#: No background application runs longer than this, whether or not a test waits for it.
BACKGROUND_JOB_LIMIT_S = 900


def background_job(module_file: str, name: str, text: str) -> str:
    """Declare that the tests of ``module_file`` assert on what the application ``text`` reports: a Python
    script of its own (a Spark application with a session of its own, e.g. on ``local-cluster``, classic
    Spark, with this interpreter as the workers' Python) whose last stdout line is a JSON object. Once the
    tests are collected, the first test process of the run that has one of them starts it
    (:func:`start_background_jobs`), so that it runs beside the tests instead of holding a test process
    while its JVMs start and its slow consumers sleep; :func:`job_report` waits for its report. Returns
    ``name``."""
    BACKGROUND_JOBS.setdefault(os.path.realpath(module_file), []).append((name, text))
    return name


def _run_directory(config) -> Path:
    """The directory every test process of this run shares (each xdist worker's base is inside it)."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def start_background_jobs(config, items) -> None:
    """Start the declared applications that the collected spark tests of ``items`` need, each once per run
    whichever test process gets here first. Each runs as a process of its own, under a shell that writes its
    exit code when it ends; its output goes to files of the run's directory."""
    if config.option.collectonly:
        return
    # an application is a JVM of its own: only a spark test (never one of the quick loop) asserts on one
    modules = {os.path.realpath(str(item.path)) for item in items if item.get_closest_marker("spark")}
    for module in sorted(modules & BACKGROUND_JOBS.keys()):
        for name, text in BACKGROUND_JOBS[module]:
            work = _run_directory(config) / f"job-{name}"
            try:
                work.mkdir(parents=True)  # whoever makes the directory starts the application
            except FileExistsError:
                continue
            (work / "job.py").write_text(text)
            env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
            env.pop("SPARK_CONNECT_MODE_ENABLED", None)
            # the shell writes the application's process id, then its exit code once it has ended; a watchdog
            # kills it after BACKGROUND_JOB_LIMIT_S, should the run end without anyone waiting for it
            shell = (
                '"$0" job.py > stdout 2> stderr & job=$!; echo $job > pid; '
                f"(trap 'kill $nap; exit' TERM; sleep {BACKGROUND_JOB_LIMIT_S} & nap=$!; wait $nap; kill -9 $job) "
                "2> /dev/null & dog=$!; "
                "wait $job; echo $? > exit.tmp; mv exit.tmp exit; kill $dog 2> /dev/null"
            )
            _started.append(
                subprocess.Popen(
                    ["sh", "-c", shell, sys.executable], cwd=work, env=env, start_new_session=True, close_fds=True
                )
            )


def job_report(config, name: str, timeout_s: float) -> dict:
    """The report of the background application ``name`` (its last stdout line, a JSON object), once it has
    ended; fails with the end of its stderr if it exited with an error. One that has not ended ``timeout_s``
    after this call (its run began earlier, with the tests) is stopped, with its process group."""
    work = _run_directory(config) / f"job-{name}"
    if not work.exists():
        raise RuntimeError(f"application {name!r} was not started: no collected test module declares it")
    deadline = time.monotonic() + timeout_s
    while not (work / "exit").exists():
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError, ValueError):  # the group of its shell: the shell, it and its JVMs
                os.killpg(os.getpgid(int((work / "pid").read_text())), signal.SIGKILL)
            raise TimeoutError(f"application {name!r} did not end within {timeout_s:.0f} s: {_tail(work / 'stderr')}")
        time.sleep(0.2)
    code = (work / "exit").read_text().strip()
    assert code == "0", f"application {name!r} exited with {code}: {_tail(work / 'stderr')}"
    return json.loads((work / "stdout").read_text().strip().splitlines()[-1])


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def cluster_job(master: str, conf: dict[str, str], body: str) -> str:
    """The text of a Spark application of its own for :func:`background_job`: a classic session on ``master``
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
