"""What a simulation run measured, as the runtimes' metric rows, with the topology it ran on and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..engine.checkpoints import CheckpointRecord
from ..metrics import MetricRow

__all__ = [
    "BYTES_IN_PER_SECOND",
    "DATA_BYTES_IN",
    "FINISH_TIME",
    "RECORDS_IN_PER_SECOND",
    "ChannelOrigin",
    "SimulationReport",
]

#: A subtask's finish time in virtual milliseconds (``channel`` null, ``stat = "total"``): when a producer
#: wrote its last record, when a consumer read the end of partition of its last channel.
FINISH_TIME = "finishTimeMs"
#: The bytes of the data buffers one channel of a consumer delivered (``channel`` the producer): Flink's
#: ``numBytesIn`` without the events (schema, barriers, end of partition), so the counterpart of the
#: producer's ``numBytesOut`` of that subpartition, which counts finished data buffers only.
DATA_BYTES_IN = "numDataBytesIn"
#: A consumer's throughput over the measured window (``stat = "mean"``): its ``numBytesIn`` over all channels
#: received within the window, divided by it, in bytes per virtual second (Flink's meter of ``numBytesIn``,
#: averaged over the window: the run after its warm-up).
BYTES_IN_PER_SECOND = "numBytesInPerSecond"
#: A consumer's records per virtual second over the measured window (``stat = "mean"``, Flink's meter of
#: ``numRecordsIn``): the throughput of records whatever the buffers' framing costs, which grows as buffers shrink.
RECORDS_IN_PER_SECOND = "numRecordsInPerSecond"


class ChannelOrigin(NamedTuple):
    """Where a consumer's channel reads from: a fact of the topology, not a measurement."""

    #: The producer's subpartition the channel reads.
    subpartition: int
    #: Read from the producer's host (a local input channel), not over the network.
    local: bool


