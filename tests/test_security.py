"""What a reader or a forger on the network gets from a pipelined exchange: the secret never, the rows only
without TLS; and what the listeners refuse (a wrong secret, a wrong certificate, a replayed handshake, plain
text to a TLS listener), each within the authentication deadline, with the exchange carrying on exactly.

Real transports on 127.0.0.1; a relay between consumer and producer records every byte each side sends.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import ssl
import threading

import pyarrow as pa
import pytest
from exchange_helpers import expected_placement, inputs, make_plan, spark_rows, table
from spark_helpers import session_conf
from tcp_helpers import (
    CONFIG,
    MARKER,
    NUMBER,
    SECRET,
    Consumer,
    Producer,
    closed_by_peer,
    exchange_through,
    marked_batches,
)

import spark_credit_shuffle as scs
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import ConfigError, CreditShuffleError, ProtocolError
from spark_credit_shuffle.protocol import Hello, encode_to_bytes
from spark_credit_shuffle.runtime.pipelined import run_in_threads
from spark_credit_shuffle.runtime.pipelined.rendezvous import AddressRendezvous, all_gather_via
from spark_credit_shuffle.runtime.pipelined.rendezvous.wire import server_name
from spark_credit_shuffle.runtime.security import use_tls
from spark_credit_shuffle.transport.tls import TlsIdentity

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 1.0
IDENTITY = TlsIdentity.generate("test exchange")


@pytest.mark.parametrize("tls", [None, IDENTITY], ids=["plain", "tls"])
def test_the_wire_never_carries_the_secret_and_with_tls_no_row_value(tls):
    _, relay = exchange_through(True, tls)
    wire = bytes(relay.upstream) + bytes(relay.downstream)
    assert len(relay.downstream) > 6000 * 8  # the rows went through the relay
    assert SECRET not in wire and SECRET[:8] not in wire
    number = NUMBER.to_bytes(8, "little")
    if tls is None:  # the test can see rows: without TLS they are there in the clear
        assert MARKER.encode() in relay.downstream and number in relay.downstream
    else:
        assert MARKER.encode() not in wire and number not in wire
        assert IDENTITY.private_key not in wire


def _rogue_is_refused_and_the_exchange_is_exact(producer: Producer, rogue: socket.socket, cause: str) -> None:
    with rogue:
        assert closed_by_peer(rogue, timeout=DEADLINE_S + 2), "the listener kept the rogue connection"
    _exact_after(producer, cause)


def _exact_after(producer: Producer, cause: str, rejected: int = 1) -> None:
    """A legitimate consumer still gets every row, and the ``rejected`` rogues were refused for ``cause``."""
    data = marked_batches(3000)
    consumer = Consumer(producer.transport.address, [0], tls=producer.transport.tls)
    try:
        writer = threading.Thread(target=producer.write, args=(data, 1))
        writer.start()
        received = consumer.read_all(data[0].schema)
        writer.join(10)
        got = pa.Table.from_batches(received[0]).sort_by("id")
        assert got.equals(pa.Table.from_batches(data).sort_by("id"))
    finally:
        consumer.transport.close()
    assert producer.transport.num_rejected == rejected
    assert cause in " ".join(producer.transport.rejections), producer.transport.rejections


def test_a_replayed_handshake_is_refused():
    _, relay = exchange_through(True, None, n=2000)
    recorded = bytes(relay.upstream[:84])  # the legitimate consumer's Hello and AuthResponse
    producer = Producer(1, handshake_timeout_s=DEADLINE_S)
    try:
        rogue = socket.create_connection(producer.transport.address)
        rogue.sendall(recorded)
        _rogue_is_refused_and_the_exchange_is_exact(producer, rogue, "wrong secret")
    finally:
        producer.transport.close()


def test_a_replayed_tls_conversation_is_refused():
    _, relay = exchange_through(True, IDENTITY, n=2000)
    producer = Producer(1, handshake_timeout_s=DEADLINE_S, tls=IDENTITY)
    try:
        rogue = socket.create_connection(producer.transport.address)
        rogue.sendall(bytes(relay.upstream[:4096]))
        _rogue_is_refused_and_the_exchange_is_exact(producer, rogue, "TLS handshake failed")
    finally:
        producer.transport.close()


def test_plain_text_to_a_tls_listener_is_refused():
    producer = Producer(1, handshake_timeout_s=DEADLINE_S, tls=IDENTITY)
    try:
        rogue = socket.create_connection(producer.transport.address)
        rogue.sendall(encode_to_bytes(Hello(os.urandom(32))))
        _rogue_is_refused_and_the_exchange_is_exact(producer, rogue, "TLS handshake failed")
    finally:
        producer.transport.close()


def test_a_wrong_certificate_is_refused_by_both_sides(tmp_path):
    producer = Producer(1, handshake_timeout_s=DEADLINE_S, tls=IDENTITY)
    other = TlsIdentity.generate("another exchange")
    try:
        # a consumer with another exchange's key pair does not trust the producer's certificate
        with pytest.raises(ProtocolError, match="TLS handshake with producer subtask 0 failed"):
            Consumer(producer.transport.address, [0], tls=other)
        # a client that trusts anything still has to present the exchange's certificate
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.load_cert_chain(*_identity_files(other, str(tmp_path)))
        raw = socket.create_connection(producer.transport.address)
        rogue = context.wrap_socket(raw)
        with pytest.raises((ssl.SSLError, OSError)):  # TLS 1.3: the server checks it after the client's Finished
            rogue.sendall(encode_to_bytes(Hello(os.urandom(32))))
            while rogue.recv(4096):
                pass
        rogue.close()
        assert _wait(lambda: producer.transport.num_rejected == 2)  # the consumer's and the rogue's
        assert set(producer.transport.rejected_by_cause) == {
            "TLS handshake failed: TLSV1_ALERT_UNKNOWN_CA",
            "TLS handshake failed: CERTIFICATE_VERIFY_FAILED",
        }
        _exact_after(producer, "TLS handshake failed", rejected=2)
    finally:
        producer.transport.close()


def _identity_files(identity: TlsIdentity, directory: str) -> tuple[str, str]:
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert, "wb") as f:
        f.write(identity.certificate)
    with open(key, "wb") as f:
        f.write(identity.private_key)
    return cert, key


def test_a_wrong_secret_over_tls_is_refused():
    producer = Producer(1, handshake_timeout_s=DEADLINE_S, tls=IDENTITY)
    try:
        consumer = Consumer(producer.transport.address, [0], secret=b"not the secret", tls=IDENTITY)
        try:
            assert _wait(lambda: consumer.conn.closed)
            assert "producer's proof does not verify" in str(consumer.conn.error)
        finally:
            consumer.transport.close()
        assert producer.transport.num_rejected == 0  # the consumer gave up first: nothing was sent to it
    finally:
        producer.transport.close()


def _wait(predicate, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("executors", [None, [0, 0, 1]], ids=["remote channels", "local and remote channels"])
def test_a_pipelined_exchange_between_tasks_with_tls_is_exact(executors):
    plan = dataclasses.replace(make_plan(scs.key_by("k"), 3, 3), tls=True)
    data = inputs(3, 4000)
    received, _ = run_in_threads(plan, data, executors=executors)
    for consumer, want in enumerate(expected_placement(plan, data)):
        assert table(received[consumer]).sort_by("id").equals(want)


def test_the_key_pair_never_shows_its_private_key():
    assert b"PRIVATE" not in repr(IDENTITY).encode() and b"BEGIN CERTIFICATE" in IDENTITY.certificate


# -- the driver's address service ------------------------------------------------------------------------


def test_the_address_service_with_tls_answers_only_tls_with_the_exchange_certificate(caplog, tmp_path):
    service = AddressRendezvous("127.0.0.1", timeout_s=30, request_timeout_s=DEADLINE_S)
    secret = os.urandom(32)
    other = TlsIdentity.generate("another exchange")
    try:
        service.register("ex/tls", secret, 2, tls=IDENTITY)
        answers: dict[int, list[str]] = {}

        def task(i: int) -> None:
            answers[i] = all_gather_via(service.address, "ex/tls", secret, "stage 1", i, i, 10.0, tls=IDENTITY)(
                f"address of {i}"
            )

        first = threading.Thread(target=task, args=(0,))
        first.start()
        with caplog.at_level(logging.WARNING, logger="spark_credit_shuffle"):
            for kwargs in ({"tls": None}, {"tls": other}):  # plain text, and another key pair: refused
                with pytest.raises(CreditShuffleError, match="address service"):
                    all_gather_via(service.address, "ex/tls", secret, "stage 1", 1, 9, 5.0, **kwargs)("rogue")
            with pytest.raises(CreditShuffleError, match="did not prove"):  # TLS right, secret wrong
                all_gather_via(service.address, "ex/tls", os.urandom(32), "stage 1", 1, 9, 5.0, tls=IDENTITY)("x")
            # an exchange the service does not hold a key pair for: the task falls back to allGather
            fallback = all_gather_via(
                service.address, "ex/gone", secret, "stage 1", 0, 1, 5.0, fallback=lambda m: [m], tls=IDENTITY
            )
            assert fallback("mine") == ["mine"]
            # a client that trusts any server and names the exchange still has to present its certificate
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            context.load_cert_chain(*_identity_files(other, str(tmp_path)))
            with socket.create_connection(service.address, timeout=5) as raw:
                rogue = context.wrap_socket(raw, server_hostname=server_name("ex/tls"))
                with pytest.raises((ssl.SSLError, OSError, ValueError)):  # refused after its Finished (TLS 1.3)
                    rogue.sendall(b'{"exchange": "ex/tls", "nonce": "' + b"00" * 32 + b'"}\n')
                    if not rogue.recv(4096):
                        raise ValueError("closed without an answer")
        task(1)
        first.join(10)
        assert answers == {i: ["address of 0", "address of 1"] for i in range(2)}
        assert service.rejected_by_cause.get("plain text for TLS") == 1
        # another key pair on either side, and the server name of an exchange it does not hold
        assert service.rejected_by_cause.get("TLS handshake failed") == 3
    finally:
        service.close()


# -- the decision, before launch ----------------------------------------------------------------------------


@pytest.mark.spark
def test_tls_follows_the_session_unless_the_setting_says_otherwise(spark):
    assert not use_tls(NetworkConfig(), spark, "pipelined")  # the test session encrypts nothing
    assert use_tls(NetworkConfig(ssl=True), spark, "pipelined")
    assert not use_tls(NetworkConfig(ssl="on"), spark, "blocking")  # Spark's shuffle: Spark's settings
    with session_conf(spark, "spark.ssl.enabled", "true"):
        assert use_tls(NetworkConfig(), spark, "pipelined")
        assert not use_tls(NetworkConfig(ssl="off"), spark, "pipelined")
    with pytest.raises(ConfigError, match="'ssl'"):
        NetworkConfig(ssl="sometimes")
    assert CONFIG.ssl == "auto"


@pytest.mark.spark
def test_a_pipelined_exchange_on_a_session_that_encrypts_runs_tls_unasked_and_is_exact(spark):
    df = spark_rows(spark, 6000, 3)
    with session_conf(spark, "spark.network.crypto.enabled", "true"):
        ex = scs.exchange(df, scs.key_by("k"), parallelism=3, mode="pipelined")
        assert ex.plan.tls
        rows = ex.df.collect()
    assert sorted(r["id"] for r in rows) == list(range(6000))
    assert sum(r.value for r in ex.metric_rows() if r.metric == "numRecordsIn") == 6000
    assert not scs.exchange(df, scs.key_by("k"), mode="pipelined").plan.tls  # the conf is back as it was


@pytest.mark.spark
def test_a_pipelined_exchange_with_tls_over_spark_connect_is_exact(connect_spark):
    df = spark_rows(connect_spark, 3000, 2)
    ex = scs.exchange(df, scs.key_by("k"), parallelism=2, mode="pipelined", ssl=True)
    assert ex.plan.tls
    assert sorted(r["id"] for r in ex.df.collect()) == list(range(3000))


@pytest.mark.spark
def test_tls_asked_for_and_impossible_is_refused_before_launch(spark, monkeypatch):
    from spark_helpers import no_spark_jobs

    from spark_credit_shuffle.transport import tls as tls_module

    # a Python whose ssl module lacks TLS 1.3 (the attribute ssl sets from OpenSSL's build)
    monkeypatch.setattr(tls_module.ssl, "HAS_TLSv1_3", False)
    with no_spark_jobs(spark), pytest.raises(ConfigError, match=r"'ssl'.*TLS is asked for by ssl=on.*TLS 1\.3"):
        scs.exchange(spark_rows(spark, 10, 2), scs.key_by("k"), mode="pipelined", ssl=True)
