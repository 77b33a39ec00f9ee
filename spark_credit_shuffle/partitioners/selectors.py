"""Channel selectors: the per-producer, stateful half of a partitioner (Flink's ``ChannelSelector``).

Flink clones the partitioner for every output of every producer subtask, so each producer has its own
round-robin counter and its own random generator. A :class:`ChannelSelector` is that clone. It picks the
subpartition (channel) of every row of a whole Arrow batch at once and carries its state over to the next
batch, so splitting the input into batches never changes the sequence of channels.
"""

from __future__ import annotations

import abc
import inspect
import secrets
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa

from ..errors import PartitionerError
from .javarandom import JavaRandom
from .keygroups import _channels_of_hashes, _hash_codes_u32, check_parallelism

__all__ = [
    "AdaptiveRebalanceSelector",
    "BroadcastSelector",
    "ChannelSelector",
    "ConstantSelector",
    "CustomSelector",
    "KeyGroupSelector",
    "RoundRobinSelector",
    "ShuffleSelector",
    "key_columns",
]

#: What a selector reads: a record batch or a table (pyarrow has no type stubs: both are Any to mypy).
Batch: TypeAlias = "pa.RecordBatch | pa.Table"
Column = str | int


def key_columns(batch: Batch, columns: Sequence[Column]) -> list[pa.Array | pa.ChunkedArray]:
    """The key columns of ``batch``, by name (or by position for an int), with a clear error if one is missing."""
    arrays = []
    names = batch.schema.names
    for column in columns:
        if isinstance(column, int) and not isinstance(column, bool):
            if not -len(names) <= column < len(names):
                raise PartitionerError(f"key position {column} is out of range: the batch has {len(names)} columns")
            arrays.append(batch.column(column))
        elif column in names:
            arrays.append(batch.column(names.index(column)))
        else:
            raise PartitionerError(f"key column {column!r} is not in the batch; its columns are: {', '.join(names)}")
    return arrays


