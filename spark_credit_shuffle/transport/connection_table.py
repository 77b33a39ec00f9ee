"""The transport's bookkeeping: the connections of one task and what its I/O thread knows of each.

:class:`ConnectionTable` is the lowest part of :class:`~.tcp.TcpTransport` (Flink's ``NettyConnectionManager``):
the listener and selector (:class:`~.event_loop.EventLoop`), every connection by id with the events the
selector watches for it, the connections still waiting to authenticate, those whose handler has something to
send (dirty) or that the I/O thread must look at in its next round (attention), the TLS connections holding
decrypted input the selector cannot see, and the count of rejected connections (:class:`~.authentication.RejectionLog`).
It adds connections, changes what the selector watches, half-closes, drops and discards them, and closes them
all. How bytes come in is :mod:`.connection_reading`'s, how connections are made :mod:`.connection_setup`'s,
the I/O thread and the writing :mod:`.tcp`'s.

Every method here runs in the I/O thread or with the task's ``lock`` held (the table is the I/O thread's,
the protocol objects the lock's), except :meth:`ConnectionTable.wakeup`, which any thread may call.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import selectors
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

from ..errors import ProtocolError
from .authentication import RejectionLog, rejection_cause
from .connection import Connection
from .event_loop import LISTEN_BACKLOG, EventLoop

__all__ = ["ConnectionTable"]

log = logging.getLogger("spark_credit_shuffle")


class ConnectionTable:
    """The listener, the selector and the connections of one task, with what is known of each.

    ``host`` and ``port``: the listener's address (port 0 picks a free one). ``lock`` guards every protocol
    object the handlers reach (re-entrant: handlers' callbacks may run while it is held). ``high_water`` and
    ``on_data_sent`` are how a connection's output is filled (:meth:`.Connection.fill`); ``on_event`` and
    ``on_closed`` what the runtime is told (see :class:`~.tcp.TcpTransport`).
    """

    def __init__(
        self,
        host: str,
        port: int,
        lock: Any,
        *,
        name: str,
        high_water: int,
        on_event: Callable[[], None] | None,
        on_data_sent: Callable[[Connection, int], None] | None,
        on_closed: Callable[[Connection], None] | None,
    ) -> None:
        self.lock = lock  # re-entrant: handlers' callbacks may run while the transport holds it
        self.name = name
        self._high_water = high_water
        self._on_event = on_event
        self._on_data_sent = on_data_sent
        self._on_closed = on_closed
        self._ids = itertools.count(1)
        self._loop = EventLoop(host, port, backlog=LISTEN_BACKLOG)
        self._selector = self._loop.selector
        self._connections: dict[int, Connection] = {}
        self._interest: dict[int, int] = {}
        #: Client connections opened by other threads (:meth:`~.connection_setup.ConnectionSetup.connect`),
        #: adopted by the I/O thread in its next round.
        self._pending: list[Connection] = []
        self._pending_lock = threading.Lock()
        #: Connections whose handler went from nothing to send to something to send (``lock`` held).
        self._dirty: set[Connection] = set()
        #: Connections the I/O thread looks at in its next round besides its events and the dirty ones: new
        #: ones, and those a writer thread left data or a state change in (I/O thread and ``lock`` only).
        self._attention: set[Connection] = set()
        #: Server connections still waiting to authenticate (their deadline is the I/O thread's timeout).
        self._unauthenticated: dict[int, Connection] = {}
        #: The nesting depth of each thread's ``sending()`` block (:class:`~.tcp.TcpTransport`).
        self._local = threading.local()
        self._thread: threading.Thread | None = None
        self._rejections = RejectionLog(self.name)
        #: TLS connections holding decrypted input the selector cannot see (I/O thread only).
        self._tls_readable: set[Connection] = set()

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

    def wakeup(self) -> None:
        """Wake the I/O thread for a round: it writes the dirty connections and looks at the ones marked for
        its attention (thread-safe, cheap when already woken)."""
        self._loop.wakeup()

    def _ready(self, conn: Connection) -> None:
        """A handler went from nothing to send to something to send (called with ``lock`` held)."""
        self._dirty.add(conn)
        if threading.current_thread() is self._thread:
            return  # the I/O thread pumps the dirty connections after handling its events
        if getattr(self._local, "depth", 0):
            return  # the calling thread writes at the end of its sending() block
        self.wakeup()

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

    def _notify(self) -> None:
        """Tell the runtime something happened (call with ``lock`` held)."""
        if self._on_event is not None:
            self._on_event()

    def _shut_write(self, conn: Connection) -> None:
        """Shut ``conn``'s sending side (a half-close: its peer reads the end, this side reads on)."""
        with self.lock:  # no other thread writes while the sending side is shut
            conn.write_shut = True
            with contextlib.suppress(OSError):
                # the TCP socket's own shutdown: SSLSocket.shutdown would also drop its TLS state, and what
                # the peer still sends has to be read through it
                socket.socket.shutdown(conn.sock, socket.SHUT_WR)

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
