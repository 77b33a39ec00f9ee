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

from .config import NetworkConfig
from .errors import InsufficientNetworkBuffersError

if TYPE_CHECKING:
    from .exchange import ExchangePlan

__all__ = ["TaskBuffers", "check_fits", "executor_slots", "gate_buffers", "partition_buffers", "task_buffers"]

_LOCAL = re.compile(r"^local(?:-cluster)?\[(\*|\d+)(?:\s*,\s*\d+)?\]$|^local$")


def partition_buffers(num_subpartitions: int, config: NetworkConfig, mode: str) -> tuple[int, int | None]:
    """(min, max) buffers of a result partition's LocalBufferPool; max None means unbounded.

    Pipelined (PIPELINED_BOUNDED): min N + 1, max N * buffers_per_channel + floating_buffers_per_gate.
    Blocking (hash BLOCKING): min N + 1, unbounded.
    """
    minimum = num_subpartitions + 1
    if mode == "blocking":
        return minimum, None
    return minimum, max(minimum, num_subpartitions * config.buffers_per_channel + config.floating_buffers_per_gate)


def gate_buffers(num_channels: int, num_local_channels: int, config: NetworkConfig, mode: str) -> tuple[int, int, int]:
    """(exclusive per remote channel, floating pool min, floating pool max) of one input gate.

    Follows ``InputGateSpecUtils.createGateBuffersSpec``: required = C * bpc + 1 (capped at 1000 for
    blocking), exclusive per channel = min(bpc, (required - 1) / C), floating min = required -
    C * exclusive, floating max = C * bpc + fpg - C * exclusive. Local channels get no exclusive buffers.
    """
    channels = num_channels
    bpc, fpg = config.buffers_per_channel, config.floating_buffers_per_gate
    target_required = channels * bpc + 1
    max_required = 1000 if mode == "blocking" else target_required
    required = min(max_required, target_required)
    exclusive = min(bpc, (required - 1) // channels) if channels else 0
    floating_min = required - channels * exclusive
    floating_max = channels * bpc + fpg - channels * exclusive
    del num_local_channels  # local channels take no exclusive buffers; see task_buffers
    return exclusive, floating_min, max(floating_min, floating_max)


@dataclass(frozen=True)
class TaskBuffers:
    """Network buffers one task reserves at set-up (the minimums Flink checks)."""

    partition_min: int
    partition_max: int | None
    exclusive: int
    floating_min: int
    floating_max: int

    @property
    def required(self) -> int:
        return self.partition_min + self.exclusive + self.floating_min


def task_buffers(plan: ExchangePlan, subtask: int) -> tuple[TaskBuffers, TaskBuffers]:
    """(producer subtask's buffers, consumer subtask's buffers) of ``subtask`` in ``plan``."""
    p = plan.partitioner
    n_sub = len(p.consumers_of(subtask, plan.num_producers, plan.num_consumers)) if subtask < plan.num_producers else 0
    producer = TaskBuffers(*partition_buffers(n_sub, plan.config, plan.mode), 0, 0, 0) if n_sub else None
    if subtask < plan.num_consumers:
        channels = p.producers_of(subtask, plan.num_producers, plan.num_consumers)
        local = 1 if plan.mode == "pipelined" and subtask in channels else 0
        excl, fmin, fmax = gate_buffers(len(channels), local, plan.config, plan.mode)
        consumer = TaskBuffers(0, 0, excl * (len(channels) - local), fmin, fmax)
    else:
        consumer = None
    empty = TaskBuffers(0, 0, 0, 0, 0)
    return producer or empty, consumer or empty


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
            setting="spark.creditShuffle.networkMemory (network_memory)",
        )
