"""One pipelined task: producer subtask *i* and consumer subtask *i* driven by one thread, the Spark task's.

The rules (flush schedule, keep-alives, backpressure wait, silence timeouts, output linger, gauges) are the
task engine's (:mod:`~spark_credit_shuffle.engine`); this module supplies the clock, the loop and the
sockets. The Spark task thread does all the per-buffer work of both halves: it writes the input batches
through the RecordWriter, drives the task's non-blocking sockets
(:meth:`~spark_credit_shuffle.transport.tcp.TcpTransport.run_round`: read, decode, dispatch, write, accept),
takes what its gate holds, decodes it and yields the rows to Spark, and runs the engine's schedule (flusher,
keep-alives, latency markers, checkpoint barriers, debloating, samples) between two of these. When none has
work it waits in the sockets' ``select``, at most until the engine's next deadline; a socket, or the input
thread with a new batch, wakes it. A buffer is touched by one thread at each end of a connection: no hand-off
between threads per buffer, no condition to wait on, no contention for the interpreter lock among the
task's parts (the runtime before ran a producer, an I/O and a timer thread besides this one; this one
makes a sixth fewer Python calls and a third of the context switches per buffer, for about the same CPU:
docs/benchmarks.md, "One thread per task").

Besides a guard thread (below), one other thread pulls Spark's input iterator (:class:`InputReader`), at most
one batch ahead. Spark's ``next()`` blocks until the JVM has written the next input batch to the worker, for
as long as the stage before the exchange takes to compute it. Called in the task's thread, that wait would
stop everything else the task does: its consumer would not read (its producers, in other tasks, would stall
without credit), its flusher would not flush (a buffer timeout of 1 ms would wait for the next input instead),
and its keep-alives would not go out (its consumers fail after ``partition_request_timeout_ms`` of silence): a
slow input stage would become a failure. In a thread of its own the wait costs one hand-off per input batch
(some ten buffers at 32 KiB), and the input is back-pressured as in Flink: no batch is taken while the
partition's pool has no buffer, and the reader stops one batch ahead.

Why it cannot deadlock: the task's thread never waits for anything but its sockets and the input thread's
wake-up, always with a timeout no later than the engine's next deadline (silence, back-pressure, linger,
flush, checkpoint, the end); the input thread waits only for Spark's iterator and for the task's thread to
take its batch. Two more waits are not the task's: the set-up's blocking connects, and handing a batch to
Spark (``yield``), which takes as long as Spark takes to pass it on (one output batch, up to
``output_batch_rows`` rows). Meanwhile its producer half writes nothing, as a Flink task's mailbox thread does
not while its operator works; but its keep-alives must go on, or after ``partition_request_timeout_ms`` of
silence its consumers in other tasks would fail behind a slow Spark downstream, and its connections would
stand still while Spark works. So while the task's thread is away in Spark, a guard thread drives the task's
schedule and sockets in its place, until it comes back (:meth:`PipelinedTask._guard`): one hand-over per
output batch (some eight buffers), never two threads driving at once. The set-up (listening, the address
exchange, connecting) keeps the transport's I/O thread, because a TLS client's handshake blocks its thread
while the accepting task must answer it; once connected, the task's thread takes the sockets over
(:meth:`~spark_credit_shuffle.transport.tcp.TcpTransport.drive_inline`). The RecordWriter writes to the
partition without a lock: while the task's thread drives, nothing else touches it, and the guard acts only
while it holds the task (the driving lock the task's thread gives up while it is away); the other protocol
objects still take the task's one re-entrant lock, uncontended now (the set-up's I/O thread shares them).
Connections and the end of the task are in :mod:`~spark_credit_shuffle.runtime.wiring`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from ..buffers.reader import RecordReader
from ..config import ADDRESS_EXCHANGES
from ..engine import LINGER_OVER, ConsumerEngine, Fail, ProducerEngine, Settings, TimeAccount, Wait
from ..engine.checkpoints import ConsumerCheckpoints
from ..errors import ConfigError, CreditShuffleError, ExchangeTimeoutError
from ..metrics import CONSUMER, PRODUCER, MetricRow, TaskMetrics, executor_row
from ..protocol import BufferOrEvent, PipelinedResultPartition, SingleInputGate
from ..transport.tls import TlsIdentity
from .metrics_report import IN_BAND, MetricsReport
from .monitor import MonitorClient, watch
from .resources import rss_bytes
from .wiring import TaskWiring

if TYPE_CHECKING:
    from .plan import ExchangePlan

__all__ = ["MAX_WAIT_S", "InputReader", "PipelinedTask", "TaskOptions"]

#: The longest the task's thread waits in ``select`` at once (its deadlines are usually sooner).
MAX_WAIT_S = 1.0
INF = float("inf")


class InputReader:
    """Spark's input batches, pulled by a thread of their own at most ``depth`` batches ahead of the task's
    thread (see the module documentation for why). ``wakeup()`` tells the task's thread that a batch (or the
    end) is ready; :meth:`poll` takes a batch without waiting, :meth:`exhausted` says the input ended (and
    raises what the iterator raised, in the task's thread). Empty batches are skipped."""

    def __init__(
        self, batches: Iterable[pa.RecordBatch], wakeup: Callable[[], None], *, name: str, depth: int = 1
    ) -> None:
        self._batches = batches
        self._wakeup = wakeup
        self._depth = depth
        self._ready: deque[pa.RecordBatch] = deque()
        self._cond = threading.Condition()
        self._ended = False
        self._stopped = False
        self._wanted = False
        self._error: BaseException | None = None
        #: CPU seconds of the input thread (set when it ends).
        self.cpu_s = 0.0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """The task ends: the thread takes no more input (one blocked in Spark's iterator ends with it)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def poll(self) -> pa.RecordBatch | None:
        """The next input batch, if one is ready now."""
        if not self._ready:
            return None
        with self._cond:
            batch = self._ready.popleft()
            self._cond.notify()
        return batch

    def wanted(self) -> bool:
        """The task's thread is about to wait, and a batch should wake it: True if one is ready already (then
        it should not wait), else the next batch (or the end) wakes it. One wake-up per wait, not per batch."""
        with self._cond:
            if self._ready or self._ended:
                return True
            self._wanted = True
            return False

    def exhausted(self) -> bool:
        """True once every batch was taken and the input ended; raises the iterator's failure, if it failed."""
        if not self._ended or self._ready:
            return False
        if self._error is not None:
            raise self._error
        return True

    def _run(self) -> None:
        started = time.thread_time()
        cond, ready = self._cond, self._ready
        try:
            for batch in self._batches:
                if not batch.num_rows:
                    continue
                with cond:
                    # the task's thread takes a batch as soon as its pool has a buffer for it; this wait ends
                    # then, or when the task ends (stop)
                    while len(ready) >= self._depth and not self._stopped:
                        cond.wait(MAX_WAIT_S)
                    if self._stopped:
                        return
                    ready.append(batch)
                    wake, self._wanted = self._wanted, False
                if wake:
                    self._wakeup()
        except BaseException as exc:  # raised in the task's thread, after the batches before it
            self._error = exc
        finally:
            self.cpu_s = time.thread_time() - started
            with cond:
                self._ended = True
            self._wakeup()


