"""Argument types shared by the command line (``python -m spark_credit_shuffle``) and the jobs in ``jobs/``.

Each turns a bad value into ``argparse.ArgumentTypeError`` saying what is allowed, so argparse reports it
with the option's name and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from typing import Any

from .config import CONF_PREFIX

__all__ = ["conf_pair", "job_session", "positive_int", "require_plotting"]


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of rows, tasks, rounds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}: allowed is an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {value}: allowed is an integer >= 1")
    return value


def conf_pair(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` of ``--conf``: a Spark setting or an exchange setting (conf key or keyword name)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"invalid --conf {text!r}: allowed is KEY=VALUE, e.g. {CONF_PREFIX}buffersPerChannel=4 or "
            f"buffers_per_channel=4"
        )
    return key.strip(), value.strip()


def require_plotting(parser: argparse.ArgumentParser, option: str, value: object) -> None:
    """Exit with status 2 (argparse's usage error) if ``option`` asks for a picture (``value`` set) and matplotlib
    is not installed: checked with the arguments, before the job runs anything."""
    if not value:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.exit(
            2,
            f"{parser.prog}: error: {option} draws a picture, which needs matplotlib: pip install "
            f"'spark-credit-shuffle[plot]' (or pip install matplotlib), or leave {option} out\n",
        )


def job_session(app_name: str, master: str, conf: Iterable[tuple[str, str]]) -> tuple[Any, bool]:
    """A job's SparkSession and whether the job created it (and so stops it at its end).

    The active session (a notebook's, a test's, ``spark-submit``'s) is used as it is. Otherwise one is built
    with ``conf``; under plain ``python``, where nobody chose a master, on ``master`` with a quiet, fast-starting
    local driver.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from .runtime.session import spark_context

    existing = SparkSession.getActiveSession()
    if existing is not None:
        return existing, False
    builder = SparkSession.builder.appName(app_name)
    if not os.environ.get("PYSPARK_GATEWAY_PORT"):  # plain python: nobody chose a master
        builder = (
            builder.master(master)
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.adaptive.enabled", "false")
            .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        )
    for key, value in conf:
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    sc = spark_context(spark)
    if sc is not None:  # Spark Connect: the log level is the server's
        sc.setLogLevel("WARN")
    return spark, True
