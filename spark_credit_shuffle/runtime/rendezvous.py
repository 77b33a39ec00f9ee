"""Where the tasks of a pipelined exchange learn each other's addresses: a small service on the driver.

Spark's own ``BarrierTaskContext.allGather`` does the job, but each call costs about a second (the task
polls the driver's barrier coordinator once a second), and during that second no consumer reads: the
producers fill their pools and wait. On a classic Spark session the driver runs one
:class:`AddressRendezvous` per process instead: every task of a barrier stage sends it one line (its
exchange's name and secret, the stage attempt it belongs to, its index and its message) and gets back, as
soon as every task index of that stage has arrived, every message in task order. A task that comes
again before its group is complete (a new attempt of the stage, after a failure) replaces its earlier
entry if its task attempt id is newer (Spark numbers task attempts in increasing order); an older one (a
late task of a failed attempt) is turned away. The barrier stage
still schedules all tasks at once and retries them together; only the address exchange is faster.

The service listens on the driver's own address only. Each exchange registers its random secret with it
(:meth:`AddressRendezvous.register`); a connection that presents a wrong secret, an unknown exchange, a
malformed or oversized request, or that says nothing within the timeout is closed and logged, and changes
nothing. A task that gets no answer within its timeout raises
:class:`~spark_credit_shuffle.errors.ExchangeTimeoutError` naming the service and what it waited for.
Spark Connect sessions (no driver process here) and ``TaskOptions(address_exchange="allgather")`` use
Spark's ``allGather``.

**Failures that a retry repeats.** A task that meets a deterministic failure (a null key, a custom
partitioner's function that raised: see :func:`~.common.is_deterministic`) reports it here
(:func:`report_failure`) before it fails. From then on every address request of that exchange, of the
attempt now waiting and of any later stage attempt, is answered with that failure, which the task raises at
once, and the exchange's ``on_failure`` callback (given at :meth:`AddressRendezvous.register`; the
pipelined runtime cancels the stage with it) runs once per stage: the exchange fails once, with the typed
error, instead of after every barrier stage attempt Spark allows.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import errors
from ..errors import CreditShuffleError, ExchangeTimeoutError
from ..transport.tcp import resolve_host

__all__ = ["AddressRendezvous", "all_gather_via", "driver_rendezvous", "report_failure"]

log = logging.getLogger("spark_credit_shuffle")

#: The longest request or answer line accepted (one address message per task is about 100 bytes).
MAX_LINE = 1 << 20
_LOCK = threading.Lock()
_SERVICES: dict[str, AddressRendezvous] = {}


def driver_rendezvous(host: str) -> AddressRendezvous:
    """The rendezvous service of this driver process listening on ``host`` (started on first use)."""
    address = resolve_host(host)
    with _LOCK:
        service = _SERVICES.get(address)
        if service is None or not service.is_alive:
            service = _SERVICES[address] = AddressRendezvous(address)
        return service


class _Group:
    """The messages of one stage attempt of one exchange, and the connections waiting for them."""

    __slots__ = ("attempts", "created", "messages", "waiting", "width")

    def __init__(self, width: int) -> None:
        self.width = width
        self.messages: dict[int, str] = {}
        self.attempts: dict[int, int] = {}
        self.waiting: dict[int, socket.socket] = {}
        self.created = time.monotonic()


class AddressRendezvous:
    """The driver's address service: one listening socket and one daemon thread per connection.

    ``register(name, secret, width)`` before the exchange's stage runs; tasks then call
    :func:`all_gather_via` with :attr:`address`. ``timeout_s`` bounds how long a connection may take to
    send its request and how long an incomplete group is kept.
    """

    def __init__(self, host: str, *, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self._exchanges: dict[str, tuple[bytes, int]] = {}
        self._failures: dict[str, dict[str, str]] = {}  # exchange -> {"failed": error type, "message": text}
        self._on_failure: dict[str, Callable[[int, str], None]] = {}
        self._failed_stages: set[tuple[str, int]] = set()
        self._groups: dict[tuple[str, str], _Group] = {}
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, 0))
            self._listener.listen(128)
        except OSError:
            self._listener.close()
            raise
        self.num_rejected = 0
        self._thread = threading.Thread(target=self._accept_loop, name="credit-shuffle-rendezvous", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def register(
        self, name: str, secret: bytes, width: int, on_failure: Callable[[int, str], None] | None = None
    ) -> None:
        """Accept the tasks of exchange ``name`` (``width`` per stage attempt) presenting ``secret``;
        ``on_failure(stage_id, reason)`` runs (on a thread of its own) the first time a task of a stage
        reports a deterministic failure."""
        with self._lock:
            self._exchanges[name] = (bytes(secret), int(width))
            if on_failure is not None:
                self._on_failure[name] = on_failure

    def failure(self, name: str) -> dict[str, str] | None:
        """The deterministic failure a task of exchange ``name`` reported, if any."""
        with self._lock:
            return self._failures.get(name)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()

    # -- service threads --

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve,
                args=(sock, f"{peer[0]}:{peer[1]}"),
                name="credit-shuffle-rendezvous-conn",
                daemon=True,
            ).start()

    def _reject(self, sock: socket.socket, peer: str, reason: str) -> None:
        self.num_rejected += 1
        log.warning("address rendezvous: closing connection from %s: %s", peer, reason)
        with contextlib.suppress(OSError):
            sock.close()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.settimeout(min(self.timeout_s, 60.0))
            line = _read_line(sock)
            request = json.loads(line)
            name, group_id = str(request["exchange"]), str(request["group"])
            task, message = int(request["task"]), str(request["message"])
            attempt = int(request["attempt"])
            secret = bytes.fromhex(str(request["secret"]))
            failure = request.get("failure")
            if failure is not None:
                failure = {"failed": str(failure["type"]), "message": str(failure["message"])[: MAX_LINE // 2]}
            stage = int(request.get("stage", -1))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._reject(sock, peer, f"bad request ({type(exc).__name__}: {exc})")
            return
        with self._lock:
            known = self._exchanges.get(name)
            if known is None or not hmac.compare_digest(secret, known[0]):
                reason = "unknown exchange" if known is None else "wrong secret"
            elif not 0 <= task < known[1]:
                reason = f"task {task} outside [0, {known[1]})"
            elif failure is not None or name in self._failures:
                reason = ""
            else:
                reason = ""
                self._expire()
                group = self._groups.get((name, group_id))
                if group is None:
                    group = self._groups[(name, group_id)] = _Group(known[1])
                complete = False
                if attempt < group.attempts.get(task, -1):
                    reason = f"task {task} attempt {attempt} is older than attempt {group.attempts[task]}"
                else:
                    previous = group.waiting.pop(task, None)
                    if previous is not None:  # the same task again (a new attempt): the old one is gone
                        with contextlib.suppress(OSError):
                            previous.close()
                    group.messages[task] = message
                    group.attempts[task] = attempt
                    group.waiting[task] = sock
                    complete = len(group.messages) == group.width
                    if complete:
                        del self._groups[(name, group_id)]
        if reason:
            self._reject(sock, peer, reason)
            return
        if failure is not None or name in self._failures:
            self._fail_exchange(sock, name, failure, stage)
            return
        if complete:
            answer = (json.dumps([group.messages[i] for i in range(group.width)]) + "\n").encode()
            for waiting in group.waiting.values():
                with contextlib.suppress(OSError):
                    waiting.settimeout(10.0)
                    waiting.sendall(answer)
                with contextlib.suppress(OSError):
                    waiting.close()

    def _fail_exchange(self, sock: socket.socket, name: str, failure: dict[str, str] | None, stage: int | None) -> None:
        """Record a reported failure (``failure`` given) and answer every task of the exchange waiting, and
        ``sock``, with it; run the exchange's ``on_failure`` once per stage."""
        callback = None
        waiting = [sock]
        with self._lock:
            if failure is not None:
                self._failures.setdefault(name, failure)
                if stage is not None and (name, stage) not in self._failed_stages:
                    self._failed_stages.add((name, stage))
                    callback = self._on_failure.get(name)
            recorded = self._failures[name]
            for key in [k for k in self._groups if k[0] == name]:
                waiting.extend(self._groups.pop(key).waiting.values())
        answer = (json.dumps(recorded) + "\n").encode()
        for waiter in waiting:
            with contextlib.suppress(OSError):
                waiter.settimeout(10.0)
                waiter.sendall(answer)
            with contextlib.suppress(OSError):
                waiter.close()
        if callback is not None and stage is not None:
            reason = f"{recorded['failed']}: {recorded['message']}"
            threading.Thread(target=callback, args=(stage, reason), name="credit-shuffle-failure", daemon=True).start()

    def _expire(self) -> None:
        """Drop groups that never completed within the timeout (lock held)."""
        now = time.monotonic()
        for key, group in list(self._groups.items()):
            if now - group.created > self.timeout_s:
                del self._groups[key]
                for waiting in group.waiting.values():
                    with contextlib.suppress(OSError):
                        waiting.close()