class _Schedule:
    """The deadlines of the task's schedule kept by the task itself (the engines keep their own)."""

    __slots__ = ("next_checkpoint", "next_sample", "next_timeline")

    def __init__(self, next_sample: float, next_timeline: float, next_checkpoint: float) -> None:
        self.next_sample = next_sample
        self.next_timeline = next_timeline
        self.next_checkpoint = next_checkpoint


@dataclass(frozen=True)
class TaskOptions:
    """Knobs of a pipelined task that are not network settings.

    ``latency_interval_ms``: a producer sends a latency marker to one random channel this often (0: only
    the keep-alives every quarter of the partition request timeout). ``output_batch_rows``: the
    consumer joins decoded batches that are ready at the same moment up to this many rows before handing
    them to Spark (0: one output batch per network buffer). ``output_linger_ms``: how long the consumer waits
    for more rows when fewer than ``output_batch_rows`` are ready (each output batch costs Spark a fixed
    amount, as a network buffer costs Flink); None takes a tenth of the buffer timeout, at most 2 ms, none
    with timeout 0 and 2 ms with -1 (:class:`~.engine.Settings`). ``sample_memory_ms``: how often the timer
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
        self._wall_start = time.monotonic()
        self.wiring.consumer_done = not self.is_consumer
        self.wiring.producer_done = not self.is_producer
        self.producer: ProducerEngine | None = None
        self.consumer: ConsumerEngine | None = None
        inf = float("inf")
        self._schedule = _Schedule(inf, inf, inf)
        #: Held by the task's thread while it drives (released while it hands rows to Spark): the guard thread
        #: serves the schedule only while it holds this (see :meth:`_guard`).
        self._driving = threading.Lock()
        #: Set while the task's thread is away (handing rows to Spark); whether the guard drives meanwhile.
        self._left = threading.Event()
        self._guard_driving = False
        #: The producer half's state, shared by the task's thread and the guard (one at a time): it still
        #: writes, its input, and whether its writer stopped in the middle of an input batch (no buffer).
        self._producing = False
        self._source: InputReader | None = None
        self._writing = False
        if self.is_producer:
            self._setup_producer()
        if self.is_consumer:
            self._setup_consumer()

    # -- set-up --

    def _setup_producer(self) -> None:
        plan, config, index = self.plan, self.config, self.index
        consumers = plan.partitioner.consumers_of(index, plan.num_producers, plan.num_consumers)
        self.wiring.subpartition_consumers = consumers
        partition = PipelinedResultPartition.create(
            self.wiring.network, len(consumers), config, partition_id=self.wiring.partition_id, bounded=True
        )
        self.wiring.partition = partition
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
            resumable=True,
        )

    def _setup_consumer(self) -> None:
        plan, index = self.plan, self.index
        producers = plan.partitioner.producers_of(index, plan.num_producers, plan.num_consumers)
        self.wiring.channel_producers = producers
        if not producers:
            return
        remote = sum(1 for p in producers if not self.wiring.is_local(p))
        self.wiring.gate = SingleInputGate(self.wiring.network, len(producers), self.config, num_remote_channels=remote)
        checkpoints = (
            ConsumerCheckpoints(index, producers, time.time_ns, acknowledge=self.wiring.gate.acknowledge_checkpoint)
            if self.config.checkpoint_interval_ms > 0
            else None
        )
        readers = [RecordReader(plan.schema, channel=p, validate=p != index) for p in producers]
        self.consumer = ConsumerEngine(
            index, self.wiring.gate, readers, producers, self.settings, time.monotonic(), checkpoints=checkpoints
        )
        self.consumer.where = lambda producer: self.wiring.peers.get(producer, "?")
        self.consumer.detail = self.wiring.connection_detail
        self.wiring.consumer = self.consumer  # started when its channels are requested

    # -- the task --

    def run(
        self, batches: Iterable[pa.RecordBatch], all_gather: Callable[[str], list[str]]
    ) -> Iterator[pa.RecordBatch]:
        """Set up, exchange addresses, stream; yields the received rows, then reports the metrics."""
        source: InputReader | None = None
        try:
            if self.plan.monitor is not None:  # the live monitor: every timeline sample to the driver
                self.wiring.monitor = MonitorClient(self.plan.monitor, self.wiring.attempt_id)
                for engine in (self.producer, self.consumer):
                    if engine is not None:
                        watch(self.wiring.monitor, engine)
            self.wiring.start_transport()
            transport = self.wiring.transport
            assert transport is not None
            if self.producer is not None:
                with self.lock:  # the first answer to every partition request, before any data
                    self.producer.send_liveness_markers()
            if self.is_producer:
                source = InputReader(batches, transport.wakeup, name=f"credit-shuffle-input-{self.index}")
                self.wiring.threads.append(source.thread)
                source.start()
            else:
                _drain(batches, self.index)
            self.wiring.exchange_addresses(all_gather)
            transport.drive_inline(self.config.partition_request_timeout_ms / 1000.0)  # this thread's from now on
            self._driving.acquire()  # held while this thread drives; the guard serves the schedule when it is away
            self._start_guard()
            injection = self.plan.injection
            if injection is not None and self.is_producer:
                injection.maybe_fail(PRODUCER, self.index)
            if injection is not None and self.is_consumer:
                injection.maybe_fail(CONSUMER, self.index)
            yield from self._drive(source)
            yield from self.report.last(self.plan.schema, self._metric_rows(source))
        except BaseException as exc:
            if self.wiring.failed_at is None:  # before closing: peers see the close and fail after this task
                self.wiring.failed_at = time.monotonic()
            self.wiring.fail(exc)
            self.wiring.cause = exc
            remote = getattr(exc, "remote", None)
            if remote is not None:  # a producer's failure reached this consumer: raise that first cause
                raise remote from exc
            raise
        finally:
            if source is not None:
                source.stop()
            self.wiring.stopping.set()
            self._left.set()  # the guard wakes, sees the end and stops (joined in close)
            self.wiring.close()

    # -- the loop: producer, consumer, sockets and the engine's schedule in the task's thread --

    def _drive(self, source: InputReader | None) -> Iterator[pa.RecordBatch]:
        """The task's loop, until its producer finished, its consumer read every channel to its end and the
        exchange may end (:meth:`TaskWiring.end_step`). Each pass: one round of the sockets (waiting only
        when the last pass found nothing to do, and only until the engine's next deadline or until a socket
        or the input thread wakes it), the engine's schedule, everything the gate holds (decoded in order,
        the rows handed to Spark as they are ready), and one input batch written.

        The consumer returns the buffers it decoded, which may send credit (or, on a local channel, the
        producer's segment), together, and this thread writes what that made sendable itself before it
        writes input, waits or hands rows to Spark. With unaligned checkpoints a priority barrier still
        overtakes every buffer the consumer has not taken: the consumer takes one buffer at a time from the
        gate, and no socket is read between two of them. A buffer taken but not decoded when the loop ends (a
        failure, an early close) goes back to its pool."""
        wiring, lock = self.wiring, self.lock
        transport = wiring.transport
        assert transport is not None
        run_round, write_out = transport.run_round, transport.flush
        producer, consumer, gate = self.producer, self.consumer, wiring.gate
        monotonic, time_ns = time.monotonic, time.time_ns
        data = self.report.data
        delay = self.plan.injection.delay_of(self.index) if self.plan.injection is not None else 0.0
        trigger = wiring.checkpoint_trigger
        if producer is not None and trigger.enabled:  # the writer stops between two runs of rows when one is due
            producer.writer.interrupt = trigger.is_due
        start = monotonic()
        sample_every = self.settings.memory_sample_interval
        self._schedule = _Schedule(
            start if sample_every else float("inf"),
            start if self.settings.timeline_interval_ms > 0 else float("inf"),
            start + trigger.seconds_until_next() if trigger.enabled else float("inf"),
        )
        consuming = consumer is not None and gate is not None
        self._producing = producer is not None
        self._source = source
        if producer is not None:
            assert source is not None
            with lock:  # the producer's first timeline sample
                self._record_producer_sample(monotonic())
        if consumer is not None:
            if consuming:
                with lock:  # the consumer's first timeline sample
                    self._record_consumer_sample(monotonic())
            else:
                consumer.time.stop(monotonic())
        wiring.consumer_done = not consuming
        returned: list[Callable[[], None]] = []  # the recycles of the buffers decoded since the last flush
        give_back = returned.append
        taken: BufferOrEvent | None = None  # polled from the gate, not yet decoded

        def flush() -> None:
            if returned:
                with lock:
                    for recycle in returned:
                        recycle()
                returned.clear()
                wiring.last_progress = monotonic()  # segments came back (the back-pressure timeout's progress)
            write_out()

        timeout: float | None = 0.0
        try:
            while True:
                run_round(timeout)
                wiring.raise_if_failed()
                now = monotonic()
                busy = False
                due = self._on_schedule(now)
                # the consumer: everything its gate holds now, its rows to Spark as they are ready
                if consuming:
                    assert consumer is not None
                    output = consumer.output
                    wall_ns = time_ns()
                    while True:
                        with lock:
                            try:
                                step = consumer.next(now, output.linger_until)
                            except Exception as exc:
                                raise wiring.channel_error(exc) from exc
                        if type(step) is BufferOrEvent:
                            taken = step
                            busy = True
                            if consumer.time.idle_since is not None:  # an idle stretch of the gate ends
                                self._consumer_active(consumer, now)
                            recycler = step.buffer.detach_recycler()  # returned with the others, at the next flush
                            if recycler is not None:
                                give_back(recycler)
                            taken = None
                            batches, resume = consumer.take(step, wall_ns)
                            if resume:
                                self._resume(consumer, resume)
                                flush()
                            for batch in batches:
                                if delay:  # a slow consumer (injected): what it returned goes out before it works
                                    flush()
                                    self._away(time.sleep, delay * batch.num_rows)
                                output.add(batch)
                            moment = monotonic()
                            ready = output.ready(step.more_available, moment)
                            if ready is not None:
                                flush()
                                yield from self._hand_on(data(ready))
                                break  # the sockets and the producer waited meanwhile: their turn
                            if moment >= due:  # the schedule is due (a slow consumer): its turn first
                                busy = True
                                break
                            continue
                        if step is None:  # every channel ended
                            consuming = False
                            self._consumer_active(consumer, now)
                            flush()
                            if output.pending:
                                yield from self._hand_on(data(output.take()))
                            end = monotonic()
                            with lock:  # the consumer's last timeline sample
                                self._record_consumer_sample(end)
                            wiring.consumer_done = True
                            consumer.time.stop(end)
                            busy = True
                            break
                        if step is LINGER_OVER:  # nothing more came while the pending rows waited: hand them on
                            flush()
                            yield from self._hand_on(data(output.take()))
                            busy = True
                            break
                        if isinstance(step, Fail):
                            raise step.error
                        assert isinstance(step, Wait)
                        if consumer.time.idle_since is None:  # the gate is empty: the consumer is idle
                            consumer.time.idle_since = now
                        due = min(due, step.until)
                        break
                    flush()
                # the producer: one input batch, or on with the one the writer stopped in
                if self._producing:
                    did, until = self._produce_step(now, wait_for_input=not busy)
                    busy = busy or did
                    due = min(due, until)
                if not self._producing and not consuming:
                    step_end = wiring.end_step(now)
                    if step_end is None:
                        return
                    if isinstance(step_end, Fail):
                        raise step_end.error
                    due = min(due, step_end.until)
                timeout = 0.0 if busy else min(MAX_WAIT_S, max(0.0, due - monotonic()))
        finally:  # a failure or an early close: no buffer stays out of its pool
            if taken is not None:
                recycler = taken.buffer.detach_recycler()
                if recycler is not None:
                    give_back(recycler)
            if returned:
                with lock:
                    for recycle in returned:
                        recycle()

    def _produce_step(self, now: float, *, wait_for_input: bool) -> tuple[bool, float]:
        """The producer's turn (the task's thread, or the guard while it is away): write on in the batch the
        writer stopped in, or write the next input batch, or finish at the end of the input. Returns whether it
        did something, and until when it may wait (back-pressure's timeout); ``wait_for_input``: nothing else
        is to be done, so the input thread should wake this one with its next batch."""
        producer, source, lock = self.producer, self._source, self.lock
        assert producer is not None and source is not None
        trigger = self.wiring.checkpoint_trigger
        if not producer.is_available():  # back-pressure: wait for a buffer of the pool
            return False, self._back_pressured(producer, now, hard=self._writing)
        self._end_back_pressure(producer, now)
        if self._writing:
            with self._sending():
                done = producer.resume()
                while not done and trigger.enabled and trigger.is_due():
                    self._inject_due_checkpoint(producer)
                    done = producer.resume()
            self._writing = not done
            with lock:
                producer.sample_output()
            return True, INF
        batch = source.poll()
        if batch is not None:
            self._producer_active(producer, now)
            with self._sending():
                done = producer.write(batch)
                while not done and trigger.enabled and trigger.is_due():  # stopped between two runs: the barrier now
                    self._inject_due_checkpoint(producer)
                    done = producer.resume()
            self._writing = not done
            with lock:
                producer.sample_output()
            return True, INF
        if source.exhausted():  # the end of the input (raises the input's failure)
            self._producer_active(producer, now)
            self._finish_producer(producer)
            self._producing = False
            return True, INF
        if producer.time.idle_since is None:  # waiting for Spark's next input batch
            producer.time.idle_since = now
        return bool(wait_for_input and source.wanted()), INF  # a batch that came meanwhile: no wait

    def _hand_on(self, batch: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
        """Hand ``batch`` to Spark; while Spark takes it, the guard drives the task (see :meth:`_guard`)."""
        self._leave()
        try:
            yield batch
        finally:
            self._take_back()

    def _away(self, work: Callable[[float], None], seconds: float) -> None:
        """Run ``work(seconds)`` (an injected slow consumer's work) as time away from driving, as a hand-on."""
        self._leave()
        try:
            work(seconds)
        finally:
            self._take_back()

    def _leave(self) -> None:
        """The task's thread leaves its loop (to hand rows to Spark): the guard may drive meanwhile."""
        self._driving.release()
        self._left.set()

    def _take_back(self) -> None:
        """The task's thread comes back: the guard leaves its ``select`` and ends its round, then this thread
        drives again."""
        self._left.clear()
        transport = self.wiring.transport
        if self._guard_driving and transport is not None:
            transport.interrupt()
        if not self._driving.acquire(timeout=self.settings.silence_timeout):
            raise ExchangeTimeoutError(
                f"task {self.index}: its guard thread held the task's sockets longer than "
                f"partition_request_timeout_ms={self.config.partition_request_timeout_ms}"
            )

    def _start_guard(self) -> None:
        thread = threading.Thread(target=self._guard, name=f"credit-shuffle-guard-{self.index}", daemon=True)
        self.wiring.threads.append(thread)
        thread.start()

    def _guard(self) -> None:
        """While the task's thread is away from its loop, handing rows to Spark (or working as an injected slow
        consumer), this thread drives the task in its place: the schedule (flusher, keep-alives, barriers,
        samples) and the sockets (what arrives is read into the gate, credit that arrives lets data out), waiting
        in ``select`` until the next deadline or until the task's thread comes back. Without it, no keep-alive
        would go out while Spark takes a batch (after ``partition_request_timeout_ms`` of silence this task's
        consumers in other tasks would fail behind a slow downstream), and the task's connections would stand
        still while Spark works, where Spark's own work could overlap them. It never writes input or
        consumes, and it runs only while it holds the driving lock, which the task's thread gives up while it
        is away: the task is driven by one thread at a time."""
        wiring, transport, left = self.wiring, self.wiring.transport, self._left
        assert transport is not None
        period = self.settings.heartbeat_interval
        try:
            while not wiring.stopping.is_set():
                if not left.wait(period) or not self._driving.acquire(blocking=False):
                    continue  # the task's thread drives
                try:
                    self._guard_driving = True  # before looking at ``left``: see _take_back
                    while left.is_set() and not wiring.stopping.is_set():
                        now = time.monotonic()
                        due = self._on_schedule(now)
                        did = False
                        if self._producing:
                            did, until = self._produce_step(now, wait_for_input=True)
                            due = min(due, until)
                        transport.run_round(0.0 if did else min(MAX_WAIT_S, max(0.0, due - now)))
                finally:
                    self._guard_driving = False
                    self._driving.release()
        except BaseException as exc:
            wiring.fail(exc)

    @staticmethod
    def _consumer_active(consumer: ConsumerEngine, now: float) -> None:
        """Data (or the end) reached the consumer: an idle stretch of its gate ends."""
        clock = consumer.time
        if clock.idle_since is not None:
            clock.idle += now - clock.idle_since
            clock.idle_since = None

    @staticmethod
    def _producer_active(producer: ProducerEngine, now: float) -> None:
        """An input batch (or the input's end) reached the producer: its wait for input ends."""
        clock = producer.time
        if clock.idle_since is not None:
            clock.idle += now - clock.idle_since
            clock.idle_since = None

    def _back_pressured(self, producer: ProducerEngine, now: float, *, hard: bool) -> float:
        """Back-pressure (Flink's ``isAvailable``): the partition's pool has no buffer. Soft before the next
        input, ``hard`` in the middle of one. Returns until when the engine allows the wait; raises its timeout
        (``buffers_request_timeout_ms`` without progress)."""
        if producer.waiting_since is None:
            producer.begin_wait(now, hard=hard)
        step = producer.check_wait(now, self.wiring.last_progress, self.wiring.describe_buffer_wait)
        if isinstance(step, Fail):
            raise step.error
        return step.until

    @staticmethod
    def _end_back_pressure(producer: ProducerEngine, now: float) -> None:
        if producer.waiting_since is not None:
            producer.end_wait(now)

    def _finish_producer(self, producer: ProducerEngine) -> None:
        """The input ended: the open buffers and the end of partition go out, the partition closes."""
        transport, partition = self.wiring.transport, self.wiring.partition
        assert transport is not None and partition is not None
        with transport.sending():
            producer.finish()
        with self.lock:
            producer.sample_output()
            partition.close()
            now = time.monotonic()
            self._record_producer_sample(now)
            self.wiring.producer_done = True
            producer.time.stop(now)

    def _inject_due_checkpoint(self, producer: ProducerEngine) -> None:
        """Between two runs of rows of a batch, the checkpoint barrier that is due goes in (so that a long
        write does not hold it back until the batch is written)."""
        trigger = self.wiring.checkpoint_trigger
        with self.lock:
            if trigger.is_due():
                producer.writer.broadcast_event(trigger.next_barrier())

    # -- the engine's schedule: flusher, keep-alives, latency markers, checkpoint barriers, samples --

    def _on_schedule(self, now: float) -> float:
        """Do what the schedule has due at ``now`` (between two input batches, or while the writer waits in one
        for a buffer); returns the schedule's next deadline."""
        wiring, producer, consumer = self.wiring, self.producer, self.consumer
        trigger = wiring.checkpoint_trigger
        schedule = self._schedule
        sample_every = self.settings.memory_sample_interval
        if sample_every is not None and now >= schedule.next_sample:
            self._sample_memory()
            schedule.next_sample = max(schedule.next_sample + sample_every, now)
        if now >= schedule.next_timeline:
            schedule.next_timeline = max(schedule.next_timeline + self._sample_timeline(now), now)
        due = min(schedule.next_sample, schedule.next_timeline)
        debloat = consumer.debloat if consumer is not None and not wiring.consumer_done else None
        if debloat is not None and wiring.gate is not None:
            if now >= debloat.next_at:
                with self._sending(), self.lock:  # the size goes to every producer (NewBufferSize)
                    debloat.on_timer(now)
            due = min(due, debloat.next_at)
        if producer is None or (not trigger.enabled and producer.is_finished):
            return due
        if not producer.is_finished:
            if now >= producer.next_timer() or now >= schedule.next_checkpoint or now >= trigger.timeout_at:
                with self._sending(), self.lock:
                    producer.on_timer(now, time.time_ns())
                    if now >= schedule.next_checkpoint:  # between two records (see checkpoint barriers)
                        if trigger.is_due():
                            producer.writer.broadcast_event(trigger.next_barrier())
                        schedule.next_checkpoint = now + trigger.seconds_until_next()
                    timed_out = trigger.timed_out(now)
                    if timed_out is not None:  # a barrier still queued overtakes as unaligned
                        producer.partition.aligned_barrier_timeout(timed_out)
            return min(due, producer.next_timer(), schedule.next_checkpoint, trigger.timeout_at)
        # a finished producer whose output a consumer still reads injects unaligned barriers on
        if trigger.options.is_unaligned and producer.takes_part_in_checkpoints_after_finish():
            if now >= schedule.next_checkpoint:
                with self._sending(), self.lock:
                    if trigger.is_due():
                        producer.inject_after_finish(trigger.next_barrier())
                    schedule.next_checkpoint = now + trigger.seconds_until_next()
            return min(due, schedule.next_checkpoint)
        return due

    def _sample_memory(self) -> None:
        rss = rss_bytes()
        if rss:
            self._task_metrics.sample("taskRssBytes", float(rss))
        self._task_metrics.sample("taskArrowAllocatedBytes", float(pa.total_allocated_bytes()))
        # the task's network buffers in use: Flink's Status.Shuffle.Netty.UsedMemorySegments, per task here
        self._task_metrics.sample("usedMemorySegments", float(self.wiring.network.num_used))

    # -- timeline (lock held) --

    def _record_producer_sample(self, now: float) -> None:
        producer = self.producer
        assert producer is not None
        credits = self.wiring.remote_credits()
        producer.timeline.record(lambda: producer.gauges(now, credits), now, time.time() * 1000.0)

    def _record_consumer_sample(self, now: float) -> None:
        consumer = self.consumer
        assert consumer is not None
        consumer.timeline.record(lambda: consumer.gauges(now), now, time.time() * 1000.0)

    def _sample_timeline(self, now: float) -> float:
        """One timeline sample of each side still running; returns the seconds until the next one
        (``inf`` once both sides ended or sampling is off)."""
        intervals = []
        producer, consumer = self.producer, self.consumer
        with self.lock:
            if producer is not None and not self.wiring.producer_done and producer.timeline.interval > 0:
                self._record_producer_sample(now)
                intervals.append(producer.timeline.interval)
            if consumer is not None and not self.wiring.consumer_done and consumer.timeline.interval > 0:
                if consumer.gate_gauges is not None:  # channels requested
                    self._record_consumer_sample(now)
                intervals.append(consumer.timeline.interval)
        return min(intervals, default=float("inf"))

    def _sending(self) -> AbstractContextManager[None]:
        """The transport's sending block (see :meth:`TcpTransport.sending`): what it made sendable is written
        at its end."""
        transport = self.wiring.transport
        assert transport is not None, "the task's transport is started before anything is sent"
        return transport.sending()

    def _resume(self, consumer: ConsumerEngine, channels: tuple[int, ...]) -> None:
        """ResumeConsumption on ``channels`` (their subpartitions blocked themselves after an aligned barrier)."""
        if not channels:
            return
        with self._sending(), self.lock:
            for channel in channels:
                consumer.gate.resume_consumption(channel)
            consumer.resumed(channels, time.monotonic())

    # -- the end --

    def _metric_rows(self, source: InputReader | None) -> list[MetricRow]:
        now = time.monotonic()
        rows: list[MetricRow] = []
        self._sample_memory()
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
        # the task's thread does the per-buffer work of both halves; the input thread pulls Spark's input, the
        # I/O thread ran the set-up's sockets
        metrics.count("taskThreadCpuTimeMs", (time.thread_time() - self._main_cpu_start) * 1000.0)
        if source is not None:
            metrics.count("inputThreadCpuTimeMs", source.cpu_s * 1000.0)
        if self.wiring.transport is not None:
            metrics.count("ioThreadCpuTimeMs", self.wiring.transport.thread_cpu_s * 1000.0)
        metrics.count("taskWallTimeMs", (time.monotonic() - self._wall_start) * 1000.0)
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
