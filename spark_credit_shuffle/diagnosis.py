"""What an exchange's metrics say, per subtask and as a whole: Flink's back-pressure status and where
backpressure starts.

:func:`summarize` turns the metric rows of a run (:class:`~spark_credit_shuffle.metrics.MetricRow`) into one
:class:`SubtaskSummary` per side and subtask: integer counters, rates, busy / idle / back-pressured time per
second and Flink's back-pressure status, which its web UI derives from the share of time a subtask is
back-pressured (``backPressuredTimeMsPerSecond``): ``OK`` up to 10%, ``LOW`` up to 50%, ``HIGH`` above.

:func:`diagnose` reads the summaries the way Flink's documentation teaches to read backpressure
("Monitoring Back Pressure"): backpressure starts at the busy subtask that is not itself back-pressured while
the subtasks that send to it are. A consumer busy while the others starve is where it starts (its own work, or
an operator chained into its task, :mod:`.runtime.chain`); a consumer back-pressured on its output points to
the step after the exchange; producers waiting while no single consumer explains it is a spread load, which
names no consumer; busy or input-bound producers beside idle consumers are source-bound; data skew, stragglers
and an exchange that moved nothing are told apart. :func:`find_origin` is the rule, shared with the live
monitor's line. Every verdict carries the figures it rests on. Pure functions of the rows: no Spark. The
thresholds and the runs that check them: docs/diagnosis.md, "The verdicts".
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from .metrics import CONSUMER, EXECUTOR, PRODUCER, MetricRow

__all__ = [
    "DOWNSTREAM_MIN_MS",
    "HIGH",
    "LOW",
    "OK",
    "SKEW_RATIO",
    "SUMMARY_DDL",
    "SUMMARY_VIEW_DDL",
    "Cpu",
    "Diagnosis",
    "Load",
    "Origin",
    "SubtaskSummary",
    "back_pressure_status",
    "cpu_use",
    "diagnose",
    "find_origin",
    "summarize",
    "summary_view",
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
#: Half a second: what a pause of the machine (a descheduled thread, a collection in the JVM or Python) gives a
#: healthy consumer of a small exchange on a loaded machine stays below it.
_STRAGGLER_MIN_MS = 500.0
#: A straggler spends at least this share of its life on the work the others did not have: the time it held the
#: exchange's end back, not a pause within a life spent mostly waiting for data.
_STRAGGLER_SHARE_OF_LIFE = 0.5


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


#: Spark DDL of :meth:`Exchange.summary`'s default view, the one for people: a row fits a terminal, counts are
#: integers, rates and times per second whole numbers, bytes in MB (10^6 bytes, 2 decimals), the pool usage
#: peak a share with 2 decimals. The full view (``summary(full=True)``, :data:`SUMMARY_DDL`) keeps every field
#: unrounded, for code.
SUMMARY_VIEW_DDL = (
    "side string, subtask long, records long, buffers long, MB double, records_per_s long, busy_ms_per_s long, "
    "idle_ms_per_s long, back_pressured_ms_per_s long, back_pressure string, pool_usage_max double"
)


def _whole(value: float | None) -> int | None:
    return None if value is None else round(value)


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def summary_view(s: SubtaskSummary) -> tuple[object, ...]:
    """The row of :data:`SUMMARY_VIEW_DDL` for ``s``: what a person reads first, rounded (the full figures
    stay in ``s``)."""
    return (
        s.side,
        s.subtask,
        s.records,
        s.buffers,
        round(s.bytes / 1e6, 2),
        _whole(s.records_per_second),
        _whole(s.busy_ms_per_second),
        _whole(s.idle_ms_per_second),
        _whole(s.back_pressured_ms_per_second),
        s.back_pressure,
        _rounded(s.pool_usage_max, 2),
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
class Load:
    """One subtask's time, as Flink's web UI shows it: busy, idle and back-pressured ms per second (over its
    life in a summary, over the last window in a live sample); None where not measured."""

    side: str
    subtask: int
    busy: float | None
    idle: float | None
    back_pressured: float | None
    #: Seconds the figures cover, where known (a run's summary): a wait must add up to something to count.
    life_s: float | None = None


#: A consumer busy at least this many ms per second may be where backpressure starts.
ORIGIN_MIN_BUSY_MS = 500.0
#: ... if it is busy at least this many times the median of the other consumers' busy time,
ORIGIN_RATIO = 2.0
#: ... and the others wait for data at least this many ms per second (starved: the producers are stuck on it).
STARVED_MIN_IDLE_MS = 300.0
#: A consumer back-pressured on its output at least this many ms per second, and at least
#: DOWNSTREAM_MIN_TOTAL_S in all, is held back by what follows it (a JVM pause of a short run is not).
DOWNSTREAM_MIN_MS = 400.0
DOWNSTREAM_MIN_TOTAL_S = 1.0
#: Producers busy (or idle, waiting for their input) at least this many ms per second while the consumers idle at
#: least _SOURCE_IDLE_MS: source-bound. High bars: in a healthy exchange the producer half (partitioning,
#: serialising) costs more than the consumer half, and its consumers idle a good part of their time.
_SOURCE_BUSY_MS = 850.0
_SOURCE_IDLE_MS = 900.0
#: ... and busy at least this many ms in all (the median producer): a producer's rate over a life of a few ms
#: (one input batch of a small query, written as soon as it came) says nothing of its source, and small healthy
#: runs were called source-bound from such rates.
SOURCE_MIN_BUSY_MS = 500.0


@dataclass(frozen=True)
class Origin:
    """Where backpressure starts, as Flink finds it: the first subtask that is busy and not back-pressured
    while those sending to it are. ``kind``: ``"consumer"`` (consumer ``subtask`` is busy, the others starve),
    ``"downstream"`` (consumer ``subtask``, or every consumer when None, waits to hand its output on: the slow
    part follows the exchange) or ``"spread"`` (no one consumer: every consumer busy, the load spread)."""

    kind: str
    subtask: int | None
    load: Load | None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def find_origin(consumers: list[Load]) -> Origin:
    """Where the backpressure of back-pressured producers starts, among the ``consumers`` they send to (the
    rule the diagnosis and the live monitor share)."""
    by_bp = sorted(consumers, key=lambda c: (-(c.back_pressured or 0.0), c.subtask))
    waited_s = (by_bp[0].back_pressured or 0.0) / 1000.0 * by_bp[0].life_s if by_bp and by_bp[0].life_s else None
    if (
        by_bp
        and (by_bp[0].back_pressured or 0.0) >= DOWNSTREAM_MIN_MS
        and (waited_s is None or waited_s >= DOWNSTREAM_MIN_TOTAL_S)
    ):
        first = by_bp[0]
        others_waiting = _median([c.back_pressured or 0.0 for c in by_bp[1:]])
        if (first.back_pressured or 0.0) >= ORIGIN_RATIO * others_waiting:  # the others wait far less, if at all
            return Origin("downstream", first.subtask, first)
        return Origin("downstream", None, None)
    free = [c for c in consumers if (c.back_pressured or 0.0) <= 100.0]  # not back-pressured themselves
    if not free:
        return Origin("spread", None, None)
    busiest = max(free, key=lambda c: (c.busy or 0.0, -c.subtask))
    busy = busiest.busy or 0.0
    others = [c for c in consumers if c.subtask != busiest.subtask]
    if busy < ORIGIN_MIN_BUSY_MS:
        return Origin("spread", None, None)
    if not others:
        return Origin("consumer", busiest.subtask, busiest)
    others_busy = _median([c.busy or 0.0 for c in others])
    idles = [c.idle for c in others if c.idle is not None]
    starved = not idles or _median(idles) >= STARVED_MIN_IDLE_MS
    if busy >= ORIGIN_RATIO * others_busy and starved:
        return Origin("consumer", busiest.subtask, busiest)
    return Origin("spread", None, None)


@dataclass(frozen=True)
class Cpu:
    """What the exchange's tasks used of their machines: ``cores`` available to the tasks (summed over the
    executors), ``used``: their CPU time over the exchange's wall time, in cores; ``tasks``: how many."""

    tasks: int
    cores: int
    used: float


