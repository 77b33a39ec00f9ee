"""How a consumer task's metric rows reach the driver, in both runtimes.

A consumer task ends with the metric rows of the task (and of the producers whose metrics reached
it). A :class:`MetricsReport`, chosen on the driver when the plan is built, carries them:

- through a PySpark accumulator (classic sessions, the default): the rows travel back with the task's
  result, and the task's output has exactly the input's columns. Spark merges the updates of
  successful task attempts; :class:`CollectedMetrics` keeps, per consumer subtask, the latest attempt
  of the first stage that ran it.
- in band (Spark Connect, which has no accumulators): the task yields one hidden column, null on every
  data row, and one last row whose cell holds the metrics; an ``Observation`` collects the cells and a
  filter drops that row again, so the user sees exactly the input schema. Spark evaluates the
  observation and the filter row by row: on 10 M rows they cost about 2 s of JVM CPU, which is why
  the accumulator is preferred where it exists.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..errors import CreditShuffleError
from ..metrics import METRIC_ROW_FIELDS, METRIC_ROW_TYPE, MetricRow, metric_row_spark_type, rows_to_arrow
from .placement import unused_name

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Observation
    from pyspark.sql.types import StructType

    from .exchange_plan import ExchangePlan

__all__ = [
    "IN_BAND",
    "METRICS_COLUMN",
    "CollectedMetrics",
    "MetricsReport",
    "NoMetrics",
    "finish_plan",
    "metrics_batch",
    "metrics_report",
    "output_struct_type",
    "with_metrics_column",
]

#: The hidden column that carries metrics out of consumer tasks.
METRICS_COLUMN = "__credit_shuffle_metrics"
_METRICS_CELL_TYPE = pa.list_(METRIC_ROW_TYPE)


def output_struct_type(schema: StructType, column: str = METRICS_COLUMN) -> StructType:
    """Spark type of a consumer stage's output: the columns of ``schema`` (the input's, or the last chained
    operator's) plus the metrics column ``column``."""
    from pyspark.sql.types import ArrayType, StructField, StructType

    if column in schema.names:
        raise ValueError(f"the input already has a column named {column}")
    metrics_type = ArrayType(metric_row_spark_type())
    return StructType([*schema.fields, StructField(column, metrics_type, True)])


def output_schema(schema: pa.Schema, column: str = METRICS_COLUMN) -> pa.Schema:
    return schema.append(pa.field(column, _METRICS_CELL_TYPE))


#: Null metrics cells, sliced (no copy) for every data batch: allocating them, and the output schema, per batch
#: cost the consumer about a tenth of a network buffer's CPU per output batch. Grown when a batch is longer;
#: a one-entry cache of (input schema, column, output schema). Replaced whole, never changed in place.
_null_cells: pa.Array = pa.nulls(0, _METRICS_CELL_TYPE)
_last_output_schema: tuple[pa.Schema, str, pa.Schema] | None = None


def with_metrics_column(batch: pa.RecordBatch, column: str = METRICS_COLUMN) -> pa.RecordBatch:
    """A data batch with a null metrics cell on every row."""
    global _null_cells, _last_output_schema
    rows = batch.num_rows
    cells = _null_cells
    if len(cells) < rows:
        cells = _null_cells = pa.nulls(max(rows, 2 * len(cells), 1024), _METRICS_CELL_TYPE)
    schema = batch.schema
    cached = _last_output_schema
    if cached is not None and cached[1] == column and cached[0].equals(schema):
        out_schema = cached[2]
    else:
        out_schema = output_schema(schema, column)
        _last_output_schema = (schema, column, out_schema)
    return pa.RecordBatch.from_arrays([*batch.columns, cells.slice(0, rows)], schema=out_schema)


def _zero(t: pa.DataType) -> object:
    """A value of type ``t`` for a column that may not be null (the metrics row's filler)."""
    if pa.types.is_struct(t):
        return {f.name: None if f.nullable else _zero(f.type) for f in t}
    if pa.types.is_fixed_size_list(t):
        return [_zero(t.value_type)] * t.list_size
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        return []
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return ""
    if pa.types.is_fixed_size_binary(t):
        return bytes(t.byte_width)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return b""
    if pa.types.is_boolean(t):
        return False
    if pa.types.is_decimal(t):
        import decimal

        return decimal.Decimal(0)
    if pa.types.is_floating(t):
        return 0.0
    return 0  # integers, dates, times, timestamps, durations


def metrics_batch(schema: pa.Schema, rows: Iterable[MetricRow], column: str = METRICS_COLUMN) -> pa.RecordBatch:
    """One row whose data columns are null (or zero where the column may not be null) and whose
    metrics cell holds ``rows``; the row is filtered out before the user sees the data."""
    arrays = [pa.nulls(1, f.type) if f.nullable else pa.array([_zero(f.type)], f.type) for f in schema]
    arrays.append(rows_to_arrow([list(rows)]))
    return pa.RecordBatch.from_arrays(arrays, schema=output_schema(schema, column))


