"""The engine's rules, its answers and the time accounts: settings interpreted once, :class:`Wait`,
:class:`Fail`, :class:`TimeAccount` and the end-of-task rule :func:`check_end`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ...errors import ExchangeTimeoutError
from ...metrics import MetricRow

if TYPE_CHECKING:
    from ...config import NetworkConfig

__all__ = ["LINGER_OVER", "Fail", "Gauges", "LingerOver", "Settings", "TimeAccount", "Wait", "check_end"]

#: The longest a consumer holds decoded rows back by default, waiting for more to send on in one batch.
MAX_DEFAULT_LINGER_MS = 2.0
#: The shortest interval between two keep-alives of a producer.
MIN_HEARTBEAT_S = 0.01

Gauges = Iterator[tuple[str, "int | None", float]]


class Wait(NamedTuple):
    """Nothing to do before ``until`` (a time on the caller's clock), unless something arrives."""

    until: float


class Fail(NamedTuple):
    """The task fails with ``error`` (typed, its message naming what was waited for and the setting)."""

    error: Exception


class LingerOver:
    """What :meth:`ConsumerEngine.next` returns when the linger deadline passed with nothing new."""

    __slots__ = ()


#: The one :class:`LingerOver`.
LINGER_OVER = LingerOver()


@dataclass(frozen=True)
class Settings:
    """The engine's rules, derived once from the network settings and the task knobs (seconds).

    ``flush_always``: every record is flushed (buffer timeout 0). ``flush_interval``: the output flusher's
    period (buffer timeout > 0; None for 0 and -1). ``heartbeat_interval``: a producer's keep-alive period,
    a quarter of ``silence_timeout`` (``partition_request_timeout_ms``), so that a live producer is never
    taken for a silent one. ``buffer_wait_timeout``: the longest a back-pressured producer waits without a
    single buffer coming back (``buffers_request_timeout_ms``). ``output_linger``/``output_batch_rows``:
    how long and up to how many rows a consumer collects rows before handing them on. ``blocking``: the
    halves of a blocking exchange (its partition is read after its producer ended: no flushing, no
    queue or time metrics, a backlog of every buffer stored).
    """

    flush_always: bool
    flush_interval: float | None
    heartbeat_interval: float
    silence_timeout: float
    buffer_wait_timeout: float
    output_linger: float
    output_batch_rows: int
    latency_interval: float | None
    memory_sample_interval: float | None
    timeline_interval_ms: int
    partition_request_timeout_ms: int
    buffers_request_timeout_ms: int
    blocking: bool = False

    @classmethod
    def of(
        cls,
        config: NetworkConfig,
        *,
        blocking: bool = False,
        latency_interval_ms: int = 0,
        output_batch_rows: int = 8192,
        output_linger_ms: float | None = None,
        sample_memory_ms: int = 0,
    ) -> Settings:
        """The rules for ``config``; ``blocking``: a blocking partition, read only after its producer ended
        (no flushing). ``output_linger_ms`` None: a tenth of the buffer timeout, at most
        :data:`MAX_DEFAULT_LINGER_MS`; none with timeout 0 and :data:`MAX_DEFAULT_LINGER_MS` with -1."""
        timeout = config.buffer_timeout_ms
        if output_linger_ms is None:
            output_linger_ms = (
                0.0
                if timeout == 0
                else MAX_DEFAULT_LINGER_MS
                if timeout < 0
                else min(MAX_DEFAULT_LINGER_MS, timeout / 10.0)
            )
        silence = config.partition_request_timeout_ms / 1000.0
        return cls(
            flush_always=timeout == 0 and not blocking,
            flush_interval=timeout / 1000.0 if timeout > 0 and not blocking else None,
            heartbeat_interval=max(MIN_HEARTBEAT_S, silence / 4.0),
            silence_timeout=silence,
            buffer_wait_timeout=config.buffers_request_timeout_ms / 1000.0,
            output_linger=max(0.0, output_linger_ms) / 1000.0,
            output_batch_rows=output_batch_rows,
            latency_interval=latency_interval_ms / 1000.0 if latency_interval_ms > 0 else None,
            memory_sample_interval=sample_memory_ms / 1000.0 if sample_memory_ms > 0 else None,
            timeline_interval_ms=config.metrics_sample_interval_ms,
            partition_request_timeout_ms=config.partition_request_timeout_ms,
            buffers_request_timeout_ms=config.buffers_request_timeout_ms,
            blocking=blocking,
        )


class TimeAccount:
    """Busy, idle and back-pressured time of one side of a task (Flink's time metrics)."""

    __slots__ = ("back_pressured", "end", "idle", "start")

    def __init__(self, now: float) -> None:
        self.start = now
        self.end: float | None = None
        self.idle = 0.0
        self.back_pressured = 0.0

    def stop(self, now: float) -> None:
        if self.end is None:
            self.end = now

    def rows(self, side: str, subtask: int, now: float) -> list[MetricRow]:
        life = max(1e-9, (self.end or now) - self.start)
        idle = min(self.idle, life)
        bp = min(self.back_pressured, life - idle)
        busy = max(0.0, life - idle - bp)
        out = []
        for name, seconds in (("BackPressured", bp), ("Idle", idle), ("Busy", busy)):
            out.append(MetricRow(side, subtask, None, f"accumulate{name}TimeMs", "total", seconds * 1000.0))
            per_second = min(1000.0, max(0.0, seconds / life * 1000.0))
            out.append(
                MetricRow(side, subtask, None, f"{name[0].lower()}{name[1:]}TimeMsPerSecond", "mean", per_second)
            )
        return out


def check_end(now: float, last_progress: float, settings: Settings, subtask: int, pending: str) -> Wait | Fail | None:
    """The end of a task: done once nothing is ``pending`` (None); else wait, at most
    ``partition_request_timeout_ms`` after the last progress (a recycled segment, a data buffer sent, credit
    from a consumer, or a subpartition whose every buffer went to a reader still connected)."""
    if not pending:
        return None
    since = now - last_progress
    timeout = settings.silence_timeout
    if since >= timeout:
        return Fail(
            ExchangeTimeoutError(
                f"task {subtask} waited {since * 1000:.0f} ms for the end of the exchange "
                f"(partition_request_timeout_ms={settings.partition_request_timeout_ms}): {pending}"
            )
        )
    return Wait(now + min(timeout - since, 0.5))
