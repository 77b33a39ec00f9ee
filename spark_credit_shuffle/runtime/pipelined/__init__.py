"""The pipelined exchange (Flink's PIPELINED_BOUNDED result partitions) as one Spark barrier stage.

Every subtask runs at once: task *i* of a ``mapInArrow(..., barrier=True)`` stage is producer subtask *i*
(its input partition through the RecordWriter into a :class:`PipelinedResultPartition`) and consumer
subtask *i* (a :class:`SingleInputGate` over all its producers) at the same time. Buffers stream from
producers to consumers as soon as they are handed on (full, buffer timeout, event), under credit-based
flow control, with real backpressure: a producer whose buffer pool is exhausted stops reading its input
until its consumers return credit (or, on local channels, recycle its buffers), and the time it waits is
measured.

**Wiring.** Each task listens on its own address (the executor's host as Spark reports it; 127.0.0.1 in
local mode) and publishes ``host:port`` once: through the driver's address service on a classic session
(:mod:`~spark_credit_shuffle.runtime.pipelined.rendezvous`: milliseconds), or with ONE ``allGather`` (Spark Connect,
or ``TaskOptions(address_exchange="allgather")``; each barrier call costs about a second, during which no
consumer reads); after that tasks talk only over their own sockets. A consumer opens one TCP connection
per remote producer task, carrying every channel between the two (framed with the protocol codec,
authenticated by a random per-exchange secret generated on the driver, which a challenge and response
proves without sending it; with ``plan.tls`` under mutual TLS pinned to a key pair made on the driver for
the exchange, see :mod:`~spark_credit_shuffle.runtime.security`). Every channel between two tasks
of one executor (``getTaskInfos()`` gives each task's executor address; in local mode all tasks share one)
is a local channel, as between two tasks of one Flink TaskManager: no credit and no exclusive buffers; a
task's own subpartition is read directly (no copy), a subpartition of another task of the executor (another
Python worker process) through that connection, with the producer's segment held in its pool until the
consumer recycled the buffer (:class:`~spark_credit_shuffle.protocol.client.ConnectionSubpartitionView`):
backpressure on a local channel is the producer's pool filling. ``local_channels="task"`` makes every
channel between tasks remote (credit-based) instead. Threads per task: one loop (:mod:`~.loop`, the
transport's I/O thread, :class:`~spark_credit_shuffle.transport.tcp.TcpTransport`) drives every socket, writes
the input batches (the RecordWriter), decodes what the gate delivers, hands whole output batches on and runs
the schedule (the output flusher, ``buffer_timeout_ms``; latency markers, debloating, checkpoint barriers,
samples); an input thread reads Spark's input (through the operators chained before the exchange) and hands
it over in whole batches; the Spark task thread runs the operators chained after the exchange
(:mod:`~.chain`) and yields to Spark (:mod:`~.handoff`: bounded hand-overs, whose waits the loop turns into
the halves' idle and back-pressured time). Only the loop touches the protocol, so no buffer crosses a thread.
What the loop does and when is decided by the task engine (:mod:`~spark_credit_shuffle.engine`, which reads
no clock); :mod:`~.task` (set-up, the threads), :mod:`~.loop` (the rounds), :mod:`~.wiring` (sockets,
connections, the end) and :mod:`~.in_threads` (tasks as threads of one process)
are the glue around it, and this module the Spark side.

**Placement.** The stage has max(S, T) tasks, and the cluster must be able to run them all at once
(:class:`InsufficientSlotsError` before launch otherwise; on a cluster it first waits for executors still
registering, as long as Spark's ``spark.scheduler.maxRegisteredResourcesWaitingTime``: Spark itself refuses a
barrier stage with more tasks than the slots registered). With S == T (the common case) the input's
partitions feed the stage directly. With S < T, or when the input's last stage holds an operator whose
partitions are not its input's (a ``union``, a ``coalesce``, a cartesian product: Spark refuses a barrier
stage over those, see :func:`~.spark_plans.barrier_refusal`), the input is first placed by an identity shuffle
(``repartitionById`` on the producer index, the input's partition): one extra shuffle of the input rows.
Spark runs no barrier stage under dynamic allocation: :class:`BarrierStageError` before launch.

**Output and retries.** A failure in one task fails the barrier stage. Spark never retries a failed
barrier *result* stage, and refuses jobs that run only some of a barrier stage's partitions (``show``,
``take``, ``limit``, the sampling of a skewed sort). So by default (``retryable=True``) the consumers'
output is placed on its partitions by an identity ``repartitionById``: the barrier stage then feeds a
shuffle, which Spark re-runs whole after a failure (output exact: every producer and consumer runs again),
and every DataFrame operation works downstream. That shuffle moves one nested row per output batch
(:mod:`~.nested_output`: an array per column, which ``posexplode`` turns back into rows in the JVM), about
two thirds of the cost of shuffling every row.
``retryable=False`` streams the consumers' rows straight into what follows (the fastest form, for
actions that run every partition: ``write``, ``collect``, ``count``, ``foreachPartition``); with S > T
the output is always placed on T partitions by that shuffle.

**Faults.** Every wait has a timeout and raises :class:`ExchangeTimeoutError` naming what it waited for
and from whom: connecting (``partition_request_timeout_ms``), data on a channel (a live producer sends a
latency marker on every channel at least every quarter of ``partition_request_timeout_ms``, so silence
means a stalled peer), a network buffer while back-pressured (``buffers_request_timeout_ms`` without a
single data buffer moving), and the end of the exchange. Connections must complete their handshake (TLS
when on, then the secret's challenge and response) within the authentication deadline
(``min(partition_request_timeout_ms, 2 s)`` from connecting); a wrong proof, a wrong certificate, plain
text to TLS, garbage, an oversized frame or silence closes that connection (logged once per cause) and
nothing else. At most four times the task's remote consumers (at least 32) may wait to authenticate; one more
closes the oldest of them, and a consumer writes its ``Hello`` with its connect, so a flood of silent
connections costs a bounded number of sockets and does not displace the consumers.

**Backpressure.** The loop hands each input batch to a resumable ``RecordWriter``, which takes a new buffer
only while the pool is available (Flink's ``isAvailable``, checked per buffer request) and otherwise stops
there; the loop serves its sockets (a buffer comes back) and resumes the batch, and takes no next input
meanwhile, so the input thread stops reading Spark's. A producer holds at most its pool size plus the
overdraft, and the time it waits is its back-pressured time. What a round makes sendable (data, credit) is
written by the same round: no buffer is handed between threads.

**Metrics** are the blocking mode's (same schema, Flink's time metrics per side included:
``accumulateBackPressuredTimeMs``, ``accumulateIdleTimeMs``, ``accumulateBusyTimeMs`` (stat ``total``),
``backPressuredTimeMsPerSecond``, ``idleTimeMsPerSecond``, ``busyTimeMsPerSecond``,
``softBackPressuredTimeMsPerSecond``, ``hardBackPressuredTimeMsPerSecond`` (stat ``mean``: averaged over the
side's life; the timeline has them over the last minute, as Flink's gauges), ``maxSoftBackPressureTimeMs``,
``maxHardBackPressureTimeMs`` (stat ``max``)). A producer is back-pressured while it waits for a buffer:
soft before it takes its next input batch, hard in the middle of one it could not write whole; it is idle
while it waits for its next input batch; a consumer is idle while its gate has nothing.
Producers also report ``outputQueueLength`` per channel (max, mean); consumers report ``latencyMs`` of the
latency markers they received (p50, p99, max, mean) and ``numLatencyMarkersIn``; each task reports its
resident memory ``taskRssBytes``, Arrow memory ``taskArrowAllocatedBytes`` and the network buffers it holds,
``usedMemorySegments`` (Flink's ``Status.Shuffle.Netty.UsedMemorySegments``, of each task's own pool here;
max, mean), sampled by the task's loop, and its CPU time (``taskCpuTimeMs``; ``inputThreadCpuTimeMs``,
``loopThreadCpuTimeMs``, ``outputThreadCpuTimeMs`` per thread, see :mod:`.loop`) next to its wall-clock time
``taskWallTimeMs``.
The producer half hands its rows to the consumer half of the same task, whose last output row carries both.

**Timeline.** Every ``metrics_sample_interval_ms`` the loop samples both sides of its task (pool
usage, backpressure, rates, and per channel backlog, queue length and credits; the list is in
:mod:`spark_credit_shuffle.metrics`), once more when a side ends; ``Exchange.timeline()`` returns them.

Latency markers travel as records, as Flink's: a marker chunk in the open buffer of one random channel,
behind its rows. They finish no buffer, so they measure the time a row waits in a partly filled buffer
(bounded by the buffer timeout) as well as queueing and transit.
"""

