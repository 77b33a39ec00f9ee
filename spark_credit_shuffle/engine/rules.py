"""The engine's rules, its answers and the time accounts: settings interpreted once, :class:`Wait`,
:class:`Fail`, :class:`TimeAccount` and the end-of-task rule :func:`check_end`."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ..errors import ExchangeTimeoutError
from ..metrics import MetricRow

if TYPE_CHECKING:
    from ..config import NetworkConfig

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
    #: Buffer debloating (pipelined consumers): (period s, target ms, samples, threshold %), None when off.
    debloat: tuple[float, int, int, int] | None = None

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
            debloat=(
                (
                    config.buffer_debloat_period_ms / 1000.0,
                    config.buffer_debloat_target_ms,
                    config.buffer_debloat_samples,
                    config.buffer_debloat_threshold_percentages,
                )
                if config.buffer_debloat_enabled and not blocking
                else None
            ),
        )


#: Flink's time gauges are averages over the last minute (``TimerGauge``: 12 slots of 5 s); the timeline's are
#: over the same window, from the samples it keeps.
TIME_WINDOW_S = 60.0


class TimeAccount:
    """Busy, idle and back-pressured time of one side of a task (Flink's time metrics).

    Back-pressured time is *soft* when the side waits before taking its next input because its output is
    unavailable (Flink's mailbox in ``StreamTask.processInput``) and *hard* when it waits in the middle of an
    input it could not write whole (Flink's ``requestBufferBuilderBlocking``); busy time is the rest. The
    totals cover the side's life (:meth:`rows`: ``accumulate*TimeMs`` and the ``*TimeMsPerSecond`` means
    whose busy + idle + back-pressured is 1000); :meth:`window_gauges` gives the same per second over the
    last :data:`TIME_WINDOW_S` for the timeline, as Flink's gauges. ``maxSoftBackPressureTimeMs`` and
    ``maxHardBackPressureTimeMs``: the longest single wait of each kind.
    """

    __slots__ = (
        "_history",
        "back_pressured",
        "end",
        "hard",
        "idle",
        "idle_since",
        "max_hard",
        "max_soft",
        "soft",
        "start",
    )

    def __init__(self, now: float) -> None:
        self.start = now
        self.end: float | None = None
        self.idle = 0.0
        self.back_pressured = 0.0
        self.soft = 0.0
        self.hard = 0.0
        self.max_soft = 0.0
        self.max_hard = 0.0
        #: Set while the side waits for input (the wait counts as idle as it goes, in the window gauges).
        self.idle_since: float | None = None
        #: (time, idle, soft, hard) totals at past window samples, oldest first.
        self._history: deque[tuple[float, float, float, float]] = deque()

    def stop(self, now: float) -> None:
        if self.end is None:
            self.end = now

    def add_idle(self, seconds: float) -> None:
        self.idle += seconds

    def add_back_pressure(self, seconds: float, *, hard: bool) -> None:
        """A back-pressured wait of ``seconds`` ended (``hard``: in the middle of an input)."""
        self.back_pressured += seconds
        if hard:
            self.hard += seconds
            if seconds > self.max_hard:
                self.max_hard = seconds
        else:
            self.soft += seconds
            if seconds > self.max_soft:
                self.max_soft = seconds

    def window_gauges(
        self, now: float, waiting_since: float | None = None, hard: bool = False
    ) -> Iterator[tuple[str, float]]:
        """busy, idle, backPressured, soft and hard ``...TimeMsPerSecond`` over the last :data:`TIME_WINDOW_S`
        up to ``now`` (a wait still going on, from ``waiting_since``, counts as back-pressure of its kind)."""
        idle, soft, hard_total = self.idle, self.soft, self.hard
        if self.idle_since is not None:
            idle += max(0.0, now - self.idle_since)
        if waiting_since is not None:
            if hard:
                hard_total += max(0.0, now - waiting_since)
            else:
                soft += max(0.0, now - waiting_since)
        history = self._history
        history.append((now, idle, soft, hard_total))
        while len(history) > 1 and history[1][0] <= now - TIME_WINDOW_S:
            history.popleft()
        then, idle0, soft0, hard0 = history[0] if len(history) > 1 else (self.start, 0.0, 0.0, 0.0)
        span = now - then
        if span <= 0:
            return
        scale = 1000.0 / span
        idle_ms = min(1000.0, max(0.0, (idle - idle0) * scale))
        soft_ms = min(1000.0 - idle_ms, max(0.0, (soft - soft0) * scale))
        hard_ms = min(1000.0 - idle_ms - soft_ms, max(0.0, (hard_total - hard0) * scale))
        yield "busyTimeMsPerSecond", 1000.0 - idle_ms - soft_ms - hard_ms
        yield "idleTimeMsPerSecond", idle_ms
        yield "backPressuredTimeMsPerSecond", soft_ms + hard_ms
        yield "softBackPressuredTimeMsPerSecond", soft_ms
        yield "hardBackPressuredTimeMsPerSecond", hard_ms

    def rows(self, side: str, subtask: int, now: float) -> list[MetricRow]:
        """The whole life's totals and per-second means (busy + idle + back-pressured = 1000), the soft and
        hard shares and the longest wait of each kind."""
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
        soft = min(self.soft, bp)
        for name, seconds in (("soft", soft), ("hard", max(0.0, bp - soft))):
            per_second = min(1000.0, max(0.0, seconds / life * 1000.0))
            out.append(MetricRow(side, subtask, None, f"{name}BackPressuredTimeMsPerSecond", "mean", per_second))
        out.append(MetricRow(side, subtask, None, "maxSoftBackPressureTimeMs", "max", self.max_soft * 1000.0))
        out.append(MetricRow(side, subtask, None, "maxHardBackPressureTimeMs", "max", self.max_hard * 1000.0))
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
