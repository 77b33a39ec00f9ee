"""Where the tasks of a pipelined exchange learn each other's addresses: a small service on the driver.

Spark's own ``BarrierTaskContext.allGather`` does the job, but each call costs about a second (the task
polls the driver's barrier coordinator once a second), and during that second no consumer reads: the
producers fill their pools and wait. On a classic Spark session the driver runs one
:class:`AddressRendezvous` per process instead: every task of a barrier stage sends it one request (its
exchange's name, the stage attempt it belongs to, its index and its message; signed with the exchange's
secret after the service proved it knows it, see :mod:`.wire`, and inside TLS when the exchange runs it) and
gets back, as soon as every task index of that stage has arrived, every message in task order. A task that comes
again before its group is complete (a new attempt of the stage, after a failure) replaces its earlier
entry if its task attempt id is newer (Spark numbers task attempts in increasing order); an older one (a
late task of a failed attempt) is turned away. The barrier stage
still schedules all tasks at once and retries them together; only the address exchange is faster.

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

The package: :mod:`.service` (the driver's service), :mod:`.client` (the task's ``allGather``),
:mod:`.failures` (reporting a failure that a retry repeats), :mod:`.wire` (the conversation's lines and their
proofs).
"""

from .client import all_gather_via
from .failures import report_failure
from .service import EXCHANGE_TTL_S, REQUEST_TIMEOUT_S, AddressRendezvous, driver_rendezvous
from .wire import MAX_REQUEST

__all__ = [
    "EXCHANGE_TTL_S",
    "MAX_REQUEST",
    "REQUEST_TIMEOUT_S",
    "AddressRendezvous",
    "all_gather_via",
    "driver_rendezvous",
    "report_failure",
]
