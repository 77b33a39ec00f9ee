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

The listener, its thread and what bounds every connection are
:class:`~spark_credit_shuffle.transport.line_service.LineService`'s: a request is verified over its raw
bytes before it is parsed, every line is parsed within bounds of size and nesting, a connection has
``request_timeout_s`` from its accept (TLS handshake included) to a verified request, at most
``max_pending`` connections wait for that (the oldest evicted first), a failure on one connection closes that
connection only, and a failure of the loop restarts it in place with every registered exchange kept.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import ProtocolError
from ...protocol.handshake import NONCE_BYTES, handshake_proof
from ...transport.authentication import unauthenticated_cap
from ...transport.connection import resolve_host
from ...transport.event_loop import ServicesByHost
from ...transport.line_service import LinePeer, LineService, Rejected, parse_bounded
from ...transport.tls import TlsIdentity, check_pinned
from .wire import (
    ANSWER_LABEL,
    MAX_HELLO,
    MAX_LINE,
    MAX_REQUEST,
    REQUEST_LABEL,
    SERVICE_LABEL,
    UNKNOWN_EXCHANGE,
    server_name,
    signed_line,
    split_signed,
)

__all__ = ["EXCHANGE_TTL_S", "MAX_CONNECTIONS", "REQUEST_TIMEOUT_S", "AddressRendezvous", "driver_rendezvous"]

log = logging.getLogger("spark_credit_shuffle")

#: How long a connection may take to send its request (from its accept, TLS handshake included), and to
#: take its answer.
REQUEST_TIMEOUT_S = 5.0
#: How long the service keeps an exchange's secret after its last request.
EXCHANGE_TTL_S = 600.0
#: Connections the service keeps open at once: those waiting to send their request (``max_pending`` of them
#: at most) and the tasks' waiting for their group.
MAX_CONNECTIONS = 4096


def driver_rendezvous(host: str) -> AddressRendezvous:
    """The rendezvous service of this driver process listening on ``host`` (started on first use, and again,
    on the same port with the same exchanges, if its thread ended)."""
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
        self.waiting: dict[int, LinePeer] = {}
        self.created = time.monotonic()


class _Conversation:
    """One connection's side of the conversation, after its hello: the exchange it named, both nonces, and
    the group it waits in."""

    __slots__ = ("exchange", "nonce", "state", "task_nonce", "waiting_in")

    def __init__(self, exchange: str, task_nonce: bytes, nonce: bytes) -> None:
        self.exchange = exchange
        self.task_nonce = task_nonce
        self.nonce = nonce
        self.state = "request"  # then "waiting", then "answer"
        self.waiting_in: tuple[tuple[str, str], int] | None = None  # (group key, task)


