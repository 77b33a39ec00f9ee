"""Reading one connection: the bytes its socket holds, handed to its protocol handler, which frames them.

The handler (:class:`~.connection.SansIOConnection`) cuts frames and decodes messages; this part of
:class:`~.tcp.TcpTransport` moves bytes from the socket to it, with the task's ``lock`` held, and closes the
connection when the input ends (a clean close: the peer's EOF), fails (an ``OSError``), or breaks the protocol
(a :class:`~spark_credit_shuffle.errors.ProtocolError` from the handler: a wrong proof, garbage, an oversized
frame length, a message out of turn, or more than :data:`~.authentication.MAX_HELLO_BYTES` before the
handshake is done), which closes that connection only: the exchange carries on.

TLS decrypts whole records: bytes of a record already read from the socket wait in the ``SSLSocket``
(``pending()``), where the selector cannot see them, so a TLS connection is read until it would block, and
one that still holds decrypted bytes when it stopped (its read's share taken, or its handler not reading) is
looked at again in the I/O thread's next round, without waiting.
"""

from __future__ import annotations

import ssl
import time

from ..errors import ProtocolError
from .authentication import check_hello_bytes
from .connection import Connection
from .connection_table import ConnectionTable

__all__ = ["RECV_SIZE", "ConnectionReading"]

#: The most bytes one read of a connection takes (a plain ``recv``, or a TLS connection's decrypted records).
RECV_SIZE = 256 * 1024


class ConnectionReading(ConnectionTable):
    """Reading a connection's input into its handler (I/O thread); see the module's docstring."""

    def _read(self, conn: Connection) -> None:
        if conn.tls:
            data = self._read_tls(conn)
            if data is None:
                return
        else:
            try:
                data = conn.sock.recv(RECV_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._drop(conn, exc, clean=False)
                return
        if not data:
            self._drop(conn, None, clean=True)
            return
        conn.bytes_in += len(data)
        conn.last_received = time.monotonic()
        with self.lock:
            try:
                conn.handler.receive_data(data)
                check_hello_bytes(conn)
            except ProtocolError as exc:
                self._reject(conn, exc)
                return
            finally:
                self._notify()

    def _read_tls(self, conn: Connection) -> bytes | None:
        """Decrypted input of a TLS connection, up to ``RECV_SIZE`` bytes (``b""``: the peer closed; None:
        nothing now, or the connection was dropped). Reads until the socket would block: what a record
        already read holds is not seen by the selector; a connection left with some is looked at again."""
        sock = conn.sock
        lock = conn.tls_lock
        assert lock is not None
        chunks: list[bytes] = []
        size = 0
        eof = False
        while size < RECV_SIZE:
            try:
                with lock:
                    chunk = sock.recv(RECV_SIZE - size)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                eof = True  # close_notify, or the peer's half-close (it shuts its socket down without one)
                break
            except OSError as exc:
                self._drop(conn, exc, clean=False)
                return None
            if not chunk:
                eof = True
                break
            chunks.append(chunk)
            size += len(chunk)
        if size >= RECV_SIZE or (chunks and eof):
            self._tls_readable.add(conn)  # more may wait decrypted (or the EOF after it): next round
        if chunks:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return b"" if eof else None
