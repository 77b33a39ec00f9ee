"""The planner (:mod:`spark_credit_shuffle.planner`) on a Spark session: its executors and task slots
(:mod:`~spark_credit_shuffle.runtime.session` computes them), the plan as a Spark DataFrame, and
:func:`check_fits`, which ``exchange()`` runs before launch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..config import NetworkConfig
from ..planner import ExchangeSpec, Executors, plan_network, plan_table
from .executors import configured_executors, executor_slots

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from .exchange_plan import ExchangePlan

__all__ = ["check_fits", "executors_from_spark", "plan_dataframe"]


def plan_dataframe(
    spark: SparkSession,
    exchanges: ExchangeSpec | Sequence[ExchangeSpec],
    executors: Executors | None = None,
    config: NetworkConfig | None = None,
    *,
    chain: bool = False,
    level: str = "stage",
) -> DataFrame:
    """:func:`plan_table` as a Spark DataFrame. ``executors`` and ``config`` default to the session's."""
    if config is None:
        config = NetworkConfig.from_spark(spark)
    if executors is None:
        executors = executors_from_spark(spark)
    table = plan_table(exchanges, executors, config, chain=chain, level=level)
    if "partition_max" in table:
        table["partition_max"] = table["partition_max"].astype("Int64")
    return spark.createDataFrame(table)


def executors_from_spark(spark: Any) -> Executors:
    """The session's executors (:mod:`~spark_credit_shuffle.runtime.session`): how many it is configured
    with (1 when unknown) and the task slots of each."""
    return Executors(configured_executors(spark) or 1, executor_slots(spark))


def check_fits(plan: ExchangePlan, spark: Any) -> None:
    """Raise InsufficientNetworkBuffersError if one executor cannot reserve what its tasks need.

    Run by ``exchange()`` before any Spark job, with the session's executors and the plan's settings.
    Blocking mode runs producers and consumers in separate stages; pipelined mode runs both halves of a
    subtask in one task. An executor runs up to ``executor_slots`` tasks at once.
    """
    network = plan_network(ExchangeSpec.from_plan(plan), executors_from_spark(spark), plan.config)
    network.raise_if_not_fits()