class AddressRendezvous(LineService):
    """The driver's address service: one listening socket and one daemon thread running a selector.

    ``register(name, secret, width)`` before the exchange's stage runs; tasks then call
    :func:`all_gather_via` with :attr:`address`. ``timeout_s`` bounds how long an incomplete group is
    kept, ``request_timeout_s`` how long a connection may take to send its request (from its accept) or take
    its answer, ``exchange_ttl_s`` how long an exchange's secret is kept after its last request;
    ``max_pending`` (default: derived from the registered exchanges' tasks) how many connections may wait to
    send their request at once; ``port`` where to listen (0: a free port).
    """

    label = "address rendezvous"
    auth_cause = "request timeout"
    first_line = "request"
    auth_setting = "request_timeout_s"
    idle_setting = "timeout_s"
    unauthenticated_setting = "max_pending"
    too_long_cause = "request too long"

    def __init__(
        self,
        host: str,
        *,
        timeout_s: float = 600.0,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        exchange_ttl_s: float = EXCHANGE_TTL_S,
        max_pending: int | None = None,
        port: int = 0,
    ) -> None:
        for name, value in (("timeout_s", timeout_s), ("exchange_ttl_s", exchange_ttl_s)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        super().__init__(
            host,
            port=port,
            auth_timeout_s=request_timeout_s,
            idle_timeout_s=timeout_s,
            max_connections=MAX_CONNECTIONS,
            max_unauthenticated=max_pending or 1,
            first_line_limit=MAX_HELLO,
            line_limit=MAX_REQUEST,
            thread_name="credit-shuffle-rendezvous",
        )
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s
        self.exchange_ttl_s = exchange_ttl_s
        self._max_pending = max_pending
        self._exchanges: dict[str, _Exchange] = {}
        #: TLS server name -> exchange (see :func:`~.wire.server_name`).
        self._server_names: dict[str, str] = {}
        self._tls_context: ssl.SSLContext | None = None  # made on the first TLS connection
        self._groups: dict[tuple[str, str], _Group] = {}
        self._lock = threading.Lock()
        self._start()

    def _successor(self, host: str, port: int) -> AddressRendezvous:
        successor = AddressRendezvous(
            host,
            timeout_s=self.timeout_s,
            request_timeout_s=self.request_timeout_s,
            exchange_ttl_s=self.exchange_ttl_s,
            max_pending=self._max_pending,
            port=port,
        )
        with self._lock:
            exchanges, names = dict(self._exchanges), dict(self._server_names)
        with successor._lock:
            successor._exchanges.update(exchanges)
            successor._server_names.update(names)
        return successor

    @property
    def exchanges(self) -> list[str]:
        """The names of the exchanges whose secret the service holds now."""
        with self._lock:
            return list(self._exchanges)

    @property
    def max_pending(self) -> int:
        """How many connections may wait to send their request at once."""
        if self._max_pending is not None:
            return self._max_pending
        with self._lock:
            tasks = sum(e.width for e in self._exchanges.values())
        return unauthenticated_cap(tasks)

    @property
    def max_unauthenticated(self) -> int:
        return self.max_pending

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
        reports a deterministic failure. With ``tls`` (the exchange's key pair) only over TLS pinned to it.
        Raises ValueError for a name too long for a task's hello (:data:`~.wire.MAX_HELLO`)."""
        if len(json.dumps(name)) > MAX_HELLO // 2:
            raise ValueError(f"exchange name of {len(name)} characters: at most {MAX_HELLO // 2} fit a task's hello")
        exchange = _Exchange(bytes(secret), int(width), on_failure, tls)
        with self._lock:
            self._exchanges[name] = exchange
            if tls is not None:
                self._server_names[server_name(name)] = name
        self.wakeup()

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
        self.wakeup()

    # -- the service thread --

    def tls_context(self) -> ssl.SSLContext | None:
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
        return self._tls_context

    def _choose_certificate(self, sock: Any, name: str | None, context: ssl.SSLContext) -> int | None:
        """TLS's server name callback: present the certificate of the exchange the task names (or refuse)."""
        with self._lock:
            exchange = self._exchanges.get(self._server_names.get(name or "", ""))
        if exchange is None or exchange.tls_context is None:
            return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
        sock.context = exchange.tls_context
        return None

    def on_line(self, peer: LinePeer, line: bytes) -> None:
        conversation = peer.data
        if conversation is None:
            self._on_hello(peer, line)
        elif conversation.state == "request":
            self._on_request(peer, conversation, line)
        else:  # a task that sent more after its request: it will not read its answer
            self.close_peer(peer)

    def on_closed(self, peer: LinePeer) -> None:
        conversation = peer.data
        if conversation is None or conversation.waiting_in is None:
            return
        key, task = conversation.waiting_in
        group = self._groups.get(key)
        if group is not None and group.waiting.get(task) is peer:
            # the task is gone before its group completed (failed, killed): its address with it, so that no
            # later attempt of the stage is handed it; the next attempt of that task sends its own
            del group.waiting[task]
            group.messages.pop(task, None)

    def on_restart(self) -> None:
        self._groups.clear()  # their connections are closed: the tasks fail, and their retries ask again

    def _on_hello(self, peer: LinePeer, line: bytes) -> None:
        """The task's first line names the exchange and brings its nonce: answer with the challenge."""
        try:
            hello = parse_bounded(line, max_bytes=MAX_HELLO)
            name = hello["exchange"]
            if not isinstance(name, str):
                raise TypeError(f"an exchange named by a {type(name).__name__}")
            task_nonce = bytes.fromhex(str(hello["nonce"]))
            if len(task_nonce) != NONCE_BYTES:
                raise ValueError(f"a nonce of {len(task_nonce)} bytes")
        except (ValueError, KeyError, TypeError) as exc:
            raise Rejected(f"bad request ({type(exc).__name__}: {str(exc)[:200]})", "bad request") from None
        with self._lock:
            known = self._exchanges.get(name)
        if known is None:
            self._unknown(peer, name)
            return
        sock = peer.sock
        if known.tls is not None:
            if not isinstance(sock, ssl.SSLSocket):
                raise Rejected(f"exchange {name!r} requires TLS, the connection is plain", "plain text for TLS")
            try:
                if sock.context is not known.tls_context:
                    raise ProtocolError("its TLS server name chose another exchange")
                check_pinned(sock, known.tls, peer.address)
            except ProtocolError as exc:
                raise Rejected(f"exchange {name!r}: {exc}", "wrong certificate") from None
        conversation = peer.data = _Conversation(name, task_nonce, secrets.token_bytes(NONCE_BYTES))
        peer.line_limit = MAX_REQUEST
        proof = handshake_proof(known.secret, SERVICE_LABEL, task_nonce, conversation.nonce)
        self.send(peer, (json.dumps({"nonce": conversation.nonce.hex(), "proof": proof.hex()}) + "\n").encode())

    def _unknown(self, peer: LinePeer, name: str) -> None:
        """Tell ``peer`` the exchange it named is unknown (logged first: the peer may look at the log once
        answered), then close it."""
        self.record(peer.address, f"{UNKNOWN_EXCHANGE} {name!r}", UNKNOWN_EXCHANGE)
        self.hold(peer, time.monotonic() + self.request_timeout_s)
        self.send(peer, (json.dumps({"error": UNKNOWN_EXCHANGE}) + "\n").encode(), close_after=True)

    def _on_request(self, peer: LinePeer, conversation: _Conversation, line: bytes) -> None:
        """The task's signed request: verified over its raw bytes, then parsed, then put in its group."""
        name = conversation.exchange
        try:
            proof, body = split_signed(line)
        except ValueError as exc:
            raise Rejected(f"bad request ({exc})", "bad request") from None
        with self._lock:
            known = self._exchanges.get(name)
        if known is None:
            self._unknown(peer, name)
            return
        expected = handshake_proof(known.secret, REQUEST_LABEL, conversation.nonce, conversation.task_nonce, body)
        if not hmac.compare_digest(proof, expected):
            raise Rejected("wrong secret (the task's proof does not verify)", "wrong secret")
        try:
            request = parse_bounded(body, max_bytes=MAX_REQUEST)
            group_id = str(request["group"])
            task, message = int(request["task"]), str(request["message"])
            attempt = int(request["attempt"])
            failure = request.get("failure")
            if failure is not None:
                failure = {"failed": str(failure["type"]), "message": str(failure["message"])[: MAX_LINE // 2]}
            stage = int(request.get("stage", -1))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise Rejected(f"bad request ({type(exc).__name__}: {str(exc)[:200]})", "bad request") from None
        self.authenticate(peer)
        now = time.monotonic()
        with self._lock:
            known.last_used = now
        if not 0 <= task < known.width:
            raise Rejected(f"task {task} outside [0, {known.width})", "task outside the exchange")
        if failure is not None or known.failure is not None:
            self._fail_exchange(peer, name, known, failure, stage)
            return
        key = (name, group_id)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(known.width)
        if attempt < group.attempts.get(task, -1):
            raise Rejected(
                f"task {task} attempt {attempt} is older than attempt {group.attempts[task]}", "older attempt"
            )
        previous = group.waiting.pop(task, None)
        if previous is not None:  # the same task again (a new attempt): the old one is gone
            self.close_peer(previous)
        group.messages[task] = message
        group.attempts[task] = attempt
        group.waiting[task] = peer
        conversation.state = "waiting"
        conversation.waiting_in = (key, task)
        self.hold(peer, group.created + self.timeout_s)  # the group's timeout bounds the wait
        if len(group.messages) == group.width:
            del self._groups[key]
            answer = json.dumps([group.messages[i] for i in range(group.width)])
            for waiting in list(group.waiting.values()):
                self._answer(waiting, answer, known.secret)

    def _fail_exchange(
        self, peer: LinePeer, name: str, known: _Exchange, failure: dict[str, str] | None, stage: int
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
            for waiting in list(self._groups.pop(key).waiting.values()):
                self._answer(waiting, answer, known.secret)
        self._answer(peer, answer, known.secret)
        if callback is not None:
            reason = f"{recorded['failed']}: {recorded['message']}"
            threading.Thread(target=callback, args=(stage, reason), name="credit-shuffle-failure", daemon=True).start()

    def _answer(self, peer: LinePeer, answer: str, secret: bytes) -> None:
        """Write ``answer`` (JSON text) to ``peer``, signed for its conversation, and close it once written."""
        conversation = peer.data
        body = answer.encode()
        proof = handshake_proof(secret, ANSWER_LABEL, conversation.task_nonce, conversation.nonce, body)
        conversation.state = "answer"
        conversation.waiting_in = None
        self.hold(peer, time.monotonic() + self.request_timeout_s)  # a task that does not take it: closed
        self.send(peer, signed_line(proof, body), close_after=True)

    def on_round(self, now: float) -> float | None:
        """Drop old groups and exchanges; when to look again."""
        with self._lock:
            for name, exchange in list(self._exchanges.items()):
                idle = now - exchange.last_used
                if idle > self.exchange_ttl_s and not any(key[0] == name for key in self._groups):
                    del self._exchanges[name]
                    self._server_names.pop(server_name(name), None)
                    log.info("address rendezvous: forgot exchange %s after %.0f s without a request", name, idle)
            known = set(self._exchanges)
            next_round = [e.last_used + self.exchange_ttl_s for e in self._exchanges.values()]
        for key, group in list(self._groups.items()):
            expired = now - group.created > self.timeout_s
            if expired or key[0] not in known:
                del self._groups[key]
                for waiting in list(group.waiting.values()):
                    self.close_peer(waiting)
                if expired:
                    log.warning(
                        "address rendezvous: group %s of %s incomplete after %.0f s (%d of %d tasks): dropped",
                        key[1],
                        key[0],
                        self.timeout_s,
                        len(group.messages),
                        group.width,
                    )
        next_round += [g.created + self.timeout_s for g in self._groups.values()]
        return min(next_round, default=None)


_SERVICES: ServicesByHost[AddressRendezvous] = ServicesByHost(AddressRendezvous, resolve_host)
