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
                     buffer a consumer took, every slice of input a producer wrote
value      double    the value
=========  ========  ===================================================================

The timeline (``Exchange.timeline()``) has the same columns plus one at the end:

=========  ========  ===================================================================
time_ms    double    wall-clock time of the sample, milliseconds since the Unix epoch
=========  ========  ===================================================================

Timeline rows have ``stat = "sample"``: every ``metrics_sample_interval_ms`` of wall time a task
records its gauges, plus once at its start and once at its end. In blocking mode the clock is checked
once per input batch or received buffer (never per row); in pipelined mode each task's loop
samples both of its sides on time, whether data moves or the task waits.

- Producers: ``outPoolUsage``, ``isBackPressured`` (0/1), ``numRecordsOutPerSecond`` since the
  previous sample and, per subpartition (channel = consumer), ``backlog`` (buffers queued and not
  yet consumed; in blocking mode every buffer stored so far). Pipelined mode adds, per subpartition,
  ``outputQueueLength`` and ``credit`` (the credit the consumer granted and the sender has not used
  yet; remote channels only, a task reads its own subpartition without credit).
- Both sides, both modes: Flink's time gauges ``busyTimeMsPerSecond``, ``idleTimeMsPerSecond``,
  ``backPressuredTimeMsPerSecond`` = ``softBackPressuredTimeMsPerSecond`` +
  ``hardBackPressuredTimeMsPerSecond``, each per second over the last minute (Flink's ``TimerGauge``
  window; see ``TimeAccount`` in :mod:`spark_credit_shuffle.engine.rules`); busy + idle +
  back-pressured = 1000 in every sample.
