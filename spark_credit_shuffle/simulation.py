"""A virtual clock and a discrete-event simulation of an exchange through the real protocol core.

Producers write records at a given rate through real :class:`PipelinedResultPartition`\\ s (with their
LocalBufferPools, max buffers per channel and overdraft, and a buffer-timeout flusher); consumers read
their :class:`SingleInputGate` and spend ``size / rate`` virtual seconds on each buffer before they
recycle it. Remote channels travel over :class:`~spark_credit_shuffle.transport.memory.MemoryConnection`\\ s
with an optional latency and bandwidth, one connection per host pair (Flink's multiplexing: every channel
between two hosts shares it) or per task pair; a consumer on the producer's host reads it through a
:class:`LocalInputChannel`: directly (``local_channels="direct"``, Flink's TaskManager) or through a
connection (``"connection"``: tasks of one Spark executor in different Python processes), where the
producer holds each data buffer's segment in its pool until the consumer recycled it. Everything runs
on virtual time, so results are deterministic and independent of the machine, which makes the simulation
usable for what-if questions ("what does one slow consumer do to the others, with and without credits?")
and for tests.

The report gives per-channel and per-subtask bytes and throughput, the time producers spent back-pressured,
and samples over virtual time of the Flink metrics (outPoolUsage, inPoolUsage, exclusive and floating
buffer usage, backlog, queue lengths).

With ``checkpoint_interval_ms`` > 0 a coordinator triggers checkpoint barriers in every producer, one
checkpoint at a time, and each consumer aligns them with :class:`SingleCheckpointBarrierHandler` (its
completed checkpoints are in :attr:`ConsumerStats.checkpoints`); without credits the alignment is the old
model's (see :func:`_barrier_buffer`).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import math
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .buffers.buffer import Buffer, ByteBufferBuilder, DataType
from .buffers.format import CheckpointBarrier, barrier_data_type, decode_event, encode_event
from .config import NetworkConfig
from .errors import ConfigError, SimulationStalledError
from .metrics import CONSUMER, PRODUCER, SAMPLE, MetricRow, TaskMetrics
from .planner import consumer_buffers, producer_buffers
from .protocol.channels import RemoteInputChannel
from .protocol.checkpointing import CompletedCheckpoint, SingleCheckpointBarrierHandler
from .protocol.client import CreditBasedPartitionRequestClientHandler
from .protocol.gate import SingleInputGate
from .protocol.partition import PipelinedResultPartition, ResultPartitionManager
from .protocol.pools import NetworkBufferPool
from .protocol.sender import PartitionRequestServerHandler
from .runtime.engine import Flusher, GateGauges, Settings, channel_gauges, subpartition_gauges
from .transport.memory import MemoryConnection, MemoryNetwork

__all__ = [
    "ChannelStats",
    "ConsumerStats",
    "ProducerStats",
    "Simulation",
    "SimulationReport",
    "VirtualClock",
    "simulate",
]


class VirtualClock:
    """Virtual time and a queue of timed callbacks, run in (time, insertion) order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._sequence = 0

    def schedule(self, at: float, callback: Callable[[float], None]) -> None:
        """Run ``callback(time)`` at virtual time ``at`` (never before now)."""
        self._sequence += 1
        heapq.heappush(self._events, (max(at, self.now), self._sequence, callback))

    def next_time(self) -> float | None:
        return self._events[0][0] if self._events else None

    def run_next(self) -> bool:
        """Advance to the next event and run it; False if there is none."""
        if not self._events:
            return False
        at, _, callback = heapq.heappop(self._events)
        self.now = at
        callback(at)
        return True

    def __len__(self) -> int:
        return len(self._events)


# -- per-subtask actors --------------------------------------------------------------------------------


def _per_subtask(value: float | Sequence[float] | None, count: int, name: str) -> list:
    if value is None or isinstance(value, (int, float)):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ConfigError(name, value, f"one value per subtask ({count} values) or a single value")
    return values


