"""Who may wait on a task's listener, and for how long: the transport's authentication policy.

Every accepted connection must prove it knows the exchange's secret (the handshake of
:mod:`~spark_credit_shuffle.protocol.handshake`: ``Hello``, ``AuthChallenge``, ``AuthResponse``; with TLS on,
the TLS handshake first) within the authentication deadline, counted from the accept, and within
:data:`MAX_HELLO_BYTES`. At most
``max_unauthenticated`` connections (:func:`unauthenticated_cap`) wait to authenticate; when one more
arrives, the oldest one still waiting is evicted. The transport does the reading and closing; this
module says when a connection goes and why, and keeps the count of every
connection closed per cause (:class:`RejectionLog`), logged once per cause, not once per connection.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from ..errors import ProtocolError
from ..protocol.codec import FRAME_HEADER_LENGTH
from ..protocol.handshake import NONCE_BYTES, PROOF_BYTES
from .connection import Connection

__all__ = [
    "ACCEPTS_PER_ROUND",
    "AUTHENTICATION_TIMEOUT_S",
    "MAX_HELLO_BYTES",
    "MIN_UNAUTHENTICATED",
    "RejectionLog",
    "check_hello_bytes",
    "expired_handshakes",
    "handshake_wait",
    "rejection_cause",
    "unauthenticated_cap",
]

log = logging.getLogger("spark_credit_shuffle")

#: The longest a task's listener waits for a connected peer to complete its handshake (at most, the runtime
#: passes ``min(partition_request_timeout_ms, this)``): a legitimate peer starts it as soon as it is
#: connected and answers the challenge as soon as it arrives.
AUTHENTICATION_TIMEOUT_S = 2.0
#: The most bytes a peer may send before it is authenticated: its ``Hello`` and its ``AuthResponse`` frames
#: (with TLS, counted after decryption; the TLS handshake itself is bounded by the deadline).
MAX_HELLO_BYTES = 2 * FRAME_HEADER_LENGTH + NONCE_BYTES + PROOF_BYTES
#: The fewest connections allowed to wait for authentication at once, whatever the expected peers.
MIN_UNAUTHENTICATED = 32
#: The most connections an I/O thread accepts before it reads its other sockets again.
ACCEPTS_PER_ROUND = 16

_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


def unauthenticated_cap(expected_peers: int) -> int:
    """How many connections may wait to authenticate when ``expected_peers`` legitimate peers will connect.

    Four times the legitimate peers, at least :data:`MIN_UNAUTHENTICATED`: every legitimate peer can be
    waiting at once with room to spare, and a flood evicts the oldest waiting connection, not a new one.
    """
    return max(MIN_UNAUTHENTICATED, 4 * max(0, int(expected_peers)))


def check_hello_bytes(conn: Connection) -> None:
    """Raise ProtocolError if ``conn`` sent more than :data:`MAX_HELLO_BYTES` without authenticating."""
    if conn.bytes_in > MAX_HELLO_BYTES and not conn.is_authenticated:
        raise ProtocolError(
            f"{conn.bytes_in} bytes received without completing the handshake (at most {MAX_HELLO_BYTES} bytes may "
            "come before it)"
        )


def handshake_wait(connections: Iterable[Connection], timeout_s: float, now: float) -> float | None:
    """Seconds until the first unauthenticated connection's deadline passes (None: none waits)."""
    accepted = [c.accepted_at for c in connections if not c.is_authenticated]
    if not accepted:
        return None
    return max(0.0, min(accepted) + timeout_s - now)


def expired_handshakes(connections: Iterable[Connection], timeout_s: float, now: float) -> list[Connection]:
    """The open connections still unauthenticated ``timeout_s`` after their accept."""
    return [c for c in connections if not c.closed and not c.is_authenticated and now - c.accepted_at >= timeout_s]


def rejection_cause(exc: BaseException) -> str:
    """One cause per kind of error, whatever its numbers (a frame length, a byte count)."""
    return _NUMBERS.sub("N", str(exc))


class RejectionLog:
    """The connections a transport named ``name`` closed before or while authenticating.

    Each cause is logged at WARNING the first time and at DEBUG after that; :meth:`log_counts` (when the
    transport closes) logs one WARNING with the count of every cause that closed more than one, so a flood
    makes a few lines, not one per connection.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_rejected = 0
        #: The first 100 rejections, as logged.
        self.rejections: list[str] = []
        #: Connections closed per cause (a short name: "evicted", "handshake timeout", a protocol error).
        self.by_cause: dict[str, int] = {}
        self._counts_logged = False

    def record(self, text: str, cause: str) -> None:
        """Count a closed connection; log its ``cause`` at WARNING the first time, at DEBUG after that."""
        self.num_rejected += 1
        if len(self.rejections) < 100:
            self.rejections.append(text)
        seen = self.by_cause.get(cause, 0)
        self.by_cause[cause] = seen + 1
        if seen:
            log.debug("%s: %s", self.name, text)
        else:
            log.warning(
                "%s: %s (more connections closed for this cause are counted when the transport closes)",
                self.name,
                text,
            )

    def log_counts(self) -> None:
        """One WARNING with the count of every cause that closed more than one connection (once)."""
        if self._counts_logged:
            return
        self._counts_logged = True
        repeated = {cause: n for cause, n in self.by_cause.items() if n > 1}
        if repeated:
            counts = ", ".join(f"{n} x {cause}" for cause, n in sorted(repeated.items()))
            log.warning("%s: connections closed before or while authenticating: %s", self.name, counts)