def cpu_use(rows: Iterable[MetricRow]) -> Cpu | None:
    """The tasks' CPU use from a run's metric rows (``taskCpuTimeMs``, ``taskWallTimeMs``,
    ``taskAvailableCores`` and the executor rows of the pipelined runtime); None where not reported."""
    cpu: dict[tuple[str, int], float] = {}
    wall: dict[tuple[str, int], float] = {}
    cores: dict[tuple[str, int], float] = {}
    where: dict[tuple[str, int], str] = {}
    for r in rows:
        if r.time_ms is not None:
            continue
        key = (r.side, r.subtask)
        if r.metric == EXECUTOR:
            where[key] = r.stat
        elif r.metric == "taskCpuTimeMs":
            cpu[key] = r.value
        elif r.metric == "taskWallTimeMs":
            wall[key] = r.value
        elif r.metric == "taskAvailableCores":
            cores[key] = r.value
    if not cpu or not wall or not cores:
        return None
    per_executor: dict[str, float] = {}
    for key, n in cores.items():
        executor = where.get(key, str(key))
        per_executor[executor] = max(per_executor.get(executor, 0.0), n)
    longest = max(wall.values())
    used = sum(cpu.values()) / longest if longest > 0 else 0.0
    return Cpu(tasks=len(cpu), cores=int(sum(per_executor.values())), used=used)


