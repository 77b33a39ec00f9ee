"""The TCP transport on 127.0.0.1 with real sockets: credit-based streaming over one multiplexed
connection, authentication, hostile input, handshake and connect timeouts, and a clean shutdown."""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading

import pyarrow as pa
import pytest
from tcp_helpers import SECRET, Consumer, Producer, batches, closed_by_peer, wait_until

from spark_credit_shuffle.errors import ExchangeTimeoutError
from spark_credit_shuffle.protocol import (
    AddCredit,
    AuthChallenge,
    AuthResponse,
    CreditBasedPartitionRequestClientHandler,
    Hello,
    PartitionRequest,
    encode_to_bytes,
)
from spark_credit_shuffle.protocol.codec import MAGIC_NUMBER, PROTOCOL_VERSION
from spark_credit_shuffle.transport.tcp import MAX_HELLO_BYTES, TcpTransport, resolve_host

pytestmark = pytest.mark.timeout(60)


def test_resolve_host_gives_an_ipv4_address():
    assert resolve_host("localhost") == "127.0.0.1"
    assert resolve_host("127.0.0.1") == "127.0.0.1"
    with pytest.raises(OSError):
        resolve_host("")


def test_listens_only_on_the_given_address():
    producer = Producer(1)
    try:
        host, port = producer.transport.address
        assert host == "127.0.0.1" and port > 0
    finally:
        producer.transport.close()


def test_all_channels_of_a_task_pair_stream_over_one_connection_under_credit():
    data = batches(30_000)
    producer = Producer(3)
    consumer = Consumer(producer.transport.address, [0, 1, 2])
    try:
        writer = threading.Thread(target=producer.write, args=(data, 3))
        writer.start()
        received = consumer.read_all(data[0].schema)
        writer.join(10)
        got = pa.Table.from_batches([b for channel in received for b in channel]).sort_by("id")
        assert got.equals(pa.Table.from_batches(data).sort_by("id"))
        assert [sum(b.num_rows for b in channel) for channel in received] == producer.expected
        # every channel shares the one connection; the half-close ends it on both sides
        assert len([c for c in producer.transport.connections if c.role == "server"]) <= 1
        assert wait_until(lambda: not consumer.transport.connections and not producer.transport.connections)
        assert consumer.conn.error is None and consumer.conn.bytes_in > 0
        assert all(sub.is_released for sub in producer.partition.subpartitions)
    finally:
        consumer.transport.close()
        producer.transport.close()


def hostile_payloads() -> dict[str, bytes]:
    header = struct.Struct(">IIBB")
    return {
        "wrong secret": encode_to_bytes(Hello(b"n" * 32)) + encode_to_bytes(AuthResponse(b"x" * 32)),
        "no hello first": encode_to_bytes(PartitionRequest(1, 0, 2, 7)),
        "request before the response": encode_to_bytes(Hello(b"n" * 32))
        + encode_to_bytes(PartitionRequest(1, 0, 2, 7)),
        "garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        "oversized length": header.pack(1 << 31, MAGIC_NUMBER, PROTOCOL_VERSION, 2),
        "garbage after a valid hello": encode_to_bytes(Hello(b"n" * 32)) + b"\xff" * 64,
        "the old protocol's hello with the secret": header.pack(44, MAGIC_NUMBER, 1, 12) + b"\0\x20" + SECRET,
    }


