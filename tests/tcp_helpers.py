"""A producer and a consumer subtask over the real TCP transport, without Spark: the pipelined partition and
the gate each under its own lock, as a task holds them; a relay that records what crosses the wire; waits.
Shared by the transport, security and hostile-client tests."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time

import numpy as np
import pyarrow as pa

from spark_credit_shuffle import key_by
from spark_credit_shuffle.buffers import Buffer, RecordReader, RecordWriter
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.protocol import (
    CreditBasedPartitionRequestClientHandler,
    NetworkBufferPool,
    PartitionRequestServerHandler,
    PipelinedResultPartition,
    ResultPartitionManager,
    SingleInputGate,
    default_max_frame_length,
)
from spark_credit_shuffle.transport.tcp import TcpTransport
from spark_credit_shuffle.transport.tls import TlsIdentity

#: The exchange's secret both sides prove, and their network settings (small buffers, short timeouts).
SECRET = b"s" * 32

CONFIG = NetworkConfig(segment_size=4096, buffer_timeout_ms=-1, partition_request_timeout_ms=2000)

FRAME = default_max_frame_length(CONFIG.segment_size)

#: A string and an int64 that every row carries, easy to find in a byte stream.
MARKER = "row-value-7f3a9c"

NUMBER = 0x5EC2E7_5EC2E7_5E


def batches(n: int, seed: int = 0) -> list[pa.RecordBatch]:
    """``n`` rows (id, a key 0..49, a 19-character string) in batches of 1,000."""
    rng = np.random.default_rng(seed)
    ids = np.arange(n, dtype=np.int64)
    keys = rng.integers(0, 50, n).astype(np.int32)
    words = pa.array([f"w{i:018d}" for i in ids])
    batch = pa.RecordBatch.from_arrays([pa.array(ids), pa.array(keys), words], names=["id", "k", "s"])
    return [batch.slice(i, 1000) for i in range(0, n, 1000)]


class Producer:
    """One producer subtask serving a pipelined partition over TCP."""

    def __init__(
        self, num_subpartitions: int, *, handshake_timeout_s: float = 5.0, max_unauthenticated: int = 32, tls=None
    ):
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.network = NetworkBufferPool.from_config(CONFIG)
        self.partition = PipelinedResultPartition.create(self.network, num_subpartitions, CONFIG, partition_id=7)
        self.manager = ResultPartitionManager()
        self.manager.register_partition(self.partition)
        self.partition.buffer_pool.add_availability_listener(self.notify)
        self.transport = TcpTransport(
            "127.0.0.1",
            self.lock,
            server_handler_factory=self.handler,
            handshake_timeout_s=handshake_timeout_s,
            max_unauthenticated=max_unauthenticated,
            on_event=self.notify,
            name="producer",
            tls=tls,
        )
        self.transport.start()

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def handler(self, wakeup):
        handler = PartitionRequestServerHandler(self.manager, secret=SECRET, max_frame_length=FRAME)
        handler.queue.listener = wakeup
        return handler

    def write(self, data: list[pa.RecordBatch], num_consumers: int) -> None:
        """Write ``data`` keyed by ``k``, waiting for buffers like a back-pressured producer would."""
        selector = key_by("k").selector(0, 1, num_consumers, 128)
        writer = RecordWriter(LockedPartition(self.partition, self.lock), selector, CONFIG.segment_size)
        for batch in data:
            with self.cond:
                assert self.cond.wait_for(self.partition.is_available, timeout=10), "producer never got a buffer"
            writer.emit(batch)
        writer.finish()
        self.expected = writer.num_records_out


class LockedPartition:
    """The partition as the RecordWriter sees it, every call under the producer's lock."""

    def __init__(self, partition, lock):
        self.partition, self.lock = partition, lock
        self.num_subpartitions = partition.num_subpartitions

    def request_segment(self, sp):
        with self.lock:
            recycler = self.partition.request_segment(sp)

        def recycle():
            with self.lock:
                recycler()

        return recycle

    def __getattr__(self, name):
        method = getattr(self.partition, name)

        def locked(*args, **kwargs):
            with self.lock:
                return method(*args, **kwargs)

        return locked