class _Producer:
    """Writes records of ``record_size`` bytes at ``rate`` bytes per virtual second, round robin over its
    subpartitions, in batches of ``batch_records``.

    It blocks per buffer request, as Flink's ``requestBufferBuilderBlocking``: a new record starts in a new
    buffer only while its partition is available; a record that spans buffers takes its continuation
    buffers from the pool's overdraft; a buffer it cannot get stops the batch there, and the producer
    writes on from that point once the pool is available again."""

    def __init__(
        self,
        sim: Simulation,
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
            self.partition.add_event(k, _barrier_buffer(barrier, self.sim.config.credit_based))

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


# -- checkpoint barriers in the model without credits ---------------------------------------------------
#
# The model without credits is Flink's before credit-based flow control (<= 1.4, and 1.5-1.9 with
# ``taskmanager.network.credit-model: false``). Its aligned checkpoints did not block upstream: a barrier
# travelled as a plain event (the upstream-blocking ALIGNED_CHECKPOINT_BARRIER type and ResumeConsumption
# came with credit-based blocking, after the old model was gone), the sender went on sending the channel,
# and the consumer's BarrierBuffer kept reading every channel of the connection: the buffers of a channel
# that had delivered the barrier were spilled (BufferSpiller: written aside, the network buffer recycled
# at once) and replayed, in order, before any new input once the alignment ended. A receiver can stop one
# channel there only by stopping the whole connection, so this is what the simulation does for
# ``credit_based=False``; with credits the subpartition blocks itself at the barrier as in current Flink.


def _barrier_buffer(barrier: CheckpointBarrier, credit_based: bool) -> Buffer:
    """The buffer a producer adds for ``barrier``: an aligned barrier of the model without credits travels as
    a plain event (its subpartition does not block)."""
    buffer = encode_event(barrier)
    if not credit_based and buffer.data_type.is_blocking_upstream:
        return Buffer(DataType.EVENT_BUFFER, buffer.data)
    return buffer


class _Consumer:
    """Reads its gate and spends ``size / rate`` virtual seconds on each data buffer before recycling it.

    Without credits, aligned checkpoints align at the consumer (see :func:`_barrier_buffer`): what a
    channel blocked by the pending alignment delivers is spilled (its network buffer recycled at once, the
    spill assumed free) and replayed before new input when the alignment ends."""

    def __init__(self, sim: Simulation, index: int, gate: SingleInputGate, rate: float, producers: list[int]) -> None:
        self.sim = sim
        self.index = index
        self.gate = gate
        self.rate = rate
        self.producers = producers
        self.digests = [hashlib.blake2b(digest_size=16) for _ in producers]
        self.bytes_per_channel = [0] * len(producers)
        self.buffers_per_channel = [0] * len(producers)
        self.channel_finish_time: list[float | None] = [None] * len(producers)
        self.busy = False
        self.finished = False
        self.finish_time: float | None = None
        self.scheduled = False
        self.checkpoints = SingleCheckpointBarrierHandler(len(producers))
        #: Model without credits: spilled (channel, buffer, sequence number) of blocked channels, and the
        #: spilled items to replay before the gate.
        self.aligns_by_spilling = not sim.config.credit_based
        self.barrier_data_type = barrier_data_type(sim.config.checkpoint_options)
        self.spilled: deque[tuple[int, Buffer, int]] = deque()
        self.replay: deque[tuple[int, Buffer, int]] = deque()
        self.spilled_bytes = 0
        gate.listener = self._on_data

    @property
    def bytes_consumed(self) -> int:
        return sum(self.bytes_per_channel)

    def _on_data(self) -> None:
        if not self.busy and not self.finished and not self.scheduled:
            self.scheduled = True
            self.sim.clock.schedule(self.sim.clock.now, self.consume)

    def consume(self, now: float) -> None:
        self.scheduled = False
        while not self.busy and not self.finished:
            if self.replay:
                channel, buffer, sequence_number = self.replay.popleft()
            else:
                boe = self.gate.poll_next()
                if boe is None:
                    if self.gate.is_finished and not self.spilled:
                        self._finish(now)
                    return
                buffer, channel, sequence_number = boe.buffer, boe.channel_index, boe.sequence_number
            if self.aligns_by_spilling and self.checkpoints.is_blocked(channel):
                self._spill(channel, buffer, sequence_number)
                continue
            data_type = buffer.data_type
            if data_type.is_buffer:
                size = buffer.size
                self.checkpoints.process_buffer(channel, sequence_number, size)
                self.digests[channel].update(buffer.data)
                self.bytes_per_channel[channel] += size
                self.buffers_per_channel[channel] += 1
                self.busy = True
                self.sim.clock.schedule(now + size / self.rate, functools.partial(self._done, buffer=buffer))
                return
            if self.aligns_by_spilling and data_type is DataType.EVENT_BUFFER:
                data_type = self.barrier_data_type  # an aligned barrier travels as a plain event here
            event = decode_event(data_type, buffer.data)
            buffer.recycle()
            now_ns = round(now * 1e9)
            if isinstance(event, CheckpointBarrier):
                self._resume(self.checkpoints.process_barrier(channel, event, now_ns, sequence_number))
            elif data_type is DataType.END_OF_PARTITION:
                self.channel_finish_time[channel] = now
                self._resume(self.checkpoints.process_end_of_partition(channel, now_ns))

    def _resume(self, channels: tuple[int, ...]) -> None:
        """The barrier handler released ``channels``: resume their subpartitions (with credits) or replay
        what was spilled while they were blocked (without)."""
        if not self.aligns_by_spilling:
            for channel in channels:
                self.gate.resume_consumption(channel)
        elif self.spilled and not self.checkpoints.blocked_channels:
            self.spilled.extend(self.replay)  # the newer spill first, then what was still to replay
            self.replay, self.spilled = self.spilled, deque()

    def _spill(self, channel: int, buffer: Buffer, sequence_number: int) -> None:
        if buffer.data_type.is_buffer:
            spilled = Buffer(buffer.data_type, bytes(buffer.data))
            self.spilled_bytes += spilled.size
            buffer.recycle()
            buffer = spilled
        self.spilled.append((channel, buffer, sequence_number))

    def _done(self, now: float, buffer: Buffer) -> None:
        buffer.recycle()
        self.busy = False
        self.consume(now)

    def _finish(self, now: float) -> None:
        self.finished = True
        self.finish_time = now
        self.gate.close()


# -- report --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChannelStats:
    """One channel: producer ``producer``'s subpartition ``subpartition`` read by consumer ``consumer``."""

    consumer: int
    channel: int
    producer: int
    subpartition: int
    local: bool
    bytes_sent: int
    bytes_received: int
    buffers_received: int
    intact: bool  # the bytes received equal the bytes written, in order
    finish_time: float | None


@dataclass(frozen=True)
class ProducerStats:
    subtask: int
    host: int
    bytes_written: int
    back_pressured_time: float
    finish_time: float | None


@dataclass(frozen=True)
class ConsumerStats:
    subtask: int
    host: int
    bytes_consumed: int
    buffers_consumed: int
    finish_time: float | None
    throughput: float  # bytes per virtual second over the measured window
    #: Checkpoints this subtask aligned (``checkpoint_interval_ms`` > 0), times in virtual nanoseconds.
    checkpoints: tuple[CompletedCheckpoint, ...] = ()


@dataclass
class SimulationReport:
    """What a simulation run measured. Times are virtual seconds, throughputs bytes per virtual second."""

    end_time: float
    window: float
    steps: int
    finished: bool
    producers: list[ProducerStats]
    consumers: list[ConsumerStats]
    channels: list[ChannelStats]
    samples: list[dict] = field(default_factory=list)
    #: The samples as the runtimes' timeline rows (``time_ms``: virtual milliseconds).
    timeline: list[MetricRow] = field(default_factory=list)
    buffers_returned: bool = False
    connection_pauses: int = 0
    messages: int = 0

    @property
    def data_intact(self) -> bool:
        """Every channel received exactly what was written to it, in order."""
        return all(c.intact for c in self.channels)

    def consumer_throughput(self, subtask: int) -> float:
        return self.consumers[subtask].throughput

    def back_pressure_ratio(self, subtask: int) -> float:
        """Share of the window producer ``subtask`` spent waiting for buffers (backPressuredTime / time)."""
        return self.producers[subtask].back_pressured_time / self.window if self.window else 0.0

    def channel_rows(self) -> list[dict]:
        return [dict(c.__dict__) for c in self.channels]

    def timeline_rows(self) -> list[MetricRow]:
        """Every sample as the runtimes' timeline rows (``Exchange.timeline()``'s form; virtual ms): producers'
        ``outPoolUsage``, ``isBackPressured``, per channel ``backlog`` and ``outputQueueLength``; consumers'
        pool usages and per channel ``credit``, ``unannouncedCredit``, ``backlog`` (remote channels) and
        ``inputQueueLength``."""
        return list(self.timeline)

    def metric_rows(self) -> list[MetricRow]:
        """The run summed up as the runtimes' metric rows: ``numBytesOut`` per channel and
        ``accumulateBackPressuredTimeMs`` (virtual) per producer, ``numBytesIn`` and ``numBuffersIn`` per
        channel per consumer."""
        rows = []
        for p in self.producers:
            rows.append(
                MetricRow(
                    PRODUCER, p.subtask, None, "accumulateBackPressuredTimeMs", "total", p.back_pressured_time * 1000.0
                )
            )
        for c in self.channels:
            rows.append(MetricRow(PRODUCER, c.producer, c.consumer, "numBytesOut", "total", float(c.bytes_sent)))
            rows.append(MetricRow(CONSUMER, c.consumer, c.producer, "numBytesIn", "total", float(c.bytes_received)))
            rows.append(MetricRow(CONSUMER, c.consumer, c.producer, "numBuffersIn", "total", float(c.buffers_received)))
        return rows


# -- the simulation ------------------------------------------------------------------------------------


class Simulation:
    """An exchange of ``num_producers`` -> ``num_consumers`` subtasks on virtual time.

    ``consumers_of(p)`` lists the consumer of each subpartition of producer ``p`` (default all-to-all;
    ``"forward"`` for p -> p). Rates are per subtask, in bytes per virtual second (``rate_unit="records"``
    multiplies by ``record_size``). ``bytes_per_producer`` ends the run when all is consumed; otherwise
    give ``duration``. Hosts place subtasks; ``connections="host_pair"`` multiplexes every channel between
    two hosts over one connection, ``"task_pair"`` gives each (consumer, producer) pair its own.
    ``network_buffers`` per host default to ``config.total_network_buffers``;
    ``extra_buffers_per_host`` instead sizes each host at exactly its minimum plus that many.
    ``local_channels``: how a consumer reads a producer of its own host: ``"direct"`` (one process, Flink's
    TaskManager) or ``"connection"`` (one process per task, as Spark's Python workers: a local channel over
    a connection, credit-free, the producer's segment held until the consumer recycled it).
    """

    def __init__(
        self,
        config: NetworkConfig,
        *,
        num_producers: int,
        num_consumers: int,
        producer_rate: float | Sequence[float],
        consumer_rate: float | Sequence[float],
        consumers_of: str | Callable[[int], list[int]] = "all_to_all",
        bytes_per_producer: float | Sequence[float] | None = None,
        duration: float | None = None,
        record_size: int = 1024,
        batch_records: int = 32,
        rate_unit: str = "bytes",
        producer_hosts: Sequence[int] | None = None,
        consumer_hosts: Sequence[int] | None = None,
        connections: str = "host_pair",
        latency: float = 0.0,
        bandwidth: float | None = None,
        socket_buffer_bytes: int | None = 256 * 1024,
        encode: bool = False,
        network_buffers: int | None = None,
        extra_buffers_per_host: int | None = None,
        sample_interval: float | None = None,
        check_invariants: bool = False,
        max_steps: int = 2_000_000,
        local_channels: str = "direct",
    ) -> None:
        if num_producers < 1 or num_consumers < 1:
            raise ConfigError("parallelism", (num_producers, num_consumers), "at least 1 producer and 1 consumer")
        if bytes_per_producer is None and duration is None:
            raise ConfigError("duration", None, "a duration when bytes_per_producer is not given")
        if rate_unit not in ("bytes", "records"):
            raise ConfigError("rate_unit", rate_unit, "'bytes' or 'records'")
        if connections not in ("host_pair", "task_pair"):
            raise ConfigError("connections", connections, "'host_pair' or 'task_pair'")
        if local_channels not in ("direct", "connection"):
            raise ConfigError("local_channels", local_channels, "'direct' or 'connection'")
        if record_size < 1 or batch_records < 1:
            raise ConfigError("record_size", (record_size, batch_records), "record_size and batch_records >= 1")
        self.config = config
        self.settings = Settings.of(config)  # the task engine's reading of the settings (flush rule)
        self.duration = duration
        self.check_invariants = check_invariants
        self.max_steps = max_steps
        self.sample_interval = sample_interval
        self.clock = VirtualClock()
        scale = record_size if rate_unit == "records" else 1
        producer_rates = [r * scale for r in _per_subtask(producer_rate, num_producers, "producer_rate")]
        consumer_rates = [r * scale for r in _per_subtask(consumer_rate, num_consumers, "consumer_rate")]
        for name, rates in (("producer_rate", producer_rates), ("consumer_rate", consumer_rates)):
            if any(not (r > 0 and math.isfinite(r)) for r in rates):
                raise ConfigError(name, rates, "finite rates > 0")
        totals = _per_subtask(bytes_per_producer, num_producers, "bytes_per_producer")
        totals = [math.inf if t is None else t for t in totals]
        if consumers_of == "all_to_all":
            wiring = [list(range(num_consumers)) for _ in range(num_producers)]
        elif consumers_of == "forward":
            if num_producers != num_consumers:
                raise ConfigError("consumers_of", "forward", "equal producer and consumer parallelism")
            wiring = [[p] for p in range(num_producers)]
        elif callable(consumers_of):
            wiring = [list(consumers_of(p)) for p in range(num_producers)]
        else:
            raise ConfigError("consumers_of", consumers_of, "'all_to_all', 'forward' or a function")
        producers_of: list[list[tuple[int, int]]] = [[] for _ in range(num_consumers)]
        for p, consumers in enumerate(wiring):
            if not consumers:
                raise ConfigError("consumers_of", p, "at least one consumer per producer")
            for sp, c in enumerate(consumers):
                producers_of[c].append((p, sp))
        if any(not channels for channels in producers_of):
            raise ConfigError("consumers_of", consumers_of, "at least one producer per consumer")
        self.producer_hosts = list(producer_hosts) if producer_hosts is not None else [0] * num_producers
        self.consumer_hosts = list(consumer_hosts) if consumer_hosts is not None else [1] * num_consumers
        if len(self.producer_hosts) != num_producers or len(self.consumer_hosts) != num_consumers:
            raise ConfigError("hosts", (producer_hosts, consumer_hosts), "one host per subtask")

        # network memory per host
        hosts = sorted(set(self.producer_hosts) | set(self.consumer_hosts))
        required = dict.fromkeys(hosts, 0)
        for p, consumers in enumerate(wiring):  # the planner's sums, placed on these hosts
            required[self.producer_hosts[p]] += producer_buffers(len(consumers), config, "pipelined").required
        for c, channels in enumerate(producers_of):
            remote = sum(1 for p, _ in channels if self.producer_hosts[p] != self.consumer_hosts[c])
            required[self.consumer_hosts[c]] += consumer_buffers(len(channels), remote, config, "pipelined").required
        self.required_buffers_per_host = required
        self.network_pools: dict[int, NetworkBufferPool] = {}
        for host in hosts:
            if extra_buffers_per_host is not None:
                total = required[host] + extra_buffers_per_host
            else:
                total = network_buffers if network_buffers is not None else config.total_network_buffers
            self.network_pools[host] = NetworkBufferPool(total, config.segment_size)
        self.managers = {host: ResultPartitionManager() for host in hosts}

        # producers
        self._consumers_of = wiring
        self.producers: list[_Producer] = []
        for p, consumers in enumerate(wiring):
            host = self.producer_hosts[p]
            partition = PipelinedResultPartition.create(
                self.network_pools[host], len(consumers), config, partition_id=p
            )
            self.managers[host].register_partition(partition)
            self.producers.append(
                _Producer(self, p, partition, producer_rates[p], totals[p], record_size, batch_records)
            )

        # consumers, channels, connections
        self.connections: dict[tuple, MemoryConnection] = {}
        self.network = MemoryNetwork()
        self._pump_at: dict[MemoryConnection, float] = {}
        self.consumers: list[_Consumer] = []
        self._remote: list[tuple[RemoteInputChannel, MemoryConnection]] = []
        self._local_links: list[tuple[int, MemoryConnection, PipelinedResultPartition]] = []
        self._channel_origin: list[list[tuple[int, int, bool]]] = []
        link = {
            "latency": latency,
            "bandwidth": bandwidth,
            "socket_buffer_bytes": socket_buffer_bytes,
            "encode": encode,
        }
        receiver_id = 0
        for c, channels in enumerate(producers_of):
            host = self.consumer_hosts[c]
            remote_count = sum(1 for p, _ in channels if self.producer_hosts[p] != host)
            gate = SingleInputGate(self.network_pools[host], len(channels), config, num_remote_channels=remote_count)
            origins = []
            for index, (p, sp) in enumerate(channels):
                producer_host = self.producer_hosts[p]
                if producer_host == host and local_channels == "direct":
                    gate.local_channel(index, self.managers[host], partition_id=p, subpartition=sp)
                    origins.append((p, sp, True))
                    continue
                key = (producer_host, host) if connections == "host_pair" else (p, c)
                connection = self.connections.get(key)
                if connection is None:
                    client = CreditBasedPartitionRequestClientHandler(credit_based=config.credit_based)
                    server = PartitionRequestServerHandler(
                        self.managers[producer_host],
                        credit_based=config.credit_based,
                    )
                    connection = self.network.connect(client, server, **link)
                    self.connections[key] = connection
                receiver_id += 1
                if producer_host == host:  # a local channel through the connection
                    gate.local_channel(
                        index, connection.client, receiver_id=receiver_id, partition_id=p, subpartition=sp
                    )
                    self._local_links.append((receiver_id, connection, self.producers[p].partition))
                    origins.append((p, sp, True))
                    continue
                channel = gate.remote_channel(index, receiver_id, connection.client, partition_id=p, subpartition=sp)
                self._remote.append((channel, connection))
                origins.append((p, sp, False))
            self._channel_origin.append(origins)
            self.consumers.append(_Consumer(self, c, gate, consumer_rates[c], [p for p, _ in channels]))
        self.samples: list[dict] = []
        self.timeline: list[MetricRow] = []
        self._gate_gauges: dict[int, GateGauges] = {}
        self.checkpoints_triggered = 0
        self.steps = 0
        self.invariant_checks = 0

    # -- driving --

    def _settle(self, now: float) -> None:
        self.network.pump(now, self._later)
        if self.check_invariants:
            self._check_invariants()

    def _later(self, connection: MemoryConnection, at: float) -> None:
        """Wake ``connection`` at ``at``, unless a wake-up no later than that is already due."""
        scheduled = self._pump_at.get(connection)
        if scheduled is None or scheduled <= self.clock.now or at < scheduled:
            self._pump_at[connection] = at
            self.clock.schedule(at, functools.partial(self._wake, connection=connection))

    def _wake(self, now: float, connection: MemoryConnection) -> None:
        self.network.mark(connection)

    def _trigger_checkpoint(self, now: float) -> None:
        """Flink's checkpoint coordinator with its defaults (``execution.checkpointing.max-concurrent-checkpoints``
        1, no minimum pause): every ``checkpoint_interval_ms`` it triggers the next checkpoint in every
        producer at once, unless the last one is still pending on some consumer; then it tries at the next
        tick."""
        last = self.checkpoints_triggered
        if last == 0 or all(
            c.finished or (c.checkpoints.current_checkpoint_id >= last and not c.checkpoints.is_checkpoint_pending)
            for c in self.consumers
        ):
            self.checkpoints_triggered = last + 1
            for producer in self.producers:
                producer.inject_barrier(now, last + 1)
        if not all(p.finished for p in self.producers):
            self.clock.schedule(now + self.config.checkpoint_interval_ms / 1000.0, self._trigger_checkpoint)

    def _sample(self, now: float) -> None:
        self._sample_rows(now)
        for producer in self.producers:
            partition = producer.partition
            self.samples.append(
                {
                    "time": now,
                    "role": "producer",
                    "subtask": producer.index,
                    "outPoolUsage": partition.out_pool_usage,
                    "outputQueueLength": partition.output_queue_length(),
                    "backlog": sum(partition.backlogs()),
                    "isBackPressured": not partition.is_available() and not producer.finished,
                    "bytes": sum(producer.bytes_written),
                }
            )
        for consumer in self.consumers:
            gate = consumer.gate
            closed = gate.is_closed
            self.samples.append(
                {
                    "time": now,
                    "role": "consumer",
                    "subtask": consumer.index,
                    "inPoolUsage": 0.0 if closed else gate.in_pool_usage,
                    "inputExclusiveBuffersUsage": 0.0 if closed else gate.input_exclusive_buffers_usage,
                    "inputFloatingBuffersUsage": 0.0 if closed else gate.input_floating_buffers_usage,
                    "inputQueueLength": 0 if closed else gate.input_queue_length(),
                    "bytes": consumer.bytes_consumed,
                }
            )
        if not all(c.finished for c in self.consumers) and self.sample_interval:
            self.clock.schedule(now + self.sample_interval, self._sample)

    def _sample_rows(self, now: float) -> None:
        """The runtimes' timeline gauges (the task engine's), as timeline rows stamped in virtual ms."""
        stamp = now * 1000.0
        rows = self.timeline
        for producer in self.producers:
            partition, p = producer.partition, producer.index
            back_pressured = not partition.is_available() and not producer.finished
            gauges = [
                ("outPoolUsage", None, partition.out_pool_usage),
                ("isBackPressured", None, 1.0 if back_pressured else 0.0),
                *subpartition_gauges(partition, self._consumers_of[p], {}),
            ]
            rows.extend(MetricRow(PRODUCER, p, ch, m, SAMPLE, float(v), stamp) for m, ch, v in gauges)
        for consumer in self.consumers:
            gate, c = consumer.gate, consumer.index
            if gate.is_closed:
                gauges = [(name, None, 0.0) for name in GateGauges.NAMES]
            else:
                usage = self._gate_gauges.get(c)
                if usage is None:
                    usage = self._gate_gauges[c] = GateGauges(gate, TaskMetrics(CONSUMER, c))
                gauges = [
                    *zip(GateGauges.NAMES, (None,) * 3, usage.values()),
                    *channel_gauges(gate, consumer.producers),
                ]
            rows.extend(MetricRow(CONSUMER, c, ch, m, SAMPLE, float(v), stamp) for m, ch, v in gauges)

    def _check_invariants(self) -> None:
        """No producer holds more than its pool size plus the overdraft, no executor's pools hold more than
        its network buffers, no data buffer is in flight or sendable without a receiver buffer reserved for
        it, and on a local channel through a connection every buffer sent and not yet recycled holds a
        segment of the producer's pool."""
        self.invariant_checks += 1
        for producer in self.producers:
            pool = producer.partition.buffer_pool
            held = pool.num_requested + pool.num_borrowed
            if held > pool.current_pool_size + pool.max_overdraft_buffers:
                raise AssertionError(
                    f"producer {producer.index} holds {held} segments, beyond its pool size "
                    f"{pool.current_pool_size} + overdraft {pool.max_overdraft_buffers}"
                )
        for host, network in self.network_pools.items():
            held = sum(p.num_requested + p.num_borrowed for p in network.buffer_pools) + network.num_unpooled
            if held > network.total or network.num_available < 0:
                raise AssertionError(f"host {host}: pools hold {held} segments of {network.total} network buffers")
        segments: dict[int, set[int]] = {}  # per producer partition: the segments its local channels hold
        for receiver_id, connection, partition in self._local_links:
            reader = connection.server.queue.all_readers.get(receiver_id)
            if reader is not None:
                mine = segments.setdefault(id(partition), set())
                for buffer in reader.held:  # type: ignore[attr-defined]
                    recycler = buffer._recycler  # a slice's recycler is bound to its segment's lease
                    if recycler is None:
                        raise AssertionError(f"local channel {receiver_id} holds a buffer already recycled")
                    mine.add(id(getattr(recycler, "__self__", recycler)))
        for partition in {id(p): p for _, _, p in self._local_links}.values():
            held = len(segments.get(id(partition), ()))
            if held > partition.buffer_pool.num_used:
                raise AssertionError(
                    f"producer {partition.partition_id}: {held} segments held by local channels, "
                    f"{partition.buffer_pool.num_used} in use in its pool"
                )
        if not self.config.credit_based:
            return
        for channel, connection in self._remote:
            if channel.is_released:
                continue
            if channel.unannounced_credit < 0:
                raise AssertionError(f"negative unannounced credit on {channel!r}")
            reader = connection.server.queue.all_readers.get(channel.receiver_id)
            if reader is None:
                continue
            credits = reader.num_credits_available
            if credits < 0:
                raise AssertionError(f"negative credit on {reader!r}")
            in_flight = connection.data_in_flight(channel.receiver_id)
            if credits + in_flight > channel.num_available_buffers:
                raise AssertionError(
                    f"channel {channel.receiver_id}: sender credit {credits} + {in_flight} data buffers in flight "
                    f"exceed the {channel.num_available_buffers} buffers the receiver reserved"
                )

    def run(self) -> SimulationReport:
        """Run to completion (or to ``duration``); raises :class:`SimulationStalledError` on a deadlock."""
        for consumer in self.consumers:
            consumer.gate.request_partitions()
        for producer in self.producers:
            producer.start()
        if self.config.checkpoint_interval_ms > 0:
            self.clock.schedule(self.config.checkpoint_interval_ms / 1000.0, self._trigger_checkpoint)
        for connection in self.connections.values():
            self.network.mark(connection)
        if self.sample_interval:
            self.clock.schedule(0.0, self._sample)
        clock = self.clock
        self._settle(0.0)
        while True:
            at = clock.next_time()
            if at is None:
                break
            if self.duration is not None and at > self.duration:
                clock.now = self.duration
                break
            clock.run_next()
            self._settle(clock.now)
            self.steps += 1
            if self.steps > self.max_steps:
                raise SimulationStalledError(
                    f"simulation exceeded {self.max_steps} steps at virtual time {clock.now:.6f}s; "
                    f"{self._describe_state()}"
                )
        finished = all(c.finished for c in self.consumers)
        if not finished and self.duration is None:
            raise SimulationStalledError(
                f"simulation deadlocked at virtual time {clock.now:.6f}s: nothing left to happen, "
                f"{self._describe_state()}"
            )
        return self._report(finished)

    def _describe_state(self) -> str:
        waiting = [p.index for p in self.producers if p.waiting_since is not None]
        open_consumers = [c.index for c in self.consumers if not c.finished]
        paused = sum(1 for c in self.connections.values() if not c.client.is_reading)
        return f"producers waiting for buffers {waiting}, consumers not finished {open_consumers}, paused {paused}"

    def _report(self, finished: bool) -> SimulationReport:
        end = self.clock.now
        window = self.duration if self.duration is not None else end
        producers = [
            ProducerStats(
                p.index,
                self.producer_hosts[p.index],
                sum(p.bytes_written),
                p.back_pressured_time + ((end - p.waiting_since) if p.waiting_since is not None else 0.0),
                p.finish_time,
            )
            for p in self.producers
        ]
        consumers = []
        channels = []
        for consumer in self.consumers:
            consumed = consumer.bytes_consumed
            consumers.append(
                ConsumerStats(
                    consumer.index,
                    self.consumer_hosts[consumer.index],
                    consumed,
                    sum(consumer.buffers_per_channel),
                    consumer.finish_time,
                    consumed / window if window else 0.0,
                    tuple(consumer.checkpoints.completed),
                )
            )
            for index, (p, sp, local) in enumerate(self._channel_origin[consumer.index]):
                producer = self.producers[p]
                channels.append(
                    ChannelStats(
                        consumer.index,
                        index,
                        p,
                        sp,
                        local,
                        producer.bytes_written[sp],
                        consumer.bytes_per_channel[index],
                        consumer.buffers_per_channel[index],
                        consumer.digests[index].digest() == producer.digests[sp].digest(),
                        consumer.channel_finish_time[index],
                    )
                )
        returned = finished and all(
            pool.num_available == pool.total and pool.num_total_required_buffers == 0 and not pool.buffer_pools
            for pool in self.network_pools.values()
        )
        return SimulationReport(
            end_time=end,
            window=window,
            steps=self.steps,
            finished=finished,
            producers=producers,
            consumers=consumers,
            channels=channels,
            samples=self.samples,
            timeline=self.timeline,
            buffers_returned=returned,
            connection_pauses=sum(c.client.num_times_paused for c in self.connections.values()),
            messages=sum(c.upstream.messages_sent + c.downstream.messages_sent for c in self.connections.values()),
        )


def simulate(config: NetworkConfig | None = None, **kwargs) -> SimulationReport:
    """Build a :class:`Simulation` with ``kwargs`` and run it."""
    return Simulation(config or NetworkConfig(), **kwargs).run()
