"""Sweeps: a grid of simulations, each point one Spark task, the headline figures as one DataFrame.

A what-if question is rarely one run: "throughput against the buffer timeout, with and without credits", "the
producers' back-pressured time against floating buffers per gate". :func:`grid` spells the points as the
cartesian product of a few axes over a base; :func:`sweep` runs them as a Spark job, one simulation per task
(``spark.range(n, numPartitions=n)``: one point per partition, on classic Spark and Spark Connect alike), so a
sweep that outgrows one machine runs on the user's cluster; :func:`run_points` runs the same points in this
process. A simulation runs on virtual time, so a point's figures are the same wherever it runs (only
``wall_s`` is the machine's).

Each point's figures (:data:`SWEEP_DDL`): the consumers' throughput over the measured window, the producers'
back-pressured time per second (mean and max, Flink's ``backPressuredTimeMsPerSecond`` over the run), the
consumers' busy time per second, the run's checks (``data_intact``, ``buffers_returned``) and its size
(virtual end, events, messages).
"""

from __future__ import annotations

import inspect
import itertools
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import NetworkConfig
from ..errors import ConfigError
from ..metrics import CONSUMER, PRODUCER
from .model import Simulation
from .report import BYTES_IN_PER_SECOND, SimulationReport

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["SWEEP_DDL", "SWEEP_FIELDS", "SweepPoint", "figures_of", "grid", "run_points", "sweep", "sweep_frame"]

#: The figures of one point, in :func:`sweep`'s columns (after ``index``, ``label`` and ``axes``).
SWEEP_FIELDS = (
    "throughput_mb_per_s",
    "producers_back_pressured_ms_per_s",
    "producers_back_pressured_ms_per_s_max",
    "consumers_busy_ms_per_s",
    "virtual_s",
    "finished",
    "data_intact",
    "buffers_returned",
    "steps",
    "messages",
    "wall_s",
)
#: Spark DDL of :func:`sweep`'s result: ``axes`` is the point's axis values as JSON (:func:`sweep_frame`
#: spreads them into columns), ``label`` the same as ``name=value`` text.
SWEEP_DDL = (
    "index long, label string, axes string, throughput_mb_per_s double, producers_back_pressured_ms_per_s double, "
    "producers_back_pressured_ms_per_s_max double, consumers_busy_ms_per_s double, virtual_s double, "
    "finished boolean, data_intact boolean, buffers_returned boolean, steps long, messages long, wall_s double"
)

#: The keyword arguments :class:`~.model.Simulation` takes (besides the config).
_SIMULATION_ARGS = tuple(p for p in inspect.signature(Simulation.__init__).parameters if p not in ("self", "config"))


@dataclass(frozen=True)
class SweepPoint:
    """One simulation of a sweep: ``settings`` (NetworkConfig's, as keyword arguments) and ``params``
    (:func:`~.model.simulate`'s), and ``axes``, the values of the swept axes that made it."""

    index: int
    settings: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    axes: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``name=value, ...`` of its axes."""
        return ", ".join(f"{k}={_short(v)}" for k, v in self.axes.items())

    def run(self) -> SimulationReport:
        """Run this point's simulation here."""
        return Simulation(NetworkConfig(**self.settings), **self.params).run()


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."


