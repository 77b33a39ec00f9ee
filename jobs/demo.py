"""Demo: a keyed exchange on local Spark with generated data, and what the network stack did: the package's
demo (:mod:`spark_credit_shuffle.jobs.demo`), run from a checkout by ``make run``.

From an installed package: ``python -m spark_credit_shuffle.jobs.demo`` or ``spark-submit $(python -m
spark_credit_shuffle job-path demo)``.
"""

from __future__ import annotations

import sys

from spark_credit_shuffle.jobs.demo import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
