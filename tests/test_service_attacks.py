"""Attacks on the driver's two services (the address service and the live monitor's) and on a producer's
listener, over real sockets on 127.0.0.1: deeply nested JSON, more idle connections than the cap, half lines
of up to 1 MiB, garbage and replays, with and without TLS where the listener speaks it.

After each: the listener is alive and still serves a legitimate client, every attacking connection was
closed within a bound relative to its deadline (measured from its own ``connect()`` to the close it saw), and
what the service held for the connections stayed within its per-connection bound (its buffered bytes, not
the process's RSS). The base all three driver-side guarantees come from is
:mod:`spark_credit_shuffle.transport.line_service`; docs/security.md lists the bounds.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import selectors
import socket
import ssl
import threading
import time

import pyarrow as pa
import pytest
from pyspark.sql import functions as F
from tcp_helpers import Consumer, Producer, batches, exchange_through

import spark_credit_shuffle as scs
from spark_credit_shuffle.errors import CreditShuffleError
from spark_credit_shuffle.metrics import PRODUCER, MetricRow
from spark_credit_shuffle.protocol.handshake import handshake_proof
from spark_credit_shuffle.runtime import monitor as monitor_module
from spark_credit_shuffle.runtime.monitor import (
    MAX_CONNECTIONS,
    MAX_FIRST_LINE,
    Monitor,
    MonitorClient,
    MonitorService,
    driver_monitor,
)
from spark_credit_shuffle.runtime.pipelined.rendezvous import AddressRendezvous, all_gather_via, driver_rendezvous
from spark_credit_shuffle.runtime.pipelined.rendezvous.wire import (
    MAX_HELLO,
    MAX_REQUEST,
    REQUEST_LABEL,
    SERVICE_LABEL,
    read_line,
    server_name,
    signed_line,
)
from spark_credit_shuffle.transport.connection import resolve_host
from spark_credit_shuffle.transport.event_loop import LISTEN_BACKLOG, ServicesByHost
from spark_credit_shuffle.transport.line_service import LinePeer, LineService, Rejected, check_nesting, parse_bounded
from spark_credit_shuffle.transport.tls import TlsIdentity

pytestmark = pytest.mark.timeout(120)

#: The authentication deadline of the services under attack, and of the producer's listener.
DEADLINE_S = 0.5
PRODUCER_DEADLINE_S = 1.0
SECRET = os.urandom(32)
IDENTITY = TlsIdentity.generate("attacked exchange")
NESTED = b"[" * 100_000
HALF_LINE = b"a" * (512 * 1024)  # half of a 1 MiB line, without its newline


def bound(deadline_s: float) -> float:
    """The longest an attacking connection may live: its deadline, twice over, and a second of scheduling."""
    return 2 * deadline_s + 1.0


@pytest.fixture(autouse=True)
def _samples_sent_often(monkeypatch):
    """A task's monitor client sends what it was given every 50 ms here, not every second: nothing these tests
    assert depends on the interval (the deadlines are the services'), and each of them waited for it, once
    before an attack and once after (about 1 s each)."""
    monkeypatch.setattr(monitor_module, "SEND_INTERVAL_S", 0.05)


class Attackers:
    """Connections opened by an attacker, each watched from its ``connect()`` call to the close the listener
    made (an end of stream or a reset), on a thread of its own so that a close is seen when it comes."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._opened: dict[socket.socket, float] = {}
        #: Seconds each closed connection lived.
        self.lived: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="attackers", daemon=True)
        self._thread.start()

    def open(
        self, address: tuple[str, int], data: bytes = b"", *, tls: ssl.SSLContext | None = None, name: str = ""
    ) -> None:
        """Connect (with ``tls``: send a ClientHello and go no further), send ``data``, and watch."""
        started = time.monotonic()
        sock = socket.create_connection(address, timeout=5)
        if tls is not None:
            sock.setblocking(False)
            sock = tls.wrap_socket(sock, server_hostname=name or "x", do_handshake_on_connect=False)
            with contextlib.suppress(ssl.SSLWantReadError, ssl.SSLError, OSError):
                sock.do_handshake()
        elif data:
            with contextlib.suppress(OSError):  # closed while sending: what the test looks for
                sock.sendall(data)
        sock.setblocking(False)
        with self._lock:
            self._opened[sock] = started
            self._selector.register(sock, selectors.EVENT_READ)

    def _watch(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                events = self._selector.select(0)
                for key, _ in events:
                    sock = key.fileobj
                    try:
                        data = socket.socket.recv(sock, 65536)  # the raw bytes, under TLS too
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        self.lived.append(time.monotonic() - self._opened.pop(sock))
                        self._selector.unregister(sock)
                        sock.close()
            time.sleep(0.002)

    def wait_closed(self, count: int, timeout_s: float = 30.0) -> list[float]:
        """How long each of ``count`` connections lived (fails if they are not all closed in time)."""
        deadline = time.monotonic() + timeout_s
        while len(self.lived) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.lived) >= count, f"{count - len(self.lived)} attacking connections still open"
        return list(self.lived)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in list(self._opened):
            sock.close()


