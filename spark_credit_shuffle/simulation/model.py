"""The simulation: an exchange's topology (subtasks, hosts, network memory, channels and connections) built
from the real protocol core, run on a virtual clock."""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ParamSpec

from ..buffers.pools import NetworkBufferPool
from ..config import NetworkConfig
from ..engine import Settings
from ..errors import ConfigError, SimulationStalledError
from ..metrics import CONSUMER, PRODUCER, MetricRow
from ..planner import consumer_buffers, producer_buffers
from ..planner.channels import DIRECT, LOCAL, Endpoint, channel_route
from ..protocol.channels import RemoteInputChannel
from ..protocol.client import CreditBasedPartitionRequestClientHandler
from ..protocol.gate import SingleInputGate
from ..protocol.partition import PipelinedResultPartition, ResultPartitionManager
from ..protocol.sender import PartitionRequestServerHandler
from ..transport.in_memory import MemoryConnection, MemoryNetwork, SharedBandwidth
from .barrier_models import CheckpointCoordinator
from .clock import VirtualClock, per_subtask
from .observe import check_invariants, sample
from .report import (
    BYTES_IN_PER_SECOND,
    DATA_BYTES_IN,
    FINISH_TIME,
    RECORDS_IN_PER_SECOND,
    ChannelOrigin,
    SimulationReport,
)
from .simulated_consumer import SimulatedConsumer
from .simulated_producer import SimulatedProducer

__all__ = ["Simulation", "simulate"]


#: The channels (producers x consumers, at most) from which a run freezes its topology: below, the collection
#: that must come first costs more than the run saves (a whole test process's heap walked per small simulation).
_FREEZE_FROM_CHANNELS = 4096

P = ParamSpec("P")


def _collector_paused_while_building(init: Callable[P, None]) -> Callable[P, None]:
    """Build a topology of :data:`_FREEZE_FROM_CHANNELS` channels or more with the cyclic garbage collector
    paused: building makes millions of objects that live as long as the simulation and no garbage cycles,
    and every collection the allocations started walked what was built so far again (at 400 tasks, 4,000
    collections and about 2 of the 4.3 s the collector took)."""

    @functools.wraps(init)
    def build(*args: P.args, **kwargs: P.kwargs) -> None:
        producers: Any = kwargs.get("num_producers", 0)
        consumers: Any = kwargs.get("num_consumers", 0)
        if producers * consumers < _FREEZE_FROM_CHANNELS or not gc.isenabled():
            return init(*args, **kwargs)
        gc.disable()
        try:
            return init(*args, **kwargs)
        finally:
            gc.enable()

    return build


def _short_weights(weights: Any) -> str:
    text = repr(weights)
    return text if len(text) <= 80 else text[:77] + "..."


