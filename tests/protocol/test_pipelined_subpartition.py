"""PipelinedSubpartitionWithReadViewTest and PipelinedSubpartitionTest (docs/flink.md, "Behaviours from Flink's
test suite")."""

from __future__ import annotations

import pytest
from protocol_helpers import (
    CountingListener,
    Segments,
    data_buffer_consumer,
    event_consumer,
    filled_finished_consumer,
    filled_unfinished_consumer,
)

from spark_credit_shuffle.buffers.buffer import DataType
from spark_credit_shuffle.buffers.format import (
    AlignmentType,
    CheckpointBarrier,
    CheckpointOptions,
    KeepAlive,
    decode_event,
    encode_event,
)
from spark_credit_shuffle.errors import PartitionStateError
from spark_credit_shuffle.protocol.subpartition import (
    ADD_BUFFER_ERROR_CODE,
    DEFAULT_BUFFER_SIZE,
    PipelinedSubpartition,
)


@pytest.fixture
def setup():
    subpartition = PipelinedSubpartition(0)
    listener = CountingListener()
    view = subpartition.create_read_view(listener)
    return subpartition, listener, view


def assert_next_buffer(view, size, data_available, backlog, *, event=False):
    nxt = view.get_next_buffer()
    assert nxt is not None
    assert nxt.buffer.size == size
    assert nxt.buffer.data_type.is_event == event
    assert nxt.is_data_available == data_available
    assert nxt.backlog == backlog
    nxt.buffer.recycle()
    return nxt


def test_add_non_empty_not_finished_buffer(setup):
    subpartition, listener, view = setup
    assert listener.num_notifications == 0
    consumer, _builder = filled_unfinished_consumer(1024)
    subpartition.add(consumer)
    assert subpartition.get_buffers_in_backlog() == 0
    assert_next_buffer(view, 1024, False, 0)


def test_unfinished_buffer_behind_finished(setup):
    subpartition, listener, view = setup
    subpartition.add(filled_finished_consumer(1025))
    subpartition.add(filled_unfinished_consumer(1024)[0])
    assert subpartition.get_buffers_in_backlog() == 1
    assert listener.num_notifications > 0
    assert_next_buffer(view, 1025, False, 0)
    # not notified, but the unfinished buffer can still be read
    assert_next_buffer(view, 1024, False, 0)
    assert view.get_next_buffer() is None


def test_flush_with_unfinished_buffer_behind_finished(setup):
    subpartition, listener, view = setup
    subpartition.add(filled_finished_consumer(1025))
    subpartition.add(filled_unfinished_consumer(1024)[0])
    before = listener.num_notifications
    assert subpartition.get_buffers_in_backlog() == 1
    subpartition.flush()
    # more than one element: the reader was notified when the second was added
    assert before > 0
    assert listener.num_notifications == before
    assert subpartition.get_buffers_in_backlog() == 2
    assert_next_buffer(view, 1025, True, 1)
    assert_next_buffer(view, 1024, False, 0)
    assert view.get_next_buffer() is None


def test_flush_with_unfinished_buffer_behind_finished2(setup):
    subpartition, listener, view = setup
    subpartition.flush()  # empty: no effect
    assert listener.num_notifications == 0
    subpartition.add(filled_finished_consumer(1025))
    subpartition.add(filled_unfinished_consumer(1024)[0])
    assert_next_buffer(view, 1025, False, 0)
    before = listener.num_notifications
    subpartition.flush()  # one element with unread data: notify
    assert listener.num_notifications == before + 1
    subpartition.flush()  # already requested: no second notification
    assert listener.num_notifications == before + 1
    assert_next_buffer(view, 1024, False, 0)
    assert view.get_next_buffer() is None


def test_multiple_empty_buffers(setup):
    subpartition, listener, view = setup
    segments = Segments()
    assert listener.num_notifications == 0
    subpartition.add(filled_finished_consumer(0, segments))
    assert listener.num_notifications == 0
    subpartition.add(filled_finished_consumer(0, segments))
    assert listener.num_notifications == 1
    subpartition.add(filled_finished_consumer(0, segments))
    assert listener.num_notifications == 1
    assert subpartition.get_buffers_in_backlog() == 2
    subpartition.add(filled_finished_consumer(1024, segments))
    assert listener.num_notifications == 1
    assert_next_buffer(view, 1024, False, 0)  # the empty buffers are skipped
    assert segments.in_use == 0  # and every segment is back, the skipped ones included


