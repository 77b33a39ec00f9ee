"""The writer half of one segment holding Arrow rows (Flink's ``BufferBuilder``) and its consumer.

The :class:`~spark_credit_shuffle.buffers.writer.RecordWriter` appends record-batch slices to the open
builder of a subpartition; the builder's consumer, queued in the subpartition, serialises the rows added
since its last build as one Arrow message when the network takes a slice. The builder is the only state
shared with the consumer side; it takes a lock around its pending rows, so a subpartition may build slices
from another thread while the writer appends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pyarrow as pa

from .buffer import Buffer, BufferConsumer, DataType
from .format import CHUNK_HEADER, FORMAT_VERSION, MAGIC
from .size_model import IpcSizeModel, compact

__all__ = ["APPENDED", "FULL", "BufferBuilder"]

#: What :meth:`BufferBuilder.append_if_fits` did: appended, or appended and nothing more fits.
APPENDED = 1
FULL = 2

_HEADER = CHUNK_HEADER.size
_PACK = CHUNK_HEADER.pack
_EMPTY = b""


class BufferBuilder:
    """The writer half of one segment holding Arrow rows (Flink's ``BufferBuilder``).

    Rows are appended as record-batch slices and serialised lazily: a consumer's ``build()`` (after
    a flush) or :meth:`finish` turns the rows added since the last serialisation into one *chunk*
    (header + Arrow message). ``capacity`` bounds the bytes of all chunks together; ``model``
    serialises the rows. The writer appends rows with the bits and chunk overhead the size model
    gives them, so the open chunk's estimate is known.

    If a chunk turns out larger than the space left (the size model was wrong), the builder
    serialises the longest prefix that fits and keeps the rest as *overflow*, which the writer
    moves to a new builder; a payload never exceeds ``capacity``.
    """

    __slots__ = (
        "_chunks",
        "_finished",
        "_lock",
        "_open_consumers",
        "_outstanding",
        "_overflow",
        "_pending",
        "_pending_bits",
        "_pending_overhead",
        "_readers",
        "_recycler",
        "_written",
        "capacity",
        "model",
    )

    def __init__(self, capacity: int, model: IpcSizeModel, recycler: Callable[[], None] | None = None) -> None:
        self.capacity = capacity
        self.model = model
        self._lock = threading.Lock()
        self._chunks: list[bytes] = []  # a unicast builder empties what its reader built
        self._written = 0
        #: Rows appended since the last serialisation: record-batch slices, or ``(batch, offset, length)`` of
        #: a run appended by :meth:`append_if_fits` (sliced only when serialised: a slice object per run was
        #: most of a partly filled buffer's memory with a few rows per channel).
        self._pending: list[pa.RecordBatch | tuple[pa.RecordBatch, int, int]] = []
        self._pending_bits = 0
        self._pending_overhead = 0
        self._overflow: list[pa.RecordBatch] = []
        self._finished = False
        self._recycler = recycler
        self._open_consumers = 0  # consumers that have not seen the builder finished (or been closed)
        self._readers = 0  # consumers ever made (a broadcast builder's chunks are read by each)
        self._outstanding = 0  # built slices not yet recycled

    # -- writer side ------------------------------------------------------------------------------

    def free_bits(self, overhead: int) -> int:
        """Bits of rows with chunk ``overhead`` the size model lets the writer still append here."""
        with self._lock:
            pending_overhead = self._pending_overhead
            if overhead < pending_overhead:
                overhead = pending_overhead
            return (self.capacity - self._written - overhead) * 8 - self._pending_bits

    @property
    def written(self) -> int:
        """Bytes serialised into the segment so far."""
        return self._written

    @property
    def free_bytes(self) -> int:
        """Bytes not yet taken by serialised chunks (pending rows not counted)."""
        return self.capacity - self._written

    def append(self, rows: pa.RecordBatch, bits: int, overhead: int) -> None:
        """Add ``rows`` to the open chunk; the size model says they cost ``bits`` and ``overhead``."""
        with self._lock:
            self._pending.append(rows)
            self._pending_bits += bits
            if overhead > self._pending_overhead:
                self._pending_overhead = overhead

    def append_if_fits(
        self, batch: pa.RecordBatch, offset: int, length: int, bits: int, overhead: int, min_bits: int
    ) -> int:
        """Append rows ``offset .. offset + length - 1`` of ``batch`` if the size model lets them in (their
        ``bits`` within :meth:`free_bits` of ``overhead``), under one lock: 0 if they do not fit (nothing
        appended, or the builder has overflow to hand on first), :data:`APPENDED`, or :data:`FULL` when
        less than ``min_bits`` (the smallest row) is left, so the writer finishes the builder."""
        with self._lock:
            if self._overflow:
                return 0
            pending_overhead = self._pending_overhead
            if overhead < pending_overhead:
                free = (self.capacity - self._written - pending_overhead) * 8 - self._pending_bits
            else:
                free = (self.capacity - self._written - overhead) * 8 - self._pending_bits
                self._pending_overhead = overhead
            if bits > free:
                if overhead > pending_overhead:
                    self._pending_overhead = pending_overhead
                return 0
            self._pending.append((batch, offset, length))
            self._pending_bits += bits
            return FULL if free - bits < min_bits else APPENDED

    def append_chunk(self, chunk: bytes) -> None:
        """Add a ready chunk (a fragment or an exactly measured message) behind what is written.

        The caller called :meth:`seal` first and checked that it fits in :attr:`free_bytes`.
        """
        with self._lock:
            if self._pending:
                raise RuntimeError("append_chunk with unserialised rows; seal() first")
            if len(chunk) > self.capacity - self._written:
                raise RuntimeError(f"chunk of {len(chunk)} bytes does not fit in {self.capacity - self._written}")
            self._chunks.append(chunk)
            self._written += len(chunk)

    def seal(self) -> None:
        """Serialise the pending rows now (before a ready chunk goes behind them)."""
        with self._lock:
            if self._pending:
                self._materialise()

    def take_overflow(self) -> list[pa.RecordBatch]:
        """Rows a serialisation could not fit; the writer moves them to a new builder."""
        with self._lock:
            rows, self._overflow = self._overflow, []
        return rows

    def finish(self) -> int:
        """Serialise what is pending and mark the segment finished (idempotent); return its bytes."""
        with self._lock:
            if self._pending:
                self._materialise()
            self._finished = True
            recycler = self._take_recycler()
        if recycler is not None:
            recycler()
        return self._written

    def is_finished(self) -> bool:
        return self._finished

    def create_buffer_consumer(self) -> BufferConsumer:
        """A new reader of this segment; a broadcast builder has one per subpartition."""
        with self._lock:
            self._open_consumers += 1
            self._readers += 1
        return _RecordConsumer(self)

    # -- serialisation (lock held) ----------------------------------------------------------------

    def _materialise(self) -> None:
        pending = [p[0].slice(p[1], p[2]) if isinstance(p, tuple) else p for p in self._pending]
        rows = pending[0] if len(pending) == 1 else pa.concat_batches(pending)
        bound = self._pending_overhead + -(-self._pending_bits // 8)
        self._pending = []
        self._pending_bits = 0
        self._pending_overhead = 0
        room = self.capacity - self._written
        model = self.model
        message = model.serialize(rows, bound) if model.has_nested_lists else rows.serialize()
        if _HEADER + message.size <= room:
            self._add_chunk(rows.num_rows, message)
            return
        # The size model under-estimated: keep the longest prefix that fits, hand the rest back.
        rows = compact(rows)  # measure the rows themselves, not buffers they share with others
        lo, hi = 0, rows.num_rows - 1  # the largest k in [lo, hi] whose k rows fit
        best = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            candidate = rows.slice(0, mid).serialize()
            if _HEADER + candidate.size <= room:
                lo, best = mid, candidate
            else:
                hi = mid - 1
        if best is not None:
            self._add_chunk(lo, best)
        self._overflow.append(rows.slice(lo))

    def _add_chunk(self, num_rows: int, message: pa.Buffer) -> None:
        size = message.size
        chunk = b"".join((_PACK(MAGIC, FORMAT_VERSION, 0, num_rows, 0, 1, size, 0), message))
        self._chunks.append(chunk)
        self._written += len(chunk)

    # -- segment release --------------------------------------------------------------------------
    # The segment goes back to its pool once the builder is finished, every consumer has read to
    # the end (or was closed) and every slice built from it was recycled (Flink's reference count
    # on the segment). The counts change under the builder's lock; the pool's recycler is called
    # outside it, so a pool lock held by a poller that builds slices cannot deadlock with it.

    def _take_recycler(self) -> Callable[[], None] | None:
        """The recycler, once, when the segment is free (lock held)."""
        if self._finished and not self._open_consumers and not self._outstanding:
            recycler, self._recycler = self._recycler, None
            return recycler
        return None

    def _slice_returned(self) -> None:
        with self._lock:
            self._outstanding -= 1
            recycler = self._take_recycler()
        if recycler is not None:
            recycler()

    def _consumer_done(self) -> None:
        with self._lock:
            self._open_consumers -= 1
            recycler = self._take_recycler()
        if recycler is not None:
            recycler()


class _RecordConsumer:
    """The reader half of a :class:`BufferBuilder` (Flink's ``BufferConsumer``).

    ``build()`` returns the chunks written since its last call as one buffer: usually one chunk
    (one Arrow message), shared by identity with the other consumers of a broadcast builder.
    As Flink's cached writer position, :meth:`is_finished` reflects the builder's state as of the
    last ``build()``: a consumer is finished once a build saw its builder finished, so a poller
    that checks it after ``build()`` never drops bytes written in between.
    """

    __slots__ = ("_builder", "_done", "_next")

    #: What it holds: always data (events are buffers of their own).
    data_type = DataType.DATA_BUFFER

    def __init__(self, builder: BufferBuilder) -> None:
        self._builder = builder
        self._next = 0
        self._done = False

    def is_finished(self) -> bool:
        return self._done

    def is_data_available(self) -> bool:
        builder = self._builder
        return bool(builder._pending) or len(builder._chunks) > self._next

    def unread_bytes(self) -> int:
        builder = self._builder
        with builder._lock:
            if builder._pending:
                builder._materialise()
            return sum(len(chunk) for chunk in builder._chunks[self._next :])

    def build(self) -> Buffer:
        builder = self._builder
        with builder._lock:
            if builder._pending:
                builder._materialise()
            chunks = builder._chunks
            end = len(chunks)
            start, self._next = self._next, end
            finished = builder._finished
            if start != end:
                builder._outstanding += 1
        if start == end:
            buffer = Buffer(DataType.DATA_BUFFER, _EMPTY)
        else:
            data = chunks[start] if end - start == 1 else b"".join(chunks[start:end])
            buffer = Buffer(DataType.DATA_BUFFER, data, builder._slice_returned)
            if builder._readers == 1:  # its only reader has them now: the open builder need not keep them
                with builder._lock:
                    chunks[start:end] = [_EMPTY] * (end - start)
        if finished and not self._done:
            self._done = True
            builder._consumer_done()
        return buffer

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._builder._consumer_done()
