"""The one event loop of a pipelined task: its producer half, its consumer half, its timers and its sockets.

A pipelined task runs on three threads, and only one of them touches the protocol:

- the **loop** (the transport's I/O thread, :class:`~spark_credit_shuffle.transport.tcp.TcpTransport`): every
  socket of the task, and after each round of reads :meth:`TaskLoop.round` here, which writes the input
  batches handed to it (the RecordWriter, back-pressured when its pool has no buffer), decodes what the gate
  holds (the RecordReaders, returning every buffer and so its credit at once), hands whole output batches on,
  and runs the engine's schedule (flusher, keep-alives, latency markers, debloating, checkpoint barriers,
  timeline and memory samples). What a round makes sendable is written by the same round: no buffer crosses
  a thread, and no lock or condition is taken per buffer;
- the **input thread** reads Spark's input iterator (and the operators chained before the exchange) and
  hands whole batches to the loop (:class:`~spark_credit_shuffle.runtime.handoff.InputHandoff`);
- the **Spark task thread** takes whole output batches from the loop
  (:class:`~spark_credit_shuffle.runtime.handoff.OutputHandoff`), runs the operators chained after the
  exchange and yields to Spark.

Each half of the loop is in one :class:`HalfState` at a time. Flink's time metrics follow from them and from
the other threads' clocks (:class:`~spark_credit_shuffle.runtime.handoff.ThreadClock`): a producer starved of
input is idle while the input thread waits for Spark and busy while a chained operator works; a consumer with
its output full is back-pressured while Spark holds the output and busy while a chained operator after the
exchange works; a consumer with nothing in its gate is idle unless such an operator is still working.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pyarrow as pa

from ...engine import LINGER_OVER, ConsumerEngine, Fail, ProducerEngine, TimeAccount, Wait
from ...protocol import BufferOrEvent
from ..handoff import HANDOFF_BATCHES, InputHandoff, OutputHandoff, ThreadClock
from ..resources import rss_bytes

if TYPE_CHECKING:
    from ...engine import Settings
    from ...metrics import TaskMetrics
    from .wiring import TaskWiring

__all__ = ["BURST", "HalfState", "TaskLoop"]

#: The most buffers and events the consumer half decodes in one round of the loop before the sockets are
#: served again. With unaligned (or timeoutable) checkpoints it takes one at a time: a priority barrier read
#: in the next round overtakes only what is still in the gate.
BURST = 64
#: Output batches the loop hands on before it wakes the Spark task thread waiting for them; a single one is
#: woken for when the loop has nothing more to do at once, or after :data:`WAKE_DELAY_S`. A wakeup costs the
#: loop a system call and the interpreter lock for as long as the woken thread runs, and a busy round hands
#: on about one batch; two per wakeup halve them.
WAKE_AFTER = 2
WAKE_DELAY_S = 0.001
_INF = float("inf")


class HalfState(enum.Enum):
    """Where one half of a pipelined task stands, as its loop sees it."""

    #: Not started: the producer before its first round, the consumer before its channels are requested.
    NEW = "new"
    #: Working: input to write, or buffers to decode.
    RUNNING = "running"
    #: Nothing to do: the producer has no input batch, the consumer's gate is empty.
    STARVED = "starved"
    #: Its output is full: the producer's pool has no buffer, the consumer's output is not taken.
    BACK_PRESSURED = "back-pressured"
    #: Done: the producer finished its partition, the consumer handed on its last batch.
    FINISHED = "finished"


class TaskLoop:
    """The producer and consumer halves of one pipelined task and its schedule, one round at a time, on the
    task's one loop thread (see the module documentation). ``inputs`` and ``outputs`` are the hand-overs to
    the other two threads (``output_batches``: the most output batches handed on and not yet taken);
    ``input_clock`` is the input thread's wait for Spark, ``output_clock`` and ``work_clock`` the Spark task
    thread's time with Spark holding the output and in the chained operators.

    Every method runs with the task's lock held; :meth:`round` takes it.
    """

    def __init__(
        self,
        wiring: TaskWiring,
        settings: Settings,
        producer: ProducerEngine | None,
        consumer: ConsumerEngine | None,
        task_metrics: TaskMetrics,
        *,
        burst: int = BURST,
        output_batches: int = HANDOFF_BATCHES,
    ) -> None:
        self.wiring = wiring
        self.settings = settings
        self.producer = producer
        self.consumer = consumer
        self.task_metrics = task_metrics
        self.burst = burst
        self.inputs = InputHandoff()
        self.outputs = OutputHandoff(output_batches, wake_after=min(WAKE_AFTER, output_batches))
        #: When a batch was handed on that the Spark task thread may not have been woken for (None: none).
        self._unwoken_at: float | None = None
        self.input_clock = ThreadClock()
        self.output_clock = ThreadClock()
        self.work_clock = ThreadClock()
        self.producer_state = HalfState.NEW if producer is not None else HalfState.FINISHED
        self.consumer_state = HalfState.NEW if consumer is not None else HalfState.FINISHED
        #: When the producer's current state began, and the input thread's wait for Spark then.
        self._producer_since = 0.0
        self._input_wait_at = 0.0
        #: When the consumer's current state began, and the Spark thread's clocks then.
        self._consumer_since = 0.0
        self._output_at = 0.0
        self._work_at = 0.0
        #: A batch the writer stopped in (its pool had no buffer): written on from there.
        self._writing = False
        #: An output batch the hand-over refused (full): handed on first.
        self._unhanded: pa.RecordBatch | None = None
        #: Every channel ended: once the last output batch is handed on, the consumer half is finished.
        self._gate_ended = False
        #: Whether the gate has data it did not have when the consumer last looked, and when it must look
        #: again regardless (a silence deadline, the output's linger).
        self._gate_signalled = True
        self._consumer_due = 0.0
        trigger = wiring.checkpoint_trigger
        self._barrier_due: Callable[[], bool] = trigger.is_due if trigger.enabled else (lambda: False)
        if producer is not None and trigger.enabled:  # the writer stops between two runs of rows when one is due
            producer.writer.interrupt = trigger.is_due
        now = time.monotonic()
        self._next_checkpoint = now + trigger.seconds_until_next() if trigger.enabled else _INF
        every = settings.memory_sample_interval
        self._sample_every = every
        self._next_sample = now if every else _INF
        self._next_timeline = now if settings.timeline_interval_ms > 0 else _INF

    # -- signals from the protocol (on the loop thread) --

    def gate_signalled(self) -> None:
        """The gate went from empty to holding data: the consumer half looks this round."""
        self._gate_signalled = True

    # -- the round --

    def round(self) -> float:
        """One round's work after the sockets were read: timers, the consumer half, the producer half. Returns
        when the next round is due (``time.monotonic()``; now: more work is waiting). A failure fails the task
        (:meth:`TaskWiring.fail`)."""
        wiring = self.wiring
        with wiring.lock:
            if wiring.has_failed or wiring.stopping.is_set():
                return time.monotonic() + 1.0
            now = time.monotonic()
            try:
                due = self._timers(now)
                if self.consumer_state is not HalfState.FINISHED and self.consumer_state is not HalfState.NEW:
                    due = min(due, self._consume(now))
                if self.producer_state is not HalfState.FINISHED:
                    due = min(due, self._produce(now))
            except BaseException as exc:
                wiring.fail(exc)
                return time.monotonic() + 1.0
            unwoken = self._unwoken_at  # a busy round (due now) looks again in the next one
            if unwoken is not None and (due > now or now - unwoken >= WAKE_DELAY_S):
                self._unwoken_at = None
                self.outputs.wake()
            return due

    # -- the producer half --

    def _producer_to(self, state: HalfState, now: float) -> None:
        """Change the producer's state; a starved stretch ending counts as idle what the input thread spent
        waiting for Spark in it (the rest a chained operator before the exchange worked)."""
        if state is self.producer_state:
            return
        producer = self.producer
        assert producer is not None
        if self.producer_state is HalfState.NEW:  # its life starts with the loop's first look at it
            producer.time = TimeAccount(now)
        if self.producer_state is HalfState.STARVED:
            waited = self.input_clock.total(now) - self._input_wait_at
            producer.time.add_idle(min(max(0.0, waited), now - self._producer_since))
            producer.time.idle_since = None
        if state is HalfState.STARVED:
            self._input_wait_at = self.input_clock.total(now)
            producer.time.idle_since = now
        self.producer_state = state
        self._producer_since = now

    def _produce(self, now: float) -> float:
        """Write the next input batch, or on in the one the writer stopped in; at most one batch a round."""
        producer = self.producer
        assert producer is not None
        if not self._writing:
            inputs = self.inputs
            batch = inputs.peek()
            if batch is None:
                if not inputs.is_ended:
                    self._producer_to(HalfState.STARVED, now)
                    return _INF  # the input thread wakes the loop
                self._finish_producer(now)
                return _INF
            if not producer.is_available():  # soft back-pressure: the next input waits for a buffer
                return self._wait_for_buffer(now, hard=False)
            self._producer_to(HalfState.RUNNING, now)
            producer.end_wait(now)
            inputs.pop()
            done = self._barriers(producer.write(batch))
        else:
            if not producer.is_available():  # hard back-pressure: in the middle of an input
                return self._wait_for_buffer(now, hard=True)
            self._producer_to(HalfState.RUNNING, now)
            producer.end_wait(now)
            done = self._barriers(producer.resume())
        self._writing = not done
        producer.sample_output()
        return now

    def _barriers(self, done: bool) -> bool:
        """The writer stopped between two runs of rows with buffers left: a checkpoint barrier is due, and goes
        in now (a long write does not hold it back); then it writes on."""
        producer = self.producer
        assert producer is not None
        trigger = self.wiring.checkpoint_trigger
        while not done and self._barrier_due():
            producer.writer.broadcast_event(trigger.next_barrier())
            done = producer.resume()
        return done

    def _wait_for_buffer(self, now: float, *, hard: bool) -> float:
        """Back-pressured: the pool has no buffer (Flink's ``isAvailable``); until when, or the timeout."""
        producer = self.producer
        assert producer is not None
        if self.producer_state is not HalfState.BACK_PRESSURED:
            self._producer_to(HalfState.BACK_PRESSURED, now)
            producer.begin_wait(now, hard=hard)
        wiring = self.wiring
        step = producer.check_wait(now, wiring.last_progress, wiring.describe_buffer_wait)
        if isinstance(step, Fail):
            raise step.error
        return step.until

    def _finish_producer(self, now: float) -> None:
        """The input ended: the open buffers and the end of partition go out; the partition is complete."""
        producer = self.producer
        wiring = self.wiring
        assert producer is not None and wiring.partition is not None
        self._producer_to(HalfState.FINISHED, now)
        producer.finish()
        producer.sample_output()
        wiring.partition.close()
        self.record_producer_sample(now)
        wiring.producer_done = True
        producer.time.stop(now)
        wiring.cond.notify_all()

    # -- the consumer half --

    def start_consumer(self, now: float) -> None:
        """The consumer's channels were requested: its half runs from the next round."""
        self._consumer_since = now
        self._consumer_to(HalfState.RUNNING, now)

    def _consumer_to(self, state: HalfState, now: float) -> None:
        """Change the consumer's state, settling the time of the one that ends (see :meth:`settle_consumer`)."""
        if state is self.consumer_state:
            return
        self.settle_consumer(now)
        consumer = self.consumer
        assert consumer is not None
        consumer.time.idle_since = now if state is HalfState.STARVED else None
        self.consumer_state = state

    def settle_consumer(self, now: float) -> None:
        """Count the consumer's time since its state began: starved, idle but for what a chained operator
        after the exchange worked meanwhile; back-pressured (or finished with output still handed on), soft
        back-pressure for what Spark held the output meanwhile. The rest is busy."""
        consumer = self.consumer
        assert consumer is not None
        state, span = self.consumer_state, now - self._consumer_since
        output, work = self.output_clock.total(now), self.work_clock.total(now)
        if span > 0:
            if state is HalfState.STARVED:
                consumer.time.add_idle(min(span, max(0.0, span - (work - self._work_at))))
                consumer.time.idle_since = now  # the live gauges count the stretch from here
            elif state is HalfState.BACK_PRESSURED or state is HalfState.FINISHED:
                held = min(span, max(0.0, output - self._output_at))
                if held > 0:
                    consumer.time.add_back_pressure(held, hard=False)
        self._consumer_since, self._output_at, self._work_at = now, output, work

    def _consume(self, now: float) -> float:
        """Decode up to a burst of what the gate holds and hand the output on; when to look again."""
        consumer = self.consumer
        assert consumer is not None
        outputs = self.outputs
        if self._unhanded is not None:
            if not self._hand_on(self._unhanded, now):
                return _INF  # the Spark task thread wakes the loop when it took a batch
            self._unhanded = None
            if self._gate_ended:
                self._consumer_to(HalfState.FINISHED, now)
                outputs.end()
                return _INF
            self._consumer_to(HalfState.RUNNING, now)
        if not self._gate_signalled and now < self._consumer_due:
            return self._consumer_due
        self._gate_signalled = False
        output = consumer.output
        add, ready_now, take = output.add, output.ready, consumer.take
        wall_ns = time.time_ns()
        # nothing is decoded beyond what the hand-over takes: the rest waits in the gate. Only this thread's
        # offers use room up, so it is looked at before the burst and after each batch handed on.
        if not outputs.has_room():
            return self._output_full(now)
        sampled = False  # the gate's gauges once a look (ConsumerEngine.sample_gauges), at its first data buffer
        for _ in range(self.burst):
            try:
                step = consumer.next(now, output.linger_until)
            except Exception as exc:
                raise self.wiring.channel_error(exc) from exc
            if type(step) is BufferOrEvent:
                if not sampled:  # the look took something: the consumer runs (until it returns)
                    self._consumer_to(HalfState.RUNNING, now)
                    if step.buffer.is_buffer:
                        consumer.sample_gauges()
                        sampled = True
                batches, resume = take(step, wall_ns)  # its reader returns the buffer (its credit) once decoded
                if resume:
                    self._resume(resume, now)
                for batch in batches:
                    add(batch)
                ready = ready_now(step.more_available, now)
                if ready is not None:
                    if not self._hand_on(ready, now):
                        return _INF
                    if not outputs.has_room():
                        return self._output_full(now)
                continue
            if step is None:  # every channel ended
                self._gate_ended = True
                if output.pending and not self._hand_on(output.take(), now):
                    return _INF  # finished once the last batch is handed on
                self._consumer_to(HalfState.FINISHED, now)
                outputs.end()
                return _INF
            if step is LINGER_OVER:
                if not self._hand_on(output.take(), now):
                    return _INF
                if not outputs.has_room():
                    return self._output_full(now)
                continue
            if isinstance(step, Wait):
                self._consumer_to(HalfState.STARVED, now)
                self._consumer_due = step.until
                return step.until
            if isinstance(step, Fail):
                raise self.wiring.channel_error(step.error) from step.error
        self._gate_signalled = True  # the burst is used up: more in the next round
        return now

    def _output_full(self, now: float) -> float:
        """The hand-over has no room: back-pressured until the Spark task thread takes a batch and wakes the
        loop, which then looks at the gate again."""
        self._consumer_to(HalfState.BACK_PRESSURED, now)
        self._gate_signalled = True
        return _INF

    def _hand_on(self, batch: pa.RecordBatch, now: float) -> bool:
        """Hand ``batch`` to the Spark task thread; False if its hand-over is full (back-pressured)."""
        if self.outputs.offer(batch):
            if self._unwoken_at is None:
                self._unwoken_at = now
            return True
        self._unhanded = batch
        self._consumer_to(HalfState.BACK_PRESSURED, now)
        return False

    def _resume(self, channels: tuple[int, ...], now: float) -> None:
        """ResumeConsumption on ``channels`` (their subpartitions blocked themselves after an aligned barrier)."""
        consumer = self.consumer
        assert consumer is not None
        for channel in channels:
            consumer.gate.resume_consumption(channel)
        consumer.resumed(channels, now)

    # -- the schedule: flusher, keep-alives, markers, debloating, checkpoints, samples --

    def _timers(self, now: float) -> float:
        """Run what is due at ``now``; returns when the next is due."""
        producer, consumer, wiring = self.producer, self.consumer, self.wiring
        trigger = wiring.checkpoint_trigger
        if self._sample_every is not None and now >= self._next_sample:
            self.sample_memory()
            self._next_sample = max(self._next_sample + self._sample_every, now)
        if now >= self._next_timeline:
            self._next_timeline = max(self._next_timeline + self.sample_timeline(now), now)
        due = min(self._next_sample, self._next_timeline)
        debloat = consumer.debloat if consumer is not None and not wiring.consumer_done else None
        if debloat is not None and wiring.gate is not None and self.consumer_state is not HalfState.NEW:
            if now >= debloat.next_at:  # the size goes to every producer (NewBufferSize)
                debloat.on_timer(now)
            due = min(due, debloat.next_at)
        if producer is None:
            return due
        if not producer.is_finished:
            producer.on_timer(now, time.time_ns())
            if now >= self._next_checkpoint:  # between two records (see checkpoint barriers)
                if trigger.is_due():
                    producer.writer.broadcast_event(trigger.next_barrier())
                self._next_checkpoint = now + trigger.seconds_until_next()
            timed_out = trigger.timed_out(now)
            if timed_out is not None:  # a barrier still queued overtakes as unaligned
                producer.partition.aligned_barrier_timeout(timed_out)
            return min(due, producer.next_timer(), self._next_checkpoint, trigger.timeout_at)
        # a finished producer whose output a consumer still reads injects unaligned barriers on
        if trigger.enabled and trigger.options.is_unaligned and producer.takes_part_in_checkpoints_after_finish():
            if now >= self._next_checkpoint:
                trigger.inject_after_finish(producer.inject_after_finish)  # counted if one took it
                self._next_checkpoint = now + trigger.seconds_until_next()
            due = min(due, self._next_checkpoint)
        return due

    def sample_memory(self) -> None:
        rss = rss_bytes()
        metrics = self.task_metrics
        if rss:
            metrics.sample("taskRssBytes", float(rss))
        metrics.sample("taskArrowAllocatedBytes", float(pa.total_allocated_bytes()))
        # the task's network buffers in use: Flink's Status.Shuffle.Netty.UsedMemorySegments, per task here
        metrics.sample("usedMemorySegments", float(self.wiring.network.num_used))

    def record_producer_sample(self, now: float) -> None:
        producer = self.producer
        assert producer is not None
        credits = self.wiring.remote_credits()
        producer.timeline.record(lambda: producer.gauges(now, credits), now, time.time() * 1000.0)

    def record_consumer_sample(self, now: float) -> None:
        consumer = self.consumer
        assert consumer is not None
        if self.consumer_state is not HalfState.NEW:
            self.settle_consumer(now)
        consumer.timeline.record(lambda: consumer.gauges(now), now, time.time() * 1000.0)

    def sample_timeline(self, now: float) -> float:
        """One timeline sample of each side still running; returns the seconds until the next one
        (``inf`` once both sides ended or sampling is off)."""
        intervals = []
        producer, consumer, wiring = self.producer, self.consumer, self.wiring
        if producer is not None and not wiring.producer_done and producer.timeline.interval > 0:
            self.record_producer_sample(now)
            intervals.append(producer.timeline.interval)
        if consumer is not None and not wiring.consumer_done and consumer.timeline.interval > 0:
            if consumer.gate_gauges is not None:  # channels requested
                self.record_consumer_sample(now)
            intervals.append(consumer.timeline.interval)
        return min(intervals, default=_INF)
