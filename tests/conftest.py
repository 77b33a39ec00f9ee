"""One local SparkSession for the whole test run, started only when a test asks for it."""

from __future__ import annotations

import os
import sys

import pytest


@pytest.fixture(scope="session")
def spark():
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["SPARK_TESTING"] = "1"
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[4, 2]")
        .appName("spark_credit_shuffle tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
        .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "3")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