def _read_line(sock: socket.socket) -> str:
    """One line (without its newline) of at most :data:`MAX_LINE` bytes; raises ValueError otherwise."""
    chunks: list[bytes] = []
    size = 0
    while True:
        data = sock.recv(65536)
        if not data:
            raise ValueError("connection closed before the end of the line")
        end = data.find(b"\n")
        if end >= 0:
            chunks.append(data[:end])
            return b"".join(chunks).decode()
        chunks.append(data)
        size += len(data)
        if size > MAX_LINE:
            raise ValueError(f"line longer than {MAX_LINE} bytes")


def all_gather_via(
    address: tuple[str, int],
    exchange: str,
    secret: bytes,
    group: str,
    task: int,
    attempt: int,
    timeout_s: float,
) -> Callable[[str], list[str]]:
    """An ``allGather(message)`` for task ``task`` (task attempt id ``attempt``) through the rendezvous at
    ``address``.

    ``group`` names the stage (every task of it must use the same). Raises
    :class:`ExchangeTimeoutError` if the answer does not come within ``timeout_s``.
    """
    host, port = address

    def all_gather(message: str) -> list[str]:
        request = {
            "exchange": exchange,
            "group": group,
            "task": task,
            "attempt": attempt,
            "message": message,
            "secret": secret.hex(),
        }
        where = f"the driver's address service at {host}:{port}"
        started = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as sock:
                sock.sendall((json.dumps(request) + "\n").encode())
                sock.settimeout(max(0.01, timeout_s - (time.monotonic() - started)))
                answer: Any = json.loads(_read_line(sock))
        except TimeoutError:
            raise ExchangeTimeoutError(
                f"task {task} of {exchange} waited {(time.monotonic() - started) * 1000:.0f} ms for the addresses "
                f"of the other tasks from {where} (partition_request_timeout_ms); set "
                f"spark.creditShuffle.addressExchange=allgather if executors cannot reach the driver"
            ) from None
        except (OSError, ValueError) as exc:
            raise CreditShuffleError(
                f"task {task} of {exchange}: exchanging addresses through {where} failed: {exc}; set "
                f"spark.creditShuffle.addressExchange=allgather if executors cannot reach the driver"
            ) from exc
        if isinstance(answer, dict) and "failed" in answer:  # another task met a failure that retries repeat
            raise _reported_error(str(answer["failed"]), str(answer.get("message", "")))
        if not isinstance(answer, list) or not all(isinstance(m, str) for m in answer):
            raise CreditShuffleError(f"task {task} of {exchange}: malformed answer from {where}")
        return answer

    return all_gather


def _reported_error(kind: str, message: str) -> CreditShuffleError:
    """The error a task reported, as its own class if that is one of this package's partitioner errors."""
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.PartitionerError):
        return cls(message)
    return CreditShuffleError(f"{kind}: {message}")


def report_failure(
    address: tuple[str, int], exchange: str, secret: bytes, stage: int, task: int, attempt: int, exc: BaseException
) -> bool:
    """Tell the rendezvous at ``address`` that task ``task`` of stage ``stage`` met ``exc``, a failure every
    retry repeats (best effort, a few seconds at most: the task fails with ``exc`` either way). True if the
    service took it."""
    request = {
        "exchange": exchange,
        "group": f"stage {stage}",
        "task": task,
        "attempt": attempt,
        "message": "",
        "secret": secret.hex(),
        "stage": stage,
        "failure": {"type": type(exc).__name__, "message": str(exc)},
    }
    try:
        with socket.create_connection(address, timeout=5.0) as sock:
            sock.sendall((json.dumps(request) + "\n").encode())
            _read_line(sock)
        return True
    except (OSError, ValueError) as e:
        log.warning("task %d of %s: could not report its failure to the driver: %s", task, exchange, e)
        return False
