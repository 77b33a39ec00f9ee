"""One TCP connection of the transport: its socket, the protocol handler it drives, its output queue and
the counters the runtime reports; and what a handler must offer (:class:`SansIOConnection`).

A connection with TLS (:mod:`.tls`) has an ``ssl.SSLSocket`` in non-blocking mode as its socket. It cannot
``sendmsg``: its output is joined into writes of at most :data:`TLS_WRITE_BYTES` (one copy, small beside
the encryption), and a write that the socket could not take (``SSLWantWriteError``) is retried with the
very same bytes, as OpenSSL requires.
"""

from __future__ import annotations

import itertools
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from ..buffers.buffer import Payload
from ..protocol._flags import IS_BUFFER as _IS_BUFFER
from ..protocol.codec import FRAME_HEADER_LENGTH, buffer_response_header, encode
from ..protocol.messages import BufferResponse, Message

__all__ = ["Connection", "SansIOConnection", "resolve_host"]

#: The most buffers one ``sendmsg`` call is given.
_MAX_IOV = 64
#: Bytes of a BufferResponse's frame and message header, before its payload.
_BUFFER_RESPONSE_HEADER = FRAME_HEADER_LENGTH + 26
#: The most bytes one write to a TLS socket is given (four TLS records of 16 KiB).
TLS_WRITE_BYTES = 64 * 1024


class SansIOConnection(Protocol):
    """What the transport drives: a server or client connection handler of the protocol core."""

    def receive_data(self, data: bytes | bytearray | memoryview) -> None: ...

    def next_message(self) -> Message | None: ...

    def has_data(self) -> bool: ...

    def connection_closed(self) -> None: ...


def resolve_host(host: str) -> str:
    """The IPv4 address of ``host`` (a name such as ``localhost`` or an address); raises ``OSError``."""
    if not host:
        raise OSError("empty host name")
    infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"host {host!r} has no IPv4 address")
    return str(infos[0][4][0])