@dataclass
class SimulationReport:
    """What a simulation run measured, in the runtimes' form: :class:`~spark_credit_shuffle.metrics.MetricRow`.

    ``rows`` are the summary rows at the end of the run (``Exchange.metric_rows()``'s form): the task engine's
    rows of every subtask (per channel ``numRecordsOut``/``numBytesOut``/``numBuffersOut`` and
    ``outputQueueLength``, per producer ``outPoolUsage`` and the time metrics, ``accumulateBackPressuredTimeMs``
    and the rest; per channel ``numRecordsIn``/``numBytesIn``/``numBuffersIn``, per consumer the pool usages,
    time metrics and, with checkpoints, the per-checkpoint rows that :meth:`checkpoint_records` reads), then
    the run's own measurements, named in the same style, times in virtual milliseconds as the timeline
    stamps them:

    - ``finishTimeMs`` (:data:`FINISH_TIME`), each subtask that finished: when, in virtual ms;
    - ``numDataBytesIn`` (:data:`DATA_BYTES_IN`), per consumer channel: the data buffers' bytes, equal to
      the producer's ``numBytesOut`` of the subpartition once the channel delivered everything;
    - ``numBytesInPerSecond`` (:data:`BYTES_IN_PER_SECOND`, ``stat = "mean"``), per consumer: the
      ``numBytesIn`` it received within the measured ``window``, bytes per virtual second;
    - ``numRecordsInPerSecond`` (:data:`RECORDS_IN_PER_SECOND`, ``stat = "mean"``), per consumer: the records
      it received within the window, per virtual second.

    ``timeline`` holds the samples over virtual time (``time_ms``: virtual milliseconds). A producer's share of
    the run spent back-pressured is ``value("producer", p, "accumulateBackPressuredTimeMs") / 1000 /
    end_time`` (the time counters count from the start, a warm-up included). What is no measurement stays out of
    the rows: the hosts of the subtasks, where each channel reads from (:meth:`channel_origin`) and the run's
    checks (``data_intact``, ``buffers_returned``).
    """

    #: Virtual seconds at the end of the run, and the window the throughputs are measured over: from the end
    #: of the simulation's ``warmup`` (0 by default) to the ``duration``, or to the end of a run that ended when
    #: everything was consumed.
    end_time: float
    window: float
    steps: int
    finished: bool
    #: Every channel delivered exactly the records written to it, in order, each with its whole payload.
    data_intact: bool
    #: The host of each subtask, by side (``"producer"``, ``"consumer"``): ``hosts[side][subtask]``.
    hosts: dict[str, list[int]]
    #: Each channel's origin by (consumer, producer): a consumer's channel is named by its producer, as in
    #: the metric rows.
    channel_origins: dict[tuple[int, int], ChannelOrigin]
    #: The summary rows (see above).
    rows: list[MetricRow] = field(default_factory=list)
    #: The samples over virtual time, as the runtimes' timeline rows (``time_ms``: virtual milliseconds).
    timeline: list[MetricRow] = field(default_factory=list)
    buffers_returned: bool = False
    connection_pauses: int = 0
    messages: int = 0

    def channel_origin(self, consumer: int, channel: int) -> ChannelOrigin:
        """The subpartition and locality of consumer ``consumer``'s channel ``channel`` (its producer, as the
        metric rows name a consumer's channel); KeyError if the producer does not feed that consumer."""
        return self.channel_origins[(consumer, channel)]

    def value(self, side: str, subtask: int, metric: str, channel: int | None = None, stat: str = "total") -> float:
        """One summary row's value: ``metric`` of ``side``'s ``subtask`` (of its ``channel``), e.g.
        ``value("producer", 0, "accumulateBackPressuredTimeMs")``. With ``channel`` None and no subtask-level
        row, the sum of the channels' rows: a counter the engine reports per channel only (``numBytesIn``,
        ``numDataBytesIn``...), summed as Flink's task-level counter sums its channels. KeyError if no row
        matches."""
        total, found = 0.0, False
        for r in self.rows:
            if r.side == side and r.subtask == subtask and r.metric == metric and r.stat == stat:
                if r.channel == channel:
                    return r.value
                if channel is None:
                    total += r.value
                    found = True
        if not found:
            raise KeyError(f"no {side} {subtask} row of {metric} ({stat}) on channel {channel}")
        return total

    def checkpoint_records(self, subtask: int | None = None) -> list[CheckpointRecord]:
        """The checkpoints the consumers completed (of consumer ``subtask`` only, if given), read from the
        per-checkpoint rows as ``Exchange.checkpoint_records()`` reads them; times in virtual ms."""
        records = CheckpointRecord.from_rows(self.rows)
        return records if subtask is None else [c for c in records if c.subtask == subtask]

    def timeline_rows(self) -> list[MetricRow]:
        """Every sample as the runtimes' timeline rows (``Exchange.timeline()``'s form; virtual ms): producers'
        ``outPoolUsage``, ``isBackPressured``, per channel ``backlog`` and ``outputQueueLength``; consumers'
        pool usages and per channel ``credit``, ``unannouncedCredit``, ``backlog`` (remote channels) and
        ``inputQueueLength``; the counters so far, ``numBytesOut`` and ``numBytesIn`` (channel null)."""
        return list(self.timeline)

    def value_at(self, side: str, subtask: int, metric: str, time_s: float) -> float:
        """A sampled metric of one subtask (channel None) at the sample of virtual time ``time_s``, e.g. the
        ``numBytesIn`` a consumer had received by then; KeyError if no sample was taken at that time."""
        stamp = time_s * 1000.0
        for r in self.timeline:
            if (
                r.time_ms == stamp
                and r.side == side
                and r.subtask == subtask
                and r.metric == metric
                and r.channel is None
            ):
                return r.value
        raise KeyError(f"no {side} {subtask} sample of {metric} at {time_s} virtual s")

    def metric_rows(self) -> list[MetricRow]:
        """The summary rows (``Exchange.metric_rows()``'s form; see the class documentation)."""
        return list(self.rows)
