"""CreditBasedPartitionRequestClientHandlerTest and RemoteInputChannelTest (docs/flink.md, "Behaviours from
Flink's test suite"), plus the worked trace (docs/flink.md, "A worked trace")."""

from __future__ import annotations

import pytest
from protocol_helpers import Exchange, write_buffer

from spark_credit_shuffle.buffers.buffer import Buffer, DataType
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import BufferReorderingError, ProtocolError
from spark_credit_shuffle.protocol import (
    AddCredit,
    BacklogAnnouncement,
    BufferResponse,
    CancelPartitionRequest,
    CloseRequest,
    CreditBasedPartitionRequestClientHandler,
    ErrorResponse,
    NetworkBufferPool,
    PartitionRequest,
    SingleInputGate,
)

CONFIG = NetworkConfig()


def data(receiver_id: int, seq: int, backlog: int, size: int = 32) -> BufferResponse:
    return BufferResponse(receiver_id, 0, seq, backlog, DataType.DATA_BUFFER, False, bytes(size))


def gate_with_pool(network: NetworkBufferPool, channels: int, floating: int):
    pool = network.create_buffer_pool(floating, floating)
    gate = SingleInputGate(network, channels, CONFIG, buffer_pool=pool)
    client = CreditBasedPartitionRequestClientHandler()
    for i in range(channels):
        gate.remote_channel(i, 100 + i, client)
    return gate, client, pool


def outbound(client) -> list:
    out = []
    while (message := client.next_message()) is not None:
        out.append(message)
    return out


def test_notify_credit_available():
    network = NetworkBufferPool(10, 32)
    gate, client, _ = gate_with_pool(network, 2, 6)
    gate.request_partitions()
    requests = outbound(client)
    assert [(type(m), m.receiver_id, m.credit) for m in requests] == [
        (PartitionRequest, 100, 2),
        (PartitionRequest, 101, 2),
    ]
    # each response takes a channel buffer and announces backlog 1: required 1 + 2, available 1 -> 2 floating
    client.receive_message(data(100, 0, 1))
    client.receive_message(data(101, 0, 1))
    ch0, ch1 = gate.channels
    assert (ch0.unannounced_credit, ch1.unannounced_credit) == (2, 2)
    assert [(type(m), m.receiver_id, m.credit) for m in outbound(client)] == [(AddCredit, 100, 2), (AddCredit, 101, 2)]
    assert client.next_message() is None
    # the link is not writable (nothing is pulled) while another response arrives
    client.receive_message(data(100, 1, 1))
    assert (ch0.unannounced_credit, ch1.unannounced_credit) == (1, 0)
    # writable again: the credit goes out, built at send time
    (message,) = outbound(client)
    assert (type(message), message.receiver_id, message.credit) == (AddCredit, 100, 1)
    assert (ch0.unannounced_credit, ch1.unannounced_credit) == (0, 0)


def test_credit_gathered_while_not_writable_goes_out_as_one_add_credit():
    network = NetworkBufferPool(20, 32)
    gate, client, _ = gate_with_pool(network, 1, 8)
    gate.request_partitions()
    outbound(client)
    client.receive_message(data(100, 0, 2))  # required 4, available 1: takes 3
    client.receive_message(data(100, 1, 5))  # required 7, available 3: takes 4 more
    (message,) = outbound(client)
    assert message == AddCredit(100, 7)


def test_receive_backlog_announcement():
    network = NetworkBufferPool(10, 1024)
    gate, client, _ = gate_with_pool(network, 1, 8)
    gate.setup()
    channel = gate.channels[0]
    assert channel.num_available_buffers == 2
    assert channel.num_floating_buffers_available == 0
    client.receive_message(BacklogAnnouncement(100, 5))
    assert channel.num_available_buffers == 7
    assert channel.num_required_buffers == 7
    assert channel.sender_backlog == 5
    assert channel.num_floating_buffers_available == 5
    client.receive_message(BacklogAnnouncement(100, 12))
    assert channel.num_available_buffers == 10
    assert channel.num_required_buffers == 14
    assert channel.sender_backlog == 12
    assert channel.num_floating_buffers_available == 8


def test_throw_exception_for_no_available_buffer():
    network = NetworkBufferPool(10, 32)
    gate, client, pool = gate_with_pool(network, 1, 1)
    gate.request_partitions()
    outbound(client)
    assert pool.request_buffer()  # the floating pool is exhausted
    client.receive_message(data(100, 0, 0))
    client.receive_message(data(100, 1, 0))  # both exclusive buffers now hold data
    client.receive_message(data(100, 2, 0))  # a third with no credit behind it
    with pytest.raises(ProtocolError, match="read buffer is null"):
        gate.poll_next()


def test_notify_credit_available_after_released():
    network = NetworkBufferPool(10, 32)
    gate, client, _ = gate_with_pool(network, 1, 6)
    gate.request_partitions()
    (request,) = outbound(client)
    assert request.credit == 2
    client.receive_message(data(100, 0, 1))
    assert gate.channels[0].unannounced_credit == 2
    gate.close()
    # a close request goes out after the last channel is released; its credit never does
    assert outbound(client) == [CloseRequest()]


