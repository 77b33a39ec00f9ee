"""Result partitions: a producer subtask's output, one subpartition per consumer (docs/flink.md, "Result
partitions").

:class:`ResultPartition` holds what Flink's ``ResultPartition`` shares between its kinds: the subpartition
count, the LocalBufferPool, the produce/finish/release states and the ``ResultPartitionWriter`` calls that
look the same. :class:`PipelinedResultPartition` queues its buffers in
:class:`~spark_credit_shuffle.protocol.subpartition.PipelinedSubpartition` s that consumers read while it is
written; :class:`BlockingResultPartition` stores every complete buffer and is read after it finished.
:class:`ResultPartitionManager` finds a partition by id for the server side.

Not thread-safe: callers serialise access (one lock per task in a threaded runtime).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from typing import Protocol

from ..buffers.buffer import Buffer, BufferConsumer, ByteBufferBuilder
from ..buffers.pools import LocalBufferPool, NetworkBufferPool, SegmentRecycler
from ..buffers.sizing import PartitionType, result_partition_pool_size
from ..buffers.writer import ResultPartitionWriter
from ..config import NetworkConfig
from ..errors import PartitionNotFoundError, PartitionStateError
from .subpartition import (
    BufferAvailabilityListener,
    OutputChannelStateWriter,
    PipelinedSubpartition,
    PipelinedSubpartitionView,
    ResultSubpartitionView,
)

__all__ = [
    "PipelinedResultPartition",
    "ResultPartition",
    "ResultPartitionManager",
    "ResultPartitionWriter",
    "ServedPartition",
    "partition_buffer_pool",
]


# -- base -----------------------------------------------------------------------------------------------


def partition_buffer_pool(
    network_pool: NetworkBufferPool,
    num_subpartitions: int,
    config: NetworkConfig,
    partition_type: str,
    *,
    overdraft: bool = True,
) -> LocalBufferPool:
    """The LocalBufferPool of a result partition of ``partition_type``, taken from ``network_pool`` and sized
    as Flink sizes it (:func:`~.sizing.result_partition_pool_size`), with ``max_buffers_per_channel`` per
    subpartition and, if ``overdraft``, the overdraft limit. Raises InsufficientNetworkBuffersError if the
    minimum does not fit."""
    lo, hi = result_partition_pool_size(num_subpartitions, config, partition_type)
    return network_pool.create_buffer_pool(
        lo,
        hi,
        num_subpartitions=num_subpartitions,
        max_buffers_per_channel=config.max_buffers_per_channel,
        max_overdraft_buffers=config.max_overdraft_buffers_per_gate if overdraft else 0,
    )


class ResultPartition:
    """What Flink's ``ResultPartition`` kinds share: N subpartitions written through one LocalBufferPool,
    the produce / finished / released states, and the ``ResultPartitionWriter`` calls that do not depend
    on how a subpartition keeps its buffers. Subclasses implement how buffers are queued or stored."""

    def __init__(self, num_subpartitions: int, buffer_pool: LocalBufferPool, partition_id: int) -> None:
        if num_subpartitions < 1:
            raise ValueError(f"num_subpartitions must be >= 1, got {num_subpartitions}")
        self.num_subpartitions = num_subpartitions
        self.partition_id = partition_id
        self.buffer_pool = buffer_pool
        self.is_finished = False
        self.is_released = False

    def flush(self, subpartition: int) -> None:
        raise NotImplementedError

    def flush_all(self) -> None:
        for subpartition in range(self.num_subpartitions):
            self.flush(subpartition)

    def is_available(self) -> bool:
        """Flink's LocalBufferPool availability: whether a writer may start a new buffer now."""
        return self.buffer_pool.is_available()

    def create_subpartition_view(
        self, subpartition: int, listener: BufferAvailabilityListener
    ) -> ResultSubpartitionView:
        raise NotImplementedError

    def close(self) -> None:
        """The producer is done with the partition."""

    def release(self) -> None:
        """Drop every queued or stored buffer and destroy the pool (segments in use return as they are
        recycled)."""
        if self.is_released:
            return
        self.is_released = True
        self._release_subpartitions()
        self.buffer_pool.lazy_destroy()

    def _release_subpartitions(self) -> None:
        raise NotImplementedError

    def _check_in_produce_state(self) -> None:
        if self.is_finished:
            raise PartitionStateError(f"result partition {self.partition_id} already finished")
        if self.is_released:
            raise PartitionStateError(f"result partition {self.partition_id} is released")

    # -- metrics (docs/flink.md, "Metrics") --

    @property
    def out_pool_usage(self) -> float:
        """Used segments / pool size (above 1.0 when overdrafted)."""
        return self.buffer_pool.usage


