"""How many network buffers a topology needs, computed before anything runs.

Flink reserves each pool's minimum at task set-up and fails there with "Insufficient number of
network buffers". The planner applies the same rules (reference §4.3) to a topology of exchanges
and the executors it will run on, so the answer comes on the driver, before a Spark job starts:

- a producer task's result partition with N subpartitions: a LocalBufferPool of min N + 1 and max
  N * buffers_per_channel + floating_buffers_per_gate (pipelined, bounded) or unbounded (blocking, sized
  as a hash blocking partition, which the blocking exchange's partition is; with
  ``sort_shuffle_min_parallelism`` set, blocking partitions of at least that many subpartitions are sized
  as Flink's sort-merge ones: min ``sort_shuffle_min_buffers`` (512), max max(min, 4 N));
- a consumer task's input gate with C channels: buffers_per_channel exclusive buffers per *remote*
  channel and a floating pool of min 1 (pipelined) and max C * buffers_per_channel +
  floating_buffers_per_gate minus the exclusive ones; blocking gates cap the required buffers at 1000 as
  Flink does. A pipelined channel is local, with no exclusive buffers, when producer and consumer run in
  tasks of one executor (with ``local_channels="executor"``, the default; with ``"task"`` only a task's own
  channel is). A blocking consumer reads every producer from Spark's shuffle: all its channels are remote.

Which halves share a task follows the runtime: a blocking exchange runs its producers in one Spark
stage and its consumers in the next; a pipelined exchange runs producer subtask *i* and consumer
subtask *i* in task *i* of one barrier stage. With ``chain=True`` consecutive exchanges share tasks
(the consumer of exchange *k* is the producer of exchange *k + 1*, as Flink's tasks have an input gate
and a result partition). An executor runs up to ``slots`` tasks of a stage at once, and the check
assumes the worst: the heaviest tasks of the stage land on the same executor. For a pipelined (barrier)
stage, which tasks share an executor also decides which channels are local, so the planner tries every
number *k* of tasks one executor can hold while all tasks run at once (from ``W - (count - 1) * slots``
to ``min(slots, W)`` of the stage's *W* tasks; in local mode exactly *W*): the *k* heaviest tasks together
on one executor, their channels among each other local, the others spread over the other executors; the
busiest executor of the worst placement is the requirement. ``Executors(placement=...)`` gives the
placement instead (the executor of every task), as a running stage knows it. Stages run one after the
other, so an executor's requirement is that of its busiest stage.

:func:`plan_network` returns a :class:`NetworkPlan` (per task, per stage, verdict);
:func:`plan_table` gives it as a pandas DataFrame and :func:`plan_dataframe` as a Spark DataFrame.
:func:`check_fits` is what ``exchange()`` runs before launch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .config import NetworkConfig, check_count, check_operator_parallelism, parse_size
from .errors import ConfigError, InsufficientNetworkBuffersError
from .partitioners import (
    Partitioner,
    broadcast,
    custom,
    forward,
    global_,
    key_by,
    rebalance,
    rescale,
    shuffle,
)
from .protocol.pools import NETWORK_MEMORY_SETTING
from .protocol.sizing import (
    PartitionType,
    input_gate_buffers_spec,
    network_buffers_for_announcing,
    result_partition_pool_size,
)
from .runtime.session import configured_executors, executor_slots

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame, SparkSession

    from .runtime.plan import ExchangePlan

__all__ = [
    "PATTERNS",
    "ExchangeSpec",
    "Executors",
    "NetworkPlan",
    "StagePlan",
    "TaskBuffers",
    "TaskPlan",
    "check_fits",
    "consumer_buffers",
    "executors_from_spark",
    "partition_type",
    "plan_dataframe",
    "plan_network",
    "plan_table",
    "producer_buffers",
    "task_buffers",
]

_MODES = ("blocking", "pipelined")


# -- per task ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskBuffers:
    """Network buffers one task's result partition and input gate take (the minimums Flink reserves)."""

    partition_min: int
    partition_max: int
    exclusive: int
    floating_min: int
    floating_max: int

    @property
    def required(self) -> int:
        """Buffers reserved at set-up: the partition pool's minimum, exclusive buffers, floating minimum."""
        return self.partition_min + self.exclusive + self.floating_min

    @property
    def maximum(self) -> int:
        """Buffers the pools can grow to when network memory is plentiful (unbounded pools count their min)."""
        return _bounded(self.partition_min, self.partition_max) + self.exclusive + self.floating_max

    def __add__(self, other: TaskBuffers) -> TaskBuffers:
        return TaskBuffers(
            self.partition_min + other.partition_min,
            _saturating_add(self.partition_max, other.partition_max),
            self.exclusive + other.exclusive,
            self.floating_min + other.floating_min,
            self.floating_max + other.floating_max,
        )


