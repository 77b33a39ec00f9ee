"""The driver's address service (:class:`AddressRendezvous`): groups the tasks' requests per stage attempt
and answers each group once complete; turns away connections that do not authenticate; holds the failures
tasks reported (the package docstring says how).

Each connection is a conversation of :mod:`.wire`: the task's hello, the service's challenge, the task's
signed request, the service's signed answer. One listener serves exchanges with and without TLS: the first
byte a task sends tells them apart (a TLS record starts with 22, a JSON line with ``{``). A TLS connection
names the exchange in its server name (:func:`~.wire.server_name`); the service presents that exchange's
certificate and requires the same from the task (an unknown name is refused with TLS's
``unrecognized_name`` alert, which a task takes as "unknown exchange"). An exchange registered with a key
pair accepts no plain-text conversation, and a TLS conversation only for the exchange its server name
chose.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import secrets
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import ProtocolError
from ...protocol.handshake import NONCE_BYTES, handshake_proof
from ...transport.authentication import ACCEPTS_PER_ROUND, unauthenticated_cap
from ...transport.connection import resolve_host
from ...transport.event_loop import EventLoop, ServicesByHost
from ...transport.tls import TlsIdentity, check_pinned
from .wire import ANSWER_LABEL, MAX_LINE, MAX_REQUEST, REQUEST_LABEL, SERVICE_LABEL, UNKNOWN_EXCHANGE, server_name

__all__ = ["EXCHANGE_TTL_S", "REQUEST_TIMEOUT_S", "AddressRendezvous", "driver_rendezvous"]

log = logging.getLogger("spark_credit_shuffle")

#: How long a connection may take to send its request, and to take its answer.
REQUEST_TIMEOUT_S = 5.0
#: How long the service keeps an exchange's secret after its last request.
EXCHANGE_TTL_S = 600.0
#: How often a kind of rejection is logged at WARNING (the others in between are counted).
_LOG_WINDOW_S = 60.0


def driver_rendezvous(host: str) -> AddressRendezvous:
    """The rendezvous service of this driver process listening on ``host`` (started on first use)."""
    return _SERVICES.get(host)


class _Exchange:
    """A registered exchange: its secret, its tasks per stage attempt, and when it was last asked for; the
    failure a task reported (``{"failed": error class, "message": text}``), if any, and what to call then."""

    __slots__ = ("failed_stages", "failure", "last_used", "on_failure", "secret", "tls", "tls_context", "width")

    def __init__(
        self,
        secret: bytes,
        width: int,
        on_failure: Callable[[int, str], None] | None = None,
        tls: TlsIdentity | None = None,
    ) -> None:
        self.secret = secret
        self.tls = tls
        self.tls_context = tls.server_context() if tls is not None else None
        self.width = width
        self.last_used = time.monotonic()
        self.failure: dict[str, str] | None = None
        self.on_failure = on_failure
        self.failed_stages: set[int] = set()


class _Group:
    """The messages of one stage attempt of one exchange, and the connections waiting for them."""

    __slots__ = ("attempts", "created", "messages", "waiting", "width")

    def __init__(self, width: int) -> None:
        self.width = width
        self.messages: dict[int, str] = {}
        self.attempts: dict[int, int] = {}
        self.waiting: dict[int, _Peer] = {}
        self.created = time.monotonic()


class _Peer:
    """One connection: authenticating and reading its request, waiting for its group, or being written its
    answer."""

    __slots__ = (
        "accepted",
        "address",
        "answer",
        "close_after",
        "deadline",
        "exchange",
        "handshaking",
        "inbox",
        "nonce",
        "sent",
        "sniffed",
        "sock",
        "state",
        "task_nonce",
    )

    def __init__(self, sock: socket.socket, address: str, deadline: float) -> None:
        self.sock = sock
        self.address = address
        self.accepted = time.monotonic()
        self.deadline: float | None = deadline
        self.state = "request"  # then "waiting", then "answer"
        self.inbox = bytearray()
        self.answer = memoryview(b"")
        self.sent = 0
        self.close_after = False
        #: The first byte was looked at (TLS or not); a TLS handshake is under way.
        self.sniffed = False
        self.handshaking = False
        #: After the task's hello: the exchange it named, its nonce and the service's.
        self.exchange: str | None = None
        self.task_nonce = b""
        self.nonce = secrets.token_bytes(NONCE_BYTES)


class AddressRendezvous:
    """The driver's address service: one listening socket and one daemon thread running a selector.

    ``register(name, secret, width)`` before the exchange's stage runs; tasks then call
    :func:`all_gather_via` with :attr:`address`. ``timeout_s`` bounds how long an incomplete group is
    kept, ``request_timeout_s`` how long a connection may take to send its request or take its answer,
    ``exchange_ttl_s`` how long an exchange's secret is kept after its last request; ``max_pending``
    (default: derived from the registered exchanges' tasks) how many connections may wait to send their
    request at once.
    """

    def __init__(
        self,
        host: str,
        *,
        timeout_s: float = 600.0,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        exchange_ttl_s: float = EXCHANGE_TTL_S,
        max_pending: int | None = None,
    ) -> None:
        for name, value in (
            ("timeout_s", timeout_s),
            ("request_timeout_s", request_timeout_s),
            ("exchange_ttl_s", exchange_ttl_s),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s
        self.exchange_ttl_s = exchange_ttl_s
        self._max_pending = max_pending
        self._exchanges: dict[str, _Exchange] = {}
        #: TLS server name -> exchange (see :func:`~.wire.server_name`).
        self._server_names: dict[str, str] = {}
        self._tls_context: ssl.SSLContext | None = None  # made on the first TLS connection
        self._groups: dict[tuple[str, str], _Group] = {}
        self._peers: set[_Peer] = set()
        self._lock = threading.Lock()
        self._closing = False
        self._loop = EventLoop(host, backlog=128)
        self._selector = self._loop.selector
        self.num_rejected = 0
        #: Connections closed per cause since the service started.
        self.rejected_by_cause: dict[str, int] = {}
        self._log_window: dict[str, tuple[float, int]] = {}  # cause -> (window start, closed since logged)
        self._thread = threading.Thread(target=self._run, name="credit-shuffle-rendezvous", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._loop.address

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def exchanges(self) -> list[str]:
        """The names of the exchanges whose secret the service holds now."""
        with self._lock:
            return list(self._exchanges)

    @property
    def num_connections(self) -> int:
        """Open connections (reading a request, waiting for a group or being answered)."""
        return len(self._peers)

    @property
    def max_pending(self) -> int:
        """How many connections may wait to send their request at once."""
        if self._max_pending is not None:
            return self._max_pending
        with self._lock:
            tasks = sum(e.width for e in self._exchanges.values())
        return unauthenticated_cap(tasks)

    def register(
        self,
        name: str,
        secret: bytes,
        width: int,
        on_failure: Callable[[int, str], None] | None = None,
        tls: TlsIdentity | None = None,
    ) -> None:
        """Accept the tasks of exchange ``name`` (``width`` per stage attempt) that prove ``secret``;
        ``on_failure(stage_id, reason)`` runs (on a thread of its own) the first time a task of a stage
        reports a deterministic failure. With ``tls`` (the exchange's key pair) only over TLS pinned to it."""
        exchange = _Exchange(bytes(secret), int(width), on_failure, tls)
        with self._lock:
            self._exchanges[name] = exchange
            if tls is not None:
                self._server_names[server_name(name)] = name
        self._wakeup()

    def failure(self, name: str) -> dict[str, str] | None:
        """The deterministic failure a task of exchange ``name`` reported, if any."""
        with self._lock:
            known = self._exchanges.get(name)
            return None if known is None else known.failure

    def unregister(self, name: str) -> None:
        """Forget exchange ``name``: its secret now, its open groups (closing their connections) at once."""
        with self._lock:
            self._exchanges.pop(name, None)
            self._server_names.pop(server_name(name), None)
        self._wakeup()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the service thread (joined within ``timeout_s``) and close every socket."""
        self._closing = True
        self._wakeup()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _wakeup(self) -> None:
        self._loop.wakeup()

    # -- the service thread --

    def _run(self) -> None:
        try:
            while not self._closing:
                accept, ready = self._loop.poll(self._select_timeout())
                for peer, mask in ready:
                    if peer in self._peers:
                        if mask & selectors.EVENT_READ:
                            self._on_readable(peer)
                        if mask & selectors.EVENT_WRITE and peer in self._peers:
                            self._on_writable(peer)
                if accept:  # after the other sockets were read
                    self._accept()
                self._expire()
        except Exception:  # a bug or an OS failure: tasks then fail with a named error, not a hang
            log.exception("address rendezvous: the service thread failed")
        finally:
            for peer in list(self._peers):
                self._close(peer)
            self._loop.close()

    def _select_timeout(self) -> float:
        now = time.monotonic()
        deadlines = [p.deadline for p in self._peers if p.deadline is not None]
        deadlines += [g.created + self.timeout_s for g in self._groups.values()]
        with self._lock:
            deadlines += [e.last_used + self.exchange_ttl_s for e in self._exchanges.values()]
        deadlines += [start + _LOG_WINDOW_S for start, count in self._log_window.values() if count]
        if not deadlines:
            return 60.0
        return min(60.0, max(0.0, min(deadlines) - now))

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                sock, address = self._loop.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: try again next round
                log.warning("address rendezvous cannot accept a connection: %s", exc)
                return
            self._make_room()
            sock.setblocking(False)
            peer = _Peer(sock, f"{address[0]}:{address[1]}", time.monotonic() + self.request_timeout_s)
            self._peers.add(peer)
            self._selector.register(sock, selectors.EVENT_READ, peer)

    def _make_room(self) -> None:
        """Before accepting one more: if ``max_pending`` connections wait to send their request, read what
        they sent, then close the oldest still waiting."""
        limit = self.max_pending
        pending = [p for p in self._peers if p.state == "request"]
        if len(pending) < limit:
            return
        for peer in pending:
            self._on_readable(peer)
        pending = [p for p in pending if p in self._peers and p.state == "request"]
        if len(pending) >= limit:
            oldest = min(pending, key=lambda p: p.accepted)
            self._reject(
                oldest,
                f"{len(pending)} connections wait to send their request, the limit max_pending={limit} "
                "(from the registered exchanges' tasks) is reached and it is the oldest",
                "evicted unauthenticated",
            )

    def _on_readable(self, peer: _Peer) -> None:
        if peer.state == "request" and not peer.sniffed:
            self._sniff(peer)
            return
        if peer.handshaking:
            self._tls_step(peer)
            return
        try:
            data = self._recv(peer)
        except OSError as exc:
            if peer.state == "request":
                self._reject(peer, f"bad request ({type(exc).__name__}: {exc})", "connection error")
            else:
                self._leave(peer)
            return
        if data is None:
            return
        if peer.state != "request" or not data:
            if peer.state == "request":
                self._reject(peer, "bad request (connection closed before the end of the line)", "closed early")
            else:  # a task that sent more, or went away while it waited: it will not read its answer
                self._leave(peer)
            return
        end = data.find(b"\n")
        if end < 0:
            peer.inbox += data
            if len(peer.inbox) > MAX_REQUEST:
                self._reject(peer, f"bad request (longer than {MAX_REQUEST} bytes)", "request too long")
            return
        line = bytes(peer.inbox + data[:end])
        peer.inbox = bytearray(data[end + 1 :])
        if len(line) > MAX_REQUEST or len(peer.inbox) > MAX_REQUEST:
            self._reject(peer, f"bad request (longer than {MAX_REQUEST} bytes)", "request too long")
            return
        if peer.exchange is None:
            self._on_hello(peer, line)
        else:
            self._on_request(peer, line)

    def _recv(self, peer: _Peer) -> bytes | None:
        """What ``peer`` sent (``b""``: it closed; None: nothing yet). A TLS socket is read until it would
        block: bytes already decrypted wait where the selector cannot see them."""
        sock = peer.sock
        if not isinstance(sock, ssl.SSLSocket):
            try:
                return sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return None
        chunks: list[bytes] = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                chunk = b""
            if not chunk:
                return b"".join(chunks) if chunks else b""
            chunks.append(chunk)
            if sum(len(c) for c in chunks) > MAX_REQUEST:
                break
        return b"".join(chunks) if chunks else None

    def _sniff(self, peer: _Peer) -> None:
        """The first byte tells a TLS connection (a handshake record, 22) from a plain one."""
        try:
            first = peer.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._reject(peer, f"bad request ({type(exc).__name__}: {exc})", "connection error")
            return
        if not first:
            self._reject(peer, "bad request (connection closed before the end of the line)", "closed early")
            return
        peer.sniffed = True
        if first != b"\x16":
            self._on_readable(peer)
            return
        if self._tls_context is None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_3
            # the server name switches the connection to the exchange's context, which brings its certificate
            # and the one certificate it trusts; whether a client certificate is asked for stays this one's
            context.verify_mode = ssl.CERT_REQUIRED
            context.options |= getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)
            context.num_tickets = 0
            context.sni_callback = self._choose_certificate
            self._tls_context = context
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(peer.sock)
        try:
            peer.sock = self._tls_context.wrap_socket(peer.sock, server_side=True, do_handshake_on_connect=False)
        except (ssl.SSLError, OSError) as exc:
            self._reject(peer, f"TLS refused ({exc})", "TLS handshake failed")
            return
        self._selector.register(peer.sock, selectors.EVENT_READ, peer)
        peer.handshaking = True
        self._tls_step(peer)

    def _choose_certificate(self, sock: Any, name: str | None, context: ssl.SSLContext) -> int | None:
        """TLS's server name callback: present the certificate of the exchange the task names (or refuse)."""
        with self._lock:
            exchange = self._exchanges.get(self._server_names.get(name or "", ""))
        if exchange is None or exchange.tls_context is None:
            return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
        sock.context = exchange.tls_context
        return None

    def _tls_step(self, peer: _Peer) -> None:
        sock = peer.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._selector.modify(sock, selectors.EVENT_READ, peer)
            return
        except ssl.SSLWantWriteError:
            self._selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, peer)
            return
        except (ssl.SSLError, OSError) as exc:
            self._reject(peer, f"TLS handshake failed ({exc})", "TLS handshake failed")
            return
        peer.handshaking = False
        self._selector.modify(sock, selectors.EVENT_READ, peer)
        self._on_readable(peer)  # the hello may have come with the handshake's last record

    def _on_hello(self, peer: _Peer, line: bytes) -> None:
        """The task's first line names the exchange and brings its nonce: answer with the challenge."""
        try:
            hello = json.loads(line)
            name = str(hello["exchange"])
            task_nonce = bytes.fromhex(str(hello["nonce"]))
            if len(task_nonce) != NONCE_BYTES:
                raise ValueError(f"a nonce of {len(task_nonce)} bytes")
        except (ValueError, KeyError, TypeError) as exc:
            self._reject(peer, f"bad request ({type(exc).__name__}: {exc})", "bad request")
            return
        with self._lock:
            known = self._exchanges.get(name)
        if known is None:
            self._reject(peer, f"{UNKNOWN_EXCHANGE} {name!r}", UNKNOWN_EXCHANGE)
            return
        sock = peer.sock
        if known.tls is not None:
            if not isinstance(sock, ssl.SSLSocket):
                self._reject(peer, f"exchange {name!r} requires TLS, the connection is plain", "plain text for TLS")
                return
            try:
                if sock.context is not known.tls_context:
                    raise ProtocolError("its TLS server name chose another exchange")
                check_pinned(sock, known.tls, peer.address)
            except ProtocolError as exc:
                self._reject(peer, f"exchange {name!r}: {exc}", "wrong certificate")
                return
        peer.exchange = name
        peer.task_nonce = task_nonce
        proof = handshake_proof(known.secret, SERVICE_LABEL, task_nonce, peer.nonce)
        self._write(peer, (json.dumps({"nonce": peer.nonce.hex(), "proof": proof.hex()}) + "\n").encode())

    def _on_request(self, peer: _Peer, line: bytes) -> None:
        try:
            envelope = json.loads(line)
            text = str(envelope["request"])
            proof = bytes.fromhex(str(envelope["proof"]))
            request = json.loads(text)
            group_id = str(request["group"])
            task, message = int(request["task"]), str(request["message"])
            attempt = int(request["attempt"])
            failure = request.get("failure")
            if failure is not None:
                failure = {"failed": str(failure["type"]), "message": str(failure["message"])[: MAX_LINE // 2]}
            stage = int(request.get("stage", -1))
        except (ValueError, KeyError, TypeError) as exc:
            self._reject(peer, f"bad request ({type(exc).__name__}: {exc})", "bad request")
            return
        name = peer.exchange
        assert name is not None
        now = time.monotonic()
        with self._lock:
            known = self._exchanges.get(name)
        if known is None:
            self._reject(peer, f"{UNKNOWN_EXCHANGE} {name!r}", UNKNOWN_EXCHANGE)
            return
        expected = handshake_proof(known.secret, REQUEST_LABEL, peer.nonce, peer.task_nonce, text.encode())
        if not hmac.compare_digest(proof, expected):
            self._reject(peer, "wrong secret (the task's proof does not verify)", "wrong secret")
            return
        with self._lock:
            known.last_used = now
        if not 0 <= task < known.width:
            self._reject(peer, f"task {task} outside [0, {known.width})", "task outside the exchange")
            return
        if failure is not None or known.failure is not None:
            self._fail_exchange(peer, name, known, failure, stage)
            return
        group = self._groups.get((name, group_id))
        if group is None:
            group = self._groups[(name, group_id)] = _Group(known.width)
        if attempt < group.attempts.get(task, -1):
            self._reject(
                peer, f"task {task} attempt {attempt} is older than attempt {group.attempts[task]}", "older attempt"
            )
            return
        previous = group.waiting.pop(task, None)
        if previous is not None:  # the same task again (a new attempt): the old one is gone
            self._close(previous)
        group.messages[task] = message
        group.attempts[task] = attempt
        group.waiting[task] = peer
        peer.state = "waiting"
        peer.deadline = None  # the group's timeout bounds the wait
        if len(group.messages) == group.width:
            del self._groups[(name, group_id)]
            answer = json.dumps([group.messages[i] for i in range(group.width)])
            for waiting in group.waiting.values():
                self._answer(waiting, answer, known.secret)

    def _fail_exchange(
        self, peer: _Peer, name: str, known: _Exchange, failure: dict[str, str] | None, stage: int
    ) -> None:
        """Record a reported failure (``failure`` given), answer ``peer`` and every task of the exchange
        waiting for its group with it, and run the exchange's ``on_failure`` once per stage."""
        callback = None
        with self._lock:
            if failure is not None:
                if known.failure is None:
                    known.failure = failure
                if stage not in known.failed_stages:
                    known.failed_stages.add(stage)
                    callback = known.on_failure
            recorded = known.failure
        assert recorded is not None
        answer = json.dumps(recorded)
        for key in [k for k in self._groups if k[0] == name]:
            for waiting in self._groups.pop(key).waiting.values():
                self._answer(waiting, answer, known.secret)
        self._answer(peer, answer, known.secret)
        if callback is not None:
            reason = f"{recorded['failed']}: {recorded['message']}"
            threading.Thread(target=callback, args=(stage, reason), name="credit-shuffle-failure", daemon=True).start()

    def _answer(self, peer: _Peer, answer: str, secret: bytes) -> None:
        """Write ``answer`` (JSON text) to ``peer``, signed for its conversation, and close it once written."""
        proof = handshake_proof(secret, ANSWER_LABEL, peer.task_nonce, peer.nonce, answer.encode())
        peer.state = "answer"
        peer.deadline = time.monotonic() + self.request_timeout_s
        self._write(peer, (json.dumps({"answer": answer, "proof": proof.hex()}) + "\n").encode(), close_after=True)

    def _write(self, peer: _Peer, line: bytes, *, close_after: bool = False) -> None:
        """Write ``line`` to ``peer`` (the rest when its socket is writable); close it once written if
        ``close_after``, else go on reading it."""
        peer.answer = memoryview(line)
        peer.sent = 0
        peer.close_after = close_after
        self._on_writable(peer)
        if peer in self._peers and peer.sent < len(peer.answer):
            self._selector.modify(peer.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, peer)

    def _on_writable(self, peer: _Peer) -> None:
        if peer.handshaking:
            self._tls_step(peer)
            return
        if peer.sent >= len(peer.answer):
            return
        try:
            peer.sent += peer.sock.send(peer.answer[peer.sent :])
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return
        except OSError:
            self._close(peer)
            return
        if peer.sent >= len(peer.answer):
            if peer.close_after:
                self._close(peer)
            else:
                peer.answer = memoryview(b"")
                peer.sent = 0
                self._selector.modify(peer.sock, selectors.EVENT_READ, peer)

    def _leave(self, peer: _Peer) -> None:
        """A task's connection ended while it waited for its group or its answer: forget the connection."""
        for group in self._groups.values():
            for task, waiting in list(group.waiting.items()):
                if waiting is peer:
                    del group.waiting[task]
        self._close(peer)

    def _reject(self, peer: _Peer, reason: str, cause: str) -> None:
        """Close ``peer`` for ``reason``; log ``cause`` at WARNING once per window, count the rest."""
        self.num_rejected += 1
        self.rejected_by_cause[cause] = self.rejected_by_cause.get(cause, 0) + 1
        text = f"address rendezvous: closing connection from {peer.address}: {reason}"
        if cause not in self._log_window:
            self._log_window[cause] = (time.monotonic(), 0)
            log.warning("%s (more of this cause within %.0f s are counted, not logged)", text, _LOG_WINDOW_S)
        else:
            start, count = self._log_window[cause]
            self._log_window[cause] = (start, count + 1)
            log.debug("%s", text)
        if cause == UNKNOWN_EXCHANGE:  # logged first: the peer may look at the log once it is answered
            peer.state = "answer"
            peer.deadline = time.monotonic() + self.request_timeout_s
            self._write(peer, (json.dumps({"error": UNKNOWN_EXCHANGE}) + "\n").encode(), close_after=True)
        else:
            self._close(peer)

    def _close(self, peer: _Peer) -> None:
        if peer not in self._peers:
            return
        self._peers.discard(peer)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(peer.sock)
        with contextlib.suppress(OSError):
            peer.sock.close()

    def _expire(self) -> None:
        """Close connections past their deadline, drop old groups and exchanges, log the counts."""
        now = time.monotonic()
        for peer in [p for p in self._peers if p.deadline is not None and now >= p.deadline]:
            if peer.state == "request":
                self._reject(
                    peer,
                    f"no request within {self.request_timeout_s * 1000:.0f} ms of connecting (request_timeout_s)",
                    "request timeout",
                )
            else:
                self._close(peer)  # a task that does not take its answer
        with self._lock:
            for name, exchange in list(self._exchanges.items()):
                idle = now - exchange.last_used
                if idle > self.exchange_ttl_s and not any(key[0] == name for key in self._groups):
                    del self._exchanges[name]
                    self._server_names.pop(server_name(name), None)
                    log.info("address rendezvous: forgot exchange %s after %.0f s without a request", name, idle)
            known = set(self._exchanges)
        for key, group in list(self._groups.items()):
            expired = now - group.created > self.timeout_s
            if expired or key[0] not in known:
                del self._groups[key]
                for waiting in group.waiting.values():
                    self._close(waiting)
                if expired:
                    log.warning(
                        "address rendezvous: group %s of %s incomplete after %.0f s (%d of %d tasks): dropped",
                        key[1],
                        key[0],
                        self.timeout_s,
                        len(group.messages),
                        group.width,
                    )
        for cause, (start, count) in list(self._log_window.items()):
            if now - start >= _LOG_WINDOW_S:
                del self._log_window[cause]
                if count:
                    log.warning(
                        "address rendezvous: closed %d more connections in %.0f s: %s", count, now - start, cause
                    )


_SERVICES: ServicesByHost[AddressRendezvous] = ServicesByHost(AddressRendezvous, resolve_host)