- Consumers: ``inPoolUsage``, ``inputExclusiveBuffersUsage``, ``inputFloatingBuffersUsage``,
  ``numRecordsInPerSecond`` since the previous sample, ``isBackPressured`` (0/1: waiting to hand its output
  on, what follows it in the task being slower; its time is the consumer's back-pressured time) and, per
  channel (channel = producer),
  ``credit`` (buffers the sender may send now, as the receiver knows it: its free buffers for the
  channel minus the credit not yet announced), ``unannouncedCredit`` (credit not yet announced to the
  sender), ``backlog`` (the sender's last announced backlog) and ``inputQueueLength``. In pipelined
  mode the local channel (a task's own subpartition) has no credit and no announced backlog: only its
  ``inputQueueLength``.

With checkpoint barriers on (``checkpoint_interval_ms``), consumers add one set of rows per completed
checkpoint with ``stat = "checkpoint"`` and the checkpoint's ordinal on the subtask as ``channel``
(``checkpointId``, ``checkpointAlignmentTime``, ``checkpointStartDelayNanos``,
``bytesPersistedDuringAlignment``, ...; see :mod:`spark_credit_shuffle.engine.checkpoints`), and the
timeline gets ``checkpointBarrier`` rows (value: the checkpoint id) when a producer injects a barrier and
when one reaches a consumer.

Every subtask also reports where it ran: one row ``metric = "executor"`` whose ``stat`` is the executor's
address as Spark reports it (``host:port`` of the executor in pipelined mode, the host's name in blocking
mode, whose tasks Spark tells nothing more) and whose value is 1 (Flink's metric scope names the host of a
subtask the same way, as a label rather than a value).

A task keeps at most :data:`MAX_TIMELINE_POINTS` sample times; past that it drops every other one and
doubles its interval, so long runs stay cheap.

``value`` is a double for every row, counts included, so that code reads one column of one type. Counts are
whole numbers all the same (:func:`is_count`: a counter's ``total``, ``numRecordsOut``, ``numBuffersIn``,
``numBytesOut``, ...); what people read shows them as integers: :func:`readable_metrics` (a pandas copy with
counts as ints and ``channel`` as a nullable integer), ``Exchange.summary()`` (integer counts) and the jobs'
printed tables and files.
Inside an exchange a metric row is ``struct<side, subtask, channel, metric, stat, value, time_ms>``,
``time_ms`` null for the summary rows.

Producers ship their metrics through the exchange itself; consumers hand theirs, and their producers',
to the driver when they end: through a PySpark accumulator on classic sessions, or, on Spark Connect
(no accumulators), as a hidden last row that an ``Observation`` collects
(:mod:`spark_credit_shuffle.runtime.metrics_report`). Either way each consumer subtask counts once: its
successful attempt in the first action that ran it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql.types import StructType

__all__ = [
    "CONSUMER",
    "EXECUTOR",
    "MAX_TIMELINE_POINTS",
    "METRICS_DDL",
    "METRIC_ROW_FIELDS",
    "METRIC_ROW_TYPE",
    "PRODUCER",
    "SAMPLE",
    "TIMELINE_DDL",
    "GaugeStats",
    "MetricRow",
    "RateMeter",
    "TaskMetrics",
    "TimelineSampler",
    "executor_row",
    "is_count",
    "metric_row_spark_type",
    "readable_metrics",
    "row_values",
    "rows_from_bytes",
    "rows_to_arrow",
    "rows_to_bytes",
    "rows_to_pandas",
]

PRODUCER = "producer"
CONSUMER = "consumer"
#: The ``stat`` of a timeline row.
SAMPLE = "sample"
#: The metric whose ``stat`` names the executor a subtask ran on (see the module documentation).
EXECUTOR = "executor"
#: Sample times a task keeps before it thins them out (every other one) and doubles its interval.
MAX_TIMELINE_POINTS = 1000


@dataclass(frozen=True)
class MetricRow:
    side: str
    subtask: int
    channel: int | None
    metric: str
    stat: str
    value: float
    time_ms: float | None = None  # set on timeline samples only


# -- the row's other forms, all derived from MetricRow's fields -------------------------------------------

#: The Arrow type of each annotation a MetricRow field may have (a missing one fails at import).
_ARROW_TYPES = {
    "str": pa.string(),
    "int": pa.int32(),
    "int | None": pa.int32(),
    "float": pa.float64(),
    "float | None": pa.float64(),
}
#: The names of a metric row's fields, in order (also the order of a row's JSON list).
METRIC_ROW_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(MetricRow))
_VALUE_INDEX = METRIC_ROW_FIELDS.index("value")
#: One metric row as carried inside an exchange: an Arrow struct of MetricRow's fields.
METRIC_ROW_TYPE = pa.struct([(f.name, _ARROW_TYPES[str(f.type)]) for f in fields(MetricRow)])
#: The columns that name the exchange in the metrics and timeline DataFrames, before the row's.
_EXCHANGE_FIELDS = (("exchange", pa.string()), ("mode", pa.string()))
_SPARK_DDL_TYPES = {pa.string(): "string", pa.int32(): "int", pa.float64(): "double"}


def _ddl(columns: Iterable[tuple[str, pa.DataType]]) -> str:
    return ", ".join(f"{name} {_SPARK_DDL_TYPES[arrow_type]}" for name, arrow_type in columns)


_ROW_COLUMNS = [(f.name, f.type) for f in METRIC_ROW_TYPE]
#: Spark DDL of the metrics DataFrame: the exchange, then every field of a row but ``time_ms``.
METRICS_DDL = _ddl([*_EXCHANGE_FIELDS, *(c for c in _ROW_COLUMNS if c[0] != "time_ms")])
#: Spark DDL of the timeline DataFrame: the metrics columns, then ``time_ms``.
TIMELINE_DDL = _ddl([*_EXCHANGE_FIELDS, *_ROW_COLUMNS])


def metric_row_spark_type() -> StructType:
    """The Spark type of one metric row (a struct of MetricRow's fields), for a column of rows."""
    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import StructType

    spark_type = from_arrow_type(METRIC_ROW_TYPE)
    assert isinstance(spark_type, StructType)  # an Arrow struct converts to a StructType
    return spark_type


def executor_row(side: str, subtask: int, where: str) -> MetricRow:
    """The row that says subtask ``subtask`` of ``side`` ran on the executor at ``where``."""
    return MetricRow(side, subtask, None, EXECUTOR, where, 1.0)


def row_values(row: MetricRow) -> tuple:
    """A row's field values in :data:`METRIC_ROW_FIELDS` order (``value`` as a float, as the DDLs say)."""
    values = [getattr(row, f) for f in METRIC_ROW_FIELDS]
    values[_VALUE_INDEX] = float(values[_VALUE_INDEX])
    return tuple(values)


def is_count(metric: str, stat: str) -> bool:
    """True for a counter's total (``numRecordsOut``, ``numBuffersIn``, ``numBytesOut``,
    ``numberOfCompletedCheckpoints``, ...): a whole number, although ``value`` holds it as a double."""
    return stat == "total" and metric.startswith("num") and not metric.endswith("PerSecond")


def readable_metrics(frame: pd.DataFrame, digits: int = 3) -> pd.DataFrame:
    """A copy of a metrics or timeline frame (``Exchange.metrics().toPandas()``, :func:`rows_to_pandas`) for
    people: ``channel`` as pandas' nullable ``Int64`` (``0``, not ``0.0``; null stays null), ``value`` as an
    ``object`` column of ints for the counts (:func:`is_count`) and of floats rounded to ``digits`` decimals
    for the rest. The metrics' own ``value`` column stays a double, for code."""
    out = frame.copy()
    if "channel" in out:
        out["channel"] = out["channel"].astype("Int64")
    if "value" in out and "metric" in out and "stat" in out:
        import pandas

        values = [
            round(float(v)) if is_count(m, s) and v == v else round(float(v), digits)
            for m, s, v in zip(out["metric"], out["stat"], out["value"])
        ]  # a list of ints and floats would become a float column: the Series is made an object one
        out["value"] = pandas.Series(values, index=out.index, dtype=object)
    return out


def rows_to_pandas(rows: Iterable[MetricRow]) -> pd.DataFrame:
    """Metric rows as a pandas DataFrame with one column per field, typed as the Arrow struct says
    (``channel`` and ``time_ms`` hold NaN where a row has none)."""
    table = pa.Table.from_struct_array(rows_to_arrow([list(rows)]).flatten())
    return table.to_pandas()


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

    def rows(
        self, series: Mapping[str, Sequence[float]] | None = None, channels: Sequence[int] = ()
    ) -> list[MetricRow]:
        """The counters' rows (``stat = "total"``), ordered by metric, then channel; then each gauge's ``max``
        and ``mean``.

        ``series`` adds per-channel counters given as one value per entry of ``channels`` (a producer's
        counters per subpartition, a consumer's per input channel), reported as if each had been counted
        under its channel: a run of 800 x 800 channels reports some four million of them, which need not
        go through the dictionary and its sort, and a second call does not count them twice."""
        side, subtask = self.side, self.subtask
        extra = dict(series) if series else {}
        if extra and (
            any(metric in extra for _, metric in self.counters)
            or any(len(v) != len(channels) for v in extra.values())
            or len(set(channels)) != len(channels)
        ):  # the general path: the series added into the counters they share a metric with
            counters = dict(self.counters)
            for name, added in extra.items():
                for index, count in zip(channels, added):
                    counters[(index, name)] = counters.get((index, name), 0.0) + count
            extra = {}
        else:
            counters = self.counters
        by_metric: dict[str, list[tuple[int | None, float]]] = {}
        for (channel, metric), value in counters.items():
            by_metric.setdefault(metric, []).append((channel, value))
        order = sorted(range(len(channels)), key=channels.__getitem__) if extra else []
        ordered = [channels[i] for i in order]
        out: list[MetricRow] = []
        append = out.append
        for metric in sorted(by_metric.keys() | extra.keys()):
            per_channel = extra.get(metric)
            if per_channel is not None:
                for index, i in zip(ordered, order):
                    append(MetricRow(side, subtask, index, metric, "total", float(per_channel[i])))
                continue
            for channel, value in sorted(by_metric[metric], key=lambda cv: cv[0] or -1):
                append(MetricRow(side, subtask, channel, metric, "total", float(value)))
        for metric, stats in sorted(self.gauges.items()):
            append(MetricRow(side, subtask, None, metric, "max", float(stats.peak)))
            append(MetricRow(side, subtask, None, metric, "mean", float(stats.mean)))
        return out


def rows_to_arrow(groups: Iterable[list[MetricRow] | None]) -> pa.Array:
    """A ``list<METRIC_ROW_TYPE>`` array with one list per group (None gives a null list)."""
    values: list[list[dict[str, object]] | None] = []
    for group in groups:
        if group is None:
            values.append(None)
        else:
            values.append([{name: getattr(r, name) for name in METRIC_ROW_FIELDS} for r in group])
    return pa.array(values, type=pa.list_(METRIC_ROW_TYPE))


#: Metric rows as a table: one column per MetricRow field (the form :func:`rows_to_bytes` encodes).
_ROWS_SCHEMA = pa.schema(list(METRIC_ROW_TYPE))


def rows_to_bytes(rows: Iterable[MetricRow]) -> bytes:
    """Metric rows as the bytes that carry them inside an exchange (an Arrow IPC stream of one batch with a
    column per field): a blocking producer's metrics row, read back by :func:`rows_from_bytes`."""
    table = pa.Table.from_struct_array(rows_to_arrow([list(rows)]).flatten())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, _ROWS_SCHEMA) as writer:
        writer.write_table(table.cast(_ROWS_SCHEMA))
    return sink.getvalue().to_pybytes()


def rows_from_bytes(data: bytes | pa.Buffer) -> list[MetricRow]:
    """The metric rows :func:`rows_to_bytes` encoded. Bytes from the wire are untrusted: anything but a
    stream of metric rows raises :class:`~spark_credit_shuffle.errors.ProtocolError`."""
    from .errors import ProtocolError

    try:
        table = pa.ipc.open_stream(data).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise ProtocolError(f"metric rows that do not decode: {exc}") from None
    if not table.schema.equals(_ROWS_SCHEMA):
        raise ProtocolError(f"metric rows of another schema: {table.schema}")
    return [MetricRow(**row) for row in table.to_pylist()]


class TimelineSampler:
    """Samples a task's gauges every ``interval_ms`` of wall time, as timeline rows.

    Call :meth:`due` where the task handles a batch or a buffer (one clock read) and, when it says so,
    :meth:`record` with a function returning ``(metric, channel, value)`` triples; only then are the
    gauges read. ``interval_ms = 0`` turns sampling off. At most :data:`MAX_TIMELINE_POINTS` sample
    times are kept: beyond that every other one is dropped and the interval doubles.
    """

    __slots__ = ("_next", "interval", "listener", "rows", "side", "subtask")

    def __init__(self, side: str, subtask: int, interval_ms: int) -> None:
        self.side = side
        self.subtask = subtask
        self.interval = interval_ms / 1000.0
        self.rows: list[list[MetricRow]] = []  # one list per sample time
        self._next = 0.0
        #: Called with the rows of each sample as it is taken (the live monitor), if set.
        self.listener: Callable[[list[MetricRow]], None] | None = None

    def due(self, now: float | None = None) -> bool:
        """True if a sample is due at ``now`` (default: the clock's now; always False when sampling is off)."""
        return self.interval > 0 and (time.monotonic() if now is None else now) >= self._next

    def record(
        self,
        gauges: Callable[[], Iterable[tuple[str, int | None, float]]],
        now: float | None = None,
        stamp_ms: float | None = None,
    ) -> None:
        """Take one sample now (whether due or not), unless sampling is off; ``now`` (monotonic seconds) and
        ``stamp_ms`` (the sample's wall-clock time) default to the clocks' readings."""
        if self.interval <= 0:
            return
        now = time.monotonic() if now is None else now
        stamp = time.time() * 1000.0 if stamp_ms is None else stamp_ms
        side, subtask = self.side, self.subtask
        sample = [
            MetricRow(side, subtask, channel, metric, SAMPLE, float(value), stamp)
            for metric, channel, value in gauges()
        ]
        self.rows.append(sample)
        if self.listener is not None:
            self.listener(sample)
        if len(self.rows) > MAX_TIMELINE_POINTS:
            self.rows = self.rows[::2]
            self.interval *= 2
        self._next = now + self.interval

    def sample(self, gauges: Callable[[], Iterable[tuple[str, int | None, float]]]) -> None:
        """:meth:`record` if :meth:`due`."""
        if self.interval > 0 and time.monotonic() >= self._next:
            self.record(gauges)

    def timeline_rows(self) -> list[MetricRow]:
        """Every sample kept, in time order."""
        return [r for rows in self.rows for r in rows]

    @property
    def num_samples(self) -> int:
        return len(self.rows)


class RateMeter:
    """Per-second rate of a growing count between two readings (Flink's ``MeterView`` over one interval)."""

    __slots__ = ("_count", "_time")

    def __init__(self) -> None:
        self._count = 0.0
        self._time: float | None = None

    def rate(self, count: float, now: float | None = None) -> float:
        """Events per second since the previous call (0.0 on the first); ``now`` defaults to the clock's."""
        now = time.monotonic() if now is None else now
        previous, self._time = self._time, now
        delta, self._count = count - self._count, float(count)
        if previous is None or now <= previous:
            return 0.0
        return delta / (now - previous)
