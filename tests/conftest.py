"""One local SparkSession for the whole test run, and one local Spark Connect server with a session on it, each
started only when a test asks for it.

The Connect server is a process of its own (``spark-submit`` of Spark's ``SparkConnectServer``, on a free port
of 127.0.0.1, with the classic session's settings) and stops when the test run ends. PySpark decides whether
``pyspark.sql.functions`` build Connect or classic columns by one process-wide switch (the
``SPARK_CONNECT_MODE_ENABLED`` variable), so a Connect test turns it on for its own duration only:
``connect_spark`` (the one Connect session) and ``any_spark`` (a test run once per kind of session) do that.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CONNECT_MODE = "SPARK_CONNECT_MODE_ENABLED"
#: What the classic session and the Connect server share (local[4, 2]: 4 slots, a failed task retried once).
MASTER = "local[4, 2]"
SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.adaptive.enabled": "false",
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "3",
    "spark.python.worker.reuse": "true",
    # workers import the installed PySpark's bytecode, not its zip's source (spark_credit_shuffle_daemon)
    "spark.python.daemon.module": "spark_credit_shuffle_daemon",
}
CONNECT_START_TIMEOUT_S = 180


@pytest.fixture(scope="session")
def spark():
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["SPARK_TESTING"] = "1"
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(MASTER).appName("spark_credit_shuffle tests")
    for key, value in SPARK_CONF.items():
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


class ConnectServerExited(RuntimeError):
    """The Connect server process ended before it accepted connections."""


def _start_connect_server(log_path: Path) -> tuple[subprocess.Popen, int, float]:
    """(process, port, seconds until the port accepted connections) of a new Spark Connect server."""
    import pyspark

    spark_submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_REMOTE", CONNECT_MODE, "PYSPARK_SUBMIT_ARGS")}
    env.update(
        PYSPARK_PYTHON=sys.executable,  # its Python workers import the package from this environment
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_TESTING="1",
    )
    port = _free_port()
    command = [str(spark_submit), "--class", "org.apache.spark.sql.connect.service.SparkConnectServer"]
    command += ["--master", MASTER, "--name", "spark_credit_shuffle connect tests"]
    conf = {
        **SPARK_CONF,
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
    }
    for key, value in conf.items():
        command += ["--conf", f"{key}={value}"]
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    while not _accepts(port):
        waited = time.monotonic() - started
        if process.poll() is not None or waited > CONNECT_START_TIMEOUT_S:
            exited = process.poll() is not None
            _stop(process)
            tail = log_path.read_text(errors="replace")[-3000:]
            reason = f"exited with {process.returncode}" if exited else "timed out"
            raise (ConnectServerExited if exited else RuntimeError)(
                f"the Spark Connect server for the tests did not accept connections on 127.0.0.1:{port} within "
                f"{CONNECT_START_TIMEOUT_S} s ({reason}); the end of its log {log_path}:\n{tail}"
            )
        time.sleep(0.1)
    return process, port, time.monotonic() - started


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory):
    """``sc://127.0.0.1:<port>`` of a local Spark Connect server started for this test run."""
    log_path = tmp_path_factory.mktemp("connect") / "server.log"
    for attempt in range(3):  # the free port may be taken by someone else before the server binds it
        try:
            process, port, seconds = _start_connect_server(log_path)
            break
        except ConnectServerExited:
            if attempt == 2:
                raise
    print(f"\nSpark Connect server on 127.0.0.1:{port}: accepting connections after {seconds:.1f} s")
    try:
        yield f"sc://127.0.0.1:{port}"
    finally:
        _stop(process)


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


#: Modules whose tests start applications of their own (notebook kernels, a local-cluster), a minute or more
#: in one test process: collected first, so that ``make test`` (``--dist loadscope``, modules in collection
#: order) starts them first instead of ending the run with them.
STARTED_FIRST = ("test_notebooks.py", "test_local_cluster.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if JVM_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.spark)
    first = {name: rank for rank, name in enumerate(STARTED_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest keep their order