@pytest.mark.parametrize("kind", sorted(hostile_payloads()))
def test_hostile_connection_is_closed_and_logged_and_the_exchange_carries_on(caplog, kind):
    caplog.set_level(logging.WARNING, logger="spark_credit_shuffle")
    data = batches(5000)
    producer = Producer(1)
    rogue = socket.create_connection(producer.transport.address)
    try:
        rogue.sendall(hostile_payloads()[kind])
        assert closed_by_peer(rogue), f"the server kept a connection that sent {kind}"
        consumer = Consumer(producer.transport.address, [0])
        writer = threading.Thread(target=producer.write, args=(data, 1))
        writer.start()
        received = consumer.read_all(data[0].schema)
        writer.join(10)
        assert sum(b.num_rows for b in received[0]) == 5000
        assert producer.transport.num_rejected == 1
        assert any("closing connection" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        consumer.transport.close()
    finally:
        rogue.close()
        producer.transport.close()


def test_a_client_with_the_wrong_secret_gets_no_data_and_sends_nothing_but_its_hello(caplog):
    caplog.set_level(logging.WARNING, logger="spark_credit_shuffle")
    producer = Producer(1)
    consumer = Consumer(producer.transport.address, [0], secret=b"not the secret")
    try:
        assert wait_until(lambda: consumer.conn.closed)
        assert "producer's proof does not verify" in str(consumer.conn.error)
        assert consumer.conn.bytes_in == len(encode_to_bytes(AuthChallenge(b"n" * 32, b"p" * 32)))  # no data
        assert consumer.conn.bytes_out == len(encode_to_bytes(Hello(b"n" * 32)))  # no request, no credit
        with consumer.lock, pytest.raises(Exception, match="connection to the producer closed"):
            consumer.gate.poll_next()
    finally:
        consumer.transport.close()
        producer.transport.close()


def test_a_silent_connection_is_closed_after_the_handshake_timeout(caplog):
    caplog.set_level(logging.WARNING, logger="spark_credit_shuffle")
    producer = Producer(1, handshake_timeout_s=0.2)
    try:
        silent = socket.create_connection(producer.transport.address)
        assert closed_by_peer(silent)
        assert "no completed handshake" in producer.transport.rejections[0]
        silent.close()
    finally:
        producer.transport.close()


def test_when_too_many_connections_wait_to_authenticate_the_oldest_is_closed_and_a_peer_still_gets_in(caplog):
    caplog.set_level(logging.WARNING, logger="spark_credit_shuffle")
    data = batches(5000)
    producer = Producer(1, max_unauthenticated=2)
    sockets = [socket.create_connection(producer.transport.address)]
    try:
        assert wait_until(lambda: len(producer.transport.connections) == 1)
        sockets.append(socket.create_connection(producer.transport.address))
        assert wait_until(lambda: len(producer.transport.connections) == 2)
        oldest = "client {}:{}".format(*sockets[0].getsockname())
        sockets.append(socket.create_connection(producer.transport.address))  # one more than the limit
        assert closed_by_peer(sockets[0]), "the oldest silent connection was kept"
        assert f"closing connection with {oldest}" in producer.transport.rejections[0]
        assert "max_unauthenticated=2" in producer.transport.rejections[0]
        consumer = Consumer(producer.transport.address, [0])  # a legitimate peer: it gets in, whatever waits
        writer = threading.Thread(target=producer.write, args=(data, 1))
        writer.start()
        received = consumer.read_all(data[0].schema)
        writer.join(10)
        assert sum(b.num_rows for b in received[0]) == 5000
        assert sum(not c.is_authenticated for c in producer.transport.connections) <= 2
        consumer.transport.close()
    finally:
        for s in sockets:
            s.close()
        producer.transport.close()


def test_a_peer_dribbling_a_hello_byte_by_byte_is_closed_at_the_deadline_counted_from_connecting():
    producer = Producer(1, handshake_timeout_s=0.3)
    hello = encode_to_bytes(Hello(b"n" * 32))
    try:
        with socket.create_connection(producer.transport.address) as slow:
            stop = threading.Event()

            def dribble() -> None:
                for byte in hello[:-1]:  # the whole Hello would take longer than the deadline
                    if stop.wait(0.05):
                        return
                    with contextlib.suppress(OSError):
                        slow.sendall(bytes([byte]))

            sender = threading.Thread(target=dribble)
            sender.start()
            try:
                assert closed_by_peer(slow)
            finally:
                stop.set()
                sender.join(5)
        assert "no completed handshake within 300 ms of connecting" in producer.transport.rejections[0]
    finally:
        producer.transport.close()


def test_a_peer_sending_more_than_the_handshake_before_authenticating_is_closed():
    producer = Producer(1)  # authentication deadline 5 s: the byte limit closes it first
    header = struct.Struct(">IIBB")
    try:
        with socket.create_connection(producer.transport.address) as rogue:
            rogue.sendall(header.pack(4000, MAGIC_NUMBER, PROTOCOL_VERSION, 12))  # a Hello frame of 4000 bytes
            rogue.sendall(b"\0" * (MAX_HELLO_BYTES + 10))
            assert closed_by_peer(rogue, timeout=2.0)
        assert f"without completing the handshake (at most {MAX_HELLO_BYTES} bytes" in producer.transport.rejections[0]
    finally:
        producer.transport.close()


def test_a_flood_of_silent_connections_logs_each_cause_once_and_a_count_when_the_transport_closes(caplog):
    caplog.set_level(logging.DEBUG, logger="spark_credit_shuffle")
    producer = Producer(1, max_unauthenticated=4, handshake_timeout_s=1.0)
    sockets = [socket.create_connection(producer.transport.address) for _ in range(20)]
    try:
        assert wait_until(lambda: producer.transport.num_rejected == 20)
        assert producer.transport.rejected_by_cause == {"evicted unauthenticated": 16, "handshake timeout": 4}
    finally:
        for s in sockets:
            s.close()
        producer.transport.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings  # the first of each cause, then one count of both
    assert "16 x evicted unauthenticated, 4 x handshake timeout" in warnings[-1]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 18


def test_connect_gives_up_after_its_timeout_naming_the_peer():
    with socket.socket() as probe:  # a port with nobody listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    lock = threading.RLock()
    transport = TcpTransport("127.0.0.1", lock, name="consumer")
    transport.start()
    try:
        handler = CreditBasedPartitionRequestClientHandler(secret=SECRET)
        with pytest.raises(ExchangeTimeoutError, match=rf"producer subtask 3 at 127\.0\.0\.1:{port}.*within 300 ms"):
            transport.connect(
                ("127.0.0.1", port), handler, peer=f"producer subtask 3 at 127.0.0.1:{port}", timeout_s=0.3
            )
    finally:
        transport.close()


def test_close_joins_the_io_thread_and_closes_every_socket():
    producer = Producer(1)
    client = socket.create_connection(producer.transport.address)
    assert wait_until(lambda: producer.transport.connections)
    thread = producer.transport._thread
    address = producer.transport.address
    producer.transport.close(timeout_s=5)
    assert thread is not None and not thread.is_alive()
    assert closed_by_peer(client)
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=1).close()
    client.close()


