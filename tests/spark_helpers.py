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


@contextlib.contextmanager
def job_group(spark) -> Iterator[list[int]]:
    """Run the block's Spark jobs in a job group of their own; the list it gives holds, after the block, the
    highest attempt number of every stage those jobs ran (0 for a stage that ran once)."""
    sc = spark.sparkContext
    group = f"group-{uuid.uuid4()}"
    sc.setJobGroup(group, "counted")
    attempts: list[int] = []
    try:
        yield attempts
    finally:
        tracker = sc.statusTracker()
        for job in tracker.getJobIdsForGroup(group):
            info = tracker.getJobInfo(job)
            for stage in info.stageIds if info is not None else []:
                stage_info = tracker.getStageInfo(stage)
                if stage_info is not None:
                    attempts.append(stage_info.currentAttemptId)
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
