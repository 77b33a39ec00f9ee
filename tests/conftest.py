"""One local SparkSession for the whole test run (per test process), which also serves Spark Connect, and one
Connect session on it; each started only when a test asks for it.

The classic session's driver runs Spark's ``SparkConnectPlugin``: the Connect service listens on a free port of
127.0.0.1 in the same JVM, so the Connect tests run on the same task slots, Python workers and settings as the
classic ones, without a second JVM to start and warm up. PySpark decides whether ``pyspark.sql.functions``
build Connect or classic columns by one process-wide switch (the ``SPARK_CONNECT_MODE_ENABLED`` variable), so a
Connect test turns it on for its own duration only: ``connect_spark`` (the one Connect session) and
``any_spark`` (a test run once per kind of session) do that.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest
from spark_helpers import TEST_JVM_OPTIONS, WORKER_DAEMON, start_background_jobs

CONNECT_MODE = "SPARK_CONNECT_MODE_ENABLED"
#: The test session's master (local[4, 2]: 4 slots, a failed task retried once) and settings.
MASTER = "local[4, 2]"
SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.adaptive.enabled": "false",
    "spark.driver.extraJavaOptions": TEST_JVM_OPTIONS,
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "3",
    "spark.python.worker.reuse": "true",
    "spark.python.daemon.module": WORKER_DAEMON,
    # Spark's sockets to its Python workers as Unix domain sockets, whose kernel buffers stay small: over TCP on
    # 127.0.0.1 the kernel grows them with use (up to net.ipv4.tcp_rmem's maximum, 32 MiB on the test machine),
    # so what Spark holds between two Python steps varies from run to run
    # (docs/diagnosis.md, "The kernel's socket buffers")
    "spark.python.unix.domain.socket.enabled": "true",
    # PySpark's DataFrame debugging (the Python call site of each column function, kept for error messages'
    # query context) costs some 4 py4j round trips per column function; no test reads that context. Without it
    # a small exchange and its check took 5-18% less time and a third less of the driver's CPU.
    "spark.python.sql.dataFrameDebugging.enabled": "false",
}
CONNECT_START_TIMEOUT_S = 180


def session_settings(connect_port: int) -> dict[str, str]:
    """The test session's settings: ``SPARK_CONF``, and its driver serving Spark Connect on ``connect_port`` of
    127.0.0.1 (see ``connect_server``; 0 for any free port)."""
    return {
        **SPARK_CONF,
        "spark.plugins": "org.apache.spark.sql.connect.SparkConnectPlugin",
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(connect_port),
    }


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """While the test modules are collected, pytest keeps the bytecode of the ones it rewrote (for assertions)
    even where ``PYTHONDONTWRITEBYTECODE`` is set: each test process rewrote all of them on every run otherwise
    (some 2.5 s of CPU), and pytest checks a kept file against its module's source before it uses it. Only here:
    the tests and the processes they start run as the environment says."""
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = before


def pytest_collection_finish(session):
    """The applications of their own that the collected tests assert on start now, beside the tests
    (``spark_helpers.background_job``)."""
    start_background_jobs(session.config, session.items)


@pytest.fixture(scope="session")
def spark():
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["SPARK_TESTING"] = "1"
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(MASTER).appName("spark_credit_shuffle tests")
    for key, value in session_settings(_free_port()).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def connect_server(spark):
    """``sc://127.0.0.1:<port>``: the Spark Connect service of the classic session's driver."""
    port = int(spark.sparkContext.getConf().get("spark.connect.grpc.binding.port"))
    deadline = time.monotonic() + CONNECT_START_TIMEOUT_S
    while not _accepts(port):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the Spark Connect service of the tests' session did not accept connections on "
                f"127.0.0.1:{port} within {CONNECT_START_TIMEOUT_S} s"
            )
        time.sleep(0.1)
    return f"sc://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def _connect_session(connect_server):
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    session = ConnectSession.builder.remote(connect_server).create()
    yield session
    os.environ[CONNECT_MODE] = "1"  # stopping also reads the switch
    try:
        session.stop()
    finally:
        os.environ.pop(CONNECT_MODE, None)


@pytest.fixture
def connect_spark(_connect_session, monkeypatch):
    """The test run's Spark Connect session (one for the run, on the local server), in Connect mode for this test."""
    monkeypatch.setenv(CONNECT_MODE, "1")
    return _connect_session


@pytest.fixture(params=["classic", "connect"])
def any_spark(request):
    """The test runs twice: on the classic session, then on the Spark Connect session."""
    return request.getfixturevalue("spark" if request.param == "classic" else "connect_spark")


#: Fixtures that start or use a JVM: a test that asks for one (directly or through another fixture) is a
#: ``spark`` test, left out of the quick loop (``make test-fast``).
JVM_FIXTURES = {"spark", "connect_spark", "any_spark", "connect_server", "_connect_session", "java_hash"}


#: The longest modules, longest first, collected before the rest: ``make test`` (``--dist loadscope``) hands
#: modules out in collection order, so the last ones to start are short and the test processes end close
#: together. A whole-suite run on two cores busy with other work as well took 153, 164, 90, 87, 52, 45, 31, 25,
#: 22, 21 and 19 s in them (the first module of each process also pays for its session's first jobs);
#: test_backpressure_origin.py about 33 s since its slow step after ``ex.df`` (15 s of sleep) came back.
STARTED_FIRST = (
    "test_notebooks.py",
    "test_exchange.py",
    "test_queries.py",
    "test_jobs.py",
    "test_retries.py",
    "test_checks.py",
    "test_backpressure_origin.py",
    "test_web.py",
    "test_pipelined.py",
    "test_wheel.py",
    "test_types.py",
    "test_diagnosis.py",
)
#: Modules whose tests wait for the report of an application that starts with the run
#: (``spark_helpers.background_job``): collected last, when the application has long ended.
STARTED_LAST = ("test_local_cluster.py", "test_error_hook.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if JVM_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.spark)
    rank = {**{name: i - len(STARTED_FIRST) for i, name in enumerate(STARTED_FIRST)}, **{n: 1 for n in STARTED_LAST}}
    items.sort(key=lambda item: rank.get(item.path.name, 0))  # stable: the rest keep their order