def test_basic_pipelined_produce_consume_logic(setup):
    subpartition, listener, view = setup
    assert not view.get_availability_and_backlog(True).is_available
    subpartition.add(filled_finished_consumer(4096))
    assert not view.get_availability_and_backlog(True).is_available  # not known to be finished yet
    assert listener.num_notifications == 0
    subpartition.add(event_consumer())
    subpartition.add(filled_finished_consumer(4096))
    assert subpartition.get_buffers_in_backlog() == 1  # events do not count; the last buffer may grow
    assert listener.num_notifications == 1
    assert view.get_availability_and_backlog(True).is_available
    first = assert_next_buffer(view, 4096, True, 0)  # backlog after it: the last buffer may still grow
    assert first.next_data_type is DataType.EVENT_BUFFER
    assert_next_buffer(view, len(b"event"), False, 0, event=True)
    assert_next_buffer(view, 4096, False, 0)
    assert view.get_next_buffer() is None


@pytest.mark.parametrize(("flushed", "finished"), [(False, False), (True, False), (False, True)])
def test_backlog_consistent_with_number_of_consumable_buffers(flushed, finished):
    subpartition = PipelinedSubpartition(0)
    for i in range(1, 6):
        if i < 5 or finished:
            subpartition.add(filled_finished_consumer(1024))
        else:
            subpartition.add(filled_unfinished_consumer(1024)[0])
    if flushed:
        subpartition.flush()
    if finished:
        subpartition.finish()
    view = subpartition.create_read_view(CountingListener())
    availability = view.get_availability_and_backlog(True)
    backlog = availability.backlog
    data_buffers = 0
    while availability.is_available:
        nxt = view.get_next_buffer()
        if nxt.buffer.data_type.is_buffer:
            data_buffers += 1
        nxt.buffer.recycle()
        availability = view.get_availability_and_backlog(True)
    assert data_buffers == backlog


def test_barrier_overtaking(setup):
    """Priority events (unaligned barriers) overtake queued data; poll order and notifications as Flink's test.

    The channel state part of Flink's test: test_barrier_overtaking_persists_the_overtaken_data_buffers.
    """
    subpartition, listener, view = setup
    subpartition.add(filled_finished_consumer(1))
    assert (listener.num_notifications, listener.num_priority_events) == (0, 0)
    subpartition.add(filled_finished_consumer(2))
    assert (listener.num_notifications, listener.num_priority_events) == (1, 0)
    subpartition.add(event_consumer(payload=b"superstep"))
    subpartition.add(filled_finished_consumer(4))
    assert (listener.num_notifications, listener.num_priority_events) == (1, 0)
    subpartition.add(event_consumer(DataType.PRIORITIZED_EVENT_BUFFER, b"barrier"))
    assert (listener.num_notifications, listener.num_priority_events) == (1, 1)
    nxt = assert_next_buffer(view, len(b"barrier"), True, 2, event=True)
    assert nxt.buffer.data_type is DataType.PRIORITIZED_EVENT_BUFFER
    assert_next_buffer(view, 1, True, 1)
    nxt = assert_next_buffer(view, 2, True, 0)
    assert nxt.next_data_type is DataType.EVENT_BUFFER
    assert_next_buffer(view, len(b"superstep"), False, 0, event=True)
    assert_next_buffer(view, 4, False, 0)
    assert view.get_next_buffer() is None


def _blocked(setup):
    subpartition, listener, view = setup
    subpartition.add(event_consumer(DataType.ALIGNED_CHECKPOINT_BARRIER, b"barrier"))
    nxt = view.get_next_buffer()
    assert nxt.buffer.data_type is DataType.ALIGNED_CHECKPOINT_BARRIER
    assert subpartition.is_blocked
    return subpartition, listener, view


