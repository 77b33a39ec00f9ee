"""Building the plan: the halves of every exchange each task of each stage hosts, and for a barrier
stage the placements of its tasks on executors that could need the most on one executor (the package
docstring says which). :func:`plan_network` and its pandas form :func:`plan_table`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..buffers.sizing import network_buffers_for_announcing
from ..config import NetworkConfig
from ..errors import ConfigError
from .network_plan import NetworkPlan, StagePlan, TaskPlan
from .task_buffers import (
    NO_BUFFERS,
    TaskBuffers,
    consumer_buffers,
    local_channel_count,
    partition_type,
    producer_buffers,
)
from .topology import ExchangeSpec, Executors

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["plan_network", "plan_table"]


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
        remote = len(channels) - local_channel_count(channels, j, mode, config, placement)
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
    buffers = NO_BUFFERS
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
