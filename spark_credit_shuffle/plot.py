"""Pictures of an exchange: the metrics timeline per subtask and bar charts of the summary metrics.

matplotlib is an optional extra (``pip install "spark-credit-shuffle[plot]"``); this module imports it
only when a function is called. Every function returns a ``matplotlib.figure.Figure`` (shown inline by
Jupyter when it is a cell's value) built without pyplot, so nothing global changes and it works without a
display; ``path=`` also writes it as a PNG.

Inputs are whatever is at hand: an :class:`~spark_credit_shuffle.exchange.Exchange`, a Spark or pandas
DataFrame with the metrics (or timeline) columns, or a list of
:class:`~spark_credit_shuffle.metrics.MetricRow`.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .metrics import rows_to_pandas

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = [
    "LiveTimeline",
    "bar_chart",
    "line_chart",
    "plot_metrics",
    "plot_sweep",
    "plot_timeline",
    "plot_timeout_sweep",
    "subtask_colours",
    "timeline_from_simulation",
    "to_pandas",
]

#: The timeline metrics drawn by default, in this order (those present in the data that are not always 0;
#: ``backPressuredTimeMsPerSecond``, where measured, in place of ``isBackPressured``).
DEFAULT_TIMELINE_METRICS = (
    "outPoolUsage",
    "backlog",
    "backPressuredTimeMsPerSecond",
    "isBackPressured",
    "numRecordsOutPerSecond",
    "inPoolUsage",
    "inputFloatingBuffersUsage",
    "credit",
    "inputQueueLength",
    "numRecordsInPerSecond",
)

#: What each timeline metric is, in words and with its unit, for the panels' labels.
METRIC_LABELS = {
    "outPoolUsage": "output pool in use (share of its buffers)",
    "inPoolUsage": "input pool in use (share of its buffers)",
    "inputExclusiveBuffersUsage": "exclusive buffers in use (share)",
    "inputFloatingBuffersUsage": "floating buffers in use (share)",
    "backlog": "backlog (buffers)",
    "credit": "credit (buffers)",
    "unannouncedCredit": "credit not yet announced (buffers)",
    "outputQueueLength": "output queue (buffers)",
    "inputQueueLength": "input queue (buffers)",
    "isBackPressured": "back-pressured (1 = yes)",
    "backPressuredTimeMsPerSecond": "back-pressured (ms per second)",
    "numRecordsOutPerSecond": "records out per second",
    "numRecordsInPerSecond": "records in per second",
    "checkpointBarrier": "checkpoint barrier (id)",
}

#: Flink's back-pressure levels as bands of ``backPressuredTimeMsPerSecond``: (low, high, level, colour).
_BACK_PRESSURE_BANDS = (
    (0.0, 100.0, "OK", "#2ca02c"),
    (100.0, 500.0, "LOW", "#ffbf00"),
    (500.0, 1000.0, "HIGH", "#d62728"),
)


_FIGURE_CLASS: list[type] = []


def _figure_class() -> type[Figure]:
    """matplotlib's Figure with a PNG representation, so that Jupyter shows it without pyplot."""
    if _FIGURE_CLASS:
        return _FIGURE_CLASS[0]
    try:
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - depends on the installation
        raise ImportError(
            "plotting needs matplotlib: pip install 'spark-credit-shuffle[plot]' (or pip install matplotlib)"
        ) from None

    class InlineFigure(Figure):
        """A Figure that renders itself as PNG when a notebook displays it."""

        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            self.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
            return buffer.getvalue()

    _FIGURE_CLASS.append(InlineFigure)
    return InlineFigure


def to_pandas(data: Any, *, timeline: bool | None = None) -> pd.DataFrame:
    """Metric rows as a pandas DataFrame with at least side, subtask, channel, metric, stat, value
    (and time_ms for timeline rows). ``timeline`` picks the timeline of an Exchange (default: the
    summary metrics)."""
    import pandas as pd

    if hasattr(data, "timeline_rows") and hasattr(data, "metric_rows"):  # an Exchange
        rows = data.timeline_rows() if timeline else data.metric_rows()
        return rows_to_pandas(rows)
    if hasattr(data, "toPandas"):  # a Spark DataFrame
        return data.toPandas()
    if isinstance(data, pd.DataFrame):
        return data
    if isinstance(data, Sequence):
        return rows_to_pandas(data)
    raise ConfigError("data", type(data).__name__, "an Exchange, a Spark or pandas DataFrame, or MetricRows")


