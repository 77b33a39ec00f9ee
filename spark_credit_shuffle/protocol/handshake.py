"""The connection handshake: both sides prove they know the exchange's secret; the secret never travels.

A challenge and response keyed by the per-exchange secret, mutual, before any other message::

    client -> server   Hello(nonce_c)                          a fresh random nonce
    server -> client   AuthChallenge(nonce_s, proof_s)         proof_s = HMAC(secret, SERVER | nonce_c | nonce_s)
    client -> server   AuthResponse(proof_c)                   proof_c = HMAC(secret, CLIENT | nonce_s | nonce_c)

HMAC is HMAC-SHA256 and ``SERVER`` and ``CLIENT`` are fixed labels naming the direction. What holds:

* The secret is only ever an HMAC key: a reader of the wire sees two nonces and two MACs.
* Each side's proof covers the other side's fresh nonce, so a recorded handshake replayed on a new
  connection fails (the server chose a new ``nonce_s``), and a proof is good for one connection only.
* The labels and the order of the nonces differ per direction, so a server's proof reflected back to it as
  a client's (or the other way round) does not verify.
* The server proves first, and the client sends nothing else until it verified that proof: a consumer
  never sends a partition request, credit or anything else to a peer that does not know the secret.

What it does not do is protect what follows: an active man in the middle may relay a handshake between
two honest tasks and then read (not forge a second handshake for) the rows that follow. TLS, when on,
runs below the handshake and closes that gap (:mod:`spark_credit_shuffle.transport.tls`).

Sans IO: the caller feeds messages and sends what it is given; nonces come from :func:`secrets.token_bytes`
unless a test passes its own.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from ..errors import ProtocolError
from .messages import AuthChallenge, AuthResponse, Hello

__all__ = [
    "CLIENT_LABEL",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "SERVER_LABEL",
    "ClientHandshake",
    "ServerHandshake",
    "handshake_proof",
]

#: Bytes of a nonce: 256 random bits, never repeated in practice.
NONCE_BYTES = 32
#: Bytes of a proof (an HMAC-SHA256 digest).
PROOF_BYTES = 32
#: What the server's proof says: "the producer (server) of a credit-shuffle connection knows the secret".
SERVER_LABEL = b"spark-credit-shuffle v2 producer to consumer"
#: What the client's proof says.
CLIENT_LABEL = b"spark-credit-shuffle v2 consumer to producer"


def handshake_proof(
    secret: bytes, label: bytes, first_nonce: bytes, second_nonce: bytes, payload: bytes = b""
) -> bytes:
    """HMAC-SHA256 keyed by ``secret`` over ``label``, a zero byte, the two nonces (of fixed length) and
    ``payload`` (what the proof also vouches for: the driver's address service signs its lines with it)."""
    if len(first_nonce) != NONCE_BYTES or len(second_nonce) != NONCE_BYTES:
        raise ProtocolError(f"a handshake nonce must be {NONCE_BYTES} bytes")
    return hmac.new(secret, label + b"\0" + first_nonce + second_nonce + payload, hashlib.sha256).digest()


class ServerHandshake:
    """The server's side: answers the client's :class:`Hello`, then checks its :class:`AuthResponse`.

    :meth:`on_message` takes every message that arrives before :attr:`done`; it returns the
    :class:`AuthChallenge` to send after a Hello and None after the response, and raises
    :class:`ProtocolError` for anything out of turn or a proof that does not verify.
    """

    __slots__ = ("_client_nonce", "_nonce", "_secret", "done")

    def __init__(self, secret: bytes, nonce: bytes | None = None) -> None:
        self._secret = bytes(secret)
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
        self._client_nonce: bytes | None = None
        self.done = False

    def on_message(self, message: object) -> AuthChallenge | None:
        if self._client_nonce is None:
            if not isinstance(message, Hello):
                raise ProtocolError(f"connection not authenticated: first message was {type(message).__name__}")
            self._client_nonce = bytes(message.nonce)
            proof = handshake_proof(self._secret, SERVER_LABEL, self._client_nonce, self._nonce)
            return AuthChallenge(self._nonce, proof)
        if not isinstance(message, AuthResponse):
            raise ProtocolError(
                f"connection not authenticated: {type(message).__name__} before the response to the challenge"
            )
        expected = handshake_proof(self._secret, CLIENT_LABEL, self._nonce, self._client_nonce)
        if not hmac.compare_digest(bytes(message.proof), expected):
            raise ProtocolError("connection not authenticated: wrong secret (the client's proof does not verify)")
        self.done = True
        return None


class ClientHandshake:
    """The client's side: :attr:`hello` goes out first; :meth:`on_challenge` checks the server's proof and
    returns the :class:`AuthResponse` to send, or raises :class:`ProtocolError`."""

    __slots__ = ("_nonce", "_secret", "done", "hello")

    def __init__(self, secret: bytes, nonce: bytes | None = None) -> None:
        self._secret = bytes(secret)
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
        self.hello = Hello(self._nonce)
        self.done = False

    def on_challenge(self, message: object) -> AuthResponse:
        if self.done or not isinstance(message, AuthChallenge):
            raise ProtocolError(f"unexpected {type(message).__name__} from a server before it proved the secret")
        expected = handshake_proof(self._secret, SERVER_LABEL, self._nonce, bytes(message.nonce))
        if not hmac.compare_digest(bytes(message.proof), expected):
            raise ProtocolError("server not authenticated: wrong secret (the producer's proof does not verify)")
        self.done = True
        return AuthResponse(handshake_proof(self._secret, CLIENT_LABEL, bytes(message.nonce), self._nonce))
