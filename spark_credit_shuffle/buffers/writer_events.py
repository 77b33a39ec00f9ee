"""The events and flushes of the :class:`~spark_credit_shuffle.buffers.writer.RecordWriter`.

As in Flink (``BufferWritingResultPartition``): an event finishes the open buffers whose data precedes it and
goes in behind them (a checkpoint barrier into every subpartition, also in the middle of a batch a resumable
writer waits in; a latency marker as a record of its subpartition's open buffer); a *flush* hands the consumer
a slice of the open builder without finishing it (the consumer's ``build()`` serialises the rows added since its
last build as one Arrow message, and the writer keeps filling the rest of the same segment); ``finish()`` ends
the input. Flink 1.4's flush, which finished every open buffer, is :meth:`WriterEvents.finish_open_buffers`.
"""

from __future__ import annotations

import contextlib

from ..errors import ConfigError
from .format import (
    CheckpointBarrier,
    EndOfPartition,
    Event,
    LatencyMarker,
    encode_event,
    encode_marker_chunk,
)
from .writer_cutting import BufferCutting, _NoBuffer
from .writer_routing import BROADCAST, PendingWrite

__all__ = ["WriterEvents"]


class WriterEvents(BufferCutting):
    """The RecordWriter's events, flushes and end of input (a base of :class:`RecordWriter`)."""

    # The RecordWriter's state these methods use besides the cutting's (set in RecordWriter.__init__).
    _pending: PendingWrite | None
    _deferred: list[Event]
    _finished: bool

    @property
    def has_pending_write(self) -> bool:
        """The writer stopped at a buffer its partition could not give (in a batch, in a record's fragments
        or rows queued ahead of the next ones) and waits for :meth:`resume`."""
        return self._pending is not None or self._span is not None or bool(self._todo) or bool(self._deferred)

    def _complete_record(self) -> None:
        """Write what a stop left before any new row: the rest of a spanning row, the rows queued for exact
        writing, then the barriers that waited for them."""
        if self._span is not None:
            self._continue_span()
        if self._todo:
            self._drain_todo()
        if self._deferred:
            events, self._deferred = self._deferred, []
            for event in events:
                self._broadcast_now(event)

    def broadcast_event(self, event: Event) -> None:
        """Finish every open buffer, then append ``event`` to every subpartition behind its data.

        A :class:`CheckpointBarrier` may also go in while a resumable writer waits in a batch (Flink injects
        barriers between records): the rows of the batch written so far are before it on their channels,
        the rest after (the batch is grouped by channel, so this cut is per channel, not a prefix of the
        batch). A barrier that comes while a record is not written whole (the fragments of a row larger
        than a segment, rows queued for exact writing) goes out right after that record."""
        self._check_event(event)
        if self._span is not None or self._todo or self._deferred:
            self._deferred.append(event)
            return
        self._broadcast_now(event)

    def _broadcast_now(self, event: Event) -> None:
        try:
            self._finish_all()
        except _NoBuffer:  # finishing a buffer left rows to write and no buffer for them: the event waits
            self._deferred.append(event)
            return
        for sp in range(self.num_subpartitions):
            self.partition.add_event(sp, encode_event(event))
        if self.flush_always:
            self.flush_all()

    def emit_event(self, event: Event, subpartition: int) -> None:
        """Append ``event`` to one subpartition behind its data (e.g. a latency marker to a random channel).

        Finishes that subpartition's open buffer and the broadcast buffer, whose data precedes it.
        """
        self._check_event(event)
        if not 0 <= subpartition < self.num_subpartitions:
            raise ConfigError("subpartition", subpartition, f"an index in [0, {self.num_subpartitions})")
        try:
            if self._broadcast is not None:
                self._finish(BROADCAST)
            if self._unicast[subpartition] is not None:
                self._finish(subpartition)
        except _NoBuffer as stop:
            assert stop.error is not None  # finishing takes the overdraft, never waits for availability
            raise stop.error from None
        self.partition.add_event(subpartition, encode_event(event))
        if self.flush_always:
            self.flush(subpartition)

    def emit_latency_marker(self, marker: LatencyMarker, subpartition: int) -> bool:
        """Write ``marker`` as a record into ``subpartition``'s open buffer, behind its rows (Flink's
        ``randomEmit`` of a ``LatencyMarker``): no buffer is finished, so the marker moves when its buffer
        does (full, flushed by the buffer timeout, or finished by an event or the end).

        A buffer is opened for it if the subpartition has none (a broadcast buffer is finished first: a
        writing-mode switch, as in Flink); a resumable writer whose partition is not available skips the
        marker and returns False, as Flink's source would not emit while back-pressured.
        """
        if self._finished:
            raise RuntimeError("the RecordWriter is finished; no more markers can be written")
        if not isinstance(marker, LatencyMarker):
            raise TypeError(f"emit_latency_marker takes a LatencyMarker, got {type(marker).__name__}")
        if not 0 <= subpartition < self.num_subpartitions:
            raise ConfigError("subpartition", subpartition, f"an index in [0, {self.num_subpartitions})")
        if self.has_pending_write or self._model is None:
            return False  # in the middle of a batch, or before the schema: the marker waits for the next turn
        chunk = encode_marker_chunk(marker)
        try:
            self._ensure_unicast_mode()
            builder = self._unicast[subpartition]
            if builder is not None:
                builder.seal()
                self._drain_overflow(subpartition)
                builder = self._unicast[subpartition]
            if builder is not None and len(chunk) > builder.free_bytes:
                self._finish(subpartition)
                builder = None
            if builder is None:
                builder = self._open(subpartition, gate=True)
        except _NoBuffer:
            return False
        builder.append_chunk(chunk)
        if builder.free_bits(self._model.chunk_overhead) < self._min_row_bits:
            self._finish(subpartition)
        if self.flush_always:
            self.partition.flush(subpartition)
        return True

    def flush(self, subpartition: int) -> None:
        """Make the rows written to ``subpartition`` so far consumable, without finishing its buffer."""
        try:
            self._drain_overflow(subpartition)
            self._drain_overflow(BROADCAST)
        except _NoBuffer:
            pass  # the rest stays queued, ahead of the next rows: the next write or resume() takes it
        self.partition.flush(subpartition)

    def flush_all(self) -> None:
        """:meth:`flush` every subpartition (the output flusher's call on the buffer timeout)."""
        try:
            for sp in range(self.num_subpartitions):
                self._drain_overflow(sp)
            self._drain_overflow(BROADCAST)
        except _NoBuffer:
            pass  # the rest stays queued, ahead of the next rows: the next write or resume() takes it
        self.partition.flush_all()

    def finish_open_buffers(self) -> None:
        """Finish every open buffer now, as Flink 1.4's flush did (before ``BufferConsumer`` let a flush hand
        over a slice and keep writing into the same segment); the simulation's model of that version."""
        # rows a serialisation could not fit stay queued, ahead of the next rows (as in flush_all)
        with contextlib.suppress(_NoBuffer):
            self._finish_all()

    def finish(self) -> None:
        """End of input: finish every buffer, then the partition (which appends end-of-partition)."""
        if self._finished:
            return
        if self._pending is not None:
            raise RuntimeError("the RecordWriter has a batch it could not finish writing: call resume() first")
        try:
            self._complete_record()
            self._finish_all()
        except _NoBuffer as stop:  # only the overdraft's end stops here: finishing never waits for availability
            assert stop.error is not None
            raise stop.error from None
        self._finished = True
        self.partition.finish()

    def _check_event(self, event: Event) -> None:
        if self._finished:
            raise RuntimeError("the RecordWriter is finished; no more events can be written")
        if self.has_pending_write and not isinstance(event, CheckpointBarrier):
            # a barrier goes between two records: a resumable writer stopped only where a new buffer of rows
            # would start, so the rows written so far are before it on their channels and the rest after
            raise RuntimeError("the RecordWriter has a batch it could not finish writing: call resume() first")
        if not isinstance(event, (CheckpointBarrier, LatencyMarker)):
            hint = " (call finish())" if isinstance(event, EndOfPartition) else ""
            raise TypeError(f"cannot write event {event!r}{hint}: allowed are CheckpointBarrier and LatencyMarker")
