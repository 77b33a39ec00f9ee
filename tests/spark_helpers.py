"""Helpers for tests on the local SparkSession."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator


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
