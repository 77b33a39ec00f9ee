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

Input from the wire is untrusted. Every accepted connection must prove it knows the exchange's secret (the
protocol's handshake, :mod:`~spark_credit_shuffle.protocol.handshake`; the secret itself never travels)
within ``handshake_timeout_s`` (counted from the accept) and within :data:`MAX_HELLO_BYTES`; a wrong proof,
garbage, an oversized frame length or a message out of turn raises
:class:`~spark_credit_shuffle.errors.ProtocolError` in the handler, and the transport closes that connection
only: the exchange carries on. At most ``max_unauthenticated`` connections wait to authenticate: when one
more arrives, whatever the waiting ones sent is read first (a peer whose response has arrived
authenticates), then the oldest one still unauthenticated is closed to make room, so a flood of silent
connections costs a bounded number of sockets and closes a legitimate peer only if ``max_unauthenticated``
newer connections arrive before its handshake is done: connected sockets are read before new connections are
accepted, and at most :data:`ACCEPTS_PER_ROUND` are accepted per round of the I/O thread. The limits, and
how rejections are counted and logged, are :mod:`.authentication`'s; the connection's output queue is
:mod:`.connection`'s and the selector with its wakeup :mod:`.event_loop`'s.

With ``tls`` (the exchange's :class:`~.tls.TlsIdentity`) every connection runs mutual TLS 1.3 pinned to
the exchange's certificate below the protocol (:mod:`.tls`). A client completes its TLS handshake in
:meth:`TcpTransport.connect`, blocking, within its connect timeout. An accepted socket completes it in the
I/O thread, non-blocking (``do_handshake`` until it no longer wants to read or write), counted as
unauthenticated: the deadline and the cap above hold for it too, and plain text or a wrong certificate
fails the handshake and closes that connection only. TLS decrypts whole records: bytes of a record already
read from the socket wait in the ``SSLSocket`` (``pending()``), where the selector cannot see them, so the
I/O thread reads a TLS connection until it would block and looks again (without waiting) at one that still
holds decrypted bytes when it stopped (its round's share read, or its handler not reading).

Connections end with a half-close: a client whose handler sent ``CloseRequest`` (every channel on it
received its end of partition) shuts down its sending side once its output is written; the server sees
EOF, releases its readers and closes; the client sees that EOF and closes. No side closes a socket with
unread input, so no data is lost to a reset.

One class, :class:`TcpTransport` (Flink's ``NettyConnectionManager``: the server, the client and the
connections of one task, with the I/O thread that drives them), makes this module a little over 500 lines.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ExchangeTimeoutError, ProtocolError
from .authentication import (
    ACCEPTS_PER_ROUND,
    AUTHENTICATION_TIMEOUT_S,
    MAX_HELLO_BYTES,
    MIN_UNAUTHENTICATED,
    RejectionLog,
    check_hello_bytes,
    expired_handshakes,
    handshake_wait,
    rejection_cause,
    unauthenticated_cap,
)
from .connection import Connection, SansIOConnection, resolve_host
from .event_loop import LISTEN_BACKLOG, EventLoop
from .tls import TlsIdentity, check_pinned

# The names the runtime and tests take from here: the transport and its connection and limits.
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

_RECV_SIZE = 256 * 1024


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
    threads can look again; ``on_data_sent(connection, n)`` runs, with ``lock`` held, whenever ``n`` data
    buffers were pulled from a handler (progress). ``on_closed(connection)`` runs, with ``lock`` held, when a connection
    ends (its ``error`` tells why, None for a clean close). ``on_round_end()`` runs, without ``lock``, at the end
    of every round of the I/O thread (what the round's input made ready can be announced once there).
    ``handshake_timeout_s`` is the authentication deadline of an accepted connection and
    ``max_unauthenticated`` how many may wait for it at once (:func:`unauthenticated_cap`);
    ``handshake_timeout_setting`` names where the deadline comes from in logs. ``tls``: the exchange's key
    pair, with which every connection runs mutual TLS (None: plain TCP).
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
        on_data_sent: Callable[[Connection, int], None] | None = None,
        on_closed: Callable[[Connection], None] | None = None,
        on_round_end: Callable[[], None] | None = None,
        name: str = "",
        port: int = 0,
        tls: TlsIdentity | None = None,
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
        self._on_data_sent = on_data_sent
        self._on_closed = on_closed
        self._on_round_end = on_round_end
        self._ids = itertools.count(1)
        self._loop = EventLoop(host, port, backlog=LISTEN_BACKLOG)
        self._selector = self._loop.selector
        self._connections: dict[int, Connection] = {}
        self._interest: dict[int, int] = {}
        self._pending: list[Connection] = []
        self._pending_lock = threading.Lock()
        self._dirty: set[Connection] = set()
        #: Connections the I/O thread looks at in its next round besides its events and the dirty ones: new
        #: ones, and those a writer thread left data or a state change in (I/O thread and ``lock`` only).
        self._attention: set[Connection] = set()
        #: Server connections still waiting to authenticate (their deadline is the I/O thread's timeout).
        self._unauthenticated: dict[int, Connection] = {}
        self._local = threading.local()
        self._sending_block = _SendingBlock(self)
        self._stopping = False
        #: When a lingering close ends (:meth:`close`'s ``linger_s``; monotonic seconds), None: no lingering.
        self._linger_until: float | None = None
        self._linger_started = False
        self._thread: threading.Thread | None = None
        #: The exception that stopped the I/O thread, if any (a bug or an OS failure, not a peer's fault).
        self.error: BaseException | None = None
        self._rejections = RejectionLog(self.name)
        #: CPU seconds the I/O thread used (set when it stops).
        self.thread_cpu_s = 0.0
        self.tls = tls
        self._server_tls = tls.server_context() if tls is not None else None
        self._client_tls = tls.client_context() if tls is not None else None
        #: TLS connections holding decrypted input the selector cannot see (I/O thread only).
        self._tls_readable: set[Connection] = set()

    # -- public API ---------------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the listener is bound to."""
        return self._loop.address

    @property
    def num_rejected(self) -> int:
        """Connections closed before or while authenticating, or for breaking the protocol."""
        return self._rejections.num_rejected

    @property
    def rejections(self) -> list[str]:
        """What the first 100 of them were closed for, as logged."""
        return self._rejections.rejections

    @property
    def rejected_by_cause(self) -> dict[str, int]:
        """Connections closed per cause (a short name: "evicted", "handshake timeout", a protocol error)."""
        return self._rejections.by_cause

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

    @property
    def thread_ident(self) -> int:
        """The I/O thread's identifier (``threading.get_ident()`` in it); the transport must be started."""
        if self._thread is None or self._thread.ident is None:
            raise RuntimeError("transport not started")
        return self._thread.ident

    def wakeup(self) -> None:
        """Wake the I/O thread for a round: it writes the dirty connections and looks at the ones marked for
        its attention (thread-safe, cheap when already woken)."""
        self._loop.wakeup()

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
                self._drain(conn)
                resumed = getattr(conn.handler, "is_reading", True) and not (
                    self._interest.get(conn.id, 0) & selectors.EVENT_READ
                )
                closing = conn.role == "client" and getattr(conn.handler, "is_closed", False)
                if conn.out or conn.write_error is not None or resumed or closing:
                    leftover = True
                    self._attention.add(conn)
        if leftover:
            # the I/O thread waits for the socket to drain, drops a failed connection, half-closes a client that
            # sent its CloseRequest, or reads again from a connection whose handler stopped reading (the model
            # without credits) and now resumed
            self.wakeup()

    def _drain(self, conn: Connection) -> None:
        """Pull the handler's messages and write them until it has none left or the socket is full (then
        ``conn.out`` keeps the rest for EVENT_WRITE); ``lock`` held."""
        while True:
            conn.fill(self._high_water, self._on_data_sent)
            if not conn.out:
                return
            conn.write()
            if conn.out or conn.write_error is not None:
                return

    def _ready(self, conn: Connection) -> None:
        """A handler went from nothing to send to something to send (called with ``lock`` held)."""
        self._dirty.add(conn)
        if threading.current_thread() is self._thread:
            return  # the I/O thread pumps the dirty connections after handling its events
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
        if self._client_tls is not None:
            sock = self._client_handshake(sock, peer, deadline)
        sock.setblocking(False)
        conn = Connection(sock, handler, "client", peer, next(self._ids))
        if hasattr(handler, "listener"):
            handler.listener = lambda: self._ready(conn)
        # The Hello goes out with the connect, from this thread: a producer whose port is flooded closes the
        # oldest connections waiting to authenticate, and this one must not wait for the I/O thread's turn
        # to present the secret.
        with self.lock:
            conn.fill(self._high_water, self._on_data_sent)
            conn.write()
        with self._pending_lock:
            self._pending.append(conn)
        self.wakeup()
        return conn

    def _client_handshake(self, sock: socket.socket, peer: str, deadline: float) -> ssl.SSLSocket:
        """The TLS handshake of a connection to ``peer``, blocking until ``deadline`` at the latest; raises
        :class:`ProtocolError` (TLS refused, or the peer's certificate is not the exchange's) or
        :class:`ExchangeTimeoutError`."""
        assert self._client_tls is not None and self.tls is not None
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            tls_sock = self._client_tls.wrap_socket(sock, server_side=False)
            check_pinned(tls_sock, self.tls, peer)
        except TimeoutError:
            sock.close()
            raise ExchangeTimeoutError(f"TLS handshake with {peer}: not done within the connect timeout") from None
        except (ssl.SSLError, OSError, ProtocolError) as exc:
            sock.close()
            raise ProtocolError(f"TLS handshake with {peer} failed: {exc}") from None
        return tls_sock

    def close(self, timeout_s: float = 10.0, *, linger_s: float = 0.0) -> None:
        """Stop the I/O thread (joining it within ``timeout_s``) and close every socket.

        ``linger_s`` > 0: a lingering close of the accepted connections. The I/O thread stops accepting,
        closes the others, writes what the accepted ones still have to send (a fatal ``ErrorResponse``), shuts
        their sending side and reads, until each peer closed or ``linger_s`` passed. Closing a socket with
        unread input makes the kernel answer with a reset, which can destroy the peer's unread copy of what
        was sent last: the failure's cause its consumer needs.

        Raises :class:`ExchangeTimeoutError` if the thread does not stop in time (its sockets are closed
        anyway).
        """
        if linger_s > 0:
            self._linger_until = time.monotonic() + linger_s
        self._stopping = True
        self._loop.wakeup(force=True)
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
            while not self._stopping or self._lingering():
                timeout = 0.0 if self._tls_readable else self._select_timeout()
                if self._linger_started:  # look again when the lingering ends at the latest
                    assert self._linger_until is not None
                    left = max(0.0, self._linger_until - time.monotonic())
                    timeout = left if timeout is None else min(timeout, left)
                accept, ready = self._loop.poll(timeout)
                touched = self._attention
                if self._tls_readable:  # decrypted input the selector cannot see
                    ready = [
                        (c, selectors.EVENT_READ)
                        for c in self._tls_readable
                        if getattr(c.handler, "is_reading", True)  # one that stopped is added when it resumes
                    ] + ready
                    self._tls_readable = set()
                for conn, mask in ready:
                    if not conn.closed:
                        touched.add(conn)
                        if conn.tls_handshaking:
                            self._tls_handshake(conn)
                            continue
                        if mask & selectors.EVENT_READ:
                            self._read(conn)
                        if mask & selectors.EVENT_WRITE and not conn.closed:
                            with self.lock:
                                conn.write()
                if accept and not self._stopping:  # after the other sockets were read: a handshake that arrived counts
                    self._accept()
                self._adopt_pending()
                self._pump()
                if self._unauthenticated:
                    self._expire_handshakes()
                if self._on_round_end is not None:
                    self._on_round_end()
        except BaseException as exc:  # a bug or an OS failure: make it visible to the runtime
            self.error = exc
            log.exception("I/O thread of %s failed", self.name)
            with self.lock:
                self._notify()
        finally:
            self.thread_cpu_s = time.thread_time() - started
            self._close_all()

    def _lingering(self) -> bool:
        """Whether the I/O thread serves another round after :meth:`close` asked for a lingering close (see
        there): it stops accepting, closes every connection but the authenticated accepted ones (also one
        adopted since) and half-closes those that wrote everything, until none is left open."""
        until = self._linger_until
        if until is None or time.monotonic() >= until:
            return False
        if not self._linger_started:
            self._linger_started = True
            self._loop.stop_accepting()
        for conn in list(self._connections.values()):
            if conn.role != "server" or not conn.is_authenticated:
                self._discard(conn)
        open_connections = [c for c in self._connections.values() if not c.closed]
        for conn in open_connections:
            if not conn.write_shut and not conn.out and not conn.handler.has_data():
                self._shut_write(conn)
        return bool(open_connections)

    def _discard(self, conn: Connection) -> None:
        """Close ``conn`` without telling its handler or the runtime (the transport is closing)."""
        with self.lock:
            conn.closed = True
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(conn.sock)
            self._interest.pop(conn.id, None)
            self._connections.pop(conn.id, None)
            self._unauthenticated.pop(conn.id, None)
            self._dirty.discard(conn)
            self._tls_readable.discard(conn)
            with contextlib.suppress(OSError):
                conn.sock.close()

    def _select_timeout(self) -> float | None:
        waiting = self._unauthenticated
        if not waiting:
            return None
        for conn_id in [i for i, c in waiting.items() if c.closed or c.is_authenticated]:
            del waiting[conn_id]
        return handshake_wait(waiting.values(), self._handshake_timeout, time.monotonic())

    def _adopt_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for conn in pending:
            self._add(conn)

    def _add(self, conn: Connection) -> None:
        self._connections[conn.id] = conn
        self._interest[conn.id] = selectors.EVENT_READ
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)
        self._attention.add(conn)
        if not conn.is_authenticated:
            self._unauthenticated[conn.id] = conn

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_ROUND):  # the rest next round, after the other sockets were read again
            try:
                sock, addr = self._loop.listener.accept()
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
            if self._server_tls is not None:
                try:
                    sock = self._server_tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (ssl.SSLError, OSError) as exc:
                    self._refuse(sock, peer, f"TLS refused: {exc}")
                    continue
            conn = Connection(sock, None, "server", f"client {peer}", next(self._ids))
            conn.tls_handshaking = conn.tls
            with self.lock:
                conn.handler = self._factory(functools.partial(self._ready, conn))
            self._add(conn)

    def _make_room(self) -> None:
        """Before accepting one more: if ``max_unauthenticated`` connections wait to authenticate, read what
        they sent (a response that arrived authenticates its peer), then close the oldest still waiting."""
        waiting = [c for c in self._unauthenticated.values() if not c.closed and not c.is_authenticated]
        if len(waiting) < self._max_unauthenticated:
            return
        for conn in waiting:
            if not conn.closed:
                if conn.tls_handshaking:
                    self._tls_handshake(conn)
                else:
                    self._read(conn)
        waiting = [c for c in waiting if not c.closed and not c.is_authenticated]
        if len(waiting) < self._max_unauthenticated:
            return
        oldest = min(waiting, key=lambda c: c.accepted_at)
        self._rejections.record(
            f"closing connection with {oldest.peer}: {len(waiting)} connections wait to authenticate, the limit "
            f"max_unauthenticated={self._max_unauthenticated} (from the expected peers) is reached and it is the "
            "oldest",
            "evicted unauthenticated",
        )
        self._drop(oldest, ProtocolError("closed unauthenticated to make room"), clean=False, logged=True)

    def _refuse(self, sock: socket.socket, peer: str, reason: str) -> None:
        self._rejections.record(f"refused connection from {peer}: {reason}", reason)
        sock.close()

    def _tls_handshake(self, conn: Connection) -> None:
        """One step of an accepted connection's TLS handshake (I/O thread); done, it reads what came with it."""
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket) and self.tls is not None
        lock = conn.tls_lock
        assert lock is not None
        try:
            with lock:
                sock.do_handshake()
            check_pinned(sock, self.tls, conn.peer)
        except ssl.SSLWantReadError:
            self._want(conn, write=False)
            return
        except ssl.SSLWantWriteError:
            self._want(conn, write=True)
            return
        except (ssl.SSLError, OSError, ProtocolError) as exc:
            reason = getattr(exc, "reason", None) or type(exc).__name__
            self._rejections.record(
                f"closing connection with {conn.peer}: TLS handshake failed: {exc}", f"TLS handshake failed: {reason}"
            )
            self._drop(conn, ProtocolError(f"TLS handshake failed: {exc}"), clean=False, logged=True)
            return
        conn.tls_handshaking = False
        self._want(conn, write=False)
        self._read(conn)

    def _want(self, conn: Connection, *, write: bool) -> None:
        """A TLS handshake waits for its socket to be writable (``write``) or readable."""
        conn.tls_want_write = write
        self._update_interest(conn)

    def _read(self, conn: Connection) -> None:
        if conn.tls:
            data = self._read_tls(conn)
            if data is None:
                return
        else:
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
                check_hello_bytes(conn)
            except ProtocolError as exc:
                self._reject(conn, exc)
                return
            finally:
                self._notify()

    def _read_tls(self, conn: Connection) -> bytes | None:
        """Decrypted input of a TLS connection, up to ``_RECV_SIZE`` bytes (``b""``: the peer closed; None:
        nothing now, or the connection was dropped). Reads until the socket would block: what a record
        already read holds is not seen by the selector; a connection left with some is looked at again."""
        sock = conn.sock
        lock = conn.tls_lock
        assert lock is not None
        chunks: list[bytes] = []
        size = 0
        eof = False
        while size < _RECV_SIZE:
            try:
                with lock:
                    chunk = sock.recv(_RECV_SIZE - size)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                eof = True  # close_notify, or the peer's half-close (it shuts its socket down without one)
                break
            except OSError as exc:
                self._drop(conn, exc, clean=False)
                return None
            if not chunk:
                eof = True
                break
            chunks.append(chunk)
            size += len(chunk)
        if size >= _RECV_SIZE or (chunks and eof):
            self._tls_readable.add(conn)  # more may wait decrypted (or the EOF after it): next round
        if chunks:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return b"" if eof else None

    def _reject(self, conn: Connection, exc: ProtocolError) -> None:
        """A peer broke the protocol (wrong secret, garbage, oversized frame): log it, close it, carry on."""
        self._rejections.record(f"closing connection with {conn.peer}: {exc}", rejection_cause(exc))
        self._drop(conn, exc, clean=False, logged=True)

    def _drop(self, conn: Connection, exc: BaseException | None, *, clean: bool, logged: bool = False) -> None:
        """Close ``conn`` and tell its handler (``clean``: the peer closed its side after a complete frame).

        Runs in the I/O thread, under ``lock`` so that no other thread writes to the socket meanwhile.
        """
        with self.lock:
            if conn.closed:
                return
            conn.error = exc
            self._discard(conn)
            conn.out.clear()
            conn.out_bytes = 0
            try:
                conn.handler.connection_closed()
            except ProtocolError as closing_error:  # the peer closed inside a frame
                if conn.error is None:
                    conn.error = closing_error
                if conn.is_authenticated and not logged:
                    log.info("%s: connection with %s ended badly: %s", self.name, conn.peer, closing_error)
            # info, not a warning: a peer's connection that fails reaches the user through the task's own error,
            # which names that peer (or, a knock-on of the peer's failure, is that failure); a warning printed
            # on a worker's stderr would come before the typed error the action raises
            if exc is not None and not clean and not logged and conn.is_authenticated:
                log.info("%s: connection with %s failed: %s", self.name, conn.peer, exc)
            if self._on_closed is not None:
                self._on_closed(conn)
            self._notify()

    def _notify(self) -> None:
        """Tell the runtime something happened (call with ``lock`` held)."""
        if self._on_event is not None:
            self._on_event()

    def _pump(self) -> None:
        """Pull messages from the handlers that have some and write them (below the high watermark), then look
        at every connection this round touched: its events, its handler's readiness, a writer thread's
        leftovers (see :meth:`flush`)."""
        with self.lock:
            touched, self._attention = self._attention, set()
            touched |= self._dirty
            self._dirty.clear()
            connections = self._connections  # one connected meanwhile is looked at once adopted (see _add)
            conns = [c for c in touched if not c.closed and c.id in connections]
            for conn in conns:
                if conn.write_error is None and not conn.write_shut:
                    self._drain(conn)
        for conn in conns:
            if conn.write_error is not None and not conn.closed:
                self._drop(conn, conn.write_error, clean=False)
            if not conn.closed:
                self._maybe_half_close(conn)
                self._update_interest(conn)
        if self._dirty:  # a handler became ready while others were being filled: look again
            self.wakeup()

    def _maybe_half_close(self, conn: Connection) -> None:
        """A client whose handler closed (CloseRequest queued) shuts down its sending side once written."""
        if conn.role != "client" or conn.write_shut or conn.out:
            return
        handler = conn.handler
        with self.lock:  # no other thread writes while the sending side is shut
            if getattr(handler, "is_closed", False) and not handler.has_data() and not conn.out:
                self._shut_write(conn)

    def _shut_write(self, conn: Connection) -> None:
        """Shut ``conn``'s sending side (a half-close: its peer reads the end, this side reads on)."""
        with self.lock:  # no other thread writes while the sending side is shut
            conn.write_shut = True
            with contextlib.suppress(OSError):
                # the TCP socket's own shutdown: SSLSocket.shutdown would also drop its TLS state, and what
                # the peer still sends has to be read through it
                socket.socket.shutdown(conn.sock, socket.SHUT_WR)

    def _update_interest(self, conn: Connection) -> None:
        interest = 0
        if conn.tls_handshaking:
            interest = selectors.EVENT_WRITE if conn.tls_want_write else selectors.EVENT_READ
        else:
            if getattr(conn.handler, "is_reading", True):
                interest |= selectors.EVENT_READ
                sock = conn.sock
                if isinstance(sock, ssl.SSLSocket) and sock.pending():  # decrypted, unseen by the selector
                    self._tls_readable.add(conn)
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
        for conn in expired_handshakes(list(self._unauthenticated.values()), self._handshake_timeout, time.monotonic()):
            if not conn.closed:  # the callbacks of an earlier drop may have closed it
                self._rejections.record(
                    f"closing connection with {conn.peer}: no completed handshake within "
                    f"{self._handshake_timeout * 1000:.0f} ms of connecting "
                    f"(the authentication deadline, {self._handshake_setting})",
                    "handshake timeout",
                )
                self._drop(conn, ProtocolError("no completed handshake within the deadline"), clean=False, logged=True)

    def _close_all(self) -> None:
        self._rejections.log_counts()
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for conn in [*self._connections.values(), *pending]:
            if not conn.closed:
                conn.closed = True
                with contextlib.suppress(OSError):
                    conn.sock.close()
        self._connections.clear()
        self._loop.close()