@dataclass(frozen=True)
class Diagnosis:
    """What a run's metrics say. ``verdict``:

    - ``"backpressure"``: producers back-pressured, and ``origin`` is the consumer subtask where it starts
      (busy, not back-pressured itself, the other consumers starved of data);
    - ``"downstream"``: producers back-pressured because consumer ``origin`` (every consumer, when None) waits
      to hand its output on: the slow part is the step after the exchange, outside its tasks;
    - ``"spread"``: producers back-pressured and no single consumer explains it (every consumer busy, the load
      spread: the consumers as a whole, often tasks sharing too few cores);
    - ``"source-bound"``: no backpressure; the producers busy (an operator chained before the exchange) while
      the consumers wait for data, for long enough to tell (:data:`SOURCE_MIN_BUSY_MS`): the exchange is as
      fast as its input;
    - ``"skew"`` (``origin`` receives ``skew`` times the mean of the consumers' records, no producer
      back-pressured), ``"straggler"`` (no producer back-pressured, the records even, ``origin`` busy at least
      twice the other consumers' median time: a slow consumer in blocking mode, whose producers never wait),
      ``"ok"`` or ``"idle"`` (no record moved).

    ``back_pressured``: the producer subtasks at ``LOW`` or ``HIGH``. ``executor``: where ``origin`` ran.
    ``figures``: the numbers the verdict rests on, by name. ``text``: the same for people."""

    verdict: str
    origin: int | None
    back_pressured: tuple[int, ...]
    skew: float | None
    text: str
    executor: str | None = None
    figures: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.text


def _load(s: SubtaskSummary) -> Load:
    return Load(
        s.side, s.subtask, s.busy_ms_per_second, s.idle_ms_per_second, s.back_pressured_ms_per_second, _life_s(s)
    )