from __future__ import annotations

import hashlib
import logging
import secrets as _secrets
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ...config import parse_duration_ms
from ...errors import BarrierStageError, CreditShuffleError, InsufficientSlotsError, in_subtask, is_deterministic
from ...metrics import PRODUCER
from ...transport.tcp import resolve_host
from ...transport.tls import TlsIdentity
from ..executors import (
    available_slots,
    configured_executors,
    dynamic_allocation,
    executor_slots,
    registered_executors,
    wait_for_executors,
)
from ..metrics_report import IN_BAND, CollectedMetrics, MetricsReport, finish_plan, metrics_report
from ..placement import place_by, unused_name
from ..resources import freeze_worker_heap
from ..session import ansi_mode, is_connect, spark_context
from ..spark_plans import barrier_refusal
from .in_threads import _ThreadAllGather, run_in_threads
from .nested_output import columnar_layout, nest, nested_spark_type, unnest
from .task import PipelinedTask, TaskOptions

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from ..exchange_plan import ExchangePlan

__all__ = [
    "PipelinedTask",
    "TaskOptions",
    "available_slots",
    "await_executors",
    "build",
    "check_cluster",
    "check_slots",
    "registered_executors",
    "run_barrier_task",
    "run_in_threads",
]

log = logging.getLogger("spark_credit_shuffle")
#: Hidden column used by the identity placements around the barrier stage (or, if the input has a column of
#: that name, the first of ``_TAG_1``, ``_TAG_2``, ... that it has not).
_TAG = "__credit_shuffle_subtask"
#: The column of the nested rows the retryable form's placement shuffles (see :mod:`.nested_output`).
_ROWS = "__credit_shuffle_rows"
#: The least time a task waits for the other tasks' addresses (tasks of a stage may start seconds apart).
_MIN_ADDRESS_WAIT_S = 60.0
#: How long a task whose producer's connection closed without a cause (:attr:`TaskWiring.lost_producers`:
#: that producer's task failed before it could tell this one why) waits before it fails in turn. Spark
#: reports the failure of a barrier stage's first failed task; the producer's own failure, on its way to
#: the scheduler meanwhile, is that one, and this task is killed with the stage instead of racing it.
KNOCK_ON_GRACE_S = 1.0
#: Kept importable here: tests run tasks between threads with it.
_ = _ThreadAllGather


