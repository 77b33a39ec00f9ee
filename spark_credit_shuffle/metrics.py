"""Flink-named network metrics, gathered per task and returned as one long-format DataFrame.

Schema (stable; one row per measured value):

=========  ========  ===================================================================
column     type      meaning
=========  ========  ===================================================================
exchange   string    name of the exchange (``<partitioner>-<mode>-<id>``)
mode       string    ``blocking`` or ``pipelined``
side       string    ``producer`` (result partition) or ``consumer`` (input gate)
subtask    int       producer or consumer subtask index
channel    int       producer: the consumer subtask a subpartition feeds; consumer: the
                     producer subtask an input channel reads; null for task-level values
metric     string    Flink's metric name (``numRecordsOut``, ``outPoolUsage``, ...)
stat       string    ``total`` for counters; ``max`` or ``mean`` of a gauge sampled on every
                     buffer the task handled
value      double    the value
=========  ========  ===================================================================

Metrics travel with the data (no accumulators, so Spark Connect works): producers ship theirs
through the exchange itself, consumers report them as the last row of their partition, and
Spark's ``Observation`` collects them from the successful attempt of every task, once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa

__all__ = [
    "CONSUMER",
    "METRICS_DDL",
    "METRIC_ROW_TYPE",
    "PRODUCER",
    "GaugeStats",
    "MetricRow",
    "TaskMetrics",
]

PRODUCER = "producer"
CONSUMER = "consumer"

METRIC_ROW_TYPE = pa.struct(
    [
        ("side", pa.string()),
        ("subtask", pa.int32()),
        ("channel", pa.int32()),
        ("metric", pa.string()),
        ("stat", pa.string()),
        ("value", pa.float64()),
    ]
)
#: Spark DDL of one metric row, as carried inside an exchange.
METRIC_ROW_DDL = "struct<side:string,subtask:int,channel:int,metric:string,stat:string,value:double>"
#: Spark DDL of the metrics DataFrame.
METRICS_DDL = (
    "exchange string, mode string, side string, subtask int, channel int, metric string, stat string, value double"
)


@dataclass(frozen=True)
class MetricRow:
    side: str
    subtask: int
    channel: int | None
    metric: str
    stat: str
    value: float


@dataclass
class GaugeStats:
    """Running max and mean of a gauge sampled at the moments a task handles a buffer."""

    samples: int = 0
    total: float = 0.0
    peak: float = 0.0

    def sample(self, value: float) -> None:
        self.samples += 1
        self.total += value
        if value > self.peak:
            self.peak = value

    @property
    def mean(self) -> float:
        return self.total / self.samples if self.samples else 0.0


@dataclass
class TaskMetrics:
    """The metrics of one producer or consumer subtask."""

    side: str
    subtask: int
    counters: dict[tuple[int | None, str], float] = field(default_factory=dict)
    gauges: dict[str, GaugeStats] = field(default_factory=dict)

    def count(self, metric: str, value: float, channel: int | None = None) -> None:
        key = (channel, metric)
        self.counters[key] = self.counters.get(key, 0.0) + value

    def set(self, metric: str, value: float, channel: int | None = None) -> None:
        self.counters[(channel, metric)] = float(value)

    def sample(self, metric: str, value: float) -> None:
        stats = self.gauges.get(metric)
        if stats is None:
            stats = self.gauges[metric] = GaugeStats()
        stats.sample(value)

    def rows(self) -> Iterator[MetricRow]:
        for (channel, metric), value in sorted(self.counters.items(), key=lambda kv: (kv[0][1], kv[0][0] or -1)):
            yield MetricRow(self.side, self.subtask, channel, metric, "total", float(value))
        for metric, stats in sorted(self.gauges.items()):
            yield MetricRow(self.side, self.subtask, None, metric, "max", float(stats.peak))
            yield MetricRow(self.side, self.subtask, None, metric, "mean", float(stats.mean))

    def to_arrow(self) -> pa.Array:
        """This task's rows as one Arrow ``list<struct>`` value (the hidden metrics cell)."""
        return rows_to_arrow([list(self.rows())])


def rows_to_arrow(groups: Iterable[list[MetricRow] | None]) -> pa.Array:
    """A ``list<METRIC_ROW_TYPE>`` array with one list per group (None gives a null list)."""
    values = []
    for group in groups:
        if group is None:
            values.append(None)
        else:
            values.append(
                [
                    {
                        "side": r.side,
                        "subtask": r.subtask,
                        "channel": r.channel,
                        "metric": r.metric,
                        "stat": r.stat,
                        "value": r.value,
                    }
                    for r in group
                ]
            )
    return pa.array(values, type=pa.list_(METRIC_ROW_TYPE))
