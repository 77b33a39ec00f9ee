"""One thread's selector over a listening socket and its connections, with a wakeup: Netty's event loop,
reduced to what the task's transport and the driver's address service both need.

:class:`EventLoop` owns the listener (bound to one address only, never a wildcard), a socket pair that
other threads write a byte to (:meth:`EventLoop.wakeup`) and the selector. Its thread calls
:meth:`EventLoop.poll`, which drains the wakeup and answers whether the listener has connections to accept
and which registered connections are ready: the owner reads those first and accepts after, so a peer
whose request arrived in the same round counts before a new connection can push it out.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["LISTEN_BACKLOG", "EventLoop", "ServicesByHost"]

#: Connections the kernel queues for a listener before its thread accepts them. A burst beyond the queue is
#: not refused but delayed: Linux drops the SYNs (or the handshakes' last ACKs) that do not fit, and the peer
#: sends them again a second later, so 300 connections arriving at once behind a queue of 64 lived up to a
#: second longer than the authentication deadline counted from their accept. Linux caps it at
#: ``net.core.somaxconn`` (4096 by default).
LISTEN_BACKLOG = 1024

_LISTENER = object()
#: Errors of a listener out of resources: the connection waits in the backlog, accepted a round later.
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
log = logging.getLogger("spark_credit_shuffle")
_WAKEUP = object()


class EventLoop:
    """A non-blocking listener on ``(host, port)`` (port 0: a free one) with a ``backlog``, a wakeup
    socket pair and a selector. Register connections with :attr:`selector` (their ``data`` is what
    :meth:`poll` hands back). Raises ``OSError`` if the address cannot be bound (nothing is left open)."""

    def __init__(self, host: str, port: int = 0, *, backlog: int = LISTEN_BACKLOG) -> None:
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind((host, port))
            self.listener.listen(backlog)
            self.listener.setblocking(False)
        except OSError:
            self.listener.close()
            self.selector.close()
            raise
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._woken = False
        self.selector.register(self.listener, selectors.EVENT_READ, _LISTENER)
        self.selector.register(self._wake_r, selectors.EVENT_READ, _WAKEUP)

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the listener is bound to."""
        host, port = self.listener.getsockname()[:2]
        return str(host), int(port)

    def wakeup(self, *, force: bool = False) -> None:
        """Make the loop's thread return from :meth:`poll` (thread-safe, cheap when already woken;
        ``force``: send a byte even so, e.g. to stop)."""
        if self._woken and not force:
            return
        self._woken = True
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def poll(self, timeout: float | None) -> tuple[bool, list[tuple[Any, int]]]:
        """Wait up to ``timeout`` seconds (None: until something happens): (whether the listener has
        connections to accept, the ``(data, event mask)`` of every ready connection)."""
        accept = False
        ready: list[tuple[Any, int]] = []
        for key, mask in self.selector.select(timeout):
            data = key.data
            if data is _LISTENER:
                accept = True
            elif data is _WAKEUP:
                self._drain_wakeup()
            else:
                ready.append((data, mask))
        return accept, ready

    def _drain_wakeup(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass
        # Cleared after draining: a wakeup racing with this sends one byte more (a spare loop), never one
        # less; whatever its caller queued before calling it is seen by the round that follows.
        self._woken = False

    def accept_some(self, limit: int, label: str, *, raise_unexpected: bool) -> Iterator[tuple[socket.socket, str]]:
        """The connections waiting on the listener, at most ``limit`` (the rest next round, after the other
        sockets were read again), each with its peer as ``"host:port"``. A listener out of file descriptors,
        buffers or memory is logged as ``label``'s and tried again next round; any other ``OSError`` is raised
        with ``raise_unexpected``, logged and left for the next round without."""
        for _ in range(limit):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if raise_unexpected and exc.errno not in _OUT_OF_RESOURCES:
                    raise
                log.warning("%s cannot accept a connection: %s", label, exc)
                return
            yield sock, f"{addr[0]}:{addr[1]}"

    def stop_accepting(self) -> None:
        """Close the listener (new connections are refused; the registered ones go on)."""
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.selector.unregister(self.listener)
        with contextlib.suppress(OSError):
            self.listener.close()

    def close(self) -> None:
        """Close the listener, the wakeup pair and the selector (the connections are the owner's)."""
        for sock in (self.listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(Exception):
            self.selector.close()


class _Service(Protocol):
    @property
    def is_alive(self) -> bool: ...

    def restarted(self) -> Any:
        """A new service of the same kind, on the same address and port if it is free, holding what this one
        held (its registrations), for a service whose thread ended."""
        ...


_S = TypeVar("_S", bound=_Service)


class ServicesByHost(Generic[_S]):
    """One service of a kind per process and listening host (the driver's address service, its monitor
    service), made by ``start(host)`` on first use. If its thread has ended, the next use restarts it with
    its ``restarted()``: on the same port (the exchanges built before it hold that address) with the same
    registrations, so that they do not fail with a refused connection."""

    def __init__(self, start: Callable[[str], _S], resolve: Callable[[str], str]) -> None:
        self._start = start
        self._resolve = resolve
        self._lock = threading.Lock()
        self._services: dict[str, _S] = {}

    def get(self, host: str) -> _S:
        """The service listening on ``host`` (resolved to an address first)."""
        address = self._resolve(host)
        with self._lock:
            service = self._services.get(address)
            if service is None:
                service = self._services[address] = self._start(address)
            elif not service.is_alive:
                service = self._services[address] = service.restarted()
            return service