# -- the Spark side ------------------------------------------------------------------------------------


def check_cluster(spark: Any) -> None:
    """Raise :class:`BarrierStageError` if Spark would refuse any barrier stage on ``spark``'s cluster
    (dynamic allocation), naming both ways out; no job runs."""
    if dynamic_allocation(spark):
        raise BarrierStageError(
            "a pipelined exchange runs as one Spark barrier stage, and Spark runs no barrier stage while dynamic "
            "allocation is enabled (spark.dynamicAllocation.enabled=true): use mode='blocking' (it runs under "
            "dynamic allocation), or start the session with spark.dynamicAllocation.enabled=false and a fixed "
            "number of executors (spark.executor.instances)"
        )


def check_slots(plan: ExchangePlan, spark: Any, input_partitions: int | None = None) -> None:
    """Raise :class:`InsufficientSlotsError` if the cluster cannot run all max(S, T) tasks at once.

    ``input_partitions``: the input DataFrame's partition count when its partitions are the producers (no
    ``num_producers`` given): the message then names it and ``num_producers=`` as the usual way out."""
    needed = max(plan.num_producers, plan.num_consumers)
    per = executor_slots(spark)
    configured = configured_executors(spark)  # what the session is configured with: never more, perhaps not yet all
    registered = registered_executors(spark)
    executors = configured if configured is not None else registered
    if not executors:
        log.info("%s: cannot tell how many task slots the cluster has; not checking %d", plan.name, needed)
        return
    total = executors * per
    if needed > total and configured is not None:  # it can never run; fewer registered than needed: wait below
        if input_partitions is not None and plan.num_producers > total:
            way_out = (
                f"the input DataFrame has {input_partitions} partitions and each is a producer subtask (any "
                f"DataFrame after a shuffle has spark.sql.shuffle.partitions of them): pass num_producers=N with "
                f"N <= {total} to repartition it first, "
            )
        else:
            way_out = "lower the parallelism, "
        raise InsufficientSlotsError(
            f"pipelined exchange {plan.name} runs {needed} barrier tasks at once (one per subtask: "
            f"max({plan.num_producers} producers, {plan.num_consumers} consumers)), but the cluster has only "
            f"{total} task slots ({executors} executor(s) x {per} slots); {way_out}add executors or cores, or "
            f"use mode='blocking'"
        )
    if registered is not None and registered * per < needed:
        timeout_ms = parse_duration_ms(str(spark.conf.get(REGISTRATION_WAIT, "30s")), REGISTRATION_WAIT)
        await_executors(plan.name, needed, per, configured, lambda: registered_executors(spark), timeout_ms)


