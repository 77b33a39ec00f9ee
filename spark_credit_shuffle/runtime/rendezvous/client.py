"""The task's side of the address service: an ``allGather`` through the driver's rendezvous."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ...errors import CreditShuffleError, ExchangeTimeoutError, ProtocolError
from ...transport.tls import TlsIdentity
from .failures import reported_error
from .wire import UNKNOWN_EXCHANGE, converse

__all__ = ["all_gather_via"]

log = logging.getLogger("spark_credit_shuffle")


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
) -> Callable[[str], list[str]]:
    """An ``allGather(message)`` for task ``task`` (task attempt id ``attempt``) through the rendezvous at
    ``address``.

    ``group`` names the stage (every task of it must use the same). Raises
    :class:`ExchangeTimeoutError` if the answer does not come within ``timeout_s``. If the service does
    not know the exchange (it forgot it, see :data:`~.service.EXCHANGE_TTL_S`), every task of the stage hears so, and
    ``fallback`` (Spark's ``allGather``) is used instead; without one, :class:`CreditShuffleError`. The
    conversation proves the secret both ways without sending it (:mod:`.wire`); with ``tls`` (the exchange's
    key pair) it runs inside mutual TLS pinned to it.
    """
    host, port = address

    def all_gather(message: str) -> list[str]:
        where = f"the driver's address service at {host}:{port}"
        started = time.monotonic()
        request = {"group": group, "task": task, "attempt": attempt, "message": message}
        try:
            answer: Any = converse((host, port), exchange, secret, request, timeout_s, tls)
        except TimeoutError:
            raise ExchangeTimeoutError(
                f"task {task} of {exchange} waited {(time.monotonic() - started) * 1000:.0f} ms for the addresses "
                f"of the other tasks from {where} (partition_request_timeout_ms); set "
                f"spark.creditShuffle.addressExchange=allgather if executors cannot reach the driver"
            ) from None
        except (OSError, ValueError, ProtocolError) as exc:
            raise CreditShuffleError(
                f"task {task} of {exchange}: exchanging addresses through {where} failed: {exc}; set "
                f"spark.creditShuffle.addressExchange=allgather if executors cannot reach the driver"
            ) from exc
        if isinstance(answer, dict) and answer.get("error") == UNKNOWN_EXCHANGE:
            if fallback is None:
                raise CreditShuffleError(f"task {task} of {exchange}: {where} answered: {UNKNOWN_EXCHANGE}")
            log.info(
                "task %d of %s: %s forgot the exchange; addresses through Spark's allGather", task, exchange, where
            )
            return fallback(message)
        if isinstance(answer, dict) and "failed" in answer:  # another task met a failure that retries repeat
            raise reported_error(str(answer["failed"]), str(answer.get("message", "")))
        if not isinstance(answer, list) or not all(isinstance(m, str) for m in answer):
            raise CreditShuffleError(f"task {task} of {exchange}: malformed answer from {where}")
        return answer

    return all_gather
