"""Checkpoint barriers in the task engine: when producers inject them, and what consumers record.

The rule of alignment lives in the sans-IO ``SingleCheckpointBarrierHandler``
(:mod:`spark_credit_shuffle.protocol.checkpointing`); this module is the engine's part around it, with the
clocks given by its caller (the wall clock in the runtimes, the virtual one in the simulation).
:class:`CheckpointTrigger` is the producer's schedule (``execution.checkpointing.interval``), read by the
task's timer next to the flush and keep-alive schedules. :class:`ConsumerCheckpoints` feeds a consumer
subtask's events and buffers to the handler with wall-clock times, and turns what it decided into metric
rows (one set per completed checkpoint, ``stat = "checkpoint"``, ``channel`` its ordinal on the subtask
and ``checkpointId`` its id) and timeline rows (``checkpointBarrier`` when a barrier arrives, the
checkpoint id as the value and the producer as the channel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

from ..buffers.format import CancelCheckpointMarker, CheckpointBarrier, CheckpointOptions, EndOfPartition, Event
from ..metrics import CONSUMER, PRODUCER, SAMPLE, MetricRow
from ..protocol.checkpointing import SingleCheckpointBarrierHandler

__all__ = [
    "CHECKPOINTS_DDL",
    "CHECKPOINT_EVENTS",
    "CHECKPOINT_STAT",
    "CheckpointRecord",
    "CheckpointTrigger",
    "ConsumerCheckpoints",
]

#: The events a consumer's checkpoint barrier handler takes.
CHECKPOINT_EVENTS = (CheckpointBarrier, CancelCheckpointMarker, EndOfPartition)

#: ``stat`` of the per-checkpoint metric rows (their ``channel`` is the checkpoint's ordinal on its subtask).
CHECKPOINT_STAT = "checkpoint"
#: The first checkpoint's instant is at least this long after the last task announced its start (see
#: :meth:`CheckpointTrigger.arm`).
ARM_GRACE_MS = 100
#: At most this many barrier rows per task in the timeline (a long run keeps its first ones).
_MAX_BARRIER_ROWS = 20_000


class CheckpointTrigger:
    """A producer's checkpoint schedule (``interval_ms = 0`` never fires).

    Flink's checkpoint coordinator triggers every source at once, and, with its default of one concurrent
    checkpoint (``execution.checkpointing.max-concurrent-checkpoints``), only once no checkpoint is pending:
    a checkpoint whose interval passed while the last one was still aligning is triggered when that one
    ends. There is no coordinator between the tasks here, so each producer's timer plays it for its own
    barriers: it fires at the multiples of ``interval_ms`` since the epoch, the same wall-clock instants in
    every producer, so that all producers' barrier *n* start together; and only once every consumer it feeds
    acknowledged (or declined) the last checkpoint, ``acknowledged(last id)`` (``AcknowledgeCheckpoint``, see
    :class:`ConsumerCheckpoints`). Since a consumer ends checkpoint *n* only after barrier *n* arrived from
    every producer, no producer starts *n + 1* before every producer started *n*: a producer whose timer
    woke late (a busy machine) delays the checkpoint it is late for, it does not make every consumer abort
    it on seeing the next one. Checkpoint ids count from 1, with no gaps. A checkpoint not acknowledged
    within ``timeout_ms`` (``execution.checkpointing.timeout``) is given up: the next one is injected anyway,
    and consumers still aligning the late one abort it, as Flink's coordinator expires it.

    Like Flink's coordinator, which triggers a checkpoint only once every task runs, a trigger fires only
    once armed (:meth:`arm`): the runtime arms it when the address exchange returned, i.e. every task of the
    exchange has started, with the latest start any task announced, so that all producers agree on the
    first checkpoint's instant: the second after that start. Without that, barriers of producers that started
    early would block their channels at every consumer until the last producer started and injected its
    first barrier. A timer that wakes late injects the next checkpoint at once, and the one after at the
    next instant: it does not catch up on the instants it missed.
    """

    def __init__(
        self,
        subtask: int,
        interval_ms: int,
        options: CheckpointOptions,
        wall_ns: Callable[[], int],
        monotonic: Callable[[], float],
        acknowledged: Callable[[int], bool] | None = None,
        timeout_ms: int = 600_000,
    ) -> None:
        self.subtask = subtask
        #: Epoch nanoseconds (the instants every producer agrees on) and seconds on the caller's monotonic
        #: clock (the alignment and checkpoint timeouts, compared with the caller's timer).
        self.wall_ns = wall_ns
        self.monotonic = monotonic
        self.interval_ms = interval_ms
        self.interval = interval_ms / 1000.0
        self.options = options
        #: Whether every consumer ended a checkpoint (None: do not wait for consumers; tests and tools).
        self.acknowledged = acknowledged
        self.timeout = timeout_ms / 1000.0
        self.last_id = 0
        #: The instant (multiple of the interval since the epoch) of the last barrier; the next is due at the one after.
        self.instant = 0
        self.injected_at = float("-inf")
        self.armed = False
        self.num_barriers = 0
        self.rows: list[MetricRow] = []
        #: The ``monotonic`` time at which the last timeoutable barrier's alignment times out (inf: none due).
        self.timeout_at = float("inf")
        #: Output channel state: the data buffers unaligned barriers overtook in the subpartitions, and bytes.
        self.persisted_output_buffers = 0
        self.persisted_output_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.interval_ms > 0

    def arm(self, started_ms: int) -> None:
        """Every task runs, the last started at ``started_ms`` (epoch ms): fire from the second instant
        after that on, and not before :data:`ARM_GRACE_MS` after it (the tasks learn that every task runs
        at slightly different times, after the address exchange: a first instant already past when a task
        arms would make some producers inject their first barrier an interval before the others)."""
        if self.enabled:
            first = max(started_ms // self.interval_ms + 2, (started_ms + ARM_GRACE_MS) // self.interval_ms + 1)
            self.instant = max(self.instant, first - 1)
        self.armed = True

    def is_due(self) -> bool:
        """Inject a barrier now? Once armed, at the next checkpoint's instant (half an interval early at most: a
        timer may wake a little early) or later, once no consumer still aligns the last checkpoint."""
        if not (self.armed and self.enabled):
            return False
        if self.wall_ns() / 1e6 < (self.instant + 0.5) * self.interval_ms:
            return False
        return self.last_id == 0 or self.acknowledged is None or self.acknowledged(self.last_id) or self._expired()

    def _expired(self) -> bool:
        return self.monotonic() - self.injected_at >= self.timeout

    def seconds_until_next(self) -> float:
        """Wall-clock seconds until the timer should look again: the next checkpoint's instant, or, past it and
        waiting for consumers to acknowledge the last one, a tenth of the interval (at least 1 ms)."""
        now_ms = self.wall_ns() / 1e6
        if not self.armed:
            return max(0.0, (int(now_ms // self.interval_ms) + 1) * self.interval_ms - now_ms) / 1000.0
        until = ((self.instant + 1) * self.interval_ms - now_ms) / 1000.0
        if until > 0:
            return until
        return 0.0 if self.is_due() else max(0.001, self.interval / 10)

    def next_barrier(self) -> CheckpointBarrier:
        """The barrier of the next checkpoint (the one after the last injected), stamped now and counted as
        sent (``numCheckpointBarriersOut``); a timeline row records it. For a running producer, whose
        broadcast puts it into every subpartition."""
        barrier = self._peek()
        self._commit(barrier)
        return barrier

    def inject_after_finish(self, inject: Callable[[CheckpointBarrier], int]) -> int:
        """A finished producer's barrier, if one is due: ``inject`` puts it into the subpartitions a consumer
        still reads and answers how many took it (``ProducerEngine.inject_after_finish``). Only a barrier that
        went into at least one subpartition is a checkpoint this producer took part in: it alone is counted,
        recorded and uses up its id. One that none took (every consumer released its subpartition meanwhile)
        leaves the trigger as it was, so ``numCheckpointBarriersOut`` is exactly the barriers that went out.
        Returns how many subpartitions took it (0: none, or none due)."""
        if not self.is_due():
            return 0
        barrier = self._peek()
        taken = inject(barrier)
        if taken:
            self._commit(barrier)
        return taken

    def _peek(self) -> CheckpointBarrier:
        """The next checkpoint's barrier, stamped now, with nothing counted yet."""
        return CheckpointBarrier(self.last_id + 1, self.wall_ns() // 1_000_000, self.options)

    def _commit(self, barrier: CheckpointBarrier) -> None:
        """``barrier`` went out: its id is the last, the schedule moves on, and it is counted and recorded."""
        now_ms = barrier.timestamp
        self.last_id = barrier.id
        self.instant = max(self.instant + 1, round(now_ms / self.interval_ms))
        self.injected_at = self.monotonic()
        self.num_barriers += 1
        if self.options.is_timeoutable:
            self.timeout_at = self.monotonic() + self.options.aligned_checkpoint_timeout_ms / 1000.0
        if len(self.rows) < _MAX_BARRIER_ROWS:
            self.rows.append(
                MetricRow(PRODUCER, self.subtask, None, "checkpointBarrier", SAMPLE, float(barrier.id), float(now_ms))
            )

    def timed_out(self, now: float) -> int | None:
        """The checkpoint whose aligned barrier timed out by ``now`` (on the ``monotonic`` clock), once: the
        producer then makes it unaligned where it is still queued (Flink's ``alignedBarrierTimeout``)."""
        if now < self.timeout_at:
            return None
        self.timeout_at = float("inf")
        return self.last_id

    def persist_output(self, checkpoint_id: int, subpartition: int, sizes: list[int]) -> None:
        """The partition's output channel state writer: counts what unaligned barriers overtook."""
        self.persisted_output_buffers += len(sizes)
        self.persisted_output_bytes += sum(sizes)

    def metric_rows(self) -> list[MetricRow]:
        """``numCheckpointBarriersOut``: the barriers that went into the partition (a producer whose input ended
        before a checkpoint's instant sends none for it: its end of partition counts for alignment). With
        unaligned barriers, also the output channel state they persisted (``resultSubpartitionStateBuffers`` and
        ``...Bytes``, after Flink's ``ResultSubpartitionStateHandle``)."""
        rows = [MetricRow(PRODUCER, self.subtask, None, "numCheckpointBarriersOut", "total", float(self.num_barriers))]
        if self.options.is_unaligned or self.options.is_timeoutable:
            for metric, value in (
                ("resultSubpartitionStateBuffers", self.persisted_output_buffers),
                ("resultSubpartitionStateBytes", self.persisted_output_bytes),
            ):
                rows.append(MetricRow(PRODUCER, self.subtask, None, metric, "total", float(value)))
        return rows


class ConsumerCheckpoints:
    """A consumer subtask's barrier handler with its records; ``producers[c]`` is channel ``c``'s producer.

    ``acknowledge(checkpoint_id, declined)``, if given, is told of every checkpoint the handler ends
    (completes, or aborts): the runtime sends it to every producer (``AcknowledgeCheckpoint``), whose
    trigger holds its next barrier until then (see :class:`CheckpointTrigger`)."""

    def __init__(
        self,
        subtask: int,
        producers: list[int],
        clock_ns: Callable[[], int],
        acknowledge: Callable[[int, bool], None] | None = None,
    ) -> None:
        self.subtask = subtask
        self.producers = producers
        #: The clock the records are stamped with: the wall clock, or the simulation's virtual one.
        self.clock_ns = clock_ns
        self.handler = SingleCheckpointBarrierHandler(max(1, len(producers)))
        self.barrier_rows: list[MetricRow] = []
        self.acknowledge = acknowledge
        self._completed = self._aborted = 0  # the handler's ended checkpoints acknowledged so far

    def on_event(self, channel: int, event: Event, sequence_number: int) -> tuple[int, ...]:
        """Hand a barrier, cancel marker or end of partition to the handler; the channels to resume."""
        now_ns = self.clock_ns()
        handler = self.handler
        if isinstance(event, CheckpointBarrier):
            if len(self.barrier_rows) < _MAX_BARRIER_ROWS:
                self.barrier_rows.append(
                    MetricRow(
                        CONSUMER,
                        self.subtask,
                        self.producers[channel],
                        "checkpointBarrier",
                        SAMPLE,
                        float(event.id),
                        now_ns / 1e6,
                    )
                )
            resume = handler.process_barrier(channel, event, now_ns, sequence_number)
        elif isinstance(event, CancelCheckpointMarker):
            resume = handler.process_cancellation_barrier(channel, event, now_ns)
        elif isinstance(event, EndOfPartition):
            resume = handler.process_end_of_partition(channel, now_ns)
        else:
            return ()
        if self.acknowledge is not None and (
            len(handler.completed) > self._completed or len(handler.aborted) > self._aborted
        ):
            self._acknowledge_ended()
        return resume

    def _acknowledge_ended(self) -> None:
        """Acknowledge (or decline) the checkpoints the handler ended since the last call, in id order."""
        handler = self.handler
        fresh = [(c.checkpoint_id, False) for c in handler.completed[self._completed :]]
        fresh += [(a.checkpoint_id, True) for a in handler.aborted[self._aborted :]]
        self._completed, self._aborted = len(handler.completed), len(handler.aborted)
        assert self.acknowledge is not None
        for checkpoint_id, declined in sorted(fresh):
            self.acknowledge(checkpoint_id, declined)

    def check_timeout(self) -> tuple[int, ...]:
        """Channels to resume if an aligned-with-timeout checkpoint just switched to unaligned."""
        return self.handler.check_alignment_timeout(self.clock_ns()) if self.handler.is_checkpoint_pending else ()

    def metric_rows(self) -> list[MetricRow]:
        """Per completed checkpoint (``stat = "checkpoint"``, channel = its ordinal, ``checkpointId``): Flink's
        ``checkpointAlignmentTime`` and ``checkpointStartDelayNanos`` (ns), ``bytesPersistedDuringAlignment``
        (channel state, unaligned), ``unalignedCheckpoint`` and ``alignedCheckpointTimedOut`` (0/1), and
        ``checkpointEndMs`` (on the records' clock); then their max and mean, the counts of completed and aborted
        checkpoints, and the barrier arrivals as timeline rows."""
        handler = self.handler
        rows: list[MetricRow] = []
        subtask = self.subtask
        for ordinal, c in enumerate(handler.completed, 1):
            persisted = handler.channel_state_bytes.get(c.checkpoint_id, 0)
            for metric, value in (
                ("checkpointId", c.checkpoint_id),
                ("checkpointAlignmentTime", c.alignment_time_ns),
                ("checkpointStartDelayNanos", c.start_delay_ns),
                ("bytesPersistedDuringAlignment", persisted),
                ("unalignedCheckpoint", int(c.alignment.name == "UNALIGNED")),
                ("alignedCheckpointTimedOut", int(c.timed_out)),
                ("checkpointEndMs", c.end_ns / 1e6),
            ):
                rows.append(MetricRow(CONSUMER, subtask, ordinal, metric, CHECKPOINT_STAT, float(value)))
        if handler.completed:
            for metric, values in (
                ("checkpointAlignmentTime", [c.alignment_time_ns for c in handler.completed]),
                ("checkpointStartDelayNanos", [c.start_delay_ns for c in handler.completed]),
            ):
                rows.append(MetricRow(CONSUMER, subtask, None, metric, "max", float(max(values))))
                rows.append(MetricRow(CONSUMER, subtask, None, metric, "mean", sum(values) / len(values)))
            rows.append(
                MetricRow(
                    CONSUMER,
                    subtask,
                    None,
                    "bytesPersistedDuringAlignment",
                    "total",
                    float(sum(handler.channel_state_bytes.values())),
                )
            )
        rows.append(
            MetricRow(CONSUMER, subtask, None, "numberOfCompletedCheckpoints", "total", float(len(handler.completed)))
        )
        rows.append(
            MetricRow(CONSUMER, subtask, None, "numberOfFailedCheckpoints", "total", float(len(handler.aborted)))
        )
        rows.extend(self.barrier_rows)
        return rows


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint one consumer subtask completed: a row of ``Exchange.checkpoints()``.

    ``alignment`` is ``"aligned"`` or ``"unaligned"`` (an aligned-with-timeout checkpoint that timed out is
    unaligned, ``timed_out`` says so); ``alignment_time_ms`` is Flink's ``checkpointAlignmentTime`` (first to
    last barrier on the subtask), ``start_delay_ms`` its ``checkpointStartDelayNanos`` (trigger to first
    barrier), ``persisted_bytes`` the channel state an unaligned checkpoint captured, ``end_ms`` when the
    subtask completed it (on the clock of its records).
    """

    subtask: int
    checkpoint_id: int
    alignment: str
    timed_out: bool
    alignment_time_ms: float
    start_delay_ms: float
    persisted_bytes: int
    end_ms: float

    @classmethod
    def from_rows(cls, rows: Iterable[MetricRow]) -> list[CheckpointRecord]:
        """The records behind the per-checkpoint metric rows (``stat = "checkpoint"``, ``channel`` the
        checkpoint's ordinal on its subtask) that :meth:`ConsumerCheckpoints.metric_rows` wrote, by subtask
        and checkpoint id."""
        per: dict[tuple[int, int], dict[str, float]] = {}
        for r in rows:
            if r.stat == CHECKPOINT_STAT and r.channel is not None and r.side == CONSUMER:
                per.setdefault((r.subtask, r.channel), {})[r.metric] = r.value
        records = [
            cls(
                subtask=subtask,
                checkpoint_id=int(values["checkpointId"]),
                alignment="unaligned" if values["unalignedCheckpoint"] else "aligned",
                timed_out=bool(values["alignedCheckpointTimedOut"]),
                alignment_time_ms=values["checkpointAlignmentTime"] / 1e6,
                start_delay_ms=values["checkpointStartDelayNanos"] / 1e6,
                persisted_bytes=int(values["bytesPersistedDuringAlignment"]),
                end_ms=float(values["checkpointEndMs"]),
            )
            for (subtask, _ordinal), values in per.items()
        ]
        return sorted(records, key=lambda c: (c.subtask, c.checkpoint_id))


_DDL_TYPES = {"int": "int", "str": "string", "bool": "boolean", "float": "double"}
_LONG_FIELDS = ("checkpoint_id", "persisted_bytes")
#: Spark DDL of ``Exchange.checkpoints()``: :class:`CheckpointRecord`'s fields, in order.
CHECKPOINTS_DDL = ", ".join(
    f"{f.name} {'long' if f.name in _LONG_FIELDS else _DDL_TYPES[str(f.type)]}" for f in fields(CheckpointRecord)
)
