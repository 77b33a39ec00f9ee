"""Which kind of SparkSession the exchange runs on, and the session settings it reads or sets on the driver.

A classic session has a driver JVM in this process (``SparkContext``, accumulators, RDDs); a Spark
Connect session (``SparkSession.builder.remote(...)``, ``SPARK_REMOTE``, Databricks' shared and
serverless compute) is a client of a remote driver and has none of them. Every place in the package that
needs the SparkContext asks :func:`spark_context` and takes the Connect path when it returns None, so
nothing touches the JVM on a Connect session. :func:`is_connect` and :func:`spark_context` live in the bottom
layer (:mod:`spark_credit_shuffle._pyspark`, so that the config can ask them too) and are importable from here.

The rest of what the driver learns from the session is in rooms of its own: :mod:`.spark_plans` (the input's
partitions and physical plan), :mod:`.executors` (executors and task slots), :mod:`.worker_python` (the Python
the workers start).
"""

from __future__ import annotations

import logging
from typing import Any

from .._pyspark import is_connect, spark_context

__all__ = ["ARROW_BATCH_BYTES_KEY", "ansi_mode", "bound_arrow_batches", "is_connect", "spark_context"]

_log = logging.getLogger(__name__)

#: Spark's bound on the bytes of one Arrow batch it hands a Python task (its default: 64 MiB).
ARROW_BATCH_BYTES_KEY = "spark.sql.execution.arrow.maxBytesPerBatch"


def bound_arrow_batches(spark: Any, max_bytes: int) -> bool:
    """Have Spark hand Python tasks Arrow batches of at most ``max_bytes`` (its
    ``spark.sql.execution.arrow.maxBytesPerBatch``), unless the session sets that bound itself.

    Spark cuts a Python task's input after 10,000 rows or 64 MiB. Rows of whole network buffers
    (32 KiB each by default) reach the byte bound first: a consumer task of the blocking exchange would
    get its input in 64 MiB batches, which its Python worker holds whole, and which the JVM builds by
    growing its Arrow vectors over and over (a batch of a few MiB costs the JVM about half as much
    CPU per byte). The bound is a session setting, so it holds for every Python task of the session
    that gets batches larger than it; rows of ordinary width (10,000 rows under ``max_bytes``) are cut
    as before. Returns whether it set the bound: False when the session already has one (the user's
    choice is kept) or does not allow it to be set (a managed runtime's restriction; the exchange
    still runs, with Spark's batches).
    """
    from pyspark.errors import PySparkException  # the base of classic (captured) and Connect errors

    conf = spark.conf
    if conf.get(ARROW_BATCH_BYTES_KEY, None) is not None:
        return False
    try:
        conf.set(ARROW_BATCH_BYTES_KEY, f"{int(max_bytes)}b")
    except PySparkException as exc:
        _log.warning("could not set %s (%s); Spark's default bound applies", ARROW_BATCH_BYTES_KEY, exc)
        return False
    return True


def ansi_mode(spark: Any) -> bool:
    """True if ``spark`` runs in ANSI mode (``spark.sql.ansi.enabled``, on by default in Spark 4)."""
    return str(spark.conf.get("spark.sql.ansi.enabled", "true")).strip().lower() == "true"
