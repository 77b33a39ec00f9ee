"""The task's side of the address service: an ``allGather`` through the driver's rendezvous, and the end
barrier of the tasks it wired together."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ....errors import CreditShuffleError, ExchangeTimeoutError, ProtocolError
from ....transport.tls import TlsIdentity
from .failures import reported_error
from .wire import UNKNOWN_EXCHANGE, converse

__all__ = ["END_WAIT_S", "all_gather_via", "end_barrier_via", "group_token"]

log = logging.getLogger("spark_credit_shuffle")

#: How long a task that finished its part waits at the end barrier for the others of its stage attempt (the
#: service's own bound on a group, ``timeout_s``, is as long by default): after every producer finished, what
#: is left to the slowest consumer is what its network buffers and output hold, behind however slow a step
#: follows it.
END_WAIT_S = 600.0


def group_token(messages: Sequence[str]) -> str:
    """A name for the group whose answer was ``messages``: the same for every task that got it (one stage
    attempt's tasks wired together), and different for any other group (other task attempts, ports, start
    times)."""
    digest = hashlib.sha256()
    for message in messages:
        digest.update(message.encode())
        digest.update(b"\n")
    return digest.hexdigest()[:32]


def _ask(
    address: tuple[str, int],
    exchange: str,
    secret: bytes,
    request: dict[str, Any],
    timeout_s: float,
    tls: TlsIdentity | None,
    waited_for: str,
) -> Any:
    """``request``'s answer from the service at ``address`` (a list of messages, or ``{"error": ...}`` for an
    exchange it does not know); raises what the service told the task to raise (``{"failed": ...}``: a failure a
    retry repeats, ``{"stopped": ...}``: its stage attempt is over, or its group timed out), and
    :class:`ExchangeTimeoutError` naming ``waited_for`` if no answer came within ``timeout_s``."""
    host, port = address
    task = request["task"]
    where = f"the driver's address service at {host}:{port}"
    started = time.monotonic()
    try:
        answer: Any = converse((host, port), exchange, secret, request, timeout_s, tls)
    except TimeoutError:
        raise ExchangeTimeoutError(
            f"task {task} of {exchange} waited {(time.monotonic() - started) * 1000:.0f} ms for {waited_for} "
            f"from {where}; set spark.creditShuffle.addressExchange=allgather if executors cannot reach the driver"
        ) from None
    except (OSError, ValueError, ProtocolError) as exc:
        raise CreditShuffleError(
            f"task {task} of {exchange}: waiting for {waited_for} from {where} failed: {exc}; set "
            f"spark.creditShuffle.addressExchange=allgather if executors cannot reach the driver"
        ) from exc
    if isinstance(answer, dict) and answer.get("error") == UNKNOWN_EXCHANGE:
        return answer
    if isinstance(answer, dict) and "failed" in answer:  # another task met a failure that retries repeat
        raise reported_error(str(answer["failed"]), str(answer.get("message", "")))
    if isinstance(answer, dict) and "stopped" in answer:  # its stage attempt is over, or its group timed out
        raise reported_error(str(answer["stopped"]), str(answer.get("message", "")))
    if not isinstance(answer, list) or not all(isinstance(m, str) for m in answer):
        raise CreditShuffleError(f"task {task} of {exchange}: malformed answer from {where}")
    return answer


def all_gather_via(
    address: tuple[str, int],
    exchange: str,
    secret: bytes,
    group: str,
    task: int,
    attempt: int,
    timeout_s: float,
    fallback: Callable[[str], list[str]] | None = None,
    tls: TlsIdentity | None = None,
    *,
    stage: int | None = None,
) -> Callable[[str], list[str]]:
    """An ``allGather(message)`` for task ``task`` (task attempt id ``attempt``) through the rendezvous at
    ``address``.

    ``group`` names the stage (every task of it must use the same); ``stage``, the Spark stage's id, lets the
    service put the task in the group of its stage attempt (see :mod:`.service`). Raises
    :class:`ExchangeTimeoutError` if the answer does not come within ``timeout_s``. If the service does
    not know the exchange (it forgot it, see :data:`~.service.EXCHANGE_TTL_S`), every task of the stage hears so, and
    ``fallback`` (Spark's ``allGather``) is used instead; without one, :class:`CreditShuffleError`. The
    conversation proves the secret both ways without sending it (:mod:`.wire`); with ``tls`` (the exchange's
    key pair) it runs inside mutual TLS pinned to it.
    """

    def all_gather(message: str) -> list[str]:
        request: dict[str, Any] = {"group": group, "task": task, "attempt": attempt, "message": message}
        if stage is not None:
            request["stage"] = stage
        waited_for = "the addresses of the other tasks (partition_request_timeout_ms)"
        answer = _ask(address, exchange, secret, request, timeout_s, tls, waited_for)
        if isinstance(answer, dict):  # the service forgot the exchange
            if fallback is None:
                raise CreditShuffleError(
                    f"task {task} of {exchange}: the driver's address service at {address[0]}:{address[1]} "
                    f"answered: {UNKNOWN_EXCHANGE}"
                )
            log.info(
                "task %d of %s: the driver's address service forgot the exchange; addresses through Spark's allGather",
                task,
                exchange,
            )
            return fallback(message)
        return list(answer)

    return all_gather


def end_barrier_via(
    address: tuple[str, int],
    exchange: str,
    secret: bytes,
    stage: int,
    task: int,
    attempt: int,
    timeout_s: float = END_WAIT_S,
    tls: TlsIdentity | None = None,
) -> Callable[[str], None]:
    """The end barrier of task ``task`` (task attempt id ``attempt``) of Spark stage ``stage``: called with the
    :func:`group_token` of the address group the task was wired with, it returns once every task of that group
    called it, and raises if one of them left first (failed, killed), if the stage attempt is over, or
    (:class:`ExchangeTimeoutError`) after ``timeout_s``. A service that forgot the exchange (whose tasks then
    used Spark's ``allGather``) is no barrier: it returns at once."""

    def end(token: str) -> None:
        request = {
            "group": f"stage {stage} end {token}",
            "task": task,
            "attempt": attempt,
            "message": "",
            "stage": stage,
            "end": True,
        }
        waited_for = "the other tasks of its stage attempt to reach the end of the exchange"
        _ask(address, exchange, secret, request, timeout_s, tls, waited_for)

    return end
