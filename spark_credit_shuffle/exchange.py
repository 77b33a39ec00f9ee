"""The public exchange: a DataFrame's rows moved to the consumer subtasks Flink would pick.

``exchange(df, partitioner)`` plans the exchange on the driver (settings, parallelism, buffer
pools: every mistake surfaces here, before any Spark job) and returns an :class:`Exchange` whose
``df`` is lazy: partition *i* of ``ex.df`` holds exactly the rows consumer subtask *i* received,
with the input's schema. After an action on ``ex.df`` ran, ``ex.metrics()`` returns the
network metrics of that run as a DataFrame (schema in :mod:`spark_credit_shuffle.metrics`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import re
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from .arrow_schema import arrow_schema
from .config import NetworkConfig, check_operator_parallelism
from .diagnosis import (
    SUMMARY_DDL,
    SUMMARY_VIEW_DDL,
    Diagnosis,
    SubtaskSummary,
    cpu_use,
    diagnose,
    summarize,
    summary_view,
)
from .engine.checkpoints import CHECKPOINTS_DDL, CheckpointRecord
from .errors import ConfigError, CreditShuffleError
from .input_checks import check_dataframe, check_partitioner, plain_names, renamed_keys, resolve_key_columns, short
from .metrics import METRICS_DDL, TIMELINE_DDL, MetricRow, row_values
from .partitioners import Partitioner
from .registry import Registry
from .runtime.chain import ChainedOperator, as_chain
from .runtime.exchange_plan import ExchangePlan, Injection
from .runtime.monitor import MonitorAddress
from .runtime.security import use_tls
from .runtime.spark_plans import num_partitions
from .runtime.worker_python import check_worker_python

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import DataFrame

    from .runtime.metrics_report import CollectedMetrics

__all__ = [
    "MODES",
    "ChainedOperator",
    "Exchange",
    "ExchangePlan",
    "Injection",
    "exchange",
    "exchange_of",
    "exchange_rdd",
    "exchanged",
    "exchanges_of",
    "install_dataframe_method",
    "map_in_arrow",
    "map_in_pandas",
]

log = logging.getLogger("spark_credit_shuffle")

MODES = ("blocking", "pipelined")
_ids = itertools.count(1)
#: The exchanges planned in this process (:func:`exchanges_of` finds them from a DataFrame's plan).
_registry: Registry[Exchange] = Registry()


#: Builds the exchange's output again with other operators chained after it: (DataFrame, its metrics).
Rebuild = Callable[[tuple[ChainedOperator, ...]], "tuple[DataFrame, CollectedMetrics]"]


def map_in_pandas(fn: Callable[[Iterator[Any]], Any], schema: Any) -> ChainedOperator:
    """An operator to chain into an exchange's tasks, shaped as PySpark's ``mapInPandas``: ``fn`` takes an
    iterator of pandas DataFrames and yields pandas DataFrames of ``schema`` (a DDL string or StructType).
    Pass it as ``exchange(..., after=...)`` (run in the consumer tasks, on the rows received) or
    ``before=...`` (run in the producer tasks, on the input); see :mod:`.runtime.chain`."""
    return ChainedOperator(fn, schema, "pandas")


def map_in_arrow(fn: Callable[[Iterator[pa.RecordBatch]], Any], schema: Any) -> ChainedOperator:
    """:func:`map_in_pandas` for a function of Arrow record batches (PySpark's ``mapInArrow`` shape)."""
    return ChainedOperator(fn, schema, "arrow")


class Exchange:
    """One planned exchange: its output DataFrame and, after an action, its metrics."""

    def __init__(
        self, plan: ExchangePlan, df: DataFrame, collected: CollectedMetrics, rebuild: Rebuild | None = None
    ) -> None:
        self.plan = plan
        self.df = df
        #: The metrics of ``df`` and of every output built with chained operators (:meth:`map_in_pandas`).
        self._collected = [collected]
        self._rebuild = rebuild
        _registry.add(plan.name, self)

    @property
    def rdd(self) -> RDD[Any]:
        """``df`` as an RDD of Rows, with the same partitions (partition *i* = consumer subtask *i*)."""
        return self.df.rdd

    @property
    def name(self) -> str:
        return self.plan.name

    def metric_rows(self) -> list[MetricRow]:
        """The metrics of the first action that ran ``df`` (of each consumer subtask), as plain rows.

        Call it after an action (``count()``, ``write``...); before one it raises
        :class:`CreditShuffleError`, on classic sessions and Spark Connect alike.
        """
        return [r for r in self._all_metric_rows() if r.time_ms is None]

    def _all_metric_rows(self) -> list[MetricRow]:
        failure: Exception | None = None
        for collected in self._collected:  # the outputs share one accumulator on a classic session
            try:
                rows = collected.rows()
            except CreditShuffleError as exc:  # not run (yet)
                failure = failure or exc
                continue
            if rows:
                return rows
        if failure is not None:
            raise failure
        return []

    def map_in_pandas(self, fn: Callable[[Iterator[Any]], Any], schema: Any) -> DataFrame:
        """The exchange's output with ``fn`` chained into its consumer tasks, as Flink chains an operator after
        a network exchange: ``fn`` (PySpark's ``mapInPandas`` shape: an iterator of pandas DataFrames in,
        DataFrames of ``schema`` out) runs in consumer subtask *i*'s task on the rows it receives, so its time
        is the consumer's busy time and a slow ``fn`` back-pressures the producers through credits. Partition
        *i* of the result is ``fn``'s output on what consumer *i* received. Running it fills this exchange's
        metrics, summary and diagnosis (:func:`exchange_of` finds it from the result too). Unlike
        ``ex.df.mapInPandas(fn, schema)``, whose ``fn`` runs behind Spark's buffers in another Python worker
        (see docs/diagnosis.md, "What Spark holds between two Python steps")."""
        return self.chain(map_in_pandas(fn, schema))

    def map_in_arrow(self, fn: Callable[[Iterator[pa.RecordBatch]], Any], schema: Any) -> DataFrame:
        """:meth:`map_in_pandas` for a function of Arrow record batches (PySpark's ``mapInArrow`` shape)."""
        return self.chain(map_in_arrow(fn, schema))

    # PySpark's spelling, on the exchange (never on PySpark's DataFrame)
    mapInPandas = map_in_pandas
    mapInArrow = map_in_arrow

    def chain(self, *operators: ChainedOperator) -> DataFrame:
        """The exchange's output with ``operators`` (:func:`map_in_pandas`, :func:`map_in_arrow`) chained into
        its consumer tasks after any chained already, in order (see :meth:`map_in_pandas`)."""
        chained = as_chain(list(operators), "operators")
        if not chained:
            raise ConfigError(
                "operators", "()", "at least one operator made by map_in_pandas or map_in_arrow", kind="argument"
            )
        if self._rebuild is None:
            raise ConfigError(
                "operators",
                ", ".join(op.name for op in chained),
                "an exchange whose input has partitions (this one moves nothing, so nothing runs its consumers)",
                kind="argument",
            )
        after = self.plan.after + resolve_chain(self.df.sparkSession, chained)
        out, collected = self._rebuild(after)
        self._collected.append(collected)
        if self.plan.monitor is not None:  # the web view, if it shows this exchange, names them from now on
            from .web import attach

            attach(self, tuple(op.name for op in after))
        return out

    def timeline_rows(self) -> list[MetricRow]:
        """The timeline samples of the first action that ran ``df`` (``stat == "sample"``), by time."""
        return sorted((r for r in self._all_metric_rows() if r.time_ms is not None), key=lambda r: r.time_ms or 0.0)

    def timeline(self) -> DataFrame:
        """Pool usage, backlog, credits and backpressure per subtask over time, sampled every
        ``metrics_sample_interval_ms``: the metrics columns plus ``time_ms`` (see
        :mod:`spark_credit_shuffle.metrics`). Available after an action, like :meth:`metrics`."""
        spark = self.df.sparkSession
        head = (self.plan.name, self.plan.mode)
        data = [head + row_values(r) for r in self.timeline_rows()]
        return spark.createDataFrame(data, TIMELINE_DDL)

    def metrics(self) -> DataFrame:
        """The metrics as a DataFrame (see :mod:`spark_credit_shuffle.metrics` for the schema)."""
        spark = self.df.sparkSession
        head = (self.plan.name, self.plan.mode)
        data = [head + row_values(r)[:-1] for r in self.metric_rows()]  # METRICS_DDL: all fields but time_ms
        return spark.createDataFrame(data, METRICS_DDL)

    def summary_rows(self) -> list[SubtaskSummary]:
        """One :class:`~spark_credit_shuffle.diagnosis.SubtaskSummary` per producer and consumer subtask of
        the first action that ran ``df`` (see :meth:`summary`)."""
        return summarize(self.metric_rows())

    def summary(self, full: bool = False) -> DataFrame:
        """One row per subtask, to read: ``side``, ``subtask``, ``records`` and ``buffers`` (out for a producer,
        in for a consumer), ``MB`` (its bytes in 10^6 bytes, 2 decimals), ``records_per_s``, ``busy_ms_per_s``,
        ``idle_ms_per_s`` and ``back_pressured_ms_per_s`` (whole numbers), Flink's ``back_pressure`` status
        (``OK`` up to 10% of the time back-pressured, ``LOW`` up to 50%, ``HIGH`` above) and ``pool_usage_max``
        (2 decimals): narrow enough for ``show()`` in a terminal.

        ``full=True``: every figure unrounded, for code, in the columns of
        :data:`~spark_credit_shuffle.diagnosis.SUMMARY_DDL` (``exchange``, ``mode``, the fields of
        :class:`~spark_credit_shuffle.diagnosis.SubtaskSummary`: ``executor``, ``bytes``, ``records_per_second``,
        ``busy_ms``, ``*_ms_per_second``, ``pool_usage_mean``, ...). Counts are integers in both. Available after
        an action, like :meth:`metrics`."""
        rows = self.summary_rows()
        if full:
            data = [(self.plan.name, self.plan.mode, *dataclasses.astuple(r)) for r in rows]
            return self.df.sparkSession.createDataFrame(data, SUMMARY_DDL)
        return self.df.sparkSession.createDataFrame([summary_view(r) for r in rows], SUMMARY_VIEW_DDL)

    def diagnose(self) -> Diagnosis:
        """Where backpressure starts (the busy consumer subtask the back-pressured producers send to), told
        apart from data skew and from an idle exchange; ``str()`` of it is a sentence for people, its fields
        a result for code (see :class:`~spark_credit_shuffle.diagnosis.Diagnosis`)."""
        rows = self.metric_rows()
        return diagnose(summarize(rows), cpu_use(rows), self.plan.mode)

    def checkpoint_records(self) -> list[CheckpointRecord]:
        """The checkpoints each consumer subtask completed (``checkpoint_interval_ms`` > 0), one
        :class:`~spark_credit_shuffle.engine.checkpoints.CheckpointRecord` per checkpoint and subtask, by
        subtask and checkpoint id. Available after an action."""
        return CheckpointRecord.from_rows(self.metric_rows())

    def checkpoints(self) -> DataFrame:
        """Completed checkpoints per consumer subtask: ``subtask``, ``checkpoint_id``, ``alignment`` (aligned
        or unaligned; an aligned-with-timeout checkpoint that timed out is unaligned), ``timed_out``,
        ``alignment_time_ms`` (Flink's ``checkpointAlignmentTime``: first to last barrier on the subtask),
        ``start_delay_ms`` (``checkpointStartDelayNanos``: trigger to first barrier), ``persisted_bytes``
        (channel state captured, unaligned) and ``end_ms`` (wall clock). Available after an action."""
        spark = self.df.sparkSession
        return spark.createDataFrame([dataclasses.astuple(c) for c in self.checkpoint_records()], CHECKPOINTS_DDL)

    @contextlib.contextmanager
    def labelled(self) -> Iterator[Exchange]:
        """Label the Spark jobs run inside the ``with`` block with this exchange (Spark UI, logs).

        The stages' Python functions are named after the exchange as well
        (``credit_shuffle_produce_<name>``), so the SQL tab shows them whatever the label.
        On Spark Connect, where the job description cannot be set from a client, the jobs carry the
        tag ``credit_shuffle_<name>`` instead (``spark.addTag``: the Spark UI shows it with each job, and
        ``spark.interruptTag`` cancels them).
        """
        from .runtime.session import spark_context

        spark = self.df.sparkSession
        sc = spark_context(spark)
        if sc is None:
            tag = re.sub(r"[^A-Za-z0-9_]", "_", f"credit_shuffle_{self.plan.name}")
            spark.addTag(tag)
            try:
                yield self
            finally:
                spark.removeTag(tag)
            return
        previous = sc.getLocalProperty("spark.job.description")
        sc.setJobDescription(self.plan.describe())
        try:
            yield self
        finally:
            sc.setLocalProperty("spark.job.description", previous)  # type: ignore[arg-type]  # None unsets it

    def __repr__(self) -> str:
        return f"Exchange({self.plan.describe()})"


def exchanges_of(df: DataFrame) -> list[Exchange]:
    """The exchanges whose output ``df`` is or is built on (``df.transform(exchanged(...)).where(...)``), from
    its physical plan, outermost first: the way to an exchange's metrics, summary and diagnosis from a
    DataFrame alone, on classic sessions and Spark Connect. Exchanges planned in another process, or no
    longer held by anything, are not found."""
    from .runtime.spark_plans import physical_plan

    return _registry.in_plan(physical_plan(check_dataframe(df)))


def exchange_of(df: DataFrame) -> Exchange:
    """The one exchange ``df`` is the output of, or is built on (see :func:`exchanges_of`);
    :class:`ConfigError` if there is none, or more than one (then pick from :func:`exchanges_of`)."""
    found = exchanges_of(df)
    if len(found) != 1:
        what = "no exchange" if not found else f"{len(found)} exchanges ({', '.join(e.name for e in found)})"
        raise ConfigError(
            "df",
            short(df),
            "a DataFrame built on exactly one exchange of this process",
            f"its plan holds {what}",
            kind="argument",
        )
    return found[0]


def install_dataframe_method(name: str = "creditShuffle") -> None:
    """Add the exchange to PySpark's DataFrame (classic and Spark Connect alike) as ``df.<name>(partitioner,
    parallelism, mode, **kwargs)``, returning the exchanged DataFrame (``exchange(...).df``); its metrics are
    one :func:`exchange_of` away. Only this call changes PySpark's class (importing the package does not), so
    a program that never asks for the method runs on an untouched ``DataFrame``; calling it again under the same
    name is allowed. A DataFrame method of that name already there (Spark's own, or another library's) is left as
    it is and :class:`ConfigError` says so."""
    from pyspark.sql import DataFrame

    existing = getattr(DataFrame, name, None)
    if existing is not None and getattr(existing, "_credit_shuffle", False) is not True:
        raise ConfigError(
            "name", name, "a name that DataFrame does not have yet", "it has that attribute already", kind="argument"
        )

    def method(
        self: DataFrame, partitioner: Partitioner, parallelism: int | None = None, mode: str = "blocking", **kwargs: Any
    ) -> DataFrame:
        return exchange(self, partitioner, parallelism, mode, **kwargs).df

    method.__name__ = name
    method.__doc__ = (
        "The DataFrame after a credit-based exchange: ``spark_credit_shuffle.exchange(self, ...).df`` (see "
        "there); ``spark_credit_shuffle.exchange_of(result)`` gives its metrics, summary and diagnosis."
    )
    method._credit_shuffle = True  # type: ignore[attr-defined]  # marks the method as this package's
    setattr(DataFrame, name, method)


def exchange(
    df: DataFrame,
    partitioner: Partitioner,
    parallelism: int | None = None,
    mode: str = "blocking",
    config: NetworkConfig | None = None,
    *,
    num_producers: int | None = None,
    injection: Injection | None = None,
    retryable: bool | None = None,
    monitor: bool | str | Callable[[list[MetricRow]], Any] | None = None,
    before: ChainedOperator | list[ChainedOperator] | tuple[ChainedOperator, ...] | None = None,
    after: ChainedOperator | list[ChainedOperator] | tuple[ChainedOperator, ...] | None = None,
    **settings: Any,
) -> Exchange:
    """Move ``df``'s rows through Flink's network stack to ``parallelism`` consumer subtasks.

    The input's partitions are the producer subtasks (``num_producers`` repartitions it first,
    round robin, when given). ``parallelism`` defaults to the number of producers. ``config``
    defaults to the session's ``spark.creditShuffle.*`` settings; keyword ``settings`` override
    single values (``buffer_timeout_ms=10``). Everything the arguments and ``df``'s schema reveal is
    checked before any job runs: :class:`ConfigError` (a setting, or an argument of the wrong kind, such as
    a pandas DataFrame or a dict as ``config``), :class:`PartitionerError` (a key column that is missing, out
    of range or nested), :class:`UnsupportedKeyTypeError`, :class:`UnsupportedColumnTypeError` (a column
    ``mapInArrow`` cannot carry) or :class:`InsufficientNetworkBuffersError`. Key columns are top-level
    columns by name, position or plain column reference (``F.col("k")``); every type ``mapInArrow`` carries
    goes through unchanged, timestamps in the session time zone.

    ``retryable`` (pipelined mode; default True): the barrier stage's output is placed on its partitions
    by an identity shuffle (of one nested row per output batch, unnested in the JVM), so that Spark can
    re-run the whole stage after a task failure (output exact) and every operation works downstream
    (``show``, ``take``, ``limit``). ``retryable=False`` streams the
    consumers' rows straight into what follows: faster (no shuffle of the output), but a failed task
    fails the job (Spark never retries a barrier result stage) and only actions over every partition run
    (``write``, ``count``, ``collect``, ``foreachPartition``). Blocking mode's output always comes from
    a Spark shuffle and is always retryable; there the keyword changes nothing.

    ``monitor`` (default: the ``monitor`` setting, ``spark.creditShuffle.monitor``): while an action runs the
    exchange, its tasks send their timeline samples to the driver; ``True`` prints one line per exchange every
    few seconds to stderr (rows moved, back-pressured producers, the slowest consumer, pool usage), a callable
    gets the samples (lists of the metric rows :meth:`Exchange.timeline_rows` returns) as they arrive, on a
    thread of its own (``spark_credit_shuffle.plot.LiveTimeline`` draws them in a notebook), ``"web"`` shows
    them on a page the driver serves, with Prometheus metrics beside it (its URL, with a token, is printed; see
    :mod:`.web`). Classic sessions only: on Spark Connect the exchange says so once and runs without (see
    :mod:`.runtime.monitor`).

    ``after`` (one operator of :func:`map_in_pandas` / :func:`map_in_arrow`, or a list of them): chained into
    the consumer tasks, on the rows each consumer receives, as Flink chains an operator after an exchange: its
    time is the consumer's busy time, and while it works the consumer returns no credit, so a slow operator
    back-pressures the producers. The output is then the last operator's (``Exchange.map_in_pandas`` chains
    after an exchange already built). ``before``: chained into the producer tasks, on the input; the
    producers partition and write its output (key columns name its columns). See :mod:`.runtime.chain`.
    """
    df = check_dataframe(df)
    before_ops, after_ops = as_chain(before, "before"), as_chain(after, "after")
    if not isinstance(mode, str) or mode not in MODES:
        raise ConfigError("mode", mode, " or ".join(repr(m) for m in MODES), kind="argument", choices=MODES)
    if retryable is not None and not isinstance(retryable, bool):
        raise ConfigError("retryable", retryable, "True, False or None (the default: True)", kind="argument")
    if monitor is not None and not isinstance(monitor, bool) and not callable(monitor) and monitor != "web":
        raise ConfigError(
            "monitor",
            short(monitor),
            "True, False, 'web', a function of the samples, or None (the setting)",
            kind="argument",
        )
    partitioner = check_partitioner(partitioner)
    if config is not None and not isinstance(config, NetworkConfig):
        raise ConfigError(
            "config",
            short(config),
            "a NetworkConfig or None (the session's spark.creditShuffle.* settings)",
            "single settings go as keyword arguments: exchange(..., buffer_timeout_ms=10), or "
            "config=NetworkConfig(**settings)",
            kind="argument",
        )
    if injection is not None and not isinstance(injection, Injection):
        raise ConfigError("injection", short(injection), "an Injection or None", kind="argument")
    if parallelism is not None:
        parallelism = check_operator_parallelism(parallelism, "parallelism")
    if num_producers is not None:
        num_producers = check_operator_parallelism(num_producers, "num_producers")
    spark = df.sparkSession
    before_ops, after_ops = resolve_chain(spark, before_ops), resolve_chain(spark, after_ops)
    written = _schema_frame(spark, before_ops[-1]) if before_ops else df  # the rows the producers write
    partitioner = resolve_key_columns(written, partitioner)
    names = df.columns
    plain = plain_names(names)
    if plain != names:  # PySpark hands mapInArrow its input as df[name], which reads "a.b" as a nested field
        df = df.toDF(*plain)
        if not before_ops:
            partitioner = renamed_keys(partitioner, dict(zip(names, plain)))
    schema = before_ops[-1].arrow_schema if before_ops else arrow_schema(df)
    assert schema is not None
    if config is None:
        config = NetworkConfig.from_spark(spark, **settings)
    elif settings:
        config = config.replace(**settings)
    check_worker_python(spark)  # local masters: the Python the workers start imports pyarrow and this package
    if mode == "pipelined":
        from .runtime.pipelined import check_cluster

        check_cluster(spark)
    if num_producers is not None:
        df = df.repartition(num_producers)
    if parallelism is not None:  # checked before the producer count, which is a Spark job on Spark Connect
        _max_parallelism(partitioner, config, parallelism)
    producers = num_producers or num_partitions(df)
    if producers:
        consumers = check_operator_parallelism(producers if parallelism is None else parallelism, "parallelism")
        max_parallelism = _max_parallelism(partitioner, config, consumers)
        partitioner.validate(producers, consumers)
    else:  # nothing to move: no producer subtask, `parallelism` consumers (0 if not given) that receive nothing
        consumers = parallelism or 0
        max_parallelism = _max_parallelism(partitioner, config, max(consumers, 1))
    name = f"{partitioner.name.lower()}-{mode}-{next(_ids)}"
    wanted = config.monitor if monitor is None else monitor
    tls = use_tls(config, spark, mode)  # a ConfigError here if TLS is asked for and impossible
    plan = ExchangePlan(
        name=name,
        mode=mode,
        partitioner=partitioner,
        num_producers=producers,
        num_consumers=consumers,
        max_parallelism=max_parallelism,
        config=config,
        schema=schema,
        injection=injection,
        retryable=retryable,
        tls=tls,
        before=before_ops,
        after=after_ops,
    )
    rebuild: Rebuild | None = None
    if producers:
        from .runtime.planner_on_spark import check_fits

        check_fits(plan, spark)
        log.info("%s; %s", plan.describe(), config)
        if mode == "blocking":
            from .runtime.blocking import build
        else:
            from .runtime.pipelined import build, check_slots

            check_slots(plan, spark, input_partitions=None if num_producers else producers)
        if wanted == "web":  # the driver's page (spark_credit_shuffle.web), once every check passed
            from .web import register

            plan = dataclasses.replace(plan, monitor=register(spark, plan))
        elif wanted is not False and not isinstance(wanted, str):  # registered once every check passed
            plan = dataclasses.replace(plan, monitor=_live_monitor(spark, name, wanted, producers, consumers))
        from .runtime.metrics_report import metrics_report

        report = metrics_report(spark)  # one for every output of the exchange (an accumulator on classic Spark)
        planned, source = plan, df

        def rebuild(chained: tuple[ChainedOperator, ...]) -> tuple[DataFrame, CollectedMetrics]:
            return build(dataclasses.replace(planned, after=chained), source, report=report)

        out, collected = build(plan, df, report=report)
    else:  # an empty df with the input's schema, no metric rows; no task runs
        from .runtime.metrics_report import NoMetrics

        log.info("%s: the input has no partitions, nothing to move", plan.describe())
        out = df.repartition(consumers) if consumers else df  # consumer subtask i is partition i, as always
        collected = NoMetrics()
    if plain != names and not before_ops and not after_ops:
        out = out.toDF(*names)
    if not producers and after_ops:  # no consumer task runs: the output has the chained operators' schema
        out = _schema_frame(spark, after_ops[-1])
    ex = Exchange(plan, out, collected, rebuild)
    if wanted == "web" and plan.monitor is not None:  # the page reads the run's metrics from it once it ended
        from .web import attach

        attach(ex)
    return ex


def resolve_chain(spark: Any, operators: tuple[ChainedOperator, ...]) -> tuple[ChainedOperator, ...]:
    """``operators`` with their schemas resolved on ``spark`` (Spark and Arrow types), before any job: a schema
    Spark cannot parse, or a type ``mapInArrow`` cannot carry, is a :class:`ConfigError` here."""
    resolved = []
    for op in operators:
        if op.arrow_schema is not None:
            resolved.append(op)
            continue
        try:
            frame = spark.createDataFrame([], op.schema)
            spark_schema = frame.schema
        except Exception as exc:
            raise ConfigError(
                "schema",
                short(op.schema),
                "a Spark DDL string or StructType",
                f"of operator {op.name}: {exc}",
                kind="argument",
            ) from None
        resolved.append(op.resolved(spark_schema, arrow_schema(frame)))
    return tuple(resolved)


def _schema_frame(spark: Any, op: ChainedOperator) -> DataFrame:
    """An empty DataFrame of ``op``'s output schema: what key columns are resolved against."""
    return spark.createDataFrame([], op.spark_schema)


_said_no_monitor: list[bool] = []


def _live_monitor(
    spark: Any,
    name: str,
    wanted: bool | Callable[[list[MetricRow]], Any],
    producers: int | None = None,
    consumers: int | None = None,
) -> MonitorAddress | None:
    """Where the tasks of exchange ``name`` send their samples (the driver's monitor service), or None on
    Spark Connect (said once per process) or when the service cannot start."""
    from .runtime.monitor import Monitor, driver_monitor
    from .runtime.session import is_connect

    if is_connect(spark):
        if not _said_no_monitor:
            _said_no_monitor.append(True)
            log.warning(
                "live monitor: not on Spark Connect (the executors cannot reach this client); the metrics come "
                "after the action, through metrics(), summary() and timeline()"
            )
        return None
    callback = None if isinstance(wanted, bool) else wanted
    sink = Monitor(
        name,
        callback=callback,
        print_to=sys.stderr if callback is None else None,
        producers=producers,
        consumers=consumers,
    )
    try:
        service = driver_monitor(spark.conf.get("spark.driver.host", None) or "127.0.0.1")
    except OSError as exc:
        log.warning("live monitor: the driver's monitor service cannot start (%s); running without", exc)
        return None
    return service.register(name, sink)


def _max_parallelism(partitioner: Partitioner, config: NetworkConfig, consumers: int) -> int:
    """The exchange's max parallelism for ``consumers``, or the ConfigError of a parallelism above it."""
    max_parallelism = config.resolve_max_parallelism(consumers)
    own = getattr(partitioner, "resolve_max_parallelism", None)
    if own is not None:  # key_by(..., max_parallelism=P) wins over the config's
        max_parallelism = own(consumers, config.max_parallelism)
    return max_parallelism


def exchange_rdd(
    rdd: RDD[Any],
    partitioner: Partitioner,
    parallelism: int | None = None,
    mode: str = "blocking",
    *,
    schema: Any = None,
    **kwargs: Any,
) -> Exchange:
    """The exchange for an RDD of Rows, tuples or dicts: ``exchange_rdd(rdd, key_by("k")).rdd``.

    The RDD becomes a DataFrame with ``schema`` (inferred when None), partition for partition, so the
    RDD's partitions are the producer subtasks; partition *i* of the result's ``rdd`` holds what
    consumer subtask *i* received, as Rows.
    """
    from pyspark import RDD
    from pyspark.sql import SparkSession

    if not isinstance(rdd, RDD):
        raise ConfigError("rdd", short(rdd), "a pyspark RDD (for a DataFrame use exchange)", kind="argument")
    check_partitioner(partitioner)
    spark = SparkSession.builder.getOrCreate()
    df = spark.createDataFrame(rdd, schema)
    return exchange(df, partitioner, parallelism, mode, **kwargs)


def exchanged(
    partitioner: Partitioner, parallelism: int | None = None, mode: str = "blocking", **kwargs: Any
) -> Callable[[DataFrame], DataFrame]:
    """``df.transform(exchanged(key_by("k"), 4))``: the exchange as a DataFrame -> DataFrame step."""

    def step(df: DataFrame) -> DataFrame:
        return exchange(df, partitioner, parallelism, mode, **kwargs).df

    return step