def _span(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "unmeasured"
    low, high = min(known), max(known)
    return f"{low:.0f} ms/s" if round(low) == round(high) else f"{low:.0f}-{high:.0f} ms/s"


def _cpu_text(cpu: Cpu | None) -> str:
    if cpu is None:
        return ""
    return (
        f"; {cpu.tasks} tasks share {cpu.cores} cores, and their Python processes used {cpu.used:.1f} of them "
        f"(Spark's JVM, which hands the rows in and out, used part of the rest)"
    )


def diagnose(summaries: Iterable[SubtaskSummary], cpu: Cpu | None = None, mode: str | None = None) -> Diagnosis:
    """Where backpressure starts, or whether the data is skewed, from the summaries of one run; ``cpu``: what
    its tasks used of their cores (:func:`cpu_use`), named where it explains a verdict; ``mode``: the exchange's
    (a blocking exchange's consumers start after its producers ended: no run of it is source-bound)."""
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
    by_subtask = {s.subtask: s for s in consumers}
    figures: dict[str, float] = {"skew": skew}
    if cpu is not None:
        figures.update(tasks=float(cpu.tasks), cores=float(cpu.cores), cores_used=cpu.used)
    for s in pressured:
        figures[f"producer_{s.subtask}_back_pressured_ms_per_second"] = s.back_pressured_ms_per_second or 0.0
    origin = find_origin([_load(s) for s in consumers])
    busy = {s.subtask: s.busy_ms for s in consumers if s.busy_ms is not None}
    straggler = _straggler(busy, {s.subtask: _life_s(s) * 1000.0 for s in consumers}) if not pressured else None
    # a consumer HIGH on its output for a second or more is the news even where producers never wait (blocking)
    loud = (
        origin.kind == "downstream"
        and origin.subtask is not None
        and (by_subtask[origin.subtask].back_pressured_ms_per_second or 0.0) > 500.0
        and _life_s(by_subtask[origin.subtask]) >= 2.0
        and straggler is None
        and not skewed
    )
    if pressured or loud:
        levels = ", ".join(f"{s.subtask} ({s.back_pressure}, {_ms(s.back_pressured_ms_per_second)})" for s in pressured)
        waiting = f"producer subtask(s) {levels} wait for buffers" if pressured else "no producer measures a wait"
        pressured_ids = tuple(s.subtask for s in pressured)
        if skewed and (
            origin.subtask == heaviest.subtask or (origin.subtask is None and _least_idle(consumers) is heaviest)
        ):
            # the skewed consumer, the one that works (or waits on its output) most: the cause is its share of rows
            origin = Origin("consumer", heaviest.subtask, _load(heaviest))
        if origin.kind == "downstream":
            if origin.subtask is not None:
                c = by_subtask[origin.subtask]
                figures.update(
                    origin_back_pressured_ms_per_second=c.back_pressured_ms_per_second or 0.0,
                    origin_busy_ms_per_second=c.busy_ms_per_second or 0.0,
                )
                text = (
                    f"backpressure starts downstream of the exchange, after consumer subtask {c.subtask}{_on(c)}: it "
                    f"waits {_ms(c.back_pressured_ms_per_second)} to hand its rows on (back-pressured on its output, "
                    f"busy {_ms(c.busy_ms_per_second)}) while {waiting}; the step that follows the exchange on "
                    f"partition {c.subtask} is slow (chain it with Exchange.map_in_pandas to see its time as busy "
                    f"time)"
                )
                return Diagnosis("downstream", c.subtask, pressured_ids, skew, text, c.executor, figures)
            most = max(consumers, key=lambda s: (s.back_pressured_ms_per_second or 0.0, -s.subtask))
            figures.update(most_back_pressured_ms_per_second=most.back_pressured_ms_per_second or 0.0)
            text = (
                f"backpressure starts downstream of the exchange: the consumers wait to hand their rows on "
                f"({_span([s.back_pressured_ms_per_second for s in consumers])} back-pressured on their output) "
                f"while {waiting}; what follows the exchange holds it back, and no one partition stands out "
                f"(consumer subtask {most.subtask} waits most, {_ms(most.back_pressured_ms_per_second)}, less than "
                f"twice the others' median)"
            )
            return Diagnosis("downstream", None, pressured_ids, skew, text, None, figures)
        if origin.kind == "consumer" and origin.subtask is not None:
            c = by_subtask[origin.subtask]
            if skewed and (heaviest.busy_ms_per_second or 0.0) >= _NEARLY_AS_BUSY * (c.busy_ms_per_second or 0.0):
                c = heaviest  # about as busy as the busiest, with the records to show why: the skewed consumer
            others = [s for s in consumers if s.subtask != c.subtask]
            figures.update(
                origin_busy_ms_per_second=c.busy_ms_per_second or 0.0,
                others_busy_ms_per_second=_median([s.busy_ms_per_second or 0.0 for s in others]),
                others_idle_ms_per_second=_median([s.idle_ms_per_second or 0.0 for s in others]),
            )
            if (c.back_pressured_ms_per_second or 0.0) > 100.0:  # skewed, its output the costliest part of its rows
                state = (
                    f"it is busy {_ms(c.busy_ms_per_second)} and waits {_ms(c.back_pressured_ms_per_second)} to hand "
                    f"its rows on"
                )
            else:
                state = f"it is busy {_ms(c.busy_ms_per_second)} and not back-pressured itself"
            text = (
                f"backpressure starts at consumer subtask {c.subtask}{_on(c)}: {state}, while {waiting} to send to it"
            )
            if others:
                text += (
                    f" and the other consumers, busy {_span([s.busy_ms_per_second for s in others])}, wait for data "
                    f"({_span([s.idle_ms_per_second for s in others])} idle)"
                )
            if skewed and c.subtask == heaviest.subtask:
                text += f"; the cause is data skew: it receives {skew:.1f}x the mean of the consumers' records"
            elif skewed:  # busier than the skewed consumer (slowed, or starved of CPU): both are worth a look
                text += (
                    f"; there is data skew too: consumer subtask {heaviest.subtask}{_on(heaviest)} receives "
                    f"{skew:.1f}x the mean of the consumers' records"
                )
            return Diagnosis("backpressure", c.subtask, pressured_ids, skew, text, c.executor, figures)
        if pressured:
            figures.update(
                consumers_busy_ms_per_second=_median([s.busy_ms_per_second or 0.0 for s in consumers]),
                consumers_idle_ms_per_second=_median([s.idle_ms_per_second or 0.0 for s in consumers]),
            )
            text = (
                f"backpressure that no single consumer explains: {waiting} while the {len(consumers)} consumers are "
                f"busy {_span([s.busy_ms_per_second for s in consumers])}, idle "
                f"{_span([s.idle_ms_per_second for s in consumers])} and back-pressured on their output "
                f"{_span([s.back_pressured_ms_per_second for s in consumers])}: the load is spread over the consumers "
                f"as a whole and the credit round trips between the tasks, not one slow consumer{_cpu_text(cpu)}"
            )
            if skewed:  # no single consumer explains the wait, but the data is skewed: worth a look
                text += (
                    f"; there is data skew: consumer subtask {heaviest.subtask}{_on(heaviest)} receives "
                    f"{skew:.1f}x the mean of the consumers' records"
                )
            return Diagnosis("spread", None, pressured_ids, skew, text, None, figures)
    if skewed:
        text = (
            f"data skew: consumer subtask {heaviest.subtask}{_on(heaviest)} receives {heaviest.records} records, "
            f"{skew:.1f}x the mean of the consumers' {mean:.0f}; no producer is back-pressured"
        )
        return Diagnosis("skew", heaviest.subtask, (), skew, text, heaviest.executor, figures)
    unmeasured = all(s.back_pressure is None for s in producers)
    if straggler is not None:  # no producer waits (blocking mode's never do): a slow consumer shows as its own time
        slowest, median = straggler
        figures.update(origin_busy_ms=busy[slowest], others_busy_ms=median)
        text = (
            f"straggler: consumer subtask {slowest}{_on(by_subtask[slowest])} was busy "
            f"{busy[slowest] / 1000.0:.2f} s, "
            f"{busy[slowest] / max(median, 1e-9):.1f}x the other consumers' median {median / 1000.0:.2f} s, with "
            f"records within {skew:.1f}x of the mean: it is slow itself and holds the exchange back"
        )
        return Diagnosis("straggler", slowest, (), skew, text, by_subtask[slowest].executor, figures)
    source = _source_bound(producers, consumers) if mode != "blocking" else None
    if source is not None:
        figures.update(source[1])
        return Diagnosis("source-bound", None, (), skew, source[0], None, figures)
    text = (
        f"ok: no producer back-pressured over 10% of its time; the consumers' records within {skew:.1f}x of their mean"
        if not unmeasured
        else f"ok: the consumers' records within {skew:.1f}x of their mean (this mode does not measure backpressure)"
    )
    p_idle = [s.idle_ms_per_second for s in producers if s.idle_ms_per_second is not None]
    if mode != "blocking" and p_idle and _median(p_idle) >= 500.0:
        figures.update(producers_idle_ms_per_second=_median(p_idle))
        text += (
            f"; the producers waited for their input {_span(list(p_idle))}: what comes before the exchange, Spark's "
            f"hand-over of the rows included, set the pace"
        )
    return Diagnosis("ok", None, (), skew, text, None, figures)


def _least_idle(consumers: list[SubtaskSummary]) -> SubtaskSummary:
    """The consumer that waits for data least (busy, or waiting on its output, most of its time)."""
    return min(
        consumers, key=lambda s: (s.idle_ms_per_second if s.idle_ms_per_second is not None else 1000.0, s.subtask)
    )


def _straggler(busy: dict[int, float], life_ms: dict[int, float]) -> tuple[int, float] | None:
    """(the consumer busy at least :data:`STRAGGLER_RATIO` times the others' median busy time, that median), or
    None; ``busy``: each consumer's busy ms; ``life_ms``: each consumer's life (0 where unknown). A consumer whose
    extra busy time is a small part of its life was paused, not slow: its life was spent waiting like the others'."""
    if len(busy) < 2:
        return None
    slowest = max(busy, key=lambda c: (busy[c], -c))
    median = statistics.median(ms for c, ms in busy.items() if c != slowest)  # the others'
    if busy[slowest] < _STRAGGLER_MIN_MS or busy[slowest] < STRAGGLER_RATIO * max(median, 1e-9):
        return None
    if busy[slowest] - median < _STRAGGLER_SHARE_OF_LIFE * life_ms.get(slowest, 0.0):
        return None
    return slowest, median


def _life_s(s: SubtaskSummary) -> float:
    """A subtask's life in seconds, from its records and their rate (0 where unknown)."""
    return s.records / s.records_per_second if s.records_per_second else 0.0


def _source_bound(
    producers: list[SubtaskSummary], consumers: list[SubtaskSummary]
) -> tuple[str, dict[str, float]] | None:
    """The text and figures of a source-bound run (no backpressure; the producers busy, an operator chained
    before the exchange among their work, while the consumers wait for data), or None."""
    p_busy = [s.busy_ms_per_second for s in producers if s.busy_ms_per_second is not None]
    p_idle = [s.idle_ms_per_second for s in producers if s.idle_ms_per_second is not None]
    c_idle = [s.idle_ms_per_second for s in consumers if s.idle_ms_per_second is not None]
    if not p_busy or not c_idle or _median(c_idle) < _SOURCE_IDLE_MS:
        return None
    p_busy_total = [s.busy_ms for s in producers if s.busy_ms is not None]
    if p_busy_total and _median(p_busy_total) < SOURCE_MIN_BUSY_MS:
        return None  # too short a run to tell
    figures = {
        "producers_busy_ms_per_second": _median(p_busy),
        "producers_idle_ms_per_second": _median(p_idle),
        "consumers_idle_ms_per_second": _median(c_idle),
    }
    consumers_wait = f"the consumers wait for data ({_span(list(c_idle))} idle)"
    if _median(p_busy) >= _SOURCE_BUSY_MS:
        return (
            f"source-bound: the producers are busy ({_span(list(p_busy))}) with their input, an operator chained "
            f"before the exchange included, while {consumers_wait}; no backpressure: the exchange moves rows as "
            f"fast as its producers make them"
        ), figures
    # producers waiting for Spark's input is no verdict: Spark's own hand-over of the input (the JVM's Arrow
    # batches) sets that pace in healthy runs too; the ok text says it
    return None


def _on(summary: SubtaskSummary) -> str:
    return f" (on {summary.executor})" if summary.executor else ""


def _ms(value: float | None) -> str:
    return "unmeasured" if value is None else f"{value:.0f} ms/s"
