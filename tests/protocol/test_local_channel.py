"""Local channels between two processes of one executor: no credit, no exclusive buffers, and the
producer's segment held in its pool until the consumer recycled the buffer (Flink's LocalInputChannel,
with a connection as the path for the bytes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_helpers import write_buffer

from spark_credit_shuffle.buffers import CheckpointBarrier, DataType, KeepAlive, decode_event, encode_event
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import ProtocolError
from spark_credit_shuffle.protocol import (
    AddCredit,
    CloseRequest,
    CreditBasedPartitionRequestClientHandler,
    LocalInputChannel,
    NetworkBufferPool,
    PartitionRequest,
    PartitionRequestServerHandler,
    PipelinedResultPartition,
    ResultPartitionManager,
    SingleInputGate,
)
from spark_credit_shuffle.protocol.messages import RecycleBuffers
from spark_credit_shuffle.transport.in_memory import MemoryConnection


class TwoProcesses:
    """A producer partition in one process and a consumer gate in another, on one executor: the gate reads
    the partition through a local channel carried by an in-memory connection (through the wire codec)."""

    def __init__(self, config: NetworkConfig | None = None, *, subpartitions: int = 1) -> None:
        self.config = config or NetworkConfig()
        self.producer_network = NetworkBufferPool.from_config(self.config)
        self.consumer_network = NetworkBufferPool.from_config(self.config)  # the other process' accounting
        self.partition = PipelinedResultPartition.create(self.producer_network, subpartitions, self.config)
        manager = ResultPartitionManager()
        manager.register_partition(self.partition)
        self.client = CreditBasedPartitionRequestClientHandler()
        self.server = PartitionRequestServerHandler(manager)
        self.connection = MemoryConnection(self.client, self.server, encode=True)
        self.gate = SingleInputGate(self.consumer_network, 1, self.config, num_remote_channels=0)
        self.channel = self.gate.local_channel(0, self.client, receiver_id=7)
        self.sent: list = []
        self.received: list = []
        up, down = self.connection.upstream, self.connection.downstream
        up_deliver, down_deliver = up.deliver, down.deliver
        up.deliver = lambda m: (self.sent.append(m), up_deliver(m))  # type: ignore[method-assign]
        down.deliver = lambda m: (self.received.append(m), down_deliver(m))  # type: ignore[method-assign]
        self.gate.request_partitions()
        self.pump()

    def pump(self) -> None:
        self.connection.pump()

    def write(self, count: int, size: int = 1000) -> None:
        for i in range(count):
            write_buffer(self.partition, 0, bytes([i % 256]) * size)
        self.partition.flush_all()
        self.pump()

    def poll_all(self) -> list:
        out = []
        while (item := self.gate.poll_next()) is not None:
            out.append(item)
        return out

    @property
    def held_by_producer(self) -> int:
        return self.partition.buffer_pool.num_used


def test_a_local_channel_across_processes_takes_no_credit_and_no_consumer_buffers():
    ex = TwoProcesses()
    (request,) = [m for m in ex.sent if isinstance(m, PartitionRequest)]
    assert request.local and request.credit == 0
    assert isinstance(ex.channel, LocalInputChannel)
    # the consumer reserved no exclusive buffer, only the gate's one floating buffer
    assert ex.consumer_network.num_unpooled == 0
    assert ex.consumer_network.num_total_required_buffers == ex.gate.spec.floating_min == 1

    ex.write(3)
    items = ex.poll_all()
    assert [len(item.buffer.data) for item in items] == [1000, 1000, 1000]
    assert not any(isinstance(m, AddCredit) for m in ex.sent)  # no credit ever
    assert ex.gate.buffer_pool.num_used == 0  # no floating buffer taken either


def test_the_producer_holds_each_segment_until_the_consumer_recycles_it():
    ex = TwoProcesses()
    ex.write(3)
    items = ex.poll_all()
    assert ex.held_by_producer == 3  # the three sent buffers
    items[0].buffer.recycle()
    items[1].buffer.recycle()
    ex.pump()
    assert [m for m in ex.sent if isinstance(m, RecycleBuffers)] == [RecycleBuffers(7, 2)]  # one message
    assert ex.held_by_producer == 1
    items[2].buffer.recycle()
    ex.pump()
    assert ex.held_by_producer == 0


def test_a_consumer_that_does_not_recycle_backpressures_its_producer_through_the_producers_pool():
    config = NetworkConfig(max_buffers_per_channel=4)
    ex = TwoProcesses(config)
    ex.write(3)
    held = ex.poll_all()  # the consumer keeps them: nothing goes back
    assert ex.partition.is_available()
    ex.write(1)
    held += ex.poll_all()
    assert not ex.partition.is_available()  # four buffers held for the subpartition: back-pressured
    assert ex.gate.buffer_pool.num_used == 0 and ex.consumer_network.num_unpooled == 0
    held[0].buffer.recycle()
    ex.pump()
    assert ex.partition.is_available()  # one recycled buffer lets the producer go on


def test_cancelling_a_local_channel_returns_every_held_segment():
    ex = TwoProcesses(subpartitions=1)
    ex.write(5)
    items = ex.poll_all()
    assert len(items) == 5 and ex.held_by_producer == 5
    ex.gate.close()  # the consumer goes away without recycling
    ex.pump()
    assert isinstance(ex.sent[-1], CloseRequest)
    assert ex.held_by_producer == 0
    for item in items:  # recycling afterwards sends nothing and returns nothing twice
        item.buffer.recycle()
    ex.pump()
    assert not any(isinstance(m, RecycleBuffers) for m in ex.sent)
    assert ex.held_by_producer == 0


def test_the_end_of_partition_releases_the_channel_and_the_partition_is_consumed():
    ex = TwoProcesses()
    ex.write(2)
    ex.partition.finish()
    ex.pump()
    items = ex.poll_all()
    assert [item.buffer.is_buffer for item in items] == [True, True, False]
    for item in items:
        item.buffer.recycle()
    ex.pump()
    assert ex.gate.is_finished
    assert ex.partition.subpartitions[0].is_released
    assert ex.held_by_producer == 0


def test_recycling_more_than_is_held_or_on_a_credit_based_channel_is_a_protocol_error():
    ex = TwoProcesses()
    ex.write(1)
    with pytest.raises(ProtocolError, match="RecycleBuffers of 2 buffers, but 1 are held"):
        ex.server.receive_message(RecycleBuffers(7, 2))
    manager = ResultPartitionManager()
    network = NetworkBufferPool.from_config(NetworkConfig())
    manager.register_partition(PipelinedResultPartition.create(network, 1, NetworkConfig()))
    server = PartitionRequestServerHandler(manager)
    server.receive_message(PartitionRequest(3, 0, 2))  # a remote, credit-based channel
    with pytest.raises(ProtocolError, match="not a local channel"):
        server.receive_message(RecycleBuffers(3, 1))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=12))
def test_held_segments_are_exactly_the_sent_and_not_yet_recycled_buffers(steps):
    """Whatever the order of writes and recycles, the producer's pool holds one segment per data buffer
    sent and not yet recycled, and every buffer arrives."""
    ex = TwoProcesses(NetworkConfig(max_buffers_per_channel=1000))
    outstanding: list = []
    written = received = 0
    for write, recycle in steps:
        for _ in range(write):  # as a producer writes: a new buffer only while its pool is available
            if not ex.partition.is_available():
                break
            ex.write(1, size=100)
            written += 1
        got = ex.poll_all()
        received += len(got)
        outstanding += got
        for item in outstanding[:recycle]:
            item.buffer.recycle()
        outstanding = outstanding[recycle:]
        ex.pump()
        assert received == written
        assert ex.held_by_producer == len(outstanding)


UNALIGNED = NetworkConfig(unaligned_checkpoints=True).checkpoint_options


def test_an_unaligned_barrier_overtakes_what_the_consumer_received_and_has_not_consumed():
    # given three buffers that crossed the connection and wait, unread, in the consumer's queue
    ex = TwoProcesses()
    ex.write(3)
    # when the producer adds an unaligned barrier (its own queue is empty: everything was sent)
    ex.partition.add_event(0, encode_event(CheckpointBarrier(5, 0, UNALIGNED)))
    ex.pump()
    items = ex.poll_all()
    # then the consumer takes the barrier first, as on a remote channel: it overtook every buffer not yet
    # consumed, which keep their lower sequence numbers (the channel state of checkpoint 5)
    assert [item.buffer.data_type for item in items] == [DataType.PRIORITIZED_EVENT_BUFFER] + [DataType.DATA_BUFFER] * 3
    barrier_seq = items[0].sequence_number
    assert all(item.sequence_number < barrier_seq for item in items[1:])


def test_a_keep_alive_queues_behind_the_received_data_and_an_unaligned_barrier_moves_its_channel_ahead():
    # given a gate with two in-process local channels, each with a buffer queued, channel 0 first
    config = NetworkConfig()
    network = NetworkBufferPool.from_config(config)
    partitions = [PipelinedResultPartition.create(network, 1, config, partition_id=p) for p in range(2)]
    gate = SingleInputGate(network, 2, config, num_remote_channels=0)
    for p, partition in enumerate(partitions):
        gate.local_channel(p, partition)
    gate.request_partitions()
    for partition in partitions:
        write_buffer(partition, 0, b"x" * 100)
    # when channel 1's producer sends a keep-alive: the gate's order stays round robin
    partitions[1].add_event(0, encode_event(KeepAlive()))
    first = gate.poll_next()
    assert first is not None and first.channel_index == 0 and first.buffer.data_type is DataType.DATA_BUFFER
    # and when it sends an unaligned barrier, channel 1 goes first with it (ahead of its keep-alive too),
    # before channel 0's buffer
    write_buffer(partitions[0], 0, b"y" * 100)
    partitions[1].add_event(0, encode_event(CheckpointBarrier(1, 0, UNALIGNED)))
    for partition in partitions:
        partition.flush_all()
    taken = [
        (
            item.channel_index,
            decode_event(item.buffer.data_type, item.buffer.data)
            if item.buffer.data_type.is_event
            else len(item.buffer.data),
        )
        for item in iter(gate.poll_next, None)
    ]
    assert taken[0] == (1, CheckpointBarrier(1, 0, UNALIGNED))
    assert sorted(taken[1:], key=str) == sorted([(1, KeepAlive()), (0, 100), (1, 100)], key=str)


def test_a_finished_producer_still_puts_unaligned_barriers_ahead_of_what_its_consumer_has_not_read():
    # given a finished producer whose consumer has read nothing yet
    ex = TwoProcesses()
    write_buffer(ex.partition, 0, b"z" * 500)
    ex.partition.finish()
    # when a checkpoint's barrier comes after the end (a slow consumer still reads the finished producer)
    assert ex.partition.add_priority_event_after_finish(0, encode_event(CheckpointBarrier(2, 0, UNALIGNED)))
    ex.pump()
    items = ex.poll_all()
    # then the consumer takes it ahead of the data and the end of partition
    assert [item.buffer.data_type for item in items] == [
        DataType.PRIORITIZED_EVENT_BUFFER,
        DataType.DATA_BUFFER,
        DataType.END_OF_PARTITION,
    ]
    ex.pump()
    # and once the consumer read the end and released the channel, nothing more goes in
    assert not ex.partition.add_priority_event_after_finish(0, encode_event(CheckpointBarrier(3, 0, UNALIGNED)))