class Consumer:
    """One consumer task reading ``channels`` subpartitions of one producer over ONE connection."""

    def __init__(self, address, subpartitions: list[int], *, secret: bytes = SECRET, tls=None):
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.network = NetworkBufferPool.from_config(CONFIG)
        self.transport = TcpTransport("127.0.0.1", self.lock, on_event=self.notify, name="consumer", tls=tls)
        self.transport.start()
        self.gate = SingleInputGate(self.network, len(subpartitions), CONFIG)
        self.gate.listener = self.notify
        self.handler = CreditBasedPartitionRequestClientHandler(secret=secret, max_frame_length=FRAME)
        with self.lock:  # channels first: a connection refused at once still fails them
            for channel, sp in enumerate(subpartitions):
                self.gate.remote_channel(channel, channel + 1, self.handler, partition_id=7, subpartition=sp)
            self.gate.request_partitions()
        self.conn = self.transport.connect(address, self.handler, peer="producer subtask 0", timeout_s=5)

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def read_all(self, schema) -> list[list[pa.RecordBatch]]:
        readers = [RecordReader(schema, channel=c) for c in range(self.gate.num_channels)]
        out: list[list[pa.RecordBatch]] = [[] for _ in readers]
        deadline = time.monotonic() + 20
        while True:
            with self.cond:
                polled = None
                while polled is None and not self.gate.is_finished:
                    assert time.monotonic() < deadline, "consumer waited too long"
                    polled = self.gate.poll_next()
                    if polled is None:
                        self.cond.wait(0.2)
                if polled is None:
                    return out
                buffer = polled.buffer

                def recycle(r=buffer.recycle):
                    with self.lock:
                        r()

                # the reader recycles after decoding, outside this block: under the lock again
                buffer = Buffer(buffer.data_type, buffer.data, recycle)
            for item in readers[polled.channel_index].feed(buffer, polled.sequence_number):
                if isinstance(item, pa.RecordBatch):
                    out[polled.channel_index].append(item)


def wait_until(predicate, timeout=10.0) -> bool:
    """Whether ``predicate()`` became true within ``timeout`` seconds (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """The server closed ``sock``: a read returns EOF or a reset."""
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def marked_batches(n: int) -> list[pa.RecordBatch]:
    """``n`` rows carrying :data:`MARKER` and :data:`NUMBER`, in batches of 1,000."""
    ids = np.arange(n, dtype=np.int64)
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(ids),
            pa.array((ids % 50).astype(np.int32)),
            pa.array([f"{MARKER}-{i}" for i in range(n)]),
            pa.array(np.full(n, NUMBER, dtype=np.int64)),
        ],
        names=["id", "k", "s", "n"],
    )
    return [batch.slice(i, 1000) for i in range(0, n, 1000)]


class Relay:
    """Forwards one connection at a time to ``target`` and records what each side sent."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.upstream = bytearray()  # consumer -> producer
        self.downstream = bytearray()  # producer -> consumer
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        selector = selectors.DefaultSelector()
        selector.register(client, selectors.EVENT_READ, (server, self.upstream))
        selector.register(server, selectors.EVENT_READ, (client, self.downstream))
        open_ends = 2
        with client, server, selector:
            while open_ends:
                for key, _ in selector.select(10):
                    other, record = key.data
                    try:
                        data = key.fileobj.recv(65536)
                    except OSError:
                        data = b""
                    if data:
                        record += data
                        with contextlib.suppress(OSError):
                            other.sendall(data)
                    else:  # pass the half-close on
                        selector.unregister(key.fileobj)
                        open_ends -= 1
                        with contextlib.suppress(OSError):
                            other.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.thread.join(10)
        self.listener.close()


def exchange_through(relay_to_producer: bool, tls: TlsIdentity | None, n: int = 6000):
    """One producer, one consumer reading 2 subpartitions through a relay; returns (rows, relay)."""
    data = marked_batches(n)
    producer = Producer(2, tls=tls)
    relay = Relay(producer.transport.address)
    consumer = Consumer(relay.address, [0, 1], tls=tls)
    try:
        writer = threading.Thread(target=producer.write, args=(data, 2))
        writer.start()
        received = consumer.read_all(data[0].schema)
        writer.join(10)
        assert wait_until(lambda: not consumer.transport.connections and not producer.transport.connections)
        assert consumer.conn.error is None  # the half-close ends TLS cleanly too
        relay.close()
        rows = pa.Table.from_batches([b for channel in received for b in channel]).sort_by("id")
        assert rows.equals(pa.Table.from_batches(data).sort_by("id"))
        return rows, relay
    finally:
        consumer.transport.close()
        producer.transport.close()
