"""The bounded hand-over of a consumer's output to the Spark task thread that yields it.

A pipelined consumer decodes (and runs its chained operators) on a thread of its own; the Spark task thread
only hands whole output batches to Spark. Between the two sits an :class:`OutputHandoff` of a few batches:
when Spark does not take the task's output (the rest of the stage is slower, or Spark's own buffers towards
the next Python step are full), the hand-over fills, the consumer waits, and that wait is its back-pressured
time, as a Flink task whose output buffers are all taken (``backPressuredTimeMsPerSecond``). While it waits
it reads no input: its input buffers stay taken, it announces no credit, and its producers become
back-pressured in turn.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator

import pyarrow as pa

from ..errors import CreditShuffleError

__all__ = ["HANDOFF_BATCHES", "HANDOFF_BYTES", "OutputHandoff", "handed_on"]

#: Output batches handed on and not yet taken: four, so that the consumer decodes the next while Spark consumes one,
#: and a burst of input (producers released together) does not count as waiting on the output. A slow step after the
#: task fills any bound; measured with jobs/diagnosis_matrix.py, two made the consumers of fast partitions wait on
#: their output 300-450 ms/s behind one slow partition, four 40-370.
HANDOFF_BATCHES = 4
#: ... and at most this many bytes of them (a batch is never split: one larger batch still goes alone). Output
#: batches are cut at up to 4 MiB (``engine.consumer.OUTPUT_BATCH_BYTES``) when input comes in bursts and far
#: smaller when it trickles, so a bound in batches alone held 0.1-20 MB by chance: behind a slow step after the
#: exchange, wide rows (1 KB, 40 MB per partition) then went by without back-pressuring the consumer in 3 of 14
#: runs. Two full batches: one Spark consumes, one ready.
HANDOFF_BYTES = 8 << 20
#: How often a wait on either side looks whether the other side stopped.
_POLL_S = 0.5


class OutputHandoff:
    """At most ``capacity`` output batches and ``max_bytes`` bytes handed on and not yet taken, from the
    consumer thread to the Spark task thread, then the end (:meth:`close`) or the consumer's failure
    (:meth:`fail`). A batch counts as taken once the Spark thread comes back for the next one (Spark consumed
    what it was given), so a slow step after the task holds the consumer back by its last batch as by any
    other."""

    def __init__(self, capacity: int = HANDOFF_BATCHES, max_bytes: int = HANDOFF_BYTES) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._items: deque[pa.RecordBatch] = deque()
        self._in_flight = 0  # a batch yielded to Spark and not yet consumed
        self._held_bytes = 0  # of the batches handed on and not yet taken, the one in flight included
        self._in_flight_bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None

    def _wait_while(
        self,
        full: Callable[[], bool],
        stopping: Callable[[], bool],
        on_wait: Callable[[], None],
        on_taken: Callable[[], None],
    ) -> None:
        """Wait (lock held) while ``full()``, bracketed by ``on_wait`` / ``on_taken``."""
        if not full():
            return
        on_wait()
        try:
            while full():
                if stopping():
                    raise CreditShuffleError("task stopping: its output is no longer taken")
                self._cond.wait(_POLL_S)
        finally:
            on_taken()

    def put(
        self,
        batch: pa.RecordBatch,
        stopping: Callable[[], bool],
        on_wait: Callable[[], None],
        on_taken: Callable[[], None],
    ) -> None:
        """Hand ``batch`` on, waiting while ``capacity`` batches are not yet taken; ``on_wait`` and ``on_taken``
        bracket such a wait (the consumer's back-pressured time). Raises :class:`CreditShuffleError` once
        ``stopping()`` (the task ends: nobody will take it)."""
        with self._cond:
            self._wait_while(self._full, stopping, on_wait, on_taken)
            self._items.append(batch)
            self._held_bytes += batch.nbytes
            self._cond.notify_all()

    def _full(self) -> bool:
        return len(self._items) + self._in_flight >= self.capacity or self._held_bytes >= self.max_bytes

    def close(
        self,
        stopping: Callable[[], bool] = lambda: False,
        on_wait: Callable[[], None] = lambda: None,
        on_taken: Callable[[], None] = lambda: None,
    ) -> None:
        """No more batches: the consumer ended. Returns once Spark took every batch handed on (the wait
        bracketed by ``on_wait`` / ``on_taken``: the consumer's last back-pressured time)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._wait_while(lambda: bool(self._items) or self._in_flight > 0, stopping, on_wait, on_taken)

    def fail(self, error: BaseException) -> None:
        """The consumer failed: :meth:`take` raises ``error`` once the batches before it were taken."""
        with self._cond:
            self._error = error
            self._closed = True
            self._cond.notify_all()

    def take(self, alive: Callable[[], bool]) -> pa.RecordBatch | None:
        """The next batch, or None at the end; raises the consumer's failure. ``alive()``: whether the consumer
        thread still runs (a thread that ended without closing the hand-over is a failure named here)."""
        with self._cond:
            self._in_flight = 0  # the batch taken before, if any, was consumed: Spark asks for the next
            self._held_bytes -= self._in_flight_bytes
            self._in_flight_bytes = 0
            self._cond.notify_all()
            while not self._items:
                if self._error is not None:
                    raise self._error
                if self._closed:
                    return None
                if not alive():
                    raise CreditShuffleError("the consumer thread ended without handing on the end of its output")
                self._cond.wait(_POLL_S)
            batch = self._items.popleft()
            self._in_flight = 1
            self._in_flight_bytes = batch.nbytes
            return batch


def handed_on(
    outputs: Iterator[pa.RecordBatch],
    on_wait: Callable[[], None],
    on_taken: Callable[[], None],
    name: str,
    join_timeout_s: float = 1.0,
) -> Iterator[pa.RecordBatch]:
    """``outputs`` computed on a thread of its own (``name``), yielded here through an :class:`OutputHandoff`;
    ``on_wait`` / ``on_taken`` bracket that thread's waits for room (its back-pressured time). Closing this
    generator early stops the thread at its next hand-over (joined for up to ``join_timeout_s``: a thread
    blocked on Spark's input cannot be interrupted, and its worker exits after a failure)."""
    handoff = OutputHandoff()
    stop = threading.Event()

    def run() -> None:
        try:
            for batch in outputs:
                handoff.put(batch, stop.is_set, on_wait, on_taken)
            handoff.close(stop.is_set, on_wait, on_taken)
        except BaseException as exc:
            handoff.fail(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        while (batch := handoff.take(thread.is_alive)) is not None:
            yield batch
    finally:
        stop.set()
        thread.join(join_timeout_s)
