"""The network buffers of one task: its result partition's pool and its input gate's exclusive and
floating buffers, as Flink sizes them (``buffers/sizing.py``), and how many of a consumer's channels are
local (no exclusive buffers) for a placement of tasks on executors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..buffers.sizing import (
    UNBOUNDED,
    PartitionType,
    input_gate_buffers_spec,
    result_partition_pool_size,
)
from ..config import NetworkConfig
from .channels import Endpoint, channel_route

if TYPE_CHECKING:
    from .topology import PlannedExchange

__all__ = [
    "NO_BUFFERS",
    "TaskBuffers",
    "consumer_buffers",
    "local_channel_count",
    "partition_type",
    "producer_buffers",
    "task_buffers",
]


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


#: A task that hosts no half of an exchange.
NO_BUFFERS = TaskBuffers(0, 0, 0, 0, 0)


def _bounded(lo: int, hi: int) -> int:
    return lo if hi >= UNBOUNDED else hi


def _saturating_add(a: int, b: int) -> int:
    return min(UNBOUNDED, a + b)


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


def local_channel_count(channels: Sequence[int], subtask: int, mode: str, config: NetworkConfig, placement: Any) -> int:
    """How many of consumer ``subtask``'s ``channels`` (producer subtasks) are local: in pipelined mode its
    own task's, and with ``local_channels="executor"`` every producer whose task shares its executor
    (``placement[i]`` is the executor of task *i*; None: every task its own executor)."""
    if mode != "pipelined":  # a blocking consumer reads every producer from Spark's shuffle
        return 0
    at = Endpoint.pipelined_task
    mine = at(subtask, placement)
    return sum(1 for p in channels if channel_route(at(p, placement), mine, config.local_channels).is_local)


def task_buffers(
    plan: PlannedExchange, subtask: int, placement: Sequence[Any] | None = None
) -> tuple[TaskBuffers, TaskBuffers]:
    """(producer half, consumer half) of subtask ``subtask`` of ``plan``: the pools the runtime creates.

    ``placement[i]`` names the executor of task *i* (pipelined mode: channels between tasks of one executor
    are local); None: every task its own executor."""
    p, config = plan.partitioner, plan.config
    producer = consumer = NO_BUFFERS
    if subtask < plan.num_producers:
        n = len(p.consumers_of(subtask, plan.num_producers, plan.num_consumers))
        producer = producer_buffers(n, config, plan.mode)
    if subtask < plan.num_consumers:
        channels = p.producers_of(subtask, plan.num_producers, plan.num_consumers)
        local = local_channel_count(channels, subtask, plan.mode, config, placement)
        consumer = consumer_buffers(len(channels), len(channels) - local, config, plan.mode)
    return producer, consumer