def timeline_from_simulation(report: Any) -> list[Any]:
    """The samples of a :class:`~spark_credit_shuffle.simulation.SimulationReport` as timeline rows
    (``time_ms`` in virtual milliseconds), ready for :func:`plot_timeline`: the runtimes' own rows and
    metric names (a report can also be passed to :func:`plot_timeline` as it is)."""
    return list(report.timeline_rows())


def _save(fig: Figure, path: str | os.PathLike[str] | None) -> Figure:
    if path is not None:
        fig.savefig(os.fspath(path), dpi=110, bbox_inches="tight")
    return fig


def plot_timeline(
    data: Any,
    metrics: Sequence[str] | None = None,
    *,
    side: str | None = None,
    per_channel: bool = False,
    title: str | None = None,
    xlabel: str = "seconds since the first sample",
    path: str | os.PathLike[str] | None = None,
) -> Figure:
    """One panel per metric, one line per subtask (per channel with ``per_channel=True``), over time.

    ``data``: an Exchange (its timeline), or timeline rows (with ``time_ms``). Per-channel metrics
    (backlog, credit, ...) are summed over the channels of a subtask unless ``per_channel``. Time is in
    seconds from the first sample. ``side`` keeps only ``producer`` or ``consumer`` rows.
    """
    frame = to_pandas(data, timeline=True)
    if "time_ms" not in frame or frame["time_ms"].isna().all():
        raise ConfigError("data", "metrics without time_ms", "timeline rows (Exchange.timeline())")
    frame = frame[frame["time_ms"].notna()]
    if side is not None:
        frame = frame[frame["side"] == side]
    present = list(dict.fromkeys(frame["metric"]))
    left_out: list[str] = []
    if metrics is None:
        moving = {m for m in present if (frame.loc[frame["metric"] == m, "value"] != 0).any()}
        chosen = [m for m in DEFAULT_TIMELINE_METRICS if m in moving]
        if "backPressuredTimeMsPerSecond" in present and "isBackPressured" in chosen:
            chosen.remove("isBackPressured")  # the time per second says more, and has Flink's bands
        left_out = [m for m in DEFAULT_TIMELINE_METRICS if m in present and m not in moving]
        chosen = chosen or present
    else:
        missing = [m for m in metrics if m not in present]
        if missing:
            raise ConfigError("metrics", missing, "metrics present in the timeline: " + ", ".join(present))
        chosen = list(metrics)
    if not chosen:
        raise ConfigError("data", "an empty timeline", "at least one sample (run an action first)")
    start = frame["time_ms"].min()
    phases = _phases(frame, start)
    colours = subtask_colours(frame[frame["metric"].isin(chosen)])
    channel_styles = ("-", "--", ":", "-.")
    Figure = _figure_class()
    fig = Figure(figsize=(10, 2.1 * len(chosen) + 0.9), layout="constrained")
    axes = fig.subplots(len(chosen), 1, sharex=True, squeeze=False)[:, 0]
    for ax, metric in zip(axes, chosen):
        rows = frame[frame["metric"] == metric]
        per_task = rows["channel"].isna().all()
        grouped: Any  # a DataFrame either way (pandas-stubs type the as_index=False sum as a Series)
        if per_task or not per_channel:
            grouped = rows.groupby(["side", "subtask", "time_ms"], as_index=False)["value"].sum()
            keys = ["side", "subtask"]
        else:
            grouped = rows
            keys = ["side", "subtask", "channel"]
        for key, series in grouped.groupby(keys):
            series = series.sort_values("time_ms")
            arrow = " -> " if key[0] == "producer" else " <- "  # a producer's channel names its consumer
            label = f"{key[0]} {key[1]}" + (f"{arrow}{int(key[2])}" if len(key) > 2 else "")
            style = channel_styles[int(key[2]) % len(channel_styles)] if len(key) > 2 else "-"
            ax.step(
                (series["time_ms"] - start) / 1000.0,
                series["value"],
                where="post",
                label=label,
                color=colours[(key[0], int(key[1]))],  # one colour per subtask in every panel
                linestyle=style,  # per channel: the subtask's colour, one dash pattern per channel
            )
        if metric == "backPressuredTimeMsPerSecond":
            for low, high, level, colour in _BACK_PRESSURE_BANDS:
                ax.axhspan(low, high, color=colour, alpha=0.08, lw=0)
                ax.text(1.0, (low + high) / 2, f" {level}", transform=ax.get_yaxis_transform(), fontsize=7,
                        va="center", ha="left", color=colour)  # fmt: skip
            ax.set_ylim(0, 1000)
        for name, begin, end in phases:
            ax.axvspan(begin, end, color="#1f77b4" if name.startswith("producer") else "#9467bd", alpha=0.06, lw=0)
        suffix = "" if per_task or per_channel else ", sum over channels"
        ax.set_ylabel(f"{METRIC_LABELS.get(metric, metric)}\n[{metric}{suffix}]", fontsize=7)
        ax.grid(True, alpha=0.3)
        ax.legend(
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.06 if metric == "backPressuredTimeMsPerSecond" else 1.01, 1.0),
        )
    for name, begin, end in phases:  # blocking mode: the stages one after the other, named on the top panel
        axes[0].text((begin + end) / 2, 1.02, name, transform=axes[0].get_xaxis_transform(), ha="center",
                     va="bottom", fontsize=8)  # fmt: skip
    axes[-1].set_xlabel(xlabel)
    fig.suptitle(title or "network metrics over time")
    if left_out:
        fig.supxlabel("always 0 in this run, not drawn: " + ", ".join(left_out), fontsize=7, color="0.4")
    return _save(fig, path)


