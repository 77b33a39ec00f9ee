"""A cluster of hosts with slots, all-to-all, on the virtual clock: the throughput a buffer timeout leaves, for
current Flink and for Flink 1.4 (the figure "throughput against buffer timeout" of Flink's network stack
article, "A Deep-Dive into Flink's Network Stack", flink.apache.org, 2019-06-05).

Every host runs ``slots`` producers and ``slots`` consumers; producer and consumer ``i`` are on host
``i // slots``; every producer writes round robin to every consumer (a consumer reads the producers of its
host directly, the others over one connection per host pair, 100 us latency). The producers write as fast as
their costs let them (the throughput is what the exchange allows, not an input rate), so what a timeout changes
is the number of buffers the same bytes take, and each buffer's cost.

The costs, from the package's own measurements (docs/benchmarks.md, "Pipelined path budget": CPU per 32 KiB
data buffer of the pipelined path with 2 tasks, producer 95.8 us, I/O thread 36.4 us, consumer 67.5 us; and
the task engine's ``take`` of one buffer, about 25 us, the simulation's default ``buffer_cost``):

- per buffer: 25 us at the consumer (:data:`BUFFER_COST`) and 25 us at the producer
  (:data:`PRODUCER_BUFFER_COST`, a flushed slice as a whole buffer);
- per record: the rest of each side's per-buffer figure spread over a full 32 KiB buffer's bytes, as rates:
  producer (95.8 - 25) us per 32 KiB = :data:`PRODUCER_RATE`, consumer (67.5 - 25) us per 32 KiB =
  :data:`CONSUMER_RATE`;
- Flink 1.4 (``flush_model="1.4"``): a flush finishes every open buffer, and every buffer handed over costs
  the I/O thread's 36.4 us more (:data:`NOTIFICATION_COST`, the network thread woken per buffer, where the
  pipelined runtime measured it per buffer).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from ..config import NetworkConfig
from ..errors import ConfigError, InsufficientNetworkBuffersError
from ..metrics import CONSUMER
from .model import Simulation
from .report import BYTES_IN_PER_SECOND

__all__ = [
    "BUFFER_COST",
    "CONSUMER_RATE",
    "FIGURE_TIMEOUTS_MS",
    "NOTIFICATION_COST",
    "PRODUCER_BUFFER_COST",
    "PRODUCER_RATE",
    "ProgressLine",
    "buffer_timeout_figure",
    "draw",
    "headline",
    "memory_warning",
    "network_memory_bytes",
    "print_table",
    "run_cluster",
    "steady_state_times",
]

log = logging.getLogger(__name__)

#: The buffer timeouts of the article's figure, in ms.
FIGURE_TIMEOUTS_MS = (0, 1, 5, 10, 100)
_SEGMENT = 32 * 1024
#: Consumer: seconds per data buffer besides its records (the task engine's ``take``).
BUFFER_COST = 25e-6
#: Producer: seconds per buffer handed to the network.
PRODUCER_BUFFER_COST = 25e-6
#: Producer: bytes per second of records, (95.8 - 25) us per 32 KiB buffer.
PRODUCER_RATE = _SEGMENT / ((95.8 - 25) * 1e-6)
#: Consumer: bytes per second of records, (67.5 - 25) us per 32 KiB buffer.
CONSUMER_RATE = _SEGMENT / ((67.5 - 25) * 1e-6)
#: Flink 1.4: seconds more per buffer handed over (the I/O thread's 36.4 us per buffer).
NOTIFICATION_COST = 36.4e-6
#: The extra network buffers a host gets where the default network memory does not hold its minimum.
EXTRA_BUFFERS_PER_HOST = 2048


class ProgressLine:
    """A progress line on ``stream`` at most every ``every`` wall seconds: virtual time done and the wall time
    left at the pace so far."""

    def __init__(self, duration: float, label: str = "", stream: TextIO | None = None, every: float = 5.0) -> None:
        self.duration = duration
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.started = time.perf_counter()
        self._last = self.started

    def __call__(self, now: float) -> None:
        wall = time.perf_counter()
        if wall - self._last < self.every or now <= 0:
            return
        self._last = wall
        elapsed = wall - self.started
        left = elapsed * (self.duration - now) / now
        print(
            f"{self.label}virtual {now:.3f} of {self.duration:g} s, wall {elapsed:.0f} s, about {left:.0f} s left",
            file=self.stream,
            flush=True,
        )


def run_cluster(
    hosts: int,
    slots: int,
    timeout_ms: int,
    *,
    flush_model: str = "1.5",
    duration: float = 0.05,
    warmup: float = 0.0,
    progress: Callable[[float], None] | None = None,
    producer_rate: float = PRODUCER_RATE,
    consumer_rate: float = CONSUMER_RATE,
    buffer_cost: float = BUFFER_COST,
    producer_buffer_cost: float = PRODUCER_BUFFER_COST,
    notification_cost: float = NOTIFICATION_COST,
) -> dict[str, Any]:
    """One run of the cluster at buffer timeout ``timeout_ms`` for ``duration`` virtual seconds: its figures
    (throughput over all consumers in MB per virtual second after the first ``warmup`` seconds, buffers and
    records received, bytes per buffer, wall seconds)."""
    if hosts < 1 or slots < 1:
        raise ConfigError("hosts", (hosts, slots), "at least 1 host and 1 slot")
    if not (duration > 0 and math.isfinite(duration)):
        raise ConfigError("duration", duration, "a finite time > 0 s")
    tasks = hosts * slots
    placement = [i // slots for i in range(tasks)]
    kwargs: dict[str, Any] = {
        "num_producers": tasks,
        "num_consumers": tasks,
        "producer_rate": producer_rate,
        "consumer_rate": consumer_rate,
        "producer_hosts": placement,
        "consumer_hosts": placement,
        "latency": 100e-6,
        "duration": duration,
        "buffer_cost": buffer_cost,
        "producer_buffer_cost": producer_buffer_cost,
        "flush_model": flush_model,
        "notification_cost": notification_cost,
        "progress": progress,
        "max_steps": 10**9,
        "warmup": warmup,
    }
    config = NetworkConfig(buffer_timeout_ms=timeout_ms)
    network = "default"
    start = time.perf_counter()
    try:
        simulation = Simulation(config, **kwargs)
        warn_if_short_of_memory(simulation)
        report = simulation.run()
    except InsufficientNetworkBuffersError:  # the default network memory does not hold what the host's tasks take
        network = f"minimum+{EXTRA_BUFFERS_PER_HOST}"
        simulation = Simulation(config, **kwargs, extra_buffers_per_host=EXTRA_BUFFERS_PER_HOST)
        warn_if_short_of_memory(simulation)
        report = simulation.run()
    wall = time.perf_counter() - start
    # The topology is garbage now, in reference cycles (its objects call back into each other) that only a full
    # collection frees: gigabytes at 800 tasks, collected before the next run builds its own.
    del simulation
    gc.collect()
    totals = {"numBytesIn": 0.0, "numBuffersIn": 0.0, "numRecordsIn": 0.0}
    throughput = 0.0  # bytes per virtual second over the window after the warm-up
    for row in report.rows:
        if row.side == CONSUMER:
            if row.metric in totals and row.channel is not None:
                totals[row.metric] += row.value
            elif row.metric == BYTES_IN_PER_SECOND:
                throughput += row.value
    buffers = int(totals["numBuffersIn"])
    return {
        "hosts": hosts,
        "slots": slots,
        "channels": tasks * tasks,
        "flush_model": flush_model,
        "timeout_ms": timeout_ms,
        "virtual_s": duration,
        "warmup_s": warmup,
        "network": network,
        "throughput_mb_s": round(throughput / 1e6, 1),
        "buffers": buffers,
        "records": int(totals["numRecordsIn"]),
        "bytes_per_buffer": round(totals["numBytesIn"] / buffers) if buffers else 0,
        "data_intact": report.data_intact,
        "wall_s": round(wall, 2),
    }


def network_memory_bytes(simulation: Simulation) -> int:
    """The bytes the simulation's network buffers take when every one holds a full segment: what a
    back-pressured all-to-all with full buffers (a long buffer timeout) comes near, since each buffer in flight
    holds its real Arrow bytes."""
    return sum(pool.total for pool in simulation.network_pools.values()) * simulation.config.segment_size


def _available_memory_bytes() -> int | None:
    """This machine's available memory (Linux ``MemAvailable``), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_warning(simulation: Simulation, available: int | None) -> str | None:
    """The warning for a simulation whose full network buffers would take more than ``available`` bytes
    (None: nothing to warn about, or the memory is unknown)."""
    need = network_memory_bytes(simulation)
    if available is None or need <= available:
        return None
    return (
        f"the simulation's {len(simulation.network_pools)} hosts have {need / 1e9:.1f} GB of network buffers, and "
        f"this machine has {available / 1e9:.1f} GB available: a run that fills them (full buffers, e.g. a long "
        "buffer timeout, back-pressured) may run out of memory; run fewer hosts or one timeout per process"
    )