@pytest.fixture
def attackers():
    watched = Attackers()
    yield watched
    watched.close()


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


# -- parsing --------------------------------------------------------------------------------------------


def test_nesting_is_refused_before_parsing_and_brackets_inside_strings_do_not_count():
    started = time.monotonic()
    for deep in (NESTED, b'{"a":' * 100_000, b"[" * 33 + b"]" * 33):
        with pytest.raises(ValueError, match="nested deeper than 32"):
            parse_bounded(deep, max_bytes=1 << 20)
    assert time.monotonic() - started < 0.5  # each scan stops at the 33rd bracket
    assert parse_bounded(b"[" * 32 + b"]" * 32, max_bytes=100) == eval("[" * 31 + "[]" + "]" * 31)
    text = json.dumps({"rows": [["[" * 1000, '"{\\']], "k": "x"}).encode()
    assert parse_bounded(text, max_bytes=1 << 20)["rows"][0][0] == "[" * 1000
    check_nesting(b'["\\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["]', 2)  # an escaped quote does not end the string
    with pytest.raises(ValueError, match="more than 10"):
        parse_bounded(b"[1, 2, 3, 4, 5]", max_bytes=10)
    with pytest.raises(ValueError):
        parse_bounded("[1]".encode("utf-16"), max_bytes=100)  # UTF-8 only


# -- the address service --------------------------------------------------------------------------------


