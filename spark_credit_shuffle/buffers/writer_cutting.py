"""The buffer cutting of the :class:`~spark_credit_shuffle.buffers.writer.RecordWriter`: rows into segments.

A run of rows for one target (a subpartition, or the shared broadcast buffer) is appended to the target's open
:class:`~spark_credit_shuffle.buffers.builder.BufferBuilder` (Flink's ``BufferBuilder``); a buffer is cut where
the next row would not fit, from the vectorised per-row size model (:class:`~.size_model.IpcSizeModel`), so no
payload ever exceeds the segment. A run of rows that fills a fresh segment is serialised straight into a
finished buffer (no builder object); a row larger than a segment spans several buffers (fragments, starting in
the remaining space of the open builder; continuation builders are queued with ``partial_record_length``);
rows a serialisation could not fit (the size model was wrong) are queued and written exactly. A builder is
*finished* when the next row does not fit, and ``numBuffersOut`` and ``numBytesOut`` count finished builders
(a broadcast builder once per subpartition).

:class:`BufferCutting` holds these methods; the writer's state is the RecordWriter's (its attributes are
declared here for the type checker). A resumable writer stops at the first new buffer its partition cannot
give (:class:`_NoBuffer`), before anything of the rows it was for is written.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Protocol

import numpy as np
import pyarrow as pa

from ..errors import NoBufferAvailableError
from .buffer import Buffer, BufferConsumer, DataType, Payload
from .builder import BufferBuilder
from .format import CHUNK_HEADER, FORMAT_VERSION, MAGIC, pack_chunk_header
from .size_model import IpcSizeModel, compact
from .writer_routing import BROADCAST

__all__ = ["BufferCutting", "ResultPartitionWriter"]

_HEADER = CHUNK_HEADER.size
_PACK = CHUNK_HEADER.pack


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


class BufferCutting:
    """The RecordWriter's cutting of rows into network buffers (a base of :class:`RecordWriter`)."""

    # The RecordWriter's state these methods use (set in RecordWriter.__init__).
    partition: ResultPartitionWriter
    segment_size: int
    num_subpartitions: int
    flush_always: bool
    flush_always_rows: int
    resumable: bool
    _builder_opened: Callable[[int], None] | None
    _builder_finished: Callable[..., None] | None
    _unicast: list[BufferBuilder | None]
    _broadcast: BufferBuilder | None
    _schema_sent: list[bool]
    _schema_payload: Payload
    _model: IpcSizeModel | None
    _min_row_bits: int
    _min_capacity: int
    _desired: list[int]
    _load_based: bool
    _released_log: collections.deque[tuple[int, int]]
    _span: _Span | None
    _todo: collections.deque[tuple[int, pa.RecordBatch]]
    _draining: bool
    _resume_row: int
    _buffers_out: list[int]
    _bytes_out: list[int]

    @property
    def _size_model(self) -> IpcSizeModel:
        """The size model of the writer's schema (set by the schema given, or the first batch)."""
        model = self._model
        if model is None:
            raise RuntimeError("the RecordWriter has no schema yet: it learns it from the first batch")
        return model

    def _flush_target(self, target: int) -> None:
        """Flush ``target``'s open buffer (every subpartition's for the broadcast buffer)."""
        if target >= 0:
            self.partition.flush(target)
        else:
            self.partition.flush_all()

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
            self._finish(BROADCAST)

    def _ensure_broadcast_mode(self) -> None:
        for sp in range(self.num_subpartitions):
            if self._unicast[sp] is not None:
                self._finish(sp)

    def _finish_all(self) -> None:
        self._ensure_broadcast_mode()
        self._finish(BROADCAST)


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
