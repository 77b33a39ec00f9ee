"""What an exchange's metrics say, per subtask and as a whole: Flink's back-pressure status and where
backpressure starts.

:func:`summarize` turns the metric rows of a run (:class:`~spark_credit_shuffle.metrics.MetricRow`) into one
:class:`SubtaskSummary` per side and subtask: integer counters, rates, busy / idle / back-pressured time per
second and Flink's back-pressure status, which its web UI derives from the share of time a subtask is
back-pressured (``backPressuredTimeMsPerSecond``): ``OK`` up to 10%, ``LOW`` up to 50%, ``HIGH`` above.

:func:`diagnose` reads the summaries the way Flink's documentation teaches to read backpressure
("Monitoring Back Pressure"): backpressure starts at the busy subtask that is not itself back-pressured while
the subtasks that send to it are. In one exchange the consumers receive and are never back-pressured by
anything downstream, so when producers are back-pressured the origin is the busiest consumer they send to;
data skew (one consumer receiving far more records than the others) is told apart, as the cause of that
backpressure or on its own, and so is an exchange that moved nothing. Pure functions of the rows: no Spark.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, fields

from .metrics import CONSUMER, EXECUTOR, PRODUCER, MetricRow

__all__ = [
    "HIGH",
    "LOW",
    "OK",
    "SKEW_RATIO",
    "SUMMARY_DDL",
    "Diagnosis",
    "SubtaskSummary",
    "back_pressure_status",
    "diagnose",
    "summarize",
]

OK = "OK"
LOW = "LOW"
HIGH = "HIGH"
#: A consumer receiving at least this many times the mean of the consumers' records is skewed.
SKEW_RATIO = 2.0
#: A skewed consumer at least this busy, relative to the busiest consumer, is where backpressure starts (busy
#: time per second saturates near 1000 ms, so the busiest by a few ms says less than several times the records).
_NEARLY_AS_BUSY = 0.8
#: A consumer busy at least this many times the median of the other consumers' times (and at least
#: _STRAGGLER_MIN_MS) is a straggler: where no producer is back-pressured (blocking mode's producers never wait),
#: the slow consumer shows as its own time.
STRAGGLER_RATIO = 2.0
_STRAGGLER_MIN_MS = 100.0


def back_pressure_status(back_pressured_ms_per_second: float | None) -> str | None:
    """Flink's back-pressure level of a subtask back-pressured this many ms per second: ``OK`` (<= 10%),
    ``LOW`` (<= 50%), ``HIGH`` (above); None when the time is not measured."""
    if back_pressured_ms_per_second is None:
        return None
    ratio = back_pressured_ms_per_second / 1000.0
    return OK if ratio <= 0.10 else LOW if ratio <= 0.50 else HIGH


@dataclass(frozen=True)
class SubtaskSummary:
    """One producer or consumer subtask of a run. Counters are the subtask's over all its channels (records,
    buffers and bytes out for a producer, in for a consumer); times per second are Flink's
    ``busyTimeMsPerSecond`` and kin over the subtask's life, None where the mode does not measure them.
    ``executor``: where it ran (the executor's ``host:port`` in pipelined mode, the host in blocking mode)."""

    side: str
    subtask: int
    executor: str | None
    records: int
    buffers: int
    bytes: int
    records_per_second: float | None
    busy_ms: float | None
    busy_ms_per_second: float | None
    idle_ms_per_second: float | None
    back_pressured_ms_per_second: float | None
    back_pressure: str | None
    pool_usage_max: float | None
    pool_usage_mean: float | None


_SPARK_TYPES = {"str": "string", "int": "long", "float | None": "double", "str | None": "string"}
#: Spark DDL of :meth:`Exchange.summary`: the exchange's name and mode, then the fields of SubtaskSummary.
SUMMARY_DDL = "exchange string, mode string, " + ", ".join(
    f"{f.name} {_SPARK_TYPES[str(f.type)]}" for f in fields(SubtaskSummary)
)


def summarize(rows: Iterable[MetricRow]) -> list[SubtaskSummary]:
    """One summary per side and subtask that reported metrics, producers first, by subtask."""
    per: dict[tuple[str, int], dict[tuple[str, str], float]] = {}
    where: dict[tuple[str, int], str] = {}
    for r in rows:
        if r.metric == EXECUTOR and r.time_ms is None:
            where[(r.side, r.subtask)] = r.stat
            per.setdefault((r.side, r.subtask), {})
            continue
        if r.time_ms is not None or r.stat not in ("total", "max", "mean"):
            continue  # timeline samples and checkpoint records
        values = per.setdefault((r.side, r.subtask), {})
        key = (r.metric, r.stat)
        values[key] = values.get(key, 0.0) + r.value if r.stat == "total" else r.value
    out = []
    for (side, subtask), values in sorted(per.items(), key=lambda kv: (kv[0][0] != PRODUCER, kv[0][1])):
        direction = "Out" if side == PRODUCER else "In"
        pool = "outPoolUsage" if side == PRODUCER else "inPoolUsage"
        records = int(values.get((f"numRecords{direction}", "total"), 0.0))
        back_pressured = values.get(("backPressuredTimeMsPerSecond", "mean"))
        life_ms = sum(values.get((f"accumulate{t}TimeMs", "total"), 0.0) for t in ("Busy", "Idle", "BackPressured"))
        out.append(
            SubtaskSummary(
                side=side,
                subtask=subtask,
                executor=where.get((side, subtask)),
                records=records,
                buffers=int(values.get((f"numBuffers{direction}", "total"), 0.0)),
                bytes=int(values.get((f"numBytes{direction}", "total"), 0.0)),
                records_per_second=records / (life_ms / 1000.0) if life_ms > 0 else None,
                busy_ms=values.get(("accumulateBusyTimeMs", "total")),
                busy_ms_per_second=values.get(("busyTimeMsPerSecond", "mean")),
                idle_ms_per_second=values.get(("idleTimeMsPerSecond", "mean")),
                back_pressured_ms_per_second=back_pressured,
                back_pressure=back_pressure_status(back_pressured),
                pool_usage_max=values.get((pool, "max")),
                pool_usage_mean=values.get((pool, "mean")),
            )
        )
    return out


@dataclass(frozen=True)
class Diagnosis:
    """What a run's metrics say. ``verdict``: ``"backpressure"`` (producers back-pressured; ``origin`` is the
    consumer subtask where it starts), ``"skew"`` (``origin`` receives ``skew`` times the mean of the
    consumers' records and no producer is back-pressured), ``"straggler"`` (no producer back-pressured, the
    records even, but ``origin`` busy at least twice the other consumers' median time: what a slow consumer looks like
    in blocking mode, whose producers never wait), ``"ok"`` or ``"idle"`` (no record moved).
    ``back_pressured``: the producer subtasks at ``LOW`` or ``HIGH``. ``executor``: where ``origin`` ran.
    ``text``: the same for people."""

    verdict: str
    origin: int | None
    back_pressured: tuple[int, ...]
    skew: float | None
    text: str
    executor: str | None = None

    def __str__(self) -> str:
        return self.text


def diagnose(summaries: Iterable[SubtaskSummary]) -> Diagnosis:
    """Where backpressure starts, or whether the data is skewed, from the summaries of one run."""
    summaries = list(summaries)
    producers = [s for s in summaries if s.side == PRODUCER]
    consumers = [s for s in summaries if s.side == CONSUMER]
    received = [s.records for s in consumers]
    if not consumers or sum(received) == 0:
        return Diagnosis("idle", None, (), None, "idle: no record reached a consumer")
    mean = statistics.fmean(received)
    heaviest = max(consumers, key=lambda s: (s.records, -s.subtask))
    skew = heaviest.records / mean if mean > 0 and len(consumers) > 1 else 1.0
    skewed = skew >= SKEW_RATIO
    pressured = [s for s in producers if s.back_pressure in (LOW, HIGH)]
    if pressured:
        origin = max(consumers, key=lambda s: (s.busy_ms_per_second or 0.0, s.records, -s.subtask))
        if skewed and (heaviest.busy_ms_per_second or 0.0) >= _NEARLY_AS_BUSY * (origin.busy_ms_per_second or 0.0):
            origin = heaviest  # about as busy as the busiest, with the records to show why: the skewed consumer
        levels = ", ".join(f"{s.subtask} ({s.back_pressure}, {_ms(s.back_pressured_ms_per_second)})" for s in pressured)
        text = (
            f"backpressure starts at consumer subtask {origin.subtask}{_on(origin)}: it is busy "
            f"{_ms(origin.busy_ms_per_second)} and not back-pressured itself, while producer subtask(s) {levels} "
            f"wait for buffers to send to it"
        )
        if skewed and origin.subtask == heaviest.subtask:
            text += f"; the cause is data skew: it receives {skew:.1f}x the mean of the consumers' records"
        elif skewed:  # busier than the skewed consumer (slowed, or starved of CPU): both are worth a look
            text += (
                f"; there is data skew too: consumer subtask {heaviest.subtask}{_on(heaviest)} receives "
                f"{skew:.1f}x the mean of the consumers' records"
            )
        pressured_ids = tuple(s.subtask for s in pressured)
        return Diagnosis("backpressure", origin.subtask, pressured_ids, skew, text, origin.executor)
    if skewed:
        text = (
            f"data skew: consumer subtask {heaviest.subtask}{_on(heaviest)} receives {heaviest.records} records, "
            f"{skew:.1f}x the mean of the consumers' {mean:.0f}; no producer is back-pressured"
        )
        return Diagnosis("skew", heaviest.subtask, (), skew, text, heaviest.executor)
    unmeasured = all(s.back_pressure is None for s in producers)
    busy = {s.subtask: s.busy_ms for s in consumers if s.busy_ms is not None}
    by_subtask = {s.subtask: s for s in consumers}
    if len(busy) > 1:  # no producer waits (blocking mode's never do): a slow consumer shows as its own time
        slowest = max(busy, key=lambda c: (busy[c], -c))
        median = statistics.median(ms for c, ms in busy.items() if c != slowest)  # the others'
        if busy[slowest] >= _STRAGGLER_MIN_MS and busy[slowest] >= STRAGGLER_RATIO * max(median, 1e-9):
            text = (
                f"straggler: consumer subtask {slowest}{_on(by_subtask[slowest])} was busy "
                f"{busy[slowest] / 1000.0:.2f} s, "
                f"{busy[slowest] / max(median, 1e-9):.1f}x the other consumers' median {median / 1000.0:.2f} s, with "
                f"records within {skew:.1f}x of the mean: it is slow itself and holds the exchange back"
            )
            return Diagnosis("straggler", slowest, (), skew, text, by_subtask[slowest].executor)
    text = (
        f"ok: no producer back-pressured over 10% of its time; the consumers' records within {skew:.1f}x of their mean"
        if not unmeasured
        else f"ok: the consumers' records within {skew:.1f}x of their mean (this mode does not measure backpressure)"
    )
    return Diagnosis("ok", None, (), skew, text)


def _on(summary: SubtaskSummary) -> str:
    return f" (on {summary.executor})" if summary.executor else ""


def _ms(value: float | None) -> str:
    return "unmeasured" if value is None else f"{value:.0f} ms/s"
