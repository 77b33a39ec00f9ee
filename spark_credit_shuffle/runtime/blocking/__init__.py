"""The blocking exchange (Flink's BLOCKING result partitions) as two Spark stages.

Producer stage: each input partition is a producer subtask; ``mapInArrow`` runs its rows through
the RecordWriter into a blocking result partition, whose finished buffers are written, as they
complete, to Spark's shuffle: one row per network buffer (consumer channel, producer, sequence
number, data type, payload), placed by ``repartitionById`` (on pyspark 4.0 its equivalent: see
:func:`~spark_credit_shuffle.runtime.placement.place_by`) so that shuffle partition *i* holds exactly the
buffers for consumer subtask *i*.

Consumer stage: each shuffle partition is a consumer subtask. It replays the stored buffers of
each producer through the credit-based protocol core, in process: a subpartition per producer
channel on the sending side, a remote input channel with exclusive buffers and the gate's floating
pool on the receiving side, credits, backlog and AddCredit as on the wire. A data buffer moves
only into a receiver buffer reserved for it, and the RecordReader turns received buffers back into
rows. The storage order of Spark's shuffle is the only thing that differs from Flink: the whole
result is produced before any consumer starts, which is the point of blocking mode.

The package: :mod:`.producer` and :mod:`.consumer` (the two halves), :mod:`.storage` (the rows of stored
buffers between them, and the producer's metrics row), :mod:`.input` (a stage's input, its waits idle time).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pyarrow as pa

from ...errors import PartitionerError, in_subtask
from ...metrics import PRODUCER
from ..metrics_report import CollectedMetrics, MetricsReport, finish_plan, metrics_report
from ..placement import place_by
from ..resources import freeze_worker_heap
from ..session import bound_arrow_batches
from .consumer_stage import consume_partition
from .producer_stage import produce_partition
from .storage import CONSUMER_INPUT_BATCH_BYTES, STORAGE_DDL, STORAGE_SCHEMA

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from ..exchange_plan import ExchangePlan

__all__ = ["STORAGE_SCHEMA", "build", "consume_partition", "produce_partition"]


def _partition_id() -> int:
    """The partition of the Spark task running this (only ever called inside one)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        raise RuntimeError("not inside a Spark task")
    return int(ctx.partitionId())


def build(
    plan: ExchangePlan, df: DataFrame, *, report: MetricsReport | None = None
) -> tuple[DataFrame, CollectedMetrics]:
    """The lazy Spark plan of a blocking exchange: (user-facing DataFrame, its metrics after an action).

    ``report``: how consumer tasks report metrics (default: the choice of
    :func:`~spark_credit_shuffle.runtime.metrics_report.metrics_report`).
    """
    report = (report if report is not None else metrics_report(df.sparkSession)).beside(
        [*df.columns, *plan.output_schema.names]
    )
    bound_arrow_batches(df.sparkSession, CONSUMER_INPUT_BATCH_BYTES)

    def produce(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        producer = _partition_id()
        try:
            freeze_worker_heap(plan.config.freeze_worker_heap)
            yield from produce_partition(batches, producer, plan)
        except PartitionerError as exc:
            raise in_subtask(exc, PRODUCER, producer) from None

    def consume(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        freeze_worker_heap(plan.config.freeze_worker_heap)
        yield from consume_partition(batches, _partition_id(), plan, report=report)

    label = plan.name.replace("-", "_")
    produce.__name__ = f"credit_shuffle_produce_{label}"
    consume.__name__ = f"credit_shuffle_consume_{label}"
    stored = df.mapInArrow(produce, STORAGE_DDL)
    placed = place_by(stored, plan.num_consumers, "channel")
    consumed = placed.mapInArrow(consume, report.output_type(df, plan))
    return finish_plan(plan, consumed, report)
