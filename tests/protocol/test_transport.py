"""The in-memory transport, the model without credits, local channels, and the blocking replay through the
credit protocol."""

from __future__ import annotations

import random

import pytest
from protocol_helpers import write_buffer

from spark_credit_shuffle.buffers.buffer import Buffer, DataType
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import ProtocolError
from spark_credit_shuffle.protocol import (
    BlockingResultPartition,
    BufferResponse,
    CreditBasedPartitionRequestClientHandler,
    NetworkBufferPool,
    PartitionRequest,
    PartitionRequestServerHandler,
    PipelinedResultPartition,
    ResultPartitionManager,
    SingleInputGate,
)
from spark_credit_shuffle.protocol.codec import encoded_size
from spark_credit_shuffle.transport.in_memory import MemoryConnection, StoredBuffersExchange

CONFIG = NetworkConfig(segment_size=4096)


def _produce_blocking(network, num_producers, num_consumers, rng):
    written = {}
    partitions = []
    for p in range(num_producers):
        partition = BlockingResultPartition.create(network, num_consumers, CONFIG, partition_id=p)
        for c in range(num_consumers):
            for k in range(rng.randrange(0, 30)):
                payload = bytes([p, c, k % 256]) * rng.randrange(1, 1365)
                write_buffer(partition, c, payload)
                written.setdefault((p, c), []).append(payload)
        partition.finish()
        partitions.append(partition)
    return partitions, written


@pytest.mark.parametrize("encode", [False, True])
def test_blocking_partitions_replayed_through_the_credit_protocol(encode):
    rng = random.Random(7)
    network = NetworkBufferPool(400, CONFIG.segment_size)
    partitions, written = _produce_blocking(network, 3, 2, rng)
    for c in range(2):
        exchange = StoredBuffersExchange(CONFIG, 3, network_pool=network, encode=encode)
        for p in range(3):
            for data_type, payload in partitions[p].stored_buffers(c):
                exchange.add(p, data_type, payload)
        gate = exchange.gate
        received = {p: [] for p in range(3)}
        sequence = {p: -1 for p in range(3)}
        for item in exchange:
            assert item.sequence_number == sequence[item.channel_index] + 1  # in order, nothing skipped
            sequence[item.channel_index] = item.sequence_number
            if item.buffer.data_type is DataType.DATA_BUFFER:
                received[item.channel_index].append(bytes(item.buffer.data))
            assert gate.in_pool_usage <= 1.0  # never more buffers than the gate has
            item.buffer.recycle()
        for p in range(3):
            assert received[p] == written.get((p, c), [])
        exchange.close()
    for partition in partitions:
        partition.release()
    assert network.num_available == network.total
    assert network.num_total_required_buffers == 0


def test_a_consumer_holding_every_buffer_gets_an_error_not_a_hang():
    network = NetworkBufferPool(100, CONFIG.segment_size)
    stored = [(DataType.DATA_BUFFER, b"x" * 100)] * 50 + [(DataType.END_OF_PARTITION, b"")]
    exchange = StoredBuffersExchange(CONFIG, 1, network_pool=network)
    for data_type, payload in stored:
        exchange.add(0, data_type, payload)
    held = []
    with pytest.raises(ProtocolError, match="stalled"):
        for item in exchange:
            held.append(item.buffer)  # never recycled
    limit = exchange.gate.spec.maximum
    assert len(held) <= limit  # the credits bound what the consumer can hold
    for buffer in held:
        buffer.recycle()
    rest = sum(1 for item in exchange if item.buffer.recycle() is None)
    assert len(held) + rest == 51


def test_buffers_pushed_while_consuming_arrive_in_order_through_the_credits():
    network = NetworkBufferPool(100, CONFIG.segment_size)
    exchange = StoredBuffersExchange(CONFIG, 2, network_pool=network)
    received: dict[int, list[bytes]] = {0: [], 1: []}
    for k in range(40):  # the storage delivers producer 0's run, then producer 1's, a buffer at a time
        channel = 0 if k < 20 else 1
        exchange.add(channel, DataType.DATA_BUFFER, bytes([channel, k]))
        while (item := exchange.poll()) is not None:
            received[item.channel_index].append(bytes(item.buffer.data))
            assert exchange.gate.in_pool_usage <= 1.0
            item.buffer.recycle()
    exchange.add(0, DataType.END_OF_PARTITION, b"")
    exchange.add(1, DataType.END_OF_PARTITION, b"")
    rest = [item for item in exchange if item.buffer.recycle() is None]
    assert exchange.is_finished and all(item.buffer.data_type is DataType.END_OF_PARTITION for item in rest)
    assert received == {0: [bytes([0, k]) for k in range(20)], 1: [bytes([1, k]) for k in range(20, 40)]}
    exchange.close()
    assert network.num_available == network.total


