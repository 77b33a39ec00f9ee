"""Setting up a connection: opening one to a producer, accepting one from a consumer, its TLS handshake and
the authentication deadline it must meet.

Input from the wire is untrusted. Every accepted connection must prove it knows the exchange's secret (the
protocol's handshake, :mod:`~spark_credit_shuffle.protocol.handshake`; the secret itself never travels)
within ``handshake_timeout_s`` (counted from the accept) and within
:data:`~.authentication.MAX_HELLO_BYTES`; a wrong proof, garbage, an oversized frame length or a message out
of turn closes that connection only (:mod:`.connection_reading`): the exchange carries on. At most
``max_unauthenticated`` connections wait to authenticate: when one more arrives, whatever the waiting ones
sent is read first (a peer whose response has arrived authenticates), then the oldest one still
unauthenticated is closed to make room, so a flood of silent connections costs a bounded number of sockets
and closes a legitimate peer only if ``max_unauthenticated`` newer connections arrive before its handshake is
done: connected sockets are read before new connections are accepted, and at most
:data:`~.authentication.ACCEPTS_PER_ROUND` are accepted per round of the I/O thread. The limits, and how
rejections are counted and logged, are :mod:`.authentication`'s.

With ``tls`` (the exchange's :class:`~.tls.TlsIdentity`) every connection runs mutual TLS 1.3 pinned to
the exchange's certificate below the protocol (:mod:`.tls`). A client completes its TLS handshake in
:meth:`ConnectionSetup.connect`, blocking, within its connect timeout. An accepted socket completes it in the
I/O thread, non-blocking (``do_handshake`` until it no longer wants to read or write), counted as
unauthenticated: the deadline and the cap above hold for it too, and plain text or a wrong certificate
fails the handshake and closes that connection only.
"""

from __future__ import annotations

import functools
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from ..errors import ExchangeTimeoutError, ProtocolError
from .authentication import ACCEPTS_PER_ROUND, expired_handshakes, handshake_wait
from .connection import Connection, SansIOConnection
from .connection_reading import ConnectionReading
from .tls import TlsIdentity, check_pinned

__all__ = ["ConnectionSetup"]

log = logging.getLogger("spark_credit_shuffle")


class ConnectionSetup(ConnectionReading):
    """Opening and accepting connections, their TLS handshakes and authentication deadline.

    ``server_handler_factory(wakeup)`` builds the handler of an accepted connection (None: accept nothing).
    ``handshake_timeout_s`` is the authentication deadline of an accepted connection and
    ``max_unauthenticated`` how many may wait for it at once; ``handshake_timeout_setting`` names where the
    deadline comes from in logs. ``tls``: the exchange's key pair, with which every connection runs mutual
    TLS (None: plain TCP). The other arguments are :class:`~.connection_table.ConnectionTable`'s.
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
        server_handler_factory: Callable[[Callable[[], None]], SansIOConnection] | None,
        handshake_timeout_s: float,
        handshake_timeout_setting: str,
        max_unauthenticated: int,
        tls: TlsIdentity | None,
    ) -> None:
        self._factory = server_handler_factory
        self._handshake_timeout = handshake_timeout_s
        self._handshake_setting = handshake_timeout_setting
        self._max_unauthenticated = max_unauthenticated
        super().__init__(
            host,
            port,
            lock,
            name=name,
            high_water=high_water,
            on_event=on_event,
            on_data_sent=on_data_sent,
            on_closed=on_closed,
        )
        self.tls = tls
        self._server_tls = tls.server_context() if tls is not None else None
        self._client_tls = tls.client_context() if tls is not None else None

    # -- opening a connection (the caller's thread) ---------------------------------------------------

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

    # -- accepting a connection (the I/O thread) ------------------------------------------------------

    def _accept(self) -> None:
        for sock, peer in self._loop.accept_some(ACCEPTS_PER_ROUND, self.name, raise_unexpected=True):
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

    # -- the authentication deadline (the I/O thread) -------------------------------------------------

    def _select_timeout(self) -> float | None:
        waiting = self._unauthenticated
        if not waiting:
            return None
        for conn_id in [i for i, c in waiting.items() if c.closed or c.is_authenticated]:
            del waiting[conn_id]
        return handshake_wait(waiting.values(), self._handshake_timeout, time.monotonic())

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