class Connection:
    """One TCP connection: its socket, its protocol handler and its output queue.

    ``role`` is ``"server"`` (accepted from a consumer) or ``"client"`` (opened to a producer); ``peer``
    names the other side in logs and errors. Counters and timestamps (``time.monotonic()``) let the runtime
    say what it waited for and from whom.
    """

    __slots__ = (
        "accepted_at",
        "bytes_in",
        "bytes_out",
        "closed",
        "error",
        "handler",
        "id",
        "last_received",
        "messages_out",
        "out",
        "out_bytes",
        "peer",
        "role",
        "sock",
        "tls",
        "tls_handshaking",
        "tls_lock",
        "tls_retry",
        "tls_want_write",
        "write_error",
        "write_shut",
    )

    def __init__(self, sock: socket.socket, handler: Any, role: str, peer: str, conn_id: int) -> None:
        now = time.monotonic()
        self.sock = sock
        self.handler = handler
        self.role = role
        self.peer = peer
        self.id = conn_id
        self.out: deque[Payload] = deque()
        self.out_bytes = 0
        self.closed = False
        self.write_shut = False
        self.write_error: BaseException | None = None
        self.error: BaseException | None = None
        self.accepted_at = now
        self.last_received = now
        self.bytes_in = 0
        self.bytes_out = 0
        self.messages_out = 0
        #: TLS: the socket is an ``ssl.SSLSocket``; ``tls_handshaking`` until its handshake completed (an
        #: accepted one completes it in the I/O thread), ``tls_want_write`` while that handshake waits to
        #: write, ``tls_retry`` the write that must be repeated as it was (bytes, chunks it covers).
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.tls_handshaking = False
        self.tls_want_write = False
        self.tls_retry: tuple[Payload, int] | None = None
        #: An SSL object must not be read and written by two threads at once (OpenSSL's rule): the I/O
        #: thread's reads and any thread's writes take this lock (writes inside the transport's lock).
        self.tls_lock = threading.Lock() if self.tls else None

    def fill(self, high_water: int, on_data_sent: Callable[[Connection, int], None] | None) -> None:
        """Pull messages from the handler, encoded without copying their payloads, while fewer than
        ``high_water`` bytes wait in the output (Netty's write-buffer high watermark). A BufferResponse is
        encoded as its header alone, packed in one step, followed by its payload as it is (no message object
        beyond the handler's, no view per chunk). ``on_data_sent(connection, n)`` runs once if ``n`` > 0 data
        buffers were pulled."""
        handler = self.handler
        out = self.out
        append = out.append
        next_message = handler.next_message
        out_bytes = self.out_bytes
        messages = data_buffers = 0
        try:
            while out_bytes < high_water:
                message = next_message()
                if message is None:
                    break
                messages += 1
                if type(message) is BufferResponse:
                    receiver_id, subpartition, sequence_number, backlog, data_type, compressed, payload = message
                    if not compressed:
                        size = len(payload)
                        append(
                            buffer_response_header(receiver_id, subpartition, sequence_number, backlog, data_type, size)
                        )
                        out_bytes += _BUFFER_RESPONSE_HEADER + size
                        if size:
                            append(payload)
                        if _IS_BUFFER[data_type]:
                            data_buffers += 1
                        continue
                for chunk in encode(message):
                    n = len(chunk)
                    if n:
                        append(chunk)
                        out_bytes += n
        finally:
            self.out_bytes = out_bytes
            self.messages_out += messages
        if data_buffers and on_data_sent is not None:
            on_data_sent(self, data_buffers)

    def write(self) -> None:
        """Write what the socket takes now (the transport's ``lock`` held; any thread): up to :data:`_MAX_IOV`
        chunks per ``sendmsg``. A failure is recorded in ``write_error`` for the I/O thread, which drops the
        connection."""
        if self.tls:
            self._write_tls()
            return
        out = self.out
        sock = self.sock
        while out:
            chunks = list(itertools.islice(out, _MAX_IOV)) if len(out) > _MAX_IOV else list(out)
            try:
                sent = sock.sendmsg(chunks)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.write_error = exc
                out.clear()
                self.out_bytes = 0
                return
            self.bytes_out += sent
            self.out_bytes -= sent
            remaining = sent
            popleft = out.popleft
            while remaining:
                head = out[0]
                n = len(head) if type(head) is bytes else memoryview(head).nbytes
                if n <= remaining:
                    remaining -= n
                    popleft()
                else:
                    out[0] = memoryview(head).cast("B")[remaining:]
                    return  # the socket took part of a chunk: it is full, wait for EVENT_WRITE

    def _write_tls(self) -> None:
        """:meth:`write` on a TLS socket: whole chunks joined into writes of at most :data:`TLS_WRITE_BYTES`."""
        out = self.out
        sock = self.sock
        if self.tls_handshaking:
            return  # the I/O thread writes once the handshake is done
        while out:
            retry = self.tls_retry
            if retry is not None:
                data, count = retry
            else:
                count, size = 0, 0
                for chunk in out:
                    n = len(chunk) if type(chunk) is bytes else memoryview(chunk).nbytes
                    if count and size + n > TLS_WRITE_BYTES:
                        break
                    count += 1
                    size += n
                data = out[0] if count == 1 else b"".join(itertools.islice(out, count))
            lock = self.tls_lock
            assert lock is not None
            try:
                with lock:
                    sock.send(data)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                self.tls_retry = (data, count)
                return
            except OSError as exc:
                self.write_error = exc
                out.clear()
                self.out_bytes = 0
                self.tls_retry = None
                return
            self.tls_retry = None
            sent = len(data)
            self.bytes_out += sent
            self.out_bytes -= sent
            for _ in range(count):
                out.popleft()

    @property
    def is_authenticated(self) -> bool:
        """A server connection whose TLS handshake (if any) completed and whose client proved the secret
        (client connections always are: the listener's limits concern the peers it accepted)."""
        if self.role == "client":
            return True
        return not self.tls_handshaking and bool(getattr(self.handler, "is_authenticated", True))

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Connection({self.role} {self.peer}, {state}, in={self.bytes_in}, out={self.bytes_out})"
