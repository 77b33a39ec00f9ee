"""The address service's line protocol: one line at a time, each side proving the exchange's secret.

A conversation on one connection (the task speaks first; with TLS all of it runs inside the exchange's
mutual TLS, :mod:`spark_credit_shuffle.transport.tls`, whose server name tells the service which
exchange's certificate to present, :func:`server_name`)::

    task    -> service   {"exchange": name, "nonce": hex}                      the task's fresh nonce
    service -> task      {"nonce": hex, "proof": hex}                          the service proves the secret
                         or {"error": "unknown exchange"}
    task    -> service   <proof hex> <request JSON>                            the task proves it, and signs
    service -> task      <proof hex> <answer JSON>                             the answer, signed

The proofs are :func:`~spark_credit_shuffle.protocol.handshake.handshake_proof` with labels of their own
(never those of the data plane, and different per direction and per line), over both nonces and the raw
bytes of the JSON that follows the proof on its line: the secret never travels, a recorded request replayed
on another connection fails (the service's nonce differs), and a task believes no answer the service did not
sign for this connection. Each side checks a proof over the line's raw bytes before it parses any of them
(:func:`split_signed`), and parses only within bounds of size and nesting
(:func:`~spark_credit_shuffle.transport.line_service.parse_bounded`); the two lines that come before any
proof (the hello and the challenge) are small, flat and parsed within the same bounds.

A request names the group (the stage attempt), the task, its task attempt id and its message; a failure
report adds the stage and the failure. The answer is the group's messages in task order, or
``{"failed": error class, "message": text}``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import socket
import ssl
from typing import Any

from ....errors import ProtocolError
from ....protocol.handshake import NONCE_BYTES, PROOF_BYTES, handshake_proof
from ....transport.line_service import parse_bounded
from ....transport.tls import TlsIdentity, check_pinned

__all__ = [
    "ANSWER_LABEL",
    "MAX_HELLO",
    "MAX_LINE",
    "MAX_REQUEST",
    "REQUEST_LABEL",
    "SERVICE_LABEL",
    "UNKNOWN_EXCHANGE",
    "converse",
    "read_line",
    "server_name",
    "signed_line",
    "split_signed",
]

#: The longest answer line a task accepts (one address message per task is about 100 bytes).
MAX_LINE = 1 << 20
#: The longest request line the service accepts (a task's request is a few hundred bytes).
MAX_REQUEST = 64 * 1024
#: The longest hello the service accepts, and challenge a task accepts (both about 150 bytes; an exchange's
#: name is short: ``<partitioner>-<mode>-<n>/<16 hex digits>``).
MAX_HELLO = 4096
#: The answer to a request for an exchange the service does not know (never registered, or forgotten).
UNKNOWN_EXCHANGE = "unknown exchange"
#: What the service's first proof says.
SERVICE_LABEL = b"spark-credit-shuffle v2 address service to task"
#: What a task's proof of its request says.
REQUEST_LABEL = b"spark-credit-shuffle v2 task request to address service"
#: What the service's proof of its answer says.
ANSWER_LABEL = b"spark-credit-shuffle v2 address service answer to task"


def server_name(exchange: str) -> str:
    """The TLS server name a task asks the service for to reach ``exchange`` (one DNS label, whatever the
    exchange's name)."""
    return "x" + hashlib.sha256(exchange.encode()).hexdigest()[:40]


def read_line(sock: socket.socket, limit: int = MAX_LINE) -> bytes:
    """One line (without its newline) of at most ``limit`` bytes; raises ValueError otherwise. The lines of
    a conversation alternate, so no byte of a later line comes in the same read."""
    chunks: list[bytes] = []
    size = 0
    while True:
        data = sock.recv(65536)
        if not data:
            raise ValueError("connection closed before the end of the line")
        end = data.find(b"\n")
        if end >= 0:
            if size + end > limit:
                break
            chunks.append(data[:end])
            return b"".join(chunks)
        chunks.append(data)
        size += len(data)
        if size > limit:
            break
    raise ValueError(f"line longer than {limit} bytes")


def signed_line(proof: bytes, body: bytes) -> bytes:
    """The line ``<proof hex> <body>`` (``body``: JSON, signed by ``proof`` as it is)."""
    return proof.hex().encode() + b" " + body + b"\n"


def split_signed(line: bytes) -> tuple[bytes, bytes]:
    """(proof, body) of a line :func:`signed_line` made, nothing of ``body`` parsed; ValueError if it has
    no proof of :data:`~spark_credit_shuffle.protocol.handshake.PROOF_BYTES` in hex before its first space."""
    head, space, body = line.partition(b" ")
    if not space or len(head) != 2 * PROOF_BYTES:
        raise ValueError("no proof before the signed text")
    return bytes.fromhex(head.decode("ascii")), body


def _line(obj: Any) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def _refused(address: tuple[str, int], exc: ConnectionRefusedError) -> ConnectionRefusedError:
    """A refused connection, said as what it means: nothing listens at the address the exchange was built with."""
    return ConnectionRefusedError(
        exc.errno,
        f"nothing listens at {address[0]}:{address[1]} ({exc.strerror}): the driver's address service this "
        "exchange was built with is not running (the driver's log says why its thread ended); build the exchange "
        "again",
    )


def converse(
    address: tuple[str, int],
    exchange: str,
    secret: bytes,
    request: dict[str, Any],
    timeout_s: float,
    tls: TlsIdentity | None = None,
) -> Any:
    """Send ``request`` for ``exchange`` to the service at ``address`` and return its answer (a JSON value),
    or ``{"error": UNKNOWN_EXCHANGE}``.

    Raises ``TimeoutError`` (a step took longer than ``timeout_s``), ``OSError`` or ``ValueError`` (the
    service is unreachable or broke the protocol) and :class:`ProtocolError` (the service did not prove the
    secret, or signed its answer wrongly, or presented another certificate).
    """
    try:
        raw = socket.create_connection(address, timeout=timeout_s)
    except ConnectionRefusedError as exc:
        raise _refused(address, exc) from None
    with raw:
        sock: socket.socket = raw
        if tls is not None:
            try:
                sock = tls.client_context().wrap_socket(raw, server_hostname=server_name(exchange))
            except ssl.SSLError as exc:
                if "UNRECOGNIZED_NAME" in str(exc).upper():  # the service holds no key pair for it (forgotten)
                    return {"error": UNKNOWN_EXCHANGE}
                raise ProtocolError(f"TLS handshake with the address service failed: {exc}") from None
            check_pinned(sock, tls, "the address service")
        with contextlib.ExitStack() as stack:
            if sock is not raw:
                stack.callback(sock.close)
            nonce = secrets.token_bytes(NONCE_BYTES)
            sock.sendall(_line({"exchange": exchange, "nonce": nonce.hex()}))
            challenge = parse_bounded(read_line(sock, MAX_HELLO), max_bytes=MAX_HELLO)
            if isinstance(challenge, dict) and challenge.get("error") == UNKNOWN_EXCHANGE:
                return challenge
            try:
                service_nonce = bytes.fromhex(str(challenge["nonce"]))
                proof = bytes.fromhex(str(challenge["proof"]))
            except (KeyError, TypeError) as exc:
                raise ValueError(f"malformed challenge ({type(exc).__name__}: {exc})") from None
            if len(service_nonce) != NONCE_BYTES or not hmac.compare_digest(
                proof, handshake_proof(secret, SERVICE_LABEL, nonce, service_nonce)
            ):
                raise ProtocolError("the address service did not prove the exchange's secret")
            body = json.dumps(request).encode()
            sock.sendall(signed_line(handshake_proof(secret, REQUEST_LABEL, service_nonce, nonce, body), body))
            reply = read_line(sock)
            if reply.startswith(b"{"):  # unsigned: only "unknown exchange" (forgotten meanwhile) comes so
                error = parse_bounded(reply, max_bytes=MAX_HELLO)
                if isinstance(error, dict) and error.get("error") == UNKNOWN_EXCHANGE:
                    return error
                raise ValueError("malformed answer (neither signed nor 'unknown exchange')")
            answer_proof, answer = split_signed(reply)
            expected = handshake_proof(secret, ANSWER_LABEL, nonce, service_nonce, answer)
            if not hmac.compare_digest(answer_proof, expected):
                raise ProtocolError("the address service's answer is not signed with the exchange's secret")
            return parse_bounded(answer, max_bytes=MAX_LINE)
