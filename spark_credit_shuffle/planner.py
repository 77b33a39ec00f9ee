"""How many network buffers an exchange needs, computed before anything runs.

Flink reserves each pool's minimum at task set-up and fails there with "Insufficient number of
network buffers". The planner applies the same rules (reference §4.3) to an exchange and the
executors it will run on, so the error comes on the driver, before a Spark job starts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import InsufficientNetworkBuffersError
from .protocol.pools import NETWORK_MEMORY_SETTING, PartitionType, input_gate_buffers_spec, result_partition_pool_size

if TYPE_CHECKING:
    from .exchange import ExchangePlan

__all__ = ["TaskBuffers", "check_fits", "executor_slots", "partition_type", "task_buffers"]

_LOCAL = re.compile(r"^local(?:-cluster)?\[(\*|\d+)(?:\s*,\s*\d+)?\]$|^local$")


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


_NONE = TaskBuffers(0, 0, 0, 0, 0)


def partition_type(mode: str) -> str:
    """Flink's partition type of an exchange mode: PIPELINED_BOUNDED or (hash) BLOCKING."""
    return PartitionType.BLOCKING if mode == "blocking" else PartitionType.PIPELINED_BOUNDED


def task_buffers(plan: ExchangePlan, subtask: int) -> tuple[TaskBuffers, TaskBuffers]:
    """(producer half, consumer half) of subtask ``subtask`` of ``plan``: the pools the runtime creates."""
    p, config = plan.partitioner, plan.config
    producer = consumer = _NONE
    if subtask < plan.num_producers:
        n = len(p.consumers_of(subtask, plan.num_producers, plan.num_consumers))
        lo, hi = result_partition_pool_size(n, config, partition_type(plan.mode))
        producer = TaskBuffers(lo, hi, 0, 0, 0)
    if subtask < plan.num_consumers:
        channels = p.producers_of(subtask, plan.num_producers, plan.num_consumers)
        local = 1 if plan.mode == "pipelined" and subtask in channels else 0
        spec = input_gate_buffers_spec(
            len(channels), config, num_remote_channels=len(channels) - local, blocking=plan.mode == "blocking"
        )
        consumer = TaskBuffers(0, 0, spec.exclusive_total, spec.floating_min, spec.floating_max)
    return producer, consumer


def executor_slots(spark: Any) -> int:
    """Tasks one executor runs at once: ``local[N]`` gives N; otherwise executor cores / task cpus."""
    conf = spark.conf
    master = conf.get("spark.master", "local[*]") or "local[*]"
    task_cpus = int(conf.get("spark.task.cpus", "1") or 1)
    match = _LOCAL.match(master.strip())
    if match:
        n = match.group(1)
        cores = (os.cpu_count() or 1) if n in (None, "*") else int(n)
    else:
        cores = int(conf.get("spark.executor.cores", "1") or 1)
    return max(1, cores // task_cpus)


def check_fits(plan: ExchangePlan, spark: Any) -> None:
    """Raise InsufficientNetworkBuffersError if one executor cannot reserve what its tasks need.

    Blocking mode runs producers and consumers in separate stages; pipelined mode runs both halves
    of a subtask in one task. An executor runs up to ``executor_slots`` tasks at once.
    """
    worst = 0
    for subtask in range(max(plan.num_producers, plan.num_consumers)):
        producer, consumer = task_buffers(plan, subtask)
        if plan.mode == "pipelined":
            worst = max(worst, producer.required + consumer.required)
        else:
            worst = max(worst, producer.required, consumer.required)
    slots = min(executor_slots(spark), max(plan.num_producers, plan.num_consumers))
    required = worst * slots
    total = plan.config.total_network_buffers
    if required > total:
        raise InsufficientNetworkBuffersError(
            required=required,
            available=total,
            total=total,
            segment_size=plan.config.segment_size,
            setting=f"{NETWORK_MEMORY_SETTING} (network_memory)",
        )
