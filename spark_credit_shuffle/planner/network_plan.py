"""The planner's answer: per task (:class:`TaskPlan`), per stage (:class:`StagePlan`: what the busiest
executor needs while it runs) and for the topology (:class:`NetworkPlan`: the verdict, the error Flink
would raise, a summary for people and pandas tables)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..buffers.pools import NETWORK_MEMORY_SETTING
from ..buffers.sizing import UNBOUNDED
from ..config import DEFAULT_SEGMENT_SIZE, NetworkConfig
from ..errors import InsufficientNetworkBuffersError
from .task_buffers import TaskBuffers
from .topology import ExchangeSpec, Executors

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["NetworkPlan", "StagePlan", "TaskPlan"]


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
            "partition_max": None if b.partition_max >= UNBOUNDED else b.partition_max,
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
        if self.config.segment_size > DEFAULT_SEGMENT_SIZE:  # the setting the user raised: name it too
            detail += f"; or lower segment_size ({self.config.segment_size // 1024} KiB, default 32 KiB)"
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
