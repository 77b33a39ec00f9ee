"""One pipelined task: producer subtask *i* and consumer subtask *i* as threads and sockets around the engine.

The rules (flush schedule, keep-alives, backpressure wait, silence timeouts, output linger, gauges) are the
task engine's (:mod:`~spark_credit_shuffle.engine`); this module supplies the clock, the threads and
the sockets: one consumer thread decodes what the gate delivers and runs the operators chained after the
exchange, handing whole output batches to the Spark task thread that yields them (a bounded hand-over: its
wait is the consumer's back-pressured time), one producer thread feeds the input batches (through the
operators chained before the exchange) to the RecordWriter, one I/O thread drives every socket
(:class:`~spark_credit_shuffle.transport.tcp.TcpTransport`) and one timer thread wakes the engine's
schedule (flusher, keep-alives, latency markers, checkpoint barriers, samples). All protocol objects of a
task are guarded by one re-entrant lock; the writer by a lock of its own, so that the flusher takes turns
with the producer as in Flink's mailbox. Where the task waits, the engine says until when, or with which
error it gives up. Connections and the end of the task are in :mod:`~spark_credit_shuffle.runtime.pipelined.wiring`.
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

from ...buffers.reader import RecordReader
from ...config import ADDRESS_EXCHANGES
from ...engine import ConsumerEngine, Fail, LingerOver, ProducerEngine, Settings, TimeAccount, Wait
from ...engine.checkpoints import ConsumerCheckpoints
from ...errors import ConfigError, CreditShuffleError
from ...metrics import CONSUMER, PRODUCER, MetricRow, TaskMetrics, executor_row
from ...protocol import BufferOrEvent, PipelinedResultPartition, SingleInputGate
from ...transport.tls import TlsIdentity
from ..blocking.input import timed_batches
from ..chain import apply_chain
from ..handoff import OutputHandoff
from ..metrics_report import IN_BAND, MetricsReport
from ..monitor import MonitorClient, watch
from ..resources import available_cores, rss_bytes, thread_cpu_seconds
from .locked_partition import LockedPartition
from .wiring import TaskWiring

if TYPE_CHECKING:
    from ..exchange_plan import ExchangePlan

__all__ = ["BURST", "PipelinedTask", "TaskOptions"]

#: The most buffers and events the consumer takes from its gate under one taking of the task's lock. With
#: unaligned (or timeoutable) checkpoints it takes one at a time: a priority barrier overtakes only what is
#: still in the gate, and a burst already taken would hold it back behind a slow consumer's work.
BURST = 64


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
        self.lock, self.cond, self.writer_lock = wiring.lock, wiring.cond, wiring.writer_lock
        self.consumer_cond, self.producer_cond = wiring.consumer_cond, wiring.producer_cond
        self._task_metrics = TaskMetrics(CONSUMER if self.is_consumer else PRODUCER, index)
        self._cpu_start = time.process_time()
        self._main_cpu_start = time.thread_time()
        self._producer_cpu_s = 0.0
        self._consumer_cpu_s = 0.0
        self._wall_start = time.monotonic()
        self.wiring.consumer_done = not self.is_consumer
        self.wiring.producer_done = not self.is_producer
        self.producer: ProducerEngine | None = None
        self.consumer: ConsumerEngine | None = None
        trigger = wiring.checkpoint_trigger
        #: The most buffers the consumer takes from its gate at once (see :data:`BURST`).
        unaligned = trigger.options.is_unaligned or trigger.options.is_timeoutable
        self._burst = 1 if trigger.enabled and unaligned else BURST
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
        partition.buffer_pool.add_availability_listener(self.wiring.notify_producer)
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
            partition_writer=LockedPartition(partition, self.lock, self._on_recycle),
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
        self.wiring.gate.listener = self.wiring.notify_consumer
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

    # -- notifications (lock held) --

    def _on_recycle(self) -> None:
        """A segment came back (lock held): progress, and the producer may be waiting for it."""
        self.wiring.last_progress = time.monotonic()
        if self.producer is not None and self.producer.waiting_since is not None:
            self.producer_cond.notify()

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
        try:
            if self.plan.monitor is not None:  # the live monitor: every timeline sample to the driver
                self.wiring.monitor = MonitorClient(self.plan.monitor, self.wiring.attempt_id)
                for engine in (self.producer, self.consumer):
                    if engine is not None:
                        watch(self.wiring.monitor, engine)
            self.wiring.start_transport()
            if self.producer is not None:
                with self.writer_lock, self.lock:  # the first answer to every partition request, before any data
                    self.producer.send_liveness_markers()
            self._start_thread(self._timer, "timer")
            if self.is_producer:
                self._start_thread(lambda: self._produce(batches), "producer")
            else:
                _drain(batches, self.index)
            self.wiring.exchange_addresses(all_gather)
            injection = self.plan.injection
            if injection is not None and self.is_consumer:
                injection.maybe_fail(CONSUMER, self.index)
            consumer = self.consumer
            data = self.report.data
            if consumer is not None and self.wiring.gate is not None:
                with self.lock:  # the consumer's first timeline sample
                    self._record_consumer_sample(time.monotonic())
                for batch in self._handed_on(consumer):
                    yield data(batch)
                with self.lock:  # the consumer's last timeline sample
                    self._record_consumer_sample(time.monotonic())
            elif self.is_consumer and self.plan.after:  # no channel: the chained operators see an empty input
                for batch in apply_chain(self.plan.after, iter(())):
                    yield data(batch)
            self.wiring.consumer_done = True
            if consumer is not None:
                consumer.time.stop(time.monotonic())
            self.wiring.await_end()
            rows = self._metric_rows()  # the task's own time: the wait for the others below is not in it
            if end is not None:
                end(self.wiring.address_group)
            yield from self.report.last(self.plan.output_schema, rows)
        except BaseException as exc:
            if self.wiring.failed_at is None:  # before closing: peers see the close and fail after this task
                self.wiring.failed_at = time.monotonic()
            self.wiring.cause = exc
            remote = getattr(exc, "remote", None)
            if remote is not None:  # a producer's failure reached this consumer: raise that first cause
                raise remote from exc
            raise
        finally:
            self.wiring.close()

    def _sending(self) -> AbstractContextManager[None]:
        """The transport's sending block (see :meth:`TcpTransport.sending`); the transport runs once set up."""
        transport = self.wiring.transport
        assert transport is not None, "the task's transport is started before any thread that sends"
        return transport.sending()

    def _start_thread(self, target: Callable[[], None], role: str) -> None:
        thread = threading.Thread(target=target, name=f"credit-shuffle-{role}-{self.index}", daemon=True)
        self.wiring.threads.append(thread)
        thread.start()

    # -- producer half (producer thread) --

    def _produce(self, batches: Iterable[pa.RecordBatch]) -> None:
        producer = self.producer
        assert producer is not None and self.wiring.transport is not None and self.wiring.partition is not None
        clock = producer.time
        sending = self.wiring.transport.sending
        deferred = self.wiring.consumer_wakeups_deferred  # one wake-up of the consumer per input batch written
        thread_cpu = time.thread_time()
        trigger = self.wiring.checkpoint_trigger
        barrier_due = trigger.is_due if trigger.enabled else (lambda: False)
        if trigger.enabled:  # the writer stops between two runs of rows when a checkpoint is due
            producer.writer.interrupt = trigger.is_due
        try:
            injection = self.plan.injection
            if injection is not None:
                injection.maybe_fail(PRODUCER, self.index)
            with self.lock:  # the producer's first timeline sample, whether or not its timer runs before the end
                self._record_producer_sample(time.monotonic())
            # the wait for Spark's next input batch is idle time; a chained operator's work is busy time
            iterator = timed_batches(batches, clock)
            if self.plan.before:
                iterator = apply_chain(self.plan.before, iterator)
            while not self.wiring.stopping.is_set():
                batch = next(iterator, None)
                if batch is None:
                    break
                if not batch.num_rows:
                    continue
                # the writer stops at the first buffer its pool cannot give; wait, then write on from there
                self._await_buffer(producer)
                with sending(), self.writer_lock, deferred():
                    done = producer.write(batch)
                    while not done and barrier_due():  # stopped between two runs: the barrier goes in now
                        self._inject_due_checkpoint(producer)
                        done = producer.resume()
                while not done:
                    with self.lock:
                        producer.sample_output()
                    self._await_buffer(producer, hard=True)  # in the middle of an input: hard back-pressure
                    with sending(), self.writer_lock, deferred():
                        done = producer.resume()
                        while not done and barrier_due():
                            self._inject_due_checkpoint(producer)
                            done = producer.resume()
                with self.lock:
                    producer.sample_output()
            with sending(), self.writer_lock:
                producer.finish()
            with self.cond:
                producer.sample_output()
                self.wiring.partition.close()
                now = time.monotonic()
                self._record_producer_sample(now)
                self.wiring.producer_done = True
                clock.stop(now)
                self._producer_cpu_s = time.thread_time() - thread_cpu
                self.cond.notify_all()
        except BaseException as exc:
            self.wiring.fail(exc)

    def _inject_due_checkpoint(self, producer: ProducerEngine) -> None:
        """The producer thread, holding the writer between two runs of rows of a batch, injects the checkpoint
        barrier that is due (so a long write does not hold it back until the timer thread gets the writer)."""
        trigger = self.wiring.checkpoint_trigger
        with self.lock:
            if trigger.is_due():
                producer.writer.broadcast_event(trigger.next_barrier())

    def _await_buffer(self, producer: ProducerEngine, *, hard: bool = False) -> None:
        """Back-pressure: wait until the partition's pool has a buffer (Flink's ``isAvailable``), as long as
        the engine allows; before the next input (soft) or, ``hard``, in the middle of one. Every recycled
        segment wakes this wait (``_on_recycle``)."""
        if producer.is_available():
            return
        with self.producer_cond:
            producer.begin_wait(time.monotonic(), hard=hard)
            try:
                while not producer.is_available():
                    self.wiring.raise_if_failed()
                    if self.wiring.stopping.is_set():
                        raise CreditShuffleError("task stopping")
                    now = time.monotonic()
                    step = producer.check_wait(now, self.wiring.last_progress, self.wiring.describe_buffer_wait)
                    if isinstance(step, Fail):
                        raise step.error
                    self.producer_cond.wait(step.until - now)
            finally:
                producer.end_wait(time.monotonic())

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

    # -- timer thread: the engine's schedule, checkpoint barriers, memory samples --

    def _timer(self) -> None:
        settings, producer, trigger, consumer = (
            self.settings,
            self.producer,
            self.wiring.checkpoint_trigger,
            self.consumer,
        )
        inf = float("inf")
        now = time.monotonic()
        next_checkpoint = now + trigger.seconds_until_next() if trigger.enabled else inf
        sample_every = settings.memory_sample_interval
        next_sample = now if sample_every else inf
        next_timeline = now if settings.timeline_interval_ms > 0 else inf
        try:
            while True:
                producing = producer is not None and not producer.is_finished
                # a finished producer whose output a consumer still reads injects unaligned barriers on
                finishing = (
                    not producing
                    and producer is not None
                    and trigger.enabled
                    and trigger.options.is_unaligned
                    and producer.takes_part_in_checkpoints_after_finish()
                )
                due = min(next_sample, next_timeline)
                debloat = consumer.debloat if consumer is not None and not self.wiring.consumer_done else None
                if debloat is not None:
                    due = min(due, debloat.next_at)
                if producing:
                    assert producer is not None
                    due = min(due, producer.next_timer(), next_checkpoint, trigger.timeout_at)
                elif finishing:
                    due = min(due, next_checkpoint)
                if due == inf:
                    due = now + 1.0
                if self.wiring.stopping.wait(max(0.0, due - time.monotonic())):
                    return
                now = time.monotonic()
                if sample_every is not None and now >= next_sample:
                    self._sample_memory()
                    next_sample = max(next_sample + sample_every, now)
                if now >= next_timeline:
                    next_timeline = max(next_timeline + self._sample_timeline(now), now)
                if debloat is not None and now >= debloat.next_at and self.wiring.gate is not None:
                    with self._sending(), self.lock:  # the size goes to every producer (NewBufferSize)
                        # the time read under the lock: the consumer may have measured data after ``now`` while
                        # this thread waited for the lock, and a throughput measured backwards is refused
                        debloat.on_timer(max(now, time.monotonic()))
                if finishing and producer is not None and now >= next_checkpoint:
                    with self._sending(), self.lock:
                        trigger.inject_after_finish(producer.inject_after_finish)  # counted if one took it
                        next_checkpoint = now + trigger.seconds_until_next()
                if not producing or producer is None:
                    continue
                with self._sending(), self.writer_lock:
                    if producer.is_finished:
                        continue
                    with self.lock:
                        producer.on_timer(now, time.time_ns())
                        if now >= next_checkpoint:  # between two records (see checkpoint barriers)
                            if trigger.is_due():
                                producer.writer.broadcast_event(trigger.next_barrier())
                            next_checkpoint = now + trigger.seconds_until_next()
                        timed_out = trigger.timed_out(now)
                        if timed_out is not None:  # a barrier still queued overtakes as unaligned
                            producer.partition.aligned_barrier_timeout(timed_out)
        except BaseException as exc:
            self.wiring.fail(exc)

    def _sample_memory(self) -> None:
        rss = rss_bytes()
        if rss:
            self._task_metrics.sample("taskRssBytes", float(rss))
        self._task_metrics.sample("taskArrowAllocatedBytes", float(pa.total_allocated_bytes()))
        # the task's network buffers in use: Flink's Status.Shuffle.Netty.UsedMemorySegments, per task here
        self._task_metrics.sample("usedMemorySegments", float(self.wiring.network.num_used))

    # -- consumer half (the task thread) --

    def _handed_on(self, consumer: ConsumerEngine) -> Iterator[pa.RecordBatch]:
        """The consumer's output (through the chained operators), decoded on the consumer thread and yielded
        here, on the Spark task thread, through a bounded :class:`~.handoff.OutputHandoff`: the consumer's
        wait for room there is its back-pressured time (the output not taken)."""
        handoff = OutputHandoff()
        self._start_thread(lambda: self._consumer_thread(consumer, handoff), "consumer")
        thread = self.wiring.threads[-1]
        take, alive = handoff.take, thread.is_alive
        while (batch := take(alive)) is not None:
            yield batch

    def _consumer_thread(self, consumer: ConsumerEngine, handoff: OutputHandoff) -> None:
        """Decode, run the chained operators, hand the output on; the end or the failure goes to ``handoff``."""
        cpu = time.thread_time()
        stopping = self.wiring.stopping.is_set
        lock = self.lock

        def on_wait() -> None:
            with lock:
                consumer.begin_output_wait(time.monotonic())

        def on_taken() -> None:
            with lock:
                consumer.end_output_wait(time.monotonic())

        try:
            outputs: Iterator[pa.RecordBatch] = self._consume(consumer)
            if self.plan.after:
                outputs = apply_chain(self.plan.after, outputs)
            put = handoff.put
            for batch in outputs:
                put(batch, stopping, on_wait, on_taken)
            handoff.close(stopping, on_wait, on_taken)
        except BaseException as exc:
            handoff.fail(exc)
        finally:
            self._consumer_cpu_s = time.thread_time() - cpu

    def _consume(self, consumer: ConsumerEngine) -> Iterator[pa.RecordBatch]:
        """The consumer loop. It takes what the gate holds in bursts (every buffer and event there, up to
        :data:`BURST`, under one taking of the task's lock: the lock the I/O and producer threads contend for)
        and decodes them in order outside the lock. Returning a buffer may send credit (or, on a local
        channel, the producer's segment): the buffers decoded since the last time go back together, under one
        taking of the lock, and this thread writes what that made sendable itself, just before it waits for
        data or hands rows to Spark (one write per burst instead of one per buffer). Their credit is announced
        at that moment either way, and none is held over a wait, so the senders see the same credit as
        before. A burst polled but not decoded when the loop ends (a failure, an early close) goes back too."""
        delay = self.plan.injection.delay_of(self.index) if self.plan.injection is not None else 0.0
        lock = self.lock
        output = consumer.output
        add, ready_now = output.add, output.ready
        take = consumer.take
        transport = self.wiring.transport
        assert transport is not None
        write = transport.flush
        returned: list[Callable[[], None]] = []  # the recycles of the buffers decoded since the last flush
        give_back = returned.append
        burst: deque[BufferOrEvent] = deque()  # polled from the gate, not yet decoded
        next_of_burst = burst.popleft
        monotonic, time_ns = time.monotonic, time.time_ns
        wall_ns = 0

        def recycle_returned() -> None:
            if returned:
                with lock:
                    for recycle in returned:
                        recycle()
                returned.clear()

        def flush() -> None:
            recycle_returned()
            write()

        with self._sending():  # what the recycles make sendable waits for flush(), not for the I/O thread
            try:
                while True:
                    if not burst:
                        polled_burst = self._next_burst(consumer, output.linger_until, flush)
                        if type(polled_burst) is not list:
                            if polled_burst is None:
                                break
                            flush()  # nothing more came while the pending rows waited: hand them on
                            yield output.take()
                            continue
                        burst.extend(polled_burst)
                        wall_ns = time_ns()
                    polled = next_of_burst()
                    recycler = polled.buffer.detach_recycler()  # returned with the others, at the next flush
                    if recycler is not None:
                        give_back(recycler)
                    batches, resume = take(polled, wall_ns)
                    if resume:
                        self._resume(consumer, resume)
                        flush()
                    for batch in batches:
                        if delay:  # a slow consumer (injected): what it returned goes out before it works
                            flush()
                            self.wiring.pause(delay * batch.num_rows)
                        add(batch)
                    ready = ready_now(polled.more_available, monotonic())
                    if ready is not None:
                        flush()
                        yield ready
                flush()
                if output.pending:
                    yield output.take()
            finally:  # a failure or an early close: no buffer stays out of its pool
                for polled in burst:
                    recycler = polled.buffer.detach_recycler()
                    if recycler is not None:
                        give_back(recycler)
                recycle_returned()

    def _resume(self, consumer: ConsumerEngine, channels: tuple[int, ...]) -> None:
        """ResumeConsumption on ``channels`` (their subpartitions blocked themselves after an aligned barrier)."""
        if not channels:
            return
        with self._sending(), self.lock:
            for channel in channels:
                consumer.gate.resume_consumption(channel)
            consumer.resumed(channels, time.monotonic())

    def _next_burst(
        self, consumer: ConsumerEngine, linger_until: float | None, before_wait: Callable[[], None]
    ) -> list[BufferOrEvent] | LingerOver | None:
        """The gate's next buffers and events, in order: every one it holds now, up to :data:`BURST`, waiting
        for the first as long as the engine says; None once every channel ended; ``LINGER_OVER`` if
        ``linger_until`` (a ``time.monotonic()`` deadline) passed first. ``before_wait`` runs before the first
        wait."""
        wiring = self.wiring
        with self.lock:  # the common case, data is there: one look, no wait machinery
            wiring.raise_if_failed()
            now = time.monotonic()
            try:
                step = consumer.next(now, linger_until)
                if type(step) is BufferOrEvent:
                    return self._more_of_burst(consumer, step, now, self._burst)
            except Exception as exc:
                raise wiring.channel_error(exc) from exc
        waited_since: float | None = None
        with self.consumer_cond:
            try:
                while True:
                    wiring.raise_if_failed()
                    now = time.monotonic()
                    try:
                        step = consumer.next(now, linger_until)
                        if type(step) is BufferOrEvent:
                            return self._more_of_burst(consumer, step, now, self._burst)
                    except Exception as exc:
                        raise wiring.channel_error(exc) from exc
                    if isinstance(step, Wait):
                        if waited_since is None:
                            waited_since = consumer.time.idle_since = now
                            before_wait()
                            continue  # writing took time: look again before waiting
                        self.consumer_cond.wait(max(0.0005, step.until - now))
                        continue
                    if isinstance(step, Fail):
                        raise step.error
                    return step  # type: ignore[return-value]  # None or LINGER_OVER
            finally:
                if waited_since is not None:
                    consumer.time.idle_since = None
                    consumer.time.idle += time.monotonic() - waited_since

    @staticmethod
    def _more_of_burst(consumer: ConsumerEngine, first: BufferOrEvent, now: float, limit: int) -> list[BufferOrEvent]:
        """``first`` and what else the gate holds now, up to ``limit`` in all (lock held)."""
        burst = [first]
        if first.more_available and limit > 1:
            poll = consumer.next
            while len(burst) < limit:
                step = poll(now)
                if type(step) is not BufferOrEvent:
                    break
                burst.append(step)
                if not step.more_available:
                    break
        return burst

    # -- the end --

    def _metric_rows(self) -> list[MetricRow]:
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
        # the consumer half: its own thread (decoding, chained operators) and the Spark task thread (hand-over)
        main_cpu_s = time.thread_time() - self._main_cpu_start
        metrics.count("consumerThreadCpuTimeMs", (main_cpu_s + self._consumer_cpu_s) * 1000.0)
        if self.is_producer:
            metrics.count("producerThreadCpuTimeMs", self._producer_cpu_s * 1000.0)
        io_cpu = thread_cpu_seconds(getattr(self.wiring.transport, "_thread", None))
        if io_cpu is not None:
            metrics.count("ioThreadCpuTimeMs", io_cpu * 1000.0)
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