#: Spark's bound on its own wait for executors to register before it schedules; the exchange waits as long for
#: the task slots of its barrier stage (Spark refuses a barrier stage with more tasks than the slots registered).
REGISTRATION_WAIT = "spark.scheduler.maxRegisteredResourcesWaitingTime"


def await_executors(
    name: str, needed: int, per: int, configured: int | None, registered: Callable[[], int | None], timeout_ms: int
) -> None:
    """Wait until the executors registered with the driver (``registered()``, ``per`` task slots each) offer the
    ``needed`` slots of exchange ``name``'s barrier stage: a session's executors register seconds after it
    starts (tens of seconds on a loaded machine, or with a cluster manager granting them one by one), and Spark
    refuses a barrier stage with more tasks than the slots registered. Raises :class:`InsufficientSlotsError`
    naming the wait and its setting if they do not within ``timeout_ms`` (Spark's
    ``spark.scheduler.maxRegisteredResourcesWaitingTime``, 30 s by default); ``configured``: the executors the
    session is configured with, if known."""
    started = time.monotonic()
    count = wait_for_executors(needed, per, registered, timeout_ms / 1000.0)
    waited = time.monotonic() - started
    if count * per >= needed:
        log.info("%s: waited %.1f s for %d executors to register", name, waited, count)
        return
    of = f" of the {configured} the session is configured with" if configured is not None else ""
    raise InsufficientSlotsError(
        f"pipelined exchange {name} runs {needed} barrier tasks at once (one per subtask), but after waiting "
        f"{waited:.0f} s ({REGISTRATION_WAIT}={timeout_ms} ms) the executors registered with the driver, "
        f"{count}{of}, offer only {count * per} task slots ({per} each): executors failed to start or "
        f"the cluster manager has not granted them; raise {REGISTRATION_WAIT}, lower the parallelism, or use "
        f"mode='blocking'"
    )