def test_cancel_request_for_unknown_or_other_released_channel():
    network = NetworkBufferPool(20, 32)
    gate, client, _ = gate_with_pool(network, 2, 6)
    gate.request_partitions()
    outbound(client)
    gate.channels[0].release_all_resources()
    assert outbound(client) == [CancelPartitionRequest(100)]  # not the last channel of the connection
    client.receive_message(data(999, 0, 0))  # a channel this connection does not know
    assert outbound(client) == [CancelPartitionRequest(999)]


def _single_channel(total: int, floating: int):
    network = NetworkBufferPool(total, 32)
    gate, client, pool = gate_with_pool(network, 1, floating)
    gate.request_partitions()
    outbound(client)
    return gate.channels[0], pool, client


def test_available_buffers_less_than_required_buffers():
    channel, pool, _ = _single_channel(16, 14)
    exclusive = channel.request_buffer()
    assert exclusive is not None
    assert pool.request_buffer() and pool.request_buffer()  # two floating buffers taken by the test
    channel.on_sender_backlog(14)
    assert channel.num_available_buffers == 13
    assert channel.num_required_buffers == 16
    assert pool.num_available_segments == 0
    assert channel.is_waiting_for_floating_buffers
    channel.on_sender_backlog(16)  # already waiting: only the requirement changes
    assert (channel.num_available_buffers, channel.num_required_buffers) == (13, 18)
    assert pool.num_listeners == 1
    exclusive()  # recycle the exclusive buffer: back to the channel, one more credit
    assert (channel.num_available_buffers, channel.num_required_buffers) == (14, 18)
    assert channel.is_waiting_for_floating_buffers
    pool.recycle()  # a floating buffer goes to the waiting channel, which waits again
    assert (channel.num_available_buffers, channel.num_required_buffers) == (15, 18)
    assert pool.num_available_segments == 0
    assert channel.is_waiting_for_floating_buffers and pool.num_listeners == 1
    channel.on_sender_backlog(13)
    assert (channel.num_available_buffers, channel.num_required_buffers) == (15, 15)
    assert channel.is_waiting_for_floating_buffers
    pool.recycle()  # not needed any more (15 >= 15): back to the pool, and the channel stops waiting
    assert (channel.num_available_buffers, channel.num_required_buffers) == (15, 15)
    assert pool.num_available_segments == 1
    assert not channel.is_waiting_for_floating_buffers
    channel.on_sender_backlog(15)  # takes it back and waits again
    assert (channel.num_available_buffers, channel.num_required_buffers) == (16, 17)
    assert pool.num_available_segments == 0
    assert channel.is_waiting_for_floating_buffers


def test_available_buffers_more_than_required_buffers():
    channel, pool, _ = _single_channel(16, 14)
    exclusive = channel.request_buffer()
    assert pool.request_buffer()
    channel.on_sender_backlog(12)
    assert (channel.num_available_buffers, channel.num_required_buffers) == (14, 14)
    assert pool.num_available_segments == 0
    assert pool.num_listeners == 0
    channel.on_sender_backlog(10)
    assert (channel.num_available_buffers, channel.num_required_buffers) == (14, 12)
    assert pool.num_available_segments == 0
    credit_before = channel.unannounced_credit
    exclusive()  # an exclusive buffer comes back: a floating one returns to the pool instead, no credit
    assert (channel.num_available_buffers, channel.num_required_buffers) == (14, 12)
    assert pool.num_available_segments == 1
    assert channel.unannounced_credit == credit_before
    pool.recycle()  # the test's floating buffer goes straight to the pool
    assert (channel.num_available_buffers, channel.num_required_buffers) == (14, 12)
    assert pool.num_available_segments == 2


def test_fair_distribution_floating_buffers():
    network = NetworkBufferPool(12, 32)
    gate, client, pool = gate_with_pool(network, 3, 3)
    gate.request_partitions()
    outbound(client)
    for _ in range(3):
        assert pool.request_buffer()
    for channel in gate.channels:
        channel.on_sender_backlog(8)
        assert channel.num_available_buffers == 2
    assert pool.num_listeners == 3
    for _ in range(3):
        pool.recycle()
    for channel in gate.channels:
        assert channel.num_available_buffers == 3
        assert channel.unannounced_credit == 1


def test_exception_on_reordering():
    network = NetworkBufferPool(10, 32)
    gate, _, _ = gate_with_pool(network, 1, 2)
    gate.setup()
    channel = gate.channels[0]
    channel.on_buffer(Buffer(DataType.DATA_BUFFER, b"x"), 0, -1)
    channel.on_buffer(Buffer(DataType.DATA_BUFFER, b"y"), 29, -1)  # sets the error, raises nothing yet
    with pytest.raises(BufferReorderingError, match="expected buffer with sequence number 1, but received 29"):
        channel.get_next_buffer()