_NONE = TaskBuffers(0, 0, 0, 0, 0)
_UNBOUNDED = (1 << 31) - 1


def _bounded(lo: int, hi: int) -> int:
    return lo if hi >= _UNBOUNDED else hi


def _saturating_add(a: int, b: int) -> int:
    return min(_UNBOUNDED, a + b)


def partition_type(mode: str) -> str:
    """Flink's partition type of an exchange mode: PIPELINED_BOUNDED or BLOCKING."""
    return PartitionType.BLOCKING if mode == "blocking" else PartitionType.PIPELINED_BOUNDED


def producer_buffers(n: int, config: NetworkConfig, mode: str) -> TaskBuffers:
    """The buffers of a result partition of ``n`` subpartitions in ``mode`` (its pool's min and max)."""
    lo, hi = result_partition_pool_size(n, config, partition_type(mode))
    return TaskBuffers(lo, hi, 0, 0, 0)


def consumer_buffers(channels: int, remote: int, config: NetworkConfig, mode: str) -> TaskBuffers:
    """The buffers of an input gate of ``channels`` channels, ``remote`` of them remote, in ``mode``."""
    spec = input_gate_buffers_spec(channels, config, num_remote_channels=remote, blocking=mode == "blocking")
    return TaskBuffers(0, 0, spec.exclusive_total, spec.floating_min, spec.floating_max)


def _local_channels(channels: Sequence[int], subtask: int, mode: str, config: NetworkConfig, placement: Any) -> int:
    """How many of consumer ``subtask``'s ``channels`` (producer subtasks) are local: in pipelined mode its
    own task's, and with ``local_channels="executor"`` every producer whose task shares its executor
    (``placement[i]`` is the executor of task *i*; None: every task its own executor)."""
    if mode != "pipelined":
        return 0
    if placement is None or config.local_channels != "executor":
        return 1 if subtask in channels else 0
    mine = placement[subtask]
    return sum(1 for p in channels if p == subtask or placement[p] == mine)


def task_buffers(
    plan: ExchangePlan, subtask: int, placement: Sequence[Any] | None = None
) -> tuple[TaskBuffers, TaskBuffers]:
    """(producer half, consumer half) of subtask ``subtask`` of ``plan``: the pools the runtime creates.

    ``placement[i]`` names the executor of task *i* (pipelined mode: channels between tasks of one executor
    are local); None: every task its own executor."""
    p, config = plan.partitioner, plan.config
    producer = consumer = _NONE
    if subtask < plan.num_producers:
        n = len(p.consumers_of(subtask, plan.num_producers, plan.num_consumers))
        producer = producer_buffers(n, config, plan.mode)
    if subtask < plan.num_consumers:
        channels = p.producers_of(subtask, plan.num_producers, plan.num_consumers)
        local = _local_channels(channels, subtask, plan.mode, config, placement)
        consumer = consumer_buffers(len(channels), len(channels) - local, config, plan.mode)
    return producer, consumer


# -- topology ------------------------------------------------------------------------------------------