def _split(values: Mapping[str, Any], what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(NetworkConfig settings, simulation arguments) of ``values``; a name that is neither is a ConfigError."""
    settings_names = NetworkConfig.settings()
    settings: dict[str, Any] = {}
    params: dict[str, Any] = {}
    for name, value in values.items():
        if name in settings_names:
            settings[name] = value
        elif name in _SIMULATION_ARGS:
            params[name] = value
        else:
            raise ConfigError(
                what,
                name,
                "names of NetworkConfig settings or of arguments of simulate()",
                kind="argument",
                choices=(*settings_names, *_SIMULATION_ARGS),
            )
    return settings, params


def grid(base: Mapping[str, Any] | None = None, **axes: Sequence[Any]) -> list[SweepPoint]:
    """The points of a sweep: every combination of the ``axes`` (name -> the values it takes, in order; the
    last axis varies fastest) over ``base``, each name a NetworkConfig setting (``buffer_timeout_ms``,
    ``floating_buffers_per_gate``, ...) or an argument of :func:`~.model.simulate` (``num_producers``,
    ``consumer_rate``, ``duration``, ...). Every point's NetworkConfig is checked here, before any job: a bad
    value is the same ConfigError that ``NetworkConfig`` raises."""
    base_settings, base_params = _split(dict(base or {}), "base")
    for name, values in axes.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ConfigError(name, _short(values), "a non-empty list of the values the axis takes", kind="argument")
    _split({name: values[0] for name, values in axes.items()}, "axes")
    points = []
    names = list(axes)
    for index, combination in enumerate(itertools.product(*(axes[n] for n in names))):
        chosen = dict(zip(names, combination))
        settings, params = _split(chosen, "axes")
        point = SweepPoint(index, {**base_settings, **settings}, {**base_params, **params}, chosen)
        NetworkConfig(**point.settings)  # a bad setting fails here, not in a task
        points.append(point)
    return points


def figures_of(point: SweepPoint, report: SimulationReport, wall_s: float) -> tuple[Any, ...]:
    """The row of :data:`SWEEP_DDL` for ``point`` and its ``report``."""
    window = report.end_time or 1.0  # the time counters count over the whole run
    producers = sorted({r.subtask for r in report.rows if r.side == PRODUCER})
    consumers = sorted({r.subtask for r in report.rows if r.side == CONSUMER})
    back_pressured = [report.value(PRODUCER, p, "accumulateBackPressuredTimeMs") / window for p in producers]
    busy = [report.value(CONSUMER, c, "accumulateBusyTimeMs") / window for c in consumers]
    throughput = sum(report.value(CONSUMER, c, BYTES_IN_PER_SECOND, stat="mean") for c in consumers)
    return (
        point.index,
        point.label,
        json.dumps(point.axes, default=repr),
        throughput / 1e6,
        sum(back_pressured) / len(back_pressured) if back_pressured else 0.0,
        max(back_pressured, default=0.0),
        sum(busy) / len(busy) if busy else 0.0,
        report.end_time,
        report.finished,
        report.data_intact,
        report.buffers_returned,
        report.steps,
        report.messages,
        wall_s,
    )


def _run(point: SweepPoint) -> tuple[Any, ...]:
    started = time.perf_counter()
    report = point.run()
    return figures_of(point, report, time.perf_counter() - started)


def run_points(points: Sequence[SweepPoint]) -> list[tuple[Any, ...]]:
    """Run ``points`` one after the other in this process: the rows :func:`sweep` would return, in order."""
    return [_run(p) for p in points]


def sweep(spark: SparkSession, points: Sequence[SweepPoint]) -> DataFrame:
    """Run ``points`` as one Spark job, one simulation per task, and return their figures
    (:data:`SWEEP_DDL`), one row per point, ordered by ``index``. Lazy as any DataFrame: each action runs the
    simulations again (cache it, or ``toPandas()`` once)."""
    points = list(points)
    if not points or not all(isinstance(p, SweepPoint) for p in points):
        raise ConfigError(
            "points", _short(repr(points)), "a non-empty list of SweepPoints (see grid())", kind="argument"
        )
    by_index = {p.index: p for p in points}
    if len(by_index) != len(points):
        raise ConfigError(
            "points", _short(repr([p.index for p in points])), "points of distinct indexes", kind="argument"
        )
    order = [p.index for p in points]

    def run_partition(frames: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        import pandas

        columns = [c.split(" ")[0] for c in SWEEP_DDL.split(", ")]
        for frame in frames:
            rows = [_run(by_index[order[int(i)]]) for i in frame["id"]]
            yield pandas.DataFrame(rows, columns=columns)

    ids = spark.range(0, len(points), 1, len(points))
    return ids.mapInPandas(run_partition, SWEEP_DDL).orderBy("index")


def sweep_frame(result: DataFrame | Sequence[tuple[Any, ...]]) -> pd.DataFrame:
    """A sweep's figures (:func:`sweep`'s DataFrame, or :func:`run_points`' rows) as pandas, each axis a column
    of its own beside the figures, ordered by ``index``: ready to plot."""
    import pandas

    if isinstance(result, Sequence):
        columns = [c.split(" ")[0] for c in SWEEP_DDL.split(", ")]
        frame = pandas.DataFrame(list(result), columns=columns)
    else:
        frame = result.toPandas()
    axes = pandas.DataFrame([json.loads(a) for a in frame["axes"]], index=frame.index)
    return pandas.concat([frame[["index"]], axes, frame.drop(columns=["index", "axes"])], axis=1).sort_values("index")