class Simulation:
    """An exchange of ``num_producers`` -> ``num_consumers`` subtasks on virtual time.

    ``consumers_of(p)`` lists the consumer of each subpartition of producer ``p`` (default all-to-all;
    ``"forward"`` for p -> p). Rates are per subtask, in bytes per virtual second (``rate_unit="records"``
    multiplies by ``record_size``). ``bytes_per_producer`` ends the run when all is consumed; otherwise
    give ``duration``. Hosts place subtasks; ``connections="host_pair"`` multiplexes every channel between
    two hosts over one connection, ``"task_pair"`` gives each (consumer, producer) pair its own.
    ``network_buffers`` per host default to ``config.total_network_buffers``;
    ``extra_buffers_per_host`` instead sizes each host at exactly its minimum plus that many.
    ``processes``: what runs in one process, and so how a consumer reads a producer of its own host
    (:func:`~spark_credit_shuffle.planner.channels.channel_route`): ``"host"`` (Flink's TaskManager: directly)
    or ``"subtask"`` (as Spark's Python workers: a local channel over a connection, credit-free, the
    producer's segment held until the consumer recycled it).

    A consumer spends ``records' bytes / rate`` on a data buffer (its rate is the operator's: it processes
    records) plus ``buffer_cost`` seconds for the buffer itself (its header and Arrow metadata, decoded at the
    machine's speed whatever the operator's: the task engine's ``take`` of one buffer costs about 20-25 us).
    A producer spends ``records' bytes / rate`` on a batch plus ``producer_buffer_cost`` for every buffer it
    finishes (default 0). ``flush_model``: ``"1.5"`` (Flink 1.5 and later, the default: a flush hands the
    reader a slice of the open buffer, which the writer keeps filling) or ``"1.4"`` (Flink 1.4's output
    flusher: a flush finishes every open buffer, and every buffer handed over costs ``notification_cost`` more,
    its wake-up of the network thread; see :class:`SimulatedProducer`). ``progress(now)``, if
    given, is called with the virtual time every ``progress_steps`` events (a progress line for long runs).
    ``channel_weights[p]``, if given: the share of producer ``p``'s records each of its subpartitions gets
    (a keyed exchange's skew; default round robin, equal shares).
    ``threading``: who pays for a buffer (see :class:`SimulatedProducer`). ``"loop"`` (the default, this
    package's runtime): the producer, per buffer or slice handed over. ``"netty"`` (Flink's threads): the producer
    per segment it fills and per notification it raises, and the host's ``network_threads`` (Netty's server
    threads; Flink's default is one per slot; None: one per connection) ``sender_cost`` per message each
    sends. A host's connections are spread over its threads round robin, as Netty assigns channels to event loops,
    and a thread's connections share it evenly: each sends at ``sender_cost`` times their number per message.
    A network thread takes a subpartition's next slice only when it is free, so a flushed buffer keeps filling
    until then, as with Flink 1.5's ``BufferConsumer`` (a flushed buffer under Flink 1.4 is finished).
    ``warmup``: the virtual seconds at the start that the consumers' throughput (``numBytesInPerSecond``) leaves
    out, so that it is the steady state's: buffers fill for the first time, pools and credits settle, and a buffer
    timeout has not fired yet (the report's ``window`` is the time after it).
    ``host_bandwidth``: bytes per virtual second that all connections a host sends on move together, one message
    after another (:class:`~spark_credit_shuffle.transport.in_memory.SharedBandwidth`): the CPU of a machine
    whose processes copy, frame and decode every buffer, as when Spark's Python workers share a few cores; None
    (the default): no such limit.
    ``producer_start`` and ``consumer_start``: when each subtask starts (virtual seconds, one value or one per
    subtask; default all at 0). A real run's subtasks start one after the other, as Spark schedules them and
    starts their Python workers: a producer that starts early fills its subpartitions and waits for consumers
    that have not asked for them yet; a consumer's partition requests go out when it starts, on connections of its
    own (a connection shared with consumers that started on time may have closed by then).
    """

    @_collector_paused_while_building
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
        buffer_cost: float = 25e-6,
        max_steps: int = 2_000_000,
        processes: str = "host",
        producer_buffer_cost: float = 0.0,
        flush_model: str = "1.5",
        notification_cost: float = 0.0,
        progress: Callable[[float], None] | None = None,
        progress_steps: int = 20_000,
        warmup: float = 0.0,
        channel_weights: Sequence[Sequence[float]] | None = None,
        threading: str = "loop",
        sender_cost: float = 0.0,
        network_threads: int | None = None,
        producer_start: float | Sequence[float] = 0.0,
        consumer_start: float | Sequence[float] = 0.0,
        host_bandwidth: float | None = None,
    ) -> None:
        if num_producers < 1 or num_consumers < 1:
            raise ConfigError("parallelism", (num_producers, num_consumers), "at least 1 producer and 1 consumer")
        if bytes_per_producer is None and duration is None:
            raise ConfigError("duration", None, "a duration when bytes_per_producer is not given")
        if rate_unit not in ("bytes", "records"):
            raise ConfigError("rate_unit", rate_unit, "'bytes' or 'records'")
        if connections not in ("host_pair", "task_pair"):
            raise ConfigError("connections", connections, "'host_pair' or 'task_pair'")
        if processes not in ("host", "subtask"):
            raise ConfigError("processes", processes, "'host' or 'subtask'")
        costs = (
            ("buffer_cost", buffer_cost),
            ("producer_buffer_cost", producer_buffer_cost),
            ("notification_cost", notification_cost),
            ("sender_cost", sender_cost),
        )
        for name, cost in costs:
            if not (cost >= 0 and math.isfinite(cost)):
                raise ConfigError(name, cost, "a finite time >= 0 s")
        if not (warmup >= 0 and math.isfinite(warmup)) or (duration is not None and warmup >= duration):
            raise ConfigError("warmup", warmup, f"a time >= 0 s and below the duration ({duration} s)")
        if threading not in ("loop", "netty"):
            raise ConfigError("threading", threading, "'loop' (this package's runtime) or 'netty' (Flink's threads)")
        if network_threads is not None and (
            isinstance(network_threads, bool) or not isinstance(network_threads, int) or network_threads < 1
        ):
            raise ConfigError(
                "network_threads", network_threads, "an integer >= 1 per host, or None (one per connection)"
            )
        if flush_model not in ("1.5", "1.4"):
            raise ConfigError("flush_model", flush_model, "'1.5' (current Flink) or '1.4' (flush finishes buffers)")
        self.flush_model = flush_model
        self.progress = progress
        self.progress_steps = max(1, progress_steps)
        if record_size < 1 or batch_records < 1:
            raise ConfigError("record_size", (record_size, batch_records), "record_size and batch_records >= 1")
        self.config = config
        self.settings = Settings.of(config)  # the task engine's reading of the settings (flush rule)
        self.duration = duration
        self.warmup = warmup
        #: Each consumer's numBytesIn and numRecordsIn at the end of the warm-up (None until then).
        self._bytes_at_warmup: list[int] | None = None
        self._records_at_warmup: list[int] | None = None
        self.check_invariants = check_invariants
        self.buffer_cost = buffer_cost
        self.max_steps = max_steps
        self.sample_interval = sample_interval
        self.clock = VirtualClock()
        scale = record_size if rate_unit == "records" else 1
        producer_rates = [r * scale for r in per_subtask(producer_rate, num_producers, "producer_rate")]
        consumer_rates = [r * scale for r in per_subtask(consumer_rate, num_consumers, "consumer_rate")]
        for name, rates in (("producer_rate", producer_rates), ("consumer_rate", consumer_rates)):
            if any(not (r > 0 and math.isfinite(r)) for r in rates):
                raise ConfigError(name, rates, "finite rates > 0")
        if host_bandwidth is not None and not (host_bandwidth > 0 and math.isfinite(host_bandwidth)):
            raise ConfigError("host_bandwidth", host_bandwidth, "bytes per virtual second > 0, or None (no limit)")
        producer_starts = per_subtask(producer_start, num_producers, "producer_start")
        self.consumer_starts = per_subtask(consumer_start, num_consumers, "consumer_start")
        for name, starts in (("producer_start", producer_starts), ("consumer_start", self.consumer_starts)):
            if any(not (t >= 0 and math.isfinite(t)) for t in starts):
                raise ConfigError(name, starts, "finite virtual times >= 0 s")
        totals = per_subtask(bytes_per_producer, num_producers, "bytes_per_producer")
        totals = [math.inf if t is None else t for t in totals]
        if consumers_of == "all_to_all":
            wiring = [list(range(num_consumers)) for _ in range(num_producers)]
        elif consumers_of == "forward":
            if num_producers != num_consumers:
                raise ConfigError("consumers_of", "forward", "equal producer and consumer parallelism")
            wiring = [[p] for p in range(num_producers)]
        elif callable(consumers_of):
            wiring = [list(consumers_of(p)) for p in range(num_producers)]
            if any(len(set(consumers)) != len(consumers) for consumers in wiring):
                # the runtimes' rows name a channel by the subtask at its other end: one channel per pair
                raise ConfigError("consumers_of", consumers_of, "each consumer at most once per producer")
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

        if channel_weights is not None:
            weights = [list(w) for w in channel_weights]
            if len(weights) != num_producers or any(
                len(w) != len(c) or min(w, default=0) < 0 or not sum(w) > 0 or not all(map(math.isfinite, w))
                for w, c in zip(weights, wiring, strict=True)
            ):
                raise ConfigError(
                    "channel_weights",
                    _short_weights(channel_weights),
                    "per producer, one finite weight >= 0 per subpartition, summing to > 0",
                )
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
        self.producers: list[SimulatedProducer] = []
        for p, consumers in enumerate(wiring):
            host = self.producer_hosts[p]
            partition = PipelinedResultPartition.create(
                self.network_pools[host], len(consumers), config, partition_id=p
            )
            self.managers[host].register_partition(partition)
            self.producers.append(
                SimulatedProducer(
                    self,
                    p,
                    partition,
                    consumers,
                    producer_rates[p],
                    totals[p],
                    record_size,
                    batch_records,
                    producer_buffer_cost,
                    flush_model,
                    notification_cost,
                    None if channel_weights is None else list(channel_weights[p]),
                    threading,
                    producer_starts[p],
                )
            )

        # consumers, channels, connections
        self.connections: dict[Hashable, MemoryConnection] = {}
        self.network = MemoryNetwork()
        self._pump_at: dict[MemoryConnection, float] = {}
        self._sender_hosts: dict[MemoryConnection, int] = {}
        self.consumers: list[SimulatedConsumer] = []
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

        process_of = {"host": lambda host, side, index: host, "subtask": lambda host, side, index: (side, index)}[
            processes
        ]

        def producer_at(p: int) -> Endpoint:
            host = self.producer_hosts[p]
            return Endpoint(p, host, process_of(host, "producer", p))

        def consumer_at(c: int) -> Endpoint:
            host = self.consumer_hosts[c]
            return Endpoint(c, host, process_of(host, "consumer", c))

        #: Each host's bandwidth, shared by every connection it sends on (none without ``host_bandwidth``).
        self._host_bandwidth = {h: SharedBandwidth(host_bandwidth) for h in hosts} if host_bandwidth else {}
        for c, channels in enumerate(producers_of):
            host = self.consumer_hosts[c]
            late = self.consumer_starts[c] > 0
            routes = [channel_route(producer_at(p), consumer_at(c), "executor", connections) for p, _ in channels]
            remote_count = sum(1 for r in routes if not r.is_local)
            gate = SingleInputGate(self.network_pools[host], len(channels), config, num_remote_channels=remote_count)
            origins = []
            for index, ((p, sp), route) in enumerate(zip(channels, routes)):
                producer_host = self.producer_hosts[p]
                if route.kind == DIRECT:
                    gate.local_channel(index, self.managers[host], partition_id=p, subpartition=sp)
                    origins.append((p, sp, True))
                    continue
                # a consumer that starts late connects on connections of its own: a shared one may have closed by
                # then, its other consumers done (Flink's factory then opens a new one too)
                key = (route.connection, "consumer", c) if late else route.connection
                connection = self.connections.get(key)
                if connection is None:
                    client = CreditBasedPartitionRequestClientHandler(credit_based=config.credit_based)
                    server = PartitionRequestServerHandler(
                        self.managers[producer_host],
                        credit_based=config.credit_based,
                    )
                    shared = (self._host_bandwidth.get(host), self._host_bandwidth.get(producer_host))
                    connection = self.network.connect(client, server, **link, shared=shared)
                    self.connections[key] = connection
                    self._sender_hosts[connection] = producer_host
                receiver_id += 1
                if route.kind == LOCAL:  # a local channel through the connection
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
            self.consumers.append(
                SimulatedConsumer(
                    self,
                    c,
                    gate,
                    consumer_rates[c],
                    [p for p, _ in channels],
                    [sp for _, sp in channels],
                    [len(wiring[p]) for p, _ in channels],
                    record_size,
                )
            )
        if sender_cost:
            self._share_network_threads(sender_cost, network_threads)
        self.timeline: list[MetricRow] = []
        self.coordinator = CheckpointCoordinator(config.checkpoint_interval_ms / 1000.0)
        self.steps = 0
        self.invariant_checks = 0
        #: Per producer: (segments held, pool size) at the last invariant check.
        self.pool_seen: dict[int, tuple[int, int]] = {}

    def _share_network_threads(self, sender_cost: float, threads: int | None) -> None:
        """Each connection's sender spends ``sender_cost`` per message times the connections that share its
        network thread (a producer host's connections dealt to its ``threads`` round robin)."""
        served: dict[int, list[MemoryConnection]] = {}
        for connection, host in self._sender_hosts.items():
            served.setdefault(host, []).append(connection)
        for connections in served.values():
            n = len(connections)
            t = threads or n
            for i, connection in enumerate(connections):  # thread i % t serves connections i % t, i % t + t, ...
                connection.set_sender_cost(sender_cost * len(range(i % t, n, t)))

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
        at = self.coordinator.tick(now, self.producers, self.consumers)
        if at is not None:
            self.clock.schedule(at, self._trigger_checkpoint)

    def _sample(self, now: float) -> None:
        sample(self, now)
        if not all(c.finished for c in self.consumers) and self.sample_interval:
            self.clock.schedule(now + self.sample_interval, self._sample)

    def _check_invariants(self) -> None:
        check_invariants(self)

    def run(self) -> SimulationReport:
        """Run to completion (or to ``duration``); raises :class:`SimulationStalledError` on a deadlock.

        The topology built (millions of objects at hundreds of tasks) is moved out of the cyclic garbage
        collector's generations for the run (``gc.freeze``): it lives as long as the run, and every full
        collection walked all of it again (a few seconds each at 800 tasks). The collector is then paused until
        the run ends: a run makes no garbage in reference cycles (a collection at the end of runs of 16,384 and
        160,000 channels found none), while its collections, walking the buffers and rows in flight, took a
        tenth of its CPU time with the default thresholds and still about 5% with a hundred times fewer.
        Nothing in the run depends on when a collection happens (no finalizers), so the results are the same."""
        if len(self.producers) * len(self.consumers) < _FREEZE_FROM_CHANNELS:
            return self._run()  # a small topology: a collection before the run would cost more than it saves
        gc.collect()
        gc.freeze()
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            gc.freeze()  # what the run made and kept (the report's rows) goes to the oldest generation with the
            gc.unfreeze()  # topology: the first collection after the run would otherwise walk all of it as young
            if enabled:
                gc.enable()

    def _run(self) -> SimulationReport:
        for consumer, start in zip(self.consumers, self.consumer_starts, strict=True):
            if start > 0:  # its gate is set up now (its exclusive buffers taken, as a deployed task's), read later
                consumer.gate.setup()
                self.clock.schedule(start, functools.partial(self._start_consumer, consumer=consumer))
            else:
                consumer.gate.request_partitions()
                consumer.start(0.0)
        for producer in self.producers:
            producer.start()
        if self.config.checkpoint_interval_ms > 0:
            self.clock.schedule(self.config.checkpoint_interval_ms / 1000.0, self._trigger_checkpoint)
        for connection in self.connections.values():
            self.network.mark(connection)
        if self.sample_interval:
            self.clock.schedule(0.0, self._sample)
        if self.warmup > 0:
            self.clock.schedule(self.warmup, self._end_warmup)
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
            if self.progress is not None and self.steps % self.progress_steps == 0:
                self.progress(clock.now)
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

    def _start_consumer(self, now: float, consumer: SimulatedConsumer) -> None:
        """A consumer that starts late (``consumer_start``): its partition requests go out now (each connection's
        client has the network pump it), until then its producers' subpartitions keep what they were given."""
        consumer.gate.request_partitions()
        consumer.start(now)

    def _end_warmup(self, now: float) -> None:
        self._bytes_at_warmup = [self._bytes_in(consumer) for consumer in self.consumers]
        self._records_at_warmup = [self._records_in(consumer) for consumer in self.consumers]

    @staticmethod
    def _bytes_in(consumer: SimulatedConsumer) -> int:
        return sum(r.num_bytes_in for r in consumer.engine.readers)

    @staticmethod
    def _records_in(consumer: SimulatedConsumer) -> int:
        return sum(r.num_records_in for r in consumer.engine.readers)

    def _describe_state(self) -> str:
        waiting = [p.index for p in self.producers if p.waiting_since is not None]
        open_consumers = [c.index for c in self.consumers if not c.finished]
        paused = sum(1 for c in self.connections.values() if not c.client.is_reading)
        return f"producers waiting for buffers {waiting}, consumers not finished {open_consumers}, paused {paused}"

    def _report(self, finished: bool) -> SimulationReport:
        end = self.clock.now
        window = (self.duration if self.duration is not None else end) - self.warmup
        at_warmup = self._bytes_at_warmup or [0] * len(self.consumers)
        records_at_warmup = self._records_at_warmup or [0] * len(self.consumers)
        rows: list[MetricRow] = []
        for producer in self.producers:
            rows.extend(producer.metric_rows(end))
            if producer.finish_time is not None:
                rows.append(MetricRow(PRODUCER, producer.index, None, FINISH_TIME, "total", producer.finish_time * 1e3))
        intact = True
        written = [producer.records_written for producer in self.producers]  # once each, not once per channel
        origins: dict[tuple[int, int], ChannelOrigin] = {}
        for consumer in self.consumers:
            c = consumer.index
            rows.extend(consumer.metric_rows(end))
            bytes_per_channel = consumer.bytes_per_channel
            for index, (p, sp, local) in enumerate(self._channel_origin[c]):
                origins[(c, p)] = ChannelOrigin(sp, local)
                rows.append(MetricRow(CONSUMER, c, p, DATA_BYTES_IN, "total", float(bytes_per_channel[index])))
                intact = intact and consumer.in_order[index] and consumer.records_per_channel[index] == written[p][sp]
            if consumer.finish_time is not None:
                rows.append(MetricRow(CONSUMER, c, None, FINISH_TIME, "total", consumer.finish_time * 1e3))
            bytes_in = self._bytes_in(consumer) - at_warmup[c]
            rows.append(
                MetricRow(CONSUMER, c, None, BYTES_IN_PER_SECOND, "mean", bytes_in / window if window > 0 else 0.0)
            )
            records_in = self._records_in(consumer) - records_at_warmup[c]
            rows.append(
                MetricRow(CONSUMER, c, None, RECORDS_IN_PER_SECOND, "mean", records_in / window if window > 0 else 0.0)
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
            data_intact=intact,
            hosts={PRODUCER: list(self.producer_hosts), CONSUMER: list(self.consumer_hosts)},
            channel_origins=origins,
            rows=rows,
            timeline=self.timeline,
            buffers_returned=returned,
            connection_pauses=sum(c.client.num_times_paused for c in self.connections.values()),
            messages=sum(c.upstream.messages_sent + c.downstream.messages_sent for c in self.connections.values()),
        )


def simulate(config: NetworkConfig | None = None, **kwargs) -> SimulationReport:
    """Build a :class:`Simulation` with ``kwargs`` and run it."""
    return Simulation(config or NetworkConfig(), **kwargs).run()