def build(
    plan: ExchangePlan,
    df: DataFrame,
    *,
    retryable: bool | None = None,
    options: TaskOptions | None = None,
    report: MetricsReport | None = None,
) -> tuple[DataFrame, CollectedMetrics]:
    """The lazy Spark plan of a pipelined exchange: (user-facing DataFrame, its metrics after an action).

    Raises :class:`InsufficientSlotsError` before launch if the cluster has fewer task slots than the
    exchange has tasks. ``retryable`` (default: the plan's ``retryable`` attribute if it has one, else
    True) places the output with an identity shuffle after the barrier stage, so that Spark can re-run the
    stage after a task failure and any operation works downstream; ``False`` streams the consumers' rows
    straight into the next operator (see the module documentation). ``options`` are the task knobs
    (latency marker interval, output batch size, memory sampling); ``report`` how tasks report metrics
    (default: :func:`~.metrics_report.metrics_report`'s choice).
    """
    from pyspark.sql import functions as F

    check_slots(plan, df.sparkSession)  # exchange() checked it already, naming the input; build() may run alone
    if retryable is None:
        retryable = getattr(plan, "retryable", None)
    if retryable is None:
        retryable = True
    options = options or TaskOptions(address_exchange=plan.config.address_exchange)
    report = (report if report is not None else metrics_report(df.sparkSession)).beside(
        [*df.columns, *plan.output_schema.names]
    )
    producers, consumers = plan.num_producers, plan.num_consumers
    width = max(producers, consumers)
    secret = _secrets.token_bytes(32)
    tls = TlsIdentity.generate(plan.name) if plan.tls else None  # shipped to the tasks as the secret is
    tag = unused_name(_TAG, [*df.columns, *plan.output_schema.names, report.column])
    source = df
    refused = barrier_refusal(df)
    if refused is not None:
        log.info("%s: the input's last stage has a %s, which no barrier stage reads: placed first", plan.name, refused)
    if producers < consumers or refused is not None:  # place producer p's rows on task p of `width` tasks
        source = place_by(df.withColumn(tag, F.spark_partition_id()), width, tag).drop(tag)

    rendezvous = (
        _address_service(df.sparkSession, plan, secret, width, tls) if options.address_exchange == "auto" else None
    )

    output_type = report.output_type(df, plan)
    placed = producers > consumers or retryable
    rows_column = unused_name(_ROWS, [tag])
    columnar = placed and columnar_layout(output_type, ansi_mode(df.sparkSession))

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        output = run_barrier_task(batches, plan, secret, options, rendezvous, report, tls)
        if placed:  # one row per output batch, for the placement's shuffle (see nested_output)
            from pyspark import BarrierTaskContext

            output = nest(output, BarrierTaskContext.get().partitionId(), tag, rows_column, columnar)
        yield from output

    run.__name__ = f"credit_shuffle_{plan.name.replace('-', '_')}"
    if placed:
        nested = nested_spark_type(output_type, tag, rows_column, columnar)
        consumed = source.mapInArrow(run, nested, barrier=True)
        consumed = unnest(place_by(consumed, consumers, tag), rows_column, output_type, columnar)
    else:
        consumed = source.mapInArrow(run, output_type, barrier=True)
    return finish_plan(plan, consumed, report)


def _address_service(
    spark: Any, plan: ExchangePlan, secret: bytes, width: int, tls: TlsIdentity | None = None
) -> tuple[str, int, str] | None:
    """(host, port, exchange key) of the driver's address service, with this exchange registered; None on
    Spark Connect or if the service cannot start (the tasks then use Spark's ``allGather``)."""
    from .rendezvous import driver_rendezvous

    if is_connect(spark):  # no driver process here: the tasks cannot reach this client
        log.info("%s: addresses through Spark's allGather (Spark Connect)", plan.name)
        return None
    try:
        host = spark.conf.get("spark.driver.host", None) or "127.0.0.1"
        service = driver_rendezvous(host)
    except Exception as exc:
        log.info("%s: addresses through Spark's allGather (%s: %s)", plan.name, type(exc).__name__, exc)
        return None
    key = f"{plan.name}/{hashlib.sha256(secret).hexdigest()[:16]}"
    service.register(key, secret, width, on_failure=_stage_canceller(spark, plan.name), tls=tls)
    host, port = service.address
    return host, port, key


