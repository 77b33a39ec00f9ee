"""What the web view knows of the session's exchanges: the latest sample of every subtask and channel, a
short history for the charts, and the run's metrics and diagnosis once it ended.

An :class:`ExchangeView` is the live monitor's sink for one exchange (a
:class:`~spark_credit_shuffle.runtime.monitor.Monitor` that prints nothing): the driver's monitor service hands
it each task's samples on the service's thread, and the web service reads it on its own. The :class:`Board`
holds the views of this driver process, the newest :data:`MAX_EXCHANGES`.

While an exchange runs, a vertex (the producers, or the consumers) has the back-pressure status of its most
back-pressured subtask, as Flink's web UI colours a job vertex by its subtasks' ``backPressuredTimeMsPerSecond``
(``OK`` up to 10%, ``LOW`` up to 50%, ``HIGH`` above; :func:`~spark_credit_shuffle.diagnosis.back_pressure_status`),
and where backpressure starts is :func:`~spark_credit_shuffle.diagnosis.find_origin` over the consumers' latest
samples, the rule the diagnosis and the live monitor's line share. Once every consumer reported its metric rows
(the action ended), the view takes them from the exchange (``Exchange.metric_rows()``): the counters become the
run's totals and the diagnosis is ``Exchange.diagnose()``'s.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from ..diagnosis import HIGH, LOW, OK, Load, back_pressure_status, cpu_use, diagnose, find_origin, summarize
from ..errors import CreditShuffleError
from ..metrics import CONSUMER, EXECUTOR, PRODUCER, MetricRow
from ..runtime.monitor import Monitor

__all__ = [
    "CHART_METRICS",
    "COUNTERS",
    "MAX_CHARTED_SUBTASKS",
    "MAX_EXCHANGES",
    "MAX_POINTS",
    "STALE_S",
    "Board",
    "ExchangeView",
    "WatchedExchange",
]

#: Exchanges the board keeps (the oldest is forgotten first).
MAX_EXCHANGES = 32
#: Points a chart's series keeps: past that it drops every other one and keeps half as many per second.
MAX_POINTS = 240
#: The least time between two points of a series at first (a task samples every 100 ms by default).
_FIRST_SPACING_MS = 250.0
#: Subtasks per side whose history is kept for the charts (all are in the tables and the metrics).
MAX_CHARTED_SUBTASKS = 32
#: The figures the charts draw, per side.
CHART_METRICS: dict[str, tuple[str, ...]] = {
    PRODUCER: ("backPressuredTimeMsPerSecond", "busyTimeMsPerSecond", "outPoolUsage", "numRecordsOutPerSecond"),
    CONSUMER: ("backPressuredTimeMsPerSecond", "busyTimeMsPerSecond", "inPoolUsage", "numRecordsInPerSecond"),
}
#: Counters each sample carries as the subtask's total so far, and the run's metric rows as totals per channel.
COUNTERS: dict[str, tuple[str, ...]] = {
    PRODUCER: ("numRecordsOut", "numBuffersOut", "numBytesOut"),
    CONSUMER: ("numRecordsIn", "numBuffersIn", "numBytesIn"),
}
#: Without a sample for this long, the view asks the exchange whether its metrics are in (the action ended).
_QUIET_S = 1.0
#: ... and asks again at most this often.
_CHECK_EVERY_S = 1.0
#: Without a sample for this long and without its metrics, an exchange has stopped (its action failed or was
#: cancelled): a running task sends samples every second.
STALE_S = 10.0
_LEVELS = {None: -1, OK: 0, LOW: 1, HIGH: 2}


class WatchedExchange(Protocol):
    """What the view reads of an exchange (``spark_credit_shuffle.Exchange``)."""

    @property
    def name(self) -> str: ...

    def metric_rows(self) -> list[MetricRow]: ...


def worst(statuses: Iterable[str | None]) -> str | None:
    """The most back-pressured of ``statuses`` (a vertex's, from its subtasks'), None if none is known."""
    return max(statuses, key=lambda s: _LEVELS[s], default=None)


class _Series:
    """One chart line: (time ms, value) points, thinned to at most :data:`MAX_POINTS`."""

    __slots__ = ("points", "spacing")

    def __init__(self) -> None:
        self.points: list[tuple[float, float]] = []
        self.spacing = _FIRST_SPACING_MS

    def add(self, time_ms: float, value: float) -> None:
        if self.points and time_ms - self.points[-1][0] < self.spacing:
            return
        self.points.append((time_ms, value))
        if len(self.points) > MAX_POINTS:
            self.points = self.points[::2]
            self.spacing *= 2


@dataclass(frozen=True)
class Final:
    """What the view keeps of a run that ended: its metric rows' summaries and diagnosis."""

    summaries: list[Any]
    diagnosis: Any
    totals: dict[tuple[str, int, str], float]
    executors: dict[tuple[str, int], str]


