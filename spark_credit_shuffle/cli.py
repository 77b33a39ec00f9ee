"""Argument types shared by the command line (``spark-credit-shuffle``) and the jobs (:mod:`.jobs`, ``jobs/``), and
the jobs' SparkSession (:func:`job_session`).

Each turns a bad value into ``argparse.ArgumentTypeError`` saying what is allowed (and, for a word close to
an allowed one, "did you mean"), so argparse reports it with the option's name and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from .config import CONF_PREFIX
from .errors import suggest

__all__ = ["choice", "conf_pair", "job_session", "positive_int", "require_plotting"]


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of rows, tasks, rounds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}: allowed is an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {value}: allowed is an integer >= 1")
    return value


def choice(*allowed: str) -> Callable[[str], str]:
    """An argument type taking one of the words ``allowed`` (any case, returned as spelled in ``allowed``):
    argparse's own ``choices`` says only "invalid choice", this also says which word was probably meant.
    Pass the same words as ``choices=`` too, so that ``--help`` lists them."""
    by_lower = {word.lower(): word for word in allowed}

    def parse(text: str) -> str:
        word = by_lower.get(text.strip().lower())
        if word is not None:
            return word
        message = f"invalid value {text!r}: allowed is " + ", ".join(repr(w) for w in allowed)
        nearest = suggest(text, allowed)
        if nearest is not None:
            message += f"; did you mean {nearest!r}?"
        raise argparse.ArgumentTypeError(message)

    parse.__name__ = "one of " + ", ".join(allowed)  # argparse names a type by it in some messages
    return parse


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


def job_session(
    app_name: str,
    master: str,
    conf: Iterable[tuple[str, str]] = (),
    *,
    local_conf: Iterable[tuple[str, str]] = (),
    quick_start: bool = True,
    log_level: str = "WARN",
) -> tuple[Any, bool]:
    """A job's SparkSession and whether the job created it (and so stops it at its end).

    The active session (a notebook's, a test's, ``spark-submit``'s) is used as it is. Otherwise one is built
    with ``conf``; under plain ``python``, where nobody chose a master, on ``master`` with ``local_conf`` too (a
    benchmark's driver memory, its UI off) and a quiet driver. ``quick_start``: that local driver's JVM starts
    fast (the first JIT tier only, the serial collector), which suits a short job, not a benchmark timing the
    JVM's share of the work. ``log_level``: Spark's log level of the session (not on Spark Connect).
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
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
        )
        if quick_start:
            builder = builder.config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        for key, value in local_conf:
            builder = builder.config(key, value)
    for key, value in conf:
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    sc = spark_context(spark)
    if sc is not None:  # Spark Connect: the log level is the server's
        sc.setLogLevel(log_level)
    return spark, True
