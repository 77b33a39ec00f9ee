"""Where the tasks of a pipelined exchange learn each other's addresses: a small service on the driver.

Spark's own ``BarrierTaskContext.allGather`` does the job, but each call costs about a second (the task
polls the driver's barrier coordinator once a second), and during that second no consumer reads: the
producers fill their pools and wait. On a classic Spark session the driver runs one
:class:`AddressRendezvous` per process instead: every task of a barrier stage sends it one request (its
exchange's name, its stage, its index, its task attempt id and its message; signed with the exchange's
secret after the service proved it knows it, see :mod:`.wire`, and inside TLS when the exchange runs it) and
gets back, as soon as every task index of its stage attempt has arrived, every message in task order. The
barrier stage still schedules all tasks at once and retries them together; only the address exchange is
faster.

The service listens on the driver's own address only. Each exchange registers its random secret (and its
key pair, with TLS) with it (:meth:`AddressRendezvous.register`); a connection that proves a wrong secret,
sends a malformed or oversized line (more than :data:`MAX_REQUEST` bytes), or has not sent its request
within ``request_timeout_s`` is closed and changes nothing. A task that gets no answer within its timeout raises
:class:`~spark_credit_shuffle.errors.ExchangeTimeoutError` naming the service and what it waited for.
Spark Connect sessions (no driver process here) and ``TaskOptions(address_exchange="allgather")`` use
Spark's ``allGather``.

The service is hardened against peers that never authenticate: one thread runs a selector over every
socket (no thread per connection, no blocking read), at most ``max_pending`` connections wait to send their
request (:func:`~spark_credit_shuffle.transport.tcp.unauthenticated_cap` of the registered exchanges' tasks:
when one more arrives the oldest waiting one is closed), and a request or an answer not done within
``request_timeout_s`` closes its connection. Connections that sent a valid request wait for their group
(at most one per task of a registered exchange). A group's addresses are forgotten as soon as every task
got them (or ``timeout_s`` after it started, if it never completes), and an exchange's secret
``exchange_ttl_s`` after its last request: a later run of that exchange is told "unknown exchange", and
its tasks fall back to Spark's ``allGather`` (all of them: every request of that run gets the same answer).
:meth:`AddressRendezvous.unregister` forgets an exchange at once. Each kind of rejection is logged at
WARNING once per minute (the limit and the peer), with a count of the others.

**Failures that a retry repeats.** A task that meets a deterministic failure (a null key, a custom
partitioner's function that raised: see :func:`~spark_credit_shuffle.errors.is_deterministic`) reports it here
(:func:`report_failure`) before it fails. From then on every address request of that exchange, of the
attempt now waiting and of any later stage attempt, is answered with that failure, which the task raises at
once, and the exchange's ``on_failure`` callback (given at :meth:`AddressRendezvous.register`; the
pipelined runtime cancels the stage with it) runs once per stage: the exchange fails once, with the typed
error, instead of after every barrier stage attempt Spark allows.

**Retries.** Spark re-runs a failed barrier stage whole, as a new stage attempt with the same stage id (and
``attemptNumber()`` 0 in every task). A request names its stage, and the service groups it with the tasks
of its stage *attempt*, which the driver's task scheduler tells from the task's attempt id
(:mod:`.attempts`): a retried attempt is never handed an address of the attempt before it, a task of an
attempt that is over is told to stop, and the tasks of one that fails while they wait stop within
:data:`~.service.OVER_CHECK_S`. A task that finished its part waits at an end barrier for the tasks it was
wired with (:func:`end_barrier_via`), so that no task of an attempt ends successfully unless all of them do:
Spark keeps the output of a task that finished, and would otherwise re-run only the others.

The package: :mod:`.service` (the driver's service), :mod:`.client` (the task's ``allGather`` and end
barrier), :mod:`.attempts` (the stage attempt of a task, from the driver's scheduler), :mod:`.failures`
(reporting a failure that a retry repeats), :mod:`.wire` (the conversation's lines and their proofs).
"""

from .attempts import Attempt, SparkStageAttempts, StageAttempts
from .client import END_WAIT_S, all_gather_via, end_barrier_via, group_token
from .failures import report_failure
from .service import EXCHANGE_TTL_S, OVER_CHECK_S, REQUEST_TIMEOUT_S, AddressRendezvous, driver_rendezvous
from .wire import MAX_REQUEST

__all__ = [
    "END_WAIT_S",
    "EXCHANGE_TTL_S",
    "MAX_REQUEST",
    "OVER_CHECK_S",
    "REQUEST_TIMEOUT_S",
    "AddressRendezvous",
    "Attempt",
    "SparkStageAttempts",
    "StageAttempts",
    "all_gather_via",
    "driver_rendezvous",
    "end_barrier_via",
    "group_token",
    "report_failure",
]