def warn_if_short_of_memory(simulation: Simulation) -> None:
    """Log :func:`memory_warning` for this machine, before the run starts."""
    message = memory_warning(simulation, _available_memory_bytes())
    if message is not None:
        log.warning(message)


def buffer_timeout_figure(
    hosts: int,
    slots: int,
    *,
    timeouts_ms: Sequence[int] = FIGURE_TIMEOUTS_MS,
    flush_models: Sequence[str] = ("1.5", "1.4"),
    window: float = 0.05,
    progress: bool = True,
    stream: TextIO | None = None,
) -> list[dict[str, Any]]:
    """:func:`run_cluster` at every timeout for every flush model, each measured in its steady state (see
    :func:`steady_state_times`); each row also holds its throughput as a fraction of its model's largest
    timeout (``of_largest``)."""
    rows = []
    for model in flush_models:
        for timeout in timeouts_ms:
            warmup, duration = steady_state_times(timeout, window)
            line = ProgressLine(duration, f"[{model}, {timeout} ms] ", stream) if progress else None
            rows.append(
                run_cluster(hosts, slots, timeout, flush_model=model, duration=duration, warmup=warmup, progress=line)
            )
    for model in flush_models:
        own = [r for r in rows if r["flush_model"] == model]
        reference = max(own, key=lambda r: r["timeout_ms"])["throughput_mb_s"]
        for r in own:
            r["of_largest"] = round(r["throughput_mb_s"] / reference, 3) if reference else None
    return rows


