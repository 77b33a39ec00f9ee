"""PartitionRequestQueueTest and CreditBasedSequenceNumberingViewReaderTest (docs/flink.md, "Behaviours from
Flink's test suite")."""

from __future__ import annotations

import pytest
from protocol_helpers import CountingListener, data_buffer_consumer, event_consumer, filled_finished_consumer

from spark_credit_shuffle.buffers.buffer import DataType
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import ProtocolError
from spark_credit_shuffle.protocol import (
    AckAllUserRecordsProcessed,
    AcknowledgeCheckpoint,
    AddCredit,
    AuthChallenge,
    BacklogAnnouncement,
    BlockingResultPartition,
    BoundedBlockingSubpartitionReader,
    BufferResponse,
    CancelPartitionRequest,
    CreditBasedSequenceNumberingViewReader,
    ErrorResponse,
    Hello,
    NetworkBufferPool,
    NewBufferSize,
    PartitionRequest,
    PartitionRequestQueue,
    PartitionRequestServerHandler,
    PipelinedResultPartition,
    PipelinedSubpartition,
    ResultPartitionManager,
    ResumeConsumption,
    StoredBuffer,
)
from spark_credit_shuffle.protocol.subpartition import DEFAULT_BUFFER_SIZE


class SingleView:
    """A partition provider that serves one given view, as Flink's tests do with a lambda."""

    def __init__(self, subpartition: PipelinedSubpartition | None = None, view=None) -> None:
        self.subpartition = subpartition
        self.view = view

    def create_subpartition_view(self, partition_id, subpartition, listener):
        if self.view is not None:
            if hasattr(self.view, "set_listener"):
                self.view.set_listener(listener)
            return self.view
        return self.subpartition.create_read_view(listener)


def serving_receiver_7() -> tuple[PipelinedSubpartition, PartitionRequestServerHandler]:
    """A server connection on which receiver 7 requested subpartition 0 of a registered partition."""
    subpartition = PipelinedSubpartition(0)
    manager = ResultPartitionManager()
    manager.register_partition(SinglePartition(subpartition))
    handler = PartitionRequestServerHandler(manager)
    handler.receive_message(PartitionRequest(7, 0, 2))
    return subpartition, handler


def drain(queue: PartitionRequestQueue) -> list:
    out = []
    while (message := queue.next_message()) is not None:
        out.append(message)
    return out


def test_enqueue_reader_by_notifying_event_buffer():
    subpartition = PipelinedSubpartition(0)
    queue = PartitionRequestQueue()
    reader = CreditBasedSequenceNumberingViewReader(7, 0, queue)
    reader.request_subpartition_view(SingleView(subpartition), 0, 0)
    queue.notify_reader_created(reader)
    assert not queue.available_readers
    subpartition.add(event_consumer())  # notifies the reader
    assert list(queue.available_readers) == [reader]  # enqueued although it has no credit
    assert reader.num_credits_available == 0
    (message,) = drain(queue)
    assert isinstance(message, BufferResponse) and message.data_type is DataType.EVENT_BUFFER
    assert not queue.available_readers
    assert reader.num_credits_available == 0


def test_enqueue_reader_by_notifying_buffer_and_credit():
    subpartition = PipelinedSubpartition(0)
    for _ in range(10):
        subpartition.add(data_buffer_consumer(64))
    queue = PartitionRequestQueue()
    reader = CreditBasedSequenceNumberingViewReader(7, 2, queue)
    queue.notify_reader_created(reader)
    reader.request_subpartition_view(SingleView(subpartition), 0, 0)
    assert len(drain(queue)) == 2  # the initial credit
    assert reader.num_credits_available == 0
    for _ in range(5):
        reader.notify_data_available()
    assert not queue.available_readers  # no credit, data next: not enqueued
    for credit in (1, 2, 3):
        queue.add_credit_or_resume_consumption(7, lambda r: r.add_credit(1))
        assert list(queue.available_readers) == [reader]  # once only
        assert reader.num_credits_available == credit
    sent = drain(queue)  # the link becomes writable
    assert len(sent) == 3
    assert all(isinstance(m, BufferResponse) and m.is_buffer for m in sent)
    assert reader.num_credits_available == 0


