"""Run one credit-based exchange over a dataset and write its output, metrics and timeline: the package's
exchange job (:mod:`spark_credit_shuffle.jobs.exchange_job`, its options and output there), run from a checkout.

    spark-submit jobs/exchange_job.py --input events.parquet --partitioner hash:user_id --parallelism 8
    python jobs/exchange_job.py --generate 100000 --partitioner rebalance

From an installed package: ``spark-submit $(python -m spark_credit_shuffle job-path exchange) ...``.
"""

from __future__ import annotations

import sys

from spark_credit_shuffle.jobs.exchange_job import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
