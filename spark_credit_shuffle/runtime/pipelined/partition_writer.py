"""The ``ResultPartitionWriter`` of a pipelined task's RecordWriter: its partition, written by the task's loop
alone, whose segments mark progress when they come back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ...engine.producer import timed_recycler
from ...protocol import PipelinedResultPartition

__all__ = ["TaskPartitionWriter"]


class TaskPartitionWriter:
    """The ``ResultPartitionWriter`` the RecordWriter writes to: the partition's own methods, called without a
    lock (the task's loop is the only thread that writes and it holds the task's lock for its whole round), and
    segments whose recycling takes the task's lock (a segment may come back from the thread that closes the
    task) and calls ``on_recycle`` with the time the segment was requested (``time.monotonic()``): progress,
    which the back-pressure timeout is measured from, and how long the segment was held.
    """

    def __init__(self, partition: PipelinedResultPartition, lock: threading.RLock, on_recycle: Callable[[float], None]):
        self.partition = partition
        self.num_subpartitions = partition.num_subpartitions
        self._lock = lock
        self._on_recycle = on_recycle
        self.add_consumer = partition.add_consumer
        self.add_event = partition.add_event
        self.builder_opened = partition.builder_opened
        self.builder_finished = partition.builder_finished
        self.flush = partition.flush
        self.flush_all = partition.flush_all
        self.finish = partition.finish
        self.is_available = partition.is_available

    def request_segment(self, subpartition: int) -> Callable[[], None]:
        recycler = self.partition.request_segment(subpartition)
        return timed_recycler(recycler, self._on_recycle, time.monotonic(), self._lock)
