"""The bounded hand-over of a consumer's output to the Spark task thread that yields it.

A pipelined consumer decodes on its task's loop (a blocking one on a thread of its own, with its chained
operators); the Spark task thread hands whole output batches to Spark. Between the two sits an
:class:`OutputHandoff` of a few batches: when Spark does not take the task's output (the rest of the stage is
slower, or Spark's own buffers towards the next Python step are full), the hand-over fills, the consumer
waits, and that wait is its back-pressured time, as a Flink task whose output buffers are all taken
(``backPressuredTimeMsPerSecond``). While it waits it reads no input: its input buffers stay taken, it
announces no credit, and its producers become back-pressured in turn. The pipelined task's input comes the
other way, from the thread that reads Spark's input to the loop, through an :class:`InputHandoff`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator

import pyarrow as pa

from ..errors import CreditShuffleError

__all__ = [
    "HANDOFF_BATCHES",
    "HANDOFF_BYTES",
    "INPUT_BATCHES",
    "INPUT_LOW_WATER",
    "InputHandoff",
    "OutputHandoff",
    "ThreadClock",
    "handed_on",
]

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

    def __init__(self, capacity: int = HANDOFF_BATCHES, max_bytes: int = HANDOFF_BYTES, *, wake_after: int = 1) -> None:
        if not 1 <= wake_after <= capacity:
            raise ValueError(f"wake_after must be in [1, capacity], got {wake_after} with capacity {capacity}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        #: Batches waiting before :meth:`offer` wakes a waiting taker itself; with fewer, :meth:`wake` does,
        #: or the hand-over once it is full.
        self.wake_after = wake_after
        self._items: deque[pa.RecordBatch] = deque()
        self._in_flight = 0  # a batch yielded to Spark and not yet consumed
        self._held_bytes = 0  # of the batches handed on and not yet taken, the one in flight included
        self._in_flight_bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        #: Runs (on the taking thread; it must not wait) when a batch was taken after an
        #: :meth:`offer` was refused: the offering side may hand on again.
        self.on_room: Callable[[], None] | None = None
        self._wants_room = False
        #: Threads waiting in :meth:`take` (for a batch) and in :meth:`put` or :meth:`close` (for room): a
        #: notification wakes them only (a wakeup that finds no one is a system call for nothing, and on a
        #: virtual machine one that finds a sleeper costs tens of microseconds).
        self._takers_waiting = 0
        self._putters_waiting = 0

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
        self._putters_waiting += 1
        try:
            while full():
                if stopping():
                    raise CreditShuffleError("task stopping: its output is no longer taken")
                self._cond.wait(_POLL_S)
        finally:
            self._putters_waiting -= 1
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
            if self._takers_waiting:
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

    def offer(self, batch: pa.RecordBatch) -> bool:
        """Hand ``batch`` on if there is room, without waiting: False if it is full (then :attr:`on_room`
        runs, on the taking thread, once it has room again). For a producer of batches that must not block:
        the pipelined task's event loop."""
        with self._cond:
            if self._closed:
                raise CreditShuffleError("output handed on after its end")
            if self._full():
                return self._refuse()
            self._items.append(batch)
            self._held_bytes += batch.nbytes
            if self._takers_waiting and len(self._items) >= self.wake_after:
                self._cond.notify_all()
            return True

    def wake(self) -> None:
        """Wake a taker waiting while batches :meth:`offer` handed on wait for it (fewer than
        :attr:`wake_after`)."""
        # without the lock first: a taker waits only while nothing is handed on, and looks under the lock
        # before it waits, so a batch it could miss here is one it finds
        if self._takers_waiting and self._items:
            with self._cond:
                if self._takers_waiting and self._items:
                    self._cond.notify_all()

    def has_room(self) -> bool:
        """Whether :meth:`offer` would take a batch now; if not, :attr:`on_room` runs once it would."""
        # without the lock: only the offering thread fills it, and the taking thread only empties it (see
        # take), so room seen stays room
        if not self._full():
            return True
        with self._cond:
            return not self._full() or self._refuse()

    def _refuse(self) -> bool:
        """Full (lock held): :attr:`on_room` runs once a batch is taken, and a taker still waiting takes what
        waits now (fewer than :attr:`wake_after` batches may, when they fill the bytes). Returns False."""
        self._wants_room = True
        if self._takers_waiting:
            self._cond.notify_all()
        return False

    def end(self) -> None:
        """No more batches, without waiting for them to be taken (:meth:`close` waits)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

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
            if self._putters_waiting:
                self._cond.notify_all()
            if self._wants_room and not self._full() and self.on_room is not None:
                self._wants_room = False
                self.on_room()
            while not self._items:
                if self._error is not None:
                    raise self._error
                if self._closed:
                    return None
                if not alive():
                    raise CreditShuffleError("the thread handing on the output ended without handing on its end")
                self._takers_waiting += 1
                try:
                    self._cond.wait(_POLL_S)
                finally:
                    self._takers_waiting -= 1
            # in flight before it leaves the queue: a look without the lock (has_room) never sees the batch
            # counted nowhere, so the room it sees is room the taking thread does not take back
            self._in_flight = 1
            batch = self._items.popleft()
            self._in_flight_bytes = batch.nbytes
            return batch


#: Input batches read from Spark and not yet taken by the pipelined task's loop. The reading thread is woken to
#: read more once the loop took all but one (:data:`INPUT_LOW_WATER`): one wakeup per three batches, not one per
#: batch, and the loop still finds one ready while the reader refills.
INPUT_BATCHES = 4
INPUT_LOW_WATER = 1


class InputHandoff:
    """The input batches of a pipelined task, from the thread that reads them from Spark to the task's event
    loop, which must not wait: at most ``capacity`` not yet taken, then the end (:meth:`end`). The reading
    thread waits while it is full (the loop takes no input while its output is back-pressured, so neither
    does Spark's reader: Flink's mailbox). A waiting reader is woken once the loop took all but ``low_water``
    of them (it then refills in one go); :attr:`on_item` runs when a batch arrives at an empty hand-over (the
    loop's wakeup: one that still holds a batch is looked at by the loop's next round anyway)."""

    def __init__(self, capacity: int = INPUT_BATCHES, low_water: int = INPUT_LOW_WATER) -> None:
        if not 0 <= low_water < capacity:
            raise ValueError(f"low_water must be in [0, capacity), got {low_water} with capacity {capacity}")
        self.capacity = capacity
        self.low_water = low_water
        self._items: deque[pa.RecordBatch] = deque()
        self._ended = False
        self._cond = threading.Condition()
        self._reader_waiting = False
        self.on_item: Callable[[], None] | None = None

    def put(self, batch: pa.RecordBatch, stopping: Callable[[], bool]) -> None:
        """Hand ``batch`` on, waiting while the hand-over is full; raises :class:`CreditShuffleError` once
        ``stopping()``."""
        with self._cond:
            if len(self._items) >= self.capacity:
                self._reader_waiting = True
                try:
                    while len(self._items) > self.low_water:
                        if stopping():
                            raise CreditShuffleError("task stopping: its input is no longer taken")
                        self._cond.wait(_POLL_S)
                finally:
                    self._reader_waiting = False
            was_empty = not self._items
            self._items.append(batch)
        if was_empty and self.on_item is not None:
            self.on_item()

    def end(self) -> None:
        """The input ended (every batch before it was handed on)."""
        with self._cond:
            self._ended = True
        if self.on_item is not None:
            self.on_item()

    @property
    def is_ended(self) -> bool:
        """Whether every input batch was taken and the input ended."""
        return self._ended and not self._items

    def peek(self) -> pa.RecordBatch | None:
        """The next batch, not taken (None: none now)."""
        items = self._items
        return items[0] if items else None

    def pop(self) -> pa.RecordBatch:
        """Take the next batch (there must be one: :meth:`peek`)."""
        with self._cond:
            batch = self._items.popleft()
            if self._reader_waiting and len(self._items) <= self.low_water:
                self._cond.notify()
            return batch


class ThreadClock:
    """How long one thread spent in one kind of wait (or work), for another thread to read: its total so far,
    the wait going on included (:meth:`total`). The pipelined task's loop splits its own waits with it: its
    producer half starved of input is idle only while the reading thread waits for Spark, its consumer half
    with a full output back-pressured only while Spark holds the output."""

    __slots__ = ("_since", "_total")

    def __init__(self) -> None:
        self._total = 0.0
        self._since: float | None = None

    def begin(self, now: float) -> None:
        if self._since is None:
            self._since = now

    def end(self, now: float) -> None:
        since = self._since
        if since is not None:
            self._total += max(0.0, now - since)
            self._since = None

    def total(self, now: float) -> float:
        total, since = self._total, self._since  # in this order: a wait ended meanwhile is missed, not doubled
        return total + (max(0.0, now - since) if since is not None else 0.0)


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
