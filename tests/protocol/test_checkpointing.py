"""Consumer-side barrier handling: given/when/then after Flink's ``AlignedCheckpointsTest``,
``UnalignedCheckpointsTest``, ``AlternatingCheckpointsTest`` and ``ChannelStatePersisterTest``, and a
property test of row conservation across barriers, aligned and unaligned."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_helpers import CountingListener, event_consumer, filled_finished_consumer

from spark_credit_shuffle.buffers import (
    AlignmentType,
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointOptions,
    DataType,
    encode_event,
)
from spark_credit_shuffle.errors import ProtocolError
from spark_credit_shuffle.protocol import (
    BarrierHandlerState,
    ChannelStatePersister,
    CheckpointStatus,
    PipelinedSubpartition,
    SingleCheckpointBarrierHandler,
)

MS = 1_000_000
ALIGNED = CheckpointOptions()
UNALIGNED = CheckpointOptions(AlignmentType.UNALIGNED)


def barrier(checkpoint_id: int, options: CheckpointOptions = ALIGNED, timestamp: int = 0) -> CheckpointBarrier:
    return CheckpointBarrier(checkpoint_id, timestamp, options)


class Captured:
    """A channel-state writer that keeps what it is given, in order."""

    def __init__(self) -> None:
        self.items: list[tuple[int, int, int, int]] = []

    def __call__(self, checkpoint_id: int, channel: int, sequence_number: int, size: int) -> None:
        self.items.append((checkpoint_id, channel, sequence_number, size))


# -- aligned -----------------------------------------------------------------------------------------


def test_alignment_blocks_only_the_channels_that_delivered_the_barrier():
    """Given 3 channels, when barrier 1 arrives on channels 0 and 2, then only those are blocked and the
    checkpoint waits; when it arrives on channel 1, the checkpoint completes and every channel resumes
    (each subpartition blocked itself when it sent the barrier, channel 1's too)."""
    handler = SingleCheckpointBarrierHandler(3)
    assert handler.process_barrier(0, barrier(1), 10 * MS) == ()
    assert handler.state is BarrierHandlerState.COLLECTING_BARRIERS
    assert handler.process_buffer(1, 0, 100) is False  # channel 1 still delivers, nothing is captured
    assert handler.process_barrier(2, barrier(1), 12 * MS) == ()
    assert [handler.is_blocked(c) for c in range(3)] == [True, False, True]
    with pytest.raises(ProtocolError, match="blocked"):
        handler.process_buffer(0, 1, 100)
    assert handler.process_barrier(1, barrier(1), 15 * MS) == (0, 1, 2)
    assert handler.blocked_channels == frozenset() and handler.state is BarrierHandlerState.WAITING_FOR_FIRST_BARRIER
    (done,) = handler.completed
    assert (done.checkpoint_id, done.alignment, done.alignment_time_ns) == (1, AlignmentType.ALIGNED, 5 * MS)
    assert done.start_delay_ns == 10 * MS  # trigger timestamp 0 ms, first barrier at 10 ms
    assert done.persisted_bytes == 0


def test_later_barrier_cancels_an_incomplete_alignment():
    """Given barrier 1 on channel 0 of 2, when barrier 2 arrives on channel 1, then checkpoint 1 is aborted
    (subsumed), channel 0 resumes, and alignment of checkpoint 2 starts with channel 1 blocked; barrier 1
    arriving late on channel 1's peer is ignored and its channel resumed at once."""
    handler = SingleCheckpointBarrierHandler(2)
    handler.process_barrier(0, barrier(1), 0)
    assert handler.process_barrier(1, barrier(2), 1 * MS) == (0,)
    assert [(a.checkpoint_id, a.reason) for a in handler.aborted] == [(1, "subsumed by checkpoint 2")]
    assert handler.pending_checkpoint_id == 2 and handler.blocked_channels == {1}
    assert handler.process_barrier(0, barrier(2), 3 * MS) == (0, 1)
    assert [c.checkpoint_id for c in handler.completed] == [2]
    assert handler.process_barrier(0, barrier(1), 4 * MS) == (0,)  # stale: its subpartition blocked itself
    assert handler.completed[-1].checkpoint_id == 2 and not handler.is_checkpoint_pending


def test_cancel_checkpoint_marker_aborts_alignment_and_later_barriers_of_it():
    """Given an alignment of checkpoint 4, when CancelCheckpointMarker(4) arrives, then it is aborted and the
    blocked channel resumes; a marker for checkpoint 5 before any of its barriers aborts 5, whose barriers then
    pass without blocking."""
    handler = SingleCheckpointBarrierHandler(3)
    handler.process_barrier(1, barrier(4), 0)
    assert handler.process_cancellation_barrier(2, CancelCheckpointMarker(4), 1) == (1,)
    assert handler.aborted[-1].checkpoint_id == 4 and not handler.is_checkpoint_pending
    assert handler.process_cancellation_barrier(0, CancelCheckpointMarker(5), 2) == ()
    assert handler.aborted[-1].checkpoint_id == 5
    assert handler.process_barrier(0, barrier(5), 3) == (0,)
    assert handler.completed == [] and handler.blocked_channels == frozenset()


def test_barrier_after_end_of_partition_completes_alignment():
    """Given 3 channels of which channel 2 finished, when barrier 1 arrives on channels 0 and 1, then the
    checkpoint completes; and an EndOfPartition on the last missing channel completes one as well."""
    handler = SingleCheckpointBarrierHandler(3)
    handler.process_end_of_partition(2, 0)
    handler.process_barrier(0, barrier(1), 1)
    assert handler.process_barrier(1, barrier(1), 2) == (0, 1)
    assert [c.checkpoint_id for c in handler.completed] == [1]
    handler.process_barrier(0, barrier(2), 3)
    assert handler.process_end_of_partition(1, 4) == (0,)
    assert [c.checkpoint_id for c in handler.completed] == [1, 2]
    with pytest.raises(ProtocolError, match="after its EndOfPartition"):
        handler.process_barrier(1, barrier(3), 5)


def test_duplicate_barrier_and_unknown_channel_are_protocol_errors():
    handler = SingleCheckpointBarrierHandler(2)
    handler.process_barrier(0, barrier(1, UNALIGNED), 0)
    with pytest.raises(ProtocolError, match="twice"):
        handler.process_barrier(0, barrier(1, UNALIGNED), 1)
    with pytest.raises(ProtocolError, match="outside"):
        handler.process_barrier(2, barrier(1), 1)


def test_aligned_barrier_blocks_its_subpartition_until_the_handler_resumes_it():
    """Given a subpartition with data, an aligned barrier and more data, when the barrier is polled the
    subpartition is blocked; the consumer's handler completes alignment and returns the channel to resume;
    resuming it delivers the data behind the barrier (Flink's ResumeConsumption)."""
    subpartition = PipelinedSubpartition(0)
    view = subpartition.create_read_view(CountingListener())
    subpartition.add(filled_finished_consumer(10))
    subpartition.add(event_consumer(DataType.ALIGNED_CHECKPOINT_BARRIER, bytes(encode_event(barrier(1)).data)))
    subpartition.add(filled_finished_consumer(20))
    subpartition.finish()
    handler = SingleCheckpointBarrierHandler(1)
    assert view.get_next_buffer().buffer.size == 10
    assert view.get_next_buffer().buffer.data_type is DataType.ALIGNED_CHECKPOINT_BARRIER
    assert view.get_next_buffer() is None and subpartition.is_blocked
    for channel in handler.process_barrier(0, barrier(1), 0):
        assert channel == 0
        view.resume_consumption()
    assert view.get_next_buffer().buffer.size == 20


# -- unaligned and aligned with timeout ------------------------------------------------------------------


def test_overtaken_buffers_are_persisted_exactly_once_and_in_order():
    """Given 2 channels, when an unaligned barrier 1 (at sequence number 3 on channel 0) overtakes channel 0's
    buffers 1 and 2, then those two and channel 1's buffers consumed before its barrier are the channel state,
    in consumption order, once each; buffer 4 behind the barrier is not."""
    captured = Captured()
    handler = SingleCheckpointBarrierHandler(2, captured)
    assert handler.process_buffer(0, 0, 8) is False  # consumed before the checkpoint started
    assert handler.process_barrier(0, barrier(1, UNALIGNED), 5 * MS, sequence_number=3) == ()
    assert handler.blocked_channels == frozenset()  # unaligned: nothing blocks
    assert handler.process_buffer(1, 0, 16) is True  # channel 1 is before its barrier
    assert handler.process_buffer(0, 1, 32) is True  # overtaken
    assert handler.process_buffer(0, 2, 64) is True  # overtaken
    assert handler.process_buffer(0, 4, 128) is False  # behind the barrier
    assert handler.process_buffer(0, 2, 64) is False  # the overtaken run ended with buffer 4
    handler.process_barrier(1, barrier(1, UNALIGNED), 6 * MS, sequence_number=1)
    assert handler.process_buffer(1, 2, 256) is False
    assert captured.items == [(1, 1, 0, 16), (1, 0, 1, 32), (1, 0, 2, 64)]
    (done,) = handler.completed
    assert (done.alignment, done.persisted_buffers, done.persisted_bytes) == (AlignmentType.UNALIGNED, 3, 112)
    assert done.alignment_time_ns == 1 * MS and handler.channel_state_bytes == {1: 112}


def test_overtaken_buffers_consumed_after_completion_count_for_their_checkpoint():
    captured = Captured()
    handler = SingleCheckpointBarrierHandler(1, captured)
    handler.process_barrier(0, barrier(7, UNALIGNED), 0, sequence_number=2)  # overtook 0 and 1
    assert handler.completed[0].persisted_bytes == 0
    assert [handler.process_buffer(0, s, 10) for s in (0, 1, 3)] == [True, True, False]
    assert handler.channel_state_bytes == {7: 20}


def test_channel_state_persister_statuses():
    """ChannelStatePersisterTest: pending captures everything, a received barrier only lower sequence numbers."""
    persister = ChannelStatePersister(0)
    assert persister.maybe_persist(0) == [] and persister.status(1) is CheckpointStatus.COMPLETED
    persister.start_persisting(1)
    assert persister.maybe_persist(1) == [1] and persister.status(1) is CheckpointStatus.BARRIER_PENDING
    persister.check_for_barrier(1, 5)
    assert persister.status(1) is CheckpointStatus.BARRIER_RECEIVED
    persister.start_persisting(2)  # a second barrier overtakes the same buffers: they are in both states
    assert persister.maybe_persist(2) == [1, 2]
    persister.check_for_barrier(2, 4)
    assert persister.maybe_persist(3) == [1, 2]
    assert persister.maybe_persist(6) == [] and not persister.is_persisting


def test_aligned_with_timeout_switches_to_unaligned():
    """Given a timeoutable barrier (timeout 10 ms) on channel 0 of 2, when alignment has taken longer than
    10 ms, then channel 0 resumes, channel 1's buffers before its barrier are captured, and the checkpoint
    completes as an unaligned one that timed out."""
    timeoutable = CheckpointOptions(AlignmentType.ALIGNED, 10)
    handler = SingleCheckpointBarrierHandler(2)
    handler.process_barrier(0, barrier(1, timeoutable), 100 * MS)
    assert handler.check_alignment_timeout(105 * MS) == () and handler.is_blocked(0)
    assert handler.process_buffer(1, 0, 50) is False  # still aligned: not channel state
    assert handler.check_alignment_timeout(111 * MS) == (0,)
    assert handler.state is BarrierHandlerState.COLLECTING_BARRIERS_UNALIGNED
    assert handler.process_buffer(1, 1, 70) is True
    assert handler.process_buffer(0, 5, 90) is False  # channel 0 delivered its barrier before the switch
    assert handler.process_barrier(1, barrier(1, timeoutable), 112 * MS, sequence_number=2) == (1,)
    (done,) = handler.completed
    assert (done.alignment, done.timed_out, done.persisted_bytes) == (AlignmentType.UNALIGNED, True, 70)


# -- property: rows either side of every barrier ------------------------------------------------------


@st.composite
def channels_and_moves(draw):
    num_channels = draw(st.integers(1, 4))
    checkpoints = draw(st.integers(1, 3))
    channels = []
    for _ in range(num_channels):
        # each channel: data buffers ("d") with barriers 1..checkpoints between them, in producer order
        sizes = draw(st.lists(st.integers(0, 4), min_size=checkpoints + 1, max_size=checkpoints + 1))
        items: list[tuple[str, int]] = []
        for k, n in enumerate(sizes):
            items += [("d", 0)] * n
            if k < checkpoints:
                items.append(("b", k + 1))
        channels.append(items)
    moves = draw(st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=60))
    return channels, moves