# -- pipelined partition --------------------------------------------------------------------------------


class PipelinedResultPartition(ResultPartition):
    """A producer subtask's pipelined output: N subpartitions sharing one LocalBufferPool.

    Implements ``ResultPartitionWriter``. Released (subpartitions dropped, pool destroyed) once every
    subpartition was consumed and the producer called :meth:`close`, as Flink's reference count N + 1.
    """

    def __init__(
        self,
        num_subpartitions: int,
        buffer_pool: LocalBufferPool,
        *,
        partition_id: int = 0,
        receiver_exclusive_buffers: int = 2,
    ) -> None:
        super().__init__(num_subpartitions, buffer_pool, partition_id)
        if len(buffer_pool.subpartition_buffers_count) < num_subpartitions:
            raise ValueError(
                f"buffer pool counts {len(buffer_pool.subpartition_buffers_count)} subpartitions, "
                f"the partition has {num_subpartitions}"
            )
        self.subpartitions = [
            PipelinedSubpartition(i, self, receiver_exclusive_buffers) for i in range(num_subpartitions)
        ]
        #: Each subpartition's queue (its ``_buffers``, never replaced): :meth:`queue_lengths` in one C call.
        self._queues = [sub._buffers for sub in self.subpartitions]
        self._queue_changes: set[int] | None = None
        self._pending_references = num_subpartitions + 1
        self._producer_closed = False
        #: Flink's LocalBufferPool availability (bound to the pool's: a resumable writer asks before every new buffer).
        self.is_available: Callable[[], bool] = buffer_pool.is_available
        self._consumed = [False] * num_subpartitions
        self._all_data_processed = [False] * num_subpartitions
        #: The last checkpoint each subpartition's consumer acknowledged or declined (AcknowledgeCheckpoint).
        self.acknowledged_checkpoints = [0] * num_subpartitions
        self.num_events_out = 0
        self._unicast_builders: list[ByteBufferBuilder | None] = [None] * num_subpartitions
        #: The rest of a record emit_record could not write, and whether part of it went out already.
        self._remainders: list[tuple[bytes, bool] | None] = [None] * num_subpartitions

    @classmethod
    def create(
        cls,
        network_pool: NetworkBufferPool,
        num_subpartitions: int,
        config: NetworkConfig,
        *,
        partition_id: int = 0,
        bounded: bool = True,
    ) -> PipelinedResultPartition:
        """A partition with its LocalBufferPool sized as Flink sizes it (PIPELINED_BOUNDED by default):
        min N + 1, max N * buffers_per_channel + floating_buffers_per_gate, max_buffers_per_channel per
        subpartition and the overdraft limit. Raises InsufficientNetworkBuffersError if the minimum does
        not fit."""
        partition_type = PartitionType.PIPELINED_BOUNDED if bounded else PartitionType.PIPELINED
        pool = partition_buffer_pool(network_pool, num_subpartitions, config, partition_type)
        return cls(
            num_subpartitions,
            pool,
            partition_id=partition_id,
            receiver_exclusive_buffers=config.buffers_per_channel if config.credit_based else 1,
        )

    # -- ResultPartitionWriter --

    def request_segment(self, subpartition: int) -> SegmentRecycler:
        """One segment for a new builder of ``subpartition`` (Flink's ``requestBufferBuilder``): within the pool
        size, else from the overdraft; :class:`NoBufferAvailableError` when neither has one (nothing taken)."""
        if self.is_finished or self.is_released:
            self._check_in_produce_state()
        pool = self.buffer_pool
        if not pool.request_buffer(subpartition):
            pool.request_buffer_or_raise(subpartition)
        return pool.segment_recyclers[subpartition]

    def add_consumer(self, subpartition: int, consumer: BufferConsumer, partial_record_length: int = 0) -> int:
        """Queue ``consumer``; the subpartition's desired buffer size (debloating), as Flink's ``add``."""
        if self.is_finished or self.is_released:
            self._check_in_produce_state()
        return self.subpartitions[subpartition].add(consumer, partial_record_length)

    def builder_opened(self, subpartition: int) -> None:
        """The writer holds an unfinished buffer of ``subpartition`` (see ``LocalBufferPool.builder_opened``)."""
        self.buffer_pool.builder_opened(subpartition)

    def builder_finished(self, subpartition: int, *, broadcast: bool = False) -> None:
        """The writer's open buffer of ``subpartition`` (or, ``broadcast``, the shared buffer of every
        subpartition, counted against subpartition 0) is finished: it counts against the per-channel limit
        again, and a reader may take it."""
        self.buffer_pool.builder_finished(subpartition)
        for sub in self.subpartitions if broadcast else (self.subpartitions[subpartition],):
            sub.notify_tail_finished()

    def emit_record(self, record: bytes | bytearray | memoryview, subpartition: int) -> bool:
        """Append one serialised record to ``subpartition``'s open buffer (Flink's ``emitRecord``); True once it
        is written whole.

        A new buffer is trimmed to the larger of the record and the size the consumer announced
        (``NewBufferSize``); a record longer than the room left spans further buffers, each added with the
        length of the record's part it carries; a buffer left exactly full is finished. The Arrow
        :class:`~spark_credit_shuffle.buffers.RecordWriter` is the writer of exchanges; this raw-bytes path
        serves protocol tests and simulations.

        Sans IO, the call cannot wait for a buffer as Flink's ``requestBufferBuilderBlocking`` does: a record
        that needs a new buffer while the pool is unavailable is not started, and a record whose
        continuation finds no buffer within size + overdraft stops there. Either way the call returns False
        and the partition keeps what is left (a copy); :meth:`resume_record` writes it on once buffers were
        recycled. No other record of that subpartition is taken before.
        """
        self._check_in_produce_state()
        if self._remainders[subpartition] is not None:
            raise PartitionStateError(
                f"subpartition {subpartition} holds the rest of a record it could not write: call resume_record()"
            )
        return self._write_record(subpartition, memoryview(record).cast("B"), False)

    def resume_record(self, subpartition: int) -> bool:
        """Write on the record :meth:`emit_record` stopped in; True once nothing of it is left."""
        remainder = self._remainders[subpartition]
        if remainder is None:
            return True
        self._check_in_produce_state()
        self._remainders[subpartition] = None
        return self._write_record(subpartition, memoryview(remainder[0]), remainder[1])

    def has_pending_record(self, subpartition: int) -> bool:
        """``subpartition`` holds the rest of a record :meth:`emit_record` could not write yet."""
        return self._remainders[subpartition] is not None

    def _write_record(self, subpartition: int, view: memoryview, continuation: bool) -> bool:
        builders = self._unicast_builders
        builder = builders[subpartition]
        pool = self.buffer_pool
        segment_size = pool.network_pool.segment_size
        while True:
            if builder is None:
                if not continuation and not pool.is_available():
                    break  # a new record waits until the pool is available
                if not pool.request_buffer(subpartition):
                    break  # size + overdraft in use, or no network buffer left
                builder = ByteBufferBuilder(segment_size, pool.segment_recyclers[subpartition])
                pool.builder_opened(subpartition)
                builders[subpartition] = builder
                if continuation:
                    taken = builder.append(view)
                    view = view[taken:]
                    desired = self.add_consumer(subpartition, builder.create_buffer_consumer(), taken)
                    builder.trim(max(taken, desired))
                else:
                    desired = self.add_consumer(subpartition, builder.create_buffer_consumer())
                    builder.trim(max(len(view), desired))
                    view = view[builder.append(view) :]
            else:
                view = view[builder.append(view) :]
            continuation = True
            if view or builder.is_full():
                builder.finish()
                self.builder_finished(subpartition)
                builders[subpartition] = builder = None
            if not view:
                return True
        self._remainders[subpartition] = (bytes(view), continuation)
        return False

    def add_event(self, subpartition: int, buffer: Buffer) -> None:
        self._check_in_produce_state()
        self.num_events_out += 1
        self.subpartitions[subpartition].add(buffer)

    def add_priority_event_after_finish(self, subpartition: int, buffer: Buffer) -> bool:
        """Put a priority event (an unaligned checkpoint barrier) into a finished partition's ``subpartition``
        while its reader reads it: ahead of what the reader has not polled yet, END_OF_PARTITION included, or
        behind what it sent, where the consumer's channel puts it ahead of what it has not consumed (a
        consumer that already consumed END_OF_PARTITION drops it); False (nothing added) once the reader
        released the subpartition or the partition was released. As a finished Flink task whose output is
        not fully consumed still takes part in checkpoints (FLIP-147), a finished producer keeps injecting
        barriers, so that a slow consumer's checkpoints complete before it reaches the end."""
        if self.is_released or not self.is_finished:
            return False
        sub = self.subpartitions[subpartition]
        if not sub.has_reader or sub.add(buffer) < 0:
            return False
        self.num_events_out += 1
        return True

    def set_channel_state_writer(self, writer: OutputChannelStateWriter | None) -> None:
        """Where every subpartition's output channel state goes (see :class:`PipelinedSubpartition`)."""
        for subpartition in self.subpartitions:
            subpartition.channel_state_writer = writer

    def aligned_barrier_timeout(self, checkpoint_id: int) -> None:
        """Flink's ``ResultPartition.alignedBarrierTimeout``: each subpartition still holding the timeoutable
        barrier of ``checkpoint_id`` makes it an unaligned priority barrier."""
        if self.is_released:
            return
        for subpartition in self.subpartitions:
            subpartition.aligned_barrier_timeout(checkpoint_id)

    def flush(self, subpartition: int) -> None:
        self.subpartitions[subpartition].flush()

    def finish(self) -> None:
        """END_OF_PARTITION into every subpartition (after finishing the buffers :meth:`emit_record` left open)."""
        self._check_in_produce_state()
        if any(r is not None for r in self._remainders):
            raise PartitionStateError("a record is not written whole yet: call resume_record() before finish()")
        builders = self._unicast_builders
        for i, builder in enumerate(builders):
            if builder is not None:
                builder.finish()
                self.buffer_pool.builder_finished(i)
                builders[i] = None
        for subpartition in self.subpartitions:
            subpartition.finish()
        self.is_finished = True

    # -- lifecycle --

    def create_subpartition_view(
        self, subpartition: int, listener: BufferAvailabilityListener
    ) -> PipelinedSubpartitionView:
        if not 0 <= subpartition < self.num_subpartitions:
            raise PartitionNotFoundError(self.partition_id, subpartition)
        if self.is_released:
            raise PartitionStateError(f"result partition {self.partition_id} is released")
        return self.subpartitions[subpartition].create_read_view(listener)

    def on_consumed_subpartition(self, subpartition: int) -> None:
        if self._consumed[subpartition]:
            return
        self._consumed[subpartition] = True
        self._decrement_references()

    def on_subpartition_all_data_processed(self, subpartition: int) -> None:
        self._all_data_processed[subpartition] = True

    def on_checkpoint_acknowledged(self, subpartition: int, checkpoint_id: int, declined: bool) -> None:
        acknowledged = self.acknowledged_checkpoints
        if checkpoint_id > acknowledged[subpartition]:
            acknowledged[subpartition] = checkpoint_id

    def checkpoint_acknowledged(self, checkpoint_id: int) -> bool:
        """Every consumer ended checkpoint ``checkpoint_id`` (acknowledged or declined it, or a later one), or
        consumed its subpartition to the end: no consumer still aligns it (the condition under which Flink's
        checkpoint coordinator, with one concurrent checkpoint, triggers the next)."""
        consumed = self._consumed
        return all(a >= checkpoint_id or consumed[i] for i, a in enumerate(self.acknowledged_checkpoints))

    @property
    def all_data_processed(self) -> bool:
        """Every consumer acknowledged all user records (AckAllUserRecordsProcessed)."""
        return all(self._all_data_processed)

    def close(self) -> None:
        """The producer is done with the partition; it is released once every subpartition is consumed."""
        if not self._producer_closed:
            self._producer_closed = True
            self._decrement_references()

    def _decrement_references(self) -> None:
        self._pending_references -= 1
        if self._pending_references == 0:
            self.release()

    def _release_subpartitions(self) -> None:
        for subpartition in self.subpartitions:
            subpartition.release()

    # -- metrics (docs/flink.md, "Metrics") --

    def output_queue_length(self) -> int:
        return sum(s.queue_length() for s in self.subpartitions)

    def track_queue_changes(self) -> tuple[set[int], Sequence[Sized]]:
        """(changed, queues): the set of subpartitions whose queue may have changed length since the caller
        last emptied it (each subpartition adds its index on every add, poll, release or barrier timeout) and
        every subpartition's queue (``len`` of one is its ``queue_length()``), so a sampler of the queue lengths
        reads only those that changed. The same set on every call."""
        changed = self._queue_changes
        if changed is None:
            changed = self._queue_changes = set()
            for sub in self.subpartitions:
                sub.queue_changes = changed
        return changed, self._queues

    def queue_lengths(self) -> list[int]:
        """Every subpartition's ``queue_length()``, in order, in one step (a full read: what the producer's
        incremental samples of :meth:`track_queue_changes` must equal)."""
        return list(map(len, self._queues))

    def backlogs(self) -> list[int]:
        """The reported backlog of every subpartition."""
        return [s.get_buffers_in_backlog() for s in self.subpartitions]