def test_request_buffer():
    channel, pool, _ = _single_channel(10, 8)
    channel.on_sender_backlog(2)
    assert (channel.num_available_buffers, channel.num_required_buffers) == (4, 4)
    kinds = []
    for expected_required in (3, 2, 1, 0):
        recycler = channel.request_buffer()
        kinds.append("floating" if recycler == pool.recycle else "exclusive")
        assert channel.num_required_buffers == expected_required
    assert kinds == ["floating", "floating", "exclusive", "exclusive"]  # floating first
    assert channel.request_buffer() is None


def test_buffers_in_use_count():
    network = NetworkBufferPool(20, 32)
    gate, _, _ = gate_with_pool(network, 1, 8)
    gate.setup()
    channel = gate.channels[0]
    assert channel.buffers_in_use_count() == 0
    channel.on_buffer(Buffer(DataType.DATA_BUFFER, b"x"), 0, 1)
    assert channel.buffers_in_use_count() == 2
    channel.on_buffer(Buffer(DataType.DATA_BUFFER, b"x"), 1, 3)
    assert channel.buffers_in_use_count() == 5
    channel.get_next_buffer()
    assert channel.buffers_in_use_count() == 4
    channel.get_next_buffer()
    assert channel.buffers_in_use_count() == 3
    channel.get_next_buffer()
    assert channel.buffers_in_use_count() == 3


def test_error_response_fails_one_channel_or_all():
    network = NetworkBufferPool(20, 32)
    gate, client, _ = gate_with_pool(network, 2, 4)
    gate.request_partitions()
    client.receive_message(ErrorResponse("boom", 101))
    assert gate.channels[0].error is None and gate.channels[1].error is not None
    client.receive_message(ErrorResponse("fatal"))
    assert gate.channels[0].error is not None
    with pytest.raises(Exception, match="remote error"):
        gate.poll_next()


def test_worked_trace():
    """docs/flink.md, "A worked trace": exclusive 2, floating pool max 8, sender with 5 finished buffers and 1
    open one (backlog 5)."""
    exchange = Exchange(1)
    partition = exchange.partition
    for i in range(5):
        write_buffer(partition, 0, bytes([i]) * 100)
    open_builder = write_buffer(partition, 0, b"open", finish=False)
    subpartition = partition.subpartitions[0]
    assert subpartition.get_buffers_in_backlog() == 5
    channel, pool = exchange.channel(), exchange.gates[0].buffer_pool
    assert pool.max_buffers == 8
    exchange.gates[0].request_partitions()

    # 1. PartitionRequest(credit=2)
    (request,) = exchange.client_to_server()
    assert request.credit == 2
    reader = exchange.reader()
    assert channel.num_available_buffers == 2 and reader.num_credits_available == 2

    # 2. b0 with backlog 4: takes an exclusive buffer, required 6, takes 5 floating, unannounced 5
    (b0,) = exchange.server_to_client(limit=1)
    assert (b0.sequence_number, b0.backlog) == (0, 4)
    assert channel.num_available_buffers == 6 and channel.num_required_buffers == 6
    assert channel.num_floating_buffers_available == 5 and channel.unannounced_credit == 5
    assert reader.num_credits_available == 1 and reader.is_registered_as_available

    # 3. b1 with backlog 3: takes a floating buffer, required 5, no request; sender out of credit
    (b1,) = exchange.server_to_client(limit=1)
    assert b1.backlog == 3
    assert channel.num_available_buffers == 5 and channel.num_required_buffers == 5
    assert reader.num_credits_available == 0 and not reader.is_registered_as_available
    assert exchange.servers[0].next_message() is None

    # 4. AddCredit(5)
    assert exchange.client_to_server() == [AddCredit(1000, 5)]
    assert reader.num_credits_available == 5

    # 5. b2, b3, b4 with backlogs 2, 1, 0
    sent = exchange.server_to_client()
    assert [m.backlog for m in sent] == [2, 1, 0]
    assert channel.num_available_buffers == 2 and channel.num_required_buffers == 2
    assert channel.buffer_manager.num_exclusive == 1 and channel.buffer_manager.num_floating == 1
    assert reader.num_credits_available == 2 == channel.num_available_buffers  # the invariant

    # 6. the open buffer stays unsent until a flush
    assert exchange.servers[0].next_message() is None
    assert len(sent) == 3

    # the consumer recycles b0 (exclusive): a floating buffer goes back to the pool instead of a credit
    received = [exchange.gates[0].poll_next() for _ in range(5)]
    assert [bytes(r.buffer.data[:1]) for r in received] == [bytes([i]) for i in range(5)]
    free_before = pool.num_available_segments
    received[0].buffer.recycle()
    assert channel.num_available_buffers == 2
    assert pool.num_available_segments == free_before + 1
    assert exchange.client_to_server() == []
    for r in received[1:]:
        r.buffer.recycle()  # floating: back to the gate's pool
    assert pool.num_available_segments == free_before + 5
    open_builder.finish()
