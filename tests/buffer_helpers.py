"""An in-memory result partition and small selectors for the buffer tests.

:class:`MemoryPartition` implements the ``ResultPartitionWriter`` contract with a queue of
(consumer, partial record length) per subpartition, polled as Flink's ``PipelinedSubpartition``
polls (build the head, drop it once finished, skip empty slices), with Flink's availability rule
(a flush was requested or a finished element is queued) and a counted segment pool.
"""

from __future__ import annotations

import decimal
import itertools
from collections import deque
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from spark_credit_shuffle.buffers import Buffer, BufferConsumer, DataType, RecordReader
from spark_credit_shuffle.partitioners import ChannelSelector


class MemoryPartition:
    """A pipelined result partition in memory, with a segment pool of ``pool_size`` (None: unbounded)."""

    def __init__(self, num_subpartitions: int, pool_size: int | None = None) -> None:
        self.num_subpartitions = num_subpartitions
        self.pool_size = pool_size
        self.queues: list[deque[tuple[BufferConsumer, int]]] = [deque() for _ in range(num_subpartitions)]
        self.flush_requested = [False] * num_subpartitions
        self.sequence = [0] * num_subpartitions
        self.segments_requested = [0] * num_subpartitions
        self.segments_in_use = 0
        self.max_segments_in_use = 0
        self.partial_lengths: list[list[int]] = [[] for _ in range(num_subpartitions)]
        self.finished = False

    # -- ResultPartitionWriter --

    def request_segment(self, subpartition: int) -> Callable[[], None]:
        self.segments_requested[subpartition] += 1
        self.segments_in_use += 1
        self.max_segments_in_use = max(self.max_segments_in_use, self.segments_in_use)
        returned = []

        def recycle() -> None:
            assert not returned, "segment recycled twice"
            returned.append(True)
            self.segments_in_use -= 1

        return recycle

    def add_consumer(self, subpartition: int, consumer: BufferConsumer, partial_record_length: int = 0) -> None:
        assert not self.finished
        self.queues[subpartition].append((consumer, partial_record_length))
        self.partial_lengths[subpartition].append(partial_record_length)

    def add_event(self, subpartition: int, buffer: Buffer) -> None:
        assert not self.finished
        assert buffer.data_type.is_event
        self.queues[subpartition].append((buffer, 0))

    def flush(self, subpartition: int) -> None:
        queue = self.queues[subpartition]
        if queue:
            self.flush_requested[subpartition] = len(queue) > 1 or queue[0][0].is_data_available()

    def flush_all(self) -> None:
        for sp in range(self.num_subpartitions):
            self.flush(sp)

    def finish(self) -> None:
        for sp in range(self.num_subpartitions):
            self.add_event(sp, Buffer(DataType.END_OF_PARTITION, b""))
        self.finished = True

    def is_available(self) -> bool:
        return self.pool_size is None or self.segments_in_use < self.pool_size

    # -- consumer side --

    def is_readable(self, subpartition: int) -> bool:
        """Flink's availability with credit: a flush was requested or a finished element is queued."""
        queue = self.queues[subpartition]
        if not queue:
            return False
        finished = (1 if queue[0][0].is_finished() else 0) if len(queue) == 1 else len(queue) - 1
        return self.flush_requested[subpartition] or finished > 0

    def poll(self, subpartition: int) -> tuple[Buffer, int] | None:
        """The next non-empty buffer (or event) and its sequence number, as ``pollBuffer``."""
        queue = self.queues[subpartition]
        while queue:
            consumer, _ = queue[0]
            buffer = consumer.build()
            if len(queue) == 1:
                self.flush_requested[subpartition] = False
            finished = consumer.is_finished()
            if finished:
                queue.popleft()
            if buffer.size > 0 or buffer.data_type.is_event:
                sequence = self.sequence[subpartition]
                self.sequence[subpartition] += 1
                return buffer, sequence
            buffer.recycle()
            if not finished:
                return None
        self.flush_requested[subpartition] = False
        return None

    def poll_readable(self, subpartition: int) -> list[tuple[Buffer, int]]:
        """Everything a credit-holding reader gets now (polls while the subpartition is readable)."""
        out = []
        while self.is_readable(subpartition):
            polled = self.poll(subpartition)
            if polled is None:
                break
            out.append(polled)
        return out

    def drain(self, subpartition: int) -> list[tuple[Buffer, int]]:
        """Everything queued, including the unread part of an open buffer."""
        out = []
        while (polled := self.poll(subpartition)) is not None:
            out.append(polled)
        return out


