"""The exchanges' live figures in Prometheus' text exposition format (version 0.0.4), under Flink's metric names.

Flink's ``PrometheusReporter`` names a task's metric ``flink_taskmanager_job_task_<scope>_<name>``: the scope
components joined by ``_`` (``Shuffle_Netty_Output_Buffers_outPoolUsage``, or nothing for the task's own
``numRecordsOut``, ``backPressuredTimeMsPerSecond``), and exposes counters and gauges alike as Prometheus
gauges. The same names here, with labels for what identifies a series in an exchange: ``exchange``,
``mode``, ``side`` (``producer``, Flink's result partition, or ``consumer``, its input gate),
``subtask_index`` (Flink's label) and, per channel, ``channel`` (for a producer the consumer a subpartition
feeds, for a consumer the producer a channel reads).

While an exchange runs, every figure is its subtask's latest sample (the tasks send them about once a second);
once the run ended the counters are its totals, the same as ``Exchange.metric_rows()`` sums over channels. The
few figures Flink does not have (``credit``, ``unannouncedCredit``, a channel's ``backlog``) keep the names of
``Exchange.timeline()``; ``credit_shuffle_*`` series tell an exchange's state and each side's back-pressure
level (0 OK, 1 LOW, 2 HIGH, Flink's web UI's). Written by hand: the format is a few lines of text, and the
page's hardened service serves it (no second server, no dependency).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..diagnosis import HIGH, LOW, OK, back_pressure_status
from ..metrics import CONSUMER, PRODUCER
from .board import ExchangeView, worst

__all__ = ["CONTENT_TYPE", "PREFIX", "exposition", "metric_name"]

#: What the endpoint's answer is (Prometheus' text format).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Flink's PrometheusReporter's prefix for a task's metrics.
PREFIX = "flink_taskmanager_job_task_"

#: Flink's scope of the metrics that are not the task's own (``Shuffle.Netty.<Input|Output>.Buffers``).
_OUTPUT_BUFFERS = ("outPoolUsage", "outputQueueLength")
_INPUT_BUFFERS = ("inPoolUsage", "inputExclusiveBuffersUsage", "inputFloatingBuffersUsage", "inputQueueLength")

#: What each metric is (HELP), by the name ``Exchange.timeline()`` gives it.
_HELP = {
    "numRecordsOut": "records a producer subtask wrote so far",
    "numBuffersOut": "network buffers a producer subtask sent so far",
    "numBytesOut": "bytes of the buffers a producer subtask sent so far",
    "numRecordsIn": "records a consumer subtask received so far",
    "numBuffersIn": "network buffers a consumer subtask received so far",
    "numBytesIn": "bytes of the buffers a consumer subtask received so far",
    "numRecordsOutPerSecond": "records written per second since the previous sample",
    "numRecordsInPerSecond": "records received per second since the previous sample",
    "outPoolUsage": "share of the producer's buffer pool in use",
    "inPoolUsage": "share of the consumer's buffers (exclusive and floating) in use",
    "inputExclusiveBuffersUsage": "share of the consumer's exclusive buffers in use",
    "inputFloatingBuffersUsage": "share of the consumer's floating buffers in use",
    "outputQueueLength": "buffers queued in a subpartition",
    "inputQueueLength": "buffers queued in an input channel",
    "isBackPressured": "1 while the subtask waits for a buffer (producer) or to hand its output on (consumer)",
    "busyTimeMsPerSecond": "ms per second the subtask was busy, over the last minute",
    "idleTimeMsPerSecond": "ms per second the subtask waited for input, over the last minute",
    "backPressuredTimeMsPerSecond": "ms per second the subtask was back-pressured, over the last minute",
    "softBackPressuredTimeMsPerSecond": "back-pressured ms per second before an input batch, over the last minute",
    "hardBackPressuredTimeMsPerSecond": "back-pressured ms per second within an input batch, over the last minute",
    "backlog": "buffers a subpartition holds for its consumer (producer), as last announced (consumer)",
    "credit": "buffers the sender may send on a channel now",
    "unannouncedCredit": "credit a consumer's channel has not announced to its sender yet",
    "debloatedBufferSize": "the buffer size buffer debloating announced",
    "estimatedTimeToConsumeBuffersMs": "the time the consumer's in-flight buffers take to consume",
}
_LEVEL = {OK: 0, LOW: 1, HIGH: 2}


def metric_name(side: str, metric: str) -> str:
    """Flink's Prometheus name of a task's metric (``outPoolUsage`` ->
    ``flink_taskmanager_job_task_Shuffle_Netty_Output_Buffers_outPoolUsage``); a channel's ``credit`` and
    ``backlog`` go under the scope of the side they belong to (``Shuffle_Netty_Output_`` or ``_Input_``)."""
    if metric in _OUTPUT_BUFFERS:
        return f"{PREFIX}Shuffle_Netty_Output_Buffers_{metric}"
    if metric in _INPUT_BUFFERS:
        return f"{PREFIX}Shuffle_Netty_Input_Buffers_{metric}"
    if metric in ("backlog", "credit", "unannouncedCredit"):
        return f"{PREFIX}Shuffle_Netty_{'Output' if side == PRODUCER else 'Input'}_{metric}"
    return PREFIX + metric


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Iterable[tuple[str, object]]) -> str:
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs) + "}"


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def exposition(views: Iterable[ExchangeView]) -> str:
    """Every figure of ``views`` as Prometheus text: one HELP and TYPE per metric name, then its series."""
    families: dict[str, tuple[str, list[str]]] = {}

    def add(name: str, help_text: str, labels: list[tuple[str, object]], value: float) -> None:
        family = families.get(name)
        if family is None:
            family = families[name] = (help_text, [])
        family[1].append(f"{name}{_labels(labels)} {_number(value)}")

    for view in views:
        head: list[tuple[str, object]] = [("exchange", view.name), ("mode", view.mode)]
        add(
            "credit_shuffle_exchange_running",
            "1 while the exchange runs (samples within the last 10 s, its metrics not in), else 0",
            head,
            1.0 if view.state == "running" else 0.0,
        )
        values = view.figures()
        statuses: dict[str, list[str | None]] = {PRODUCER: [], CONSUMER: []}
        for (side, subtask, channel, metric), value in sorted(
            values.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] if kv[0][2] is not None else -1, kv[0][3])
        ):
            labels = [*head, ("side", side), ("subtask_index", subtask)]
            if channel is not None:
                labels.append(("channel", channel))
            add(metric_name(side, metric), _HELP.get(metric, metric), labels, value)
            if metric == "backPressuredTimeMsPerSecond" and channel is None:
                statuses[side].append(back_pressure_status(value))
        for side, found in statuses.items():
            level = worst(found)
            if level is not None:
                add(
                    "credit_shuffle_vertex_back_pressure_level",
                    "the most back-pressured subtask of a side: 0 OK (<= 10% of the time), 1 LOW (<= 50%), 2 HIGH",
                    [*head, ("side", side)],
                    float(_LEVEL[level]),
                )
    lines: list[str] = []
    for name, (help_text, samples) in families.items():
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} gauge")
        lines.extend(samples)
    return "\n".join(lines) + "\n"
