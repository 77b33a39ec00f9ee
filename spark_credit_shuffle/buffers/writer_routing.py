"""The channel routing of one batch for the :class:`~spark_credit_shuffle.buffers.writer.RecordWriter`.

The writer turns a batch into *runs*: ``(target, lo, hi)``, rows ``lo .. hi - 1`` of the batch (grouped by
channel) for one subpartition, for the shared broadcast buffer (:data:`BROADCAST`), or for the channel a
load-based selector chooses when the writer reaches the run (:data:`CHOOSE`). Everything here is vectorised:
one ``bincount`` and at most one stable ``take`` per batch (none when the rows already come grouped, as round
robin without a wrap-around does), the runs from the channels that have rows, never a loop over every
subpartition. :class:`PendingWrite` is the batch being written and where the writer stopped in it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .size_model import compact

__all__ = ["BROADCAST", "CHOOSE", "PendingWrite", "channel_runs", "group_by_channel", "load_based_runs"]

#: Target of the shared broadcast builder in the writer's bookkeeping.
BROADCAST = -1
#: A run of rows whose channel a load-based selector chooses when the writer reaches it.
CHOOSE = -2


def group_by_channel(
    batch: pa.RecordBatch, channels: np.ndarray, num_channels: int, selector_name: str, compact_first: bool
) -> tuple[pa.RecordBatch, np.ndarray]:
    """``batch`` with its rows grouped by channel (stable) and the row count of each channel.

    ``channels`` is the selector's channel per row (``selector_name`` names it in errors); ``compact_first``
    copies the batch from offset 0 before a ``take`` (pyarrow's take misreads slices of some types)."""
    n = num_channels
    channels = np.asarray(channels)
    if channels.shape != (batch.num_rows,) or channels.dtype.kind not in "iu":
        raise ValueError(
            f"{selector_name}.select_channels returned {channels.dtype} of shape "
            f"{channels.shape}; expected one integer channel per row ({batch.num_rows})"
        )
    try:
        counts = np.bincount(channels, minlength=n)
    except ValueError:  # negative channel
        counts = np.zeros(0, dtype=np.int64)
    if len(counts) != n:
        raise ValueError(
            f"{selector_name}.select_channels returned channels outside [0, {n}): "
            f"min {int(channels.min())}, max {int(channels.max())}"
        )
    used = counts.nonzero()[0]  # the array methods: numpy's functions add Python wrappers per call, per batch
    if len(used) == 1 or (len(channels) > 1 and bool((channels[1:] >= channels[:-1]).all())):
        # already grouped (one channel, or round robin without a wrap-around): no copy, and the open
        # buffers keep slices of the batch given, not of a copy made per batch
        return batch, counts
    if len(used) <= 8:  # a few channels: one comparison pass each beats a sort
        order = np.concatenate([(channels == c).nonzero()[0] for c in used.tolist()])
    else:
        key_type = np.uint8 if n <= 1 << 8 else np.uint16 if n <= 1 << 16 else np.int32
        order = np.argsort(channels.astype(key_type, copy=False), kind="stable")
    if compact_first:  # a copy from offset 0 first: pyarrow's take misreads such slices
        batch = compact(batch)
    return batch.take(order), counts


def channel_runs(counts: np.ndarray) -> list[tuple[int, int, int]]:
    """The runs of a batch grouped by channel with ``counts`` rows per channel: one per channel that has rows,
    in channel order (O(rows), not O(subpartitions), in Python)."""
    used = counts.nonzero()[0]
    ends = counts[used].cumsum().tolist()
    return list(zip(used.tolist(), [0, *ends[:-1]], ends))


def load_based_runs(cum: np.ndarray, num_rows: int, segment_size: int) -> list[tuple[int, int, int]]:
    """A load-based selector's runs: chunks of about a quarter of a segment (by the size model's cumulative
    bits ``cum``), each written to the channel the selector chooses when the writer reaches it."""
    quarter = segment_size * 2  # bits in a quarter of a segment
    total = int(cum[-1]) - int(cum[0])
    if total > quarter:
        marks = np.arange(int(cum[0]) + quarter, int(cum[0]) + total, quarter)
        cuts = np.unique(np.searchsorted(cum, marks, "left").clip(1, num_rows)).tolist()
    else:
        cuts = []
    runs = []
    lo = 0
    for hi in [*cuts, num_rows]:
        if hi > lo:
            runs.append((CHOOSE, lo, hi))  # the channel is chosen when the chunk is written
            lo = hi
    return runs


class PendingWrite:
    """A batch being written: its rows (grouped by channel), the size model's numbers, the runs of rows
    ``(target, lo, hi)`` and where the writer stopped."""

    __slots__ = ("_bits_at", "batch", "cum", "index", "overhead", "resume_row", "runs")

    def __init__(
        self, batch: pa.RecordBatch, cum: np.ndarray | None, overhead: int, runs: list[tuple[int, int, int]]
    ) -> None:
        self.batch = batch
        self.cum = cum
        self.overhead = overhead
        self.runs = runs
        self.index = 0
        self.resume_row: int | None = None
        self._bits_at: list[int] | dict[int, int] | None = None

    def bits_at(self) -> list[int] | dict[int, int]:
        """The size model's cumulative bits at the runs' bounds as Python ints, indexed by row (one conversion
        per batch, not one per run). A batch with many rows per run gets only its runs' bounds: converting all
        of a 10,000-row batch's numbers took about 120 us, a tenth of a network buffer's budget."""
        if self._bits_at is None:
            cum, runs = self.cum, self.runs
            if cum is None:
                self._bits_at = []
            elif len(cum) <= 2 * len(runs) + 2:
                self._bits_at = cum.tolist()
            else:
                bounds = list({row for _, lo, hi in runs for row in (lo, hi)})
                self._bits_at = dict(zip(bounds, cum[bounds].tolist()))
        return self._bits_at


_take_warm = False


def warm_up_take() -> None:
    """Call ``RecordBatch.take`` once per process, when the first writer is made: pyarrow's first take
    imports pandas, which took 1-3 s inside a Spark task's first ``emit`` on a loaded 2-core machine; there
    it held the producer's writer (and so its checkpoint timer) the whole time."""
    global _take_warm
    if not _take_warm:
        _take_warm = True
        pa.record_batch([pa.array([0])], names=["x"]).take(pa.array([0]))