def test_enqueue_reader_by_resuming_consumption():
    subpartition = PipelinedSubpartition(0)
    subpartition.add(event_consumer(DataType.ALIGNED_CHECKPOINT_BARRIER, bytes(4096)))
    subpartition.add(data_buffer_consumer(4096))
    queue = PartitionRequestQueue()
    reader = CreditBasedSequenceNumberingViewReader(7, 2, queue)
    queue.notify_reader_created(reader)
    reader.request_subpartition_view(SingleView(subpartition), 0, 0)
    assert reader.get_availability_and_backlog().is_available
    first = queue.next_message()
    assert first.data_type is DataType.ALIGNED_CHECKPOINT_BARRIER
    assert queue.next_message() is None
    assert not reader.get_availability_and_backlog().is_available
    assert subpartition.queue_length() == 1
    queue.add_credit_or_resume_consumption(7, lambda r: r.resume_consumption())
    second = queue.next_message()
    assert second.data_type is DataType.DATA_BUFFER
    assert subpartition.queue_length() == 0
    assert not reader.get_availability_and_backlog().is_available


def test_announce_backlog():
    subpartition = PipelinedSubpartition(0, receiver_exclusive_buffers=0)
    subpartition.add(data_buffer_consumer(4096))
    subpartition.add(data_buffer_consumer(4096))
    queue = PartitionRequestQueue()
    reader = CreditBasedSequenceNumberingViewReader(7, 0, queue)
    queue.notify_reader_created(reader)
    reader.request_subpartition_view(SingleView(subpartition), 0, 0)
    message = queue.next_message()
    assert isinstance(message, BacklogAnnouncement)  # not data: the channel has no credit
    assert message.receiver_id == 7
    assert message.backlog == subpartition.get_buffers_in_backlog() > 0
    assert queue.next_message() is None


def test_notify_new_buffer_size():
    """NewBufferSize reaches the subpartition, whose ``add`` then returns the size the writer trims to."""
    subpartition, handler = serving_receiver_7()
    assert subpartition.add(filled_finished_consumer(128)) == DEFAULT_BUFFER_SIZE
    handler.receive_message(NewBufferSize(7, 65))
    assert subpartition.add(filled_finished_consumer(10)) == 65


def test_notify_new_buffer_size_cuts_the_next_buffers():
    """Flink's testNotifyNewBufferSize: after NewBufferSize(65), records of 128, 10 and 60 bytes go out as a
    buffer of 128 (never smaller than its first record) and one of 65 (the rest spans into the next)."""
    config = NetworkConfig(segment_size=4096)
    network = NetworkBufferPool(100, config.segment_size)
    partition = PipelinedResultPartition.create(network, 1, config, partition_id=0)
    manager = ResultPartitionManager()
    manager.register_partition(partition)
    handler = PartitionRequestServerHandler(manager)
    handler.receive_message(PartitionRequest(7, 0, 10))
    handler.receive_message(NewBufferSize(7, 65))
    for size in (128, 10, 60):
        partition.emit_record(bytes(size), 0)
    partition.flush_all()
    sizes = []
    while (message := handler.next_message()) is not None:
        if isinstance(message, BufferResponse):
            sizes.append(message.size)
    assert sizes[:2] == [128, 65]
    assert sum(sizes) == 128 + 10 + 60


def test_a_checkpoint_is_acknowledged_once_every_consumer_ended_it():
    """AcknowledgeCheckpoint reaches the partition: a checkpoint counts as ended there once every subpartition's
    consumer acknowledged or declined it (or a later one), or went away; the producer's trigger waits for that."""
    config = NetworkConfig(segment_size=4096)
    partition = PipelinedResultPartition.create(NetworkBufferPool(100, 4096), 3, config, partition_id=0)
    manager = ResultPartitionManager()
    manager.register_partition(partition)
    handler = PartitionRequestServerHandler(manager)
    for receiver, subpartition in ((7, 0), (8, 1), (9, 2)):
        handler.receive_message(PartitionRequest(receiver, subpartition, 2))
    handler.receive_message(AcknowledgeCheckpoint(7, 1))
    handler.receive_message(AcknowledgeCheckpoint(8, 2, declined=True))  # a later one ends the earlier too
    handler.receive_message(AcknowledgeCheckpoint(99, 5))  # an unknown receiver: ignored
    assert not partition.checkpoint_acknowledged(1)  # consumer 2 still aligns it
    handler.receive_message(CancelPartitionRequest(9))  # consumer 2 goes away: it no longer holds any back
    assert partition.checkpoint_acknowledged(1) and not partition.checkpoint_acknowledged(2)
    handler.receive_message(AcknowledgeCheckpoint(7, 2))
    assert partition.checkpoint_acknowledged(2) and not partition.checkpoint_acknowledged(3)


