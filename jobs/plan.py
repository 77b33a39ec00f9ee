"""Plan the network buffers of a topology: per task, per executor, and whether it fits.

The same options as ``spark-credit-shuffle plan``. With plain ``python`` no Spark is started:
settings come from ``--conf spark.creditShuffle.*=...`` and the flags. Under ``spark-submit`` the
session's ``spark.creditShuffle.*`` settings and its executors (``spark.executor.instances``, cores)
are the defaults, the plan is also shown as a Spark DataFrame, and the flags still win::

    spark-submit --conf spark.creditShuffle.networkMemory=128mb jobs/plan.py --producers 8 --mode pipelined

The last line is one JSON object with the headline figures. Exit status 0 if it fits, 1 if not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from spark_credit_shuffle.cli import add_plan_arguments, config_from_args, plan_from_args, print_plan
    from spark_credit_shuffle.errors import ConfigError, PartitionerError

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_plan_arguments(parser)
    args = parser.parse_args(argv)

    spark = None
    base: dict[str, str] = {}
    executors = None
    if os.environ.get("PYSPARK_GATEWAY_PORT"):  # under spark-submit: the session's settings and executors
        from pyspark.sql import SparkSession

        from spark_credit_shuffle.config import CONF_PREFIX
        from spark_credit_shuffle.runtime.planner_on_spark import executors_from_spark

        spark = SparkSession.builder.appName("spark_credit_shuffle plan").getOrCreate()
        base = {k: v for k, v in dict(spark.conf.getAll).items() if k.startswith(CONF_PREFIX)}
        executors = executors_from_spark(spark)
    try:
        config = config_from_args(args, base)
        plan = plan_from_args(args, config, executors)
    except (ConfigError, PartitionerError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    print_plan(plan, args.tasks)
    if spark is not None:
        from spark_credit_shuffle.runtime.session import spark_context

        sc = spark_context(spark)  # None on Spark Connect: no job descriptions there
        if sc is not None:
            sc.setJobDescription("spark_credit_shuffle plan: stage table")
        table = plan.stages_table()
        spark.createDataFrame(table).show(truncate=False)
        if sc is not None:
            sc.setJobDescription(None)
    print(json.dumps(plan.headline()))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
