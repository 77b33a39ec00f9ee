"""The driver's address service (:class:`AddressRendezvous`): groups the tasks' requests per stage attempt
and answers each group once complete; turns away connections that do not authenticate; holds the failures
tasks reported (the package docstring says how).

**Stage attempts.** A request that names its stage is put in the group of its stage *attempt*, which the
driver's task scheduler tells from the task's attempt id (:mod:`.attempts`): a retried attempt never meets a
task of the attempt before it, whatever the order in which they come, and a task of an attempt that is over
(Spark failed it: a task of it failed, or it was killed with it) is told so (``{"stopped": ...}``) instead of
waiting. Groups still waiting are looked at again every :data:`OVER_CHECK_S`: the tasks of an attempt that
failed meanwhile stop at once, which frees their task slots for the next attempt, instead of waiting to be
killed (Spark's ``spark.python.task.killTimeout`` and more). Groups are so keyed by (stage, stage attempt),
as Spark's own ``BarrierCoordinator`` keys its barriers. Where the scheduler cannot tell (its fields could not
be read), a task joins the group of the newest attempt of its stage waiting, or else one keyed by the stage
alone: a look that fails never splits the tasks of one attempt into groups that wait for each other.

**The end barrier.** A task that finished its part of the exchange asks once more (``"end": true``) in a group
named by the address group it was wired with (its tasks, and none other), and ends only when all of them did:
no task of a stage attempt ends successfully unless every one of it got to its end, so a failed attempt
leaves no partition's output behind, and Spark re-runs the stage whole. If one of them leaves before (its
connection closes: it failed or was killed), the others are told (``{"stopped": ...}``) and fail too.

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

from ....errors import ProtocolError
from ....protocol.handshake import NONCE_BYTES, handshake_proof
from ....transport.authentication import unauthenticated_cap
from ....transport.connection import resolve_host
from ....transport.event_loop import ServicesByHost
from ....transport.line_service import LinePeer, LineService, Rejected, parse_bounded
from ....transport.tls import TlsIdentity, check_pinned
from .attempts import SparkStageAttempts, StageAttempts
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

__all__ = [
    "EXCHANGE_TTL_S",
    "MAX_CONNECTIONS",
    "OVER_CHECK_S",
    "REQUEST_TIMEOUT_S",
    "AddressRendezvous",
    "driver_rendezvous",
]

log = logging.getLogger("spark_credit_shuffle")

#: How long a connection may take to send its request (from its accept, TLS handshake included), and to
#: take its answer.
REQUEST_TIMEOUT_S = 5.0
#: How long the service keeps an exchange's secret after its last request.
EXCHANGE_TTL_S = 600.0
#: Connections the service keeps open at once: those waiting to send their request (``max_pending`` of them
#: at most) and the tasks' waiting for their group.
MAX_CONNECTIONS = 4096
#: How often the service asks the scheduler whether the stage attempt of a group still waiting is over.
OVER_CHECK_S = 0.2
#: The class of the error a task raises when told its stage attempt is over.
_STOPPED = "spark_credit_shuffle.errors.CreditShuffleError"
#: The class of the error a task raises when its group did not complete in time.
_TIMED_OUT = "spark_credit_shuffle.errors.ExchangeTimeoutError"

#: A group: (exchange, group name, stage attempt or None where the scheduler cannot tell).
GroupKey = tuple[str, str, int | None]


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
    """The messages of one stage attempt of one exchange, and the connections waiting for them; ``end``: the
    end barrier of one address group (a member that leaves fails it); ``stage`` and ``attempt``: the stage
    attempt, where the scheduler told it (looked at again from ``next_check`` on)."""

    __slots__ = ("attempt", "attempts", "created", "end", "messages", "next_check", "stage", "waiting", "width")

    def __init__(self, width: int, stage: int = -1, attempt: int | None = None, end: bool = False) -> None:
        self.width = width
        self.stage = stage
        self.attempt = attempt
        self.end = end
        self.messages: dict[int, str] = {}
        self.attempts: dict[int, int] = {}
        self.waiting: dict[int, LinePeer] = {}
        self.created = time.monotonic()
        self.next_check = self.created + OVER_CHECK_S


class _Conversation:
    """One connection's side of the conversation, after its hello: the exchange it named, both nonces, and
    the group it waits in."""

    __slots__ = ("exchange", "nonce", "state", "task_nonce", "waiting_in")

    def __init__(self, exchange: str, task_nonce: bytes, nonce: bytes) -> None:
        self.exchange = exchange
        self.task_nonce = task_nonce
        self.nonce = nonce
        self.state = "request"  # then "waiting", then "answer"
        self.waiting_in: tuple[GroupKey, int] | None = None  # (group key, task)


class AddressRendezvous(LineService):
    """The driver's address service: one listening socket and one daemon thread running a selector.

    ``register(name, secret, width)`` before the exchange's stage runs; tasks then call
    :func:`all_gather_via` with :attr:`address`. ``timeout_s`` bounds how long an incomplete group is
    kept, ``request_timeout_s`` how long a connection may take to send its request (from its accept) or take
    its answer, ``exchange_ttl_s`` how long an exchange's secret is kept after its last request;
    ``max_pending`` (default: derived from the registered exchanges' tasks) how many connections may wait to
    send their request at once; ``port`` where to listen (0: a free port); ``attempts`` tells the stage
    attempt of a task (default: this process's Spark scheduler, :class:`~.attempts.SparkStageAttempts`).
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
        attempts: StageAttempts | None = None,
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
        self._groups: dict[GroupKey, _Group] = {}
        #: End barriers a member left before they completed: what the others were told, until when it is kept.
        self._failed_ends: dict[GroupKey, tuple[str, float]] = {}
        self.attempts: StageAttempts = attempts if attempts is not None else SparkStageAttempts()
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
            attempts=self.attempts,
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
        conversation.waiting_in = None
        group = self._groups.get(key)
        if group is None or group.waiting.get(task) is not peer:
            return
        del group.waiting[task]
        if group.end:  # one of the tasks wired together will not end: none of them may
            reason = (
                f"task {task} of {key[0]} left the end of the exchange before every task of its "
                f"{_attempt(group)} "
                f"got there (it failed or was killed): this task fails with it, so that Spark re-runs the stage whole"
            )
            self._failed_ends[key] = (reason, time.monotonic() + self.timeout_s)
            self._stop_group(key, _STOPPED, reason)
            return
        # the task is gone before its group completed (failed, killed): its address with it, so that no task
        # is handed it; the next attempt of that task sends its own
        group.messages.pop(task, None)

    def on_restart(self) -> None:
        self._groups.clear()  # their connections are closed: the tasks fail, and their retries ask again
        self._failed_ends.clear()

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
            end = bool(request.get("end", False))
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
        # an end barrier is named by its address group, whose tasks are all of one stage attempt: the stage attempt
        # is looked up once, by the first of them, for the checks below and in on_round
        key: GroupKey = (name, group_id, None)
        failed = self._failed_ends.get(key) if end else None
        if failed is not None:
            self._answer(peer, _stopped(_STOPPED, failed[0]), known.secret)
            return
        stage_attempt: int | None = None
        if stage >= 0 and not (end and key in self._groups):  # a task of a Spark stage: of which stage attempt?
            found = self.attempts.attempt_of(stage, attempt)
            if found is not None and found.over:
                attempt_name = f"attempt {found.number} of stage {stage}" if found.number >= 0 else f"stage {stage}"
                log.info(
                    "address rendezvous: %s: task %d (task attempt %d) of a stage attempt that is over",
                    name,
                    task,
                    attempt,
                )
                self._answer(
                    peer,
                    _stopped(
                        _STOPPED,
                        f"task {task} (task attempt {attempt}) of {name} belongs to {attempt_name}, which is over "
                        f"(Spark failed it, or ended it for a later attempt): it stops, and takes part in no group",
                    ),
                    known.secret,
                )
                return
            if found is not None:
                stage_attempt = found.number
            elif not end:  # the scheduler cannot tell now: not split from the newest attempt's group waiting
                told = [k[2] for k in self._groups if k[:2] == (name, group_id) and k[2] is not None]
                stage_attempt = max(told, default=None)
        if not end:  # the addresses of its stage attempt's tasks, and of no other
            key = (name, group_id, stage_attempt)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(known.width, stage, stage_attempt, end)
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
        # the group's timeout bounds the wait (answered by on_round, with the tasks it waited for, just before)
        self.hold(peer, group.created + self.timeout_s + self.request_timeout_s)
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

    def _stop_group(self, key: GroupKey, kind: str, reason: str) -> None:
        """Answer every task waiting in group ``key`` that it stops (an error of class ``kind`` saying
        ``reason``), and forget the group."""
        group = self._groups.pop(key, None)
        if group is None:
            return
        with self._lock:
            known = self._exchanges.get(key[0])
        for waiting in list(group.waiting.values()):
            if known is not None:
                self._answer(waiting, _stopped(kind, reason), known.secret)
            else:
                self.close_peer(waiting)

    def _check_attempts(self, now: float) -> list[float]:
        """Stop the groups whose stage attempt the scheduler says is over; when to look again."""
        due: list[float] = []
        for key, group in list(self._groups.items()):
            if group.attempt is None:
                continue
            if now >= group.next_check:
                group.next_check = now + OVER_CHECK_S
                if self.attempts.is_over(group.stage, group.attempt):
                    waiting = sorted(group.waiting)
                    log.info(
                        "address rendezvous: %s: %s is over; stopping its tasks %s waiting for %s",
                        key[0],
                        _attempt(group),
                        waiting,
                        "the end" if group.end else "addresses",
                    )
                    waited = "the others to reach the end of the exchange" if group.end else "the others' addresses"
                    self._stop_group(
                        key,
                        _STOPPED,
                        f"{_attempt(group)} of {key[0]} is over (Spark failed it: one of its tasks failed, "
                        f"or the stage was cancelled) while this task waited for {waited}",
                    )
                    continue
            due.append(group.next_check)
        return due

    def on_round(self, now: float) -> float | None:
        """Drop old groups and exchanges; stop the groups of stage attempts that are over; when to look again."""
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
            if key[0] not in known:
                del self._groups[key]
                for waiting in list(group.waiting.values()):
                    self.close_peer(waiting)
            elif expired:
                missing = sorted(set(range(group.width)) - set(group.messages))
                log.warning(
                    "address rendezvous: group %s of %s incomplete after %.0f s (%d of %d tasks): dropped",
                    key[1],
                    key[0],
                    self.timeout_s,
                    len(group.messages),
                    group.width,
                )
                self._stop_group(
                    key,
                    _TIMED_OUT,
                    f"the tasks of {_attempt(group)} of {key[0]} waited {self.timeout_s:.0f} s for "
                    f"tasks {missing} {'to reach the end of the exchange' if group.end else 'to send their addresses'} "
                    f"(the address service's timeout_s)",
                )
        for key, (_, until) in list(self._failed_ends.items()):
            if now > until or key[0] not in known:
                del self._failed_ends[key]
        next_round += self._check_attempts(now)
        next_round += [g.created + self.timeout_s for g in self._groups.values()]
        next_round += [until for _, until in self._failed_ends.values()]
        return min(next_round, default=None)


def _stopped(kind: str, reason: str) -> str:
    """The answer that tells a task to stop, raising an error of class ``kind`` that says ``reason``."""
    return json.dumps({"stopped": kind, "message": reason[: MAX_LINE // 2]})


def _attempt(group: _Group) -> str:
    """The stage attempt of ``group``'s tasks, in words."""
    if group.attempt is None:
        return "stage attempt" if group.stage < 0 else f"attempt of stage {group.stage}"
    return f"attempt {group.attempt} of stage {group.stage}"


_SERVICES: ServicesByHost[AddressRendezvous] = ServicesByHost(AddressRendezvous, resolve_host)
