"""Builders for the protocol tests, after the helpers of Flink's own tests (``BufferBuilderTestUtils``)."""

from __future__ import annotations

from spark_credit_shuffle.buffers.buffer import (
    Buffer,
    BufferConsumer,
    ByteBufferBuilder,
    DataType,
)
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.protocol import (
    CreditBasedPartitionRequestClientHandler,
    NetworkBufferPool,
    PartitionRequestServerHandler,
    PipelinedResultPartition,
    ResultPartitionManager,
    SingleInputGate,
)

SEGMENT = 32 * 1024


class Segments:
    """Counts segments handed to builders and their return (a stand-in pool for subpartition tests)."""

    def __init__(self) -> None:
        self.out = 0
        self.returned = 0

    def recycler(self):
        self.out += 1

        def back() -> None:
            self.returned += 1

        return back

    @property
    def in_use(self) -> int:
        return self.out - self.returned


def filled_finished_consumer(size: int, segments: Segments | None = None) -> BufferConsumer:
    """A consumer created before its builder was filled with ``size`` bytes and finished (Flink's
    ``createFilledFinishedBufferConsumer``): the subpartition learns it is finished only when it reads it."""
    builder = ByteBufferBuilder(max(size, 1) if size else SEGMENT, segments.recycler() if segments else None)
    consumer = builder.create_buffer_consumer()
    builder.append(bytes(size))
    builder.finish()
    return consumer


def filled_unfinished_consumer(size: int, segments: Segments | None = None) -> tuple[BufferConsumer, ByteBufferBuilder]:
    """A consumer of a builder holding ``size`` bytes that is still being written."""
    builder = ByteBufferBuilder(SEGMENT, segments.recycler() if segments else None)
    consumer = builder.create_buffer_consumer()
    builder.append(bytes(size))
    return consumer, builder


def event_consumer(data_type: DataType = DataType.EVENT_BUFFER, payload: bytes = b"event") -> BufferConsumer:
    """A finished event (or any complete buffer) as the partition wraps ``add_event`` buffers."""
    return Buffer(data_type, payload)


def data_buffer_consumer(size: int) -> BufferConsumer:
    """A complete data buffer known to be finished (Flink's ``createEventBufferConsumer(size, DATA_BUFFER)``)."""
    return Buffer(DataType.DATA_BUFFER, bytes(size))


class CountingListener:
    """A BufferAvailabilityListener that counts what it is told."""

    def __init__(self) -> None:
        self.num_notifications = 0
        self.num_priority_events = 0

    def notify_data_available(self) -> None:
        self.num_notifications += 1

    def notify_priority_event(self, sequence_number: int) -> None:
        self.num_priority_events += 1


def write_buffer(partition, subpartition: int, payload: bytes, *, finish: bool = True) -> ByteBufferBuilder:
    """Write ``payload`` as one buffer of ``subpartition`` the way the RecordWriter does."""
    builder = ByteBufferBuilder(SEGMENT, partition.request_segment(subpartition))
    partition.add_consumer(subpartition, builder.create_buffer_consumer())
    builder.append(payload)
    if finish:
        builder.finish()
    return builder


class Exchange:
    """One producer partition, one consumer gate per subpartition, one connection per gate, all wired by hand:
    messages are moved explicitly so the tests can look at every step."""

    def __init__(self, num_subpartitions: int = 1, config: NetworkConfig | None = None, total: int | None = None):
        self.config = config or NetworkConfig()
        self.network = NetworkBufferPool(total or self.config.total_network_buffers, self.config.segment_size)
        self.partition = PipelinedResultPartition.create(self.network, num_subpartitions, self.config)
        self.manager = ResultPartitionManager()
        self.manager.register_partition(self.partition)
        self.gates: list[SingleInputGate] = []
        self.clients: list[CreditBasedPartitionRequestClientHandler] = []
        self.servers: list[PartitionRequestServerHandler] = []
        for sp in range(num_subpartitions):
            gate = SingleInputGate(self.network, 1, self.config)
            client = CreditBasedPartitionRequestClientHandler(credit_based=self.config.credit_based)
            server = PartitionRequestServerHandler(self.manager, credit_based=self.config.credit_based)
            gate.remote_channel(0, 1000 + sp, client, subpartition=sp)
            self.gates.append(gate)
            self.clients.append(client)
            self.servers.append(server)

    def client_to_server(self, index: int = 0) -> list:
        sent = []
        while (message := self.clients[index].next_message()) is not None:
            sent.append(message)
            self.servers[index].receive_message(message)
        return sent

    def server_to_client(self, index: int = 0, limit: int | None = None) -> list:
        sent = []
        while limit is None or len(sent) < limit:
            message = self.servers[index].next_message()
            if message is None:
                break
            sent.append(message)
            self.clients[index].receive_message(message)
        return sent

    def channel(self, index: int = 0):
        return self.gates[index].channels[0]

    def reader(self, index: int = 0):
        (reader,) = self.servers[index].queue.all_readers.values()
        return reader