def test_blocked_by_checkpoint_no_notification_and_no_availability(setup):
    subpartition, listener, view = _blocked(setup)
    before = listener.num_notifications
    subpartition.add(event_consumer())
    subpartition.add(filled_finished_consumer(100))
    subpartition.add(filled_finished_consumer(100))
    subpartition.flush()
    assert listener.num_notifications == before
    assert not view.get_availability_and_backlog(True).is_available
    assert not view.get_availability_and_backlog(False).is_available
    assert view.get_availability_and_backlog(True).backlog == 0
    assert view.get_next_buffer() is None


def test_resume_blocked_subpartition_with_events(setup):
    subpartition, _, view = _blocked(setup)
    subpartition.add(event_consumer())
    view.resume_consumption()
    assert view.get_availability_and_backlog(False).is_available


def test_resume_blocked_subpartition_with_flushed_buffer(setup):
    subpartition, _, view = _blocked(setup)
    subpartition.add(filled_unfinished_consumer(100)[0])
    subpartition.flush()
    view.resume_consumption()
    assert view.get_availability_and_backlog(True).is_available


def test_resume_blocked_subpartition_with_finished_buffers(setup):
    subpartition, _, view = _blocked(setup)
    subpartition.add(filled_finished_consumer(100))
    subpartition.add(filled_finished_consumer(100))
    view.resume_consumption()
    availability = view.get_availability_and_backlog(True)
    assert availability.is_available
    assert availability.backlog == 1


def test_resume_blocked_subpartition_with_unflushed_buffer(setup):
    subpartition, _, view = _blocked(setup)
    subpartition.add(filled_unfinished_consumer(100)[0])
    view.resume_consumption()
    assert not view.get_availability_and_backlog(True).is_available


def test_resume_blocked_empty_subpartition(setup):
    _, _, view = _blocked(setup)
    view.resume_consumption()
    assert not view.get_availability_and_backlog(True).is_available
    with pytest.raises(PartitionStateError):
        view.resume_consumption()  # not blocked any more


def test_new_buffer_size(setup):
    subpartition, _, view = setup
    assert subpartition.add(filled_finished_consumer(10)) == DEFAULT_BUFFER_SIZE
    view.notify_new_buffer_size(42)
    assert subpartition.add(filled_finished_consumer(10)) == 42


def test_negative_buffer_size_as_sign_of_adding_fail(setup):
    subpartition, _, _ = setup
    with pytest.raises(ValueError):
        subpartition.set_buffer_size(-1)
    subpartition.finish()
    segments = Segments()
    assert subpartition.add(filled_finished_consumer(10, segments)) == ADD_BUFFER_ERROR_CODE
    assert segments.in_use == 0  # the refused consumer was closed


def test_illegal_read_view_request(setup):
    subpartition, _, _ = setup
    with pytest.raises(PartitionStateError):
        subpartition.create_read_view(CountingListener())


def test_release_closes_queued_consumers_and_refuses_adds(setup):
    subpartition, _, view = setup
    segments = Segments()
    subpartition.add(filled_finished_consumer(10, segments))
    consumer, builder = filled_unfinished_consumer(10, segments)
    subpartition.add(consumer)
    view.release_all_resources()
    builder.finish()
    assert segments.in_use == 0
    assert subpartition.is_released
    assert subpartition.add(data_buffer_consumer(3)) == ADD_BUFFER_ERROR_CODE


def test_end_of_partition_is_never_skipped_although_empty(setup):
    subpartition, listener, view = setup
    subpartition.finish()
    assert listener.num_notifications == 1
    nxt = view.get_next_buffer()
    assert nxt.buffer.data_type is DataType.END_OF_PARTITION
    assert nxt.buffer.size == 0
    assert view.get_next_buffer() is None


def test_backlog_counts_down_for_complete_buffers():
    """Complete buffers (stored data replayed, events) leave the backlog as they are polled, so the
    backlog a receiver sees is what is really queued and it does not ask for floating buffers it
    cannot use."""
    subpartition = PipelinedSubpartition(0)
    for _ in range(4):
        subpartition.add(data_buffer_consumer(1024))
    view = subpartition.create_read_view(CountingListener())
    backlogs = []
    while (nxt := view.get_next_buffer()) is not None:
        backlogs.append(nxt.backlog)
        nxt.buffer.recycle()
    # Flink's count: the last buffer is left out while nothing was flushed (it might still be written to)
    assert backlogs == [2, 1, 0, 0]
    assert subpartition.buffers_in_backlog == 0
    assert subpartition.get_buffers_in_backlog() == 0


