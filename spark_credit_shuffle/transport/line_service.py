"""A hardened service of lines: the base of the driver's address service and of its live monitor service.

Both listen on the driver's address, where anyone who reaches the driver can connect, and both read one
line at a time from each connection on one thread (:class:`LineService`, over an
:class:`~.event_loop.EventLoop`). What they share, and what this module guarantees for both:

- **Authenticated before parsed.** A line that carries a MAC is verified over its raw bytes (HMAC-SHA256,
  :func:`hmac.compare_digest`) before any of it is parsed; the owner's :meth:`LineService.on_line` does the
  check with the secret the line's key selects, and only then calls :func:`parse_bounded`.
- **Parsing bounded.** :func:`parse_bounded` refuses a line over its size and JSON nested deeper than
  :data:`MAX_DEPTH` before :func:`json.loads` sees it: ``[[[[...`` 100,000 deep costs a scan that stops at
  the 33rd bracket, never a ``RecursionError``.
- **Deadlines.** Every connection has an authentication deadline (``auth_timeout_s`` from its accept to the
  line that authenticates it; a TLS handshake counts inside it) and, once authenticated, an idle deadline
  (``idle_timeout_s`` after its last line), or one its owner sets (:meth:`LineService.hold`).
- **Caps, unauthenticated connections first.** At most ``max_unauthenticated`` connections wait to
  authenticate and at most ``max_connections`` are open; one more evicts the oldest unauthenticated
  connection (after reading what the waiting ones sent: a line that arrived authenticates its peer first),
  never an authenticated one; with every connection authenticated, the new one is refused.
- **Memory bounded per connection.** A partial line is held up to the connection's line limit (small before
  it authenticates: ``first_line_limit``) and dropped with the connection at its deadline;
  :attr:`LineService.buffered_bytes` is what every connection holds now.
- **Failures contained.** Any exception while handling one connection's bytes closes that connection only,
  counted under its cause and logged once per cause per :data:`LOG_WINDOW_S` (the rest counted). A failure
  of the loop itself (outside one connection) restarts the loop in place: same listener, port and
  registrations, its connections closed; after :data:`MAX_RESTARTS` within :data:`RESTART_WINDOW_S` the
  thread ends, and the next use of the service starts a new one on the same port with the same
  registrations (:meth:`LineService.restarted`, :class:`~.event_loop.ServicesByHost`).

The owner (a subclass) implements :meth:`~LineService.on_line` and may implement
:meth:`~LineService.on_closed`, :meth:`~LineService.on_round`, :meth:`~LineService.tls_context` (a service
that also serves TLS: the first byte of a connection tells a TLS record from a line) and
:meth:`~LineService._successor`. Flink's servers bound what a peer may hold in the same spirit (its
``BlobServer`` the connections it serves, ``blob.fetch.num-concurrent``; its REST server a request's size,
``rest.server.max-content-length``); the task's data plane has its own policy (:mod:`.authentication`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import re
import selectors
import socket
import ssl
import threading
import time
from typing import Any

from .authentication import ACCEPTS_PER_ROUND
from .event_loop import LISTEN_BACKLOG, EventLoop

__all__ = [
    "LOG_WINDOW_S",
    "MAX_DEPTH",
    "MAX_RESTARTS",
    "RESTART_WINDOW_S",
    "LinePeer",
    "LineService",
    "Rejected",
    "check_nesting",
    "parse_bounded",
]

log = logging.getLogger("spark_credit_shuffle")

#: The deepest JSON nesting a line may have (the services' lines nest 3 deep at most).
MAX_DEPTH = 32
#: How often a kind of rejection is logged at WARNING (the others in between are counted, then logged as a count).
LOG_WINDOW_S = 60.0
#: Restarts of a failed loop in place within :data:`RESTART_WINDOW_S` before the thread ends.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
#: The most bytes one read takes from a connection.
_RECV_BYTES = 65536

#: What decides JSON's nesting: a backslash escape (inside a string), a quote, a bracket or a brace.
_STRUCTURE = re.compile(rb'\\.|["\[\]{}]', re.DOTALL)
_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")
_QUOTE = ord('"')
_BACKSLASH = ord("\\")


def check_nesting(data: bytes, max_depth: int = MAX_DEPTH) -> None:
    """Raise ``ValueError`` if the JSON text ``data`` (UTF-8) nests arrays and objects deeper than
    ``max_depth``; brackets inside strings do not count. Linear in ``data``, and it stops at the first
    bracket too deep, so a line of 100,000 ``[`` costs 33 steps."""
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return
    depth = 0
    in_string = False
    for match in _STRUCTURE.finditer(data):
        first = data[match.start()]
        if in_string:
            if first == _QUOTE:
                in_string = False
        elif first == _QUOTE:
            in_string = True
        elif first == _BACKSLASH:
            raise ValueError("a backslash outside a string")
        elif first in _OPEN:
            depth += 1
            if depth > max_depth:
                raise ValueError(f"JSON nested deeper than {max_depth}")
        elif first in _CLOSE:
            depth -= 1


def parse_bounded(data: bytes, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """``data`` (UTF-8 JSON) as a Python value, or ``ValueError`` if it is longer than ``max_bytes``, not
    UTF-8, nested deeper than ``max_depth`` (checked before parsing) or not JSON. Call it on a line only
    after the line's MAC verified, where it carries one."""
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes, more than {max_bytes}")
    text = data.decode("utf-8")  # strict: JSON's own detection of UTF-16 and UTF-32 never applies
    check_nesting(data, max_depth)
    try:
        return json.loads(text)
    except RecursionError:  # not below MAX_DEPTH; a bound set far above Python's stack is the caller's
        raise ValueError("JSON nested too deep to parse") from None


class Rejected(Exception):
    """Raised by a service's line handler: close the connection for ``reason`` (logged with the peer),
    counted under ``cause`` (a short name: "bad request", "wrong secret")."""

    def __init__(self, reason: str, cause: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.cause = cause


class LinePeer:
    """One connection of a :class:`LineService`: its socket, the partial line it sent, what is left to write
    to it, its deadline, and ``data``: what the service's owner keeps for it."""

    __slots__ = (
        "accepted",
        "address",
        "authenticated",
        "close_after",
        "data",
        "deadline",
        "deadline_cause",
        "deadline_reason",
        "handshaking",
        "idle",
        "inbox",
        "line_limit",
        "out",
        "sniffed",
        "sock",
    )

    def __init__(self, sock: socket.socket, address: str, accepted: float, line_limit: int) -> None:
        self.sock = sock
        self.address = address
        self.accepted = accepted
        self.line_limit = line_limit
        self.inbox = bytearray()
        self.out = bytearray()
        self.close_after = False
        self.authenticated = False
        #: Once authenticated, the deadline moves on with every line (the idle deadline).
        self.idle = False
        self.deadline: float | None = None
        #: Why the connection is closed at its deadline (None: closed without counting a rejection).
        self.deadline_cause: str | None = None
        self.deadline_reason = ""
        #: The first byte was looked at (TLS or not); a TLS handshake is under way.
        self.sniffed = False
        self.handshaking = False
        self.data: Any = None


class LineService:
    """One listener on ``(host, port)`` and one thread that reads lines from its connections and hands each
    to :meth:`on_line` (see the module documentation for the guarantees).

    ``auth_timeout_s``: from the accept to the line that authenticates a connection (:meth:`authenticate`);
    ``idle_timeout_s``: from an authenticated connection's last line to its close; ``max_connections`` and
    ``max_unauthenticated``: the caps; ``first_line_limit`` and ``line_limit``: the longest line before and
    after authentication. Subclasses set their own state, then call :meth:`_start`.
    """

    #: How the service names itself in logs.
    label = "line service"
    #: The cause counted, the line waited for and the setting named when the authentication deadline passes.
    auth_cause = "authentication timeout"
    first_line = "authenticated line"
    auth_setting = "auth_timeout_s"
    #: The setting named when the idle deadline passes, and the cause counted then.
    idle_setting = "idle_timeout_s"
    idle_cause = "idle timeout"
    #: The setting named when an unauthenticated connection is evicted, and the cause counted for a long line.
    unauthenticated_setting = "max_unauthenticated"
    too_long_cause = "line too long"

    def __init__(
        self,
        host: str,
        *,
        port: int = 0,
        auth_timeout_s: float,
        idle_timeout_s: float,
        max_connections: int,
        max_unauthenticated: int,
        first_line_limit: int,
        line_limit: int,
        thread_name: str,
    ) -> None:
        for name, value in (("auth_timeout_s", auth_timeout_s), ("idle_timeout_s", idle_timeout_s)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        for name, count in (
            ("max_connections", max_connections),
            ("max_unauthenticated", max_unauthenticated),
            ("first_line_limit", first_line_limit),
            ("line_limit", line_limit),
        ):
            if count < 1:
                raise ValueError(f"{name} must be >= 1, got {count}")
        self.auth_timeout_s = auth_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self._max_unauthenticated = max_unauthenticated
        self.first_line_limit = first_line_limit
        self.line_limit = line_limit
        self._loop = EventLoop(host, port, backlog=LISTEN_BACKLOG)
        self._address = self._loop.address
        #: Open connections in the order they were accepted (the oldest first).
        self._peers: dict[LinePeer, None] = {}
        #: TLS connections holding decrypted bytes the selector cannot see.
        self._tls_readable: set[LinePeer] = set()
        self._closing = False
        self._next_round: float | None = None
        self._buffered = 0
        #: The most bytes of partial lines the connections held at once since the service started.
        self.peak_buffered_bytes = 0
        self.num_rejected = 0
        #: Connections closed per cause since the service started.
        self.rejected_by_cause: dict[str, int] = {}
        self._log_window: dict[str, tuple[float, int]] = {}  # cause -> (window start, closed since logged)
        #: Times the loop failed and went on in place; the failure that ended the thread, if any.
        self.num_restarts = 0
        self.thread_failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    # -- what other threads see --

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the listener is bound to."""
        return self._address

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def max_unauthenticated(self) -> int:
        """How many connections may wait to authenticate at once."""
        return self._max_unauthenticated

    @property
    def num_connections(self) -> int:
        """Open connections."""
        return len(self._peers)

    @property
    def num_unauthenticated(self) -> int:
        """Open connections that have not authenticated yet."""
        return sum(not p.authenticated for p in list(self._peers))

    @property
    def buffered_bytes(self) -> int:
        """Bytes of partial lines the open connections hold now (each at most its line limit plus one)."""
        return self._buffered

    def wakeup(self) -> None:
        """Make the service thread look at its registrations and deadlines again (any thread)."""
        self._loop.wakeup()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the service thread (joined within ``timeout_s``) and close every socket."""
        self._closing = True
        self._loop.wakeup(force=True)
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(timeout_s)

    def restarted(self) -> LineService:
        """A new service like this one (whose thread ended), on the same port if it is free (the exchanges
        built before hold that address), holding this one's registrations (:meth:`_successor`)."""
        host, port = self._address
        try:
            successor = self._successor(host, port)
        except OSError as exc:
            log.warning(
                "%s: cannot listen on %s:%d again (%s); a new one listens on another port, and exchanges built "
                "before fail at once with a refused connection",
                self.label,
                host,
                port,
                exc,
            )
            successor = self._successor(host, 0)
        log.warning("%s: restarted on %s:%d after its thread ended", self.label, *successor.address)
        return successor

    def _successor(self, host: str, port: int) -> LineService:
        """A new service of this kind listening on ``(host, port)``, holding this one's registrations."""
        raise NotImplementedError

    # -- the owner's hooks (service thread) --

    def on_line(self, peer: LinePeer, line: bytes) -> None:
        """One complete line of ``peer`` (without its newline, at most its line limit). Raise
        :class:`Rejected` (or anything) to close the connection; :meth:`authenticate` it once a line proved
        the secret."""
        raise NotImplementedError

    def on_closed(self, peer: LinePeer) -> None:
        """``peer`` was closed (for any reason)."""

    def on_round(self, now: float) -> float | None:
        """Periodic work after every round of the loop; when it should run again at the latest (monotonic
        seconds), None: whenever. A failure here is the loop's: it restarts."""
        return None

    def tls_context(self) -> ssl.SSLContext | None:
        """The server context for a connection whose first byte starts a TLS record; None: lines only."""
        return None

    def on_restart(self) -> None:
        """The loop failed and goes on: forget what referred to the connections it closed."""

    # -- what the owner does with a connection (service thread) --

    def authenticate(self, peer: LinePeer) -> None:
        """``peer`` proved the secret: it may send lines up to ``line_limit`` from now on, each within the
        idle deadline of the one before, and is evicted only after every unauthenticated connection."""
        peer.authenticated = True
        peer.line_limit = self.line_limit
        peer.idle = True
        self._set_deadline(
            peer,
            time.monotonic() + self.idle_timeout_s,
            self.idle_cause,
            f"no line within {self.idle_timeout_s:.0f} s of its last ({self.idle_setting})",
        )

    def hold(self, peer: LinePeer, deadline: float | None, cause: str | None = None, reason: str = "") -> None:
        """Close ``peer`` at ``deadline`` (monotonic seconds; None: its owner closes it), counting ``cause``
        (None: a close that is no rejection), instead of the idle deadline."""
        peer.idle = False
        self._set_deadline(peer, deadline, cause, reason)

    def send(self, peer: LinePeer, data: bytes, *, close_after: bool = False) -> None:
        """Write ``data`` to ``peer`` (the rest when its socket is writable); close it once written if
        ``close_after``."""
        peer.out += data
        peer.close_after = peer.close_after or close_after
        if not peer.handshaking:
            self._flush(peer)

    def reject(self, peer: LinePeer, reason: str, cause: str, exc: BaseException | None = None) -> None:
        """Close ``peer`` for ``reason``, counted under ``cause`` (see :meth:`record`)."""
        self.record(peer.address, reason, cause, exc)
        self.close_peer(peer)

    def record(self, address: str, reason: str, cause: str, exc: BaseException | None = None) -> None:
        """Count a connection closed (or refused) for ``cause``; log it at WARNING once per cause and
        :data:`LOG_WINDOW_S`, the others at DEBUG and as a count at the window's end."""
        self.num_rejected += 1
        self.rejected_by_cause[cause] = self.rejected_by_cause.get(cause, 0) + 1
        text = f"{self.label}: closing connection from {address}: {reason}"
        if cause not in self._log_window:
            self._log_window[cause] = (time.monotonic(), 0)
            log.warning(
                "%s (more of this cause within %.0f s are counted, not logged)",
                text,
                LOG_WINDOW_S,
                exc_info=exc if exc is not None and not isinstance(exc, Rejected) else None,
            )
        else:
            start, count = self._log_window[cause]
            self._log_window[cause] = (start, count + 1)
            log.debug("%s", text)

    def close_peer(self, peer: LinePeer) -> None:
        """Close ``peer`` and drop what it held (no rejection counted)."""
        if peer not in self._peers:
            return
        del self._peers[peer]
        self._tls_readable.discard(peer)
        self._buffered -= len(peer.inbox)
        peer.inbox = bytearray()
        peer.out = bytearray()
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._loop.selector.unregister(peer.sock)
        with contextlib.suppress(OSError):
            peer.sock.close()
        try:
            self.on_closed(peer)
        except Exception as exc:  # the owner's bookkeeping: the connection is closed whatever it says
            self.record(peer.address, f"failed after closing it ({type(exc).__name__}: {exc})", "close failed", exc)

    # -- the service thread --

    def _run(self) -> None:
        failures: collections.deque[float] = collections.deque()
        try:
            while not self._closing:
                try:
                    self._serve()
                except Exception as exc:  # a failure outside one connection's handling: the loop goes on
                    now = time.monotonic()
                    failures.append(now)
                    while failures and now - failures[0] > RESTART_WINDOW_S:
                        failures.popleft()
                    if len(failures) > MAX_RESTARTS:
                        self.thread_failure = exc
                        log.exception(
                            "%s: the service thread failed %d times within %.0f s; it ends (the next use starts a "
                            "new one on the same port)",
                            self.label,
                            len(failures),
                            RESTART_WINDOW_S,
                        )
                        return
                    self.num_restarts += 1
                    log.exception(
                        "%s: the service thread failed; it goes on with its registrations, its %d connections closed",
                        self.label,
                        len(self._peers),
                    )
                    self._close_all()
                    with contextlib.suppress(Exception):
                        self.on_restart()
                    self._next_round = None
        finally:
            self._close_all()
            self._loop.close()

    def _serve(self) -> None:
        while not self._closing:
            timeout = 0.0 if self._tls_readable else self._select_timeout()
            accept, ready = self._loop.poll(timeout)
            if self._tls_readable:  # decrypted bytes the selector cannot see
                ready = [(p, selectors.EVENT_READ) for p in self._tls_readable] + ready
                self._tls_readable = set()
            self._handle(ready)
            if accept and not self._closing:  # after the other sockets were read
                self._accept()
            now = time.monotonic()
            self._expire(now)
            self._next_round = self.on_round(now)
            self._log_counts(now)

    def _handle(self, ready: list[tuple[Any, int]]) -> None:
        for peer, mask in ready:
            if mask & selectors.EVENT_READ and peer in self._peers:
                self._guard(peer, self._on_readable)
            if mask & selectors.EVENT_WRITE and peer in self._peers:
                self._guard(peer, self._on_writable)

    def _guard(self, peer: LinePeer, step: Any) -> None:
        """Run one step of ``peer``'s handling; whatever it raises closes ``peer`` only."""
        try:
            step(peer)
        except Rejected as rejected:
            self.reject(peer, rejected.reason, rejected.cause)
        except Exception as exc:  # any failure on one connection's bytes (a bug included) ends that connection
            self.reject(peer, f"{type(exc).__name__}: {str(exc)[:200]}", f"failed: {type(exc).__name__}", exc)

    def _select_timeout(self) -> float:
        now = time.monotonic()
        deadlines = [p.deadline for p in list(self._peers) if p.deadline is not None]
        if self._next_round is not None:
            deadlines.append(self._next_round)
        deadlines += [start + LOG_WINDOW_S for start, count in self._log_window.values() if count]
        if not deadlines:
            return 60.0
        return min(60.0, max(0.0, min(deadlines) - now))

    def _accept(self) -> None:
        for sock, address in self._loop.accept_some(ACCEPTS_PER_ROUND, self.label, raise_unexpected=False):
            try:
                self._admit(sock, address)
            except Exception as exc:  # the new connection's failure, not the service's
                with contextlib.suppress(OSError):
                    sock.close()
                self.record(address, f"{type(exc).__name__}: {exc}", f"failed: {type(exc).__name__}", exc)

    def _admit(self, sock: socket.socket, address: str) -> None:
        self._make_room()
        if len(self._peers) >= self.max_connections:  # every one authenticated: they stay, the new one goes
            sock.close()
            self.record(
                address,
                f"{len(self._peers)} connections are open and authenticated, the limit max_connections="
                f"{self.max_connections}",
                "connection limit",
            )
            return
        sock.setblocking(False)
        now = time.monotonic()
        peer = LinePeer(sock, address, now, self.first_line_limit)
        self._set_deadline(
            peer,
            now + self.auth_timeout_s,
            self.auth_cause,
            f"no {self.first_line} within {self.auth_timeout_s * 1000:.0f} ms of connecting ({self.auth_setting})",
        )
        self._peers[peer] = None
        self._loop.selector.register(sock, selectors.EVENT_READ, peer)

    def _make_room(self) -> None:
        """Before accepting one more: if the caps are reached, read what the connections sent (a line that
        arrived authenticates its peer), then close the oldest unauthenticated ones until there is room."""
        limit = self.max_unauthenticated
        waiting = [p for p in self._peers if not p.authenticated]
        if len(waiting) < limit and len(self._peers) < self.max_connections:
            return
        _, ready = self._loop.poll(0)
        self._handle(ready)
        waiting = [p for p in waiting if p in self._peers and not p.authenticated]  # the oldest first
        for evicted, oldest in enumerate(waiting):
            left = len(waiting) - evicted
            if left < limit and len(self._peers) < self.max_connections:
                return
            self.reject(
                oldest,
                f"{left} connections wait to authenticate and {len(self._peers)} are open, the limit "
                f"{self.unauthenticated_setting}={limit} or max_connections={self.max_connections} is reached, "
                "and it is the oldest waiting",
                "evicted unauthenticated",
            )

    def _set_deadline(self, peer: LinePeer, deadline: float | None, cause: str | None, reason: str) -> None:
        peer.deadline = deadline
        peer.deadline_cause = cause
        peer.deadline_reason = reason

    def _expire(self, now: float) -> None:
        for peer in [p for p in self._peers if p.deadline is not None and now >= p.deadline]:
            if peer.deadline_cause is None:
                self.close_peer(peer)
            else:
                self.reject(peer, peer.deadline_reason, peer.deadline_cause)

    def _on_readable(self, peer: LinePeer) -> None:
        if not peer.sniffed:
            if self.tls_context() is not None:
                self._sniff(peer)
                return
            peer.sniffed = True
        if peer.handshaking:
            self._tls_step(peer)
            return
        data = self._recv(peer)
        if data is None:
            return
        if not data:
            if peer.authenticated:
                self.close_peer(peer)
                return
            raise Rejected("connection closed before the end of the line", "closed early")
        self._feed(peer, data)
        sock = peer.sock
        if peer in self._peers and isinstance(sock, ssl.SSLSocket) and sock.pending():
            self._tls_readable.add(peer)

    def _recv(self, peer: LinePeer) -> bytes | None:
        """What ``peer`` sent (``b""``: it closed; None: nothing yet), at most one more byte than the line it
        may still send (a TLS socket: its records in full, read until it would block)."""
        room = max(1, peer.line_limit + 1 - len(peer.inbox))
        sock = peer.sock
        try:
            if not isinstance(sock, ssl.SSLSocket):
                try:
                    return sock.recv(min(_RECV_BYTES, room))
                except (BlockingIOError, InterruptedError):
                    return None
            chunks: list[bytes] = []
            size = 0
            while size < room:
                try:
                    chunk = sock.recv(min(_RECV_BYTES, room - size))
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                    break
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    chunk = b""
                if not chunk:
                    return b"".join(chunks) if chunks else b""
                chunks.append(chunk)
                size += len(chunk)
            return b"".join(chunks) if chunks else None
        except OSError as exc:
            if peer.authenticated:
                self.close_peer(peer)
                return None
            raise Rejected(f"{type(exc).__name__}: {exc}", "connection error") from None

    def _feed(self, peer: LinePeer, data: bytes) -> None:
        """Add ``data`` to ``peer``'s partial line and hand on every line it completes."""
        start = len(peer.inbox)
        peer.inbox += data
        self._buffered += len(data)
        if self._buffered > self.peak_buffered_bytes:
            self.peak_buffered_bytes = self._buffered
        while True:
            end = peer.inbox.find(b"\n", start)
            if end < 0 or end > peer.line_limit:
                if len(peer.inbox) > peer.line_limit:
                    raise Rejected(f"a line longer than {peer.line_limit} bytes", self.too_long_cause)
                return
            line = bytes(peer.inbox[:end])
            del peer.inbox[: end + 1]
            self._buffered -= end + 1
            start = 0
            self.on_line(peer, line)
            if peer not in self._peers:
                return
            if peer.authenticated and peer.idle:
                peer.deadline = time.monotonic() + self.idle_timeout_s

    def _on_writable(self, peer: LinePeer) -> None:
        if peer.handshaking:
            self._tls_step(peer)
            return
        self._flush(peer)

    def _flush(self, peer: LinePeer) -> None:
        while peer.out:
            try:
                sent = peer.sock.send(peer.out)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                break
            except OSError:
                self.close_peer(peer)
                return
            del peer.out[:sent]
        if peer.out:
            self._interest(peer, selectors.EVENT_READ | selectors.EVENT_WRITE)
        elif peer.close_after:
            self.close_peer(peer)
        else:
            self._interest(peer, selectors.EVENT_READ)

    def _interest(self, peer: LinePeer, events: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            if self._loop.selector.get_key(peer.sock).events != events:
                self._loop.selector.modify(peer.sock, events, peer)

    def _sniff(self, peer: LinePeer) -> None:
        """The first byte tells a TLS connection (a handshake record, 22) from a line."""
        try:
            first = peer.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            raise Rejected(f"{type(exc).__name__}: {exc}", "connection error") from None
        if not first:
            raise Rejected("connection closed before the end of the line", "closed early")
        peer.sniffed = True
        if first != b"\x16":
            self._on_readable(peer)
            return
        context = self.tls_context()
        assert context is not None
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._loop.selector.unregister(peer.sock)
        try:
            peer.sock = context.wrap_socket(peer.sock, server_side=True, do_handshake_on_connect=False)
        except (ssl.SSLError, OSError) as exc:
            raise Rejected(f"TLS refused ({exc})", "TLS handshake failed") from None
        self._loop.selector.register(peer.sock, selectors.EVENT_READ, peer)
        peer.handshaking = True
        self._tls_step(peer)

    def _tls_step(self, peer: LinePeer) -> None:
        """One step of a TLS handshake (inside the authentication deadline); done, read what came with it."""
        sock = peer.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._interest(peer, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._interest(peer, selectors.EVENT_READ | selectors.EVENT_WRITE)
            return
        except (ssl.SSLError, OSError) as exc:
            raise Rejected(f"TLS handshake failed ({exc})", "TLS handshake failed") from None
        peer.handshaking = False
        if peer.out:
            self._flush(peer)
        else:
            self._interest(peer, selectors.EVENT_READ)
        if peer in self._peers:
            self._on_readable(peer)  # the first line may have come with the handshake's last record

    def _close_all(self) -> None:
        for peer in list(self._peers):
            self.close_peer(peer)

    def _log_counts(self, now: float) -> None:
        for cause, (start, count) in list(self._log_window.items()):
            if now - start >= LOG_WINDOW_S:
                del self._log_window[cause]
                if count:
                    log.warning("%s: closed %d more connections in %.0f s: %s", self.label, count, now - start, cause)
