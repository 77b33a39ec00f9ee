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

    Flink's checkpoint coordinator triggers every source at once; here each producer's timer fires at the
    same wall-clock instants, the multiples of ``interval_ms`` since the epoch, and names the checkpoint
    after the instant (id = epoch ms // interval), so that all producers' barrier *n* start together.

    Like Flink's coordinator, which triggers a checkpoint only once every task runs, a trigger fires only
    once armed (:meth:`arm`): the runtime arms it when the address exchange returned, i.e. every task of the
    exchange has started, with the latest start any task announced, so that all producers agree on the
    first checkpoint: the one of the second instant after that start. Without that, barriers of producers
    that started early would block their channels at every consumer until the last producer started and
    injected its first barrier. A timer that wakes late (a busy machine, or a writer that held the task's
    writer lock through a long batch) injects the checkpoint it is late for, never a later one: a
    producer that skipped an id would make every consumer abort that checkpoint (its barrier missing on
    one channel, the next one's arriving). Later instants that passed meanwhile are injected right after,
    one by one, as the timer catches up.
    """

    def __init__(
        self,
        subtask: int,
        interval_ms: int,
        options: CheckpointOptions,
        wall_ns: Callable[[], int],
        monotonic: Callable[[], float],
    ) -> None:
        self.subtask = subtask
        #: Epoch nanoseconds (the instants every producer agrees on) and seconds on the caller's monotonic
        #: clock (the alignment timeout, compared with the caller's timer).
        self.wall_ns = wall_ns
        self.monotonic = monotonic
        self.interval_ms = interval_ms
        self.interval = interval_ms / 1000.0
        self.options = options
        self.last_id = 0
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
        arms would make it catch up with a burst of barriers the others do not send at the same time)."""
        if self.enabled:
            first = max(started_ms // self.interval_ms + 2, (started_ms + ARM_GRACE_MS) // self.interval_ms + 1)
            self.last_id = max(self.last_id, first - 1)
        self.armed = True

    def is_due(self) -> bool:
        """The timer woke at an instant: inject a barrier now? Only once armed, and at the instant of the next
        checkpoint (half an interval early at most: a timer may wake a little early), not at an earlier one."""
        if not (self.armed and self.enabled):
            return False
        return self.wall_ns() / 1e6 >= (self.last_id + 0.5) * self.interval_ms

    def seconds_until_next(self) -> float:
        """Wall-clock seconds until the instant of the next checkpoint not yet injected (0 if it passed: a
        late timer catches up one checkpoint at a time)."""
        now_ms = self.wall_ns() / 1e6
        if not self.armed:
            return max(0.0, (int(now_ms // self.interval_ms) + 1) * self.interval_ms - now_ms) / 1000.0
        return max(0.0, ((self.last_id + 1) * self.interval_ms - now_ms) / 1000.0)

    def next_barrier(self) -> CheckpointBarrier:
        """The barrier of the next checkpoint (the one after the last injected, however late), stamped now;
        a timeline row records it."""
        now_ms = self.wall_ns() // 1_000_000
        self.last_id += 1
        self.num_barriers += 1
        if self.options.is_timeoutable:
            self.timeout_at = self.monotonic() + self.options.aligned_checkpoint_timeout_ms / 1000.0
        if len(self.rows) < _MAX_BARRIER_ROWS:
            self.rows.append(
                MetricRow(PRODUCER, self.subtask, None, "checkpointBarrier", SAMPLE, float(self.last_id), float(now_ms))
            )
        return CheckpointBarrier(self.last_id, now_ms, self.options)

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
        """``numCheckpointBarriersOut``; with unaligned barriers, the output channel state they persisted
        (``resultSubpartitionStateBuffers`` and ``...Bytes``, after Flink's ``ResultSubpartitionStateHandle``)."""
        rows = [MetricRow(PRODUCER, self.subtask, None, "numCheckpointBarriersOut", "total", float(self.num_barriers))]
        if self.options.is_unaligned or self.options.is_timeoutable:
            for metric, value in (
                ("resultSubpartitionStateBuffers", self.persisted_output_buffers),
                ("resultSubpartitionStateBytes", self.persisted_output_bytes),
            ):
                rows.append(MetricRow(PRODUCER, self.subtask, None, metric, "total", float(value)))
        return rows


class ConsumerCheckpoints:
    """A consumer subtask's barrier handler with its records; ``producers[c]`` is channel ``c``'s producer."""

    def __init__(self, subtask: int, producers: list[int], clock_ns: Callable[[], int]) -> None:
        self.subtask = subtask
        self.producers = producers
        #: The clock the records are stamped with: the wall clock, or the simulation's virtual one.
        self.clock_ns = clock_ns
        self.handler = SingleCheckpointBarrierHandler(max(1, len(producers)))
        self.barrier_rows: list[MetricRow] = []

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
            return handler.process_barrier(channel, event, now_ns, sequence_number)
        if isinstance(event, CancelCheckpointMarker):
            return handler.process_cancellation_barrier(channel, event, now_ns)
        if isinstance(event, EndOfPartition):
            return handler.process_end_of_partition(channel, now_ns)
        return ()

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