#: Partitioner names the planner accepts, by Flink's name (lower case) and by edge pattern.
PATTERNS: dict[str, str] = {
    "hash": "all-to-all",
    "rebalance": "all-to-all",
    "shuffle": "all-to-all",
    "global": "all-to-all",
    "custom": "all-to-all",
    "broadcast": "all-to-all (every row to every consumer)",
    "rescale": "pointwise",
    "forward": "pointwise 1:1",
    "all-to-all": "all-to-all",
    "pointwise": "pointwise",
}


def _partitioner_of(name: str | Partitioner) -> Partitioner:
    if isinstance(name, Partitioner):
        return name
    key = str(name).strip().lower().replace("_", "-")
    factories = {
        "hash": lambda: key_by("key"),
        "key-by": lambda: key_by("key"),
        "rebalance": rebalance,
        "shuffle": shuffle,
        "global": global_,
        "custom": lambda: custom(lambda k, n: k, "key"),
        "broadcast": broadcast,
        "rescale": rescale,
        "forward": forward,
        "all-to-all": rebalance,
        "pointwise": rescale,
    }
    factory = factories.get(key)
    if factory is None:
        raise ConfigError("partitioner", name, "one of " + ", ".join(PATTERNS) + " (or a Partitioner)")
    return factory()


@dataclass(frozen=True)
class ExchangeSpec:
    """One exchange of a topology: producer and consumer parallelism, partitioner (pattern) and mode.

    ``partitioner`` is a :class:`Partitioner` or a name: ``hash``, ``rebalance``, ``shuffle``, ``global``,
    ``custom``, ``broadcast`` (all-to-all), ``rescale``, ``forward`` (pointwise), or the bare patterns
    ``all-to-all`` and ``pointwise``.
    """

    producers: int
    consumers: int
    partitioner: str | Partitioner = "hash"
    mode: str = "pipelined"
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "producers", check_operator_parallelism(self.producers, "producers"))
        object.__setattr__(self, "consumers", check_operator_parallelism(self.consumers, "consumers"))
        if self.mode not in _MODES:
            raise ConfigError("mode", self.mode, " or ".join(repr(m) for m in _MODES))
        _partitioner_of(self.partitioner).validate(self.producers, self.consumers)

    @property
    def resolved(self) -> Partitioner:
        return _partitioner_of(self.partitioner)

    @property
    def label(self) -> str:
        return self.name or f"{self.resolved.name.lower()}-{self.mode}"

    @classmethod
    def from_plan(cls, plan: ExchangePlan) -> ExchangeSpec:
        return cls(plan.num_producers, plan.num_consumers, plan.partitioner, plan.mode, plan.name)

    @classmethod
    def parse(cls, text: str) -> ExchangeSpec:
        """``"4:4:hash:pipelined"`` (producers:consumers[:partitioner[:mode]])."""
        parts = [p.strip() for p in str(text).split(":")]
        if not 2 <= len(parts) <= 4:
            raise ConfigError("exchange", text, "producers:consumers[:partitioner[:mode]], e.g. 4:4:hash:pipelined")
        try:
            producers, consumers = int(parts[0]), int(parts[1])
        except ValueError:
            raise ConfigError("exchange", text, "integer producer and consumer counts, e.g. 4:4:hash") from None
        return cls(producers, consumers, *(parts[2:]))


@dataclass(frozen=True)
class Executors:
    """The executors a topology runs on: how many, task slots each, network memory each (bytes or "64mb").

    ``network_memory=None`` takes the config's ``network_memory``. ``placement``, if given, is the executor
    (0 .. count - 1) of every task of the pipelined stages, as Spark placed them; without it the planner
    assumes the placement that needs the most buffers on one executor.
    """

    count: int = 1
    slots: int = 1
    network_memory: int | str | None = None
    placement: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "count", check_count(self.count, "executors"))
        object.__setattr__(self, "slots", check_count(self.slots, "slots"))
        if self.network_memory is not None:
            object.__setattr__(self, "network_memory", parse_size(self.network_memory, "network_memory"))
        if self.placement is not None:
            placement = tuple(self.placement)
            if any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < self.count for e in placement):
                raise ConfigError("placement", self.placement, f"an executor index in [0, {self.count}) per task")
            busiest = max((placement.count(e) for e in set(placement)), default=0)
            if busiest > self.slots:
                raise ConfigError(
                    "placement", self.placement, f"at most slots={self.slots} tasks per executor", f"one has {busiest}"
                )
            object.__setattr__(self, "placement", placement)

    @property
    def total_slots(self) -> int:
        return self.count * self.slots


