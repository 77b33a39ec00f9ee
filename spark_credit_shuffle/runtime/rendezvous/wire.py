"""The address service's line protocol: a task sends one JSON line, the service answers with one.

A request names the exchange, its secret (hex), the group (the stage attempt), the task, its task attempt
id and its message; a failure report adds the stage and the failure. The answer is the group's messages in
task order, ``{"error": "unknown exchange"}``, or ``{"failed": error class, "message": text}``.
"""

from __future__ import annotations

import json
import socket
from typing import Any

__all__ = ["MAX_LINE", "MAX_REQUEST", "UNKNOWN_EXCHANGE", "read_line", "request_line"]

#: The longest answer line a task accepts (one address message per task is about 100 bytes).
MAX_LINE = 1 << 20
#: The longest request line the service accepts (a task's request is a few hundred bytes).
MAX_REQUEST = 64 * 1024
#: The answer to a request for an exchange the service does not know (never registered, or forgotten).
UNKNOWN_EXCHANGE = "unknown exchange"


def request_line(
    exchange: str, secret: bytes, group: str, task: int, attempt: int, message: str, **extra: Any
) -> bytes:
    """The request of task ``task`` (task attempt id ``attempt``) of ``group``, with ``extra`` fields."""
    request = {
        "exchange": exchange,
        "group": group,
        "task": task,
        "attempt": attempt,
        "message": message,
        "secret": secret.hex(),
        **extra,
    }
    return (json.dumps(request) + "\n").encode()


def read_line(sock: socket.socket) -> str:
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
