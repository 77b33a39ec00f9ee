"""A simulation calibrated on a real exchange: what the exchange measured becomes the simulation's inputs, so that
the simulation predicts the same exchange under other settings.

From the summary of a pipelined exchange's run (:class:`~spark_credit_shuffle.diagnosis.SubtaskSummary`, one per
subtask) :func:`from_exchange` takes:

- each producer's rate: the bytes it wrote over the time it was not back-pressured (its busy time and its wait
  for Spark's input together: the pace at which its input and its writing let it produce);
- each consumer's rate: the bytes it received over its busy time (decoding, and the operators chained into it);
  the simulation then spends no separate per-buffer cost (``buffer_cost=0``: the measured busy time holds it);
- the record size (bytes over records) and the bytes each producer wrote (the run ends when all is consumed);
- the placement: the executors the subtasks ran on as hosts, each subtask a process of its own (Spark's Python
  workers: ``processes="subtask"``) with a connection to each producer it reads (``connections="task_pair"``),
  the exchange's own settings;
- when each subtask started (its first timeline sample; Spark starts them one after the other) and the rows of
  each input batch (Spark hands a producer its input in Arrow batches of
  ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows, which it writes at once);
- the producers' channel shares: each producer's records per consumer, where they are uneven (a keyed exchange's
  skew: ``channel_weights``; more than 5% from equal), else round robin;
- the transport: what moving a buffer between the tasks' processes costs (their loops copying, framing and
  decoding it while they wait for a share of the machine's cores, the consumer's recycle or credit) is no rate
  of either side. The producers measure it whole, as the time each segment was held from the writer's request
  to its return (:data:`~spark_credit_shuffle.engine.producer.SEGMENT_HOLD_TIME`); :func:`fit_transport` sets
  the bytes per second the host moves over all its connections together (``host_bandwidth``: a cost per byte,
  shared, as the cores are; or, with ``transport="latency"``, each message's latency: a cost per buffer) so
  that the simulated producers hold their segments as long (the median over producers), and the back-pressure
  that follows from it is the simulation's prediction, not an input.

:func:`measured` gives the figures a prediction is held against: the throughput (bytes over the exchange's life)
and the producers' back-pressured time per second. What the simulation does not model: the CPU the subtasks
share (their measured rates hold the contention of the run they came from, not of another), Spark's feeding of
the input and taking of the output beyond the rates, and any partitioner but round robin (a keyed exchange's
skew is not reproduced: its producers write round robin).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from ..diagnosis import SubtaskSummary, summarize
from ..engine.producer import SEGMENT_HOLD_TIME
from ..errors import ConfigError
from ..metrics import CONSUMER, PRODUCER
from .report import SimulationReport
from .sweep import SweepPoint

__all__ = [
    "MAX_HOST_BANDWIDTH",
    "START_HOST_BANDWIDTH",
    "TRANSPORTS",
    "Measured",
    "channel_shares",
    "fit_transport",
    "from_exchange",
    "from_summaries",
    "measured",
    "predicted",
    "span_s",
    "start_times",
    "with_parallelism",
]

#: The latency of a message between two processes on one machine (one way, seconds).
BASE_LATENCY = 50e-6
#: Where :func:`fit_transport` starts, and the most it gives a host (bytes per second).
START_HOST_BANDWIDTH = 100e6
MAX_HOST_BANDWIDTH = 10e9
#: :func:`fit_transport` stops once the simulated segment hold time is this close to the measured one.
_HOLD_TOLERANCE = 0.05

Measured = dict[str, float]


def _life_s(s: SubtaskSummary) -> float:
    """The subtask's life in seconds: its records over its records per second."""
    if not s.records or not s.records_per_second:
        return 0.0
    return s.records / s.records_per_second


