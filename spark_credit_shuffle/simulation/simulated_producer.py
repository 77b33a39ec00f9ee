"""A simulated producer subtask: the task engine's producer half (:class:`ProducerEngine`) writing Arrow
record batches at a rate into a real result partition, on the virtual clock."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from ..buffers.buffer import Buffer, DataType
from ..buffers.format import CheckpointBarrier
from ..buffers.writer import RecordWriter
from ..engine import Fail, ProducerEngine
from ..engine.producer import timed_recycler
from ..metrics import MetricRow
from ..partitioners.selectors import ChannelSelector, RoundRobinSelector
from ..protocol.partition import PipelinedResultPartition
from .clock import Context

__all__ = ["RECORD_SCHEMA", "SimulatedProducer", "record_payload"]

#: A simulated record: its position in its producer's output (``seq``, which checks order and completeness at
#: the consumer) and a payload that brings the record to about ``record_size`` bytes in a network buffer.
RECORD_SCHEMA = pa.schema([("seq", pa.int64()), ("payload", pa.binary())])
#: The bytes a record takes in a buffer besides its payload: the int64 and the binary column's offset.
RECORD_OVERHEAD = 12


#: The golden ratio's fractional part: row ``i`` of a producer with channel weights draws ``frac(i * PHI)``, an
#: evenly spread sequence in [0, 1), so each channel gets its share of every stretch of rows (no random draw).
_PHI = (5**0.5 - 1) / 2


class _SeqSelector(ChannelSelector):
    """The channel of a simulated record is its ``seq`` modulo the channels: a producer with channel weights
    numbers each channel's records ``channel, channel + n, channel + 2n, ...``, as round robin would, so the
    consumers check order and completeness the same way whatever the weights."""

    def select_channels(self, batch: pa.RecordBatch) -> np.ndarray:
        seq = batch.column(0).to_numpy()
        return np.remainder(seq, self.num_channels).astype(np.int32)


def record_payload(record_size: int, rows: int, fill: int) -> pa.Array:
    """``rows`` payloads of ``record_size - RECORD_OVERHEAD`` bytes (at least 0), built once and sliced per
    batch: one data buffer and one offsets buffer, no Python object per row."""
    size = max(0, record_size - RECORD_OVERHEAD)
    offsets = np.arange(rows + 1, dtype=np.int32) * size
    data = np.full(rows * size, fill % 256, dtype=np.uint8)
    return pa.Array.from_buffers(pa.binary(), rows, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


class _SimulatedPartition:
    """The partition as the producer's RecordWriter sees it: the real partition, with a recycled segment
    recorded as progress (the backpressure wait is measured from it), and, in the model without credits,
    aligned barriers sent as plain events (see :mod:`.checkpoints`)."""

    def __init__(
        self,
        partition: PipelinedResultPartition,
        credit_based: bool,
        on_recycle: Callable[[float], None],
        clock: Callable[[], float],
        finish_on_flush: bool = False,
    ):
        self.partition = partition
        self.num_subpartitions = partition.num_subpartitions
        self._credit_based = credit_based
        self._on_recycle = on_recycle
        self._clock = clock
        #: Flink 1.4's flush (see :class:`SimulatedProducer`): finish the open buffers, then hand them over.
        self.finish_on_flush = finish_on_flush
        self.writer: RecordWriter | None = None
        #: Segments the writer took from the pool so far.
        self.segments_requested = 0

    def flush(self, subpartition: int) -> None:
        if self.finish_on_flush and self.writer is not None:
            self._finish_open_buffers()
        self.partition.flush(subpartition)

    def flush_all(self) -> None:
        if self.finish_on_flush and self.writer is not None:
            self._finish_open_buffers()
        self.partition.flush_all()

    def _finish_open_buffers(self) -> None:
        writer = self.writer
        assert writer is not None
        writer.finish_open_buffers()

    def request_segment(self, subpartition: int) -> Callable[[], None]:
        recycler = self.partition.request_segment(subpartition)
        self.segments_requested += 1
        return timed_recycler(recycler, self._on_recycle, self._clock())

    def add_event(self, subpartition: int, buffer: Buffer) -> None:
        if not self._credit_based and buffer.data_type.is_blocking_upstream:
            buffer = Buffer(DataType.EVENT_BUFFER, buffer.data)
        self.partition.add_event(subpartition, buffer)

    def __getattr__(self, name: str) -> object:  # add_consumer, finish, is_available, builder hooks
        return getattr(self.partition, name)


class SimulatedProducer:
    """Writes records of about ``record_size`` bytes at ``rate`` bytes per virtual second, round robin over its
    subpartitions (``consumers[sp]``: the consumer of subpartition ``sp``), in batches of ``batch_records``,
    through the task engine's producer half.

    The engine decides what happens: its resumable RecordWriter stops at a buffer the pool cannot give
    (Flink's ``requestBufferBuilderBlocking``; a record that spans buffers takes its continuation buffers
    from the overdraft) and the producer writes on from there once the pool is available again; its timer
    flushes (buffer timeout) and sends keep-alives; its backpressure wait fails the run after
    ``buffers_request_timeout_ms`` without a segment coming back.

    ``buffer_cost``: virtual seconds the producer spends on each buffer (or event) it hands to the network, a flushed
    slice as a finished buffer (its Arrow message, the hand-over), on top of ``size / rate`` for the records: the
    next batch starts that much later. ``flush_model="1.4"`` is Flink 1.4's output flusher and notification path: a
    flush *finishes* every open buffer (the serializer's buffer went to the subpartition whole and the next record
    took a new segment, where Flink 1.5's ``BufferConsumer`` hands over a slice and keeps writing into the same
    segment), so every flush costs a segment of the producer's pool until its consumer recycled it; with ``"1.5"``
    (the default) a flush only tells the reader that data is there. Flink 1.4 also woke its network thread for every
    buffer added, where 1.5 wakes it once when a queue becomes non-empty and it then drains the queue: with
    ``"1.4"`` every buffer handed over costs ``notification_cost`` more. ``weights``: the share of the records
    each subpartition gets (a keyed exchange's skew), drawn row by row from an evenly spread sequence; default
    round robin. ``start_at``: the virtual time the subtask starts (a real run's subtasks start one after the
    other as Spark schedules them and starts their Python workers)."""

    def __init__(
        self,
        sim: Context,
        index: int,
        partition: PipelinedResultPartition,
        consumers: list[int],
        rate: float,
        total_bytes: float,
        record_size: int,
        batch_records: int,
        buffer_cost: float = 0.0,
        flush_model: str = "1.5",
        notification_cost: float = 0.0,
        weights: list[float] | None = None,
        threading: str = "loop",
        start_at: float = 0.0,
    ) -> None:
        self.sim = sim
        self.threading = threading
        #: When the subtask starts writing (virtual seconds): its time accounts and flusher start then.
        self.start_at = start_at
        # per buffer handed over ("loop") or segment filled ("netty"); Flink 1.4 woke the network thread for every
        # buffer added, 1.5 when a queue becomes non-empty: with Flink's threads, per notification its flushes raise
        self.buffer_cost = buffer_cost + (notification_cost if flush_model == "1.4" else 0.0)
        self.notification_cost = notification_cost if threading == "netty" and flush_model == "1.5" else 0.0
        self._segments_counted = 0
        self._notifications_counted = 0
        self._buffers_counted = 0
        self._debt = 0.0  # buffer costs of timer flushes, paid before the next batch
        self.index = index
        self.partition = partition
        self.rate = rate
        self.record_size = record_size
        self.batch_records = batch_records
        self.remaining_records = math.inf if math.isinf(total_bytes) else int(total_bytes // record_size)
        self.n = partition.num_subpartitions
        self.payload = record_payload(record_size, batch_records, index)
        self.next_seq = 0
        #: With channel weights: their cumulative shares, the rows drawn so far and each channel's records.
        self._cumulative: np.ndarray | None = None
        if weights is not None:
            shares = np.asarray(weights, dtype=np.float64)
            self._cumulative = np.cumsum(shares / shares.sum())
            self._drawn = 0
            self._per_channel = np.zeros(self.n, dtype=np.int64)
        self.pending_count = 0
        self.progress_at = start_at
        self.finished = False
        self.finish_time: float | None = None
        self._timer: int | None = None
        self._wait_check: int | None = None
        writer_partition = _SimulatedPartition(
            partition,
            sim.config.credit_based,
            self._recycled,
            lambda: sim.clock.now,
            finish_on_flush=flush_model == "1.4",
        )
        self.engine = ProducerEngine(
            index,
            partition,
            RoundRobinSelector(self.n) if weights is None else _SeqSelector(self.n),  # seq % n: the channel
            consumers,
            sim.settings,
            sim.config.segment_size,
            RECORD_SCHEMA,
            start_at,
            partition_writer=writer_partition,
            resumable=True,
        )
        writer_partition.writer = self.engine.writer
        self._writer_partition = writer_partition
        partition.buffer_pool.add_availability_listener(self._on_available)

    @property
    def waiting_since(self) -> float | None:
        return self.engine.waiting_since

    @property
    def back_pressured_time(self) -> float:
        return self.engine.time.back_pressured

    @property
    def records_written(self) -> list[int]:
        return self.engine.writer.num_records_out

    @property
    def bytes_written(self) -> list[int]:
        """Bytes of the finished buffers of each subpartition (numBytesOut)."""
        return self.engine.writer.num_bytes_out

    def start(self) -> None:
        self.sim.clock.schedule(self.start_at, self.emit)
        self._schedule_timer()

    def _schedule_timer(self) -> None:
        at = self.engine.next_timer()
        self._timer = self.sim.clock.schedule(at, self._on_timer) if math.isfinite(at) else None

    def _on_timer(self, now: float) -> None:
        """The engine's timer: the flusher (buffer timeout > 0) and keep-alives."""
        self._timer = None
        if not self.finished:
            self.engine.on_timer(now, round(now * 1e9))
            if self.threading == "netty":
                if self.notification_cost:
                    self._new_notifications()  # the output flusher's own thread raised them: not the task's
            elif self.buffer_cost:
                self._debt += self._new_buffers() * self.buffer_cost
            self._schedule_timer()

    def _new_buffers(self) -> int:
        """Buffers and events its subpartitions handed to the network since the last call (their sequence
        numbers): what ``buffer_cost`` is paid for, a flushed slice as a finished buffer."""
        total = sum(sub._sequence_number for sub in self.partition.subpartitions)
        new, self._buffers_counted = total - self._buffers_counted, total
        return new

    def _new_segments(self) -> int:
        """Segments the writer took since the last call."""
        total = self._writer_partition.segments_requested
        new, self._segments_counted = total - self._segments_counted, total
        return new

    def _new_notifications(self) -> int:
        """Data-available notifications its flushes gave the readers since the last call."""
        total = sum(sub.flush_notifications for sub in self.partition.subpartitions)
        new, self._notifications_counted = total - self._notifications_counted, total
        return new

    def inject_barrier(self, now: float, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` was triggered at ``now``: open buffers finish, then the barrier goes
        into every subpartition (also in the middle of a batch the writer waits in)."""
        if not self.finished:
            options = self.sim.config.checkpoint_options
            self.engine.writer.broadcast_event(CheckpointBarrier(checkpoint_id, round(now * 1000), options))

    def _recycled(self, requested: float) -> None:
        now = self.progress_at = self.sim.clock.now
        self.engine.segment_returned(now - requested)

    def _on_available(self) -> None:
        if self.engine.waiting_since is not None and not self.finished:
            now = self.sim.clock.now
            self.engine.end_wait(now)
            self.sim.clock.cancel(self._wait_check)
            self._wait_check = None
            self.sim.clock.schedule(now, self.emit)

    def _wait(self, now: float, *, hard: bool = False) -> None:
        """Back-pressured from ``now``: before the next batch (soft) or, ``hard``, in the middle of one."""
        self.engine.begin_wait(now, hard=hard)
        self._check_wait(now)

    def _check_wait(self, now: float) -> None:
        """The engine's backpressure wait: wake up at its deadline, or fail with its error."""
        self._wait_check = None
        if self.engine.waiting_since is None or self.finished:
            return
        step = self.engine.check_wait(now, self.progress_at, self._describe_wait)
        if isinstance(step, Fail):
            raise step.error
        self._wait_check = self.sim.clock.schedule(step.until, self._check_wait)

    def _describe_wait(self, waited: float) -> str:
        pool = self.partition.buffer_pool
        return (
            f"producer subtask {self.index} waited {waited * 1000:.0f} ms of virtual time for a network buffer "
            f"(buffers_request_timeout_ms={self.sim.config.buffers_request_timeout_ms}): {pool.num_used} of its "
            f"pool's {pool.current_pool_size} buffers are with consumers that do not recycle them"
        )

    def emit(self, now: float) -> None:
        engine = self.engine
        if self.finished or engine.waiting_since is not None:
            return
        if engine.writer.has_pending_write:  # a batch stopped at a buffer it could not get: write on from there
            if not engine.resume():
                self._wait(now, hard=True)
                return
            self._end_batch(now, self.pending_count)
            return
        if not engine.is_available():
            self._wait(now)
            return
        count = int(min(self.batch_records, self.remaining_records))
        if count > 0:
            seq = pa.array(self._sequence(count))
            batch = pa.RecordBatch.from_arrays([seq, self.payload.slice(0, count)], schema=RECORD_SCHEMA)
            self.next_seq += count
            self.remaining_records -= count
            self.pending_count = count
            if not engine.write(batch):
                self._wait(now, hard=True)  # in the middle of a batch: hard back-pressure
                return
        self._end_batch(now, count)

    def _sequence(self, count: int) -> np.ndarray:
        """The ``seq`` of the next ``count`` records: consecutive (round robin), or with channel weights each
        record's channel drawn by its share and numbered within its channel (see :class:`_SeqSelector`)."""
        cumulative = self._cumulative
        if cumulative is None:
            return np.arange(self.next_seq, self.next_seq + count, dtype=np.int64)
        draws = np.remainder((self._drawn + np.arange(count, dtype=np.float64)) * _PHI, 1.0)
        self._drawn += count
        channels = np.minimum(np.searchsorted(cumulative, draws, side="right"), self.n - 1)
        counts = np.bincount(channels, minlength=self.n)
        order = np.argsort(channels, kind="stable")
        rank = np.empty(count, dtype=np.int64)
        rank[order] = np.arange(count) - np.repeat(np.cumsum(counts) - counts, counts)
        numbers = self._per_channel[channels] + rank
        self._per_channel += counts
        return channels + self.n * numbers

    def _end_batch(self, now: float, count: int) -> None:
        self.engine.sample_output()
        if self.remaining_records <= 0:
            self._finish(now)
            return
        delay = count * self.record_size / self.rate
        if self.threading == "netty":
            delay += self._new_segments() * self.buffer_cost
            if self.notification_cost:
                delay += self._new_notifications() * self.notification_cost
        elif self.buffer_cost:
            delay += self._new_buffers() * self.buffer_cost + self._debt
            self._debt = 0.0
        self.sim.clock.schedule(now + delay, self.emit)

    def metric_rows(self, end: float) -> list[MetricRow]:
        """The engine's metric rows at the ``end`` of the run (a wait still going on ends there)."""
        self.engine.end_wait(end)
        self.engine.time.stop(end)
        return self.engine.metric_rows(end)

    def _finish(self, now: float) -> None:
        self.engine.finish()
        self.engine.time.stop(now)
        self.partition.close()
        self.finished = True
        self.finish_time = now
        self.sim.clock.cancel(self._timer)
        self._timer = None