def _run(channels, moves, options):
    """Consume the channels in the order ``moves`` pick (then the rest), a barrier with priority jumping
    over the data ahead of it when a move asks for it (unaligned). Returns the handler, the consumption log
    and the captured channel state."""
    captured = Captured()
    handler = SingleCheckpointBarrierHandler(len(channels), captured)
    remaining = [[(seq, kind, cid) for seq, (kind, cid) in enumerate(items)] for items in channels]
    log: list[tuple[str, int, int, int]] = []  # (kind, channel, seq, checkpoints completed so far)
    now = 0
    ended: set[int] = set()

    def step(channel: int, overtake: bool) -> None:
        nonlocal now
        now += 1
        queue = remaining[channel]
        if not queue:
            handler.process_end_of_partition(channel, now)
            ended.add(channel)
            return
        index = 0
        if overtake and options.is_unaligned:
            index = next((i for i, item in enumerate(queue) if item[1] == "b"), 0)
        seq, kind, checkpoint_id = queue.pop(index)
        if kind == "b":
            handler.process_barrier(channel, barrier(checkpoint_id, options), now, sequence_number=seq)
        else:
            handler.process_buffer(channel, seq, 1)
        log.append((kind, channel, seq, len(handler.completed)))

    def runnable() -> list[int]:
        return [c for c in range(len(channels)) if c not in ended and not handler.is_blocked(c)]

    for pick, overtake in moves:
        choices = runnable()
        if choices:
            step(choices[pick % len(choices)], overtake)
    while choices := runnable():
        step(choices[0], False)
    return handler, log, captured