def steady_state_times(timeout_ms: int, window: float) -> tuple[float, float]:
    """The warm-up and the duration, in virtual seconds, of a run at buffer timeout ``timeout_ms`` whose
    throughput is measured over at least ``window`` seconds of steady state: the warm-up and the window after it
    each last ``window`` or two timeouts, whichever is longer, so that the timeout fired twice before the window
    opens (buffers filled for the first time, pools and credits settled) and at least twice within it."""
    if not (window > 0 and math.isfinite(window)):
        raise ConfigError("window", window, "a finite time > 0 s")
    if timeout_ms < 0:
        raise ConfigError("timeout_ms", timeout_ms, "a timeout >= 0 ms")
    span = max(window, 2 * timeout_ms / 1000.0)
    return span, 2 * span


_COLUMNS = (
    "flush_model",
    "timeout_ms",
    "virtual_s",
    "throughput_mb_s",
    "of_largest",
    "buffers",
    "bytes_per_buffer",
    "wall_s",
)


def print_table(rows: Sequence[dict[str, Any]], stream: TextIO | None = None) -> None:
    out = stream if stream is not None else sys.stdout
    columns = [c for c in _COLUMNS if any(c in r for r in rows)]
    print(" ".join(f"{c:>16}" for c in columns), file=out)
    for r in rows:
        print(" ".join(f"{r.get(c)!s:>16}" for c in columns), file=out, flush=True)


def headline(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one JSON line: per flush model, throughput (MB/s) and fraction of the largest timeout's
    per timeout."""
    out: dict[str, Any] = {}
    for r in rows:
        entry = out.setdefault(f"flink_{r['flush_model']}", {})
        entry[f"{r['timeout_ms']}ms"] = {"mb_s": r["throughput_mb_s"], "of_largest": r.get("of_largest")}
    if rows:
        out["hosts"], out["slots"] = rows[0]["hosts"], rows[0]["slots"]
        out["virtual_s"] = {f"{r['timeout_ms']}ms": r["virtual_s"] for r in rows}
        out["warmup_s"] = {f"{r['timeout_ms']}ms": r["warmup_s"] for r in rows}
    return out


def draw(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Throughput against buffer timeout, one group of bars per timeout, one bar per flush model (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["flush_model"] for r in rows))
    timeouts = sorted({r["timeout_ms"] for r in rows})
    width = 0.8 / max(1, len(models))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, model in enumerate(models):
        by_timeout = {r["timeout_ms"]: r["throughput_mb_s"] for r in rows if r["flush_model"] == model}
        xs = [t + (i - (len(models) - 1) / 2) * width for t in range(len(timeouts))]
        label = "Flink 1.5+" if model == "1.5" else f"Flink {model}"
        ax.bar(xs, [by_timeout.get(t, 0.0) for t in timeouts], width, label=label)
    ax.set_xticks(range(len(timeouts)), [f"{t} ms" for t in timeouts])
    ax.set_xlabel("buffer timeout")
    ax.set_ylabel("throughput, MB per virtual second (all consumers)")
    first = rows[0] if rows else {}
    ax.set_title(
        f"Simulated: {first.get('hosts')} hosts x {first.get('slots')} slots all-to-all\nsteady state: at least "
        f"{min(r['virtual_s'] - r['warmup_s'] for r in rows):g} virtual s after a warm-up"
        if rows
        else "Simulated"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def dumps(figures: dict[str, Any]) -> str:
    return json.dumps(figures, separators=(", ", ": "))
