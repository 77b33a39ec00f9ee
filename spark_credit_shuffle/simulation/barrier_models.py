"""Checkpoint barriers in the simulation: the coordinator's trigger rule and the barrier of each flow-control
model.

The model without credits is Flink's before credit-based flow control (<= 1.4, and 1.5-1.9 with
``taskmanager.network.credit-model: false``). Its aligned checkpoints did not block upstream: a barrier
travelled as a plain event (the upstream-blocking ALIGNED_CHECKPOINT_BARRIER type and ResumeConsumption
came with credit-based blocking, after the old model was gone), the sender went on sending the channel,
and the consumer's BarrierBuffer kept reading every channel of the connection: the buffers of a channel
that had delivered the barrier were spilled (BufferSpiller: written aside, the network buffer recycled
at once) and replayed, in order, before any new input once the alignment ended. A receiver can stop one
channel there only by stopping the whole connection, so this is what the simulation does for
``credit_based=False``; with credits the subpartition blocks itself at the barrier as in current Flink.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..buffers.buffer import Buffer, DataType
from ..buffers.format import CheckpointBarrier, encode_event

__all__ = ["CheckpointCoordinator", "barrier_buffer"]


def barrier_buffer(barrier: CheckpointBarrier, credit_based: bool) -> Buffer:
    """The buffer a producer adds for ``barrier``: an aligned barrier of the model without credits travels as
    a plain event (its subpartition does not block)."""
    buffer = encode_event(barrier)
    if not credit_based and buffer.data_type.is_blocking_upstream:
        return Buffer(DataType.EVENT_BUFFER, buffer.data)
    return buffer


class _Producer(Protocol):
    finished: bool

    def inject_barrier(self, now: float, checkpoint_id: int) -> None: ...


class _Consumer(Protocol):
    finished: bool

    @property
    def checkpoint_done(self) -> int: ...


class CheckpointCoordinator:
    """Flink's checkpoint coordinator with its defaults (``execution.checkpointing.max-concurrent-checkpoints``
    1, no minimum pause): every ``interval`` seconds it triggers the next checkpoint in every producer at
    once, unless the last one is still pending on some consumer; then it tries at the next tick."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.triggered = 0

    def tick(self, now: float, producers: Sequence[_Producer], consumers: Sequence[_Consumer]) -> float | None:
        """Trigger the next checkpoint at ``now`` if none is pending; the time of the next tick (None once
        every producer finished)."""
        last = self.triggered
        if last == 0 or all(c.finished or c.checkpoint_done >= last for c in consumers):
            self.triggered = last + 1
            for producer in producers:
                producer.inject_barrier(now, last + 1)
        if all(p.finished for p in producers):
            return None
        return now + self.interval
