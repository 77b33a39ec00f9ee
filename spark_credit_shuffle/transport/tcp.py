"""The TCP transport: the sans-IO protocol core driven over real sockets by one I/O thread.

One :class:`TcpTransport` per task (Flink's ``NettyConnectionManager``: the server, the client and the
connections of one task, with the I/O thread that drives them). It listens on the task's own address (never
a wildcard), accepts the connections of remote consumers (each served by a
:class:`~spark_credit_shuffle.protocol.PartitionRequestServerHandler`) and opens the task's connections
to remote producers (each a :class:`~spark_credit_shuffle.protocol.CreditBasedPartitionRequestClientHandler`).
All channels between two tasks share one connection, as Flink multiplexes all channels between two
TaskManagers. One daemon I/O thread runs a selector over every socket; the protocol objects are touched
only while holding the task's ``lock``, which the runtime shares, so the core stays single-threaded in
effect. Other threads that make something sendable (a producer adding data, a consumer recycling a buffer
into credit) reach the I/O thread through the handlers' ``listener`` hooks, which call :meth:`~TcpTransport.wakeup`.

The class is built in layers, one module each, so that each can be read alone:

- :mod:`.connection_table`: the bookkeeping (the listener and selector, the connections and what is known
  of each, adding, dropping and closing them);
- :mod:`.connection_reading`: reading one connection's bytes into its handler, TLS records included;
- :mod:`.connection_setup`: opening and accepting connections, their TLS handshakes and the authentication
  deadline and cap an accepted one must meet;
- this module: the I/O thread's rounds, the writing, and the end of a connection and of the transport.

A connection's output queue is :mod:`.connection`'s, the selector with its wakeup :mod:`.event_loop`'s, the
authentication limits :mod:`.authentication`'s and the TLS contexts :mod:`.tls`'s.

Writing follows Flink's "write while the channel is writable": messages are pulled from a handler only
while less than ``high_water`` bytes wait in the connection's output (Netty's write-buffer high
watermark), so a sender's buffer goes back to its pool only when the socket can take it. Payloads are
never copied before ``sendmsg``. A thread that makes something sendable inside :meth:`~TcpTransport.sending` (a
consumer returning credit, a producer adding data) writes it itself, without a non-blocking socket
write it cannot finish being anything but handed to the I/O thread: in Python every hand-over between
threads waits for the interpreter lock, and the credit loop (credit out, buffer back) is the latency
that bounds a channel's throughput.

Connections end with a half-close: a client whose handler sent ``CloseRequest`` (every channel on it
received its end of partition) shuts down its sending side once its output is written; the server sees
EOF, releases its readers and closes; the client sees that EOF and closes. No side closes a socket with
unread input, so no data is lost to a reset.
"""

from __future__ import annotations

import logging
import selectors
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ExchangeTimeoutError
from .authentication import (
    ACCEPTS_PER_ROUND,
    AUTHENTICATION_TIMEOUT_S,
    MAX_HELLO_BYTES,
    MIN_UNAUTHENTICATED,
    unauthenticated_cap,
)
from .connection import Connection, SansIOConnection, resolve_host
from .connection_setup import ConnectionSetup
from .tls import TlsIdentity

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


class TcpTransport(ConnectionSetup):
    """The listening socket, the connections and the I/O thread of one task.

    ``host`` is the task's own address; the listener binds to it only (port 0 picks a free port, see
    :attr:`address`). ``lock`` (a ``threading.RLock``) guards every protocol object the handlers reach
    (pass the runtime's).
    ``server_handler_factory(wakeup)`` builds the handler of an accepted connection (None: accept nothing).
    ``on_event()`` runs, with ``lock`` held, after input was processed or a connection closed, so waiting
    threads can look again; ``on_data_sent(connection, n)`` runs, with ``lock`` held, whenever ``n`` data
    buffers were pulled from a handler (progress). ``on_closed(connection)`` runs, with ``lock`` held, when a
    connection ends (its ``error`` tells why, None for a clean close). ``on_round()`` runs, without ``lock``, in
    every round after the sockets were read and before what is sendable is written: the owner's own work on
    this thread (a pipelined task's loop); it returns when it wants the next round (``time.monotonic()``; the
    round may come earlier).
    ``handshake_timeout_s`` is the authentication deadline of an accepted connection and
    ``max_unauthenticated`` how many may wait for it at once (:func:`unauthenticated_cap`);
    ``handshake_timeout_setting`` names where the deadline comes from in logs. ``tls``: the exchange's key
    pair, with which every connection runs mutual TLS (None: plain TCP).

    Its bookkeeping, reading and connection set-up are its base classes' (see the module's docstring):
    :meth:`connect`, :meth:`wakeup`, :attr:`connections` and the rejection counts come from there.
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
        on_round: Callable[[], float] | None = None,
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
        self._on_round = on_round
        #: When ``on_round`` wants the next round (``time.monotonic()``), None: when something happens.
        self._round_due: float | None = None
        super().__init__(
            host,
            port,
            lock,
            name=name or "transport",
            high_water=high_water,
            on_event=on_event,
            on_data_sent=on_data_sent,
            on_closed=on_closed,
            server_handler_factory=server_handler_factory,
            handshake_timeout_s=handshake_timeout_s,
            handshake_timeout_setting=handshake_timeout_setting,
            max_unauthenticated=max_unauthenticated,
            tls=tls,
        )
        self._sending_block = _SendingBlock(self)
        self._stopping = False
        #: When a lingering close ends (:meth:`close`'s ``linger_s``; monotonic seconds), None: no lingering.
        self._linger_until: float | None = None
        self._linger_started = False
        #: The exception that stopped the I/O thread, if any (a bug or an OS failure, not a peer's fault).
        self.error: BaseException | None = None
        #: CPU seconds the I/O thread used (set when it stops).
        self.thread_cpu_s = 0.0

    # -- public API ---------------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the listener is bound to."""
        return self._loop.address

    def start(self) -> None:
        """Start the I/O thread."""
        if self._thread is not None:
            raise RuntimeError("transport already started")
        self._thread = threading.Thread(target=self._run, name=f"credit-shuffle-loop-{self.name}", daemon=True)
        self._thread.start()

    @property
    def thread_ident(self) -> int:
        """The I/O thread's identifier (``threading.get_ident()`` in it); the transport must be started."""
        if self._thread is None or self._thread.ident is None:
            raise RuntimeError("transport not started")
        return self._thread.ident

    def on_own_thread(self) -> bool:
        """Whether the calling thread is the I/O thread."""
        return threading.current_thread() is self._thread

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
                if self._round_due is not None:
                    left = max(0.0, self._round_due - time.monotonic())
                    timeout = left if timeout is None else min(timeout, left)
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
                if self._on_round is not None and not self._stopping:
                    self._round_due = self._on_round()
                self._pump()
                if self._unauthenticated:
                    self._expire_handshakes()
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
