"""RecordWriter: Arrow record batches into segment-sized network buffers, with Flink's flush rules.

One :class:`RecordWriter` per producer subtask and output. ``emit(batch)`` routes every row with the
channel selector, groups the rows per subpartition (one stable ``take``), and appends each group to
the open :class:`BufferBuilder` of its subpartition. Buffers are cut where the next row would not
fit, from a vectorised per-row size model (:class:`~.size_model.IpcSizeModel`), so no payload ever
exceeds the segment. As in Flink (``BufferWritingResultPartition``):

- a builder is *finished* when the next row does not fit, before an event, when the writing mode
  switches between unicast and broadcast, and at ``finish()``; ``numBuffersOut`` and
  ``numBytesOut`` count finished builders (a broadcast builder counts once per subpartition);
- a *flush* hands the consumer a slice of the open builder without finishing it: the consumer's
  ``build()`` serialises the rows added since its last build as one Arrow message, and the writer
  keeps filling the rest of the same segment;
- a row larger than a segment spans several buffers (fragments), starting in the remaining space
  of the open builder; continuation builders are queued with ``partial_record_length``;
- with a broadcast selector, broadcast rows are serialised once into one shared builder whose
  consumers (one per subpartition) return the same bytes objects; another writer's
  ``broadcast_emit`` copies the rows into every subpartition's own buffers, as Flink's
  ``ChannelSelectorRecordWriter``.

Per input batch the work is vectorised: one ``take`` groups the rows, the size model's cumulative
bits give every cut, and a run of rows that fills a fresh segment is serialised straight into a
finished buffer (no builder object), so Python does a few calls per buffer and Arrow does the rest.

The builder (:mod:`spark_credit_shuffle.buffers.builder`) is the only state shared with the consumer side.
One Flink class, the RecordWriter, with its cutting, flushing, broadcast, spanning and resumable paths, makes
this module longer than the others.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pyarrow as pa

from ..config import MIN_SEGMENT_SIZE
from ..errors import ConfigError, NoBufferAvailableError
from .buffer import Buffer, BufferConsumer, DataType, Payload
from .builder import FULL as _FULL
from .builder import BufferBuilder
from .format import (
    CHUNK_HEADER,
    FORMAT_VERSION,
    MAGIC,
    CheckpointBarrier,
    EndOfPartition,
    Event,
    LatencyMarker,
    SchemaEvent,
    encode_event,
    encode_marker_chunk,
    pack_chunk_header,
)
from .size_model import IpcSizeModel, compact, takes_wrong_rows

if TYPE_CHECKING:
    from ..partitioners import ChannelSelector

__all__ = ["RecordWriter", "ResultPartitionWriter"]


class ResultPartitionWriter(Protocol):
    """The partition as the RecordWriter sees it (Flink's ``ResultPartitionWriter``).

    Owned here, by the writer that calls it; the protocol's result partitions implement it
    (:mod:`spark_credit_shuffle.protocol.partition`), as do the tests' in-memory partitions.
    """

    num_subpartitions: int

    def request_segment(self, subpartition: int) -> Callable[[], None]: ...

    def add_consumer(
        self, subpartition: int, consumer: BufferConsumer, partial_record_length: int = 0
    ) -> int | None: ...

    def add_event(self, subpartition: int, buffer: Buffer) -> None: ...

    def flush(self, subpartition: int) -> None: ...

    def flush_all(self) -> None: ...

    def finish(self) -> None: ...

    def is_available(self) -> bool: ...


_HEADER = CHUNK_HEADER.size
_PACK = CHUNK_HEADER.pack
#: Target of the shared broadcast builder in the writer's bookkeeping.
_BROADCAST = -1
#: A run of rows whose channel a load-based selector chooses when the writer reaches it.
_CHOOSE = -2
#: Buffer timeout 0 flushes after every record; a record of an Arrow writer is a slice of at most this many
#: rows of one subpartition (Python works per slice, not per row; see docs/network.md on backpressure).
FLUSH_ALWAYS_ROWS = 64


class RecordWriter:
    """Writes Arrow record batches of one producer subtask into a result partition.

    ``partition`` is the producer's ``ResultPartitionWriter``, ``selector`` its ``ChannelSelector``
    (a broadcast selector makes every ``emit`` a ``broadcast_emit``, as Flink's
    ``BroadcastRecordWriter``), ``segment_size`` the bytes of one network buffer (at least 4 KiB).
    ``flush_always`` is buffer timeout 0: every ``emit`` ends with ``flush_all()``. With a timeout
    > 0 an output flusher calls :meth:`flush_all`; with -1 only full buffers and events go out.
    ``schema`` fixes the schema; otherwise the first batch's schema is used. Every batch must have
    the same fields.

    Calls to one writer must not overlap: an output flusher's :meth:`flush_all` takes turns with
    ``emit``, as in Flink's mailbox. Only the builders are shared with the threads that poll the
    partition, and they lock what they share.
    """

    def __init__(
        self,
        partition: ResultPartitionWriter,
        selector: ChannelSelector,
        segment_size: int,
        *,
        flush_always: bool = False,
        schema: pa.Schema | None = None,
        resumable: bool = False,
        flush_always_rows: int = FLUSH_ALWAYS_ROWS,
    ) -> None:
        if isinstance(segment_size, bool) or not isinstance(segment_size, int) or segment_size < MIN_SEGMENT_SIZE:
            raise ConfigError("segment_size", segment_size, f"an integer of at least {MIN_SEGMENT_SIZE} bytes")
        n = partition.num_subpartitions
        if selector.num_channels != n:
            raise ConfigError(
                "selector",
                selector,
                f"a channel selector over {n} channels (the partition's subpartitions)",
                f"it selects among {selector.num_channels}",
            )
        self.partition = partition
        self.selector = selector
        self.segment_size = segment_size
        self.flush_always = bool(flush_always)
        if isinstance(flush_always_rows, bool) or not isinstance(flush_always_rows, int) or flush_always_rows < 1:
            raise ConfigError("flush_always_rows", flush_always_rows, "an integer >= 1")
        self.flush_always_rows = flush_always_rows
        self.resumable = bool(resumable)
        #: Asked between two runs of rows of a batch (a subpartition's rows, or a chunk of a load-based
        #: selector's): True stops the write there (``emit`` returns False) so that the caller can do what is
        #: due between two records, such as injecting a checkpoint barrier (Flink's mailbox takes a checkpoint
        #: trigger between two records), and then calls :meth:`resume`.
        self.interrupt: Callable[[], bool] | None = None
        #: The partition's hooks for the buffer a writer holds open (a pipelined partition's per-channel limit).
        self._builder_opened = getattr(partition, "builder_opened", None)
        self._builder_finished = getattr(partition, "builder_finished", None)
        self._pending: _PendingWrite | None = None
        #: A row larger than a segment whose fragments could not all be written yet (see :meth:`_continue_span`).
        self._span: _Span | None = None
        #: Rows to write exactly, in order, ahead of anything else of their target (a builder's overflow).
        self._todo: collections.deque[tuple[int, pa.RecordBatch]] = collections.deque()
        self._draining = False
        #: Barriers that arrived while a record was not written whole; they go out right after it.
        self._deferred: list[Event] = []
        self._resume_row = 0
        self.num_subpartitions = n
        self._unicast: list[BufferBuilder | None] = [None] * n
        self._broadcast: BufferBuilder | None = None
        self._schema_sent = [False] * n
        self._schema: pa.Schema | None = None
        self._model: IpcSizeModel | None = None
        self._compact_before_take = False
        self._schema_payload: Payload = b""
        self._min_row_bits = 1
        self._finished = False
        self._records_out = np.zeros(n, dtype=np.int64)
        self._bytes_out = [0] * n
        self._buffers_out = [0] * n
        # A load-based selector (adaptive rebalance) chooses per chunk from the bytes queued per subpartition:
        # bytes of finished buffers not yet recycled (consumed) plus the open buffer's.
        self._load_based = bool(getattr(selector, "is_load_based", False))
        #: The load-based selector's ``choose_channel(queued_bytes)`` (AdaptiveRebalanceSelector's), else None.
        self._choose_channel: Callable[[np.ndarray], int] | None = (
            getattr(selector, "choose_channel", None) if self._load_based else None
        )
        #: The buffer size each subpartition's consumer asked for (``NewBufferSize``, debloating), as the
        #: partition's ``add`` returns it; the segment size while debloating is off.
        self._desired = [segment_size] * n
        self._min_capacity = segment_size
        self._released_bytes = [0] * n
        self._released_log: collections.deque[tuple[int, int]] = collections.deque()  # appended by recyclers
        if schema is not None:
            self._set_schema(schema)
        _warm_up_take()

    # -- counters (Flink's numRecordsOut, numBytesOut, numBuffersOut, per subpartition) ------------

    @property
    def num_records_out(self) -> list[int]:
        """Rows written to each subpartition (a broadcast row counts once per subpartition)."""
        return [int(v) for v in self._records_out]

    @property
    def num_bytes_out(self) -> list[int]:
        """Bytes of the finished buffers of each subpartition."""
        return list(self._bytes_out)

    @property
    def num_buffers_out(self) -> list[int]:
        """Finished buffers of each subpartition; flush slices and events are not counted."""
        return list(self._buffers_out)

    @property
    def schema(self) -> pa.Schema | None:
        return self._schema

    @property
    def _size_model(self) -> IpcSizeModel:
        """The size model of the writer's schema (set by the schema given, or the first batch)."""
        model = self._model
        if model is None:
            raise RuntimeError("the RecordWriter has no schema yet: it learns it from the first batch")
        return model

    def is_available(self) -> bool:
        """Flink's ``RecordWriter.isAvailable``: the partition's buffer pool has a segment free."""
        return self.partition.is_available()

    # -- writing ----------------------------------------------------------------------------------

    def queued_bytes(self) -> np.ndarray:
        """Bytes written to each subpartition and not yet consumed (Flink's ``getBytesInQueueUnsafe``):
        finished buffers whose segment has not come back, plus the open buffer. Tracked only for a
        load-based selector (zeros otherwise)."""
        log, released = self._released_log, self._released_bytes
        while log:  # recycled on other threads since the last call (deque appends and pops are atomic)
            target, written = log.popleft()
            released[target] += written
        queued = np.asarray(self._bytes_out, dtype=np.int64) - np.asarray(released, dtype=np.int64)
        for sp, builder in enumerate(self._unicast):
            if builder is not None:
                queued[sp] += builder._written + (builder._pending_bits >> 3)
        return queued

    def emit(self, batch: pa.RecordBatch) -> bool:
        """Route every row of ``batch`` with the selector and append it to its subpartition.

        Returns True when every row is written. A ``resumable`` writer stops at the first new buffer its
        partition cannot give (Flink's ``requestBufferBuilderBlocking``, sans IO) and returns False: the
        caller waits until :meth:`is_available` and calls :meth:`resume` for the rest of the batch.
        """
        if self.selector.is_broadcast:
            return self.broadcast_emit(batch)
        self._check_batch(batch)
        n = batch.num_rows
        runs: list[tuple[int, int, int]] = []
        grouped, cum, overhead = batch, None, 0
        if n and self._load_based:
            model = self._size_model
            cum = model.cumulative_bits(batch)
            overhead = model.overhead(batch)
            quarter = self.segment_size * 2  # bits in a quarter of a segment
            total = int(cum[-1]) - int(cum[0])
            if total > quarter:
                marks = np.arange(int(cum[0]) + quarter, int(cum[0]) + total, quarter)
                cuts = np.unique(np.searchsorted(cum, marks, "left").clip(1, n)).tolist()
            else:
                cuts = []
            lo = 0
            for hi in [*cuts, n]:
                if hi > lo:
                    runs.append((_CHOOSE, lo, hi))  # the channel is chosen when the chunk is written
                    lo = hi
        elif n:
            channels = self.selector.select_channels(batch)
            grouped, counts = self._group(batch, channels)
            model = self._size_model
            cum = model.cumulative_bits(grouped)
            overhead = model.overhead(grouped)
            used = np.flatnonzero(counts)  # the channels with rows, in order: O(rows), not O(subpartitions)
            ends = np.cumsum(counts[used]).tolist()
            runs = list(zip(used.tolist(), [0, *ends[:-1]], ends))
        return self._start(_PendingWrite(grouped, cum, overhead, runs))

    def broadcast_emit(self, batch: pa.RecordBatch) -> bool:
        """Append every row of ``batch`` to every subpartition; True once written (see :meth:`emit`).

        With a broadcast selector (Flink's ``BroadcastRecordWriter``) the rows are serialised once into a
        shared buffer whose consumers all read the same bytes. Any other writer is Flink's
        ``ChannelSelectorRecordWriter``, whose ``broadcastEmit`` emits the record to each channel in turn:
        the rows are copied into every subpartition's own buffers, one pool buffer each.
        """
        self._check_batch(batch)
        n = batch.num_rows
        runs: list[tuple[int, int, int]] = []
        cum, overhead = None, 0
        if n:
            model = self._size_model
            cum = model.cumulative_bits(batch)
            overhead = model.overhead(batch)
            if self.selector.is_broadcast:
                runs.append((_BROADCAST, 0, n))
            else:
                runs.extend((sp, 0, n) for sp in range(self.num_subpartitions))
        return self._start(_PendingWrite(batch, cum, overhead, runs))

    def resume(self) -> bool:
        """Write on where :meth:`emit` stopped; True once the whole batch is written."""
        if not self.has_pending_write:
            return True
        return self._drive()

    @property
    def has_pending_write(self) -> bool:
        """The writer stopped at a buffer its partition could not give (in a batch, in a record's fragments
        or rows queued ahead of the next ones) and waits for :meth:`resume`."""
        return self._pending is not None or self._span is not None or bool(self._todo) or bool(self._deferred)

    def _start(self, pending: _PendingWrite) -> bool:
        if self._pending is not None:
            raise RuntimeError("the RecordWriter has a batch it could not finish writing: call resume() first")
        self._pending = pending
        return self._drive()

    def _drive(self) -> bool:
        """Write the pending runs of rows in order; stop (False) at a buffer the partition cannot give.

        What a previous call left (a record's fragments, rows queued for exact writing, barriers behind
        them) goes first. A writer that is not resumable raises :class:`NoBufferAvailableError` where a
        resumable one stops; it keeps where it stopped all the same."""
        try:
            self._complete_record()
        except _NoBuffer as stop:
            return self._stopped(stop)
        pending = self._pending
        if pending is None:
            return True
        runs, batch, cum, overhead = pending.runs, pending.batch, pending.cum, pending.overhead
        flush_always = self.flush_always
        # The short path of the common case, a run of rows that fits in its subpartition's open buffer: one
        # call to the builder, which appends the run if it fits (the general path's cut, from the same bits).
        short = not flush_always and not self._load_based
        bits_at = pending.cum_list() if short else None
        unicast, min_bits, records_out = self._unicast, self._min_row_bits, self._records_out
        while pending.index < len(runs):
            target, first, hi = runs[pending.index]
            if bits_at is not None and pending.resume_row is None and target >= 0 and self._broadcast is None:
                builder = unicast[target]
                if builder is not None:
                    appended = builder.append_if_fits(
                        batch, first, hi - first, bits_at[hi] - bits_at[first], overhead, min_bits
                    )
                    if appended:
                        self._resume_row = hi
                        if appended == _FULL:
                            self._finish(target)
                        records_out[target] += hi - first
                        pending.index += 1
                        interrupt = self.interrupt
                        if interrupt is not None and pending.index < len(runs) and interrupt():
                            return False
                        continue
            lo = first if pending.resume_row is None else pending.resume_row
            if target == _CHOOSE:
                choose = self._choose_channel
                assert choose is not None  # runs to choose are made for a load-based selector only
                target = choose(self.queued_bytes())
                runs[pending.index] = (target, first, hi)
            assert cum is not None  # a batch with rows to write has the size model's numbers
            try:
                if target >= 0 and self._broadcast is not None:
                    self._finish(_BROADCAST)  # a switch of writing mode finishes the other mode's buffers
                elif target == _BROADCAST:
                    self._ensure_broadcast_mode()
                if target >= 0 and not self._load_based and not flush_always:
                    self._write_run(target, batch, lo, hi, cum, overhead)
                else:
                    self._write_rows(target, batch, lo, hi, cum, overhead)
            except _NoBuffer as stop:
                pending.resume_row = self._resume_row
                return self._stopped(stop)
            if target >= 0:
                self._records_out[target] += hi - first
            else:
                self._records_out += hi - first
            pending.index += 1
            pending.resume_row = None
            interrupt = self.interrupt
            if interrupt is not None and pending.index < len(runs) and interrupt():
                return False  # between two runs of rows: the caller does what is due, then resume()
        self._pending = None
        if flush_always:
            self.flush_all()
        return True

    def _stopped(self, stop: _NoBuffer) -> bool:
        if not self.resumable and stop.error is not None:
            raise stop.error
        return False

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
                self._finish(_BROADCAST)
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

    def _flush_target(self, target: int) -> None:
        if target >= 0:
            self.partition.flush(target)
        else:
            self.partition.flush_all()

    def flush(self, subpartition: int) -> None:
        """Make the rows written to ``subpartition`` so far consumable, without finishing its buffer."""
        try:
            self._drain_overflow(subpartition)
            self._drain_overflow(_BROADCAST)
        except _NoBuffer:
            pass  # the rest stays queued, ahead of the next rows: the next write or resume() takes it
        self.partition.flush(subpartition)

    def flush_all(self) -> None:
        """:meth:`flush` every subpartition (the output flusher's call on the buffer timeout)."""
        try:
            for sp in range(self.num_subpartitions):
                self._drain_overflow(sp)
            self._drain_overflow(_BROADCAST)
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

    # -- internals --------------------------------------------------------------------------------

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

    def _check_batch(self, batch: pa.RecordBatch) -> None:
        if self._finished:
            raise RuntimeError("the RecordWriter is finished; no more rows can be written")
        if not isinstance(batch, pa.RecordBatch):
            raise TypeError(f"emit takes a pyarrow.RecordBatch, got {type(batch).__name__}")
        if self._schema is None:
            self._set_schema(batch.schema)
        elif batch.schema is not self._schema and not batch.schema.equals(self._schema):
            raise ValueError(
                f"batch schema differs from the writer's schema:\n{batch.schema}\nexpected:\n{self._schema}"
            )

    def _set_schema(self, schema: pa.Schema) -> None:
        model = IpcSizeModel(schema, self.segment_size)
        fixed = CHUNK_HEADER.size + model.metadata_bytes
        if fixed >= self.segment_size:
            raise ConfigError(
                "segment_size",
                self.segment_size,
                f"more than {fixed} bytes for this schema (the header and Arrow metadata of one buffer of it)",
            )
        self._model = model
        self._min_capacity = min(self.segment_size, 2 * fixed)  # a debloated buffer still holds some rows
        self._schema = schema
        self._compact_before_take = any(takes_wrong_rows(field.type) for field in schema)
        self._schema_payload = encode_event(SchemaEvent(schema)).data
        self._min_row_bits = max(1, int(self._model.cumulative_bits(_empty_row_batch(schema))[-1]))

    def _group(self, batch: pa.RecordBatch, channels: np.ndarray) -> tuple[pa.RecordBatch, np.ndarray]:
        """``batch`` with its rows grouped by channel (stable) and the row count of each channel."""
        n = self.num_subpartitions
        channels = np.asarray(channels)
        if channels.shape != (batch.num_rows,) or channels.dtype.kind not in "iu":
            raise ValueError(
                f"{type(self.selector).__name__}.select_channels returned {channels.dtype} of shape "
                f"{channels.shape}; expected one integer channel per row ({batch.num_rows})"
            )
        try:
            counts = np.bincount(channels, minlength=n)
        except ValueError:  # negative channel
            counts = np.zeros(0, dtype=np.int64)
        if len(counts) != n:
            raise ValueError(
                f"{type(self.selector).__name__}.select_channels returned channels outside [0, {n}): "
                f"min {int(channels.min())}, max {int(channels.max())}"
            )
        used = np.flatnonzero(counts)
        if len(used) == 1 or (len(channels) > 1 and bool((channels[1:] >= channels[:-1]).all())):
            # already grouped (one channel, or round robin without a wrap-around): no copy, and the open
            # buffers keep slices of the batch given, not of a copy made per batch
            return batch, counts
        if len(used) <= 8:  # a few channels: one comparison pass each beats a sort
            order = np.concatenate([np.flatnonzero(channels == c) for c in used.tolist()])
        else:
            key_type = np.uint8 if n <= 1 << 8 else np.uint16 if n <= 1 << 16 else np.int32
            order = np.argsort(channels.astype(key_type, copy=False), kind="stable")
        if self._compact_before_take:  # a copy from offset 0 first: pyarrow's take misreads such slices
            batch = compact(batch)
        return batch.take(order), counts

    def _write_rows(self, target: int, batch: pa.RecordBatch, lo: int, hi: int, cum: np.ndarray, overhead: int) -> None:
        """Append rows ``lo..hi-1`` of ``batch`` to ``target``, cutting buffers where they are full.

        ``cum`` and ``overhead`` are the size model's numbers for ``batch``.
        """
        current = self._unicast if target >= 0 else None
        min_bits = self._min_row_bits
        max_row_bits = (self.segment_size - overhead) * 8
        searchsorted = cum.searchsorted
        item = cum.item
        # timeout 0 flushes after every "record": a slice of at most flush_always_rows rows (docs/network.md)
        step = self.flush_always_rows if self.flush_always else hi
        while lo < hi:
            self._resume_row = lo
            builder = current[target] if current is not None else self._broadcast
            if builder is None:
                builder = self._open(target, gate=True)
            elif builder._overflow:
                self._drain_overflow(target)
                continue
            free = builder.free_bits(overhead)
            base = item(lo)
            end = int(searchsorted(base + free, "right")) - 1  # rows lo..end-1 fit
            stop = min(hi, lo + step)
            if end >= stop:
                bits = item(stop) - base
                builder.append(batch.slice(lo, stop - lo), bits, overhead)
                self._resume_row = stop
                if free - bits < min_bits:  # nothing more fits: it is full
                    self._finish(target)
                elif step < hi:
                    self._flush_target(target)
                lo = stop
                continue
            if end > lo:
                builder.append(batch.slice(lo, end - lo), item(end) - base, overhead)
                lo = end
                self._resume_row = lo
            # row lo does not fit in this builder
            if builder.capacity < self.segment_size and not builder._written and not builder._pending:
                # a debloated buffer grows for a record it cannot hold, to that record's size (Flink trims a
                # new buffer to the larger of the record and the desired size): not to the segment, which the
                # rows behind it would then fill, undoing the debloating
                needed = overhead + -(-(item(lo + 1) - item(lo)) // 8)
                builder.capacity = min(self.segment_size, max(builder.capacity, needed))
                continue
            if item(lo + 1) - item(lo) > max_row_bits:
                if self.resumable and not self.partition.is_available():
                    raise _NoBuffer  # a new record, though it starts in the open buffer: only while available
                try:
                    self._write_spanning(target, batch.slice(lo, 1))
                except _NoBuffer:
                    if self._span is not None:  # its first fragment is written: the rest follows on resume
                        self._resume_row = lo + 1
                    raise
                lo += 1
            else:
                self._finish(target)

    def _write_run(self, sp: int, batch: pa.RecordBatch, lo: int, hi: int, cum: np.ndarray, overhead: int) -> None:
        """:meth:`_write_rows` for one subpartition's run of rows, with a short path for full segments.

        The open builder is topped up and finished as usual; after that, every run of rows that fills
        a fresh segment (and is not followed by a spanning row) is serialised straight into a finished
        buffer, without a builder: the same bytes and the same buffer cuts as a builder would make.
        The rest of the run (the last, partly filled segment, spanning rows) takes the general path.
        """
        builder = self._unicast[sp]
        item = cum.item
        if self._desired[sp] < self.segment_size:  # debloated: buffers are cut smaller, by the general path
            self._write_rows(sp, batch, lo, hi, cum, overhead)
            return
        if builder is not None:
            if builder._overflow:
                self._write_rows(sp, batch, lo, hi, cum, overhead)
                return
            free = builder.free_bits(overhead)
            base = item(lo)
            end = int(cum.searchsorted(base + free, "right")) - 1
            if end >= hi or end <= lo:  # everything fits, or row lo needs the general rules
                self._write_rows(sp, batch, lo, hi, cum, overhead)
                return
            builder.append(batch.slice(lo, end - lo), item(end) - base, overhead)
            lo = end
            self._resume_row = lo
            if builder._overflow or item(lo + 1) - item(lo) > (self.segment_size - overhead) * 8:
                self._write_rows(sp, batch, lo, hi, cum, overhead)  # a spanning row starts in this builder
                return
            self._finish(sp)
        free = (self.segment_size - overhead) * 8  # what a fresh builder takes (BufferBuilder.free_bits)
        searchsorted = cum.searchsorted
        write_full = self._write_full
        while lo < hi:
            base = item(lo)
            end = int(searchsorted(base + free, "right")) - 1
            if end >= hi or end <= lo or item(end + 1) - item(end) > free:
                break  # the last, partly filled segment, or a spanning row: the general path
            self._resume_row = lo
            write_full(sp, batch.slice(lo, end - lo), overhead + -(-(item(end) - base) // 8))
            lo = end
        if lo < hi:
            self._write_rows(sp, batch, lo, hi, cum, overhead)

    def _write_full(self, sp: int, rows: pa.RecordBatch, bound: int) -> None:
        """Queue ``rows``, which the size model says fill a segment, as one finished buffer of ``sp``.

        ``bound`` is the model's bound for their chunk. If Arrow writes more than a segment anyway,
        the rows are written exactly (split until they fit), as a builder's overflow is.
        """
        if self.resumable and not self.partition.is_available():
            raise _NoBuffer
        model = self._size_model
        message = model.serialize(rows, bound) if model.has_nested_lists else rows.serialize()
        size = message.size
        if _HEADER + size > self.segment_size:
            self._todo.append((sp, rows))
            self._resume_row += rows.num_rows  # queued: written from the queue, not again from the batch
            self._drain_todo()
            self._finish(sp)
            return
        chunk = b"".join((_PACK(MAGIC, FORMAT_VERSION, 0, rows.num_rows, 0, 1, size, 0), message))
        partition = self.partition
        try:
            recycler = partition.request_segment(sp)
        except NoBufferAvailableError as error:
            raise _NoBuffer(error) from None
        if not self._schema_sent[sp]:
            self._schema_sent[sp] = True
            partition.add_event(sp, Buffer(DataType.EVENT_BUFFER, self._schema_payload))
        partition.add_consumer(sp, Buffer(DataType.DATA_BUFFER, chunk, recycler), 0)
        self._buffers_out[sp] += 1
        self._bytes_out[sp] += len(chunk)

    def _write_spanning(self, target: int, row: pa.RecordBatch) -> None:
        """Write one row that the size model says is larger than a segment, cut into fragments.

        The row is compacted first: a slice may carry whole small buffers of its batch.
        """
        message = compact(row).serialize()
        builder = self._current(target)
        if builder is not None:
            builder.seal()
            self._drain_overflow(target)
        self._start_span(target, message, gate=True)

    def _start_span(self, target: int, message: pa.Buffer, *, gate: bool) -> None:
        """Write one row's ``message`` behind the open builder of ``target`` (sealed, without overflow): in it
        if it fits, in a segment of its own if that fits, else as fragments (:meth:`_continue_span`).
        ``gate``: the row is a new record (see :meth:`_open`). A stop before the first fragment leaves nothing
        of the row written; after it, :attr:`_span` holds the rest."""
        builder = self._current(target)
        size = _HEADER + message.size
        if builder is not None and size <= builder.free_bytes:
            builder.append_chunk(b"".join((pack_chunk_header(1, message.size), message)))
            return
        if size <= self.segment_size:  # the model was pessimistic: it fits a segment of its own
            if builder is not None:
                self._finish(target)
            builder = self._open(target, gate=gate)
            self._fit(builder, size)
            builder.append_chunk(b"".join((pack_chunk_header(1, message.size), message)))
            return
        # Fragments: the first fills what the open builder has left (if worth a header), the rest
        # take one segment each; piece lengths stay multiples of 8 so messages remain aligned.
        if builder is not None and builder.free_bytes - _HEADER < 8:
            self._finish(target)
            builder = None
        if builder is None:
            builder = self._open(target, gate=gate)
        first = (builder.free_bytes - _HEADER) & ~7
        piece = (self.segment_size - _HEADER) & ~7
        total = message.size
        count = 1 + -(-(total - first) // piece)
        view = memoryview(message)
        builder.append_chunk(b"".join((pack_chunk_header(1, first, 0, count), view[:first])))
        self._span = _Span(target, view, first, count, piece)
        self._finish(target)
        self._continue_span()

    def _continue_span(self) -> None:
        """Write the remaining fragments of :attr:`_span`, one segment each. They are the continuation of a
        record, so they take the pool's overdraft (Flink lets a record being written finish); where even
        that has no segment the writer stops (:class:`_NoBuffer`) and writes on from the same fragment."""
        span = self._span
        assert span is not None
        target, view, total = span.target, span.view, len(span.view)
        while span.index < span.count:
            builder = self._open(target, add=False)
            builder.capacity = self.segment_size  # a fragment takes a whole segment
            length = min(span.piece, total - span.offset)
            offset = span.offset
            chunk = b"".join((pack_chunk_header(1, length, span.index, span.count), view[offset : offset + length]))
            builder.append_chunk(chunk)
            self._add_consumers(target, builder, len(chunk))
            span.offset = offset + length
            span.index += 1
            if span.index < span.count or builder.free_bits(self._size_model.chunk_overhead) < self._min_row_bits:
                self._finish(target)
        self._span = None

    def _drain_todo(self) -> None:
        """Write the rows queued for exact writing (rows a serialisation could not fit: the size model was
        wrong), in order, measuring real sizes and halving until they fit. They are the continuation of
        the record being written and take the overdraft; a stop (:class:`_NoBuffer`) leaves the rest
        queued, ahead of every later row."""
        todo = self._todo
        self._draining = True
        try:
            while todo:
                target, rows = todo[0]
                builder = self._current(target)
                if builder is not None:
                    builder.seal()
                    if builder._overflow:
                        self._finish(target)  # its overflow goes to the head of the queue
                        continue
                rows = compact(rows)
                message = rows.serialize()
                size = _HEADER + message.size
                if size > self.segment_size:
                    todo.popleft()
                    if rows.num_rows > 1:
                        half = rows.num_rows // 2
                        todo.extendleft(((target, rows.slice(half)), (target, rows.slice(0, half))))
                        continue
                    try:
                        self._start_span(target, message, gate=False)
                    except _NoBuffer:
                        if self._span is None:  # nothing of it written
                            todo.appendleft((target, rows))
                        raise
                    continue
                if builder is None or size > builder.free_bytes:
                    if builder is not None:
                        self._finish(target)
                    builder = self._open(target)
                    self._fit(builder, size)
                builder.append_chunk(b"".join((pack_chunk_header(rows.num_rows, message.size), message)))
                todo.popleft()
        finally:
            self._draining = False

    def _drain_overflow(self, target: int) -> None:
        builder = self._current(target)
        if builder is not None and builder._overflow:
            self._finish(target)  # finishing writes the overflow into new builders

    def _current(self, target: int) -> BufferBuilder | None:
        return self._unicast[target] if target >= 0 else self._broadcast

    def _open(self, target: int, add: bool = True, *, gate: bool = False) -> BufferBuilder:
        """Take a segment for ``target`` and open a builder on it (queued unless ``add`` is False).

        ``gate``: the buffer starts a new slice of rows (a new record), so a resumable writer takes it only
        while the partition is available, and otherwise stops (:class:`_NoBuffer`). The continuation of a
        record (a spanning row's fragments, rows a serialisation could not fit) is not gated: it takes the
        pool's overdraft, as Flink lets a record being written finish.
        """
        if gate and self.resumable and not self.partition.is_available():
            raise _NoBuffer
        channel = target if target >= 0 else 0
        try:
            recycler = self.partition.request_segment(channel)
        except NoBufferAvailableError as error:  # size + overdraft in use, or no network buffer left
            raise _NoBuffer(error) from None
        if self._builder_opened is not None:
            self._builder_opened(channel)
        if self._load_based and target >= 0:
            recycler = self._counting_recycler(target, recycler)
        builder = BufferBuilder(self._capacity(target), self._size_model, recycler)
        if isinstance(recycler, _CountingRecycler):
            recycler.builder = builder
        if target >= 0:
            self._unicast[target] = builder
        else:
            self._broadcast = builder
        if add:
            self._add_consumers(target, builder, 0)
        return builder

    def _capacity(self, target: int) -> int:
        """The bytes a new buffer of ``target`` holds: the size its consumer asked for (debloating; the
        smallest over every subpartition for the shared broadcast buffer), at least a few rows' worth,
        at most a segment."""
        desired = self._desired[target] if target >= 0 else min(self._desired)
        return min(self.segment_size, max(desired, self._min_capacity))

    def _fit(self, builder: BufferBuilder, size: int) -> None:
        """An empty debloated ``builder`` grows to a record of ``size`` bytes it cannot hold (Flink trims a new
        buffer to the larger of the record and the desired size)."""
        if size > builder.free_bytes and not builder._written and not builder._pending:
            builder.capacity = min(self.segment_size, size)

    def _counting_recycler(self, target: int, recycler: Callable[[], None]) -> _CountingRecycler:
        """``recycler``, which also logs the builder's bytes as consumed from ``target``."""
        return _CountingRecycler(target, recycler, self._released_log)

    def _add_consumers(self, target: int, builder: BufferBuilder, partial_record_length: int) -> None:
        targets = range(self.num_subpartitions) if target < 0 else (target,)
        for sp in targets:
            if not self._schema_sent[sp]:
                self._schema_sent[sp] = True
                self.partition.add_event(sp, Buffer(DataType.EVENT_BUFFER, self._schema_payload))
            desired = self.partition.add_consumer(sp, builder.create_buffer_consumer(), partial_record_length)
            if type(desired) is int and desired > 0:
                self._desired[sp] = desired

    def _finish(self, target: int) -> None:
        """Finish the open builder of ``target`` and count it.

        Rows it could not fit (overflow) are queued ahead of every other row and written exactly into new
        builders, which are finished as well, so nothing of ``target`` stays open (within a drain of the
        queue, the drain writes them).
        """
        while True:
            if target >= 0:
                builder, self._unicast[target] = self._unicast[target], None
            else:
                builder, self._broadcast = self._broadcast, None
            if builder is None:
                return
            written = builder.finish()
            if self._builder_finished is not None:
                if target >= 0:
                    self._builder_finished(target)
                else:
                    self._builder_finished(0, broadcast=True)
            if target >= 0:
                self._buffers_out[target] += 1
                self._bytes_out[target] += written
            else:
                for sp in range(self.num_subpartitions):
                    self._buffers_out[sp] += 1
                    self._bytes_out[sp] += written
            if not builder._overflow:
                return
            self._todo.extendleft(reversed([(target, rows) for rows in builder.take_overflow()]))
            if self._draining:
                return  # the drain that runs writes them next, ahead of its other rows
            self._drain_todo()

    def _ensure_unicast_mode(self) -> None:
        if self._broadcast is not None:
            self._finish(_BROADCAST)

    def _ensure_broadcast_mode(self) -> None:
        for sp in range(self.num_subpartitions):
            if self._unicast[sp] is not None:
                self._finish(sp)

    def _finish_all(self) -> None:
        self._ensure_broadcast_mode()
        self._finish(_BROADCAST)


class _NoBuffer(Exception):
    """The partition cannot give the next new buffer now: a resumable writer's pool is unavailable for a new
    record, or ``error`` (:class:`NoBufferAvailableError`) says it has none at all. Raised before anything of
    the rows it was for is written; the writer keeps where it stopped."""

    def __init__(self, error: NoBufferAvailableError | None = None) -> None:
        super().__init__()
        self.error = error


class _Span:
    """A row larger than a segment being written as fragments: its message, the next fragment's offset and
    index, the fragment count and the bytes each whole fragment carries."""

    __slots__ = ("count", "index", "offset", "piece", "target", "view")

    def __init__(self, target: int, view: memoryview, offset: int, count: int, piece: int) -> None:
        self.target = target
        self.view = view
        self.offset = offset
        self.index = 1
        self.count = count
        self.piece = piece


class _CountingRecycler:
    """A segment's recycler that also logs the bytes its builder wrote as consumed from ``target`` (for a
    load-based selector); it may run on any thread, the writer adds the log up in ``queued_bytes``."""

    __slots__ = ("builder", "log", "recycler", "target")

    def __init__(self, target: int, recycler: Callable[[], None], log: collections.deque[tuple[int, int]]) -> None:
        self.target = target
        self.recycler = recycler
        self.log = log
        self.builder: BufferBuilder | None = None

    def __call__(self) -> None:
        builder, self.builder = self.builder, None
        if builder is not None:
            self.log.append((self.target, builder._written))
        self.recycler()


class _PendingWrite:
    """A batch being written: its rows (grouped by channel), the size model's numbers, the runs of rows
    ``(target, lo, hi)`` and where the writer stopped."""

    __slots__ = ("_cum_list", "batch", "cum", "index", "overhead", "resume_row", "runs")

    def __init__(
        self, batch: pa.RecordBatch, cum: np.ndarray | None, overhead: int, runs: list[tuple[int, int, int]]
    ) -> None:
        self.batch = batch
        self.cum = cum
        self.overhead = overhead
        self.runs = runs
        self.index = 0
        self.resume_row: int | None = None
        self._cum_list: list[int] | None = None

    def cum_list(self) -> list[int]:
        """The size model's cumulative bits as Python ints (one conversion per batch, not one per run)."""
        if self._cum_list is None:
            self._cum_list = self.cum.tolist() if self.cum is not None else []
        return self._cum_list


_take_warm = False


def _warm_up_take() -> None:
    """Call ``RecordBatch.take`` once per process, when the first writer is made: pyarrow's first take
    imports pandas, which took 1-3 s inside a Spark task's first ``emit`` on a loaded 2-core machine; there
    it held the producer's writer (and so its checkpoint timer) the whole time."""
    global _take_warm
    if not _take_warm:
        _take_warm = True
        pa.record_batch([pa.array([0])], names=["x"]).take(pa.array([0]))


def _empty_row_batch(schema: pa.Schema) -> pa.RecordBatch:
    """One row with the least bytes each column can take (for the size model's minimum row)."""
    arrays = [pa.nulls(1, field.type) for field in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