class ChannelStateRecorder:
    """An output channel state writer that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, list[int]]] = []

    def __call__(self, checkpoint_id: int, subpartition: int, sizes: list[int]) -> None:
        self.calls.append((checkpoint_id, subpartition, sizes))


def barrier(checkpoint_id: int, options: CheckpointOptions):
    return encode_event(CheckpointBarrier(checkpoint_id, 1_000, options))


TIMEOUTABLE = CheckpointOptions(AlignmentType.ALIGNED, 10)
UNALIGNED = CheckpointOptions(AlignmentType.UNALIGNED)


def test_barrier_overtaking_persists_the_overtaken_data_buffers(setup):
    """testBarrierOvertaking, its channel-state part: the writer gets the overtaken data buffers, once."""
    subpartition, listener, _ = setup
    writer = subpartition.channel_state_writer = ChannelStateRecorder()
    subpartition.add(filled_finished_consumer(1))
    subpartition.add(filled_finished_consumer(2))
    subpartition.add(event_consumer(payload=b"superstep"))
    subpartition.add(filled_finished_consumer(4))
    subpartition.add(event_consumer(DataType.PRIORITIZED_EVENT_BUFFER, encode_event(KeepAlive()).data))
    assert writer.calls == []  # a priority event that is no barrier persists nothing
    subpartition.add(barrier(7, UNALIGNED))
    assert writer.calls == [(7, 0, [1, 2, 4])]  # the data buffers, in order; not the events
    assert listener.num_priority_events == 1


def test_timeout_aligned_to_unaligned_barrier(setup):
    """Given a timeoutable aligned barrier still queued behind data, when its alignment times out, then it
    moves to the head as an unaligned priority barrier and the data it overtook is output channel state."""
    subpartition, listener, view = setup
    writer = subpartition.channel_state_writer = ChannelStateRecorder()
    subpartition.add(filled_finished_consumer(1))
    subpartition.add(filled_finished_consumer(2))
    subpartition.add(barrier(5, TIMEOUTABLE))
    subpartition.add(filled_finished_consumer(4))
    assert listener.num_priority_events == 0
    assert subpartition.aligned_barrier_timeout(4) is None  # another checkpoint's: nothing happens
    assert subpartition.aligned_barrier_timeout(5) == [1, 2]
    assert writer.calls == [(5, 0, [1, 2])]
    assert listener.num_priority_events == 1
    nxt = view.get_next_buffer()
    assert nxt.buffer.data_type is DataType.PRIORITIZED_EVENT_BUFFER
    moved = decode_event(nxt.buffer.data_type, nxt.buffer.data)
    assert (moved.id, moved.timestamp, moved.options.is_unaligned) == (5, 1_000, True)
    assert [view.get_next_buffer().buffer.size for _ in range(3)] == [1, 2, 4]
    assert not subpartition.is_blocked  # an unaligned barrier blocks nothing
    assert view.get_next_buffer() is None


def test_timeout_after_the_barrier_was_sent_changes_nothing(setup):
    """Given a timeoutable barrier already polled (the subpartition blocked behind it), when its alignment
    times out, then nothing moves, nothing is persisted and the subpartition stays blocked."""
    subpartition, listener, view = setup
    writer = subpartition.channel_state_writer = ChannelStateRecorder()
    subpartition.add(barrier(5, TIMEOUTABLE))
    subpartition.add(filled_finished_consumer(3))
    assert view.get_next_buffer().buffer.data_type is DataType.TIMEOUTABLE_ALIGNED_CHECKPOINT_BARRIER
    assert subpartition.is_blocked
    assert subpartition.aligned_barrier_timeout(5) is None
    assert writer.calls == [] and listener.num_priority_events == 0 and subpartition.is_blocked
