"""A simulated producer subtask: records at a rate into a real result partition, blocking per buffer request."""

from __future__ import annotations

import hashlib
import math
import struct

from ..buffers.buffer import ByteBufferBuilder
from ..buffers.format import CheckpointBarrier
from ..protocol.partition import PipelinedResultPartition
from ..runtime.engine import Flusher
from .checkpoints import barrier_buffer
from .clock import Context

__all__ = ["SimulatedProducer"]


class SimulatedProducer:
    """Writes records of ``record_size`` bytes at ``rate`` bytes per virtual second, round robin over its
    subpartitions, in batches of ``batch_records``.

    It blocks per buffer request, as Flink's ``requestBufferBuilderBlocking``: a new record starts in a new
    buffer only while its partition is available; a record that spans buffers takes its continuation
    buffers from the pool's overdraft; a buffer it cannot get stops the batch there, and the producer
    writes on from that point once the pool is available again."""

    def __init__(
        self,
        sim: Context,
        index: int,
        partition: PipelinedResultPartition,
        rate: float,
        total_bytes: float,
        record_size: int,
        batch_records: int,
    ) -> None:
        self.sim = sim
        self.index = index
        self.partition = partition
        self.rate = rate
        self.record_size = record_size
        self.batch_records = batch_records
        self.remaining_records = math.inf if math.isinf(total_bytes) else int(total_bytes // record_size)
        self.n = partition.num_subpartitions
        self.builders: list[ByteBufferBuilder | None] = [None] * self.n
        self.pending: list[tuple[int, memoryview, int]] = []  # (subpartition, bytes left, record offset)
        self.pending_count = 0
        self.digests = [hashlib.blake2b(digest_size=16) for _ in range(self.n)]
        self.bytes_written = [0] * self.n
        self.next_channel = 0
        self.batch_counter = 0
        self.waiting_since: float | None = None
        self.back_pressured_time = 0.0
        self.finished = False
        self.finish_time: float | None = None
        partition.buffer_pool.add_availability_listener(self._on_available)

    def start(self) -> None:
        clock = self.sim.clock
        clock.schedule(0.0, self.emit)
        self.flusher = Flusher(self.sim.settings, clock.now)  # the task engine's flush schedule
        if self.flusher.interval is not None:
            clock.schedule(self.flusher.next_at, self._flush)

    def inject_barrier(self, now: float, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` was triggered at ``now``: open buffers finish, then the barrier goes
        into every subpartition."""
        if self.finished:
            return
        for k, builder in enumerate(self.builders):
            if builder is not None:
                builder.finish()
                self.partition.builder_finished(k)
                self.builders[k] = None
        barrier = CheckpointBarrier(checkpoint_id, round(now * 1000), self.sim.config.checkpoint_options)
        for k in range(self.n):
            self.partition.add_event(k, barrier_buffer(barrier, self.sim.config.credit_based))

    def _flush(self, now: float) -> None:
        if self.finished:
            return
        if self.flusher.due(now):
            self.partition.flush_all()
        self.sim.clock.schedule(self.flusher.next_at, self._flush)

    def _on_available(self) -> None:
        if self.waiting_since is not None and not self.finished:
            now = self.sim.clock.now
            self.back_pressured_time += now - self.waiting_since
            self.waiting_since = None
            self.sim.clock.schedule(now, self.emit)

    def emit(self, now: float) -> None:
        if self.finished or self.waiting_since is not None:
            return
        if self.pending:  # a batch stopped at a buffer it could not get: write on from there
            if not self._write_pending():
                self.waiting_since = now
                return
            self._end_batch(now, self.pending_count)
            return
        if not self.partition.is_available():
            self.waiting_since = now
            return
        count = min(self.batch_records, self.remaining_records)
        count = int(count)
        if count > 0:
            n = self.n
            base, extra = divmod(count, n)
            first = self.next_channel
            for k in range(n):
                records = base + (1 if (k - first) % n < extra else 0)
                if records:
                    data = self._payload(k, records * self.record_size)
                    self.digests[k].update(data)
                    self.bytes_written[k] += len(data)
                    self.pending.append((k, memoryview(data), 0))
            self.next_channel = (first + count) % n
            self.remaining_records -= count
            self.batch_counter += 1
            self.pending_count = count
            if not self._write_pending():
                self.waiting_since = now
                return
        self._end_batch(now, count)

    def _end_batch(self, now: float, count: int) -> None:
        if self.sim.settings.flush_always:
            self.partition.flush_all()
        if self.remaining_records <= 0:
            self._finish(now)
            return
        self.sim.clock.schedule(now + count * self.record_size / self.rate, self.emit)

    def _payload(self, subpartition: int, size: int) -> bytes:
        block = struct.pack(">IIQ", self.index, subpartition, self.batch_counter)
        return (block * (size // len(block) + 1))[:size]

    def _write_pending(self) -> bool:
        """Write the pending bytes in order; False at the first buffer that cannot be had now."""
        while self.pending:
            subpartition, view, offset = self.pending[0]
            written = self._write(subpartition, view, offset)
            if written < len(view):
                self.pending[0] = (subpartition, view[written:], offset + written)
                return False
            self.pending.pop(0)
        return True

    def _write(self, subpartition: int, view: memoryview, offset: int) -> int:
        """Write ``view`` (which starts ``offset`` bytes into its run of records) to ``subpartition``;
        returns the bytes written, fewer when a buffer cannot be had."""
        partition = self.partition
        pool = partition.buffer_pool
        segment_size = self.sim.config.segment_size
        written = 0
        while written < len(view):
            builder = self.builders[subpartition]
            if builder is None:
                if (offset + written) % self.record_size == 0:  # a new record: only while available
                    if not partition.is_available() or not pool.request_buffer(subpartition):
                        return written
                elif not pool.request_buffer(subpartition):  # the rest of a record: the overdraft
                    return written
                builder = ByteBufferBuilder(segment_size, pool.segment_recyclers[subpartition])
                pool.builder_opened(subpartition)
                partition.add_consumer(subpartition, builder.create_buffer_consumer())
                self.builders[subpartition] = builder
            taken = builder.append(bytes(view[written : written + segment_size - builder.written]))
            written += taken
            if builder.is_full():
                builder.finish()
                partition.builder_finished(subpartition)
                self.builders[subpartition] = None
        return written

    def _finish(self, now: float) -> None:
        for k, builder in enumerate(self.builders):
            if builder is not None:
                builder.finish()
                self.partition.buffer_pool.builder_finished(k)
                self.builders[k] = None
        self.partition.finish()
        self.partition.close()
        self.finished = True
        self.finish_time = now