class ArraySelector(ChannelSelector):
    """Routes rows to channels given up front (a list of per-batch channel arrays, consumed in order)."""

    def __init__(self, num_channels: int, channels: list[np.ndarray]) -> None:
        super().__init__(num_channels)
        self._channels = deque(channels)

    def select_channels(self, batch: pa.RecordBatch) -> np.ndarray:
        channels = self._channels.popleft()
        assert len(channels) == batch.num_rows
        return np.asarray(channels, dtype=np.int32)


def read_all(
    buffers: list[tuple[Buffer, int]], schema: pa.Schema | None = None, channel: int = 0
) -> tuple[list[pa.RecordBatch | object], RecordReader]:
    """Feed ``buffers`` to a new reader; return what it produced and the reader."""
    reader = RecordReader(schema, channel)
    out: list[pa.RecordBatch | object] = []
    for buffer, sequence in buffers:
        out.extend(reader.feed(buffer, sequence))
    return out, reader


def rows_of(items: list[pa.RecordBatch | object], schema: pa.Schema) -> pa.Table:
    """The record batches among ``items`` as one table."""
    batches = [item for item in items if isinstance(item, pa.RecordBatch)]
    return pa.Table.from_batches(batches, schema=schema)


# -- random Arrow data --------------------------------------------------------------------------------

_INTS = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]
_PRIMITIVES = [
    *_INTS,
    pa.float32(),
    pa.float64(),
    pa.bool_(),
    pa.null(),
    pa.string(),
    pa.large_string(),
    pa.binary(),
    pa.large_binary(),
    pa.binary(3),
    pa.timestamp("us"),
    pa.timestamp("ns", tz="UTC"),
    pa.date32(),
    pa.decimal128(12, 2),
    pa.decimal256(40, 5),
    pa.uuid(),
    pa.json_(),
]


def type_strategy(max_depth: int = 2):
    """Hypothesis strategy of Arrow types: the primitives above, lists, structs, maps, fixed-size lists."""
    from hypothesis import strategies as st

    base = st.sampled_from(_PRIMITIVES)

    def nested(children):
        return st.one_of(
            children.map(pa.list_),
            children.map(pa.large_list),
            st.tuples(children, st.integers(1, 3)).map(lambda t: pa.list_(t[0], t[1])),
            st.lists(children, min_size=1, max_size=3).map(
                lambda ts: pa.struct([pa.field(f"f{i}", t) for i, t in enumerate(ts)])
            ),
            children.map(lambda t: pa.map_(pa.int32(), t)),
        )

    return st.recursive(base, nested, max_leaves=4 if max_depth else 1)


def schema_strategy(max_fields: int = 4):
    from hypothesis import strategies as st

    return st.lists(type_strategy(), min_size=1, max_size=max_fields).map(
        lambda ts: pa.schema([pa.field(f"c{i}", t) for i, t in enumerate(ts)])
    )


