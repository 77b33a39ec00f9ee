"""The ``ResultPartitionWriter`` of a pipelined task's RecordWriter: its partition, called under the task's
lock, so that the writer's thread and the I/O thread share the sans-IO partition safely."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ...buffers import Buffer, BufferConsumer
from ...protocol import PipelinedResultPartition

__all__ = ["LockedPartition"]


class LockedPartition:
    """The ``ResultPartitionWriter`` the RecordWriter writes to: the partition, called under the task lock.

    The writer's heavy work (channel selection, grouping, size model) runs outside the lock; only the
    partition calls take it. A recycled segment also records the time of the last progress, which the
    back-pressure timeout is measured from.
    """

    def __init__(self, partition: PipelinedResultPartition, lock: threading.RLock, on_recycle: Callable[[], None]):
        self.partition = partition
        self.num_subpartitions = partition.num_subpartitions
        self._lock = lock
        self._on_recycle = on_recycle

    def request_segment(self, subpartition: int) -> Callable[[], None]:
        with self._lock:
            recycler = self.partition.request_segment(subpartition)
        lock, on_recycle = self._lock, self._on_recycle

        def recycle() -> None:
            with lock:
                recycler()
                on_recycle()

        return recycle

    def add_consumer(self, subpartition: int, consumer: BufferConsumer, partial_record_length: int = 0) -> int:
        """Queue ``consumer``; the subpartition's desired buffer size (debloating)."""
        with self._lock:
            return self.partition.add_consumer(subpartition, consumer, partial_record_length)

    def add_event(self, subpartition: int, buffer: Buffer) -> None:
        with self._lock:
            self.partition.add_event(subpartition, buffer)

    def builder_opened(self, subpartition: int) -> None:
        with self._lock:
            self.partition.builder_opened(subpartition)

    def builder_finished(self, subpartition: int, *, broadcast: bool = False) -> None:
        with self._lock:
            self.partition.builder_finished(subpartition, broadcast=broadcast)

    def flush(self, subpartition: int) -> None:
        with self._lock:
            self.partition.flush(subpartition)

    def flush_all(self) -> None:
        with self._lock:
            self.partition.flush_all()

    def finish(self) -> None:
        with self._lock:
            self.partition.finish()

    def is_available(self) -> bool:
        return self.partition.is_available()
