"""The pyspark this package runs on, checked when the package is imported.

pyspark is optional (runtimes such as Databricks ship their own): without it the pure-Python parts (key
groups, the protocol core, the planner, the simulation) work. With a pyspark older than
:data:`MIN_PYSPARK`, importing the package raises ImportError naming both versions, instead of failing
later inside a Spark job. :func:`is_connect` and :func:`spark_context` tell a classic session from a Spark
Connect one without touching the JVM; they sit here, in the bottom layer, because the config reads a
session's conf too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark import SparkContext

__all__ = ["MIN_PYSPARK", "check_pyspark", "installed_pyspark_version", "is_connect", "session_conf", "spark_context"]

#: The oldest pyspark the package runs on (``mapInArrow(..., barrier=True)``, Arrow's time zone and large
#: type options, the identity placement of :func:`~spark_credit_shuffle.runtime.placement.place_by`).
MIN_PYSPARK = (4, 0)


def installed_pyspark_version() -> str | None:
    """The installed pyspark's version, None if there is none (read without importing pyspark if its
    package metadata is there)."""
    version = _metadata_version("pyspark")
    if version is not None:
        return version
    try:  # a pyspark without package metadata (a runtime's own, or pyspark-client)
        if importlib.util.find_spec("pyspark") is None:
            return None
        from pyspark.version import __version__
    except (ImportError, ValueError):
        return None
    return str(__version__)


def _metadata_version(project: str) -> str | None:
    """The ``Version`` of the first installed distribution of ``project`` on ``sys.path`` (its ``.dist-info``
    or ``.egg-info`` metadata), as ``importlib.metadata.version`` finds it, without importing
    ``importlib.metadata``: that module and the ``email`` parser it loads were most of the package's import
    time, which every Python worker daemon pays before it starts."""
    prefix = project.lower() + "-"
    for entry in sys.path:
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:  # a zip, a jar, a missing directory
            continue
        for name in names:
            if not (name.lower().startswith(prefix) and name.endswith((".dist-info", ".egg-info"))):
                continue
            info = os.path.join(entry or ".", name)
            for file in ("METADATA", "PKG-INFO") if os.path.isdir(info) else ():
                try:
                    with open(os.path.join(info, file), encoding="utf-8") as f:
                        for line in f:
                            if not line.strip():
                                break  # the end of the headers
                            if line.lower().startswith("version:"):
                                return line.split(":", 1)[1].strip()
                except OSError:
                    continue
    return None


def check_pyspark(version: str | None) -> None:
    """Raise ImportError if ``version`` (a pyspark version, None for none installed) is older than
    :data:`MIN_PYSPARK`."""
    if version is None:
        return
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[: len(MIN_PYSPARK)])
    if numbers < MIN_PYSPARK:
        minimum = ".".join(map(str, MIN_PYSPARK))
        raise ImportError(
            f"spark_credit_shuffle needs pyspark >= {minimum}, but pyspark {version} is installed: install "
            f"pyspark>={minimum} (pip install 'spark-credit-shuffle[spark]') or use a Spark {MIN_PYSPARK[0]} runtime"
        )


def is_connect(spark: Any) -> bool:
    """True if ``spark`` (a SparkSession) is a Spark Connect session, False for a classic one.

    Decided by the session's class (``pyspark.sql.connect.session.SparkSession``), not by the process's
    environment: a process may hold a classic session and a Connect session at the same time.
    """
    return type(spark).__module__.startswith("pyspark.sql.connect")


def spark_context(spark: Any) -> SparkContext | None:
    """The SparkContext of a classic session; None on Spark Connect, which has none."""
    return None if is_connect(spark) else spark.sparkContext


def session_conf(spark: Any) -> dict[str, str]:
    """Every key set on ``spark``'s session (``spark.conf.getAll``), also those set with ``spark.conf.set``.

    On a classic session ``getAll`` walks the JVM's map one py4j call per entry and ends on a Java exception
    (some 60 ms, more than the rest of building an exchange); the JVM's own JSON writer returns the same map
    in one call. Spark Connect answers ``getAll`` in one request."""
    jconf = None if is_connect(spark) else getattr(spark.conf, "_jconf", None)
    if jconf is not None:
        try:
            mapper = spark.sparkContext._jvm.com.fasterxml.jackson.databind.ObjectMapper()
            return {str(k): str(v) for k, v in json.loads(mapper.writeValueAsString(jconf.getAllAsJava())).items()}
        except Exception:  # a JVM without Jackson on the driver's class path: the walk
            pass
    return dict(spark.conf.getAll)


check_pyspark(installed_pyspark_version())
