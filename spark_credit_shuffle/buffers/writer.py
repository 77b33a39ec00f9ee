"""RecordWriter: Arrow record batches into segment-sized network buffers, with Flink's flush rules.

One :class:`RecordWriter` per producer subtask and output (Flink's ``RecordWriter``). ``emit(batch)`` routes
every row with the channel selector, groups the rows per subpartition (at most one stable ``take``), and
appends each group to the open :class:`BufferBuilder` of its subpartition. As in Flink
(``BufferWritingResultPartition``), a builder is *finished* when the next row does not fit, before an event,
when the writing mode switches between unicast and broadcast, and at ``finish()``; a *flush* hands the consumer
a slice of the open builder without finishing it; with a broadcast selector, broadcast rows are serialised
once into one shared builder whose consumers (one per subpartition) return the same bytes objects, and another
writer's ``broadcast_emit`` copies the rows into every subpartition's own buffers, as Flink's
``ChannelSelectorRecordWriter``.

Per input batch the work is vectorised: one ``take`` groups the rows, the size model's cumulative bits give
every cut, a run of rows that fits its subpartition's open buffer is appended by one builder call, and a run
that fills a fresh segment is serialised straight into a finished buffer, so Python does a few calls per
buffer and Arrow does the rest.

The writer is one Flink class in four modules, split where a reader looks for each part:

- this module: the writer, its counters and the writing of a batch's runs in order (:meth:`RecordWriter.emit`,
  :meth:`RecordWriter.resume`);
- :mod:`.writer_routing`: the channel routing of a batch (grouping its rows by channel, its runs);
- :mod:`.writer_cutting`: the buffer cutting (rows into segments, full segments, spanning rows, the size
  model's corrections);
- :mod:`.writer_events`: events, flushes and the end of input.

The builder (:mod:`spark_credit_shuffle.buffers.builder`) is the only state shared with the consumer side.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from ..config import MIN_SEGMENT_SIZE
from ..errors import ConfigError
from .buffer import Payload
from .builder import FULL as _FULL
from .builder import BufferBuilder
from .format import CHUNK_HEADER, Event, SchemaEvent, encode_event
from .size_model import IpcSizeModel, takes_wrong_rows
from .writer_cutting import ResultPartitionWriter, _NoBuffer, _Span
from .writer_events import WriterEvents
from .writer_routing import (
    BROADCAST,
    CHOOSE,
    PendingWrite,
    channel_runs,
    group_by_channel,
    load_based_runs,
    warm_up_take,
)

if TYPE_CHECKING:
    from ..partitioners import ChannelSelector

__all__ = ["RecordWriter", "ResultPartitionWriter"]


#: Buffer timeout 0 flushes after every record; a record of an Arrow writer is a slice of at most this many
#: rows of one subpartition (Python works per slice, not per row; see docs/network.md on backpressure).
FLUSH_ALWAYS_ROWS = 64


class RecordWriter(WriterEvents):
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
        self._pending: PendingWrite | None = None
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
        warm_up_take()

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
            runs = load_based_runs(cum, n, self.segment_size)
        elif n:
            channels = self.selector.select_channels(batch)
            grouped, counts = group_by_channel(
                batch, channels, self.num_subpartitions, type(self.selector).__name__, self._compact_before_take
            )
            model = self._size_model
            cum = model.cumulative_bits(grouped)
            overhead = model.overhead(grouped)
            runs = channel_runs(counts)
        return self._start(PendingWrite(grouped, cum, overhead, runs))

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
                runs.append((BROADCAST, 0, n))
            else:
                runs.extend((sp, 0, n) for sp in range(self.num_subpartitions))
        return self._start(PendingWrite(batch, cum, overhead, runs))

    def resume(self) -> bool:
        """Write on where :meth:`emit` stopped; True once the whole batch is written."""
        if not self.has_pending_write:
            return True
        return self._drive()

    def _start(self, pending: PendingWrite) -> bool:
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
        bits_at = pending.bits_at() if short else None
        unicast, min_bits, records_out = self._unicast, self._min_row_bits, self._records_out
        if bits_at is not None and pending.resume_row is None and self._broadcast is None and self.interrupt is None:
            self._append_runs(pending, bits_at)
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
            if target == CHOOSE:
                choose = self._choose_channel
                assert choose is not None  # runs to choose are made for a load-based selector only
                target = choose(self.queued_bytes())
                runs[pending.index] = (target, first, hi)
            assert cum is not None  # a batch with rows to write has the size model's numbers
            try:
                if target >= 0 and self._broadcast is not None:
                    self._finish(BROADCAST)  # a switch of writing mode finishes the other mode's buffers
                elif target == BROADCAST:
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

    def _append_runs(self, pending: PendingWrite, bits_at: list[int] | dict[int, int]) -> None:
        """The short path of :meth:`_drive` in one loop: append the pending runs of rows (one subpartition's
        each, in order) to their open buffers while they fit (:meth:`BufferBuilder.append_if_fits`); stop at
        the first run that needs the general path (no open buffer, or it does not fit). The records counted
        per subpartition are added up once for the runs appended (a batch has one run per subpartition)."""
        runs, batch, overhead = pending.runs, pending.batch, pending.overhead
        unicast, min_bits = self._unicast, self._min_row_bits
        start = index = pending.index
        end = len(runs)
        while index < end:
            target, first, hi = runs[index]
            builder = unicast[target] if target >= 0 else None
            if builder is None:
                break
            appended = builder.append_if_fits(
                batch, first, hi - first, bits_at[hi] - bits_at[first], overhead, min_bits
            )
            if not appended:
                break
            if appended == _FULL:
                self._finish(target)
            index += 1
        if index == start:
            return
        self._resume_row = runs[index - 1][2]
        pending.index = index
        if index - start == 1:
            target, first, hi = runs[start]
            self._records_out[target] += hi - first
        else:
            done = np.array(runs[start:index], dtype=np.int64)
            np.add.at(self._records_out, done[:, 0], done[:, 2] - done[:, 1])

    def _stopped(self, stop: _NoBuffer) -> bool:
        if not self.resumable and stop.error is not None:
            raise stop.error
        return False

    # -- internals --------------------------------------------------------------------------------

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


def _empty_row_batch(schema: pa.Schema) -> pa.RecordBatch:
    """One row with the least bytes each column can take (for the size model's minimum row)."""
    arrays = [pa.nulls(1, field.type) for field in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