def random_array(
    t: pa.DataType, n: int, rng: np.random.Generator, null_rate: float, big: int = 0, big_rate: float = 0.0
) -> pa.Array:
    """``n`` random values of type ``t``; strings/binaries are short, or ``big`` bytes at ``big_rate``."""
    mask = rng.random(n) < null_rate if null_rate else None
    if isinstance(t, pa.BaseExtensionType):
        storage = random_array(t.storage_type, n, rng, null_rate, big, big_rate)
        return pa.ExtensionArray.from_storage(t, storage)
    if pa.types.is_null(t):
        return pa.nulls(n)
    if pa.types.is_integer(t):
        info = np.iinfo(t.to_pandas_dtype())
        values = rng.integers(info.min, info.max, size=n, dtype=t.to_pandas_dtype(), endpoint=True)
        return pa.array(values, type=t, mask=mask)
    if pa.types.is_floating(t):
        return pa.array(rng.standard_normal(n).astype(t.to_pandas_dtype()), type=t, mask=mask)
    if pa.types.is_boolean(t):
        return pa.array(rng.random(n) < 0.5, type=t, mask=mask)
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        storage = pa.int32() if t.bit_width == 32 else pa.int64()
        return pa.array(rng.integers(0, 20_000, size=n), type=storage, mask=mask).view(t)
    if pa.types.is_decimal(t):
        values = [decimal.Decimal(int(v)).scaleb(-t.scale) for v in rng.integers(-(10**9), 10**9, size=n)]
        return pa.array(values, type=t, mask=mask)
    if pa.types.is_fixed_size_binary(t):
        raw = rng.integers(0, 256, size=n * t.byte_width, dtype=np.uint8).tobytes()
        return pa.array([raw[i * t.byte_width : (i + 1) * t.byte_width] for i in range(n)], type=t, mask=mask)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        lengths = rng.integers(0, 24, size=n)
        if big and big_rate:
            lengths = np.where(rng.random(n) < big_rate, rng.integers(big // 2, big + 1, size=n), lengths)
        alphabet = "abcdefghijklmnopqrstuvwxyzé€0123456789"
        values = []
        for length in lengths.tolist():
            chars = rng.integers(0, len(alphabet), size=min(length, 64))
            text = "".join(alphabet[c] for c in chars.tolist())
            text = (text * (length // max(len(text), 1) + 1))[:length] if length > 64 else text
            values.append(text if pa.types.is_string(t) or pa.types.is_large_string(t) else text.encode())
        return pa.array(values, type=t, mask=mask)
    if pa.types.is_fixed_size_list(t):
        child = random_array(t.value_type, n * t.list_size, rng, null_rate, big, big_rate)
        return pa.FixedSizeListArray.from_arrays(child, t.list_size, mask=pa.array(mask) if mask is not None else None)
    if pa.types.is_map(t):
        lengths = rng.integers(0, 4, size=n)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        keys = random_array(t.key_type, int(offsets[-1]), rng, 0.0)
        items = random_array(t.item_type, int(offsets[-1]), rng, null_rate, big, big_rate)
        validity = pa.array(mask) if mask is not None else None
        return pa.MapArray.from_arrays(pa.array(offsets), keys, items, mask=validity)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        lengths = rng.integers(0, 4, size=n)
        dtype = np.int64 if pa.types.is_large_list(t) else np.int32
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(dtype)
        child = random_array(t.value_type, int(offsets[-1]), rng, null_rate, big, big_rate)
        cls = pa.LargeListArray if pa.types.is_large_list(t) else pa.ListArray
        return cls.from_arrays(pa.array(offsets), child, type=t, mask=pa.array(mask) if mask is not None else None)
    if pa.types.is_struct(t):
        children = [random_array(t.field(i).type, n, rng, null_rate, big, big_rate) for i in range(t.num_fields)]
        return pa.StructArray.from_arrays(children, fields=list(t), mask=pa.array(mask) if mask is not None else None)
    raise AssertionError(f"no generator for {t}")


def random_batch(
    schema: pa.Schema, n: int, seed: int, null_rate: float = 0.2, big: int = 0, big_rate: float = 0.0
) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    arrays = [random_array(field.type, n, rng, null_rate, big, big_rate) for field in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def split_batch(batch: pa.RecordBatch, cuts: list[int]) -> list[pa.RecordBatch]:
    """``batch`` as zero-copy slices cut at ``cuts`` (so most slices have an offset)."""
    bounds = sorted({0, batch.num_rows, *(c % (batch.num_rows + 1) for c in cuts)})
    return [batch.slice(a, b - a) for a, b in itertools.pairwise(bounds)]


class RecordingSelector(ChannelSelector):
    """Wraps a selector and remembers the channels it chose, batch by batch."""

    def __init__(self, inner: ChannelSelector) -> None:
        super().__init__(inner.num_channels)
        self.inner = inner
        self.is_broadcast = inner.is_broadcast
        self.chosen: list[np.ndarray] = []

    def select_channels(self, batch: pa.RecordBatch) -> np.ndarray:
        channels = self.inner.select_channels(batch)
        self.chosen.append(np.asarray(channels).copy())
        return channels