def gather(service: AddressRendezvous, key: str, width: int, tls: TlsIdentity | None = None) -> dict[int, list[str]]:
    """Every task of one stage asks at once; each task's answer (or its error's text)."""
    answers: dict[int, list[str]] = {}

    def task(i: int) -> None:
        try:
            answers[i] = all_gather_via(service.address, key, SECRET, "stage 1", i, i, 10.0, tls=tls)(f"at {i}")
        except CreditShuffleError as exc:
            answers[i] = [str(exc)]

    threads = [threading.Thread(target=task, args=(i,)) for i in range(width)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return answers


def hello(exchange: str, nonce: bytes) -> bytes:
    return (json.dumps({"exchange": exchange, "nonce": nonce.hex()}) + "\n").encode()


def recorded_request(service: AddressRendezvous, exchange: str) -> tuple[bytes, bytes]:
    """A legitimate task's hello and signed request, as an eavesdropper records them (the exchange has one
    task: the service answers at once)."""
    nonce = os.urandom(32)
    with socket.create_connection(service.address, timeout=5) as sock:
        first = hello(exchange, nonce)
        sock.sendall(first)
        challenge = json.loads(read_line(sock))
        service_nonce = bytes.fromhex(challenge["nonce"])
        assert challenge["proof"] == handshake_proof(SECRET, SERVICE_LABEL, nonce, service_nonce).hex()
        body = json.dumps({"group": "g", "task": 0, "attempt": 0, "message": "legit"}).encode()
        request = signed_line(handshake_proof(SECRET, REQUEST_LABEL, service_nonce, nonce, body), body)
        sock.sendall(request)
        assert read_line(sock).endswith(b' ["legit"]')
    return first, request


RENDEZVOUS_ATTACKS = {
    # (what is sent, how many connections, the cause each is closed for)
    "nested JSON": (lambda: NESTED + b"\n", 1, "request too long"),
    "nested JSON within the hello's size": (lambda: b"[" * 3000 + b"\n", 1, "bad request"),
    "garbage": (lambda: os.urandom(2048).replace(b"\x16", b"") + b"\n", 1, "bad request"),
    "half a 1 MiB line": (lambda: HALF_LINE, 20, "request too long"),
    "half a 1 MiB request after a hello": (lambda: hello("ex/1", os.urandom(32)) + HALF_LINE, 20, "request too long"),
    "idle, more than the cap": (lambda: b"", 80, None),
}


@pytest.mark.parametrize("tls", [None, IDENTITY], ids=["plain", "tls"])
@pytest.mark.parametrize("attack", sorted(RENDEZVOUS_ATTACKS))
def test_the_address_service_drops_each_attack_within_its_deadline_and_tasks_still_meet(attackers, attack, tls):
    service = AddressRendezvous("127.0.0.1", request_timeout_s=DEADLINE_S)
    try:
        service.register("ex/1", SECRET, 2, tls=tls)
        make, count, cause = RENDEZVOUS_ATTACKS[attack]
        context = tls.client_context() if tls is not None else None
        for _ in range(count):
            if context is not None and make():  # a peer holding the exchange's key pair, not its secret
                raw = socket.create_connection(service.address, timeout=5)
                started = time.monotonic()
                sock = context.wrap_socket(raw, server_hostname=server_name("ex/1"))
                with contextlib.suppress(OSError):
                    sock.sendall(make())
                    while sock.recv(65536):
                        pass
                attackers.lived.append(time.monotonic() - started)
                sock.close()
            else:  # plain bytes (or, with TLS, a ClientHello and nothing more)
                attackers.open(service.address, make(), tls=context, name=server_name("ex/1"))
        lived = attackers.wait_closed(count)
        assert max(lived) < bound(DEADLINE_S), sorted(lived)[-5:]
        assert service.is_alive and service.num_restarts == 0
        if cause is not None:
            assert service.rejected_by_cause.get(cause) == count, service.rejected_by_cause
        assert service.num_connections <= service.max_pending
        # per connection at most a hello (or, after one, a request) and the one byte that made it too long
        per_connection = MAX_REQUEST + 1 if "after a hello" in attack else MAX_HELLO + 1
        assert service.peak_buffered_bytes <= min(count, service.max_pending) * per_connection
        assert wait_until(lambda: service.buffered_bytes == 0 and service.num_connections == 0)
        assert gather(service, "ex/1", 2, tls) == {i: ["at 0", "at 1"] for i in range(2)}
    finally:
        service.close()


def test_a_replayed_request_is_refused_and_the_service_answers_the_tasks(attackers):
    service = AddressRendezvous("127.0.0.1", request_timeout_s=DEADLINE_S)
    try:
        service.register("ex/replay", SECRET, 1)
        service.register("ex/1", SECRET, 2)
        first, request = recorded_request(service, "ex/replay")
        attackers.open(service.address, first + request)  # the service's nonce differs: the proof does not verify
        assert max(attackers.wait_closed(1)) < bound(DEADLINE_S)
        assert service.rejected_by_cause == {"wrong secret": 1}
        assert gather(service, "ex/1", 2) == {i: ["at 0", "at 1"] for i in range(2)}
    finally:
        service.close()


def test_nested_json_signed_with_the_secret_is_refused_after_its_proof_before_it_is_parsed():
    service = AddressRendezvous("127.0.0.1", request_timeout_s=DEADLINE_S)
    try:
        service.register("ex/1", SECRET, 2)
        nonce = os.urandom(32)
        with socket.create_connection(service.address, timeout=5) as sock:
            sock.sendall(hello("ex/1", nonce))
            service_nonce = bytes.fromhex(json.loads(read_line(sock))["nonce"])
            body = b"[" * 60_000  # within the request's size: only the nesting bound refuses it
            sock.sendall(signed_line(handshake_proof(SECRET, REQUEST_LABEL, service_nonce, nonce, body), body))
            with pytest.raises(ValueError, match="closed"):
                read_line(sock)
        assert wait_until(lambda: service.rejected_by_cause.get("bad request") == 1)
        assert service.is_alive and gather(service, "ex/1", 2) == {i: ["at 0", "at 1"] for i in range(2)}
    finally:
        service.close()


# -- the live monitor's service -------------------------------------------------------------------------


def sample(value: float) -> list[MetricRow]:
    return [MetricRow(PRODUCER, 0, None, "outPoolUsage", "sample", value, time.time() * 1000.0)]


def signed(key: str, secret: bytes, body: bytes) -> bytes:
    return key.encode() + b" " + hmac.new(secret, body, hashlib.sha256).hexdigest().encode() + b" " + body + b"\n"


class Watched:
    """A monitor service with one exchange registered and a task's client connected before any attack."""

    def __init__(self) -> None:
        self.got: list[list[MetricRow]] = []
        self.service = MonitorService("127.0.0.1", auth_timeout_s=DEADLINE_S)
        self.address = self.service.register(
            "keyby-pipelined-1", Monitor("keyby-pipelined-1", callback=self.got.append)
        )
        self.client = MonitorClient(self.address, attempt=1)
        self.client.publish(sample(0.25))
        assert wait_until(lambda: any(r.value == 0.25 for rows in self.got for r in rows))

    def still_serves(self) -> None:
        """The task's connection made before the attack still delivers, and a new task's connection too."""
        self.client.publish(sample(0.5))
        assert wait_until(lambda: any(r.value == 0.5 for rows in self.got for r in rows)), "samples froze"
        late = MonitorClient(self.address, attempt=2)
        late.publish(sample(0.75))
        late.close()
        assert wait_until(lambda: any(r.value == 0.75 for rows in self.got for r in rows))

    def close(self) -> None:
        self.client.close()
        self.service.close()


@pytest.fixture
def watched():
    monitor = Watched()
    yield monitor
    monitor.close()


def monitor_attacks(address) -> dict[str, tuple[bytes, int, str | None]]:
    body = json.dumps({"key": address.key, "attempt": 9, "seq": 0, "rows": []}).encode()
    return {
        "nested JSON": (NESTED + b"\n", 1, "line too long"),
        "nested JSON after a key and a forged mac": (
            address.key.encode() + b" " + b"0" * 64 + b" [[[[\n",
            1,
            "wrong mac",
        ),
        "garbage": (os.urandom(1024).replace(b"\n", b"").replace(b" ", b"") + b"\n", 1, "malformed line"),
        "a forged mac": (address.key.encode() + b" " + b"0" * 64 + b" " + body + b"\n", 1, "wrong mac"),
        "half a 1 MiB line": (HALF_LINE, 20, "line too long"),
        "idle, more than the cap": (b"", MAX_CONNECTIONS + 88, None),
    }


@pytest.mark.parametrize(
    "attack",
    [
        "nested JSON",
        "nested JSON after a key and a forged mac",
        "garbage",
        "a forged mac",
        "half a 1 MiB line",
        "idle, more than the cap",
    ],
)
def test_the_monitor_service_drops_each_attack_within_its_deadline_and_samples_keep_arriving(
    watched, attackers, attack
):
    data, count, cause = monitor_attacks(watched.address)[attack]
    service = watched.service
    for _ in range(count):
        attackers.open(service.address, data)
    lived = attackers.wait_closed(count)
    assert max(lived) < bound(DEADLINE_S), sorted(lived)[-5:]
    assert service.is_alive and service.num_restarts == 0
    if cause is not None:
        assert service.rejected_by_cause.get(cause) == count, service.rejected_by_cause
    # a connection without the secret holds at most a first line and one byte; at most the cap of them wait
    assert service.peak_buffered_bytes <= min(count, service.max_unauthenticated) * (MAX_FIRST_LINE + 1) + 4096
    assert service.num_connections <= 1 + service.max_unauthenticated
    watched.still_serves()
    assert wait_until(lambda: service.buffered_bytes == 0)


def test_a_replayed_line_and_nested_json_under_the_secrets_mac_are_refused(watched, attackers):
    service, address = watched.service, watched.address
    key, secret = address.key, address.secret
    first = signed(key, secret, json.dumps({"key": key, "attempt": 5, "seq": 0, "rows": []}).encode())
    with socket.create_connection(service.address, timeout=5) as sock:  # a task's lines, as recorded
        sock.sendall(first)
    assert wait_until(lambda: service._last_seq.get((key, 5)) == 0)
    attackers.open(service.address, first)  # the same bytes again: its sequence number is spent
    # the secret's own mac over JSON nested 100,000 deep, after a valid first line: the depth bound refuses it
    nested = signed(key, secret, NESTED)
    hello = signed(key, secret, json.dumps({"key": key, "attempt": 6, "seq": 0, "rows": []}).encode())
    attackers.open(service.address, hello + nested)
    assert max(attackers.wait_closed(2)) < bound(DEADLINE_S)
    assert service.rejected_by_cause == {"replayed line": 1, "malformed line": 1}
    watched.still_serves()


def test_a_task_whose_connection_the_service_closed_sends_again_on_a_new_one():
    got: list[list[MetricRow]] = []
    service = MonitorService("127.0.0.1", auth_timeout_s=DEADLINE_S, idle_timeout_s=0.3)
    client = MonitorClient(service.register("quiet-1", Monitor("quiet-1", callback=got.append)), attempt=1)
    try:
        client.publish(sample(0.25))
        assert wait_until(lambda: service.rejected_by_cause.get("idle timeout") == 1)  # quiet for too long
        client.publish(sample(0.5))
        assert wait_until(lambda: [r.value for rows in got for r in rows] == [0.25, 0.5])
    finally:
        client.close()
        service.close()


# -- a producer's listener (the data plane) -------------------------------------------------------------


def exact_after(producer: Producer) -> None:
    """A legitimate consumer still gets every row."""
    data = batches(3000)
    consumer = Consumer(producer.transport.address, [0], tls=producer.transport.tls)
    try:
        writer = threading.Thread(target=producer.write, args=(data, 1))
        writer.start()
        received = consumer.read_all(data[0].schema)
        writer.join(10)
        assert pa.Table.from_batches(received[0]).sort_by("id").equals(pa.Table.from_batches(data).sort_by("id"))
    finally:
        consumer.transport.close()


def producer_attacks() -> dict[str, tuple[bytes, int]]:
    return {
        "nested JSON": (NESTED + b"\n", 1),
        # random bytes after a first byte that starts no TLS record: a random first byte of 0x16, or one with the
        # high bit set (an SSLv2-style hello), may announce a record longer than what is sent, and the listener
        # then waits for the rest until its deadline, which is an idle connection, not garbage
        "garbage": (b"\x00" + os.urandom(4095), 1),
        "half a 1 MiB line": (HALF_LINE, 10),
        "idle, more than the cap": (b"", 32 + 16),
    }


@pytest.mark.parametrize("tls", [None, IDENTITY], ids=["plain", "tls"])
@pytest.mark.parametrize("attack", ["nested JSON", "garbage", "half a 1 MiB line", "idle, more than the cap", "replay"])
def test_a_producer_drops_each_attack_within_its_deadline_and_serves_its_consumer(attackers, attack, tls):
    if attack == "replay":  # a legitimate consumer's first bytes, recorded, sent again
        _, relay = exchange_through(True, tls, n=2000)
        data, count = bytes(relay.upstream[:4096]), 1
    else:
        data, count = producer_attacks()[attack]
    producer = Producer(1, handshake_timeout_s=PRODUCER_DEADLINE_S, max_unauthenticated=32, tls=tls)
    try:
        for _ in range(count):
            attackers.open(producer.transport.address, data)
        lived = attackers.wait_closed(count)
        assert max(lived) < bound(PRODUCER_DEADLINE_S), sorted(lived)[-5:]
        assert producer.transport.error is None and producer.transport.num_rejected == count
        if attack != "idle, more than the cap":  # refused for what they sent (no frame, or no TLS), not timed out
            assert max(lived) < PRODUCER_DEADLINE_S
            assert not producer.transport.rejected_by_cause.get("handshake timeout")
        exact_after(producer)
    finally:
        producer.transport.close()


@pytest.mark.parametrize("listener", ["producer", "address service"])
def test_300_tls_connections_arriving_at_once_are_dropped_at_the_authentication_deadline(attackers, listener):
    """A ClientHello and nothing more, 300 times at once, none evicted (the cap is above 300): each is dropped
    at the deadline counted from its own connect(), TLS handshake included."""
    if listener == "producer":
        producer = Producer(1, handshake_timeout_s=PRODUCER_DEADLINE_S, max_unauthenticated=400, tls=IDENTITY)
        address, deadline, close = producer.transport.address, PRODUCER_DEADLINE_S, producer.transport.close
    else:
        service = AddressRendezvous("127.0.0.1", request_timeout_s=PRODUCER_DEADLINE_S, max_pending=400)
        service.register("ex/1", SECRET, 2, tls=IDENTITY)
        address, deadline, close = service.address, PRODUCER_DEADLINE_S, service.close
    try:
        context = IDENTITY.client_context()
        for _ in range(300):
            attackers.open(address, tls=context, name=server_name("ex/1"))
        lived = attackers.wait_closed(300)
        assert min(lived) >= deadline * 0.9  # the deadline closed them, not a cap
        # the deadline closed every one, not an accept queue that held some back (a backlog of 64 made the last
        # ones wait a second for the kernel's retry): 300 at once fit the listener's backlog; the bound leaves
        # room for a loaded machine (deadline + 0.9 s failed at 1.97 s while two other test runs shared the cores)
        assert LISTEN_BACKLOG >= 300
        assert max(lived) < bound(deadline), sorted(lived)[-5:]
        if listener == "producer":
            assert producer.transport.rejected_by_cause == {"handshake timeout": 300}
            exact_after(producer)
        else:
            assert service.rejected_by_cause == {"request timeout": 300}
            assert gather(service, "ex/1", 2, IDENTITY) == {i: ["at 0", "at 1"] for i in range(2)}
    finally:
        close()


# -- a service's thread --------------------------------------------------------------------------------


class EchoService(LineService):
    """A service of the base alone: ``hello`` authenticates, any line is echoed, ``boom`` fails its
    handling, and :attr:`fail_rounds` rounds of the loop fail."""

    label = "echo service"

    def __init__(self, port: int = 0) -> None:
        super().__init__(
            "127.0.0.1",
            port=port,
            # deadlines this test does not exercise, long enough for a loaded machine
            auth_timeout_s=10 * DEADLINE_S,
            idle_timeout_s=10 * DEADLINE_S,
            max_connections=8,
            max_unauthenticated=4,
            first_line_limit=64,
            line_limit=1024,
            thread_name="echo",
        )
        self.fail_rounds = 0
        self._start()

    def on_line(self, peer: LinePeer, line: bytes) -> None:
        if line == b"boom":
            raise RuntimeError("a bug on one connection")
        if not peer.authenticated:
            if line != b"hello":
                raise Rejected("no hello", "no hello")
            self.authenticate(peer)
        self.send(peer, line + b"\n")

    def on_round(self, now: float) -> float | None:
        if self.fail_rounds:
            self.fail_rounds -= 1
            raise RuntimeError("a bug outside any connection")
        return None

    def _successor(self, host: str, port: int) -> EchoService:
        return EchoService(port)


def echo(address, *lines: bytes) -> list[bytes]:
    """Each line sent and its echo read before the next (read_line reads a conversation that alternates:
    two replies arriving in one read would lose the second)."""
    replies = []
    with socket.create_connection(address, timeout=20) as sock:  # a service thread of a loaded test process
        for line in lines:
            sock.sendall(line + b"\n")
            replies.append(read_line(sock))
    return replies


def test_failures_on_one_connection_close_it_only_and_a_failed_loop_goes_on_on_its_port():
    service = EchoService()
    try:
        with socket.create_connection(service.address, timeout=5) as sock:
            sock.sendall(b"hello\nboom\n")
            assert read_line(sock) == b"hello"
            with pytest.raises(ValueError, match="closed"):
                read_line(sock)
        assert service.rejected_by_cause == {"failed: RuntimeError": 1}
        held = socket.create_connection(service.address, timeout=5)
        held.sendall(b"hello\n")
        assert read_line(held) == b"hello"
        service.fail_rounds = 1
        service.wakeup()
        assert wait_until(lambda: service.num_restarts == 1)
        held.settimeout(5)
        assert held.recv(1) == b""  # the loop's connections were closed
        held.close()
        assert service.is_alive and echo(service.address, b"hello", b"again") == [b"hello", b"again"]
    finally:
        service.close()


def test_a_service_whose_thread_ended_starts_again_on_its_port_with_its_exchanges():
    services: ServicesByHost[AddressRendezvous] = ServicesByHost(AddressRendezvous, resolve_host)
    first = services.get("127.0.0.1")
    first.register("ex/1", SECRET, 2)
    first.close()  # its thread ends, as after failures it could not go on from
    assert not first.is_alive
    started = time.monotonic()
    with pytest.raises(CreditShuffleError, match=r"nothing listens at .* build the exchange again"):
        all_gather_via(first.address, "ex/1", SECRET, "stage 1", 0, 0, 10.0)("at 0")
    assert time.monotonic() - started < 1.0  # at once, not after the request's timeout
    second = services.get("127.0.0.1")
    try:
        assert second is not first and second.address == first.address and second.exchanges == ["ex/1"]
        assert gather(second, "ex/1", 2) == {i: ["at 0", "at 1"] for i in range(2)}
    finally:
        second.close()


# -- on Spark ---------------------------------------------------------------------------------------------


@pytest.mark.spark
def test_an_exchange_built_before_nested_json_hit_the_drivers_services_runs_exactly_with_its_samples(spark):
    n = 20_000
    df = spark.range(0, n, 1, 2).select("id", (F.col("id") % 101).cast("int").alias("k"))
    got: list[list[MetricRow]] = []
    ex = scs.exchange(df, scs.key_by("k"), 2, mode="pipelined", monitor=got.append)
    host = spark.conf.get("spark.driver.host", None) or "127.0.0.1"
    rendezvous, monitor = driver_rendezvous(host), driver_monitor(host)
    assert any(name.startswith(f"{ex.name}/") for name in rendezvous.exchanges)  # built: registered already
    key = ex.plan.monitor.key
    for address, line in (
        (rendezvous.address, NESTED + b"\n"),
        (rendezvous.address, b"[" * 3000 + b"\n"),
        (monitor.address, NESTED + b"\n"),
        (monitor.address, key.encode() + b" " + b"0" * 64 + b" " + NESTED + b"\n"),
        (monitor.address, b"0" * 64 + b" " + NESTED + b"\n"),
    ):
        with socket.create_connection(address, timeout=5) as sock:
            with contextlib.suppress(OSError):
                sock.sendall(line)
            sock.settimeout(10)
            with contextlib.suppress(OSError):
                assert sock.recv(1) == b""
    assert rendezvous.is_alive and monitor.is_alive
    assert driver_rendezvous(host) is rendezvous and driver_monitor(host) is monitor
    rows = ex.df.withColumn("_subtask", F.spark_partition_id()).collect()
    assert sorted(r["id"] for r in rows) == list(range(n))
    placed = sorted({(r["k"], r["_subtask"]) for r in rows})
    channels = scs.key_group_channels(pa.array([k for k, _ in placed], pa.int32()), 2, 128).tolist()
    assert [s for _, s in placed] == channels
    assert wait_until(lambda: any(r.metric == "numRecordsIn" for rows_ in got for r in rows_))
    assert rendezvous.num_restarts == 0 and monitor.num_restarts == 0