def test_emit_record_spans_segments_and_keeps_bytes_in_order():
    config = NetworkConfig(segment_size=4096)
    network = NetworkBufferPool(100, config.segment_size)
    partition = PipelinedResultPartition.create(network, 2, config, partition_id=0)
    view = partition.create_subpartition_view(1, CountingListener())
    records = [bytes([i]) * n for i, n in enumerate((10, 5000, 4086, 1, 9000))]
    for record in records:
        partition.emit_record(record, 1)
    partition.finish()
    received = bytearray()
    sizes = []
    while (nxt := view.get_next_buffer()) is not None:
        if nxt.buffer.data_type is DataType.DATA_BUFFER:
            received += bytes(nxt.buffer.data)
            sizes.append(len(nxt.buffer.data))
        nxt.buffer.recycle()
    assert bytes(received) == b"".join(records)
    assert max(sizes) <= 4096
    assert partition.buffer_pool.num_used == 0  # every segment back


class SinglePartition:
    partition_id = 0

    def __init__(self, subpartition):
        self.subpartition = subpartition

    def create_subpartition_view(self, index, listener):
        return self.subpartition.create_read_view(listener)


def test_cancel_partition_request():
    config = NetworkConfig()
    network = NetworkBufferPool(100)
    blocking = BlockingResultPartition.create(network, 1, config)
    blocking.add_event(0, event_consumer().build())
    blocking.finish()
    queue = PartitionRequestQueue()
    reader = CreditBasedSequenceNumberingViewReader(7, 2, queue)
    queue.notify_reader_created(reader)
    reader.request_subpartition_view(SingleView(view=blocking.create_subpartition_view(0, None)), 0, 0)
    assert list(queue.available_readers) == [reader]
    queue.cancel(7)
    assert not queue.available_readers
    assert 7 not in queue.all_readers
    assert reader.view.is_released
    assert not blocking.is_released  # a blocking partition outlives its readers

    subpartition = PipelinedSubpartition(0)
    subpartition.add(data_buffer_consumer(10))
    subpartition.add(data_buffer_consumer(10))
    reader = CreditBasedSequenceNumberingViewReader(8, 2, queue)
    queue.notify_reader_created(reader)
    reader.request_subpartition_view(SingleView(subpartition), 0, 0)
    queue.cancel(8)
    assert not queue.available_readers and subpartition.is_released


def test_resume_consumption_credit():
    reader = CreditBasedSequenceNumberingViewReader(1, 2, PartitionRequestQueue())
    reader.view = BoundedBlockingSubpartitionReader([])
    reader.resume_consumption()
    assert reader.num_credits_available == 2
    reader.add_credit(2)
    reader.resume_consumption()
    assert reader.num_credits_available == 4

    reader = CreditBasedSequenceNumberingViewReader(2, 0, PartitionRequestQueue())
    reader.view = BoundedBlockingSubpartitionReader([])
    reader.add_credit(2)
    assert reader.num_credits_available == 2
    reader.resume_consumption()
    assert reader.num_credits_available == 0


def test_need_announce_backlog():
    reader = CreditBasedSequenceNumberingViewReader(1, 2, PartitionRequestQueue())
    assert not reader.need_announce_backlog()
    reader.num_credits_available = 0
    assert not reader.need_announce_backlog()  # it has exclusive buffers: backlog rides on data
    reader = CreditBasedSequenceNumberingViewReader(2, 0, PartitionRequestQueue())
    assert reader.need_announce_backlog()
    reader.add_credit(1)
    assert not reader.need_announce_backlog()


def test_data_without_credit_is_a_protocol_violation():
    subpartition = PipelinedSubpartition(0)
    subpartition.add(data_buffer_consumer(10))
    subpartition.add(data_buffer_consumer(10))
    reader = CreditBasedSequenceNumberingViewReader(1, 0, PartitionRequestQueue())
    reader.view = subpartition.create_read_view(reader)
    with pytest.raises(ProtocolError, match="no credit"):
        reader.get_next_buffer()


def test_round_robin_between_readers():
    """A reader that can send more is re-queued at the tail: channels take turns on a connection."""
    queue = PartitionRequestQueue()
    subpartitions = [PipelinedSubpartition(i) for i in range(2)]
    for index, subpartition in enumerate(subpartitions):
        for _ in range(3):
            subpartition.add(data_buffer_consumer(10))
        reader = CreditBasedSequenceNumberingViewReader(index, 10, queue)
        queue.notify_reader_created(reader)
        reader.request_subpartition_view(SingleView(subpartition), 0, index)
    order = [m.receiver_id for m in drain(queue)]
    assert order == [0, 1, 0, 1, 0, 1]