def from_summaries(summaries: Iterable[SubtaskSummary], settings: dict[str, Any]) -> SweepPoint:
    """The simulation of a run whose subtasks' summaries are ``summaries`` (pipelined: time metrics measured),
    under NetworkConfig ``settings``; see the module documentation."""
    rows = list(summaries)
    producers = sorted((s for s in rows if s.side == PRODUCER), key=lambda s: s.subtask)
    consumers = sorted((s for s in rows if s.side == CONSUMER), key=lambda s: s.subtask)
    if not producers or not consumers:
        raise ConfigError("summaries", len(rows), "the summaries of a run with producers and consumers")
    if any(s.busy_ms is None or s.back_pressured_ms_per_second is None for s in producers + consumers):
        raise ConfigError(
            "exchange", "blocking", "a pipelined exchange's run (blocking mode measures no busy or back-pressured time)"
        )
    producer_rates = []
    for s in producers:
        free_s = _life_s(s) * (1000.0 - (s.back_pressured_ms_per_second or 0.0)) / 1000.0
        producer_rates.append(s.bytes / free_s if free_s > 0 and s.bytes else 1e9)
    consumer_rates = [s.bytes / (s.busy_ms / 1000.0) if s.busy_ms and s.bytes else 1e9 for s in consumers]
    records = sum(s.records for s in producers)
    record_size = max(16, round(sum(s.bytes for s in producers) / records)) if records else 1024
    executors = sorted({s.executor or "" for s in producers + consumers})
    host = {e: i for i, e in enumerate(executors)}
    params: dict[str, Any] = {
        "num_producers": len(producers),
        "num_consumers": len(consumers),
        "producer_rate": producer_rates,
        "consumer_rate": consumer_rates,
        "bytes_per_producer": [float(s.bytes) for s in producers],
        "record_size": record_size,
        "producer_hosts": [host[s.executor or ""] for s in producers],
        "consumer_hosts": [host[s.executor or ""] for s in consumers],
        "processes": "subtask",
        "connections": "task_pair",
        "buffer_cost": 0.0,
        "latency": BASE_LATENCY,
    }
    return SweepPoint(0, dict(settings), params, {})


def from_exchange(ex: Any, *, transport: str | None = "bandwidth") -> SweepPoint:
    """The simulation of pipelined exchange ``ex``'s run (after an action), under its own settings: run it with
    ``.run()``, or change its settings and parameters (``dataclasses.replace``) to predict the same exchange
    otherwise. ``transport``: what is fitted to the segments' measured hold time (:func:`fit_transport`:
    ``"bandwidth"``, the host's bytes per second, or ``"latency"``, each message's); None: nothing, the latency
    of two local processes and no bandwidth limit."""
    config = ex.plan.config
    settings = {name: getattr(config, name) for name in type(config).settings()}
    rows = ex.metric_rows()
    point = from_summaries(summarize(rows), settings)
    point = dataclasses.replace(point, params={**point.params, "batch_records": input_batch_rows(ex)})
    weights = channel_shares(rows, point.params["num_producers"], point.params["num_consumers"])
    if weights is not None:
        point = dataclasses.replace(point, params={**point.params, "channel_weights": weights})
    starts = start_times(ex.timeline_rows(), point.params["num_producers"], point.params["num_consumers"])
    if starts is not None:
        producer_start, consumer_start = starts
        point = dataclasses.replace(
            point, params={**point.params, "producer_start": producer_start, "consumer_start": consumer_start}
        )
    holds = [r.value for r in rows if r.side == PRODUCER and r.metric == SEGMENT_HOLD_TIME]
    if transport is None or not holds:
        return point
    return fit_transport(point, statistics.median(holds) / 1e3, transport)


def input_batch_rows(ex: Any) -> int:
    """The rows of each input batch Spark hands a producer (``spark.sql.execution.arrow.maxRecordsPerBatch``): a
    producer gets its input in bursts of that many rows, which it writes at once."""
    try:
        value = ex.df.sparkSession.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000")
        rows = int(value or 10000)
    except (ValueError, TypeError):
        rows = 10000
    return rows if rows > 0 else 10000


def start_times(timeline: Iterable[Any], producers: int, consumers: int) -> tuple[list[float], list[float]] | None:
    """When each producer and consumer subtask started, in seconds after the first of them: the time of its first
    timeline sample (a task samples once at its start). None where a subtask has no sample."""
    first: dict[tuple[str, int], float] = {}
    for r in timeline:
        key = (r.side, r.subtask)
        if r.time_ms is not None and (key not in first or r.time_ms < first[key]):
            first[key] = r.time_ms
    wanted = [(PRODUCER, p) for p in range(producers)] + [(CONSUMER, c) for c in range(consumers)]
    if any(key not in first for key in wanted):
        return None
    origin = min(first[key] for key in wanted)
    return (
        [(first[(PRODUCER, p)] - origin) / 1e3 for p in range(producers)],
        [(first[(CONSUMER, c)] - origin) / 1e3 for c in range(consumers)],
    )