def _stage_canceller(spark: Any, name: str) -> Callable[[int, str], None]:
    """Cancels a barrier stage of exchange ``name`` whose task met a failure every attempt repeats (see
    :mod:`~spark_credit_shuffle.runtime.pipelined.rendezvous`), so that Spark does not run it again: the job fails
    with ``reason`` (the typed error's class and text) after one attempt."""

    def cancel(stage: int, reason: str) -> None:
        try:
            spark_context(spark)._jsc.sc().cancelStage(stage, reason)  # type: ignore[union-attr]  # classic only
        except Exception as exc:  # the stage fails anyway; later attempts fail at the address exchange
            log.info("%s: could not cancel stage %d: %s", name, stage, exc)

    return cancel


def run_barrier_task(
    batches: Iterator[pa.RecordBatch],
    plan: ExchangePlan,
    secret: bytes,
    options: TaskOptions,
    rendezvous: tuple[str, int, str] | None = None,
    report: MetricsReport = IN_BAND,
    tls: TlsIdentity | None = None,
) -> Iterator[pa.RecordBatch]:
    """The body of one barrier task: its subtasks, addresses published once, through the driver's address
    service at ``rendezvous`` (host, port, exchange key) or with Spark's ``allGather``; its metrics go
    through ``report``; with ``tls`` (the exchange's key pair) every connection runs mutual TLS.

    Through the address service the task meets only the tasks of its own stage attempt (the service asks the
    driver's scheduler which one a task attempt belongs to), and ends only once all of them finished their part
    (the end barrier, :func:`~.rendezvous.client.end_barrier_via`): a stage attempt that fails leaves no task's
    output behind, and Spark re-runs all of it. Spark's ``allGather`` is exact per stage attempt too, but an end
    barrier through Spark would cost a second more per exchange (``BarrierTaskContext.barrier``): without the
    service there is none, and a task of a failed attempt that finished first may keep its output."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    index = ctx.partitionId()
    infos = ctx.getTaskInfos()
    width = max(plan.num_producers, plan.num_consumers)
    if len(infos) != width:
        raise CreditShuffleError(
            f"pipelined exchange {plan.name} needs a barrier stage of {width} tasks, Spark launched "
            f"{len(infos)}: the input's partitioning changed after planning (adaptive query execution "
            f"coalescing? repartition the input to {plan.num_producers} partitions first), or, in a retry, tasks "
            f"of the failed attempt finished and Spark re-runs only the others (addresses through Spark's "
            f"allGather have no end barrier; Spark's next attempt runs them all)"
        )
    address = infos[index].address
    host = resolve_host(address.rsplit(":", 1)[0] if ":" in address else address)
    executors = [info.address for info in infos]  # an executor's address (host:port) names it
    task = PipelinedTask(
        plan,
        index,
        secret,
        host,
        options,
        attempt_id=ctx.taskAttemptId(),
        report=report,
        executors=executors,
        tls=tls,
    )
    all_gather: Callable[[str], list[str]] = ctx.allGather
    end: Callable[[str], None] | None = None
    if rendezvous is not None:
        from .rendezvous import all_gather_via, end_barrier_via

        service_host, service_port, key = rendezvous
        wait_s = max(_MIN_ADDRESS_WAIT_S, plan.config.partition_request_timeout_ms / 1000.0)
        stage = ctx.stageId()
        all_gather = all_gather_via(
            (service_host, service_port),
            key,
            secret,
            f"stage {stage}",
            index,
            ctx.taskAttemptId(),
            wait_s,
            fallback=ctx.allGather,
            tls=tls,
            stage=stage,
        )
        end = end_barrier_via((service_host, service_port), key, secret, stage, index, ctx.taskAttemptId(), tls=tls)
    freeze_worker_heap(plan.config.freeze_worker_heap)
    try:
        yield from task.run(batches, all_gather, end)
    except Exception as exc:
        if not is_deterministic(exc):
            if task.wiring.lost_producers:
                time.sleep(KNOCK_ON_GRACE_S)
            raise
        located = in_subtask(exc, PRODUCER, index)
        if rendezvous is not None:  # every later attempt fails the same way: fail the exchange once, now
            from .rendezvous import report_failure

            service_host, service_port, key = rendezvous
            report_failure(
                (service_host, service_port), key, secret, ctx.stageId(), index, ctx.taskAttemptId(), located, tls
            )
        raise located from None