def subtask_colours(frame: pd.DataFrame) -> dict[tuple[str, int], Any]:
    """One colour per (side, subtask) of ``frame``, producers first: so that a subtask has the same colour in
    every panel of a figure, whichever subtasks a panel's metric has (matplotlib's cycle would restart in each
    panel and colour the first line of each alike). matplotlib's default cycle while it has colours enough,
    evenly spaced colours of a colour map beyond."""
    from matplotlib import colormaps, rcParams

    keys = sorted({(str(side), int(subtask)) for side, subtask in zip(frame["side"], frame["subtask"])},
                  key=lambda k: (k[0] != "producer", k[0], k[1]))  # fmt: skip
    cycle = rcParams["axes.prop_cycle"].by_key().get("color", [])
    if len(keys) <= len(cycle):
        return {key: cycle[i] for i, key in enumerate(keys)}
    cmap = colormaps["turbo"]
    return {key: cmap(i / max(len(keys) - 1, 1)) for i, key in enumerate(keys)}


def _phases(frame: pd.DataFrame, start: float) -> list[tuple[str, float, float]]:
    """The producer and consumer stages as (name, first, last sample in seconds) when one ran after the other
    (blocking mode); none when they overlap (pipelined mode)."""
    spans = {}
    for side in ("producer", "consumer"):
        times = frame.loc[frame["side"] == side, "time_ms"]
        if times.empty:
            return []
        spans[side] = ((times.min() - start) / 1000.0, (times.max() - start) / 1000.0)
    if spans["producer"][1] > spans["consumer"][0]:
        return []
    return [("producer stage", *spans["producer"]), ("consumer stage", *spans["consumer"])]


