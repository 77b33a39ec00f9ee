"""A virtual clock and a discrete-event simulation of an exchange through the real protocol core.

Producers write records at a given rate through real :class:`PipelinedResultPartition`\\ s (with their
LocalBufferPools, max buffers per channel and overdraft, and a buffer-timeout flusher); consumers read
their :class:`SingleInputGate` and spend ``size / rate`` virtual seconds on each buffer before they
recycle it. Remote channels travel over :class:`~spark_credit_shuffle.transport.memory.MemoryConnection`\\ s
with an optional latency and bandwidth, one connection per host pair (Flink's multiplexing: every channel
between two hosts shares it) or per task pair; a consumer on the producer's host reads it through a
:class:`LocalInputChannel`: directly (``local_channels="direct"``, Flink's TaskManager) or through a
connection (``"connection"``: tasks of one Spark executor in different Python processes), where the
producer holds each data buffer's segment in its pool until the consumer recycled it. Everything runs
on virtual time, so results are deterministic and independent of the machine, which makes the simulation
usable for what-if questions ("what does one slow consumer do to the others, with and without credits?")
and for tests.

The report gives per-channel and per-subtask bytes and throughput, the time producers spent back-pressured,
and samples over virtual time of the Flink metrics (outPoolUsage, inPoolUsage, exclusive and floating
buffer usage, backlog, queue lengths).

With ``checkpoint_interval_ms`` > 0 a coordinator triggers checkpoint barriers in every producer, one
checkpoint at a time, and each consumer aligns them with :class:`SingleCheckpointBarrierHandler` (its
completed checkpoints are in :attr:`ConsumerStats.checkpoints`); without credits the alignment is the old
model's (see :func:`_barrier_buffer`).
"""

from .clock import VirtualClock
from .model import Simulation, simulate
from .report import ChannelStats, ConsumerStats, ProducerStats, SimulationReport

__all__ = [
    "ChannelStats",
    "ConsumerStats",
    "ProducerStats",
    "Simulation",
    "SimulationReport",
    "VirtualClock",
    "simulate",
]