def test_blocking_reader_backlog_and_availability():
    stored = [
        StoredBuffer(DataType.DATA_BUFFER, b"a"),
        StoredBuffer(DataType.DATA_BUFFER, b"bb"),
        StoredBuffer(DataType.END_OF_PARTITION, b""),
    ]
    reader = BoundedBlockingSubpartitionReader(iter(stored), num_data_buffers=2)
    assert reader.get_availability_and_backlog(True) == (True, 2)
    assert reader.get_availability_and_backlog(False) == (False, 2)  # data next needs credit
    first = reader.get_next_buffer()
    assert (first.buffer.data, first.backlog, first.sequence_number) == (b"a", 1, 0)
    second = reader.get_next_buffer()
    assert (second.backlog, second.next_data_type) == (0, DataType.END_OF_PARTITION)
    assert reader.get_availability_and_backlog(False).is_available  # an event needs none
    assert reader.get_next_buffer().buffer.data_type is DataType.END_OF_PARTITION
    assert reader.get_next_buffer() is None


def test_server_requires_the_handshake_first():
    manager = ResultPartitionManager()
    handler = PartitionRequestServerHandler(manager, secret=b"s3cret")
    with pytest.raises(ProtocolError, match="not authenticated"):
        handler.receive_message(PartitionRequest(1, 0, 2))
    handler = PartitionRequestServerHandler(manager, secret=b"s3cret")
    handler.receive_message(Hello(b"n" * 32))
    assert not handler.is_authenticated and handler.has_data()
    challenge = handler.next_message()
    assert isinstance(challenge, AuthChallenge) and not handler.has_data()
    with pytest.raises(ProtocolError, match="before the response"):
        handler.receive_message(PartitionRequest(1, 0, 2))


def test_request_for_unregistered_partition_waits_then_fails():
    manager = ResultPartitionManager()
    handler = PartitionRequestServerHandler(manager)
    handler.receive_message(PartitionRequest(1, 0, 2, partition_id=5))
    assert [r.receiver_id for r in handler.pending_partition_requests] == [1]
    handler.fail_pending_requests()
    message = handler.next_message()
    assert isinstance(message, ErrorResponse) and message.receiver_id == 1
    assert "PartitionNotFound" in message.message

    handler = PartitionRequestServerHandler(manager)
    handler.receive_message(PartitionRequest(2, 0, 2, partition_id=6))
    subpartition = PipelinedSubpartition(0)
    subpartition.add(event_consumer())
    partition = SinglePartition(subpartition)
    partition.partition_id = 6
    manager.register_partition(partition)  # the waiting request is served now
    assert not handler.pending_partition_requests
    assert isinstance(handler.next_message(), BufferResponse)


@pytest.mark.parametrize(
    "message",
    [AddCredit(9, 1), ResumeConsumption(9), AckAllUserRecordsProcessed(9)],
    ids=lambda m: type(m).__name__,
)
def test_message_for_a_receiver_without_partition_request_is_a_protocol_error(message):
    # given a connection on which receiver 7 requested a partition
    _, handler = serving_receiver_7()
    # when a message names receiver 9, which never requested one (Flink's obtainReader fails)
    # then it is refused, naming the message and the receiver
    with pytest.raises(ProtocolError, match=rf"{type(message).__name__} for receiver 9"):
        handler.receive_message(message)


def test_cancelled_receiver_gets_no_more_credit_and_new_buffer_size_for_an_unknown_one_is_ignored():
    # given receiver 7 that requested a partition and then cancelled it
    _, handler = serving_receiver_7()
    handler.receive_message(AddCredit(7, 1))  # known: accepted
    handler.receive_message(CancelPartitionRequest(7))
    # when a buffer size for an unknown receiver arrives, then it is ignored, as in Flink (a consumer announces
    # its size to every upstream, ready or not); and a cancel for an unknown one is ignored too
    handler.receive_message(NewBufferSize(9, 4096))
    handler.receive_message(CancelPartitionRequest(9))
    # but credit for the cancelled receiver is a protocol error
    with pytest.raises(ProtocolError, match=r"AddCredit for receiver 7"):
        handler.receive_message(AddCredit(7, 1))


@pytest.mark.parametrize(
    "message",
    [AddCredit(7, 2), ResumeConsumption(7), AckAllUserRecordsProcessed(7)],
    ids=lambda m: type(m).__name__,
)
def test_after_a_fatal_error_what_the_client_sent_before_reading_it_is_ignored(message):
    # given receiver 7 served on a connection whose producer failed: the fatal ErrorResponse is queued and
    # every reader released (Flink's PartitionRequestQueue sets fatalError)
    _, handler = serving_receiver_7()
    handler.queue.notify_fatal_error("the producer failed")
    # when the client's credit, resumption or acknowledgement, sent before the error reached it, arrives
    handler.receive_message(message)
    # then it is ignored (not a protocol error that would close the connection before the error is sent),
    # and the error is all the client gets
    assert [type(m).__name__ for m in drain(handler.queue)] == ["ErrorResponse"]
