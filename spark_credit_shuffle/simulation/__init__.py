"""A virtual clock and a discrete-event simulation of an exchange through the real protocol core and the task
engine.

Producers are the task engine's producer half (:class:`~spark_credit_shuffle.engine.ProducerEngine`):
they write Arrow record batches (one ``seq`` column and a payload that brings a record to about
``record_size`` bytes, pre-built and sliced) at a given rate through its resumable RecordWriter into real
:class:`PipelinedResultPartition`\\ s (with their LocalBufferPools, max buffers per channel and overdraft),
and its timer flushes (buffer timeout) and sends keep-alives. Consumers are the consumer half
(:class:`~spark_credit_shuffle.engine.ConsumerEngine`): they read their :class:`SingleInputGate`,
decode every buffer with its RecordReaders (the rows of each channel are checked in order) and spend
``size / rate`` virtual seconds on each buffer before they recycle it.

Remote channels travel over :class:`~spark_credit_shuffle.transport.in_memory.MemoryConnection`\\ s with an
optional latency and bandwidth, one connection per host pair (Flink's multiplexing: every channel
between two hosts shares it) or per task pair; a consumer on the producer's host reads it through a
:class:`LocalInputChannel`: directly (``processes="host"``, Flink's TaskManager) or through a
connection (``processes="subtask"``: tasks of one Spark executor in different Python processes), where the
producer holds each data buffer's segment in its pool until the consumer recycled it. Everything runs
on virtual time, so results are deterministic and independent of the machine, which makes the simulation
usable for what-if questions ("what does one slow consumer do to the others, with and without credits?")
and for tests.

The report (:class:`SimulationReport`) holds what the run measured as the runtimes report it, as metric rows: the
task engine's rows of every subtask (per channel bytes, buffers and records in and out, pool usages, the time
producers spent back-pressured, ...) with the run's own measurements beside them (finish times, each
consumer's throughput over the window), and samples over virtual time of the Flink metrics (outPoolUsage,
inPoolUsage, exclusive and floating buffer usage, backlog, queue lengths) as the runtimes' timeline rows.
The topology (hosts, where each channel reads from) and the run's checks (every row delivered in order,
every buffer returned) are plain attributes.

With ``checkpoint_interval_ms`` > 0 a coordinator triggers checkpoint barriers in every producer, one
checkpoint at a time, and each consumer aligns them with :class:`SingleCheckpointBarrierHandler` (its
completed checkpoints, stamped on the virtual clock, are the runtimes' records:
:meth:`SimulationReport.checkpoint_records`); without credits the alignment is the old model's (see
:mod:`.checkpoints`).

Modules: :mod:`.clock` (the virtual clock), :mod:`.model` (the topology and the run), :mod:`.producer` and
:mod:`.consumer` (the subtasks), :mod:`.checkpoints`, :mod:`.observe` (samples, invariants),
:mod:`.report`, :mod:`.sweep` (a grid of simulations as a Spark job, one per task).
"""

from .clock import VirtualClock
from .model import Simulation, simulate
from .report import ChannelOrigin, SimulationReport
from .sweep import SweepPoint, grid, run_points, sweep, sweep_frame

__all__ = [
    "ChannelOrigin",
    "Simulation",
    "SimulationReport",
    "SweepPoint",
    "VirtualClock",
    "grid",
    "run_points",
    "simulate",
    "sweep",
    "sweep_frame",
]
