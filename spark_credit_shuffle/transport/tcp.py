"""The TCP transport: the sans-IO protocol core driven over real sockets by one I/O thread.

One :class:`TcpTransport` per task. It listens on the task's own address (never a wildcard), accepts the
connections of remote consumers (each served by a
:class:`~spark_credit_shuffle.protocol.PartitionRequestServerHandler`) and opens the task's connections
to remote producers (each a :class:`~spark_credit_shuffle.protocol.CreditBasedPartitionRequestClientHandler`).
All channels between two tasks share one connection, as Flink multiplexes all channels between two
TaskManagers. One daemon I/O thread runs a selector over every socket; the protocol objects are touched
only while holding the task's ``lock``, which the runtime shares, so the core stays single-threaded in
effect. Other threads that make something sendable (a producer adding data, a consumer recycling a buffer
into credit) reach the I/O thread through the handlers' ``listener`` hooks, which call :meth:`wakeup`.

Writing follows Flink's "write while the channel is writable": messages are pulled from a handler only
while less than ``high_water`` bytes wait in the connection's output (Netty's write-buffer high
watermark), so a sender's buffer goes back to its pool only when the socket can take it. Payloads are
never copied before ``sendmsg``. A thread that makes something sendable inside :meth:`sending` (a
consumer returning credit, a producer adding data) writes it itself, without a non-blocking socket
write it cannot finish being anything but handed to the I/O thread: in Python every hand-over between
threads waits for the interpreter lock, and the credit loop (credit out, buffer back) is the latency
that bounds a channel's throughput.

Input from the wire is untrusted. Every accepted connection must authenticate with the exchange's secret
(the protocol's ``Hello``) within ``handshake_timeout_s`` (the authentication deadline, counted from the
accept, so a peer that sends a byte a second gains nothing) and within :data:`MAX_HELLO_BYTES`; a wrong
secret, garbage, an oversized frame length or a message out of turn raises
:class:`~spark_credit_shuffle.errors.ProtocolError` in the handler, and the transport closes that connection
only: the exchange carries on. At most ``max_unauthenticated`` connections wait to authenticate (see
:func:`unauthenticated_cap`): when one more arrives, whatever the waiting ones sent is read first (a peer
whose ``Hello`` has arrived authenticates), then the oldest one still unauthenticated is closed to make room,
so a flood of silent connections costs a bounded number of sockets and closes a legitimate peer only if
``max_unauthenticated`` newer connections arrive before its Hello does: connected sockets are read before
new connections are accepted, and at most :data:`ACCEPTS_PER_ROUND` are accepted per round of the I/O
thread. Each kind of rejection is logged once per transport at WARNING (the
limit, its setting if it has one, and the peer), the rest at DEBUG, and a count of each when the transport
closes: a flood makes a few lines, not one per connection.

Connections end with a half-close: a client whose handler sent ``CloseRequest`` (every channel on it
received its end of partition) shuts down its sending side once its output is written; the server sees
EOF, releases its readers and closes; the client sees that EOF and closes. No side closes a socket with
unread input, so no data is lost to a reset.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import re
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import ExchangeTimeoutError, ProtocolError
from ..protocol.codec import FRAME_HEADER_LENGTH, MAX_SECRET_BYTES, encode
from ..protocol.messages import Message

__all__ = [
    "ACCEPTS_PER_ROUND",
    "AUTHENTICATION_TIMEOUT_S",
    "MAX_HELLO_BYTES",
    "MIN_UNAUTHENTICATED",
    "Connection",
    "SansIOConnection",
    "TcpTransport",
    "resolve_host",
    "unauthenticated_cap",
]

log = logging.getLogger("spark_credit_shuffle")

#: The longest a task's listener waits for a connected peer's ``Hello`` (at most, the runtime passes
#: ``min(partition_request_timeout_ms, this)``): a legitimate peer sends it as soon as it is connected.
AUTHENTICATION_TIMEOUT_S = 2.0
#: The most bytes a peer may send before its ``Hello`` authenticates it: one Hello frame with the longest
#: secret the codec accepts (frame header, secret size, secret).
MAX_HELLO_BYTES = FRAME_HEADER_LENGTH + 2 + MAX_SECRET_BYTES
#: The fewest connections allowed to wait for authentication at once, whatever the expected peers.
MIN_UNAUTHENTICATED = 32
#: The most connections the I/O thread accepts before it reads its other sockets again.
ACCEPTS_PER_ROUND = 16

_RECV_SIZE = 256 * 1024
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")
_MAX_IOV = 64
_LISTENER = object()
_WAKEUP = object()


class SansIOConnection(Protocol):
    """What the transport drives: a server or client connection handler of the protocol core."""

    def receive_data(self, data: bytes | bytearray | memoryview) -> None: ...

    def next_message(self) -> Message | None: ...

    def has_data(self) -> bool: ...

    def connection_closed(self) -> None: ...


def unauthenticated_cap(expected_peers: int) -> int:
    """How many connections may wait to authenticate when ``expected_peers`` legitimate peers will connect.

    Four times the legitimate peers, at least :data:`MIN_UNAUTHENTICATED`: every legitimate peer can be
    waiting at once with room to spare, and a flood evicts the oldest waiting connection, not a new one.
    """
    return max(MIN_UNAUTHENTICATED, 4 * max(0, int(expected_peers)))


def resolve_host(host: str) -> str:
    """The IPv4 address of ``host`` (a name such as ``localhost`` or an address); raises ``OSError``."""
    if not host:
        raise OSError("empty host name")
    infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"host {host!r} has no IPv4 address")
    return str(infos[0][4][0])


class Connection:
    """One TCP connection: its socket, its protocol handler and its output queue.

    ``role`` is ``"server"`` (accepted from a consumer) or ``"client"`` (opened to a producer); ``peer``
    names the other side in logs and errors. Counters and timestamps (``time.monotonic()``) let the runtime
    say what it waited for and from whom.
    """

    __slots__ = (
        "accepted_at",
        "bytes_in",
        "bytes_out",
        "closed",
        "error",
        "handler",
        "id",
        "last_received",
        "messages_out",
        "out",
        "out_bytes",
        "peer",
        "role",
        "sock",
        "write_error",
        "write_shut",
    )

    def __init__(self, sock: socket.socket, handler: Any, role: str, peer: str, conn_id: int) -> None:
        now = time.monotonic()
        self.sock = sock
        self.handler = handler
        self.role = role
        self.peer = peer
        self.id = conn_id
        self.out: deque[memoryview] = deque()
        self.out_bytes = 0
        self.closed = False
        self.write_shut = False
        self.write_error: BaseException | None = None
        self.error: BaseException | None = None
        self.accepted_at = now
        self.last_received = now
        self.bytes_in = 0
        self.bytes_out = 0
        self.messages_out = 0

    @property
    def is_authenticated(self) -> bool:
        """A server connection whose client presented the secret (client connections always are)."""
        return bool(getattr(self.handler, "is_authenticated", True))

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Connection({self.role} {self.peer}, {state}, in={self.bytes_in}, out={self.bytes_out})"


class _SendingBlock:
    """The context manager :meth:`TcpTransport.sending` returns (the depth of nested blocks is per thread)."""

    __slots__ = ("_local", "_transport")

    def __init__(self, transport: TcpTransport) -> None:
        self._transport = transport
        self._local = transport._local

    def __enter__(self) -> None:
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        local = self._local
        depth = local.depth - 1
        local.depth = depth
        transport = self._transport
        if depth == 0 and transport._dirty:
            transport.flush()


class TcpTransport:
    """The listening socket, the connections and the I/O thread of one task.

    ``host`` is the task's own address; the listener binds to it only (port 0 picks a free port, see
    :attr:`address`). ``lock`` (a ``threading.RLock``) guards every protocol object the handlers reach
    (pass the runtime's).
    ``server_handler_factory(wakeup)`` builds the handler of an accepted connection (None: accept nothing).
    ``on_event()`` runs, with ``lock`` held, after input was processed or a connection closed, so waiting
    threads can look again; ``on_send(connection, message)`` runs, with ``lock`` held, for every message
    pulled from a handler (metrics). ``on_closed(connection)`` runs, with ``lock`` held, when a connection
    ends (its ``error`` tells why, None for a clean close).
    ``handshake_timeout_s`` is the authentication deadline of an accepted connection and
    ``max_unauthenticated`` how many may wait for it at once (:func:`unauthenticated_cap`);
    ``handshake_timeout_setting`` names where the deadline comes from in logs.
    """

    def __init__(
        self,
        host: str,
        lock: Any,
        *,
        server_handler_factory: Callable[[Callable[[], None]], SansIOConnection] | None = None,
        handshake_timeout_s: float = 10.0,
        high_water: int = 256 * 1024,
        handshake_timeout_setting: str = "handshake_timeout_s",
        max_unauthenticated: int = MIN_UNAUTHENTICATED,
        on_event: Callable[[], None] | None = None,
        on_send: Callable[[Connection, Message], None] | None = None,
        on_closed: Callable[[Connection], None] | None = None,
        name: str = "",
        port: int = 0,
    ) -> None:
        if high_water <= 0:
            raise ValueError(f"high_water must be > 0 bytes, got {high_water}")
        if handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {handshake_timeout_s}")
        if max_unauthenticated < 1:
            raise ValueError(f"max_unauthenticated must be >= 1, got {max_unauthenticated}")
        self.lock = lock  # re-entrant: handlers' callbacks may run while the transport holds it
        self.name = name or "transport"
        self._factory = server_handler_factory
        self._handshake_timeout = handshake_timeout_s
        self._handshake_setting = handshake_timeout_setting
        self._high_water = high_water
        self._max_unauthenticated = max_unauthenticated
        self._on_event = on_event
        self._on_send = on_send
        self._on_closed = on_closed
        self._ids = itertools.count(1)
        self._selector = selectors.DefaultSelector()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(64)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            self._selector.close()
            raise
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._woken = False
        self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKEUP)
        self._connections: dict[int, Connection] = {}
        self._interest: dict[int, int] = {}
        self._pending: list[Connection] = []
        self._pending_lock = threading.Lock()
        self._dirty: set[Connection] = set()
        self._local = threading.local()
        self._sending_block = _SendingBlock(self)
        self._stopping = False
        self._thread: threading.Thread | None = None
        #: The exception that stopped the I/O thread, if any (a bug or an OS failure, not a peer's fault).
        self.error: BaseException | None = None
        self.num_rejected = 0
        self.rejections: list[str] = []
        #: Connections closed per cause (a short name: "evicted", "handshake timeout", a protocol error).
        self.rejected_by_cause: dict[str, int] = {}
        self._counts_logged = False
        #: CPU seconds the I/O thread used (set when it stops).
        self.thread_cpu_s = 0.0

    # -- public API ---------------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the listener is bound to."""
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def connections(self) -> list[Connection]:
        """Every connection not yet closed (a snapshot)."""
        with self._pending_lock:
            pending = list(self._pending)
        return [c for c in list(self._connections.values()) if not c.closed] + pending

    def start(self) -> None:
        """Start the I/O thread."""
        if self._thread is not None:
            raise RuntimeError("transport already started")
        self._thread = threading.Thread(target=self._run, name=f"credit-shuffle-io-{self.name}", daemon=True)
        self._thread.start()

    def wakeup(self) -> None:
        """Make the I/O thread look at every connection again (thread-safe, cheap when already woken)."""
        if self._woken:
            return
        self._woken = True
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def sending(self) -> _SendingBlock:
        """Within this block the calling thread writes what its protocol calls made sendable, at its end.

        Without it, a handler that becomes ready to send wakes the I/O thread. Blocks nest; the outermost
        one writes. Writes never block: what the socket does not take is left to the I/O thread. (One
        reusable block object: its nesting depth is per thread; entering it costs no generator.)
        """
        return self._sending_block

    def flush(self) -> None:
        """Write, from the calling thread, every connection whose handler has something to send."""
        leftover = False
        with self.lock:
            dirty, self._dirty = self._dirty, set()
            for conn in dirty:
                if conn.closed or conn.write_shut or conn.write_error is not None:
                    continue
                self._fill(conn)
                self._write(conn)
                resumed = getattr(conn.handler, "is_reading", True) and not (
                    self._interest.get(conn.id, 0) & selectors.EVENT_READ
                )
                leftover = leftover or bool(conn.out) or conn.write_error is not None or resumed
        if leftover:
            # the I/O thread waits for the socket to drain, drops a failed connection, or reads again from a
            # connection whose handler stopped reading (the model without credits) and now resumed
            self.wakeup()

    def _ready(self, conn: Connection) -> None:
        """A handler went from nothing to send to something to send (called with ``lock`` held)."""
        self._dirty.add(conn)
        if threading.current_thread() is self._thread:
            return  # the I/O thread pumps every connection after handling its events
        if getattr(self._local, "depth", 0):
            return  # the calling thread writes at the end of its sending() block
        self.wakeup()

    def connect(self, address: tuple[str, int], handler: Any, *, peer: str, timeout_s: float) -> Connection:
        """Open a connection to ``address`` served by client ``handler`` (blocking, in the caller's thread).

        Retries refused connections with back-off until ``timeout_s`` has passed, then raises
        :class:`ExchangeTimeoutError` naming ``peer`` and the address. Whatever the handler queued (its
        ``Hello`` first) is written at once from the calling thread; what follows is sent by the I/O thread
        (the handler's ``listener`` makes the connection ready to write).
        """
        host, port = address
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((host, port), timeout=max(0.01, min(remaining, 5.0)))
                break
            except OSError as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ExchangeTimeoutError(
                        f"connecting to {peer} at {host}:{port}: no connection within {timeout_s * 1000:.0f} ms "
                        f"(last error: {exc})"
                    ) from None
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        conn = Connection(sock, handler, "client", peer, next(self._ids))
        if hasattr(handler, "listener"):
            handler.listener = lambda: self._ready(conn)
        with self.lock:  # the Hello goes out with the connect, from this thread: a producer whose port is
            self._fill(conn)  # flooded closes the oldest connections waiting to authenticate, and this one
            self._write(conn)  # must not wait for the I/O thread's turn to present the secret
        with self._pending_lock:
            self._pending.append(conn)
        self.wakeup()
        return conn

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the I/O thread (joining it within ``timeout_s``) and close every socket.

        Raises :class:`ExchangeTimeoutError` if the thread does not stop in time (its sockets are closed
        anyway).
        """
        self._stopping = True
        self._woken = False
        self.wakeup()
        thread = self._thread
        alive = False
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            alive = thread.is_alive()
        self._close_all()
        if alive:
            raise ExchangeTimeoutError(
                f"joining the I/O thread of {self.name}: still running after {timeout_s * 1000:.0f} ms"
            )

    def __enter__(self) -> TcpTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- I/O thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        started = time.thread_time()
        try:
            while not self._stopping:
                events = self._selector.select(self._select_timeout())
                accept = False
                for key, mask in events:
                    data = key.data
                    if data is _LISTENER:
                        accept = True  # after the other sockets were read: a Hello that arrived counts
                    elif data is _WAKEUP:
                        self._drain_wakeup()
                    elif not data.closed:
                        if mask & selectors.EVENT_READ:
                            self._read(data)
                        if mask & selectors.EVENT_WRITE and not data.closed:
                            with self.lock:
                                self._write(data)
                if accept:
                    self._accept()
                self._adopt_pending()
                self._pump()
                self._expire_handshakes()
        except BaseException as exc:  # a bug or an OS failure: make it visible to the runtime
            self.error = exc
            log.exception("I/O thread of %s failed", self.name)
            with self.lock:
                self._notify()
        finally:
            self.thread_cpu_s = time.thread_time() - started
            self._close_all()

    def _select_timeout(self) -> float | None:
        unauthenticated = [c.accepted_at for c in self._connections.values() if not c.is_authenticated]
        if not unauthenticated:
            return None
        return max(0.0, min(unauthenticated) + self._handshake_timeout - time.monotonic())

    def _drain_wakeup(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass
        # Cleared after draining: a wakeup racing with this sends one byte more (a spare loop), never one
        # less; whatever its caller queued before calling it is seen by the _pump that follows.
        self._woken = False

    def _adopt_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for conn in pending:
            self._add(conn)

    def _add(self, conn: Connection) -> None:
        self._connections[conn.id] = conn
        self._interest[conn.id] = selectors.EVENT_READ
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_ROUND):  # the rest next round, after the other sockets were read again
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("%s cannot accept a connection: %s", self.name, exc)
                    return
                raise
            peer = f"{addr[0]}:{addr[1]}"
            if self._factory is None:
                self._refuse(sock, peer, "this endpoint serves no partitions")
                continue
            self._make_room()
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock, None, "server", f"client {peer}", next(self._ids))
            with self.lock:
                conn.handler = self._factory(functools.partial(self._ready, conn))
            self._add(conn)

    def _make_room(self) -> None:
        """Before accepting one more: if ``max_unauthenticated`` connections wait to authenticate, read what
        they sent (a Hello that arrived authenticates its peer), then close the oldest still waiting."""
        waiting = [c for c in self._connections.values() if not c.is_authenticated]
        if len(waiting) < self._max_unauthenticated:
            return
        for conn in waiting:
            if not conn.closed:
                self._read(conn)
        waiting = [c for c in waiting if not c.closed and not c.is_authenticated]
        if len(waiting) < self._max_unauthenticated:
            return
        oldest = min(waiting, key=lambda c: c.accepted_at)
        self._record_rejection(
            f"closing connection with {oldest.peer}: {len(waiting)} connections wait to authenticate, the limit "
            f"max_unauthenticated={self._max_unauthenticated} (from the expected peers) is reached and it is the "
            "oldest",
            "evicted unauthenticated",
        )
        self._drop(oldest, ProtocolError("closed unauthenticated to make room"), clean=False, logged=True)

    def _refuse(self, sock: socket.socket, peer: str, reason: str) -> None:
        self._record_rejection(f"refused connection from {peer}: {reason}", reason)
        sock.close()

    def _record_rejection(self, text: str, cause: str) -> None:
        """Count a closed connection; log its ``cause`` at WARNING the first time, at DEBUG after that."""
        self.num_rejected += 1
        if len(self.rejections) < 100:
            self.rejections.append(text)
        seen = self.rejected_by_cause.get(cause, 0)
        self.rejected_by_cause[cause] = seen + 1
        if seen:
            log.debug("%s: %s", self.name, text)
        else:
            log.warning(
                "%s: %s (more connections closed for this cause are counted when the transport closes)",
                self.name,
                text,
            )

    def _log_rejection_counts(self) -> None:
        """One WARNING with the count of every cause that closed more than one connection (once)."""
        if self._counts_logged:
            return
        self._counts_logged = True
        repeated = {cause: n for cause, n in self.rejected_by_cause.items() if n > 1}
        if repeated:
            counts = ", ".join(f"{n} x {cause}" for cause, n in sorted(repeated.items()))
            log.warning("%s: connections closed before or while authenticating: %s", self.name, counts)

    def _read(self, conn: Connection) -> None:
        try:
            data = conn.sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, exc, clean=False)
            return
        if not data:
            self._drop(conn, None, clean=True)
            return
        conn.bytes_in += len(data)
        conn.last_received = time.monotonic()
        with self.lock:
            try:
                conn.handler.receive_data(data)
                if conn.bytes_in > MAX_HELLO_BYTES and not conn.is_authenticated:
                    raise ProtocolError(
                        f"{conn.bytes_in} bytes received without a valid Hello (at most {MAX_HELLO_BYTES} "
                        "bytes may come before it)"
                    )
            except ProtocolError as exc:
                self._reject(conn, exc)
                return
            finally:
                self._notify()

    def _reject(self, conn: Connection, exc: ProtocolError) -> None:
        """A peer broke the protocol (wrong secret, garbage, oversized frame): log it, close it, carry on."""
        cause = _NUMBERS.sub("N", str(exc))  # one cause per kind of error, whatever its numbers
        self._record_rejection(f"closing connection with {conn.peer}: {exc}", cause)
        self._drop(conn, exc, clean=False, logged=True)

    def _drop(self, conn: Connection, exc: BaseException | None, *, clean: bool, logged: bool = False) -> None:
        """Close ``conn`` and tell its handler (``clean``: the peer closed its side after a complete frame).

        Runs in the I/O thread, under ``lock`` so that no other thread writes to the socket meanwhile.
        """
        with self.lock:
            if conn.closed:
                return
            conn.closed = True
            conn.error = exc
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(conn.sock)
            self._interest.pop(conn.id, None)
            self._connections.pop(conn.id, None)
            self._dirty.discard(conn)
            with contextlib.suppress(OSError):
                conn.sock.close()
            conn.out.clear()
            conn.out_bytes = 0
            try:
                conn.handler.connection_closed()
            except ProtocolError as closing_error:  # the peer closed inside a frame
                if conn.error is None:
                    conn.error = closing_error
                if conn.is_authenticated and not logged:
                    log.warning("%s: connection with %s ended badly: %s", self.name, conn.peer, closing_error)
            if exc is not None and not clean and not logged and conn.is_authenticated:
                log.warning("%s: connection with %s failed: %s", self.name, conn.peer, exc)
            if self._on_closed is not None:
                self._on_closed(conn)
            self._notify()

    def _notify(self) -> None:
        """Tell the runtime something happened (call with ``lock`` held)."""
        if self._on_event is not None:
            self._on_event()

    def _pump(self) -> None:
        """Pull messages from every handler while its connection is below the high watermark, and write."""
        conns = [c for c in self._connections.values() if not c.closed]
        if not conns:
            return
        with self.lock:
            self._dirty.clear()
            for conn in conns:
                if conn.write_error is None and not conn.write_shut:
                    self._fill(conn)
                    if conn.out:
                        self._write(conn)
        for conn in conns:
            if conn.write_error is not None and not conn.closed:
                self._drop(conn, conn.write_error, clean=False)
            if not conn.closed:
                self._maybe_half_close(conn)
                self._update_interest(conn)
        if self._dirty:  # a handler became ready while others were being filled: look again
            self.wakeup()

    def _fill(self, conn: Connection) -> None:
        handler = conn.handler
        on_send = self._on_send
        high_water = self._high_water
        out = conn.out
        while conn.out_bytes < high_water:
            message = handler.next_message()
            if message is None:
                return
            for chunk in encode(message):
                view = memoryview(chunk)
                if view.nbytes:
                    out.append(view)
                    conn.out_bytes += view.nbytes
            conn.messages_out += 1
            if on_send is not None:
                on_send(conn, message)

    def _write(self, conn: Connection) -> None:
        """Write what the socket takes now (``lock`` held; any thread). A failure is recorded for the I/O
        thread, which drops the connection."""
        out = conn.out
        sock = conn.sock
        while out:
            chunks = list(itertools.islice(out, _MAX_IOV))
            wanted = sum(c.nbytes for c in chunks)
            try:
                sent = sock.sendmsg(chunks)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                conn.write_error = exc
                out.clear()
                conn.out_bytes = 0
                return
            conn.bytes_out += sent
            conn.out_bytes -= sent
            remaining = sent
            while remaining:
                head = out[0]
                if head.nbytes <= remaining:
                    remaining -= head.nbytes
                    out.popleft()
                else:
                    out[0] = head[remaining:]
                    remaining = 0
            if sent < wanted:
                return  # the socket is full: wait for EVENT_WRITE

    def _maybe_half_close(self, conn: Connection) -> None:
        """A client whose handler closed (CloseRequest queued) shuts down its sending side once written."""
        if conn.role != "client" or conn.write_shut or conn.out:
            return
        handler = conn.handler
        with self.lock:  # no other thread writes while the sending side is shut
            if getattr(handler, "is_closed", False) and not handler.has_data() and not conn.out:
                conn.write_shut = True
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_WR)

    def _update_interest(self, conn: Connection) -> None:
        interest = 0
        if getattr(conn.handler, "is_reading", True):
            interest |= selectors.EVENT_READ
        if conn.out:
            interest |= selectors.EVENT_WRITE
        before = self._interest.get(conn.id, 0)
        if before == interest:
            return
        self._interest[conn.id] = interest
        if not interest:
            self._selector.unregister(conn.sock)
        elif not before:
            self._selector.register(conn.sock, interest, conn)
        else:
            self._selector.modify(conn.sock, interest, conn)

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        for conn in list(self._connections.values()):
            if not conn.closed and not conn.is_authenticated and now - conn.accepted_at >= self._handshake_timeout:
                self._record_rejection(
                    f"closing connection with {conn.peer}: no valid Hello within "
                    f"{self._handshake_timeout * 1000:.0f} ms of connecting "
                    f"(the authentication deadline, {self._handshake_setting})",
                    "handshake timeout",
                )
                self._drop(conn, ProtocolError("no Hello within the handshake timeout"), clean=False, logged=True)

    def _close_all(self) -> None:
        self._log_rejection_counts()
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for conn in [*self._connections.values(), *pending]:
            if not conn.closed:
                conn.closed = True
                with contextlib.suppress(OSError):
                    conn.sock.close()
        self._connections.clear()
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(Exception):
            self._selector.close()
