"""The driver's web service: the live page, its state as JSON and the Prometheus endpoint, over HTTP/1.1 on the
hardened line service (:class:`~spark_credit_shuffle.transport.line_service.LineService`).

One per driver process, started by the first exchange that asks for it (``monitor="web"``), on
``monitor_web_address`` (127.0.0.1 unless set) and ``monitor_web_port`` (a free port unless set). Its URL
holds a random token, ``http://127.0.0.1:<port>/<token>/``, printed to the user; every request must start with
``GET /<token>``, compared in constant time (:func:`hmac.compare_digest`) with the raw bytes of the request line
before any of the request is parsed. What it serves under that prefix:

==================  ===========================================================================================
``/``               the page (``assets/index.html``, ``app.js``, ``style.css``: shipped in the package, no CDN)
``/api/state``      the session's exchanges as JSON (what the page draws, once a second)
``/metrics``        the live figures in Prometheus' text format (:mod:`.prometheus`)
==================  ===========================================================================================

A request without the token gets ``403`` and is closed, one to an unknown path ``404``, any other method than
GET ``403`` (its line does not start with ``GET /<token>``). What the line service bounds (deadlines, caps,
memory per connection, failures contained) holds here with these numbers: the request line within
:data:`AUTH_TIMEOUT_S` of the accept and at most :data:`MAX_REQUEST_LINE` bytes; then at most
:data:`MAX_HEADER_LINES` header lines of at most :data:`MAX_HEADER_LINE` bytes, :data:`MAX_HEADER_BYTES` in
all, within :data:`HEADERS_TIMEOUT_S` (over that: ``431``); the answer taken within :data:`WRITE_TIMEOUT_S`;
at most :data:`MAX_UNAUTHENTICATED` connections waiting for their request line (one more closes the oldest)
and :data:`MAX_CONNECTIONS` open. Every answer closes its connection (``Connection: close``): a page polls
once a second, and no connection outlives its request. Flink's REST server bounds a request in the same spirit
(``rest.server.max-content-length``).
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
import time
from importlib import resources
from typing import Any

from ..transport.line_service import LinePeer, LineService
from .board import Board
from .prometheus import CONTENT_TYPE, exposition

__all__ = [
    "AUTH_TIMEOUT_S",
    "HEADERS_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_LINE",
    "MAX_HEADER_LINES",
    "MAX_REQUEST_LINE",
    "MAX_UNAUTHENTICATED",
    "WRITE_TIMEOUT_S",
    "WebService",
    "running_service",
    "serve",
]

#: The longest request line (method, the token, the path, the version).
MAX_REQUEST_LINE = 4096
#: The longest header line, the most header lines and header bytes a request may send.
MAX_HEADER_LINE = 8192
MAX_HEADER_LINES = 64
MAX_HEADER_BYTES = 16384
#: From the accept to the request line, and from the request line to the end of the headers.
AUTH_TIMEOUT_S = 5.0
HEADERS_TIMEOUT_S = 5.0
#: The longest a connection may take to read its answer.
WRITE_TIMEOUT_S = 30.0
#: Connections open at once, and waiting for their request line.
MAX_CONNECTIONS = 64
MAX_UNAUTHENTICATED = 32
#: The token's random bytes (URL-safe base64 in the URL: 32 characters).
TOKEN_BYTES = 24

_ASSETS = {
    b"/": ("index.html", "text/html; charset=utf-8"),
    b"/app.js": ("app.js", "text/javascript; charset=utf-8"),
    b"/style.css": ("style.css", "text/css; charset=utf-8"),
}
_REASONS = {
    200: "OK",
    301: "Moved Permanently",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    431: "Request Header Fields Too Large",
}
#: Headers on every answer: nothing cached, framed or sniffed, no referrer (the URL holds the token), scripts and
#: styles from the page's own origin only.
_SECURITY_HEADERS = (
    "Cache-Control: no-store\r\n"
    "X-Content-Type-Options: nosniff\r\n"
    "X-Frame-Options: DENY\r\n"
    "Referrer-Policy: no-referrer\r\n"
    "Content-Security-Policy: default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'\r\n"
)


def _asset(name: str) -> bytes:
    return (resources.files(__package__) / "assets" / name).read_bytes()


class _Request:
    """What a connection asked: its path, and the header lines it sent so far."""

    __slots__ = ("answered", "header_bytes", "header_lines", "path")

    def __init__(self, path: bytes | None) -> None:
        self.path = path
        self.header_lines = 0
        self.header_bytes = 0
        self.answered = False


class WebService(LineService):
    """The page, its state and the metrics of the exchanges on ``board``, for requests that carry ``token``
    (a new random one when None). See the module documentation for what it serves and bounds."""

    label = "web view"
    auth_cause = "no request line in time"
    first_line = "request line"
    auth_setting = "AUTH_TIMEOUT_S"
    idle_setting = "HEADERS_TIMEOUT_S"
    too_long_cause = "request too long"

    def __init__(
        self,
        host: str,
        board: Board,
        *,
        port: int = 0,
        token: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
        max_unauthenticated: int = MAX_UNAUTHENTICATED,
        auth_timeout_s: float = AUTH_TIMEOUT_S,
    ) -> None:
        super().__init__(
            host,
            port=port,
            auth_timeout_s=auth_timeout_s,
            idle_timeout_s=HEADERS_TIMEOUT_S,
            max_connections=max_connections,
            max_unauthenticated=max_unauthenticated,
            first_line_limit=MAX_REQUEST_LINE,
            line_limit=MAX_HEADER_LINE,
            thread_name="credit-shuffle-web",
        )
        self.board = board
        self.token = token or secrets.token_urlsafe(TOKEN_BYTES)
        self._prefix = b"GET /" + self.token.encode("ascii")
        self._assets = {path: (_asset(name), kind) for path, (name, kind) in _ASSETS.items()}
        #: Requests answered, by status.
        self.answered: dict[int, int] = {}
        self._start()

    @property
    def url(self) -> str:
        """The page's address, token included: ``http://<host>:<port>/<token>/``."""
        host, port = self.address
        return f"http://{host}:{port}/{self.token}/"

    def _successor(self, host: str, port: int) -> WebService:
        return WebService(
            host,
            self.board,
            port=port,
            token=self.token,
            max_connections=self.max_connections,
            max_unauthenticated=self.max_unauthenticated,
            auth_timeout_s=self.auth_timeout_s,
        )

    # -- the service thread --

    def on_line(self, peer: LinePeer, line: bytes) -> None:
        """The request line (the token checked before anything else), then header lines up to the blank one."""
        request: _Request | None = peer.data
        if request is not None and request.answered:
            return  # what follows an answered request is not read
        if line.endswith(b"\r"):
            line = line[:-1]
        if request is None:
            self._request_line(peer, line)
            return
        if line:
            request.header_lines += 1
            request.header_bytes += len(line)
            if request.header_lines > MAX_HEADER_LINES or request.header_bytes > MAX_HEADER_BYTES:
                self.record(
                    peer.address,
                    f"more than {MAX_HEADER_LINES} header lines or {MAX_HEADER_BYTES} header bytes",
                    "headers too large",
                )
                self._answer(peer, request, 431, b"request headers too large\n", "text/plain; charset=utf-8")
            return
        self._respond(peer, request)

    def _request_line(self, peer: LinePeer, line: bytes) -> None:
        prefix = self._prefix
        if not hmac.compare_digest(line[: len(prefix)], prefix):  # before any of the line is parsed
            request = peer.data = _Request(None)
            self.record(peer.address, "a request without the page's token", "wrong token")
            self._answer(peer, request, 403, b"this page needs the URL printed when it started\n", "text/plain")
            return
        rest = line[len(prefix) :]
        target, space, version = rest.rpartition(b" ")
        path = target.split(b"?", 1)[0].split(b"#", 1)[0]
        request = peer.data = _Request(path)
        self.authenticate(peer)
        self.hold(
            peer,
            time.monotonic() + HEADERS_TIMEOUT_S,
            "header timeout",
            f"headers not complete within {HEADERS_TIMEOUT_S:.0f} s of the request line (HEADERS_TIMEOUT_S)",
        )
        if not space or version not in (b"HTTP/1.1", b"HTTP/1.0") or (path and not path.startswith(b"/")):
            self.record(peer.address, "a request line that is not GET /<token>/<path> HTTP/1.x", "bad request")
            self._answer(peer, request, 400, b"bad request\n", "text/plain")

    def _respond(self, peer: LinePeer, request: _Request) -> None:
        path = request.path or b""
        if path == b"":  # the page's relative links need the slash
            self._answer(peer, request, 301, b"", "text/plain", extra=f"Location: {self.token}/\r\n")
        elif path in self._assets:
            body, kind = self._assets[path]
            self._answer(peer, request, 200, body, kind)
        elif path == b"/api/state":
            self._answer(peer, request, 200, json.dumps(self.state()).encode(), "application/json")
        elif path == b"/metrics":
            views = self.board.views()
            for view in views:
                view.refresh()
            self._answer(peer, request, 200, exposition(views).encode(), CONTENT_TYPE)
        else:
            self._answer(peer, request, 404, b"not found\n", "text/plain")

    def state(self) -> dict[str, Any]:
        """What ``/api/state`` answers: the exchanges, newest first."""
        return {
            "now_ms": time.time() * 1000.0,
            "exchanges": [view.state_json() for view in reversed(self.board.views())],
        }

    def _answer(
        self, peer: LinePeer, request: _Request, status: int, body: bytes, kind: str, *, extra: str = ""
    ) -> None:
        request.answered = True
        self.answered[status] = self.answered.get(status, 0) + 1
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n{_SECURITY_HEADERS}{extra}\r\n"
        )
        self.hold(peer, time.monotonic() + WRITE_TIMEOUT_S, "slow reader", "did not take its answer in time")
        self.send(peer, head.encode("ascii") + body, close_after=True)


_lock = threading.Lock()
_service: WebService | None = None
#: The exchanges of this driver process that asked for the page.
BOARD = Board()


def serve(host: str = "127.0.0.1", port: int = 0) -> WebService:
    """This process's web service (started on ``host:port`` on first use; later calls get the same one,
    wherever it listens; one whose thread ended is started again on its port)."""
    global _service
    with _lock:
        if _service is None:
            _service = WebService(host, BOARD, port=port)
        elif not _service.is_alive:
            restarted = _service.restarted()
            assert isinstance(restarted, WebService)
            _service = restarted
        return _service


def running_service() -> WebService | None:
    """This process's web service if one was started."""
    return _service