class ExchangeView(Monitor):
    """The web view of one exchange: its topology (``mode``, ``partitioner``, the operators chained before and
    after it), the latest sample of every subtask and channel, the charts' history, and once the run ended its
    summary and diagnosis (:meth:`attach` gives it the exchange to read them from)."""

    def __init__(
        self,
        name: str,
        *,
        mode: str,
        partitioner: str,
        producers: int,
        consumers: int,
        before: tuple[str, ...] = (),
        after: tuple[str, ...] = (),
    ) -> None:
        super().__init__(name, producers=producers, consumers=consumers)
        self.mode = mode
        self.partitioner = partitioner
        self.before = before
        self.after = after
        self.created_ms = time.time() * 1000.0
        self._view_lock = threading.Lock()
        #: (side, subtask, channel, metric) -> the latest sampled value
        self._values: dict[tuple[str, int, int | None, str], float] = {}
        self._history: dict[tuple[str, int, str], _Series] = {}
        self._last_sample: float | None = None  # monotonic time of the last sample
        self._first_ms: float | None = None
        self._last_ms: float | None = None
        self._exchange: weakref.ReferenceType[WatchedExchange] | None = None
        self._last_check = 0.0
        self._final: Final | None = None

    # -- the monitor service's thread --

    def accept(self, rows: list[MetricRow]) -> None:
        """Samples of one task: the latest value of each figure, and the charts' points."""
        super().accept(rows)
        now = time.monotonic()
        with self._view_lock:
            self._last_sample = now
            for r in rows:
                self._values[(r.side, r.subtask, r.channel, r.metric)] = r.value
                stamp = r.time_ms
                if stamp is None:
                    continue
                if self._first_ms is None or stamp < self._first_ms:
                    self._first_ms = stamp
                if self._last_ms is None or stamp > self._last_ms:
                    self._last_ms = stamp
                if r.channel is None and r.subtask < MAX_CHARTED_SUBTASKS and r.metric in CHART_METRICS[r.side]:
                    key = (r.side, r.subtask, r.metric)
                    series = self._history.get(key)
                    if series is None:
                        series = self._history[key] = _Series()
                    series.add(stamp, r.value)

    # -- the driver's threads --

    def attach(self, exchange: WatchedExchange, after: tuple[str, ...] | None = None) -> None:
        """Read the run's metrics from ``exchange`` once it ended (held weakly: a view keeps no exchange
        alive); ``after``: the operators chained after it now (``Exchange.map_in_pandas`` adds some)."""
        with self._view_lock:
            self._exchange = weakref.ref(exchange)
            if after is not None:
                self.after = after

    def refresh(self, now: float | None = None) -> None:
        """Take the run's metric rows if the action ended: asked when no sample came for :data:`_QUIET_S`,
        at most every :data:`_CHECK_EVERY_S` (reading them is cheap once, not on every request)."""
        now = time.monotonic() if now is None else now
        with self._view_lock:
            if self._final is not None or self._exchange is None:
                return
            if self._last_sample is not None and now - self._last_sample < _QUIET_S:
                return
            if now - self._last_check < _CHECK_EVERY_S:
                return
            self._last_check = now
            exchange = self._exchange()
        if exchange is None:
            return
        try:
            rows = exchange.metric_rows()
        except CreditShuffleError:  # no action ended yet
            return
        reported = {(r.side, r.subtask) for r in rows}
        wanted = {(PRODUCER, p) for p in range(self.producers or 0)} | {
            (CONSUMER, c) for c in range(self.consumers or 0)
        }
        if not wanted <= reported:  # some consumers still run
            return
        summaries = summarize(rows)
        totals: dict[tuple[str, int, str], float] = collections.defaultdict(float)
        executors: dict[tuple[str, int], str] = {}
        for r in rows:
            if r.stat == "total" and r.metric in COUNTERS.get(r.side, ()):
                totals[(r.side, r.subtask, r.metric)] += r.value
            elif r.metric == EXECUTOR:
                executors[(r.side, r.subtask)] = r.stat
        final = Final(summaries, diagnose(summaries, cpu_use(rows), self.mode), dict(totals), executors)
        with self._view_lock:
            self._final = final

    @property
    def finished(self) -> bool:
        return self._final is not None

    @property
    def state(self) -> str:
        """``planned`` (no sample yet), ``running``, ``finished`` (its metrics are in) or ``stopped`` (no sample
        for :data:`STALE_S` and no metrics: the action failed or was cancelled)."""
        if self._final is not None:
            return "finished"
        last = self._last_sample
        if last is None:
            return "planned"
        return "running" if time.monotonic() - last < STALE_S else "stopped"

    def values(self) -> tuple[dict[tuple[str, int, int | None, str], float], Final | None]:
        """A copy of the latest sampled values, and the run's end if it ended."""
        with self._view_lock:
            return dict(self._values), self._final

    def figures(self) -> dict[tuple[str, int, int | None, str], float]:
        """The exchange's figures now: the latest samples, and once the run ended its counters' totals
        (equal to the last samples' unless samples were lost), for the metrics endpoint."""
        values, final = self.values()
        if final is not None:
            for (side, subtask, metric), total in final.totals.items():
                values[(side, subtask, None, metric)] = total
        return values

    def live_origin(self, values: dict[tuple[str, int, int | None, str], float]) -> dict[str, Any] | None:
        """Where the producers' backpressure starts now, from the latest samples (None: no producer is
        back-pressured): :func:`~spark_credit_shuffle.diagnosis.find_origin` over the consumers."""
        pressured = [
            s
            for (side, s, channel, metric), v in values.items()
            if side == PRODUCER
            and channel is None
            and ((metric == "backPressuredTimeMsPerSecond" and v > 100.0) or (metric == "isBackPressured" and v >= 1.0))
        ]
        if not pressured:
            return None
        loads = [
            Load(
                CONSUMER,
                c,
                values.get((CONSUMER, c, None, "busyTimeMsPerSecond")),
                values.get((CONSUMER, c, None, "idleTimeMsPerSecond")),
                values.get((CONSUMER, c, None, "backPressuredTimeMsPerSecond")),
            )
            for c in range(self.consumers or 0)
            if (CONSUMER, c, None, "busyTimeMsPerSecond") in values
        ]
        if not loads:
            return None
        origin = find_origin(loads)
        load = origin.load
        if origin.kind == "consumer" and load is not None:
            text = (
                f"backpressure starts at consumer subtask {load.subtask}: it is busy {load.busy or 0.0:.0f} ms/s and "
                f"not back-pressured itself, while producer subtask(s) "
                f"{', '.join(map(str, sorted(set(pressured))))} wait for buffers"
            )
        elif origin.kind == "downstream" and load is not None:
            text = (
                f"backpressure starts after consumer subtask {load.subtask}: it waits "
                f"{load.back_pressured or 0.0:.0f} ms/s to hand its rows on"
            )
        elif origin.kind == "downstream":
            text = "backpressure starts after the exchange: every consumer waits to hand its rows on"
        else:
            busy = [v.busy for v in loads if v.busy is not None]
            span = f" (busy {min(busy):.0f}-{max(busy):.0f} ms/s)" if busy else ""
            text = f"backpressure spread over the consumers{span}: no single consumer explains it"
        return {"kind": origin.kind, "subtask": origin.subtask, "text": text}

    def state_json(self) -> dict[str, Any]:
        """The exchange as the page draws it (see ``assets/app.js``)."""
        self.refresh()
        values, final = self.values()
        with self._view_lock:
            history = {
                f"{side}/{subtask}/{metric}": [[round(t), v] for t, v in series.points]
                for (side, subtask, metric), series in self._history.items()
            }
            first_ms, last_ms = self._first_ms, self._last_ms
        summaries = {(s.side, s.subtask): s for s in final.summaries} if final is not None else {}
        vertices = {}
        for side, count in ((PRODUCER, self.producers or 0), (CONSUMER, self.consumers or 0)):
            subtasks = [self._subtask_json(side, i, values, final, summaries.get((side, i))) for i in range(count)]
            vertices[side] = {
                "parallelism": count,
                "status": worst(s["status"] for s in subtasks),
                "back_pressured_max": max((s["backPressuredTimeMsPerSecond"] or 0.0 for s in subtasks), default=0.0),
                "subtasks": subtasks,
            }
        diagnosis = None
        if final is not None:
            d = final.diagnosis
            diagnosis = {"verdict": d.verdict, "origin": d.origin, "text": d.text}
        return {
            "name": self.name,
            "mode": self.mode,
            "partitioner": self.partitioner,
            "before": list(self.before),
            "after": list(self.after),
            "state": self.state,
            "created_ms": self.created_ms,
            "first_ms": first_ms,
            "last_ms": last_ms,
            "vertices": vertices,
            "origin": self.live_origin(values) if final is None else None,
            "diagnosis": diagnosis,
            "history": history,
        }

    def _subtask_json(
        self,
        side: str,
        subtask: int,
        values: dict[tuple[str, int, int | None, str], float],
        final: Final | None,
        summary: Any,
    ) -> dict[str, Any]:
        def value(metric: str) -> float | None:
            return values.get((side, subtask, None, metric))

        direction = "Out" if side == PRODUCER else "In"
        records, buffers, nbytes = (value(f"num{what}{direction}") for what in ("Records", "Buffers", "Bytes"))
        if final is not None:
            records, buffers, nbytes = (
                final.totals.get((side, subtask, f"num{what}{direction}"), v)
                for what, v in (("Records", records), ("Buffers", buffers), ("Bytes", nbytes))
            )
        back_pressured = value("backPressuredTimeMsPerSecond")
        status = back_pressure_status(back_pressured)
        busy, idle = value("busyTimeMsPerSecond"), value("idleTimeMsPerSecond")
        rate = value(f"numRecords{direction}PerSecond")
        if summary is not None:  # the run ended: its figures over the subtask's life, as summary() has them
            status = summary.back_pressure or status
            back_pressured = summary.back_pressured_ms_per_second
            busy, idle = summary.busy_ms_per_second, summary.idle_ms_per_second
            rate = summary.records_per_second
        channels: dict[int, dict[str, float]] = {}
        for (s, t, channel, metric), v in values.items():
            if s == side and t == subtask and channel is not None:
                channels.setdefault(channel, {})[metric] = v
        pool = "outPoolUsage" if side == PRODUCER else "inPoolUsage"
        return {
            "subtask": subtask,
            "status": status,
            "records": records,
            "buffers": buffers,
            "bytes": nbytes,
            "busyTimeMsPerSecond": busy,
            "idleTimeMsPerSecond": idle,
            "backPressuredTimeMsPerSecond": back_pressured,
            "isBackPressured": value("isBackPressured"),
            "pools": {
                name: values[(side, subtask, None, name)]
                for name in (pool, "inputExclusiveBuffersUsage", "inputFloatingBuffersUsage")
                if (side, subtask, None, name) in values
            },
            "rate": rate,
            "executor": final.executors.get((side, subtask)) if final is not None else None,
            "channels": [{"channel": c, **figures} for c, figures in sorted(channels.items())],
        }


class Board:
    """The exchanges this driver process shows, newest last (at most :data:`MAX_EXCHANGES`)."""

    def __init__(self) -> None:
        self._views: collections.OrderedDict[str, ExchangeView] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, view: ExchangeView) -> None:
        with self._lock:
            self._views[view.name] = view
            while len(self._views) > MAX_EXCHANGES:
                self._views.popitem(last=False)

    def get(self, name: str) -> ExchangeView | None:
        with self._lock:
            return self._views.get(name)

    def views(self) -> list[ExchangeView]:
        with self._lock:
            return list(self._views.values())
