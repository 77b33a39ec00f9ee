"""Failures that a retry repeats, reported by a task to the address service: from then on every task of
the exchange hears of the failure instead of its addresses, and raises it (see the package docstring)."""

from __future__ import annotations

import logging

from .... import errors
from ....errors import CreditShuffleError, ProtocolError
from ....transport.tls import TlsIdentity
from .wire import MAX_REQUEST, converse

__all__ = ["report_failure", "reported_error"]

log = logging.getLogger("spark_credit_shuffle")


def reported_error(kind: str, message: str) -> CreditShuffleError:
    """The error a task reported (``kind``: its class, as :func:`~spark_credit_shuffle.errors.qualified_name`
    gives), as its own class if that is one of this package's errors."""
    rebuilt = errors.rebuild(kind, message)
    return rebuilt if rebuilt is not None else CreditShuffleError(f"{kind}: {message}")


def report_failure(
    address: tuple[str, int],
    exchange: str,
    secret: bytes,
    stage: int,
    task: int,
    attempt: int,
    exc: BaseException,
    tls: TlsIdentity | None = None,
) -> bool:
    """Tell the rendezvous at ``address`` that task ``task`` of stage ``stage`` met ``exc``, a failure every
    retry repeats (best effort, a few seconds at most: the task fails with ``exc`` either way). True if the
    service took it (it answers with the failure it holds). ``tls``: as :func:`~.client.all_gather_via`."""
    failure = {"type": errors.qualified_name(exc), "message": str(exc)[: MAX_REQUEST // 4]}
    request = {
        "group": f"stage {stage}",
        "task": task,
        "attempt": attempt,
        "message": "",
        "stage": stage,
        "failure": failure,
    }
    try:
        answer = converse(address, exchange, secret, request, 5.0, tls)
    except (OSError, ValueError, ProtocolError) as e:
        # not news for the user: the task fails with ``exc`` all the same, and the usual reason is a driver that
        # already ended the exchange (another task's report failed the job first); a warning here printed after
        # the driver's own report of the error
        log.info("task %d of %s: could not report its failure to the driver: %s", task, exchange, e)
        return False
    return isinstance(answer, dict) and "failed" in answer
