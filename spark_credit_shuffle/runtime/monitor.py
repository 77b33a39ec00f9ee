"""The live monitor: timeline samples from the tasks of a running exchange to the driver, as they are taken.

Flink's web UI shows back pressure while a job runs; Spark shows its progress bar and nothing of the
exchange. With ``exchange(..., monitor=True)`` (or ``spark.creditShuffle.monitor=true``) every task of the
exchange, in either mode, sends the timeline samples it records (the rows ``Exchange.timeline()`` returns
after the action) to a small service on the driver about once a second, and the driver prints one line per
exchange every :data:`PRINT_INTERVAL_S` to stderr, as Spark prints its progress bar; ``monitor=callable``
hands the samples to that function instead, as they arrive (on a thread of its own, so a slow callback
drops old samples rather than holding the service up).

**Channel.** One listener per driver process (:class:`MonitorService`, one thread over an
:class:`~spark_credit_shuffle.transport.event_loop.EventLoop`). A task opens one connection and writes
lines ``<mac> <json>``: the JSON names the exchange's key, the task attempt, a sequence number and the rows;
the mac is HMAC-SHA256 of the JSON under the exchange's secret, so the secret never travels, a line from
anyone without it is refused, and a replayed line (a sequence number not above the attempt's last) too.
Lines are bounded (:data:`MAX_LINE`), and so are the connections (:data:`MAX_CONNECTIONS`, the oldest
closed first); a connection that sends a bad line is closed. Metric rows carry no user data.

**Tasks.** :class:`MonitorClient` queues what the task's timeline sampler records and a thread of its own
sends it, so that no thread of the exchange ever waits for the driver; if the driver cannot be reached the
client says so once in the task's log and drops samples from then on: monitoring never fails an exchange.
Its thread is joined before the task ends (Spark reuses Python workers).

Spark Connect: the driver is a remote server whose Python process this package does not run in, so tasks
cannot reach the client; the exchange says so once and the metrics come after the action, as without a
monitor.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import json
import logging
import queue
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TextIO

from ..metrics import CONSUMER, METRIC_ROW_FIELDS, PRODUCER, MetricRow
from ..transport.connection import resolve_host
from ..transport.event_loop import EventLoop, ServicesByHost

__all__ = [
    "EXCHANGE_TTL_S",
    "MAX_CONNECTIONS",
    "MAX_LINE",
    "PRINT_INTERVAL_S",
    "SEND_INTERVAL_S",
    "Monitor",
    "MonitorAddress",
    "MonitorClient",
    "MonitorService",
    "driver_monitor",
    "task_monitor",
    "watch",
]

log = logging.getLogger("spark_credit_shuffle")

#: The longest line the service reads; a task splits what it has into lines under it.
MAX_LINE = 1 << 20
#: Connections the service keeps open at once (one per running task); one more closes the oldest.
MAX_CONNECTIONS = 512
#: How often a task sends what it sampled.
SEND_INTERVAL_S = 1.0
#: How often the driver prints a line per exchange that got samples since its last line.
PRINT_INTERVAL_S = 3.0
#: Samples a callback may be behind before the oldest are dropped.
_CALLBACK_BACKLOG = 256
#: How long the thread that calls a callback waits for more samples before it ends.
_DISPATCH_IDLE_S = 5.0
#: How long the service keeps an exchange's key after its last sample (or its registration).
EXCHANGE_TTL_S = 600.0


def _mac(secret: bytes, body: bytes) -> str:
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class MonitorAddress:
    """Where a task sends its samples: the driver's service and the exchange's key and secret (shipped
    with the tasks, as the exchange's other secret is)."""

    host: str
    port: int
    key: str
    secret: bytes


class Monitor:
    """The driver's view of one exchange while it runs: the latest sample of every subtask, a line to
    stderr every :data:`PRINT_INTERVAL_S` (``print_to``; None prints nothing) and the samples handed to
    ``callback`` as they arrive."""

    def __init__(
        self, name: str, callback: Callable[[list[MetricRow]], Any] | None = None, print_to: TextIO | None = None
    ) -> None:
        self.name = name
        self.print_to = print_to
        self.num_samples = 0
        self._latest: dict[tuple[str, int], dict[str, float]] = {}
        self._started: float | None = None
        self._last_print = 0.0
        self._news = False
        self._lock = threading.Lock()
        self._callback = callback
        self._queue: queue.Queue[list[MetricRow]] | None = queue.Queue(_CALLBACK_BACKLOG) if callback else None
        self._dispatching = False  # a thread hands the queued samples to the callback (while any come)

    def accept(self, rows: list[MetricRow]) -> None:
        """Samples of one task (service thread)."""
        with self._lock:
            if self._started is None:
                self._started = time.monotonic()
            for r in rows:
                if r.channel is None:
                    self._latest.setdefault((r.side, r.subtask), {})[r.metric] = r.value
            self.num_samples += len({r.time_ms for r in rows})
            self._news = True
        if self._queue is not None:
            while True:
                try:
                    self._queue.put_nowait(rows)
                    break
                except queue.Full:  # the callback is behind: drop the oldest samples
                    with contextlib.suppress(queue.Empty):
                        self._queue.get_nowait()
            with self._lock:
                if not self._dispatching:
                    self._dispatching = True
                    name = f"credit-shuffle-monitor-{self.name}"
                    threading.Thread(target=self._dispatch, name=name, daemon=True).start()

    def _dispatch(self) -> None:
        """Hand queued samples to the callback; end once none came for :data:`_DISPATCH_IDLE_S` (the next
        sample starts a thread again), so that an exchange that ran keeps no thread."""
        assert self._queue is not None and self._callback is not None
        while True:
            try:
                rows = self._queue.get(timeout=_DISPATCH_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._dispatching = False
                        return
                continue
            try:
                self._callback(rows)
            except Exception:  # a user's callback: its failure must not stop the others
                log.exception("%s: the monitor callback raised", self.name)

    def tick(self, now: float) -> None:
        """Print the exchange's line if one is due and samples came since the last (service thread)."""
        if self.print_to is None or not self._news or now - self._last_print < PRINT_INTERVAL_S:
            return
        line = self.line(now)
        self._last_print = now
        self._news = False
        with contextlib.suppress(Exception):
            print(line, file=self.print_to, flush=True)

    def line(self, now: float | None = None) -> str:
        """The exchange's state as the last samples tell it, in one line."""
        now = time.monotonic() if now is None else now
        with self._lock:
            latest = {k: dict(v) for k, v in self._latest.items()}
            started = self._started if self._started is not None else now
        producers = {s: v for (side, s), v in latest.items() if side == PRODUCER}
        consumers = {s: v for (side, s), v in latest.items() if side == CONSUMER}
        rows_in = sum(v.get("numRecordsIn", 0.0) for v in consumers.values())
        rows_out = sum(v.get("numRecordsOut", 0.0) for v in producers.values())
        buffers_out = sum(v.get("numBuffersOut", 0.0) for v in producers.values())
        pressured = sorted(s for s, v in producers.items() if v.get("isBackPressured", 0.0) >= 1.0)
        moved = f"{rows_out:,.0f} rows out in {buffers_out:,.0f} buffers, {rows_in:,.0f} in"
        parts = [f"[{self.name} {now - started:.0f} s] {moved}"]
        if producers:
            parts.append(f"back-pressured producers: {', '.join(map(str, pressured)) or 'none'} of {len(producers)}")
        if len(consumers) > 1:
            slowest = min(consumers, key=lambda s: (consumers[s].get("numRecordsInPerSecond", 0.0), s))
            rate = consumers[slowest].get("numRecordsInPerSecond", 0.0)
            parts.append(f"slowest consumer {slowest} ({rate:,.0f} rows/s)")
        out_pool = max((v.get("outPoolUsage", 0.0) for v in producers.values()), default=None)
        in_pool = max((v.get("inPoolUsage", 0.0) for v in consumers.values()), default=None)
        pools = [
            f"{name} max {value:.2f}"
            for name, value in (("outPool", out_pool), ("inPool", in_pool))
            if value is not None
        ]
        if pools:
            parts.append(", ".join(pools))
        return "; ".join(parts)


class _Peer:
    __slots__ = ("buffer", "opened", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.opened = time.monotonic()


class MonitorService:
    """The driver's listener for the samples of running exchanges (see the module documentation)."""

    def __init__(self, host: str) -> None:
        self._loop = EventLoop(host, 0, backlog=128)
        self._exchanges: dict[str, tuple[bytes, Monitor]] = {}
        self._last_used: dict[str, float] = {}  # key -> when it was registered or last sent a sample
        self._last_seq: dict[tuple[str, int], int] = {}
        self._peers: collections.OrderedDict[socket.socket, _Peer] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._stopping = False
        self.num_rejected = 0
        self._thread = threading.Thread(target=self._run, name="credit-shuffle-monitor-service", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._loop.address

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def register(self, name: str, monitor: Monitor) -> MonitorAddress:
        """Take samples for exchange ``name`` from now on; the address its tasks send them to."""
        secret = secrets.token_bytes(32)
        key = f"{name}/{secrets.token_hex(8)}"
        with self._lock:
            self._exchanges[key] = (secret, monitor)
            self._last_used[key] = time.monotonic()
        host, port = self.address
        return MonitorAddress(host, port, key, secret)

    def close(self) -> None:
        self._stopping = True
        self._loop.wakeup(force=True)
        self._thread.join(5.0)

    # -- the service thread --

    def _run(self) -> None:
        try:
            while not self._stopping:
                acceptable, ready = self._loop.poll(0.5)
                for peer, _ in ready:
                    self._read(peer)
                if acceptable:
                    self._accept()
                now = time.monotonic()
                with self._lock:
                    for key in [k for k, used in self._last_used.items() if now - used > EXCHANGE_TTL_S]:
                        del self._exchanges[key], self._last_used[key]
                        self._last_seq = {k: v for k, v in self._last_seq.items() if k[0] != key}
                    monitors = [m for _, m in self._exchanges.values()]
                for monitor in monitors:
                    monitor.tick(now)
        finally:
            for peer in list(self._peers.values()):
                self._close(peer)
            self._loop.close()

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._loop.listener.accept()
            except (BlockingIOError, OSError):
                return
            sock.setblocking(False)
            peer = _Peer(sock)
            self._peers[sock] = peer
            self._loop.selector.register(sock, selectors.EVENT_READ, peer)
            while len(self._peers) > MAX_CONNECTIONS:
                self._close(next(iter(self._peers.values())))

    def _close(self, peer: _Peer) -> None:
        self._peers.pop(peer.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._loop.selector.unregister(peer.sock)
        with contextlib.suppress(OSError):
            peer.sock.close()

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(peer)
            return
        peer.buffer += data
        while True:
            end = peer.buffer.find(b"\n")
            if end < 0:
                if len(peer.buffer) > MAX_LINE:
                    self._reject(peer, "a line over the limit")
                return
            line = bytes(peer.buffer[:end])
            del peer.buffer[: end + 1]
            if not self._take(line):
                self._reject(peer, "a line that does not authenticate")
                return

    def _reject(self, peer: _Peer, why: str) -> None:
        self.num_rejected += 1
        if self.num_rejected == 1 or self.num_rejected % 100 == 0:
            log.warning("monitor service: closing a connection that sent %s (%d so far)", why, self.num_rejected)
        self._close(peer)

    def _take(self, line: bytes) -> bool:
        """Verify and deliver one line; False if it does not authenticate or is malformed."""
        mac, _, body = line.partition(b" ")
        try:
            message = json.loads(body)
            key = str(message["key"])
            attempt, seq = int(message["attempt"]), int(message["seq"])
            with self._lock:
                secret, monitor = self._exchanges[key]
            if not hmac.compare_digest(mac.decode("ascii"), _mac(secret, body)):
                return False
            if seq <= self._last_seq.get((key, attempt), -1):
                return False  # replayed
            self._last_seq[(key, attempt)] = seq
            self._last_used[key] = time.monotonic()
            rows = [MetricRow(*row) for row in message["rows"]]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return False
        if rows:
            monitor.accept(rows)
        return True


def driver_monitor(host: str) -> MonitorService:
    """The monitor service of this driver process listening on ``host`` (started on first use)."""
    return _SERVICES.get(host)


class MonitorClient:
    """A task's side of the live monitor: :meth:`publish` the rows of each timeline sample (any thread);
    a thread of the client's own sends them every :data:`SEND_INTERVAL_S`; :meth:`close` sends the rest and
    joins it."""

    def __init__(self, address: MonitorAddress, attempt: int) -> None:
        self.address = address
        self.attempt = attempt
        self._rows: list[MetricRow] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._seq = 0
        self._sock: socket.socket | None = None
        self._broken = False
        self._thread = threading.Thread(target=self._run, name="credit-shuffle-monitor", daemon=True)
        self._thread.start()

    def publish(self, rows: Iterable[MetricRow]) -> None:
        if not self._broken:
            with self._lock:
                self._rows.extend(rows)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is left and stop (within ``timeout_s``)."""
        self._done.set()
        self._thread.join(timeout_s)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()

    def _run(self) -> None:
        while not self._done.wait(SEND_INTERVAL_S):
            self._send()
        self._send()

    def _send(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        if not rows or self._broken:
            return
        try:
            if self._sock is None:
                self._sock = socket.create_connection((self.address.host, self.address.port), timeout=1.0)
            for line in self._lines(rows):
                self._sock.sendall(line)
        except OSError as exc:
            self._broken = True
            log.info("live monitor: cannot reach the driver at %s:%d (%s); no more samples from this task",
                     self.address.host, self.address.port, exc)  # fmt: skip

    def _lines(self, rows: list[MetricRow]) -> Iterable[bytes]:
        fields = METRIC_ROW_FIELDS
        chunk = 2000  # rows per line: well under MAX_LINE
        for start in range(0, len(rows), chunk):
            body = json.dumps(
                {
                    "key": self.address.key,
                    "attempt": self.attempt,
                    "seq": self._seq,
                    "rows": [[getattr(r, f) for f in fields] for r in rows[start : start + chunk]],
                },
                separators=(",", ":"),
            ).encode()
            self._seq += 1
            yield _mac(self.address.secret, body).encode() + b" " + body + b"\n"


def watch(client: MonitorClient, engine: Any) -> None:
    """Send every timeline sample ``engine`` (a producer or consumer engine) takes through ``client``, with
    the engine's counters so far (its ``progress``: records, buffers and bytes, as ``sample`` rows)."""

    def listener(sample: list[MetricRow]) -> None:
        client.publish([*sample, *engine.progress(sample[0].time_ms if sample else None)])

    engine.timeline.listener = listener


def task_monitor(address: MonitorAddress | None) -> MonitorClient | None:
    """The live monitor's sender of the Spark task this runs in, if the exchange has a monitor."""
    if address is None:
        return None
    from pyspark import TaskContext

    context = TaskContext.get()
    return MonitorClient(address, context.taskAttemptId() if context is not None else 0)


_SERVICES: ServicesByHost[MonitorService] = ServicesByHost(MonitorService, resolve_host)
