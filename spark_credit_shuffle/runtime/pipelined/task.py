"""One pipelined task: producer subtask *i* and consumer subtask *i*, one event loop and its sockets.

The rules (flush schedule, keep-alives, backpressure wait, silence timeouts, output linger, gauges) are the
task engine's (:mod:`~spark_credit_shuffle.engine`); the task's one loop runs them
(:mod:`~spark_credit_shuffle.runtime.pipelined.loop`, which lists the task's three threads and what each
does); its connections, shared state and end are :mod:`~spark_credit_shuffle.runtime.pipelined.wiring`'s. This
module sets the two halves up, starts the threads and gives Spark the task's output and its metrics.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from ...buffers.reader import RecordReader
from ...config import ADDRESS_EXCHANGES
from ...engine import ConsumerEngine, ProducerEngine, Settings, TimeAccount
from ...engine.checkpoints import ConsumerCheckpoints
from ...engine.consumer import OutputBatcher
from ...errors import ConfigError, CreditShuffleError
from ...metrics import CONSUMER, PRODUCER, MetricRow, TaskMetrics, executor_row
from ...protocol import PipelinedResultPartition, SingleInputGate
from ...transport.tls import TlsIdentity
from ..chain import apply_chain
from ..handoff import HANDOFF_BATCHES, ThreadClock
from ..metrics_report import IN_BAND, MetricsReport
from ..monitor import MonitorClient, watch
from ..resources import available_cores, thread_cpu_seconds
from .loop import BURST, TaskLoop
from .partition_writer import TaskPartitionWriter
from .wiring import TaskWiring

if TYPE_CHECKING:
    from ..exchange_plan import ExchangePlan

__all__ = ["BURST", "PipelinedTask", "TaskOptions"]  # BURST: the loop's, named here as before


@dataclass(frozen=True)
class TaskOptions:
    """Knobs of a pipelined task that are not network settings.

    ``latency_interval_ms``: a producer sends a latency marker to one random channel this often (0: only
    the keep-alives every quarter of the partition request timeout). ``output_batch_rows``: the
    consumer joins decoded batches that are ready at the same moment up to this many rows before handing
    them to Spark (0: one output batch per network buffer). ``output_linger_ms``: how long the consumer waits
    for more rows when fewer than ``output_batch_rows`` are ready (each output batch costs Spark a fixed
    amount, as a network buffer costs Flink); None takes a tenth of the buffer timeout, at most 2 ms, none
    with timeout 0 and 2 ms with -1 (:class:`~.engine.Settings`). ``sample_memory_ms``: how often the task's
    loop samples the task's memory (0: never). ``announce_address_dir``: if set, each task writes its
    listening address there (``task-<i>.addr``) for tests and demos. ``address_exchange``: how tasks learn
    each other's addresses: ``"auto"`` through the driver's address service on a classic session (see
    :mod:`~spark_credit_shuffle.runtime.pipelined.rendezvous`), Spark's ``allGather`` on Spark Connect;
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