@settings(max_examples=150, deadline=None)
@given(channels_and_moves())
def test_aligned_every_row_is_before_or_after_each_barrier(case):
    channels, moves = case
    handler, log, captured = _run(channels, moves, ALIGNED)
    checkpoints = max(cid for items in channels for kind, cid in items if kind == "b")
    assert [c.checkpoint_id for c in handler.completed] == list(range(1, checkpoints + 1))
    assert captured.items == [] and handler.aborted == []
    barrier_seq = {
        (c, cid): seq for c, items in enumerate(channels) for seq, (kind, cid) in enumerate(items) if kind == "b"
    }
    for kind, channel, seq, completed in log:
        if kind == "d":
            # a data buffer is consumed after checkpoint k completed exactly when it is behind barrier k
            behind = sum(seq > barrier_seq[(channel, k)] for k in range(1, checkpoints + 1))
            assert completed == behind
    assert sum(kind == "d" for kind, *_ in log) == sum(kind == "d" for items in channels for kind, _ in items)


@settings(max_examples=150, deadline=None)
@given(channels_and_moves())
def test_unaligned_channel_state_is_exactly_the_overtaken_buffers(case):
    channels, moves = case
    handler, log, captured = _run(channels, moves, UNALIGNED)
    checkpoints = max(cid for items in channels for kind, cid in items if kind == "b")
    # a barrier of checkpoint k+1 that overtakes before every channel delivered k's subsumes k, as in Flink
    completed = [c.checkpoint_id for c in handler.completed]
    assert sorted(completed + [a.checkpoint_id for a in handler.aborted]) == list(range(1, checkpoints + 1))
    assert checkpoints in completed and handler.blocked_channels == frozenset()
    for k in completed:
        start = next(i for i, entry in enumerate(log) if entry[0] == "b" and channels_seq(channels, entry) == k)
        barrier_seq = {c: seq for c, items in enumerate(channels) for seq, it in enumerate(items) if it == ("b", k)}
        # the buffers behind-in-order but consumed after the checkpoint started: the state, in consumption order
        expected = [
            (k, channel, seq, 1)
            for i, (kind, channel, seq, _) in enumerate(log)
            if kind == "d" and i > start and seq < barrier_seq[channel]
        ]
        assert [item for item in captured.items if item[0] == k] == expected
        # conservation: rows before barrier k = consumed before the checkpoint started + its channel state
        before = {(c, seq) for c, s in barrier_seq.items() for seq in range(s) if channels[c][seq][0] == "d"}
        consumed_before = {(channel, seq) for kind, channel, seq, _ in log[:start] if kind == "d"}
        state = [(channel, seq) for _, channel, seq, _ in expected]
        assert len(state) == len(set(state)) and consumed_before.isdisjoint(state)
        assert consumed_before | set(state) == before
        assert handler.channel_state_bytes.get(k, 0) == len(expected)


def channels_seq(channels, entry) -> int:
    """The checkpoint id of a logged barrier."""
    _, channel, seq, _ = entry
    return channels[channel][seq][1]
