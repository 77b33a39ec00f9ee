"""The pyspark this package runs on, checked when the package is imported.

pyspark is optional (runtimes such as Databricks ship their own): without it the pure-Python parts (key
groups, the protocol core, the planner, the simulation) work. With a pyspark older than
:data:`MIN_PYSPARK`, importing the package raises ImportError naming both versions, instead of failing
later inside a Spark job.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

__all__ = ["MIN_PYSPARK", "check_pyspark", "installed_pyspark_version"]

#: The oldest pyspark the package runs on (``mapInArrow(..., barrier=True)``, Arrow's time zone and large
#: type options, the identity placement of :func:`~spark_credit_shuffle.runtime.common.place_by`).
MIN_PYSPARK = (4, 0)


def installed_pyspark_version() -> str | None:
    """The installed pyspark's version, None if there is none (read without importing pyspark if its
    package metadata is there)."""
    try:
        return importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # a pyspark without package metadata (a runtime's own, or pyspark-client)
        if importlib.util.find_spec("pyspark") is None:
            return None
        from pyspark.version import __version__
    except (ImportError, ValueError):
        return None
    return str(__version__)


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


check_pyspark(installed_pyspark_version())