class ChannelSelector(abc.ABC):
    """Picks the subpartition of every row of a batch for one producer subtask; state carries over batches.

    ``num_channels`` is the number of subpartitions of this producer (Flink's ``numberOfChannels``).
    """

    num_channels: int
    is_broadcast: bool = False

    def __init__(self, num_channels: int) -> None:
        if isinstance(num_channels, bool) or not isinstance(num_channels, int) or num_channels < 1:
            raise PartitionerError(f"a channel selector needs num_channels >= 1, got {num_channels!r}")
        self.num_channels = num_channels

    @abc.abstractmethod
    def select_channels(self, batch: Batch) -> np.ndarray:
        """The subpartition index (int32, in ``[0, num_channels)``) of every row of ``batch``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_channels={self.num_channels})"


class KeyGroupSelector(ChannelSelector):
    """Flink's ``KeyGroupStreamPartitioner``: the operator index of each key's key group."""

    def __init__(self, columns: Sequence[Column], num_channels: int, max_parallelism: int, null_keys: str) -> None:
        super().__init__(num_channels)
        self.num_channels, self.max_parallelism = check_parallelism(num_channels, max_parallelism)
        self.columns = tuple(columns)
        self.null_keys = null_keys

    def select_channels(self, batch: Batch) -> np.ndarray:
        arrays = key_columns(batch, self.columns)
        hashes = _hash_codes_u32(arrays, columns=[str(c) for c in self.columns], null_keys=self.null_keys)
        return _channels_of_hashes(hashes, self.num_channels, self.max_parallelism)


class RoundRobinSelector(ChannelSelector):
    """``next = (next + 1) % n; return next``, from a given start.

    Flink's ``RebalancePartitioner`` starts at a random value in ``[0, n)`` (so the first row goes to
    ``(r + 1) % n``); ``RescalePartitioner`` and ``RoundRobinChannelSelector`` start at -1 (first row to 0).
    """

    def __init__(self, num_channels: int, start: int = -1) -> None:
        super().__init__(num_channels)
        self.next_channel = start

    def select_channels(self, batch: Batch) -> np.ndarray:
        rows = batch.num_rows
        first = self.next_channel + 1
        channels = np.arange(first, first + rows, dtype=np.int64)
        np.remainder(channels, self.num_channels, out=channels)
        if rows:
            self.next_channel = int(channels[-1])
        return channels.astype(np.int32)


class AdaptiveRebalanceSelector(RoundRobinSelector):
    """Rebalance that avoids busy channels (Flink 2.x's adaptive, load-based partitioner).

    From the current channel it looks at the next ``max_traverse`` channels and picks the one whose
    subpartition has the fewest bytes queued (the first of them on a tie), so rows flow to consumers that
    keep up instead of piling up behind a slow one. ``is_load_based`` tells the RecordWriter to call
    :meth:`choose_channel` with the queued bytes of every subpartition before each small chunk of rows
    (a quarter of a segment), which is then written to that channel: the decision is per chunk, reading
    the live queues in between, not per row. With equal queues this is round robin over chunks.
    Without queue information (:meth:`select_channels`, e.g. for ``with_channel``) it is plain round robin.
    """

    is_load_based = True

    def __init__(self, num_channels: int, start: int = -1, max_traverse: int = 4) -> None:
        super().__init__(num_channels, start)
        if isinstance(max_traverse, bool) or not isinstance(max_traverse, int) or max_traverse < 1:
            raise PartitionerError(f"max_traverse must be an integer >= 1, got {max_traverse!r}")
        self.max_traverse = min(max_traverse, num_channels)

    def choose_channel(self, queued_bytes: Sequence[int] | np.ndarray) -> int:
        """The least-loaded of the next ``max_traverse`` channels after the current one; it becomes current."""
        n = self.num_channels
        best = (self.next_channel + 1) % n
        best_load = queued_bytes[best]
        for step in range(2, self.max_traverse + 1):
            candidate = (self.next_channel + step) % n
            load = queued_bytes[candidate]
            if load < best_load:
                best, best_load = candidate, load
        self.next_channel = best
        return best

    def __repr__(self) -> str:
        return f"AdaptiveRebalanceSelector(num_channels={self.num_channels}, max_traverse={self.max_traverse})"


class ShuffleSelector(ChannelSelector):
    """Flink's ``ShufflePartitioner``: ``random.nextInt(numberOfChannels)`` per row from this producer's
    ``java.util.Random``, seeded with ``seed`` (from entropy when None), so a seeded selector picks exactly
    the channels Flink's would."""

    def __init__(self, num_channels: int, seed: int | None = None) -> None:
        super().__init__(num_channels)
        self.random = JavaRandom(secrets.randbits(48) if seed is None else seed)

    def select_channels(self, batch: Batch) -> np.ndarray:
        return self.random.next_ints(self.num_channels, batch.num_rows)


class BroadcastSelector(ChannelSelector):
    """Flink's ``BroadcastPartitioner``: every row goes to every channel, so there is nothing to select."""

    is_broadcast = True

    def select_channels(self, batch: Batch) -> np.ndarray:
        raise PartitionerError(
            "Broadcast partitioner does not support select channels: every row goes to all "
            f"{self.num_channels} channels (check is_broadcast and write the batch once for all of them)"
        )


class ConstantSelector(ChannelSelector):
    """Always one channel: Flink's ``ForwardPartitioner`` (one subpartition) and ``GlobalPartitioner``."""

    def __init__(self, num_channels: int, channel: int = 0) -> None:
        super().__init__(num_channels)
        self.channel = channel

    def select_channels(self, batch: Batch) -> np.ndarray:
        return np.full(batch.num_rows, self.channel, dtype=np.int32)


def _takes_two_arguments(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` can be called as ``fn(key, num_partitions)``; a one-argument ``fn(key)`` is accepted too."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: call them as Flink would
        return True
    try:
        signature.bind(None, None)
    except TypeError:
        return False
    return True


class CustomSelector(ChannelSelector):
    """Flink's ``CustomPartitionerWrapper``: a user function picks the channel from the key.

    Vectorised (the default): ``fn(keys, num_partitions)`` gets the key column of the whole batch (a tuple of
    columns for several key columns), as pyarrow arrays or, with ``as_numpy``, numpy arrays, and returns one
    channel per row. Scalar (``vectorized=False``): ``fn(key, num_partitions)`` per row with Python values
    (a tuple for several columns), exactly Flink's ``Partitioner.partition`` — a slower path, one Python call
    per row. A function of one argument is called without ``num_partitions``. Either way every channel must
    be in ``[0, num_partitions)``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        columns: Sequence[Column],
        num_channels: int,
        vectorized: bool = True,
        as_numpy: bool = False,
    ) -> None:
        super().__init__(num_channels)
        self.fn = fn
        self.columns = tuple(columns)
        self.vectorized = vectorized
        self.as_numpy = as_numpy
        self.takes_num_partitions = _takes_two_arguments(fn)

    def _describe_fn(self) -> str:
        return getattr(self.fn, "__qualname__", None) or repr(self.fn)

    def select_channels(self, batch: Batch) -> np.ndarray:
        arrays = key_columns(batch, self.columns)
        rows = batch.num_rows
        n = self.num_channels
        if self.vectorized:
            if self.as_numpy:
                arrays = [a.to_numpy(zero_copy_only=False) for a in arrays]
            keys = arrays[0] if len(arrays) == 1 else tuple(arrays)
            try:
                result = self.fn(keys, n) if self.takes_num_partitions else self.fn(keys)
            except Exception as exc:
                raise self._raised(exc) from exc
            if isinstance(result, (pa.Array, pa.ChunkedArray)):
                if result.null_count:
                    raise PartitionerError(f"custom partitioner {self._describe_fn()} returned null channels")
                result = result.to_numpy(zero_copy_only=False)
            channels = np.asarray(result)
        else:
            values = [a.to_pylist() for a in arrays]
            keys_per_row = values[0] if len(values) == 1 else list(zip(*values, strict=True))
            try:
                fn: Callable[[Any, int], Any] = self.fn if self.takes_num_partitions else lambda key, _: self.fn(key)
                channels = np.fromiter((fn(key, n) for key in keys_per_row), dtype=np.int64, count=rows)
            except (TypeError, ValueError) as exc:
                raise PartitionerError(
                    f"custom partitioner {self._describe_fn()} must return an int channel per key: {exc}"
                ) from exc
            except Exception as exc:
                raise self._raised(exc) from exc
        return self._checked(channels, rows)

    def _raised(self, exc: Exception) -> PartitionerError:
        """The user's function raised: a PartitionerError that says so (the same input raises again, so a
        runtime need not retry it)."""
        if isinstance(exc, PartitionerError):
            return exc
        return PartitionerError(f"custom partitioner {self._describe_fn()} raised {type(exc).__name__}: {exc}")

    def _checked(self, channels: np.ndarray, rows: int) -> np.ndarray:
        name = self._describe_fn()
        if channels.ndim != 1 or len(channels) != rows:
            raise PartitionerError(
                f"custom partitioner {name} returned {channels.shape} channels for a batch of {rows} rows; "
                "it must return one channel per row"
            )
        if rows == 0:
            return np.zeros(0, dtype=np.int32)
        if channels.dtype.kind not in "iu":
            raise PartitionerError(f"custom partitioner {name} returned {channels.dtype} values; channels are integers")
        bad = (channels < 0) | (channels >= self.num_channels)
        if bad.any():
            row = int(np.argmax(bad))
            raise PartitionerError(
                f"custom partitioner {name} returned channel {int(channels[row])} for row {row}; "
                f"channels must be in [0, {self.num_channels})"
            )
        return channels.astype(np.int32, copy=False)
