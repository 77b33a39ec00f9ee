"""A blocking stage's input from Spark, with the time spent waiting for it counted as idle time."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import pyarrow as pa

from ...engine import TimeAccount

__all__ = ["timed_batches"]


def timed_batches(batches: Iterable[pa.RecordBatch], clock: TimeAccount) -> Iterator[pa.RecordBatch]:
    """``batches``, with the time spent waiting for each one counted as ``clock``'s idle time."""
    iterator = iter(batches)
    while True:
        waited = clock.idle_since = time.monotonic()
        batch = next(iterator, None)
        clock.idle_since = None
        clock.add_idle(time.monotonic() - waited)
        if batch is None:
            return
        yield batch
