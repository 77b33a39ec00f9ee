"""The jobs users run with ``spark-submit``, as modules of the package so that an installed wheel has them, and
the code the scripts of the repository's ``jobs/`` share (:mod:`.common`: generated data, sessions, timing;
:mod:`.pipelined_path` and :mod:`.lean_path`: the pipelined path's benchmarks).

``spark-submit`` runs a file, not a module: ``python -m spark_credit_shuffle job-path exchange`` prints the
file of the exchange job inside the installed package, so

    spark-submit $(python -m spark_credit_shuffle job-path exchange) --generate 100000 --partitioner rebalance

runs it from any directory (``demo`` names the demo). Under plain ``python``, ``python -m
spark_credit_shuffle.jobs.exchange_job ...`` runs the same job on a local session.
"""

from __future__ import annotations

import os

__all__ = ["JOBS", "job_path"]

#: The jobs ``job-path`` knows: the name a user types, and the module of this package that is the job.
JOBS = {"exchange": "exchange_job", "demo": "demo"}


def job_path(name: str) -> str:
    """The file of job ``name`` (a key of :data:`JOBS`) in the installed package, for ``spark-submit``."""
    if name not in JOBS:
        raise KeyError(f"no job {name!r}: the jobs are " + ", ".join(JOBS))
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), JOBS[name] + ".py")
