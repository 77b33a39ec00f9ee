"""The consumer's hand-over to the Spark task thread: bounded in batches and in bytes, so that the time a
consumer waits on its output does not depend on how large its batches happened to be cut."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from spark_credit_shuffle.errors import CreditShuffleError
from spark_credit_shuffle.runtime.handoff import HANDOFF_BATCHES, OutputHandoff


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
