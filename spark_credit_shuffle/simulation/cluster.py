"""A cluster of hosts with slots, all-to-all, on the virtual clock: the throughput a buffer timeout leaves, for
current Flink and for Flink 1.4 (the figure "throughput against buffer timeout" of Flink's network stack
article, "A Deep-Dive into Flink's Network Stack", flink.apache.org, 2019-06-05).

Every host runs ``slots`` producers and ``slots`` consumers; producer and consumer ``i`` are on host
``i // slots``; every producer writes round robin to every consumer (a consumer reads the producers of its
host directly, the others over one connection per host pair, 100 us latency). The producers write as fast as
their costs let them (the throughput is what the exchange allows, not an input rate), so what a timeout changes
is the number of buffers the same bytes take, and each buffer's cost.

The threads, as Flink's (``threading="netty"``, the default): a producer's task thread writes records into
segments; each host's ``slots`` network threads (Netty's server threads, Flink's default one per slot, a host's
connections dealt to them round robin) cut the slices and send them, each taking a subpartition's next slice
only when it is free, so under load a flushed buffer keeps filling until a thread takes it (the article: "in
high-load scenarios where Netty is the bottleneck ... we can still accumulate data in incomplete buffers");
the output flusher is a thread of its own. ``threading="loop"`` is this package's runtime instead: one loop per
task builds and sends every buffer itself, so the producer pays for every slice a flush hands over.

The costs, from the package's own measurements (docs/benchmarks.md, "Pipelined path budget": CPU per 32 KiB
data buffer of the pipelined path with 2 tasks, producer 95.8 us, I/O thread 36.4 us, consumer 67.5 us; and
the task engine's ``take`` of one buffer, about 25 us, the simulation's default ``buffer_cost``), each used once:

- per buffer: 25 us at the consumer (:data:`BUFFER_COST`) and 25 us at the producer per segment it fills
  (:data:`PRODUCER_BUFFER_COST`; with ``"loop"``, per buffer or slice handed over);
- per record: the rest of each side's per-buffer figure spread over a full 32 KiB buffer's bytes, as rates:
  producer (95.8 - 25) us per 32 KiB = :data:`PRODUCER_RATE`, consumer (67.5 - 25) us per 32 KiB =
  :data:`CONSUMER_RATE`;
- per message a network thread sends: the I/O thread's 36.4 us (:data:`SENDER_COST`);
- per wake-up of a network thread by the task thread: the same 36.4 us (:data:`NOTIFICATION_COST`). Flink 1.5
  wakes it when a flush makes a caught-up queue readable again (buffer timeout 0 flushes after every record;
  the output flusher's flushes cost the task nothing); Flink 1.4 (``flush_model="1.4"``) for every buffer added,
  and its flush finishes every open buffer.
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
from .report import BYTES_IN_PER_SECOND, RECORDS_IN_PER_SECOND

__all__ = [
    "BUFFER_COST",
    "CONSUMER_RATE",
    "FIGURE_TIMEOUTS_MS",
    "NOTIFICATION_COST",
    "PRODUCER_BUFFER_COST",
    "PRODUCER_RATE",
    "SENDER_COST",
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
#: Bytes per record. The figure's throughput counts the records' bytes, not the buffers' (whose Arrow framing
#: grows with the number of buffers, so counting it would flatter the short timeouts).
RECORD_SIZE = 1024
#: Consumer: seconds per data buffer besides its records (the task engine's ``take``).
BUFFER_COST = 25e-6
#: Producer: seconds per buffer handed to the network.
PRODUCER_BUFFER_COST = 25e-6
#: Producer: bytes per second of records, (95.8 - 25) us per 32 KiB buffer.
PRODUCER_RATE = _SEGMENT / ((95.8 - 25) * 1e-6)
#: Consumer: bytes per second of records, (67.5 - 25) us per 32 KiB buffer.
CONSUMER_RATE = _SEGMENT / ((67.5 - 25) * 1e-6)
#: A wake-up of the network thread: Flink 1.4 per buffer added, Flink 1.5 per notification a flush of the task
#: thread raises (the I/O thread's 36.4 us per buffer).
NOTIFICATION_COST = 36.4e-6
#: A network thread (Flink's threads): seconds per message it sends (the I/O thread's 36.4 us per buffer).
SENDER_COST = 36.4e-6
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
    threading: str = "netty",
    sender_cost: float = SENDER_COST,
) -> dict[str, Any]:
    """One run of the cluster at buffer timeout ``timeout_ms`` for ``duration`` virtual seconds: its figures
    (throughput over all consumers after the first ``warmup`` seconds in MB of records per virtual second, and
    ``wire_mb_s`` in MB of buffers with their framing, buffers and
    records received, bytes per buffer, wall seconds). ``threading``: ``"netty"`` (Flink's threads, ``slots``
    network threads per host, ``sender_cost`` per message each) or ``"loop"`` (this package's runtime: the
    producer's loop builds and sends every buffer itself); see :class:`~.model.Simulation`."""
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
        "record_size": RECORD_SIZE,
        "duration": duration,
        "buffer_cost": buffer_cost,
        "producer_buffer_cost": producer_buffer_cost,
        "flush_model": flush_model,
        "notification_cost": notification_cost,
        "progress": progress,
        "max_steps": 10**9,
        "warmup": warmup,
        "threading": threading,
        "sender_cost": sender_cost,
        "network_threads": slots if threading == "netty" else None,
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
    throughput = 0.0  # records' bytes per virtual second over the window after the warm-up
    wire = 0.0  # the buffers' bytes (with their framing) per virtual second over the window
    for row in report.rows:
        if row.side == CONSUMER:
            if row.metric in totals and row.channel is not None:
                totals[row.metric] += row.value
            elif row.metric == RECORDS_IN_PER_SECOND:
                throughput += row.value * RECORD_SIZE
            elif row.metric == BYTES_IN_PER_SECOND:
                wire += row.value
    buffers = int(totals["numBuffersIn"])
    return {
        "hosts": hosts,
        "slots": slots,
        "channels": tasks * tasks,
        "flush_model": flush_model,
        "threading": threading,
        "timeout_ms": timeout_ms,
        "virtual_s": duration,
        "warmup_s": warmup,
        "network": network,
        "throughput_mb_s": round(throughput / 1e6, 1),
        "wire_mb_s": round(wire / 1e6, 1),
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
    threading: str = "netty",
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
                run_cluster(
                    hosts,
                    slots,
                    timeout,
                    flush_model=model,
                    duration=duration,
                    warmup=warmup,
                    progress=line,
                    threading=threading,
                )
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


_THREADING = {"netty": "Flink's threads", "loop": "one loop per task"}

_COLUMNS = (
    "flush_model",
    "timeout_ms",
    "virtual_s",
    "throughput_mb_s",
    "of_largest",
    "wire_mb_s",
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
        out["threading"] = rows[0].get("threading")
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
    ax.set_ylabel("records, MB per virtual second (all consumers)")
    first = rows[0] if rows else {}
    threads = str(first.get("threading"))
    ax.set_title(
        f"Simulated ({_THREADING.get(threads, threads)}): {first.get('hosts')} hosts x "
        f"{first.get('slots')} slots all-to-all\nsteady state: at least "
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
