"""The consumer's hand-over to the Spark task thread: bounded in batches and in bytes, so that the time a
consumer waits on its output does not depend on how large its batches happened to be cut. And the input's
hand-over from the thread reading Spark to the task's loop: bounded, every batch once and in order, the
reader woken to refill only when the loop took all but a few, the loop only when a batch arrives at an empty
hand-over."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest

from spark_credit_shuffle.errors import CreditShuffleError
from spark_credit_shuffle.runtime import handoff as handoff_module
from spark_credit_shuffle.runtime.handoff import HANDOFF_BATCHES, InputHandoff, OutputHandoff


def batch_of(size: int) -> pa.RecordBatch:
    return pa.record_batch([pa.array([b"x" * size], pa.binary())], names=["pad"])


class Waits:
    def __init__(self) -> None:
        self.count = 0

    def on_wait(self) -> None:
        self.count += 1


def put_or_wait(handoff: OutputHandoff, batch: pa.RecordBatch) -> bool:
    """Whether putting ``batch`` had to wait (the call gives up at once instead of waiting)."""
    waits = Waits()
    try:
        handoff.put(batch, lambda: True, waits.on_wait, lambda: None)
    except CreditShuffleError:
        assert waits.count == 1
        return True
    assert waits.count == 0
    return False


def test_small_batches_are_bounded_by_their_number():
    handoff = OutputHandoff()
    small = batch_of(100)
    assert [put_or_wait(handoff, small) for _ in range(HANDOFF_BATCHES)] == [False] * HANDOFF_BATCHES
    assert put_or_wait(handoff, small)
    assert handoff.take(lambda: True) is not None  # handed to Spark: still held until Spark asks again
    assert put_or_wait(handoff, small)
    assert handoff.take(lambda: True) is not None  # the first was consumed
    assert not put_or_wait(handoff, small)


def test_large_batches_are_bounded_by_their_bytes_and_one_larger_than_the_bound_still_goes():
    handoff = OutputHandoff(capacity=4, max_bytes=1000)
    large = batch_of(600)
    assert not put_or_wait(handoff, large)
    assert not put_or_wait(handoff, large)  # 600 bytes held: room
    assert put_or_wait(handoff, large)  # 1200 held
    first = handoff.take(lambda: True)
    assert first is not None and put_or_wait(handoff, large)  # in flight: still held
    assert handoff.take(lambda: True) is not None  # the first consumed: 600 held, the second in flight
    assert not put_or_wait(handoff, large)
    handoff = OutputHandoff(capacity=4, max_bytes=100)
    assert not put_or_wait(handoff, batch_of(10_000))


@pytest.mark.parametrize("size", [10, 700])
def test_every_batch_comes_out_once_in_order_and_then_the_end(size):
    handoff = OutputHandoff(capacity=3, max_bytes=1000)
    sent, received = [], []
    for i in range(20):
        batch = pa.record_batch([pa.array([i]), pa.array([b"x" * size])], names=["i", "pad"])
        while put_or_wait(handoff, batch):
            taken = handoff.take(lambda: True)
            assert taken is not None
            received.append(taken.column(0)[0].as_py())
        sent.append(i)
    closer = threading.Thread(target=handoff.close, daemon=True)  # returns once Spark took every batch
    closer.start()
    while (taken := handoff.take(lambda: True)) is not None:
        received.append(taken.column(0)[0].as_py())
    closer.join(10)
    assert not closer.is_alive(), "close() still waits although every batch was taken"
    assert received == sent


def numbered(i: int) -> pa.RecordBatch:
    return pa.record_batch([pa.array([i])], names=["i"])


def test_the_input_reader_waits_while_full_and_refills_only_below_the_low_water_mark():
    inputs = InputHandoff(capacity=4, low_water=1)
    wakeups = []
    inputs.on_item = lambda: wakeups.append(len(wakeups))
    put_done = []

    def reader() -> None:
        for i in range(10):
            inputs.put(numbered(i), lambda: False)
            put_done.append(i)
        inputs.end()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    wait_until(lambda: len(put_done) == 4)
    time_passes()  # the reader, with its fifth batch, now waits for room
    assert len(put_done) == 4
    assert len(wakeups) == 1  # the loop is woken by the first batch only: the hand-over held one after
    taken = [inputs.pop().column(0)[0].as_py() for _ in range(2)]
    time_passes()
    assert len(put_done) == 4  # two left, above the low water mark: the reader is not woken
    taken.append(inputs.pop().column(0)[0].as_py())  # one left: woken, it refills to four
    wait_until(lambda: len(put_done) == 7)
    while not inputs.is_ended:
        batch = inputs.peek()
        if batch is None:
            time_passes()
            continue
        taken.append(inputs.pop().column(0)[0].as_py())
    thread.join(10)
    assert taken == list(range(10))


def test_a_full_input_hand_over_lets_a_stopping_reader_go():
    inputs = InputHandoff(capacity=1, low_water=0)
    inputs.put(numbered(0), lambda: False)
    with pytest.raises(CreditShuffleError, match="no longer taken"):
        inputs.put(numbered(1), lambda: True)
    with pytest.raises(ValueError, match="low_water"):
        InputHandoff(capacity=2, low_water=2)


def test_a_waiting_taker_is_woken_by_the_next_batch(monkeypatch):
    # the taker's own look comes a minute later: only the offer's notification can wake it within the join
    monkeypatch.setattr(handoff_module, "_POLL_S", 60.0)
    handoff = OutputHandoff(capacity=2)
    got = []
    taker = threading.Thread(target=lambda: got.append(handoff.take(lambda: True)), daemon=True)
    taker.start()
    time_passes()
    assert handoff.offer(numbered(7))
    taker.join(10)
    assert not taker.is_alive() and got[0].column(0)[0].as_py() == 7


def test_a_taker_is_woken_after_wake_after_batches_or_by_wake(monkeypatch):
    # the loop wakes the Spark task thread once two batches wait, or when it has nothing more to do at once
    monkeypatch.setattr(handoff_module, "_POLL_S", 60.0)
    for way in ("second offer", "wake"):
        handoff = OutputHandoff(capacity=4, wake_after=2)
        got: list[pa.RecordBatch] = []
        taker = threading.Thread(target=lambda h=handoff, g=got: g.append(h.take(lambda: True)), daemon=True)
        taker.start()
        wait_until(lambda h=handoff: h._takers_waiting == 1)
        assert handoff.offer(numbered(1))
        time_passes()
        assert taker.is_alive() and not got, "one batch must not wake the taker"
        if way == "second offer":
            assert handoff.offer(numbered(2))
        else:
            handoff.wake()
        taker.join(10)
        assert not taker.is_alive() and got[0].column(0)[0].as_py() == 1, way


def test_a_full_hand_over_wakes_its_taker_before_wake_after_batches(monkeypatch):
    # one batch that fills the bytes: nothing more comes until it is taken, so the look at the room wakes the taker
    monkeypatch.setattr(handoff_module, "_POLL_S", 60.0)
    handoff = OutputHandoff(capacity=4, max_bytes=64, wake_after=2)
    got: list[pa.RecordBatch] = []
    taker = threading.Thread(target=lambda: got.append(handoff.take(lambda: True)), daemon=True)
    taker.start()
    wait_until(lambda: handoff._takers_waiting == 1)
    assert handoff.offer(batch_of(100))
    time_passes()
    assert taker.is_alive() and not got, "one batch must not wake the taker by itself"
    assert not handoff.has_room()
    taker.join(10)
    assert not taker.is_alive() and got[0].num_rows == 1


def test_wake_after_must_be_within_the_capacity():
    with pytest.raises(ValueError, match="wake_after"):
        OutputHandoff(capacity=2, wake_after=3)
    with pytest.raises(ValueError, match="wake_after"):
        OutputHandoff(capacity=2, wake_after=0)


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the reader thread"
        time.sleep(0.005)


def time_passes() -> None:
    """Long enough for the other thread to act on anything it was woken for."""
    time.sleep(0.05)