def test_a_lingering_close_delivers_the_fatal_error_and_ends_when_the_consumer_closed():
    """A failing producer's close writes its fatal ErrorResponse, half-closes and reads on until its consumer
    closed: credit the consumer sent meanwhile is read (no reset that could destroy the error before the
    consumer read it) and ignored, and the close ends with the consumer's, long before its linger."""
    producer = Producer(1)
    consumer = Consumer(producer.transport.address, [0])
    try:
        assert wait_until(
            lambda: any(c.role == "server" and c.handler.queue.all_readers for c in producer.transport.connections)
        )
        with producer.lock:
            (server,) = [c for c in producer.transport.connections if c.role == "server"]
            server.handler.queue.notify_fatal_error("the producer's input failed")
        with consumer.lock:  # credit in flight while the producer closes (the transport writes under this lock)
            consumer.conn.sock.sendall(encode_to_bytes(AddCredit(1, 1)))
        closing = threading.Thread(target=producer.transport.close, kwargs={"timeout_s": 60, "linger_s": 60})
        closing.start()
        assert wait_until(lambda: consumer.conn.closed)
        assert "the producer's input failed" in str(consumer.handler.fatal_error)
        assert consumer.conn.error is None  # the producer's half-close, not a reset
        consumer.transport.close()
        closing.join(10)
        assert not closing.is_alive(), "the producer's close waited out its linger after the consumer closed"
        assert producer.transport.num_rejected == 0
    finally:
        consumer.transport.close()
        producer.transport.close()