def _old_model(pool_size: int):
    config = NetworkConfig(credit_based=False)
    network = NetworkBufferPool(100)
    client = CreditBasedPartitionRequestClientHandler(credit_based=False)
    gates = []
    for g in range(2):
        pool = network.create_buffer_pool(pool_size, pool_size)
        gate = SingleInputGate(network, 1, config, buffer_pool=pool)
        gate.remote_channel(0, g + 1, client)
        gate.setup()
        gates.append(gate)
    return client, gates


def _data(receiver_id: int, seq: int) -> BufferResponse:
    return BufferResponse(receiver_id, 0, seq, 0, DataType.DATA_BUFFER, False, b"d" * 10)


def test_without_credits_one_full_channel_stops_the_whole_connection():
    client, (slow, fast) = _old_model(pool_size=2)
    client.receive_message(_data(1, 0))
    client.receive_message(_data(1, 1))
    assert client.is_reading
    client.receive_message(_data(1, 2))  # no buffer left in the slow gate's pool
    assert not client.is_reading and client.num_staged == 1
    client.receive_message(_data(2, 0))  # behind it on the same connection: stuck, although its gate has room
    assert fast.poll_next() is None
    assert client.num_staged == 2
    held = slow.poll_next()
    held.buffer.recycle()  # the slow consumer frees one buffer: the connection moves on
    assert client.is_reading and client.num_staged == 0
    assert fast.poll_next().buffer.data == b"d" * 10
    assert [slow.poll_next().sequence_number for _ in range(2)] == [1, 2]


def test_without_credits_a_paused_connection_stops_its_sender_at_the_socket_buffer():
    config = NetworkConfig(credit_based=False, segment_size=4096)
    network = NetworkBufferPool(200, config.segment_size)
    partition = PipelinedResultPartition.create(network, 1, config)
    manager = ResultPartitionManager()
    manager.register_partition(partition)
    gate = SingleInputGate(network, 1, config)
    client = CreditBasedPartitionRequestClientHandler(credit_based=False)
    server = PartitionRequestServerHandler(manager, credit_based=False)
    gate.remote_channel(0, 1, client)
    connection = MemoryConnection(client, server, socket_buffer_bytes=3 * 4096)
    gate.request_partitions()
    connection.pump()
    for i in range(30):
        write_buffer(partition, 0, bytes([i]) * 4000)
    partition.flush_all()
    connection.pump()
    assert not client.is_reading
    # the link holds at most the socket buffer (one message may cross it), the rest stays at the sender
    assert connection.downstream.queued_bytes <= 3 * 4096 + 4100
    assert partition.subpartitions[0].queue_length() > 0
    received = 0
    while received < 30:
        item = gate.poll_next()
        assert item is not None
        received += 1
        item.buffer.recycle()
        connection.pump()
    assert client.is_reading


def test_latency_and_bandwidth_delay_delivery_on_virtual_time():
    network = NetworkBufferPool(100, CONFIG.segment_size)
    partition = PipelinedResultPartition.create(network, 1, CONFIG)
    manager = ResultPartitionManager()
    manager.register_partition(partition)
    gate = SingleInputGate(network, 1, CONFIG)
    client, server = CreditBasedPartitionRequestClientHandler(), PartitionRequestServerHandler(manager)
    gate.remote_channel(0, 1, client)
    connection = MemoryConnection(client, server, latency=0.01, bandwidth=1_000_000)
    gate.request_partitions()
    connection.pump(0.0)
    assert not server.queue.all_readers  # the request is still on its way
    request_arrival = connection.next_event_time(0.0)
    assert request_arrival == pytest.approx(0.01 + encoded_size(PartitionRequest(1, 0, 2)) / 1_000_000)
    connection.pump(request_arrival)
    write_buffer(partition, 0, b"z" * 4000)
    partition.flush_all()
    connection.pump(request_arrival)
    (in_flight,) = connection.downstream.in_flight()
    arrival = connection.next_event_time(request_arrival)
    assert arrival == pytest.approx(request_arrival + encoded_size(in_flight) / 1_000_000 + 0.01)
    connection.pump(arrival - 1e-6)
    assert gate.poll_next() is None
    connection.pump(arrival)
    assert gate.poll_next().buffer.data == b"z" * 4000