class MetricsReport:
    """How a consumer task hands its metric rows to the driver (pickled into the tasks).

    ``accumulator`` is a PySpark accumulator of :class:`_ReportsParam`; None sends them in band, in the
    hidden column ``column`` (see :meth:`beside`).
    """

    __slots__ = ("accumulator", "column")

    def __init__(self, accumulator: Any = None, column: str = METRICS_COLUMN) -> None:
        self.accumulator = accumulator
        self.column = column

    def beside(self, columns: Iterable[str]) -> MetricsReport:
        """This report, with a hidden metrics column named unlike any of ``columns`` (the input's) if in band."""
        if self.accumulator is not None:
            return self
        column = unused_name(METRICS_COLUMN, columns)
        return self if column == self.column else MetricsReport(None, column)

    @property
    def in_band(self) -> bool:
        """True if the metrics travel as a hidden column of the output (see the module documentation)."""
        return self.accumulator is None

    def output_type(self, df: DataFrame, plan: ExchangePlan | None = None) -> StructType:
        """Spark type of the consumer stage's output: ``df``'s (or, with operators chained into ``plan``'s
        tasks, the last one's: after the exchange, else before it), plus the metrics column if in band."""
        chained = (plan.after or plan.before) if plan is not None else ()
        schema = chained[-1].spark_schema if chained else df.schema
        return output_struct_type(schema, self.column) if self.accumulator is None else schema

    def data(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """A data batch as the consumer stage yields it."""
        return with_metrics_column(batch, self.column) if self.accumulator is None else batch

    def last(self, schema: pa.Schema, rows: Iterable[MetricRow]) -> list[pa.RecordBatch]:
        """What a consumer task yields after its data: the metrics row if in band, else nothing (the rows
        go into the accumulator, tagged with the task's stage, partition and attempt)."""
        if self.accumulator is None:
            return [metrics_batch(schema, rows, self.column)]
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is None:
            raise CreditShuffleError("metrics through an accumulator can only be reported from a Spark task")
        fields = [tuple(getattr(r, f) for f in METRIC_ROW_FIELDS) for r in rows]
        self.accumulator.add([(ctx.stageId(), ctx.partitionId(), ctx.taskAttemptId(), fields)])
        return []


#: Metrics travel as a hidden column (the in-process harnesses, Spark Connect).
IN_BAND = MetricsReport()


def metrics_report(spark: Any) -> MetricsReport:
    """The report for a plan on ``spark``: an accumulator on a classic session, in band on Spark Connect."""
    from .session import spark_context

    sc = spark_context(spark)
    if sc is None:  # Spark Connect has no SparkContext, hence no accumulators
        return IN_BAND
    return MetricsReport(sc.accumulator([], _ReportsParam()))


try:
    from pyspark.accumulators import AccumulatorParam as _AccumulatorParam
except ImportError:  # pyspark is an optional dependency of the package; the param is only used with it
    _AccumulatorParam = object  # type: ignore[assignment,misc]  # a stand-in base without pyspark


class _ReportsParam(_AccumulatorParam):
    """A list of (stage id, partition, task attempt id, metric rows) reports, merged by concatenation."""

    def zero(self, value: list) -> list:
        return []

    def addInPlace(self, value1: list, value2: list) -> list:  # PySpark names it
        value1.extend(value2)
        return value1


_NO_ACTION_YET = "no metrics yet: no action has run the exchange's DataFrame (count(), a write...) so far"


class CollectedMetrics:
    """The metric rows consumer tasks reported, on the driver (after an action)."""

    def __init__(self, report: MetricsReport, observation: Observation | None = None) -> None:
        self._report = report
        self._observation = observation

    def rows(self) -> list[MetricRow]:
        """Every row the first action that ran the exchange reported.

        Raises :class:`CreditShuffleError` if no action has run the exchange yet, on classic sessions and
        Spark Connect alike (an in-band observation on a classic session, which only the in-process
        harnesses use, waits for the action instead).
        """
        if self._observation is not None:
            try:
                observed = self._observation.get
            except Exception as exc:  # Spark Connect: NO_OBSERVE_BEFORE_GET until an action ran
                raise CreditShuffleError(_NO_ACTION_YET) from exc
            if not observed:
                raise CreditShuffleError(_NO_ACTION_YET)
            cells = observed.get("metrics") or []
            return [MetricRow(**{f: r[f] for f in METRIC_ROW_FIELDS}) for cell in cells for r in cell or []]
        reports = self._report.accumulator.value
        if not reports:
            raise CreditShuffleError(_NO_ACTION_YET)
        best: dict[int, tuple[int, int, list]] = {}  # partition -> (stage id, task attempt id, rows)
        for stage, partition, attempt, rows in reports:
            current = best.get(partition)
            if current is None or stage < current[0] or (stage == current[0] and attempt > current[1]):
                best[partition] = (stage, attempt, rows)
        return [MetricRow(*row) for _, (_, _, rows) in sorted(best.items()) for row in rows]


class NoMetrics(CollectedMetrics):
    """The metrics of an exchange whose input has no partitions: no subtask ran, there is nothing to report."""

    def __init__(self) -> None:
        super().__init__(IN_BAND)

    def rows(self) -> list[MetricRow]:
        return []


def finish_plan(plan: ExchangePlan, consumed: DataFrame, report: MetricsReport) -> tuple[DataFrame, CollectedMetrics]:
    """The user-facing DataFrame of ``consumed`` and where its metrics will be: in band, the metrics
    cells are observed and their row dropped; through an accumulator, ``consumed`` is already it."""
    if not report.in_band:
        return consumed, CollectedMetrics(report)
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    observation = Observation(plan.name)
    hidden = F.col(f"`{report.column}`")
    observed = consumed.observe(observation, F.collect_list(hidden).alias("metrics"))
    out = observed.where(hidden.isNull()).drop(hidden)
    return out, CollectedMetrics(report, observation)
