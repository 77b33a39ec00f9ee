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
(:mod:`~spark_credit_shuffle.runtime.rendezvous`: milliseconds), or with ONE ``allGather`` (Spark Connect,
or ``TaskOptions(address_exchange="allgather")``; each barrier call costs about a second, during which no
consumer reads); after that tasks talk only over their own sockets. A consumer opens one TCP connection
per remote producer task, carrying every channel between the two (framed with the protocol codec,
authenticated with a random per-exchange secret generated on the driver). Every channel between two tasks
of one executor (``getTaskInfos()`` gives each task's executor address; in local mode all tasks share one)
is a local channel, as between two tasks of one Flink TaskManager: no credit and no exclusive buffers; a
task's own subpartition is read directly (no copy), a subpartition of another task of the executor (another
Python worker process) through that connection, with the producer's segment held in its pool until the
consumer recycled the buffer (:class:`~spark_credit_shuffle.protocol.client.ConnectionSubpartitionView`):
backpressure on a local channel is the producer's pool filling. ``local_channels="task"`` makes every
channel between tasks remote (credit-based) instead. Threads per task: the Spark task thread is the
consumer (it yields the received rows as they arrive), one producer thread feeds the input batches to the
RecordWriter, one I/O thread
drives every socket (:class:`~spark_credit_shuffle.transport.tcp.TcpTransport`) and one timer thread is
the output flusher (``buffer_timeout_ms``), sends latency markers and samples memory. All protocol objects
of a task are guarded by one re-entrant lock.

**Placement.** The stage has max(S, T) tasks, and the cluster must be able to run them all at once
(:class:`InsufficientSlotsError` before launch otherwise). With S == T (the common case) the input's
partitions feed the stage directly. With S < T the input is first placed by an identity shuffle
(``repartitionById`` on the producer index): one extra shuffle of the input rows.

**Output and retries.** A failure in one task fails the barrier stage. Spark never retries a failed
barrier *result* stage, and refuses jobs that run only some of a barrier stage's partitions (``show``,
``take``, ``limit``, the sampling of a skewed sort). So by default (``retryable=True``) the consumers'
output is placed on its partitions by an identity ``repartitionById``: the barrier stage then feeds a
shuffle, which Spark re-runs whole after a failure (output exact: every producer and consumer runs again),
and every DataFrame operation works downstream; the cost is one shuffle of the output rows.
``retryable=False`` streams the consumers' rows straight into what follows (the fastest form, for
actions that run every partition: ``write``, ``collect``, ``count``, ``foreachPartition``); with S > T
the output is always placed on T partitions by that shuffle.

**Faults.** Every wait has a timeout and raises :class:`ExchangeTimeoutError` naming what it waited for
and from whom: connecting (``partition_request_timeout_ms``), data on a channel (a live producer sends a
latency marker on every channel at least every quarter of ``partition_request_timeout_ms``, so silence
means a stalled peer), a network buffer while back-pressured (``buffers_request_timeout_ms`` without a
single data buffer moving), and the end of the exchange. Connections must present the exchange's secret
within the authentication deadline (``min(partition_request_timeout_ms, 2 s)`` from connecting); a wrong
secret, garbage, an oversized frame or silence closes that connection (logged once per cause) and nothing
else. At most four times the task's remote consumers (at least 32) may wait to authenticate; one more
closes the oldest of them, and a consumer writes its ``Hello`` with its connect, so a flood of silent
connections costs a bounded number of sockets and does not displace the consumers.