def plot_metrics(
    data: Any,
    metric: str = "numRecordsIn",
    *,
    stat: str = "total",
    side: str | None = None,
    title: str | None = None,
    path: str | os.PathLike[str] | None = None,
) -> Figure:
    """A bar per subtask of ``metric`` (``stat``), stacked by channel where the metric has one.

    ``data``: an Exchange (its summary metrics) or metric rows. Raises ConfigError naming the metrics
    present if ``metric`` is not among them.
    """
    frame = to_pandas(data)
    if "time_ms" in frame:
        frame = frame[frame["time_ms"].isna()]
    rows = frame[(frame["metric"] == metric) & (frame["stat"] == stat)]
    if side is not None:
        rows = rows[rows["side"] == side]
    if rows.empty:
        present = sorted({(m, s) for m, s in zip(frame["metric"], frame["stat"])})
        raise ConfigError(
            "metric", (metric, stat), "one of " + ", ".join(f"{m}/{s}" for m, s in present) or "none (no metrics)"
        )
    Figure = _figure_class()
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.subplots()
    subtasks = sorted({(s, int(t)) for s, t in zip(rows["side"], rows["subtask"])})
    labels = [f"{s} {t}" for s, t in subtasks]
    index = {key: i for i, key in enumerate(subtasks)}
    channels = sorted({int(c) for c in rows["channel"].dropna()})
    if channels:
        bottoms = [0.0] * len(subtasks)
        for channel in channels:
            heights = [0.0] * len(subtasks)
            for s, t, c, v in zip(rows["side"], rows["subtask"], rows["channel"], rows["value"]):
                if c == c and int(c) == channel:  # c == c: not NaN
                    heights[index[(s, int(t))]] += float(v)
            ax.bar(labels, heights, bottom=bottoms, label=f"channel {channel}")
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        ax.legend(fontsize=7, title="channel: the other side's subtask", title_fontsize=7)
    else:
        heights = [0.0] * len(subtasks)
        for s, t, v in zip(rows["side"], rows["subtask"], rows["value"]):
            heights[index[(s, int(t))]] += float(v)
        ax.bar(labels, heights)
    ax.set_ylabel(f"{metric} ({stat})")
    ax.grid(True, axis="y", alpha=0.3)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.set_title(title or f"{metric} per subtask")
    return _save(fig, path)