def span_s(timeline: Iterable[Any]) -> float:
    """The run's span in seconds: from the first subtask's start to the last one's end (the first and the last
    timeline sample; a task samples at its start and at its end)."""
    times = [r.time_ms for r in timeline if r.time_ms is not None]
    return (max(times) - min(times)) / 1e3 if times else 0.0


def with_parallelism(point: SweepPoint, producers: int, consumers: int | None = None) -> SweepPoint:
    """``point`` (a run's simulation) at another parallelism: the run's bytes spread evenly over ``producers``
    producers and ``consumers`` consumers (default as many), each at the median rate of its side in the run, on
    the run's hosts round robin; subtask ``i`` starts when subtask ``i`` modulo the run's parallelism started; the
    channels' shares back to round robin. The transport fitted to the run stays: a host's bandwidth is the host's
    whatever the number of connections that share it."""
    consumers = producers if consumers is None else consumers
    if producers < 1 or consumers < 1:
        raise ConfigError("parallelism", (producers, consumers), "at least 1 producer and 1 consumer")
    params = dict(point.params)
    total = sum(float(b) for b in params["bytes_per_producer"])

    def median_rate(key: str) -> float:
        rate = params[key]
        return float(statistics.median(rate)) if isinstance(rate, list) else float(rate)

    def cycled(key: str, count: int) -> Any:
        values = params.get(key)
        return [values[i % len(values)] for i in range(count)] if isinstance(values, list) else values

    params.pop("channel_weights", None)
    params.update(
        num_producers=producers,
        num_consumers=consumers,
        producer_rate=[median_rate("producer_rate")] * producers,
        consumer_rate=[median_rate("consumer_rate")] * consumers,
        bytes_per_producer=[total / producers] * producers,
        producer_hosts=cycled("producer_hosts", producers),
        consumer_hosts=cycled("consumer_hosts", consumers),
    )
    for key, count in (("producer_start", producers), ("consumer_start", consumers)):
        if key in params:
            params[key] = cycled(key, count)
    return dataclasses.replace(point, params=params)


def channel_shares(rows: Iterable[Any], producers: int, consumers: int) -> list[list[float]] | None:
    """Each producer's records per consumer (``numRecordsOut`` per channel, all-to-all), or None where every
    producer's shares are within 5% of equal (round robin writes them as well, in the real partitioner's order)."""
    shares = [[0.0] * consumers for _ in range(producers)]
    for r in rows:
        wanted = r.side == PRODUCER and r.metric == "numRecordsOut" and r.channel is not None
        if wanted and 0 <= r.subtask < producers and 0 <= r.channel < consumers:
            shares[r.subtask][r.channel] += r.value
    uneven = False
    for row in shares:
        mean = sum(row) / consumers
        if mean <= 0:
            return None  # a producer that wrote nothing: nothing to weigh by
        uneven = uneven or max(abs(v - mean) for v in row) > 0.05 * mean
    return shares if uneven else None


def _hold_s(report: SimulationReport) -> float | None:
    """The median over the simulated producers of their mean segment hold time, in seconds."""
    holds = [r.value for r in report.rows if r.side == PRODUCER and r.metric == SEGMENT_HOLD_TIME]
    return statistics.median(holds) / 1e3 if holds else None


#: The transports :func:`fit_transport` fits: what it moves to match the measured segment hold time.
TRANSPORTS = ("bandwidth", "latency")