def test_secret_handshake_over_the_wire():
    manager = ResultPartitionManager()
    good = MemoryConnection(
        CreditBasedPartitionRequestClientHandler(secret=b"k" * 32),
        PartitionRequestServerHandler(manager, secret=b"k" * 32),
        encode=True,
    )
    good.pump()
    assert good.server.is_authenticated
    rogue = MemoryConnection(
        CreditBasedPartitionRequestClientHandler(secret=b"wrong"),
        PartitionRequestServerHandler(manager, secret=b"k" * 32),
        encode=True,
    )
    with pytest.raises(ProtocolError, match="wrong secret"):
        rogue.pump()
    garbage = PartitionRequestServerHandler(manager, secret=b"k" * 32)
    with pytest.raises(ProtocolError):
        garbage.receive_data(b"GET / HTTP/1.1\r\n\r\n")


def test_local_channel_bypasses_credits_and_skips_empty_buffers():
    config = NetworkConfig()
    network = NetworkBufferPool(100, config.segment_size)
    partition = PipelinedResultPartition.create(network, 1, config)
    gate = SingleInputGate(network, 1, config, num_remote_channels=0)
    gate.local_channel(0, partition)
    gate.request_partitions()
    assert network.num_unpooled == 0  # no exclusive buffers for local channels
    for i in range(12):
        write_buffer(partition, 0, bytes([i]) * 100)
    write_buffer(partition, 0, b"")  # an empty finished buffer
    partition.finish()
    held = []
    while (item := gate.poll_next()) is not None:
        held.append(item)
    data = [h for h in held if h.buffer.data_type is DataType.DATA_BUFFER]
    assert [bytes(h.buffer.data[:1]) for h in data] == [bytes([i]) for i in range(12)]
    assert held[-1].buffer.data_type is DataType.END_OF_PARTITION and gate.is_finished
    # the consumer holds the producer's segments: backpressure shows in the producer's pool
    assert partition.out_pool_usage > 0.5
    # 12 data buffers and END_OF_PARTITION; the empty buffer was already skipped by the subpartition
    assert gate.num_buffers_in_local == 13 and gate.num_buffers_in_remote == 0
    for h in held:
        h.buffer.recycle()
    partition.close()
    gate.close()
    assert network.num_available == network.total


class Listener:
    def __init__(self) -> None:
        self.got = 0

    def notify_buffer_available(self) -> bool:
        self.got += 1
        return True


def test_floating_listener_is_served_on_recycle():
    network = NetworkBufferPool(4, 128)
    floating = network.create_buffer_pool(1, 1)
    assert floating.request_buffer()
    listener = Listener()
    assert floating.add_buffer_listener(listener)
    floating.recycle()
    assert listener.got == 1 and floating.num_available_segments == 0


def test_floating_listener_is_served_when_the_pool_grows_into_a_freed_segment():
    network = NetworkBufferPool(3, 128)
    floating = network.create_buffer_pool(1, 2)
    other = network.create_buffer_pool(1, 1)
    third = network.create_buffer_pool(1, 1)
    assert floating.num_buffers == 1  # no excess left: every pool at its minimum
    assert floating.request_buffer()
    listener = Listener()
    assert floating.add_buffer_listener(listener)
    third.lazy_destroy()  # frees a segment and lets the floating pool grow to 2
    assert floating.num_buffers == 2
    assert listener.got == 1  # the new segment went to the waiting listener, not to the free list
    assert floating.num_available_segments == 0
    other.lazy_destroy()


def test_buffer_recycled_after_release_goes_back_to_the_global_pool():
    network = NetworkBufferPool(50, 128)
    gate = SingleInputGate(network, 1, NetworkConfig())
    client = CreditBasedPartitionRequestClientHandler()
    gate.remote_channel(0, 1, client)
    gate.request_partitions()
    client.receive_message(BufferResponse(1, 0, 0, 0, DataType.DATA_BUFFER, False, b"abc"))
    item = gate.poll_next()
    gate.close()  # the consumer still holds a buffer of a released channel
    assert network.num_available == 49
    item.buffer.recycle()
    assert network.num_available == 50 and network.num_total_required_buffers == 0
    assert isinstance(item.buffer, Buffer)