class ServedPartition(Protocol):
    """What the manager serves: a partition with an id whose subpartitions are read through views (a
    :class:`ResultPartition`, or the blocking consumer's stored partition)."""

    @property
    def partition_id(self) -> int: ...

    def create_subpartition_view(
        self, subpartition: int, listener: BufferAvailabilityListener
    ) -> ResultSubpartitionView: ...


class ResultPartitionManager:
    """The partitions a producer side serves, by partition id (Flink's ``ResultPartitionManager``).

    A request for a partition not registered yet can wait: :meth:`wait_for` registers a callback that runs
    when it is registered.
    """

    def __init__(self) -> None:
        self._partitions: dict[int, ServedPartition] = {}
        self._waiting: dict[int, list[Callable[[], None]]] = {}

    def register_partition(self, partition: ServedPartition, partition_id: int | None = None) -> None:
        pid = partition.partition_id if partition_id is None else partition_id
        if pid in self._partitions:
            raise PartitionStateError(f"result partition {pid} is already registered")
        self._partitions[pid] = partition
        for callback in self._waiting.pop(pid, []):
            callback()

    def release_partition(self, partition_id: int) -> None:
        partition = self._partitions.pop(partition_id, None)
        if isinstance(partition, ResultPartition):
            partition.release()

    def get_partition(self, partition_id: int) -> ServedPartition | None:
        return self._partitions.get(partition_id)

    def __contains__(self, partition_id: int) -> bool:
        return partition_id in self._partitions

    def create_subpartition_view(
        self, partition_id: int, subpartition: int, listener: BufferAvailabilityListener
    ) -> ResultSubpartitionView:
        partition = self._partitions.get(partition_id)
        if partition is None:
            raise PartitionNotFoundError(partition_id, subpartition)
        return partition.create_subpartition_view(subpartition, listener)

    def wait_for(self, partition_id: int, callback: Callable[[], None]) -> None:
        self._waiting.setdefault(partition_id, []).append(callback)

    def cancel_wait(self, partition_id: int, callback: Callable[[], None]) -> None:
        callbacks = self._waiting.get(partition_id)
        if callbacks and callback in callbacks:
            callbacks.remove(callback)