def bar_chart(
    categories: Sequence[str],
    series: dict[str, Sequence[float]],
    *,
    ylabel: str = "",
    title: str = "",
    path: str | os.PathLike[str] | None = None,
) -> Figure:
    """Grouped bars: one group per category, one bar per series (e.g. with and without credits)."""
    if not series or any(len(v) != len(categories) for v in series.values()):
        raise ConfigError("series", {k: len(v) for k, v in series.items()}, f"{len(categories)} values per series")
    Figure = _figure_class()
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        positions = [i + (k - (len(series) - 1) / 2) * width for i in range(len(categories))]
        ax.bar(positions, list(values), width, label=name)
    ax.set_xticks(range(len(categories)), list(categories), fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def line_chart(
    x: Sequence[float],
    series: dict[str, Sequence[float]],
    *,
    xlabel: str = "",
    ylabel: str = "",
    title: str = "",
    logx: bool = False,
    path: str | os.PathLike[str] | None = None,
) -> Figure:
    """Lines with markers, one per series, against ``x`` (e.g. throughput against buffer timeout)."""
    if not series or any(len(v) != len(x) for v in series.values()):
        raise ConfigError("series", {k: len(v) for k, v in series.items()}, f"{len(x)} values per series")
    Figure = _figure_class()
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.subplots()
    for name, values in series.items():
        ax.plot(list(x), list(values), marker="o", label=name)
    if logx:
        ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_sweep(
    data: Any,
    x: str,
    y: str = "throughput_mb_per_s",
    *,
    hue: str | None = None,
    logx: bool = False,
    title: str = "",
    path: str | os.PathLike[str] | None = None,
) -> Figure:
    """A sweep's figure (:func:`~spark_credit_shuffle.simulation.sweep.sweep`'s DataFrame, its rows, or
    :func:`~spark_credit_shuffle.simulation.sweep.sweep_frame`'s pandas frame): ``y`` against axis ``x``, one
    line per value of axis ``hue`` (if given). Points that share ``x`` and ``hue`` (other axes) are averaged."""
    import pandas as pd

    from .simulation.sweep import sweep_frame

    frame = data if isinstance(data, pd.DataFrame) else sweep_frame(data)
    for name in (x, y) + ((hue,) if hue else ()):
        if name not in frame.columns:
            raise ConfigError(
                "x" if name == x else "y" if name == y else "hue",
                name,
                "a column of the sweep (an axis or a figure)",
                kind="argument",
                choices=[str(c) for c in frame.columns],
            )
    xs: list[float] = sorted(frame[x].unique())
    groups = [(f"{hue}={v}", frame[frame[hue] == v]) for v in frame[hue].unique()] if hue else [(y, frame)]
    series: dict[str, Sequence[float]] = {
        name: [float(part[part[x] == value][y].mean()) if (part[x] == value).any() else float("nan") for value in xs]
        for name, part in groups
    }
    return line_chart(xs, series, xlabel=x, ylabel=y, title=title or f"{y} against {x}", logx=logx, path=path)


def plot_timeout_sweep(
    timeouts: Sequence[int],
    throughput_mb_s: Sequence[float],
    latency_p50_ms: Sequence[float | None],
    latency_p99_ms: Sequence[float | None],
    *,
    title: str = "buffer timeout: throughput and latency",
    path: str | os.PathLike[str] | None = None,
) -> Figure:
    """Throughput and per-record latency (p50, p99 of the latency markers) against the buffer timeout.

    One point per timeout, in the order given; ``-1`` (flush only when full) is labelled "off". Two panels
    sharing the x axis: throughput (MB/s) above, latency (ms, log scale) below.
    """
    n = len(timeouts)
    if not n or any(len(v) != n for v in (throughput_mb_s, latency_p50_ms, latency_p99_ms)):
        raise ConfigError(
            "sweep",
            {"timeouts": n, "throughput": len(throughput_mb_s), "p50": len(latency_p50_ms), "p99": len(latency_p99_ms)},
            "one throughput and one p50 and p99 latency per timeout",
        )
    labels = ["off (-1)" if t < 0 else f"{t} ms" for t in timeouts]
    x = list(range(n))
    Figure = _figure_class()
    fig = Figure(figsize=(7, 5.2), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.bar(x, list(throughput_mb_s), color="tab:blue")
    for i, value in enumerate(throughput_mb_s):
        top.annotate(f"{value:.3g}", (i, value), ha="center", va="bottom", fontsize=8)
    top.set_ylabel("throughput MB/s")
    top.grid(True, axis="y", alpha=0.3)
    for name, values in (("p50", latency_p50_ms), ("p99", latency_p99_ms)):
        points = [(i, v) for i, v in zip(x, values) if v is not None and v > 0]
        if points:
            bottom.plot([i for i, _ in points], [v for _, v in points], marker="o", label=f"latency {name}")
    bottom.set_yscale("log")
    bottom.set_ylabel("latency ms (markers)")
    bottom.set_xlabel("buffer timeout")
    bottom.set_xticks(x, labels)
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


class LiveTimeline:
    """A live monitor callback that draws an exchange's timeline in a notebook while it runs:
    ``scs.exchange(df, ..., monitor=LiveTimeline())``, then any action. Every ``every_s`` seconds of samples it
    redraws :func:`plot_timeline` of what arrived so far in one output cell (IPython's display handles, which
    Jupyter and Databricks both update in place). ``rows`` holds the samples (at most ``max_rows`` of the
    newest)."""

    def __init__(
        self,
        metrics: Sequence[str] | None = None,
        *,
        side: str | None = None,
        title: str | None = None,
        every_s: float = 2.0,
        max_rows: int = 200_000,
    ) -> None:
        self.metrics = metrics
        self.side = side
        self.title = title
        self.every_s = every_s
        self.max_rows = max_rows
        self.rows: list[Any] = []
        self.num_draws = 0
        #: The last drawing.
        self.figure: Figure | None = None
        self._handle: Any = None
        self._last = float("-inf")
        self._lock = threading.Lock()

    def __call__(self, rows: list[Any]) -> None:
        with self._lock:
            self.rows.extend(rows)
            if len(self.rows) > self.max_rows:
                del self.rows[: len(self.rows) - self.max_rows]
            now = time.monotonic()
            if now - self._last < self.every_s:
                return
            self._last = now
            self.draw()

    def draw(self) -> Figure:
        """Draw what arrived so far, in the cell of the first drawing (a new one the first time); outside a
        notebook (no IPython kernel) only :attr:`figure` is kept."""
        figure = plot_timeline(list(self.rows), self.metrics, side=self.side, title=self.title)
        self.figure = figure
        self.num_draws += 1
        try:
            from IPython import get_ipython
            from IPython.display import display
        except ImportError:
            return figure
        if get_ipython() is None:
            return figure
        if self._handle is None:
            self._handle = display(figure, display_id=True)
        else:
            self._handle.update(figure)
        return figure
