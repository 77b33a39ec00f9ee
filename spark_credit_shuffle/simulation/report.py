"""What a simulation run measured: per channel, per producer and per consumer, with the runtimes' rows."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..metrics import MetricRow
from ..protocol.checkpointing import CompletedCheckpoint

__all__ = ["ChannelStats", "ConsumerStats", "ProducerStats", "SimulationReport"]


@dataclass(frozen=True)
class ChannelStats:
    """One channel: producer ``producer``'s subpartition ``subpartition`` read by consumer ``consumer``."""

    consumer: int
    channel: int
    producer: int
    subpartition: int
    local: bool
    bytes_sent: int
    bytes_received: int
    buffers_received: int
    intact: bool  # the bytes received equal the bytes written, in order
    finish_time: float | None


@dataclass(frozen=True)
class ProducerStats:
    subtask: int
    host: int
    bytes_written: int
    back_pressured_time: float
    finish_time: float | None


@dataclass(frozen=True)
class ConsumerStats:
    subtask: int
    host: int
    bytes_consumed: int
    buffers_consumed: int
    finish_time: float | None
    throughput: float  # bytes per virtual second over the measured window
    #: Checkpoints this subtask aligned (``checkpoint_interval_ms`` > 0), times in virtual nanoseconds.
    checkpoints: tuple[CompletedCheckpoint, ...] = ()


@dataclass
class SimulationReport:
    """What a simulation run measured. Times are virtual seconds, throughputs bytes per virtual second."""

    end_time: float
    window: float
    steps: int
    finished: bool
    producers: list[ProducerStats]
    consumers: list[ConsumerStats]
    channels: list[ChannelStats]
    #: The samples over virtual time, as the runtimes' timeline rows (``time_ms``: virtual milliseconds).
    timeline: list[MetricRow] = field(default_factory=list)
    buffers_returned: bool = False
    connection_pauses: int = 0
    messages: int = 0
    #: The engine's metric rows of every subtask at the end of the run.
    rows: list[MetricRow] = field(default_factory=list)

    @property
    def data_intact(self) -> bool:
        """Every channel received exactly what was written to it, in order."""
        return all(c.intact for c in self.channels)

    def consumer_throughput(self, subtask: int) -> float:
        return self.consumers[subtask].throughput

    def back_pressure_ratio(self, subtask: int) -> float:
        """Share of the window producer ``subtask`` spent waiting for buffers (backPressuredTime / time)."""
        return self.producers[subtask].back_pressured_time / self.window if self.window else 0.0

    def channel_rows(self) -> list[dict]:
        return [dict(c.__dict__) for c in self.channels]

    def timeline_rows(self) -> list[MetricRow]:
        """Every sample as the runtimes' timeline rows (``Exchange.timeline()``'s form; virtual ms): producers'
        ``outPoolUsage``, ``isBackPressured``, per channel ``backlog`` and ``outputQueueLength``; consumers'
        pool usages and per channel ``credit``, ``unannouncedCredit``, ``backlog`` (remote channels) and
        ``inputQueueLength``."""
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
        """The run summed up as the runtimes' metric rows, from the task engine's halves (virtual times):
        per channel ``numRecordsOut``/``numBytesOut``/``numBuffersOut`` and ``outputQueueLength``, per producer
        ``outPoolUsage`` and the time metrics (``accumulateBackPressuredTimeMs``...); per channel
        ``numRecordsIn``/``numBytesIn``/``numBuffersIn``, per consumer the pool usages, time metrics and, with
        checkpoints, the checkpoint rows."""
        return list(self.rows)