# -- plan ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskPlan:
    """The buffers of one task of one stage: the exchange halves it hosts and their pools."""

    stage: str
    task: int
    parts: tuple[str, ...]  # e.g. ("hash-pipelined producer 0", "hash-pipelined consumer 0")
    subpartitions: int
    channels: int
    remote_channels: int
    buffers: TaskBuffers
    announced: int
    segment_size: int

    @property
    def required(self) -> int:
        return self.buffers.required

    @property
    def maximum(self) -> int:
        return self.buffers.maximum

    def row(self) -> dict[str, Any]:
        b = self.buffers
        return {
            "stage": self.stage,
            "task": self.task,
            "parts": ", ".join(self.parts),
            "subpartitions": self.subpartitions,
            "channels": self.channels,
            "remote_channels": self.remote_channels,
            "partition_min": b.partition_min,
            "partition_max": None if b.partition_max >= _UNBOUNDED else b.partition_max,
            "exclusive": b.exclusive,
            "floating_min": b.floating_min,
            "floating_max": b.floating_max,
            "required_buffers": b.required,
            "max_buffers": b.maximum,
            "announced_buffers": self.announced,
            "required_bytes": b.required * self.segment_size,
            "max_bytes": b.maximum * self.segment_size,
        }


@dataclass(frozen=True)
class StagePlan:
    """One Spark stage: its tasks and what the busiest executor needs while it runs."""

    name: str
    mode: str
    tasks: tuple[TaskPlan, ...]
    tasks_per_executor: int
    required_per_executor: int
    max_per_executor: int
    network_buffers: int
    segment_size: int
    all_at_once: bool  # a barrier stage: every task must have a slot at the same time
    total_slots: int
    #: The executor of every task the numbers assume (a barrier stage), or None (no channel depends on it).
    placement: tuple[int, ...] | None = None

    @property
    def fits_memory(self) -> bool:
        return self.required_per_executor <= self.network_buffers

    @property
    def fits_slots(self) -> bool:
        return not self.all_at_once or len(self.tasks) <= self.total_slots

    @property
    def fits(self) -> bool:
        return self.fits_memory and self.fits_slots

    def row(self) -> dict[str, Any]:
        worst = max(self.tasks, key=lambda t: t.required)
        mib = 1 << 20
        return {
            "stage": self.name,
            "mode": self.mode,
            "tasks": len(self.tasks),
            "tasks_per_executor": self.tasks_per_executor,
            "buffers_per_task": worst.required,
            "required_per_executor": self.required_per_executor,
            "max_per_executor": self.max_per_executor,
            "network_buffers": self.network_buffers,
            "required_mib": self.required_per_executor * self.segment_size / mib,
            "max_mib": self.max_per_executor * self.segment_size / mib,
            "network_mib": self.network_buffers * self.segment_size / mib,
            "usage": self.required_per_executor / self.network_buffers if self.network_buffers else math.inf,
            "fits_memory": self.fits_memory,
            "fits_slots": self.fits_slots,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class NetworkPlan:
    """The network buffers of a topology on given executors, and whether they fit."""

    exchanges: tuple[ExchangeSpec, ...]
    executors: Executors
    config: NetworkConfig
    stages: tuple[StagePlan, ...] = field(default_factory=tuple)

    @property
    def network_buffers(self) -> int:
        return self.config.total_network_buffers

    @property
    def required_per_executor(self) -> int:
        """What the busiest executor reserves in the busiest stage (stages run one after the other)."""
        return max(s.required_per_executor for s in self.stages)

    @property
    def max_per_executor(self) -> int:
        return max(s.max_per_executor for s in self.stages)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def worst_stage(self) -> StagePlan:
        return max(self.stages, key=lambda s: (not s.fits, s.required_per_executor))

    def tasks(self) -> pd.DataFrame:
        """One row per task of every stage (pandas)."""
        import pandas as pd

        return pd.DataFrame([t.row() for s in self.stages for t in s.tasks])

    def stages_table(self) -> pd.DataFrame:
        """One row per stage: tasks, what one executor needs at worst, network buffers, verdict (pandas)."""
        import pandas as pd

        return pd.DataFrame([s.row() for s in self.stages])

    def error(self) -> InsufficientNetworkBuffersError | None:
        """The error Flink would raise on the busiest executor, or None if the buffers fit."""
        stage = max(self.stages, key=lambda s: s.required_per_executor - s.network_buffers)
        if stage.fits_memory:
            return None
        worst = max(stage.tasks, key=lambda t: t.required)
        detail = (
            f"stage '{stage.name}': {stage.tasks_per_executor} task(s) at once on one executor "
            f"(the heaviest needs {worst.required} buffers: {', '.join(worst.parts)}); "
            f"{stage.required_per_executor * self.config.segment_size / (1 << 20):.1f} MiB of network memory "
            f"needed per executor, {self.config.network_memory / (1 << 20):.1f} MiB configured"
        )
        return InsufficientNetworkBuffersError(
            required=stage.required_per_executor,
            available=stage.network_buffers,
            total=stage.network_buffers,
            segment_size=self.config.segment_size,
            setting=f"{NETWORK_MEMORY_SETTING} (network_memory)",
            detail=detail,
        )

    def raise_if_not_fits(self) -> None:
        """Raise InsufficientNetworkBuffersError naming required vs available and the setting to raise."""
        error = self.error()
        if error is not None:
            raise error

    def summary(self) -> str:
        """A few lines for people: per stage, what one executor needs, and the verdict."""
        seg = self.config.segment_size
        lines = [
            f"{self.executors.count} executor(s) x {self.executors.slots} slot(s), "
            f"{self.network_buffers} network buffers of {seg // 1024} KiB each "
            f"({self.config.network_memory / (1 << 20):.1f} MiB) per executor"
        ]
        for s in self.stages:
            verdict = "fits" if s.fits else "DOES NOT FIT"
            lines.append(
                f"  {s.name}: {len(s.tasks)} task(s), up to {s.tasks_per_executor} per executor, "
                f"{s.required_per_executor} buffers required per executor "
                f"({s.required_per_executor * seg / (1 << 20):.2f} MiB), up to {s.max_per_executor} "
                f"({s.max_per_executor * seg / (1 << 20):.2f} MiB): {verdict}"
            )
            if not s.fits_slots:
                lines.append(
                    f"    a {s.mode} stage runs all {len(s.tasks)} tasks at once; the executors have "
                    f"{s.total_slots} slots"
                )
        if self.fits:
            lines.append(f"fits: {self.required_per_executor} of {self.network_buffers} buffers per executor")
        elif not all(s.fits_memory for s in self.stages):
            lines.append(
                f"does not fit: {self.required_per_executor} buffers required per executor, "
                f"{self.network_buffers} available; raise {NETWORK_MEMORY_SETTING} (network_memory)"
            )
        else:
            lines.append("does not fit: not enough task slots for a pipelined stage")
        return "\n".join(lines)

    def headline(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "required_buffers_per_executor": self.required_per_executor,
            "max_buffers_per_executor": self.max_per_executor,
            "network_buffers_per_executor": self.network_buffers,
            "required_mib_per_executor": round(self.required_per_executor * self.config.segment_size / (1 << 20), 3),
            "network_mib_per_executor": round(self.config.network_memory / (1 << 20), 3),
            "stages": len(self.stages),
        }


# -- building the plan ---------------------------------------------------------------------------------


@dataclass
class _Half:
    label: str
    buffers: TaskBuffers
    subpartitions: int = 0
    channels: int = 0
    remote: int = 0
    gates: list[tuple[int, bool]] = field(default_factory=list)
    partitions: list[tuple[int, str]] = field(default_factory=list)


def _halves(
    spec: ExchangeSpec, config: NetworkConfig, placement: Sequence[int] | None = None
) -> tuple[list[_Half | None], list[_Half | None]]:
    """(producer half per producer subtask, consumer half per consumer subtask) of one exchange;
    ``placement[i]`` is the executor of task *i* (None: every task its own)."""
    p = spec.resolved
    s, t, mode = spec.producers, spec.consumers, spec.mode
    producers: list[_Half | None] = []
    for i in range(s):
        n = len(p.consumers_of(i, s, t))
        producers.append(
            _Half(
                f"{spec.label} producer {i}",
                producer_buffers(n, config, mode),
                subpartitions=n,
                partitions=[(n, partition_type(mode))],
            )
        )
    consumers: list[_Half | None] = []
    for j in range(t):
        channels = p.producers_of(j, s, t)
        remote = len(channels) - _local_channels(channels, j, mode, config, placement)
        consumers.append(
            _Half(
                f"{spec.label} consumer {j}",
                consumer_buffers(len(channels), remote, config, mode),
                channels=len(channels),
                remote=remote,
                gates=[(len(channels), mode == "blocking")],
            )
        )
    return producers, consumers


def _merge(a: Sequence[Any], b: Sequence[Any]) -> list[list[_Half]]:
    """Task-wise union of two lists whose items are halves, lists of halves or None."""

    def items(x: Any) -> list[_Half]:
        if x is None:
            return []
        return list(x) if isinstance(x, list) else [x]

    width = max(len(a), len(b))
    return [items(a[i] if i < len(a) else None) + items(b[i] if i < len(b) else None) for i in range(width)]


def _task_plan(stage: str, index: int, halves: list[_Half], config: NetworkConfig) -> TaskPlan:
    buffers = _NONE
    gates: list[tuple[int, bool]] = []
    partitions: list[tuple[int, str]] = []
    for h in halves:
        buffers = buffers + h.buffers
        gates += h.gates
        partitions += h.partitions
    return TaskPlan(
        stage=stage,
        task=index,
        parts=tuple(h.label for h in halves),
        subpartitions=sum(h.subpartitions for h in halves),
        channels=sum(h.channels for h in halves),
        remote_channels=sum(h.remote for h in halves),
        buffers=buffers,
        announced=network_buffers_for_announcing(gates, partitions, config),
        segment_size=config.segment_size,
    )


#: One stage of a topology: (exchange, which halves) in the order they share its tasks; "both" is a
#: pipelined exchange's producer and consumer halves.
_Parts = list[tuple[ExchangeSpec, str]]


def _stage_tasks(parts: _Parts, config: NetworkConfig, placement: Sequence[int] | None) -> list[list[_Half]]:
    tasks: list[list[_Half]] = []
    for spec, which in parts:
        producers, consumers = _halves(spec, config, placement)
        if which == "both":
            halves = _merge(producers, consumers)
        else:
            halves = _merge(producers if which == "producers" else consumers, [])
        tasks = _merge(tasks, halves)
    return tasks


def _placements(plans: Sequence[TaskPlan], executors: Executors) -> list[tuple[int, ...]]:
    """The placements a barrier stage of ``plans`` may get that could need the most on one executor: for
    every number k of tasks one executor can hold while all run at once, the k heaviest tasks (when every
    channel between tasks is remote) on executor 0 and the others round robin over the others."""
    width, count, slots = len(plans), executors.count, executors.slots
    low, high = max(1, width - (count - 1) * slots), min(slots, width)
    if low > high:  # the stage does not fit the slots (reported as such); any placement will do for memory
        low = high
    order = sorted(range(width), key=lambda i: (-plans[i].required, i))
    out = []
    for k in range(low, high + 1):
        placement = [0] * width
        for n, task in enumerate(order[k:]):
            placement[task] = 1 + n % (count - 1) if count > 1 else 0
        out.append(tuple(placement))
    return out


def _stage(
    name: str, mode: str, parts: _Parts, executors: Executors, config: NetworkConfig, barrier: bool
) -> StagePlan:
    def task_plans(placement: Sequence[int] | None) -> tuple[TaskPlan, ...]:
        tasks = _stage_tasks(parts, config, placement)
        return tuple(_task_plan(name, i, halves, config) for i, halves in enumerate(tasks))

    plans = task_plans(None)
    pipelined = any(which == "both" for _, which in parts)
    if not (barrier and pipelined):  # no channel depends on the placement: the heaviest tasks together
        at_once = min(executors.slots, len(plans))
        heaviest = sorted((t.required for t in plans), reverse=True)[:at_once]
        largest = sorted((t.maximum for t in plans), reverse=True)[:at_once]
        worst: tuple[int, int, int, tuple[TaskPlan, ...], tuple[int, ...] | None] = (
            sum(heaviest),
            sum(largest),
            at_once,
            plans,
            None,
        )
    else:
        placements = [executors.placement] if executors.placement is not None else _placements(plans, executors)
        worst = (-1, 0, 0, plans, None)
        largest_max = 0
        for placement in placements:
            if len(placement) != len(plans):
                raise ConfigError(
                    "placement", placement, f"one executor per task of stage '{name}' ({len(plans)} tasks)"
                )
            tasks = task_plans(placement)
            by_executor: dict[int, list[TaskPlan]] = {}
            for task, executor in zip(tasks, placement):
                by_executor.setdefault(executor, []).append(task)
            for group in by_executor.values():
                required = sum(t.required for t in group)
                largest_max = max(largest_max, sum(t.maximum for t in group))
                if required > worst[0]:
                    worst = (required, 0, len(group), tasks, tuple(placement))
        worst = (worst[0], largest_max, worst[2], worst[3], worst[4])
    required, maximum, at_once, plans, worst_placement = worst
    return StagePlan(
        name=name,
        mode=mode,
        tasks=plans,
        tasks_per_executor=at_once,
        required_per_executor=required,
        max_per_executor=maximum,
        network_buffers=config.total_network_buffers,
        segment_size=config.segment_size,
        all_at_once=barrier,
        total_slots=executors.total_slots,
        placement=worst_placement,
    )


def plan_network(
    exchanges: ExchangeSpec | Sequence[ExchangeSpec],
    executors: Executors | None = None,
    config: NetworkConfig | None = None,
    *,
    chain: bool = False,
) -> NetworkPlan:
    """The network buffers of ``exchanges`` on ``executors`` with ``config`` (defaults: Flink's).

    ``executors.network_memory``, when given, overrides ``config.network_memory``. With ``chain=True``
    exchange *k*'s consumer subtask *i* and exchange *k + 1*'s producer subtask *i* run in the same task
    (the consumer count of *k* must equal the producer count of *k + 1*).
    """
    specs = (exchanges,) if isinstance(exchanges, ExchangeSpec) else tuple(exchanges)
    if not specs:
        raise ConfigError("exchanges", specs, "at least one exchange")
    for spec in specs:
        if not isinstance(spec, ExchangeSpec):
            raise ConfigError("exchanges", spec, "ExchangeSpec values")
    executors = executors or Executors()
    config = config or NetworkConfig()
    if executors.network_memory is not None and executors.network_memory != config.network_memory:
        config = config.replace(network_memory=executors.network_memory)
    if chain:
        for k in range(len(specs) - 1):
            if specs[k].consumers != specs[k + 1].producers:
                raise ConfigError(
                    "chain",
                    True,
                    "consecutive exchanges whose consumer and producer counts match",
                    f"exchange {k} has {specs[k].consumers} consumers, exchange {k + 1} "
                    f"{specs[k + 1].producers} producers",
                )
    stages: list[StagePlan] = []
    # halves waiting to share tasks with the next exchange's producers (chain=True), and their stage name
    pending: _Parts = []
    pending_name, pending_barrier = "", False
    for k, spec in enumerate(specs):
        label = spec.label if len(specs) == 1 else f"{k}:{spec.label}"
        spec = ExchangeSpec(spec.producers, spec.consumers, spec.partitioner, spec.mode, label)
        if spec.resolved.name == "HASH":  # key groups: the consumers must not outnumber them
            resolve = getattr(spec.resolved, "resolve_max_parallelism", None)
            if resolve is not None:
                resolve(spec.consumers, config.max_parallelism)
            else:
                config.resolve_max_parallelism(spec.consumers)
        carries = chain and k + 1 < len(specs)
        prefix = f"{pending_name} + " if pending else ""
        if spec.mode == "pipelined":  # one barrier stage: producer i and consumer i in task i
            parts = [*pending, (spec, "both")]
            if carries:
                pending, pending_name, pending_barrier = parts, prefix + label, True
                continue
            stages.append(_stage(prefix + label, spec.mode, parts, executors, config, True))
        else:  # a producer stage, then a consumer stage
            parts = [*pending, (spec, "producers")]
            stage = _stage(f"{prefix}{label} produce", spec.mode, parts, executors, config, pending_barrier)
            stages.append(stage)
            if carries:
                pending, pending_name, pending_barrier = [(spec, "consumers")], f"{label} consume", False
                continue
            stages.append(_stage(f"{label} consume", spec.mode, [(spec, "consumers")], executors, config, False))
        pending, pending_name, pending_barrier = [], "", False
    return NetworkPlan(specs, executors, config, tuple(stages))


def plan_table(
    exchanges: ExchangeSpec | Sequence[ExchangeSpec],
    executors: Executors | None = None,
    config: NetworkConfig | None = None,
    *,
    chain: bool = False,
    level: str = "stage",
) -> pd.DataFrame:
    """:func:`plan_network` as a pandas DataFrame: one row per stage (``level="stage"``) or per task."""
    plan = plan_network(exchanges, executors, config, chain=chain)
    if level == "stage":
        return plan.stages_table()
    if level == "task":
        return plan.tasks()
    raise ConfigError("level", level, "'stage' or 'task'")


def plan_dataframe(
    spark: SparkSession,
    exchanges: ExchangeSpec | Sequence[ExchangeSpec],
    executors: Executors | None = None,
    config: NetworkConfig | None = None,
    *,
    chain: bool = False,
    level: str = "stage",
) -> DataFrame:
    """:func:`plan_table` as a Spark DataFrame. ``executors`` and ``config`` default to the session's."""
    if config is None:
        config = NetworkConfig.from_spark(spark)
    if executors is None:
        executors = executors_from_spark(spark)
    table = plan_table(exchanges, executors, config, chain=chain, level=level)
    if "partition_max" in table:
        table["partition_max"] = table["partition_max"].astype("Int64")
    return spark.createDataFrame(table)


# -- the Spark session's executors ---------------------------------------------------------------------


def executors_from_spark(spark: Any) -> Executors:
    """The session's executors (:mod:`~spark_credit_shuffle.runtime.session`): how many it is configured
    with (1 when unknown) and the task slots of each."""
    return Executors(configured_executors(spark) or 1, executor_slots(spark))


def check_fits(plan: ExchangePlan, spark: Any) -> None:
    """Raise InsufficientNetworkBuffersError if one executor cannot reserve what its tasks need.

    Run by ``exchange()`` before any Spark job, with the session's executors and the plan's settings.
    Blocking mode runs producers and consumers in separate stages; pipelined mode runs both halves of a
    subtask in one task. An executor runs up to ``executor_slots`` tasks at once.
    """
    network = plan_network(ExchangeSpec.from_plan(plan), executors_from_spark(spark), plan.config)
    network.raise_if_not_fits()