**Backpressure.** The producer thread hands each input batch to a resumable ``RecordWriter``, which takes a
new buffer only while the pool is available (Flink's ``isAvailable``, checked per buffer request) and
otherwise stops there; the thread waits (woken by every recycled segment) and resumes the batch. A producer
holds at most its pool size plus the overdraft, and the time it waits is its back-pressured time. Threads
that make data or credit sendable write it to the socket themselves (see
:meth:`TcpTransport.sending`): every hand-over between threads costs a wait for the interpreter lock, and
the credit loop is the latency that bounds a channel's throughput.

**Metrics** are the blocking mode's (same schema), plus Flink's time metrics per side:
``accumulateBackPressuredTimeMs``, ``accumulateIdleTimeMs``, ``accumulateBusyTimeMs`` (stat ``total``) and
``backPressuredTimeMsPerSecond``, ``idleTimeMsPerSecond``, ``busyTimeMsPerSecond`` (stat ``mean``: averaged
over the side's life, Flink averages over the last minute). A producer is back-pressured while it waits for
a buffer and idle while it waits for its next input batch; a consumer is idle while its gate has nothing.
Producers also report ``outputQueueLength`` per channel (max, mean); consumers report ``latencyMs`` of the
latency markers they received (p50, p99, max, mean) and ``numLatencyMarkersIn``; each task reports its
resident memory ``taskRssBytes`` and Arrow memory ``taskArrowAllocatedBytes`` (max, mean), sampled by the
timer thread, and its CPU time (``taskCpuTimeMs``; ``producerThreadCpuTimeMs``, ``consumerThreadCpuTimeMs``,
``ioThreadCpuTimeMs`` per thread) next to its wall-clock time ``taskWallTimeMs``. The producer half hands its
rows to the consumer half of the same task, whose last output row carries both.

**Timeline.** Every ``metrics_sample_interval_ms`` the timer thread samples both sides of its task (pool
usage, backpressure, rates, and per channel backlog, queue length and credits; the list is in
:mod:`spark_credit_shuffle.metrics`), once more when a side ends; ``Exchange.timeline()`` returns them.

Latency markers travel as records, as Flink's: a marker chunk in the open buffer of one random channel,
behind its rows. They finish no buffer, so they measure the time a row waits in a partly filled buffer
(bounded by the buffer timeout) as well as queueing and transit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import secrets as _secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from ..buffers.buffer import Buffer
from ..buffers.format import (
    KeepAlive,
    LatencyMarker,
    encode_event,
)
from ..buffers.reader import RecordReader
from ..buffers.writer import RecordWriter
from ..config import ADDRESS_EXCHANGES
from ..errors import ConfigError, CreditShuffleError, ExchangeTimeoutError, InsufficientSlotsError
from ..metrics import CONSUMER, PRODUCER, MetricRow, RateMeter, TaskMetrics, TimelineSampler
from ..protocol.channels import RemoteInputChannel
from ..protocol.client import CreditBasedPartitionRequestClientHandler
from ..protocol.codec import default_max_frame_length
from ..protocol.gate import SingleInputGate
from ..protocol.messages import AddCredit, BufferResponse, Message, RecycleBuffers
from ..protocol.partition import PipelinedResultPartition, ResultPartitionManager
from ..protocol.pools import NetworkBufferPool
from ..protocol.sender import PartitionRequestServerHandler
from ..transport.tcp import AUTHENTICATION_TIMEOUT_S, Connection, TcpTransport, resolve_host, unauthenticated_cap
from .checkpoints import CHECKPOINT_EVENTS, CheckpointTrigger, ConsumerCheckpoints
from .common import (
    IN_BAND,
    CollectedMetrics,
    MetricsReport,
    combine,
    finish_plan,
    in_subtask,
    is_deterministic,
    metrics_report,
    place_by,
    unused_name,
)
from .consumer import GateGauges
from .session import available_slots, is_connect, spark_context

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from .plan import ExchangePlan

__all__ = [
    "TaskOptions",
    "available_slots",
    "build",
    "check_slots",
    "run_barrier_task",
    "run_in_threads",
]

log = logging.getLogger("spark_credit_shuffle")
#: Messages from a consumer that say it read and recycled this producer's buffers: progress for the end wait.
_PROGRESS = (AddCredit, RecycleBuffers)

#: Hidden column used by the identity placements around the barrier stage (or, if the input has a column of
#: that name, the first of ``_TAG_1``, ``_TAG_2``, ... that it has not).
_TAG = "__credit_shuffle_subtask"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MAX_LATENCY_SAMPLES = 100_000
#: The longest a consumer holds decoded rows back, waiting for more to send to Spark in one batch.
_MAX_DEFAULT_LINGER_MS = 2.0
#: Returned by ``_next_buffer`` when its linger deadline passed with nothing new.
_LINGER_OVER = object()
#: The least time a task waits for the other tasks' addresses (tasks of a stage may start seconds apart).
_MIN_ADDRESS_WAIT_S = 60.0


@dataclass(frozen=True)
class TaskOptions:
    """Knobs of a pipelined task that are not network settings.

    ``latency_interval_ms``: a producer sends a latency marker to one random channel this often (0: only
    the keep-alives every quarter of the partition request timeout). ``output_batch_rows``: the
    consumer joins decoded batches that are ready at the same moment up to this many rows before handing
    them to Spark (0: one output batch per network buffer). ``output_linger_ms``: how long the consumer waits
    for more rows when fewer than ``output_batch_rows`` are ready (each output batch costs Spark a fixed
    amount, as a network buffer costs Flink); None takes a tenth of the buffer timeout, at most 2 ms, none
    with timeout 0 and 2 ms with -1. ``sample_memory_ms``: how often the timer
    thread samples the task's memory (0: never). ``announce_address_dir``: if set, each task writes its
    listening address there (``task-<i>.addr``) for tests and demos. ``address_exchange``: how tasks learn
    each other's addresses: ``"auto"`` through the driver's address service on a classic session (see
    :mod:`~spark_credit_shuffle.runtime.rendezvous`), Spark's ``allGather`` on Spark Connect;
    ``"allgather"``: always Spark's ``allGather`` (about a second per exchange; for clusters whose
    executors cannot open connections to the driver).
    """

    latency_interval_ms: int = 0
    output_batch_rows: int = 8192
    output_linger_ms: float | None = None
    sample_memory_ms: int = 50
    announce_address_dir: str | None = None
    address_exchange: str = "auto"

    def __post_init__(self) -> None:
        if self.address_exchange not in ADDRESS_EXCHANGES:
            raise ConfigError(
                "address_exchange", self.address_exchange, " or ".join(repr(a) for a in ADDRESS_EXCHANGES)
            )


# -- the Spark side ------------------------------------------------------------------------------------


def check_slots(plan: ExchangePlan, spark: Any) -> None:
    """Raise :class:`InsufficientSlotsError` if the cluster cannot run all max(S, T) tasks at once."""
    needed = max(plan.num_producers, plan.num_consumers)
    slots = available_slots(spark)
    if slots is None:
        log.info("%s: cannot tell how many task slots the cluster has; not checking %d", plan.name, needed)
        return
    total, executors, per = slots
    if needed > total:
        raise InsufficientSlotsError(
            f"pipelined exchange {plan.name} runs {needed} barrier tasks at once (one per subtask: "
            f"max({plan.num_producers} producers, {plan.num_consumers} consumers)), but the cluster has only "
            f"{total} task slots ({executors} executor(s) x {per} slots); lower the parallelism, add executors "
            f"or cores, or use mode='blocking'"
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
    (default: :func:`~.common.metrics_report`'s choice).
    """
    from pyspark.sql import functions as F

    check_slots(plan, df.sparkSession)
    if retryable is None:
        retryable = getattr(plan, "retryable", None)
    if retryable is None:
        retryable = True
    options = options or TaskOptions(address_exchange=plan.config.address_exchange)
    report = (report if report is not None else metrics_report(df.sparkSession)).beside(df.columns)
    producers, consumers = plan.num_producers, plan.num_consumers
    width = max(producers, consumers)
    secret = _secrets.token_bytes(32)
    tag = unused_name(_TAG, [*df.columns, report.column])
    source = df
    if producers < consumers:  # place producer p's rows on task p of `width` tasks
        source = place_by(df.withColumn(tag, F.spark_partition_id()), width, tag).drop(tag)

    rendezvous = _address_service(df.sparkSession, plan, secret, width) if options.address_exchange == "auto" else None

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield from run_barrier_task(batches, plan, secret, options, rendezvous, report)

    run.__name__ = f"credit_shuffle_{plan.name.replace('-', '_')}"
    consumed = source.mapInArrow(run, report.output_type(df), barrier=True)
    if producers > consumers or retryable:
        consumed = place_by(consumed.withColumn(tag, F.spark_partition_id()), consumers, tag).drop(tag)
    return finish_plan(plan, consumed, report)


def _address_service(spark: Any, plan: ExchangePlan, secret: bytes, width: int) -> tuple[str, int, str] | None:
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
    service.register(key, secret, width, on_failure=_stage_canceller(spark, plan.name))
    host, port = service.address
    return host, port, key


def _stage_canceller(spark: Any, name: str) -> Callable[[int, str], None]:
    """Cancels a barrier stage of exchange ``name`` whose task met a failure every attempt repeats (see
    :mod:`~spark_credit_shuffle.runtime.rendezvous`), so that Spark does not run it again: the job fails
    with ``reason`` (the typed error's class and text) after one attempt."""

    def cancel(stage: int, reason: str) -> None:
        try:
            spark_context(spark)._jsc.sc().cancelStage(stage, reason)  # type: ignore[union-attr]
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
) -> Iterator[pa.RecordBatch]:
    """The body of one barrier task: its subtasks, addresses published once, through the driver's address
    service at ``rendezvous`` (host, port, exchange key) or with Spark's ``allGather``; its metrics go
    through ``report``."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    index = ctx.partitionId()
    infos = ctx.getTaskInfos()
    width = max(plan.num_producers, plan.num_consumers)
    if len(infos) != width:
        raise CreditShuffleError(
            f"pipelined exchange {plan.name} needs a barrier stage of {width} tasks, Spark launched "
            f"{len(infos)}: the input's partitioning changed after planning (adaptive query execution "
            f"coalescing?); repartition the input to {plan.num_producers} partitions first"
        )
    address = infos[index].address
    host = resolve_host(address.rsplit(":", 1)[0] if ":" in address else address)
    executors = [info.address for info in infos]  # an executor's address (host:port) names it
    task = PipelinedTask(
        plan, index, secret, host, options, attempt_id=ctx.taskAttemptId(), report=report, executors=executors
    )
    all_gather: Callable[[str], list[str]] = ctx.allGather
    if rendezvous is not None:
        from .rendezvous import all_gather_via

        service_host, service_port, key = rendezvous
        wait_s = max(_MIN_ADDRESS_WAIT_S, plan.config.partition_request_timeout_ms / 1000.0)
        group = f"stage {ctx.stageId()}"
        address = (service_host, service_port)
        all_gather = all_gather_via(
            address, key, secret, group, index, ctx.taskAttemptId(), wait_s, fallback=ctx.allGather
        )
    try:
        yield from task.run(batches, all_gather)
    except Exception as exc:
        if not is_deterministic(exc):
            raise
        located = in_subtask(exc, PRODUCER, index)
        if rendezvous is not None:  # every later attempt fails the same way: fail the exchange once, now
            from .rendezvous import report_failure

            service_host, service_port, key = rendezvous
            report_failure(
                (service_host, service_port), key, secret, ctx.stageId(), index, ctx.taskAttemptId(), located
            )
        raise located from None


# -- in-process runs (tests, demos) -------------------------------------------------------------------


def run_in_threads(
    plan: ExchangePlan,
    partitions: list[Iterable[pa.RecordBatch]],
    *,
    secret: bytes | None = None,
    options: TaskOptions | None = None,
    host: str = "127.0.0.1",
    timeout_s: float = 60.0,
    on_batch: Callable[[int, pa.RecordBatch], None] | None = None,
    executors: Sequence[object] | None = None,
) -> tuple[list[list[pa.RecordBatch]], list[MetricRow]]:
    """Run a pipelined exchange between threads of this process over real TCP sockets, without Spark.

    ``partitions[p]`` are producer p's input batches (any iterable, consumed as the producer goes).
    ``executors[i]`` names the executor task ``i`` plays on (tasks of one executor talk through local
    channels); default: every task its own executor, so every channel between tasks is remote.
    Returns (the data batches each consumer received, every metric row); ``on_batch(consumer, batch)``
    sees each data batch as it arrives. Raises the error of the task that failed first.
    """
    width = max(plan.num_producers, plan.num_consumers)
    if len(partitions) != plan.num_producers:
        raise ValueError(f"{len(partitions)} input partitions for {plan.num_producers} producers")
    secret = secret if secret is not None else _secrets.token_bytes(32)
    options = options or TaskOptions()
    gather = _ThreadAllGather(width, timeout_s)
    outputs: list[list[pa.RecordBatch]] = [[] for _ in range(width)]
    errors: list[tuple[float, BaseException] | None] = [None] * width
    metric_rows: list[list[MetricRow]] = [[] for _ in range(width)]

    def task_main(i: int) -> None:
        data = partitions[i] if i < plan.num_producers else []
        task = PipelinedTask(plan, i, secret, host, options, attempt_id=i, executors=executors)
        try:
            for batch in task.run(iter(data), gather.all_gather):
                outputs[i].append(batch)
                if on_batch is not None and batch.column(batch.num_columns - 1).null_count == batch.num_rows:
                    on_batch(i, batch.drop_columns([batch.schema.names[-1]]))
        except BaseException as exc:
            errors[i] = (task.failed_at if task.failed_at is not None else time.monotonic(), exc)
            gather.abort()

    threads = [threading.Thread(target=task_main, args=(i,), name=f"task-{i}", daemon=True) for i in range(width)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    failures = sorted((e for e in errors if e is not None), key=lambda e: e[0])
    if failures:  # the first failure is the cause; the others follow from it
        raise failures[0][1]
    if stuck:
        raise ExchangeTimeoutError(f"tasks {stuck} still running after {timeout_s:.0f} s")
    received: list[list[pa.RecordBatch]] = [[] for _ in range(plan.num_consumers)]
    for i, batches in enumerate(outputs):
        for batch in batches:
            cells = batch.column(batch.num_columns - 1)
            if cells.null_count == batch.num_rows:
                received[i].append(batch.drop_columns([batch.schema.names[-1]]))
            else:
                for cell in cells.to_pylist():
                    for r in cell or []:
                        metric_rows[i].append(MetricRow(**r))
    return received, [r for rows in metric_rows for r in rows]


class _ThreadAllGather:
    """``allGather`` between threads: everyone's message, in task order, once all have called."""

    def __init__(self, parties: int, timeout_s: float) -> None:
        self._barrier = threading.Barrier(parties, timeout=timeout_s)
        self._messages: list[str] = [""] * parties
        self._lock = threading.Lock()

    def all_gather(self, message: str) -> list[str]:
        index = json.loads(message)["task"]
        with self._lock:
            self._messages[index] = message
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise CreditShuffleError("another task failed before the addresses were exchanged") from None
        return list(self._messages)

    def abort(self) -> None:
        self._barrier.abort()


# -- one task -----------------------------------------------------------------------------------------


class _LockedPartition:
    """The ``ResultPartitionWriter`` the RecordWriter writes to: the partition, called under the task lock.

    The writer's heavy work (channel selection, grouping, size model) runs outside the lock; only the
    partition calls take it. A recycled segment also records the time of the last progress, which the
    back-pressure timeout is measured from.
    """

    def __init__(self, partition: PipelinedResultPartition, lock: threading.RLock, on_recycle: Callable[[], None]):
        self.partition = partition
        self.num_subpartitions = partition.num_subpartitions
        self._lock = lock
        self._on_recycle = on_recycle

    def request_segment(self, subpartition: int) -> Callable[[], None]:
        with self._lock:
            recycler = self.partition.request_segment(subpartition)
        lock, on_recycle = self._lock, self._on_recycle

        def recycle() -> None:
            with lock:
                recycler()
                on_recycle()

        return recycle

    def add_consumer(self, subpartition: int, consumer: Any, partial_record_length: int = 0) -> None:
        with self._lock:
            self.partition.add_consumer(subpartition, consumer, partial_record_length)

    def add_event(self, subpartition: int, buffer: Buffer) -> None:
        with self._lock:
            self.partition.add_event(subpartition, buffer)

    def builder_opened(self, subpartition: int) -> None:
        with self._lock:
            self.partition.builder_opened(subpartition)

    def builder_finished(self, subpartition: int, *, broadcast: bool = False) -> None:
        with self._lock:
            self.partition.builder_finished(subpartition, broadcast=broadcast)

    def flush(self, subpartition: int) -> None:
        with self._lock:
            self.partition.flush(subpartition)

    def flush_all(self) -> None:
        with self._lock:
            self.partition.flush_all()

    def finish(self) -> None:
        with self._lock:
            self.partition.finish()

    def is_available(self) -> bool:
        return self.partition.is_available()


class _Clock:
    """Busy, idle and back-pressured time of one side of a task (Flink's time metrics)."""

    __slots__ = ("back_pressured", "end", "idle", "start")

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.end: float | None = None
        self.idle = 0.0
        self.back_pressured = 0.0

    def stop(self) -> None:
        if self.end is None:
            self.end = time.monotonic()

    def rows(self, side: str, subtask: int) -> list[MetricRow]:
        life = max(1e-9, (self.end or time.monotonic()) - self.start)
        idle = min(self.idle, life)
        bp = min(self.back_pressured, life - idle)
        busy = max(0.0, life - idle - bp)
        out = []
        for name, seconds in (("BackPressured", bp), ("Idle", idle), ("Busy", busy)):
            out.append(MetricRow(side, subtask, None, f"accumulate{name}TimeMs", "total", seconds * 1000.0))
            per_second = min(1000.0, max(0.0, seconds / life * 1000.0))
            out.append(
                MetricRow(side, subtask, None, f"{name[0].lower()}{name[1:]}TimeMsPerSecond", "mean", per_second)
            )
        return out


class PipelinedTask:
    """Producer subtask ``index`` and consumer subtask ``index`` of a pipelined exchange, in one task.

    ``host`` is the address to listen on; ``attempt_id`` distinguishes attempts of the same task (it
    becomes the partition id that consumers request); ``report`` carries the task's metrics to the driver
    (default: in band, as a last output row); ``executors[i]`` names the executor of task ``i`` (tasks of
    one executor read each other through local channels; None: every task its own executor). :meth:`run`
    does everything: set-up, one address exchange through ``all_gather``, streaming, and the final metrics;
    it closes every socket and joins every thread before it returns or raises.
    """

    def __init__(
        self,
        plan: ExchangePlan,
        index: int,
        secret: bytes,
        host: str,
        options: TaskOptions | None = None,
        *,
        attempt_id: int = 0,
        report: MetricsReport = IN_BAND,
        executors: Sequence[object] | None = None,
    ) -> None:
        self.plan = plan
        self.report = report
        self.index = index
        self.executors = list(executors) if executors is not None else None
        self.secret = secret
        self.host = host
        self.options = options or TaskOptions()
        config = plan.config
        self.config = config
        producers, consumers = plan.num_producers, plan.num_consumers
        self.is_producer = index < producers
        self.is_consumer = index < consumers
        self.partition_id = int(attempt_id) & 0xFFFF_FFFF_FFFF
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.writer_lock = threading.Lock()
        self.max_frame_length = default_max_frame_length(config.segment_size)
        self._failure: BaseException | None = None
        self.failed_at: float | None = None  # monotonic time this task first failed (its peers fail after it)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.transport: TcpTransport | None = None
        self.network = NetworkBufferPool.from_config(config)
        self.peers: dict[int, str] = {}
        self._last_progress = time.monotonic()
        self.producer_metrics = TaskMetrics(PRODUCER, index)
        self.consumer_metrics = TaskMetrics(CONSUMER, index)
        self._task_metrics = TaskMetrics(CONSUMER if self.is_consumer else PRODUCER, index)
        self._cpu_start = time.process_time()
        self._main_cpu_start = time.thread_time()
        self._producer_cpu_s = 0.0
        self._wall_start = time.monotonic()
        self.producer_clock = _Clock()
        self.consumer_clock = _Clock()
        interval = config.metrics_sample_interval_ms
        self.producer_timeline = TimelineSampler(PRODUCER, index, interval)
        self.consumer_timeline = TimelineSampler(CONSUMER, index, interval)
        self._records_out_rate = RateMeter()
        self._records_in_rate = RateMeter()
        self._back_pressure_rate = RateMeter()
        self._waiting_since: float | None = None  # set while the producer waits for a buffer
        self._consumer_done = not self.is_consumer
        # producer half
        self.partition: PipelinedResultPartition | None = None
        self.writer: RecordWriter | None = None
        self.manager = ResultPartitionManager()
        self.subpartition_consumers: list[int] = []
        self._producer_done = not self.is_producer
        self._writer_finished = False
        self._queue_max: list[int] = []
        self._queue_sum: list[int] = []
        self._queue_samples = 0
        self.checkpoint_trigger = CheckpointTrigger(index, config.checkpoint_interval_ms, config.checkpoint_options)
        if self.is_producer:
            self._setup_producer()
        # consumer half
        self.gate: SingleInputGate | None = None
        self.channel_producers: list[int] = []
        self.readers: list[RecordReader] = []
        self._last_delivery: list[float] = []
        self._latencies_ms: list[float] = []
        self._client_connections: dict[int, Connection] = {}
        self._gate_gauges: GateGauges | None = None  # once the channels are set up
        self.checkpoints: ConsumerCheckpoints | None = None  # with checkpoint barriers on
        if self.is_consumer:
            self._setup_consumer()

    # -- set-up --

    def _setup_producer(self) -> None:
        plan, config, index = self.plan, self.config, self.index
        consumers = plan.partitioner.consumers_of(index, plan.num_producers, plan.num_consumers)
        self.subpartition_consumers = consumers
        n = len(consumers)
        self.partition = PipelinedResultPartition.create(
            self.network, n, config, partition_id=self.partition_id, bounded=True
        )
        self.partition.buffer_pool.add_availability_listener(self._notify)
        if self.checkpoint_trigger.enabled:  # what unaligned barriers overtake: output channel state
            self.partition.set_channel_state_writer(self.checkpoint_trigger.persist_output)
        self.manager.register_partition(self.partition)
        selector = plan.partitioner.selector(index, plan.num_producers, plan.num_consumers, plan.max_parallelism)
        self.writer = RecordWriter(
            _LockedPartition(self.partition, self.lock, self._on_recycle),
            selector,
            config.segment_size,
            flush_always=config.buffer_timeout_ms == 0,
            schema=plan.schema,
            resumable=True,
        )
        self._queue_max = [0] * n
        self._queue_sum = [0] * n

    def _setup_consumer(self) -> None:
        plan, index = self.plan, self.index
        producers = plan.partitioner.producers_of(index, plan.num_producers, plan.num_consumers)
        self.channel_producers = producers
        if not producers:
            return
        remote = sum(1 for p in producers if not self.is_local(p))
        self.gate = SingleInputGate(self.network, len(producers), self.config, num_remote_channels=remote)
        self.gate.listener = self._notify
        if self.config.checkpoint_interval_ms > 0:
            self.checkpoints = ConsumerCheckpoints(index, producers)
        self.readers = [RecordReader(plan.schema, channel=p, validate=p != index) for p in producers]

    def is_local(self, task: int) -> bool:
        """Whether the channel between task ``task`` and this task is local: the same task, or (with
        ``local_channels="executor"``) a task of the same executor."""
        if task == self.index:
            return True
        executors = self.executors
        return (
            self.config.local_channels == "executor"
            and executors is not None
            and executors[task] == executors[self.index]
        )

    # -- notifications (lock held) --

    def _notify(self) -> None:
        with self.cond:  # re-entrant: usually called with the lock already held
            self.cond.notify_all()

    def _on_recycle(self) -> None:
        """A segment came back (lock held): progress, and the producer may be waiting for it."""
        self._last_progress = time.monotonic()
        if self._waiting_since is not None:
            self.cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self.cond:
            if self._failure is None:
                self._failure = exc
                self.failed_at = time.monotonic() if self.failed_at is None else self.failed_at
            self.cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self.transport is not None and self.transport.error is not None:
            raise CreditShuffleError(
                f"task {self.index}: the network I/O thread failed: {self.transport.error!r}"
            ) from self.transport.error

    # -- the task --

    def run(
        self, batches: Iterable[pa.RecordBatch], all_gather: Callable[[str], list[str]]
    ) -> Iterator[pa.RecordBatch]:
        """Set up, exchange addresses, stream; yields the received rows, then reports the metrics."""
        try:
            remote_consumers = {c for c in self.subpartition_consumers if c != self.index}
            self.transport = TcpTransport(
                self.host,
                self.lock,
                server_handler_factory=self._server_handler if self.is_producer else None,
                handshake_timeout_s=min(self.config.partition_request_timeout_ms / 1000.0, AUTHENTICATION_TIMEOUT_S),
                handshake_timeout_setting=(
                    f"min(partition_request_timeout_ms, {AUTHENTICATION_TIMEOUT_S * 1000:.0f} ms)"
                ),
                max_unauthenticated=unauthenticated_cap(len(remote_consumers)),
                on_event=self._notify,
                on_send=self._on_send,
                on_closed=self._on_connection_closed,
                name=f"{self.plan.name} task {self.index}",
            )
            self.transport.start()
            self._announce_address()
            if self.is_producer:
                with self.writer_lock:  # the first answer to every partition request, before any data
                    self._send_liveness_markers()
            self._start_thread(self._timer, "timer")
            if self.is_producer:
                self._start_thread(lambda: self._produce(batches), "producer")
            messages = all_gather(
                json.dumps(
                    {
                        "task": self.index,
                        "host": self.transport.address[0],
                        "port": self.transport.address[1],
                        "partition": self.partition_id,
                        "started_ms": time.time_ns() // 1_000_000,
                    }
                )
            )
            peers = [json.loads(m) for m in messages]
            self._connect(peers)
            self.checkpoint_trigger.arm(max(int(p.get("started_ms", 0)) for p in peers))  # every task runs now
            injection = self.plan.injection
            if injection is not None and self.is_consumer:
                injection.maybe_fail(CONSUMER, self.index)
            if self.gate is not None:
                with self.lock:  # the consumer's first timeline sample
                    self.consumer_timeline.record(self._consumer_gauges)
                yield from self._consume()
                with self.lock:  # the consumer's last timeline sample
                    self.consumer_timeline.record(self._consumer_gauges)
            self._consumer_done = True
            self.consumer_clock.stop()
            self._await_end()
            yield from self.report.last(self.plan.schema, self._metric_rows())
        except BaseException:
            if self.failed_at is None:  # before closing: peers see the close and fail after this task
                self.failed_at = time.monotonic()
            raise
        finally:
            self._close()

    def _announce_address(self) -> None:
        directory = self.options.announce_address_dir
        if directory and self.transport is not None:
            host, port = self.transport.address
            path = os.path.join(directory, f"task-{self.index}.addr")
            with open(path + ".tmp", "w") as f:
                f.write(f"{host}:{port}\n")
            os.replace(path + ".tmp", path)

    def _start_thread(self, target: Callable[[], None], role: str) -> None:
        thread = threading.Thread(target=target, name=f"credit-shuffle-{role}-{self.index}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _server_handler(self, wakeup: Callable[[], None]) -> PartitionRequestServerHandler:
        handler = PartitionRequestServerHandler(
            self.manager,
            credit_based=self.config.credit_based,
            secret=self.secret,
            max_frame_length=self.max_frame_length,
        )
        handler.queue.listener = wakeup
        receive = handler.receive_message

        def receive_message(message: Message) -> None:
            if type(message) in _PROGRESS:  # a consumer read (and recycled) this producer's buffers: progress
                self._last_progress = time.monotonic()
            receive(message)

        handler.receive_message = receive_message  # type: ignore[method-assign]
        return handler

    def _connect(self, peers: list[dict[str, Any]]) -> None:
        """Open one connection per remote producer task and request every channel's subpartition."""
        by_task = {int(p["task"]): p for p in peers}
        for task, peer in by_task.items():
            self.peers[task] = f"{peer['host']}:{peer['port']}"
        if self.gate is None:
            return
        plan, gate = self.plan, self.gate
        timeout_s = self.config.partition_request_timeout_ms / 1000.0
        for channel, producer in enumerate(self.channel_producers):
            subpartition = plan.partitioner.consumers_of(producer, plan.num_producers, plan.num_consumers).index(
                self.index
            )
            if producer == self.index:
                with self.lock:
                    gate.local_channel(
                        channel, self.partition, partition_id=self.partition_id, subpartition=subpartition
                    )
                continue
            peer = by_task.get(producer)
            if peer is None:
                raise CreditShuffleError(
                    f"consumer subtask {self.index}: producer subtask {producer} published no address"
                )
            conn = self._client_connections.get(producer)
            if conn is None:  # one connection per producer task, for its remote and local channels alike
                handler = CreditBasedPartitionRequestClientHandler(
                    credit_based=self.config.credit_based, secret=self.secret, max_frame_length=self.max_frame_length
                )
                conn = self.transport.connect(  # type: ignore[union-attr]
                    (str(peer["host"]), int(peer["port"])),
                    handler,
                    peer=f"producer subtask {producer} at {peer['host']}:{peer['port']}",
                    timeout_s=timeout_s,
                )
                self._client_connections[producer] = conn
            with self.lock:
                if self.is_local(producer):  # another task of this executor: no credit, its pool holds
                    gate.local_channel(
                        channel,
                        conn.handler,
                        receiver_id=channel + 1,
                        partition_id=int(peer["partition"]),
                        subpartition=subpartition,
                    )
                    continue
                gate.remote_channel(
                    channel,
                    receiver_id=channel + 1,
                    connection=conn.handler,
                    partition_id=int(peer["partition"]),
                    subpartition=subpartition,
                )
        with self.transport.sending(), self.lock:  # type: ignore[union-attr]
            gate.setup()
            self._gate_gauges = GateGauges(gate, self.consumer_metrics)
            gate.request_partitions()
            now = time.monotonic()
            self._last_delivery = [now] * len(self.channel_producers)
            for conn in self._client_connections.values():  # closed before its channels were registered
                if conn.closed:
                    raise CreditShuffleError(
                        f"consumer subtask {self.index}: the connection to {conn.peer} closed before its "
                        f"partitions were requested: {conn.error or 'closed by the producer'}"
                    )

    # -- producer half (producer thread) --

    def _produce(self, batches: Iterable[pa.RecordBatch]) -> None:
        clock = self.producer_clock
        writer = self.writer
        assert writer is not None
        emit = writer.broadcast_emit if writer.selector.is_broadcast else writer.emit
        schema = self.plan.schema
        sending = self.transport.sending  # type: ignore[union-attr]
        thread_cpu = time.thread_time()
        try:
            injection = self.plan.injection
            if injection is not None:
                injection.maybe_fail(PRODUCER, self.index)
            with self.lock:  # the producer's first timeline sample, whether or not its timer runs before the end
                self.producer_timeline.record(self._producer_gauges)
            iterator = iter(batches)
            while not self._stop.is_set():
                waited = time.monotonic()
                batch = next(iterator, None)
                clock.idle += time.monotonic() - waited
                if batch is None:
                    break
                if not batch.num_rows:
                    continue
                if batch.schema is not schema and not batch.schema.equals(schema):
                    batch = batch.cast(schema)
                # the writer stops at the first buffer its pool cannot give; wait, then write on from there
                self._await_buffer()
                with sending(), self.writer_lock:
                    done = emit(batch)
                while not done:
                    with self.lock:
                        self._sample_output()
                    self._await_buffer()
                    with sending(), self.writer_lock:
                        done = writer.resume()
                with self.lock:
                    self._sample_output()
            with sending(), self.writer_lock:
                writer.finish()
                self._writer_finished = True
            with self.cond:
                self._sample_output()
                self.partition.close()  # type: ignore[union-attr]
                self.producer_timeline.record(self._producer_gauges)
                self._producer_done = True
                clock.stop()
                self._producer_cpu_s = time.thread_time() - thread_cpu
                self.cond.notify_all()
        except BaseException as exc:
            self._fail(exc)

    def _await_buffer(self) -> None:
        """Back-pressure: wait until the partition's pool has a buffer (Flink's ``isAvailable``).

        Every recycled segment wakes this wait (``_on_recycle``), not only the pool's turn to available."""
        partition = self.partition
        assert partition is not None
        if partition.is_available():
            return
        timeout = self.config.buffers_request_timeout_ms / 1000.0
        started = time.monotonic()
        with self.cond:
            self._waiting_since = started
            try:
                while not partition.is_available():
                    self._raise_if_failed()
                    if self._stop.is_set():
                        raise CreditShuffleError("task stopping")
                    now = time.monotonic()
                    since = now - max(self._last_progress, started)
                    if since >= timeout:
                        raise ExchangeTimeoutError(self._describe_buffer_wait(now - started))
                    self.cond.wait(timeout - since)
            finally:
                self.producer_clock.back_pressured += time.monotonic() - started
                self._waiting_since = None

    def _readers(self) -> Iterator[Any]:
        """The view readers of every connection this producer serves (lock held)."""
        if self.transport is None:
            return
        for conn in self.transport.connections:
            queue = getattr(conn.handler, "queue", None)
            yield from getattr(queue, "all_readers", {}).values()

    def _describe_buffer_wait(self, waited: float) -> str:
        partition = self.partition
        assert partition is not None
        pool = partition.buffer_pool
        held: dict[int, int] = {}  # per subpartition: buffers a local channel's consumer has not recycled yet
        for reader in self._readers():
            if reader.holds_buffers and reader.view is not None:
                held[reader.view.parent.index] = len(reader.held)
        stuck = []
        for sp, sub in enumerate(partition.subpartitions):
            queued = sub.queue_length()
            unrecycled = held.get(sp, 0)
            if queued or unrecycled:
                consumer = self.subpartition_consumers[sp]
                where = "local" if consumer == self.index else self.peers.get(consumer, "?")
                stuck.append(
                    (
                        queued + unrecycled,
                        f"consumer subtask {consumer} ({where}): {queued} buffers queued, "
                        + (f"{unrecycled} sent and not recycled, " if unrecycled else "")
                        + f"backlog {sub.get_buffers_in_backlog()}",
                    )
                )
        stuck.sort(reverse=True)
        names = "; ".join(text for _, text in stuck[:4]) or "no subpartition holds buffers"
        return (
            f"producer subtask {self.index} waited {waited * 1000:.0f} ms for a network buffer "
            f"(buffers_request_timeout_ms={self.config.buffers_request_timeout_ms}; pool of "
            f"{pool.current_pool_size} buffers, {pool.num_used} in use, none returned meanwhile): "
            f"its consumers are not reading: {names}"
        )

    def _sample_output(self) -> None:
        """outPoolUsage and the queue length of every subpartition (lock held), after every slice of input the
        producer wrote: the moments its queues are longest."""
        partition = self.partition
        if partition is None:
            return
        self.producer_metrics.sample("outPoolUsage", partition.out_pool_usage)
        self._queue_samples += 1
        for sp, sub in enumerate(partition.subpartitions):
            q = sub.queue_length()
            self._queue_sum[sp] += q
            if q > self._queue_max[sp]:
                self._queue_max[sp] = q

    def _on_send(self, conn: Connection, message: Message) -> None:
        if type(message) is BufferResponse and message.data_type.is_buffer:
            self._last_progress = time.monotonic()  # data moved (events, such as keep-alives, do not count)

    def _on_connection_closed(self, conn: Connection) -> None:
        """A connection ended (lock held): a client connection that fails channels fails the task."""
        if conn.role != "client" or conn.error is None:
            return
        handler = conn.handler
        open_channels = [c for c in handler.input_channels.values() if not c.received_end_of_partition]
        open_channels += [v for v in handler.local_views.values() if not v.listener.received_end_of_partition]
        if open_channels and self._failure is None:
            hint = ""
            if conn.bytes_in == 0:  # closed before the producer answered anything: it never accepted us
                hint = (
                    " (closed before the producer answered anything; unless that task failed, its log says why: "
                    "a wrong secret, or more connections waiting to authenticate there than it allows)"
                )
            self._failure = CreditShuffleError(
                f"consumer subtask {self.index}: connection to {conn.peer} failed before the end of its "
                f"partition: {conn.error}{hint}"
            )

    # -- timeline (timer thread, lock held) --

    def _producer_gauges(self) -> Iterator[tuple[str, int | None, float]]:
        """The producer's timeline gauges (see :mod:`spark_credit_shuffle.metrics`); lock held."""
        partition, writer = self.partition, self.writer
        assert partition is not None and writer is not None
        now = time.monotonic()
        waiting = self._waiting_since
        back_pressured_ms = (self.producer_clock.back_pressured + (now - waiting if waiting else 0.0)) * 1000.0
        yield "outPoolUsage", None, partition.out_pool_usage
        yield "isBackPressured", None, 1.0 if waiting is not None or not partition.is_available() else 0.0
        yield "backPressuredTimeMsPerSecond", None, min(1000.0, self._back_pressure_rate.rate(back_pressured_ms))
        yield "numRecordsOutPerSecond", None, self._records_out_rate.rate(sum(writer.num_records_out))
        credits: dict[int, int] = {}
        for reader in self._readers():
            view = reader.view
            if view is not None and not reader.holds_buffers:  # local channels have no credit
                credits[view.parent.index] = reader.num_credits_available
        for sp, (sub, consumer) in enumerate(zip(partition.subpartitions, self.subpartition_consumers)):
            yield "backlog", consumer, float(sub.get_buffers_in_backlog())
            yield "outputQueueLength", consumer, float(sub.queue_length())
            if sp in credits:  # remote channels only: local channels read without credit
                yield "credit", consumer, float(credits[sp])

    def _consumer_gauges(self) -> Iterator[tuple[str, int | None, float]]:
        """The consumer's timeline gauges; lock held."""
        gate = self.gate
        assert gate is not None
        assert self._gate_gauges is not None
        for name, value in zip(GateGauges.NAMES, self._gate_gauges.values()):
            yield name, None, value
        yield "numRecordsInPerSecond", None, self._records_in_rate.rate(sum(r.num_records_in for r in self.readers))
        for channel, producer in zip(gate.channels, self.channel_producers):
            if isinstance(channel, RemoteInputChannel):
                unannounced = channel.unannounced_credit
                yield "credit", producer, float(max(0, channel.num_available_buffers - unannounced))
                yield "unannouncedCredit", producer, float(unannounced)
                yield "backlog", producer, float(max(0, channel.sender_backlog))
            if channel is not None:
                yield "inputQueueLength", producer, float(channel.queue_length())

    def _sample_timeline(self) -> float:
        """One timeline sample of each side still running; returns the seconds until the next one
        (``inf`` once both sides ended or sampling is off)."""
        intervals = []
        with self.lock:
            if self.is_producer and not self._producer_done and self.producer_timeline.interval > 0:
                self.producer_timeline.record(self._producer_gauges)
                intervals.append(self.producer_timeline.interval)
            if self.gate is not None and not self._consumer_done and self.consumer_timeline.interval > 0:
                if self._gate_gauges is not None:  # channels requested
                    self.consumer_timeline.record(self._consumer_gauges)
                intervals.append(self.consumer_timeline.interval)
        return min(intervals, default=float("inf"))

    # -- timer thread: output flusher, latency markers, memory samples --

    def _timer(self) -> None:
        config, options = self.config, self.options
        flush_every = config.buffer_timeout_ms / 1000.0 if config.buffer_timeout_ms > 0 else None
        heartbeat_every = max(0.01, config.partition_request_timeout_ms / 4000.0)
        marker_every = options.latency_interval_ms / 1000.0 if options.latency_interval_ms > 0 else None
        sample_every = options.sample_memory_ms / 1000.0 if options.sample_memory_ms > 0 else None
        trigger = self.checkpoint_trigger
        checkpoint_every = trigger.interval if trigger.enabled else None
        now = time.monotonic()
        next_checkpoint = now + trigger.seconds_until_next() if checkpoint_every else float("inf")
        next_flush = now + flush_every if flush_every else float("inf")
        next_heartbeat = now + heartbeat_every
        next_marker = now + marker_every if marker_every else float("inf")
        next_sample = now if sample_every else float("inf")
        next_timeline = now if config.metrics_sample_interval_ms > 0 else float("inf")
        rng = random.Random(self.index)
        try:
            while True:
                producing = self.is_producer and not self._writer_finished
                due = min(
                    (
                        next_sample,
                        next_timeline,
                        *(
                            (next_flush, next_heartbeat, next_marker, next_checkpoint, trigger.timeout_at)
                            if producing
                            else ()
                        ),
                    )
                )
                if due == float("inf"):
                    due = now + 1.0
                if self._stop.wait(max(0.0, due - time.monotonic())):
                    return
                now = time.monotonic()
                if now >= next_sample:
                    self._sample_memory()
                    next_sample = max(next_sample + sample_every, now)  # type: ignore[operator]
                if now >= next_timeline:
                    next_timeline = max(next_timeline + self._sample_timeline(), now)
                if not producing:
                    continue
                with self.transport.sending(), self.writer_lock:  # type: ignore[union-attr]
                    if self._writer_finished:
                        continue
                    writer = self.writer
                    assert writer is not None
                    if now >= next_flush:
                        writer.flush_all()
                        next_flush = max(next_flush + flush_every, now)  # type: ignore[operator]
                    if now >= next_heartbeat:
                        self._send_liveness_markers()
                        next_heartbeat = now + heartbeat_every
                    if now >= next_marker:  # a record to one random channel (Flink's randomEmit)
                        sp = rng.randrange(writer.num_subpartitions)
                        writer.emit_latency_marker(LatencyMarker(time.time_ns(), self.index), sp)
                        next_marker = max(next_marker + marker_every, now)  # type: ignore[operator]
                    if now >= next_checkpoint:
                        if trigger.is_due():
                            self._inject_barrier()
                        next_checkpoint = now + trigger.seconds_until_next()
                    timed_out = trigger.timed_out(now)
                    if timed_out is not None:  # a barrier still queued overtakes as unaligned
                        with self.lock:
                            self.partition.aligned_barrier_timeout(timed_out)  # type: ignore[union-attr]
        except BaseException as exc:
            self._fail(exc)

    def _inject_barrier(self) -> None:
        """The due checkpoint barrier into every subpartition (aligned: behind the queued data; unaligned: a
        priority event ahead of it), between two records: a producer back-pressured half-way through an
        input batch injects it where its writer stopped. Call with ``writer_lock`` held."""
        writer = self.writer
        assert writer is not None
        if self._writer_finished:
            return
        with self.lock:
            writer.broadcast_event(self.checkpoint_trigger.next_barrier())

    def _send_liveness_markers(self) -> None:
        """A :class:`KeepAlive` priority event on every subpartition: tells each consumer this producer is
        alive. It overtakes the queued data and needs no credit, and it finishes and flushes no buffer, so
        with buffer timeout -1 partly filled buffers still move only when full, on events or at the end.

        Call with ``writer_lock`` held."""
        partition = self.partition
        assert partition is not None
        with self.lock:
            if partition.is_finished or partition.is_released:
                return
            for sp in range(partition.num_subpartitions):
                partition.add_event(sp, encode_event(KeepAlive()))

    def _sample_memory(self) -> None:
        rss = _rss_bytes()
        if rss:
            self._task_metrics.sample("taskRssBytes", float(rss))
        self._task_metrics.sample("taskArrowAllocatedBytes", float(pa.total_allocated_bytes()))

    # -- consumer half (the task thread) --

    def _consume(self) -> Iterator[pa.RecordBatch]:
        self.consumer_clock = _Clock()  # the consumer's life starts once its channels are requested
        started_ns = time.time_ns()
        readers = self.readers
        delay = self.plan.injection.delay_of(self.index) if self.plan.injection is not None else 0.0
        target = self.options.output_batch_rows
        pending: list[pa.RecordBatch] = []
        pending_rows = 0
        lock = self.lock
        sending = self.transport.sending  # type: ignore[union-attr]
        data = self.report.data
        linger = self._linger_seconds()
        linger_until: float | None = None
        checkpoints = self.checkpoints
        while True:
            polled = self._next_buffer(linger_until)
            if polled is _LINGER_OVER:  # nothing more came while the pending rows waited: hand them on
                linger_until = None
                batch = combine(pending)
                pending, pending_rows = [], 0
                yield data(batch)
                continue
            if polled is None:
                break
            buffer = polled.buffer
            recycle = buffer.recycle

            def locked_recycle(recycle: Callable[[], None] = recycle) -> None:
                with sending(), lock:  # returning the buffer may send credit: write it from here
                    recycle()

            channel = polled.channel_index
            if checkpoints is not None and buffer.is_buffer:
                checkpoints.handler.process_buffer(channel, polled.sequence_number, len(buffer.data))
                if checkpoints.handler.is_checkpoint_pending:
                    self._resume(checkpoints.check_timeout())
            items = readers[channel].feed(Buffer(buffer.data_type, buffer.data, locked_recycle), polled.sequence_number)
            for item in items:
                if isinstance(item, pa.RecordBatch):
                    if delay:
                        time.sleep(delay * item.num_rows)
                    pending.append(item)
                    pending_rows += item.num_rows
                elif checkpoints is not None and isinstance(item, CHECKPOINT_EVENTS):
                    self._resume(checkpoints.on_event(channel, item, polled.sequence_number))
                elif (
                    isinstance(item, LatencyMarker)
                    and item.timestamp >= started_ns  # markers sent before this consumer asked measure the set-up
                    and len(self._latencies_ms) < _MAX_LATENCY_SAMPLES
                ):
                    self._latencies_ms.append((time.time_ns() - item.timestamp) / 1e6)
            if not pending:
                continue
            if pending_rows >= target or (not polled.more_available and linger <= 0):
                linger_until = None
                batch = combine(pending)
                pending, pending_rows = [], 0
                yield data(batch)
            elif not polled.more_available and linger_until is None:
                linger_until = time.monotonic() + linger
        if pending:
            yield data(combine(pending))

    def _resume(self, channels: tuple[int, ...]) -> None:
        """ResumeConsumption on ``channels`` (their subpartitions blocked themselves after an aligned barrier)."""
        if not channels:
            return
        gate = self.gate
        assert gate is not None
        now = time.monotonic()
        with self.transport.sending(), self.lock:  # type: ignore[union-attr]
            for channel in channels:
                gate.resume_consumption(channel)
                self._last_delivery[channel] = now  # its silence while blocked was the alignment's

    def _linger_seconds(self) -> float:
        """How long decoded rows may wait for more before they go to Spark (see TaskOptions.output_linger_ms)."""
        linger_ms = self.options.output_linger_ms
        if linger_ms is None:
            timeout = self.config.buffer_timeout_ms
            linger_ms = (
                0.0
                if timeout == 0
                else _MAX_DEFAULT_LINGER_MS
                if timeout < 0
                else min(_MAX_DEFAULT_LINGER_MS, timeout / 10.0)
            )
        return max(0.0, linger_ms) / 1000.0

    def _next_buffer(self, linger_until: float | None = None) -> Any:
        """The gate's next buffer or event, waiting for one; None once every channel ended;
        ``_LINGER_OVER`` if ``linger_until`` (a ``time.monotonic()`` deadline) passed first."""
        gate = self.gate
        assert gate is not None
        timeout = self.config.partition_request_timeout_ms / 1000.0
        waited_since: float | None = None
        with self.cond:
            try:
                while True:
                    self._raise_if_failed()
                    try:
                        polled = gate.poll_next()
                    except Exception as exc:
                        raise self._channel_error(exc) from exc
                    now = time.monotonic()
                    if polled is not None:
                        self._last_delivery[polled.channel_index] = now
                        if polled.buffer.is_buffer:
                            self._gate_gauges()  # type: ignore[misc]
                        return polled
                    if gate.is_finished:
                        return None
                    if linger_until is not None and now >= linger_until:
                        return _LINGER_OVER
                    if waited_since is None:
                        waited_since = now
                    blocked = self.checkpoints.handler.blocked_channels if self.checkpoints is not None else ()
                    silent = [  # a channel blocked by an aligned barrier is silent on purpose
                        (now - last, ch)
                        for ch, last in enumerate(self._last_delivery)
                        if not gate.channels[ch].is_released and now - last >= timeout and ch not in blocked  # type: ignore[union-attr]
                    ]
                    if silent:
                        raise ExchangeTimeoutError(self._describe_silence(max(silent)[1], max(silent)[0]))
                    oldest = min(
                        (last for ch, last in enumerate(self._last_delivery) if not gate.channels[ch].is_released),  # type: ignore[union-attr]
                        default=now,
                    )
                    wait = oldest + timeout - now
                    if linger_until is not None:
                        wait = min(wait, linger_until - now)
                    self.cond.wait(max(0.0005, wait))
            finally:
                if waited_since is not None:
                    self.consumer_clock.idle += time.monotonic() - waited_since

    def _describe_silence(self, channel: int, seconds: float) -> str:
        producer = self.channel_producers[channel]
        where = "the local channel" if producer == self.index else f"{self.peers.get(producer, '?')}"
        conn = self._client_connections.get(producer)
        detail = ""
        if conn is not None:
            detail = (
                f"; its connection received {conn.bytes_in} bytes, the last "
                f"{(time.monotonic() - conn.last_received) * 1000:.0f} ms ago"
            )
        return (
            f"consumer subtask {self.index} waited {seconds * 1000:.0f} ms for data from producer subtask "
            f"{producer} ({where}): nothing arrived on that channel within partition_request_timeout_ms="
            f"{self.config.partition_request_timeout_ms}{detail}"
        )

    def _channel_error(self, exc: Exception) -> Exception:
        gate = self.gate
        assert gate is not None
        failed = [ch for ch, c in enumerate(gate.channels) if c is not None and getattr(c, "error", None) is not None]
        channel = failed[0] if failed else None
        if channel is None:
            return exc
        producer = self.channel_producers[channel]
        conn = self._client_connections.get(producer)
        cause = f" ({conn.error})" if conn is not None and conn.error is not None else ""
        where = "local" if producer == self.index else self.peers.get(producer, "?")
        return CreditShuffleError(
            f"consumer subtask {self.index}, channel {channel} from producer subtask {producer} ({where}): {exc}{cause}"
        )

    # -- the end --

    def _await_end(self) -> None:
        """Wait until the producer finished, every subpartition was consumed and every connection closed.

        Progress is a recycled segment, a data buffer sent, or credit from a consumer. A subpartition whose
        every buffer, its end of partition included, went to a reader that is still connected waits for
        its consumer alone, which may still be working through the buffers it received (up to its exclusive
        and floating buffers, behind a slow user function): that wait counts as progress, and it ends when
        the consumer releases the subpartition or its connection closes (which releases it too)."""
        timeout = self.config.partition_request_timeout_ms / 1000.0
        with self.cond:
            self._last_progress = time.monotonic()
            while True:
                self._raise_if_failed()
                pending = self._pending_end()
                if not pending:
                    return
                partition = self.partition
                if (
                    self._producer_done
                    and partition is not None
                    and all(sub.is_released or sub.is_sent_to_reader for sub in partition.subpartitions)
                ):
                    self._last_progress = time.monotonic()
                since = time.monotonic() - self._last_progress
                if since >= timeout:
                    raise ExchangeTimeoutError(
                        f"task {self.index} waited {since * 1000:.0f} ms for the end of the exchange "
                        f"(partition_request_timeout_ms={self.config.partition_request_timeout_ms}): {pending}"
                    )
                self.cond.wait(min(timeout - since, 0.5))

    def _pending_end(self) -> str:
        if not self._producer_done:
            return "its producer has not finished its input"
        partition = self.partition
        if partition is not None and not all(sub.is_released for sub in partition.subpartitions):
            waiting = [
                self._consumer_name(self.subpartition_consumers[sp])
                for sp, sub in enumerate(partition.subpartitions)
                if not sub.is_released
            ]
            return "subpartitions not yet consumed by " + ", ".join(waiting)
        open_clients = [c.peer for c in self._client_connections.values() if not c.closed]
        if open_clients:
            return "connections not yet closed by " + ", ".join(open_clients)
        return ""

    def _consumer_name(self, consumer: int) -> str:
        where = "local" if consumer == self.index else self.peers.get(consumer, "?")
        return f"consumer subtask {consumer} ({where})"

    def _metric_rows(self) -> list[MetricRow]:
        rows: list[MetricRow] = []
        self._sample_memory()
        if self.is_producer:
            writer = self.writer
            assert writer is not None
            metrics = self.producer_metrics
            for sp, consumer in enumerate(self.subpartition_consumers):
                metrics.count("numRecordsOut", writer.num_records_out[sp], consumer)
                metrics.count("numBytesOut", writer.num_bytes_out[sp], consumer)
                metrics.count("numBuffersOut", writer.num_buffers_out[sp], consumer)
            rows.extend(metrics.rows())
            samples = max(1, self._queue_samples)
            for sp, consumer in enumerate(self.subpartition_consumers):
                rows.append(
                    MetricRow(PRODUCER, self.index, consumer, "outputQueueLength", "max", float(self._queue_max[sp]))
                )
                rows.append(
                    MetricRow(
                        PRODUCER, self.index, consumer, "outputQueueLength", "mean", self._queue_sum[sp] / samples
                    )
                )
            rows.extend(self.producer_clock.rows(PRODUCER, self.index))
            if self.checkpoint_trigger.enabled:
                rows.extend(self.checkpoint_trigger.metric_rows())
                rows.extend(self.checkpoint_trigger.rows)
        if self.is_consumer:
            metrics = self.consumer_metrics
            for channel, reader in enumerate(self.readers):
                producer = self.channel_producers[channel]
                metrics.count("numRecordsIn", reader.num_records_in, producer)
                metrics.count("numBytesIn", reader.num_bytes_in, producer)
                metrics.count("numBuffersIn", reader.num_buffers_in, producer)
            metrics.count("numLatencyMarkersIn", len(self._latencies_ms))
            rows.extend(metrics.rows())
            if self._latencies_ms:
                values = np.asarray(self._latencies_ms)
                for stat, value in (
                    ("p50", np.percentile(values, 50)),
                    ("p99", np.percentile(values, 99)),
                    ("max", values.max()),
                    ("mean", values.mean()),
                ):
                    rows.append(MetricRow(CONSUMER, self.index, None, "latencyMs", stat, float(value)))
            rows.extend(self.consumer_clock.rows(CONSUMER, self.index))
            if self.checkpoints is not None:
                rows.extend(self.checkpoints.metric_rows())
        self._task_metrics.count("taskCpuTimeMs", (time.process_time() - self._cpu_start) * 1000.0)
        self._task_metrics.count("consumerThreadCpuTimeMs", (time.thread_time() - self._main_cpu_start) * 1000.0)
        if self.is_producer:
            self._task_metrics.count("producerThreadCpuTimeMs", self._producer_cpu_s * 1000.0)
        io_cpu = _thread_cpu_seconds(getattr(self.transport, "_thread", None))
        if io_cpu is not None:
            self._task_metrics.count("ioThreadCpuTimeMs", io_cpu * 1000.0)
        self._task_metrics.count("taskWallTimeMs", (time.monotonic() - self._wall_start) * 1000.0)
        rows.extend(self._task_metrics.rows())
        with self.lock:
            if self.is_producer:
                rows.extend(self.producer_timeline.timeline_rows())
            if self.gate is not None:
                rows.extend(self.consumer_timeline.timeline_rows())
        return rows

    def _close(self) -> None:
        """Stop the timer, join the threads, close the sockets, release the partition and the gate."""
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        failed = self._failure is not None
        current = threading.current_thread()
        stuck = []
        for thread in self._threads:
            if thread is current:
                continue
            # A producer blocked on Spark's input cannot be interrupted; after a failure the worker exits.
            thread.join(0.5 if failed else self.config.partition_request_timeout_ms / 1000.0)
            if thread.is_alive():
                stuck.append(thread.name)
        transport_error: BaseException | None = None
        if self.transport is not None:
            try:
                self.transport.close(self.config.partition_request_timeout_ms / 1000.0)
            except ExchangeTimeoutError as exc:
                transport_error = exc
        with self.lock:
            if self.gate is not None:
                self.gate.close()
            if self.partition is not None:
                self.partition.release()
        if stuck and not failed and transport_error is None:
            log.warning("task %d: threads %s did not stop in time", self.index, stuck)
        if transport_error is not None and not failed:
            raise transport_error


def _thread_cpu_seconds(thread: threading.Thread | None) -> float | None:
    """CPU seconds a running thread used (Linux), or None."""
    if thread is None or thread.ident is None or not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError):
        return None


def _rss_bytes() -> int:
    """Resident memory of this process in bytes (0 if it cannot be read)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        try:
            import resource

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        except Exception:
            return 0
