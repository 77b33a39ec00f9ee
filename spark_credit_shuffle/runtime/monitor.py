"""The live monitor: timeline samples from the tasks of a running exchange to the driver, as they are taken.

Flink's web UI shows back pressure while a job runs; Spark shows its progress bar and nothing of the
exchange. With ``exchange(..., monitor=True)`` (or ``spark.creditShuffle.monitor=true``) every task of the
exchange, in either mode, sends the timeline samples it records (the rows ``Exchange.timeline()`` returns
after the action) to a small service on the driver about once a second, and the driver prints one line per
exchange every :data:`PRINT_INTERVAL_S` to stderr, as Spark prints its progress bar; ``monitor=callable``
hands the samples to that function instead, as they arrive (on a thread of its own, so a slow callback
drops old samples rather than holding the service up).

**Channel.** One listener per driver process (:class:`MonitorService`, a
:class:`~spark_credit_shuffle.transport.line_service.LineService`: one thread, the deadlines, caps and
bounds that module describes). A task opens one connection and writes lines ``<key> <mac> <json>``: the key
selects the exchange's secret, the mac is HMAC-SHA256 of the JSON's raw bytes under it (so the secret never
travels), and the service verifies it before it parses any of the JSON, then parses within bounds of size
and nesting; the JSON repeats the key and names the task attempt, a sequence number and the rows. A line
from anyone without the secret is refused, and a replayed line (a sequence number not above the attempt's
last) too. A connection's first line carries no rows, must come within :data:`AUTH_TIMEOUT_S` of its
accept and fit :data:`MAX_FIRST_LINE`; later lines come within :data:`IDLE_TIMEOUT_S` of the one before (a
task sends an empty one every :data:`KEEPALIVE_S` at least) and fit :data:`MAX_LINE`. At most
:data:`MAX_CONNECTIONS` are open and :data:`MAX_UNAUTHENTICATED` wait for their first line: one more
closes the oldest of those, never a task's authenticated connection. A connection that sends a bad line is
closed. Metric rows carry no user data.

**Tasks.** :class:`MonitorClient` queues what the task's timeline sampler records and a thread of its own
sends it, so that no thread of the exchange ever waits for the driver; if the driver cannot be reached the
client says so once in the task's log and drops samples from then on: monitoring never fails an exchange.
Its thread is joined before the task ends (Spark reuses Python workers).

Spark Connect: the driver is a remote server whose Python process this package does not run in, so tasks
cannot reach the client; the exchange says so once and the metrics come after the action, as without a
monitor.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import queue
import re
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TextIO

from ..diagnosis import Load, find_origin
from ..metrics import CONSUMER, METRIC_ROW_FIELDS, PRODUCER, MetricRow
from ..transport.connection import resolve_host
from ..transport.event_loop import ServicesByHost
from ..transport.line_service import LinePeer, LineService, Rejected, parse_bounded

__all__ = [
    "AUTH_TIMEOUT_S",
    "EXCHANGE_TTL_S",
    "IDLE_TIMEOUT_S",
    "KEEPALIVE_S",
    "MAX_CONNECTIONS",
    "MAX_FIRST_LINE",
    "MAX_LINE",
    "MAX_UNAUTHENTICATED",
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

#: The longest line the service reads from an authenticated connection; a task splits what it has into lines
#: under it.
MAX_LINE = 1 << 20
#: The longest first line of a connection, read before it authenticated (a task's carries no rows: about 200
#: bytes), so that a connection without the secret holds at most this much of the driver's memory.
MAX_FIRST_LINE = 4096
#: Connections the service keeps open at once (one per running task).
MAX_CONNECTIONS = 512
#: Connections that may wait for their first line at once; one more closes the oldest of them.
MAX_UNAUTHENTICATED = 64
#: From a connection's accept to its first line (which a task sends as it connects).
AUTH_TIMEOUT_S = 5.0
#: From an authenticated connection's last line to its close.
IDLE_TIMEOUT_S = 60.0
#: The longest a task's connection stays without a line: then it sends one without rows.
KEEPALIVE_S = 15.0
#: Connections a task's sender opens again after the service closed one, before it gives up.
_MAX_RECONNECTS = 3
#: What a key may hold: it goes on the wire before the mac, up to the first space.
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
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
        self,
        name: str,
        callback: Callable[[list[MetricRow]], Any] | None = None,
        print_to: TextIO | None = None,
        *,
        producers: int | None = None,
        consumers: int | None = None,
    ) -> None:
        self.name = name
        self.print_to = print_to
        #: The exchange's subtasks, where known: the line counts against them, not against those sampled so far.
        self.producers, self.consumers = producers, consumers
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
        pressured = sorted(
            s
            for s, v in producers.items()
            if v.get("isBackPressured", 0.0) >= 1.0 or v.get("backPressuredTimeMsPerSecond", 0.0) > 100.0
        )
        moved = f"{rows_out:,.0f} rows out in {buffers_out:,.0f} buffers, {rows_in:,.0f} in"
        parts = [f"[{self.name} {now - started:.0f} s] {moved}"]
        if producers:
            total = max(self.producers or 0, len(producers))
            which = f" ({', '.join(map(str, pressured))})" if pressured else ""
            parts.append(f"back-pressured producers: {len(pressured)} of {total}{which}")
        if pressured and consumers:
            parts.append(_origin_text(consumers))
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


def _origin_text(consumers: dict[int, dict[str, float]]) -> str:
    """Where the producers' backpressure starts, from the consumers' latest samples, as Flink finds it: the
    consumer that is busy and not back-pressured (the rule of :func:`~spark_credit_shuffle.diagnosis.find_origin`)."""
    loads = [
        Load(
            CONSUMER,
            s,
            v.get("busyTimeMsPerSecond"),
            v.get("idleTimeMsPerSecond"),
            v.get("backPressuredTimeMsPerSecond"),
        )
        for s, v in sorted(consumers.items())
    ]
    origin = find_origin(loads)
    load = origin.load
    if origin.kind == "consumer" and load is not None:
        return f"backpressure from consumer {load.subtask} (busy {load.busy or 0.0:.0f} ms/s)"
    if origin.kind == "downstream" and load is not None:
        return (
            f"backpressure from the step after consumer {load.subtask} "
            f"(back-pressured on its output {load.back_pressured or 0.0:.0f} ms/s)"
        )
    if origin.kind == "downstream":
        return "backpressure from the step after the exchange (every consumer back-pressured on its output)"
    busy = [v.busy for v in loads if v.busy is not None]
    span = f" (busy {min(busy):.0f}-{max(busy):.0f} ms/s)" if busy else ""
    return f"backpressure spread over the consumers{span}"


class MonitorService(LineService):
    """The driver's listener for the samples of running exchanges (see the module documentation): a
    :class:`~spark_credit_shuffle.transport.line_service.LineService` whose lines are ``<key> <mac> <json>``,
    each verified before it is parsed. ``port`` 0: a free one; the deadlines and caps default to the module's
    constants."""

    label = "monitor service"

    def __init__(
        self,
        host: str,
        *,
        port: int = 0,
        auth_timeout_s: float = AUTH_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_unauthenticated: int = MAX_UNAUTHENTICATED,
    ) -> None:
        super().__init__(
            host,
            port=port,
            auth_timeout_s=auth_timeout_s,
            idle_timeout_s=idle_timeout_s,
            max_connections=max_connections,
            max_unauthenticated=max_unauthenticated,
            first_line_limit=MAX_FIRST_LINE,
            line_limit=MAX_LINE,
            thread_name="credit-shuffle-monitor-service",
        )
        self._exchanges: dict[str, tuple[bytes, Monitor]] = {}
        self._last_used: dict[str, float] = {}  # key -> when it was registered or last sent a sample
        self._last_seq: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self._failed_monitors: set[str] = set()  # monitors whose failure was logged
        self._start()

    def _successor(self, host: str, port: int) -> MonitorService:
        successor = MonitorService(
            host,
            port=port,
            auth_timeout_s=self.auth_timeout_s,
            idle_timeout_s=self.idle_timeout_s,
            max_connections=self.max_connections,
            max_unauthenticated=self.max_unauthenticated,
        )
        with self._lock:
            exchanges, used, seq = dict(self._exchanges), dict(self._last_used), dict(self._last_seq)
        with successor._lock:
            successor._exchanges.update(exchanges)
            successor._last_used.update(used)
            successor._last_seq.update(seq)
        return successor

    def register(self, name: str, monitor: Monitor) -> MonitorAddress:
        """Take samples for exchange ``name`` from now on; the address its tasks send them to."""
        secret = secrets.token_bytes(32)
        key = f"{_KEY_UNSAFE.sub('_', name)[:64]}/{secrets.token_hex(8)}"
        with self._lock:
            self._exchanges[key] = (secret, monitor)
            self._last_used[key] = time.monotonic()
        self.wakeup()
        host, port = self.address
        return MonitorAddress(host, port, key, secret)

    # -- the service thread --

    def on_line(self, peer: LinePeer, line: bytes) -> None:
        """Verify one line over its raw bytes, then parse it and hand its rows to the exchange's monitor."""
        key, mac, body = _split_line(line)
        if peer.data is not None and key != peer.data:
            raise Rejected("a line under another key than its connection's first", "key changed")
        with self._lock:
            known = self._exchanges.get(key)
        if known is None:
            raise Rejected(f"a line for an unknown key {key[:80]!r}", "unknown key")
        secret, monitor = known
        if not hmac.compare_digest(mac, hmac.new(secret, body, hashlib.sha256).digest()):
            raise Rejected("a line that does not authenticate", "wrong mac")
        try:
            message = parse_bounded(body, max_bytes=MAX_LINE)
            if message["key"] != key:
                raise ValueError("the key inside is not the line's")
            attempt, seq = int(message["attempt"]), int(message["seq"])
            rows = [MetricRow(*row) for row in message["rows"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise Rejected(f"a malformed line ({type(exc).__name__}: {str(exc)[:200]})", "malformed line") from None
        if seq <= self._last_seq.get((key, attempt), -1):
            raise Rejected(f"a replayed line (sequence number {seq} of attempt {attempt})", "replayed line")
        self._last_seq[(key, attempt)] = seq
        with self._lock:
            self._last_used[key] = time.monotonic()
        if not peer.authenticated:
            self.authenticate(peer)
            peer.data = key
        if rows:
            try:
                monitor.accept(rows)
            except Exception:  # the driver's own view of the exchange: its failure is no peer's fault
                if key not in self._failed_monitors:
                    self._failed_monitors.add(key)
                    log.exception("monitor service: the monitor of %s failed to take samples", monitor.name)

    def on_round(self, now: float) -> float | None:
        """Forget keys unused for :data:`EXCHANGE_TTL_S`; let every monitor print its line when due."""
        with self._lock:
            for key in [k for k, used in self._last_used.items() if now - used > EXCHANGE_TTL_S]:
                del self._exchanges[key], self._last_used[key]
                self._last_seq = {k: v for k, v in self._last_seq.items() if k[0] != key}
            monitors = [(key, m) for key, (_, m) in self._exchanges.items()]
            forget_at = min(self._last_used.values(), default=None)
        for key, monitor in monitors:
            try:
                monitor.tick(now)
            except Exception:  # one exchange's line: the others and the service go on
                if key not in self._failed_monitors:
                    self._failed_monitors.add(key)
                    log.exception("monitor service: the monitor of %s failed to print its line", monitor.name)
        if monitors:
            return now + 0.5
        return None if forget_at is None else forget_at + EXCHANGE_TTL_S


def _split_line(line: bytes) -> tuple[str, bytes, bytes]:
    """(key, mac, JSON bytes) of a line ``<key> <mac> <json>``, nothing of the JSON parsed."""
    parts = line.split(b" ", 2)
    if len(parts) != 3:
        raise Rejected("a line that is not <key> <mac> <json>", "malformed line")
    try:
        key = parts[0].decode("ascii")
        mac = bytes.fromhex(parts[1].decode("ascii"))
    except ValueError:
        raise Rejected("a line whose key or mac is not ASCII hex", "malformed line") from None
    if len(mac) != hashlib.sha256().digest_size:
        raise Rejected(f"a mac of {len(mac)} bytes", "malformed line")
    return key, mac, parts[2]


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
        self._last_sent = 0.0
        self._reconnects = 0
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
        now = time.monotonic()
        if self._broken or (not rows and (self._sock is None or now - self._last_sent < KEEPALIVE_S)):
            return
        where = f"{self.address.host}:{self.address.port}"
        if self._sock is not None and _closed_by_peer(self._sock):  # the service closed it (restarted, idle)
            self._drop_connection()
        if self._sock is None:
            try:
                self._sock = socket.create_connection((self.address.host, self.address.port), timeout=1.0)
                self._sock.sendall(self._line([]))  # the first line authenticates the connection: no rows
            except OSError as exc:
                self._broken = True
                self._drop_connection()
                log.info("live monitor: cannot reach the driver at %s (%s); no more samples from this task", where, exc)
                return
        try:
            for line in self._lines(rows) if rows else [self._line([])]:
                self._sock.sendall(line)
        except OSError as exc:  # the service closed the connection: the next round opens another
            self._drop_connection()
            self._reconnects += 1
            if self._reconnects >= _MAX_RECONNECTS:
                self._broken = True
                log.info(
                    "live monitor: the driver at %s closed this task's connection %d times (%s); no more samples "
                    "from this task",
                    where,
                    self._reconnects,
                    exc,
                )
            return
        self._last_sent = now
        self._reconnects = 0

    def _drop_connection(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None

    def _lines(self, rows: list[MetricRow]) -> Iterable[bytes]:
        chunk = 2000  # rows per line: well under MAX_LINE
        for start in range(0, len(rows), chunk):
            yield self._line(rows[start : start + chunk])

    def _line(self, rows: list[MetricRow]) -> bytes:
        """The next line: ``<key> <mac> <json>``, the mac over the JSON's bytes as sent."""
        fields = METRIC_ROW_FIELDS
        body = json.dumps(
            {
                "key": self.address.key,
                "attempt": self.attempt,
                "seq": self._seq,
                "rows": [[getattr(r, f) for f in fields] for r in rows],
            },
            separators=(",", ":"),
        ).encode()
        self._seq += 1
        return self.address.key.encode() + b" " + _mac(self.address.secret, body).encode() + b" " + body + b"\n"


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the service closed ``sock``: it never writes to a task, so a readable socket is at its end."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and not sock.recv(1, socket.MSG_PEEK)
    except (OSError, ValueError):
        return True


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