class PipelinedTask:
    """Producer subtask ``index`` and consumer subtask ``index`` of a pipelined exchange, in one task.

    ``host`` is the address to listen on; ``attempt_id`` distinguishes attempts of the same task (it
    becomes the partition id that consumers request); ``report`` carries the task's metrics to the driver
    (default: in band, as a last output row); ``executors[i]`` names the executor of task ``i`` (tasks of
    one executor read each other through local channels; None: every task its own executor); ``tls`` the
    exchange's key pair when its connections run TLS (``plan.tls``). :meth:`run`
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
        tls: TlsIdentity | None = None,
    ) -> None:
        self.options = options = options or TaskOptions()
        self.settings = Settings.of(
            plan.config,
            latency_interval_ms=options.latency_interval_ms,
            output_batch_rows=options.output_batch_rows,
            output_linger_ms=options.output_linger_ms,
            sample_memory_ms=options.sample_memory_ms,
        )
        #: The task's sockets, connections and shared state: what its threads share, and its end.
        self.wiring = wiring = TaskWiring(
            plan,
            index,
            secret,
            host,
            self.settings,
            announce_address_dir=options.announce_address_dir,
            attempt_id=attempt_id,
            executors=executors,
            tls=tls,
        )
        # the same objects under the task's own names: what never changes after set-up
        self.plan, self.config, self.index, self.host, self.report = plan, plan.config, index, host, report
        self.executors = wiring.executors
        self.is_producer, self.is_consumer = wiring.is_producer, wiring.is_consumer
        self.lock = wiring.lock
        self._task_metrics = TaskMetrics(CONSUMER if self.is_consumer else PRODUCER, index)
        self._cpu_start = time.process_time()
        self._main_cpu_start = time.thread_time()
        self._producer_cpu_s = 0.0
        self._wall_start = time.monotonic()
        self.wiring.consumer_done = not self.is_consumer
        self.wiring.producer_done = not self.is_producer
        self.producer: ProducerEngine | None = None
        self.consumer: ConsumerEngine | None = None
        trigger = wiring.checkpoint_trigger
        injection = plan.injection
        #: Whether the Spark task thread works on the consumer's output (chained operators, an injected slow
        #: consumer): then the loop decodes no further ahead of that work than one batch, as a Flink task's
        #: chain takes its next record only when done with the last, and its input waits in network buffers
        #: (where checkpoint barriers queue behind it).
        self._works_on_output = bool(plan.after) or bool(injection is not None and injection.delay_of(index))
        if self.is_producer:
            self._setup_producer()
        if self.is_consumer:
            self._setup_consumer()
        unaligned = trigger.options.is_unaligned or trigger.options.is_timeoutable
        #: Both halves, the schedule and (through the transport) the sockets: the task's one loop.
        self.loop = TaskLoop(
            wiring,
            self.settings,
            self.producer,
            self.consumer,
            self._task_metrics,
            burst=1 if trigger.enabled and unaligned else BURST,
            output_batches=1 if self._works_on_output else HANDOFF_BATCHES,
        )
        wiring.on_gate, wiring.on_failure = self.loop.gate_signalled, self.loop.outputs.fail

    # -- set-up --

    def _setup_producer(self) -> None:
        plan, config, index = self.plan, self.config, self.index
        consumers = plan.partitioner.consumers_of(index, plan.num_producers, plan.num_consumers)
        self.wiring.subpartition_consumers = consumers
        partition = PipelinedResultPartition.create(
            self.wiring.network, len(consumers), config, partition_id=self.wiring.partition_id, bounded=True
        )
        self.wiring.partition = partition
        partition.buffer_pool.add_availability_listener(self.wiring.notify_loop)
        if self.wiring.checkpoint_trigger.enabled:  # what unaligned barriers overtake: output channel state
            partition.set_channel_state_writer(self.wiring.checkpoint_trigger.persist_output)
        self.wiring.manager.register_partition(partition)
        selector = plan.partitioner.selector(index, plan.num_producers, plan.num_consumers, plan.max_parallelism)
        self.producer = ProducerEngine(
            index,
            partition,
            selector,
            consumers,
            self.settings,
            config.segment_size,
            plan.schema,
            time.monotonic(),
            partition_writer=TaskPartitionWriter(partition, self.lock, self._on_recycle),
            resumable=True,
        )

    def _on_recycle(self, requested: float) -> None:
        """A segment requested at ``requested`` came back: progress (the back-pressure timeout is measured from
        the last), and the time it was held."""
        now = self.wiring.last_progress = time.monotonic()
        if self.producer is not None:
            self.producer.segment_returned(now - requested)

    def _setup_consumer(self) -> None:
        plan, index = self.plan, self.index
        producers = plan.partitioner.producers_of(index, plan.num_producers, plan.num_consumers)
        self.wiring.channel_producers = producers
        if not producers:
            return
        remote = sum(1 for p in producers if not self.wiring.is_local(p))
        self.wiring.gate = SingleInputGate(self.wiring.network, len(producers), self.config, num_remote_channels=remote)
        self.wiring.gate.listener = self.wiring.notify_gate
        checkpoints = (
            ConsumerCheckpoints(index, producers, time.time_ns, acknowledge=self.wiring.gate.acknowledge_checkpoint)
            if self.config.checkpoint_interval_ms > 0
            else None
        )
        readers = [RecordReader(plan.schema, channel=p, validate=p != index) for p in producers]
        self.consumer = ConsumerEngine(
            index, self.wiring.gate, readers, producers, self.settings, time.monotonic(), checkpoints=checkpoints
        )
        injection = plan.injection
        if injection is not None and injection.delay_of(index):  # its slow work on every buffer's rows, as they come
            self.consumer.output = OutputBatcher(0, 0.0)
        self.consumer.where = lambda producer: self.wiring.peers.get(producer, "?")
        self.consumer.detail = self.wiring.connection_detail
        self.wiring.consumer = self.consumer  # started when its channels are requested

    # -- the task --

    def run(
        self,
        batches: Iterable[pa.RecordBatch],
        all_gather: Callable[[str], list[str]],
        end: Callable[[str], None] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """Set up, exchange addresses, stream; yields the received rows, then reports the metrics.

        ``end``, if given, is the end barrier (:func:`~.rendezvous.client.end_barrier_via`): called with the
        task's address group once its part is done and before its last rows, it returns when every task of that
        group got there, so that no task of a stage attempt ends successfully while another of it failed (Spark
        would keep the finished one's output and re-run only the others, fewer tasks than the exchange has)."""
        wiring, loop = self.wiring, self.loop
        try:
            if self.plan.monitor is not None:  # the live monitor: every timeline sample to the driver
                wiring.monitor = MonitorClient(self.plan.monitor, wiring.attempt_id)
                for engine in (self.producer, self.consumer):
                    if engine is not None:
                        watch(wiring.monitor, engine)
            if self.producer is not None:
                with self.lock:  # the first answer to every partition request, before any data
                    self.producer.send_liveness_markers()
                    # the producer's first timeline sample, whether or not its timer runs before the end
                    loop.record_producer_sample(time.monotonic())
            wiring.start_transport(loop.round)  # the task's loop runs from here
            transport = wiring.transport
            assert transport is not None
            loop.inputs.on_item = loop.outputs.on_room = transport.wakeup
            if self.is_producer:
                self._start_thread(lambda: self._read_input(batches), "input")
            else:
                _drain(batches, self.index)
            wiring.exchange_addresses(all_gather)
            injection = self.plan.injection
            if injection is not None and self.is_consumer:
                injection.maybe_fail(CONSUMER, self.index)
            consumer = self.consumer
            data = self.report.data
            if consumer is not None and wiring.gate is not None:
                with self.lock:  # the consumer's first timeline sample; its half of the loop runs from here
                    now = time.monotonic()
                    loop.record_consumer_sample(now)
                    loop.start_consumer(now)
                transport.wakeup()
                for batch in self._output(consumer):
                    yield data(batch)
                with self.lock:  # the consumer's end: its last time counted, its last timeline sample
                    now = time.monotonic()
                    loop.record_consumer_sample(now)
                    wiring.consumer_done = True
                    consumer.time.stop(now)
            elif self.is_consumer and self.plan.after:  # no channel: the chained operators see an empty input
                for batch in apply_chain(self.plan.after, iter(())):
                    yield data(batch)
            wiring.consumer_done = True
            wiring.await_end()
            rows = self._metric_rows()  # the task's own time: the wait for the others below is not in it
            if end is not None:
                end(wiring.address_group)
            yield from self.report.last(self.plan.output_schema, rows)
        except BaseException as exc:
            if wiring.failed_at is None:  # before closing: peers see the close and fail after this task
                wiring.failed_at = time.monotonic()
            wiring.cause = exc
            remote = getattr(exc, "remote", None)
            if remote is not None:  # a producer's failure reached this consumer: raise that first cause
                raise remote from exc
            raise
        finally:
            wiring.close()

    def _start_thread(self, target: Callable[[], None], role: str) -> None:
        thread = threading.Thread(target=target, name=f"credit-shuffle-{role}-{self.index}", daemon=True)
        self.wiring.threads.append(thread)
        thread.start()

    # -- the input thread --

    def _read_input(self, batches: Iterable[pa.RecordBatch]) -> None:
        """Read Spark's input (through the operators chained before the exchange) and hand whole batches to
        the loop; its wait for Spark is the loop's idle time when the producer starves (see
        :class:`~.loop.TaskLoop`)."""
        cpu = time.thread_time()
        loop, wiring = self.loop, self.wiring
        clock, inputs, stopping = loop.input_clock, loop.inputs, wiring.stopping.is_set
        try:
            injection = self.plan.injection
            if injection is not None:
                injection.maybe_fail(PRODUCER, self.index)
            iterator = _waited_for(batches, clock)
            if self.plan.before:
                iterator = apply_chain(self.plan.before, iterator)
            put = inputs.put
            for batch in iterator:
                if stopping():
                    return
                if batch.num_rows:
                    put(batch, stopping)
            inputs.end()
        except BaseException as exc:
            wiring.fail(exc)
        finally:
            self._producer_cpu_s = time.thread_time() - cpu

    # -- the Spark task thread --

    def _output(self, consumer: ConsumerEngine) -> Iterator[pa.RecordBatch]:
        """The consumer's output batches as the loop hands them on, through the operators chained after the
        exchange. The time the chained operators (and an injected slow consumer) work and the time Spark holds
        each batch yielded are clocked for the loop, which counts them as the consumer's busy and
        back-pressured time (see :class:`~.loop.TaskLoop`)."""
        loop, wiring = self.loop, self.wiring
        handoff, work, held = loop.outputs, loop.work_clock, loop.output_clock
        delay = self.plan.injection.delay_of(self.index) if self.plan.injection is not None else 0.0
        monotonic = time.monotonic
        transport = wiring.transport
        thread = getattr(transport, "_thread", None)

        def alive() -> bool:  # the task's failure is raised as it is; a loop that ended without one, named
            wiring.raise_if_failed()
            return thread is not None and thread.is_alive()

        def taken() -> Iterator[pa.RecordBatch]:
            take = handoff.take
            while True:
                work.end(monotonic())  # asking for more: a chained operator's work stops here
                batch = take(alive)
                work.begin(monotonic())
                if batch is None:
                    return
                if delay:  # a slow consumer (injected), working on what it took
                    wiring.pause(delay * batch.num_rows)
                yield batch

        outputs: Iterator[pa.RecordBatch] = taken()
        if self.plan.after:
            outputs = apply_chain(self.plan.after, outputs)
        try:
            for batch in outputs:
                now = monotonic()
                work.end(now)
                held.begin(now)
                yield batch
                now = monotonic()
                held.end(now)
                work.begin(now)
        finally:
            now = monotonic()
            work.end(now)
            held.end(now)

    # -- the end --

    def _metric_rows(self) -> list[MetricRow]:
        now = time.monotonic()
        rows: list[MetricRow] = []
        self.loop.sample_memory()
        producer, consumer = self.producer, self.consumer
        if producer is not None:
            rows.extend(producer.metric_rows(now))
            if self.wiring.checkpoint_trigger.enabled:
                rows.extend(self.wiring.checkpoint_trigger.metric_rows())
                rows.extend(self.wiring.checkpoint_trigger.rows)
        if consumer is not None:
            rows.extend(consumer.metric_rows(now))
        elif self.is_consumer:  # a consumer subtask without channels
            idle = TaskMetrics(CONSUMER, self.index)
            idle.count("numLatencyMarkersIn", 0)
            rows.extend(idle.rows())
            rows.extend(TimeAccount(self._wall_start).rows(CONSUMER, self.index, now))
        metrics = self._task_metrics
        metrics.count("taskCpuTimeMs", (time.process_time() - self._cpu_start) * 1000.0)
        # per thread: the Spark task thread (the chained operators after the exchange, the hand-over to Spark),
        # the input thread (Spark's input, the chained operators before) and the loop (everything else)
        main_cpu_s = time.thread_time() - self._main_cpu_start
        metrics.count("outputThreadCpuTimeMs", main_cpu_s * 1000.0)
        if self.is_producer:
            metrics.count("inputThreadCpuTimeMs", self._producer_cpu_s * 1000.0)
        io_cpu = thread_cpu_seconds(getattr(self.wiring.transport, "_thread", None))
        if io_cpu is not None:
            metrics.count("loopThreadCpuTimeMs", io_cpu * 1000.0)
        metrics.count("taskWallTimeMs", (time.monotonic() - self._wall_start) * 1000.0)
        metrics.count("taskAvailableCores", float(available_cores()))
        rows.extend(metrics.rows())
        where = str(self.executors[self.index]) if self.executors else self.host
        if self.is_producer:
            rows.append(executor_row(PRODUCER, self.index, where))
        if self.is_consumer:
            rows.append(executor_row(CONSUMER, self.index, where))
        with self.lock:
            if producer is not None:
                rows.extend(producer.timeline.timeline_rows())
            if consumer is not None:
                rows.extend(consumer.timeline.timeline_rows())
        return rows


def _drain(batches: Iterable[pa.RecordBatch], index: int) -> None:
    """Read the input of a task without a producer half to its end: it is empty (the input was placed on the
    producers' tasks), and Spark reuses a Python worker only once it read its task's input to the end (a
    worker left with unread input exits, and the next task waits for a new one to start: 1-2 s)."""
    for batch in batches:
        if batch.num_rows:
            raise CreditShuffleError(f"task {index} has no producer subtask but got {batch.num_rows} input rows")


def _waited_for(batches: Iterable[pa.RecordBatch], clock: ThreadClock) -> Iterator[pa.RecordBatch]:
    """``batches``, with the time spent waiting for each one on ``clock``."""
    iterator = iter(batches)
    monotonic = time.monotonic
    while True:
        clock.begin(monotonic())
        batch = next(iterator, None)
        clock.end(monotonic())
        if batch is None:
            return
        yield batch