def fit_transport(point: SweepPoint, hold_s: float, transport: str = "bandwidth", rounds: int = 12) -> SweepPoint:
    """``point`` with its transport set so that its producers hold a segment ``hold_s`` seconds (the median over
    producers of their mean), within 5% or the closest of ``rounds`` simulations.

    ``transport="bandwidth"`` (the default) fits ``host_bandwidth``: a cost per byte, shared by every connection
    of a host, as the cores that copy, frame and decode the buffers are. ``"latency"`` fits the one-way
    ``latency`` of every message: a cost per buffer, which each connection pays on its own. Both holds grow as the
    transport slows (a segment waits longer to be sent and for its credit back), so the knob is moved by a factor
    until the simulated hold passes the measured one, then bisected (geometrically) between the two. Where even
    the fastest transport (:data:`MAX_HOST_BANDWIDTH`, :data:`BASE_LATENCY`) holds the segments longer than
    measured (the consumers, not the transport, hold them), that fastest one is kept: no host bandwidth, the base
    latency."""
    if not (hold_s > 0):
        raise ConfigError("hold_s", hold_s, "a measured segment hold time > 0 s")
    if transport not in TRANSPORTS:
        raise ConfigError("transport", transport, " or ".join(repr(t) for t in TRANSPORTS))
    if transport == "bandwidth":
        # a knob that slows the transport as it grows: seconds per byte; 0 is no limit
        knob, fastest, start = "host_bandwidth", 1.0 / MAX_HOST_BANDWIDTH, 1.0 / START_HOST_BANDWIDTH

        def value(x: float) -> float | None:
            return None if x <= fastest else 1.0 / x
    else:
        knob, fastest = "latency", BASE_LATENCY
        start = max(BASE_LATENCY, float(point.params.get("latency", BASE_LATENCY)))

        def value(x: float) -> float | None:
            return x

    x = start
    short = long = None  # knob values known to hold segments shorter / longer than measured
    best: tuple[float, float] | None = None  # (|gap|, x)
    for _ in range(rounds):
        candidate = dataclasses.replace(point, params={**point.params, knob: value(x)})
        simulated = _hold_s(candidate.run())
        if simulated is None:
            break
        gap = simulated - hold_s
        if best is None or abs(gap) < best[0]:
            best = (abs(gap), x)
        if abs(gap) <= _HOLD_TOLERANCE * hold_s:
            break
        if gap > 0:  # held longer than measured: a faster transport
            if x <= fastest:  # even the fastest holds them longer: the transport is not what holds them
                best = (0.0, x)
                break
            long = x
        else:
            short = x
        if short is not None and long is not None:
            x = (short * long) ** 0.5
        elif short is None:
            x = max(fastest, x / 4)
        else:
            x = x * 4
    chosen = best[1] if best is not None else x
    return dataclasses.replace(point, params={**point.params, knob: value(chosen)})


def measured(summaries: Iterable[SubtaskSummary], timeline: Iterable[Any] | None = None) -> Measured:
    """What a real run measured, as a prediction is held against it: ``throughput_mb_per_s`` (the producers'
    bytes over the run's span, from the first subtask's start to the last one's end, as the simulation's clock
    runs; without timeline rows, over the longest subtask life) and ``producers_back_pressured_ms_per_s``
    (their mean)."""
    rows = list(summaries)
    producers = [s for s in rows if s.side == PRODUCER]
    life = span_s(timeline) if timeline is not None else 0.0
    if not life:  # no timeline (or sampling off: metrics_sample_interval_ms=0)
        life = max((_life_s(s) for s in rows), default=0.0)
    total = sum(s.bytes for s in producers)
    bp = [s.back_pressured_ms_per_second or 0.0 for s in producers]
    return {
        "throughput_mb_per_s": total / life / 1e6 if life else 0.0,
        "producers_back_pressured_ms_per_s": sum(bp) / len(bp) if bp else 0.0,
    }


def predicted(report: SimulationReport) -> Measured:
    """The same figures as :func:`measured`, from a simulation's report (virtual seconds: its clock starts with
    the first subtask)."""
    window = report.end_time or 1.0
    producers = sorted({r.subtask for r in report.rows if r.side == PRODUCER})
    total = sum(report.value(PRODUCER, p, "numBytesOut") for p in producers)
    bp = [report.value(PRODUCER, p, "accumulateBackPressuredTimeMs") / window for p in producers]
    return {
        "throughput_mb_per_s": total / window / 1e6,
        "producers_back_pressured_ms_per_s": sum(bp) / len(bp) if bp else 0.0,
    }


def describe(point: SweepPoint) -> dict[str, Any]:
    """The point's parameters, rounded for a table."""
    out = asdict(point)["params"]
    for key in ("producer_rate", "consumer_rate"):
        out[key] = [round(r / 1e6, 1) for r in out[key]]
    return out
