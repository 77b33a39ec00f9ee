"""The wiring of a pipelined task: its sockets, its connections to the other tasks, its end.

:class:`TaskWiring` holds what the task's threads share (the lock and its condition, the failure, the
transport, the network buffer pool, the partition and the gate) and does what involves the other tasks:
listening, the address exchange, one connection per remote producer task carrying all its channels (local
ones too, for tasks of one executor), the messages that count as progress, describing who holds buffers
or connections, waiting for the end of the exchange (the rule is the engine's :func:`~.engine.check_end`)
and closing everything. A :class:`~spark_credit_shuffle.runtime.pipelined.task.PipelinedTask` owns one and runs the
threads around it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ...engine import ConsumerEngine, Fail, Settings, check_end
from ...engine.checkpoints import CheckpointTrigger
from ...errors import CreditShuffleError, ExchangeTimeoutError, in_subtask, qualified_name
from ...metrics import PRODUCER
from ...planner.channels import DIRECT, LOCAL, ChannelRoute, Endpoint, channel_route
from ...protocol import (
    AddCredit,
    CreditBasedPartitionRequestClientHandler,
    NetworkBufferPool,
    PartitionRequestServerHandler,
    PipelinedResultPartition,
    RecycleBuffers,
    ResultPartitionManager,
    SingleInputGate,
)
from ...protocol.codec import default_max_frame_length
from ...transport.authentication import AUTHENTICATION_TIMEOUT_S, unauthenticated_cap
from ...transport.connection import Connection
from ...transport.tcp import TcpTransport
from ...transport.tls import TlsIdentity
from ..monitor import MonitorClient
from .rendezvous.client import group_token

if TYPE_CHECKING:
    from ...protocol.messages import Message
    from ..exchange_plan import ExchangePlan

__all__ = ["TaskWiring"]

log = logging.getLogger("spark_credit_shuffle")
#: Messages from a consumer that say it read and recycled this producer's buffers: progress for the end wait.
_PROGRESS = (AddCredit, RecycleBuffers)
#: The most bytes of a failing task's cause that its fatal ``ErrorResponse`` carries (the smallest frame a
#: connection accepts holds 4 KiB and 1 KiB of room).
CAUSE_TEXT_BYTES = 4000
#: How long a failing task's transport waits, once it sent the cause, for its consumers to close their
#: connections (a lingering close, :meth:`TcpTransport.close`): they fail on reading it, within milliseconds.
CAUSE_LINGER_S = 1.0


class TaskWiring:
    """Sockets, connections and shared state of pipelined task ``index`` (see the module documentation)."""

    def __init__(
        self,
        plan: ExchangePlan,
        index: int,
        secret: bytes,
        host: str,
        settings: Settings,
        *,
        announce_address_dir: str | None = None,
        attempt_id: int = 0,
        executors: Sequence[object] | None = None,
        tls: TlsIdentity | None = None,
    ) -> None:
        self.plan = plan
        self.settings = settings
        self.announce_address_dir = announce_address_dir
        self.tls = tls
        self.index = index
        self.executors = list(executors) if executors is not None else None
        self.secret = secret
        self.host = host
        config = plan.config
        self.config = config
        self.is_producer = index < plan.num_producers
        self.is_consumer = index < plan.num_consumers
        self.partition_id = int(attempt_id) & 0xFFFF_FFFF_FFFF
        #: Guards the protocol objects: the loop holds it for each round's work, the other threads take it
        #: for their few moments with them (set-up, the end, the metrics); ``cond`` wakes the end's wait.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        #: What the task's loop is told: the gate went from empty to holding data; the task failed (with what).
        self.on_gate: Callable[[], None] | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self.max_frame_length = default_max_frame_length(config.segment_size)
        self._failure: BaseException | None = None
        self.failed_at: float | None = None  # monotonic time this task first failed (its peers fail after it)
        self.cause: BaseException | None = None  # what this task fails with, reported to its consumers
        #: Producer tasks whose connection closed before the end of a partition without saying why (no fatal
        #: ``ErrorResponse``): that task most likely failed before it could answer this one.
        self.lost_producers: set[str] = set()
        self.attempt_id = attempt_id
        self.monitor: MonitorClient | None = None  # the live monitor's sender, while the task runs
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.transport: TcpTransport | None = None
        self.network = NetworkBufferPool.from_config(config)
        self.peers: dict[int, str] = {}
        self.address_group = ""  # set by the address exchange
        self.last_progress = time.monotonic()
        self.manager = ResultPartitionManager()
        self.partition: PipelinedResultPartition | None = None
        self.subpartition_consumers: list[int] = []
        self.gate: SingleInputGate | None = None
        self.channel_producers: list[int] = []
        self.client_connections: dict[int, Connection] = {}
        self.consumer: ConsumerEngine | None = None  # the consumer half's engine, once set up
        self.checkpoint_trigger = CheckpointTrigger(
            index,
            config.checkpoint_interval_ms,
            config.checkpoint_options,
            time.time_ns,
            time.monotonic,
            acknowledged=self._checkpoint_acknowledged,
            timeout_ms=config.checkpoint_timeout_ms,
        )
        self.producer_done = True
        self.consumer_done = True

    def _checkpoint_acknowledged(self, checkpoint_id: int) -> bool:
        """Every consumer of this task's partition ended checkpoint ``checkpoint_id`` (none to wait for without
        a partition)."""
        return self.partition is None or self.partition.checkpoint_acknowledged(checkpoint_id)

    def route(self, producer: int) -> ChannelRoute:
        """The route of the channel from producer task ``producer`` to this task
        (:func:`~spark_credit_shuffle.planner.channels.channel_route`: its own, another of its executor, or
        remote)."""
        at, executors = Endpoint.pipelined_task, self.executors
        return channel_route(at(producer, executors), at(self.index, executors), self.config.local_channels)

    def is_local(self, task: int) -> bool:
        """Whether the channel from task ``task`` to this task is local (no exclusive buffers, no credit)."""
        return self.route(task).is_local

    # -- notifications (lock held) --

    def _notify(self) -> None:
        """Something happened (input processed, a connection closed): the end's wait looks again."""
        with self.cond:  # re-entrant: usually called with the lock already held
            self.cond.notify_all()

    def _on_transport_event(self) -> None:
        """Input was processed or a connection closed (lock held); a failed I/O thread fails the task."""
        transport = self.transport
        if transport is not None and transport.error is not None and self._failure is None:
            self.fail(CreditShuffleError(f"task {self.index}: the network I/O thread failed: {transport.error!r}"))
        self._notify()

    def notify_loop(self) -> None:
        """Something the loop waits for happened (a buffer back in the pool): off the loop's thread, wake it
        (on it, the round looks anyway)."""
        transport = self.transport
        if transport is not None and not transport.on_own_thread():
            transport.wakeup()

    def notify_gate(self) -> None:
        """The gate went from empty to holding data: the loop's consumer half looks."""
        if self.on_gate is not None:
            self.on_gate()
        self.notify_loop()

    @property
    def has_failed(self) -> bool:
        """Whether the task failed (:meth:`fail`)."""
        return self._failure is not None

    def fail(self, exc: BaseException) -> None:
        """The task fails with ``exc`` (the first failure stays): the Spark task thread raises it, the loop stops
        its work and the end's wait ends."""
        with self.cond:
            if self._failure is None:
                self._failure = exc
                self.failed_at = time.monotonic() if self.failed_at is None else self.failed_at
                if self.on_failure is not None:
                    self.on_failure(exc)
            self._notify()

    def pause(self, seconds: float) -> None:
        """Spend ``seconds`` as an injected slow consumer's work (:class:`~.plan.Injection`), ending early if
        the task fails meanwhile: a failed stage's tasks are killed, their user code included."""
        deadline = time.monotonic() + seconds
        with self.cond:
            while self._failure is None and not self.stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self.transport is not None and self.transport.error is not None:
            raise CreditShuffleError(
                f"task {self.index}: the network I/O thread failed: {self.transport.error!r}"
            ) from self.transport.error

    # -- sockets --

    def start_transport(self, on_round: Callable[[], float]) -> None:
        """Listen, start the I/O thread (the task's loop: ``on_round`` is its work, see
        :class:`~.loop.TaskLoop`), announce the address (if asked to)."""
        remote_consumers = {c for c in self.subpartition_consumers if c != self.index}
        self.transport = TcpTransport(
            self.host,
            self.lock,
            server_handler_factory=self._server_handler if self.is_producer else None,
            handshake_timeout_s=min(self.config.partition_request_timeout_ms / 1000.0, AUTHENTICATION_TIMEOUT_S),
            handshake_timeout_setting=f"min(partition_request_timeout_ms, {AUTHENTICATION_TIMEOUT_S * 1000:.0f} ms)",
            max_unauthenticated=unauthenticated_cap(len(remote_consumers)),
            on_event=self._on_transport_event,
            on_data_sent=self._on_data_sent,
            on_closed=self._on_connection_closed,
            on_round=on_round,
            name=f"{self.plan.name} task {self.index}",
            tls=self.tls,
        )
        self.transport.start()
        directory = self.announce_address_dir
        if directory:
            host, port = self.transport.address
            path = os.path.join(directory, f"task-{self.index}.addr")
            with open(path + ".tmp", "w") as f:
                f.write(f"{host}:{port}\n")
            os.replace(path + ".tmp", path)

    def exchange_addresses(self, all_gather: Callable[[str], list[str]]) -> None:
        """Publish this task's address (and when it started) once, learn everyone's, connect; checkpoint
        triggers fire from then on (every task runs)."""
        assert self.transport is not None
        host, port = self.transport.address
        started_ms = time.time_ns() // 1_000_000
        message = json.dumps(
            {"task": self.index, "host": host, "port": port, "partition": self.partition_id, "started_ms": started_ms}
        )
        messages = all_gather(message)
        #: The address group this task was wired with: the same for every task of it, and for no other (the
        #: end barrier's name, :func:`~.rendezvous.client.group_token`).
        self.address_group = group_token(messages)
        peers = [json.loads(m) for m in messages]
        self._connect(peers)
        self.checkpoint_trigger.arm(max(int(p.get("started_ms", 0)) for p in peers))  # every task runs now

    def _server_handler(self, wakeup: Callable[[], None]) -> PartitionRequestServerHandler:
        handler = PartitionRequestServerHandler(
            self.manager,
            credit_based=self.config.credit_based,
            secret=self.secret,
            max_frame_length=self.max_frame_length,
        )
        handler.queue.listener = wakeup
        receive = handler.receive_message

        def receive_message(message: Message) -> None:
            if type(message) in _PROGRESS:  # a consumer read (and recycled) this producer's buffers: progress
                self.last_progress = time.monotonic()
            receive(message)

        handler.receive_message = receive_message  # type: ignore[method-assign]  # observed, then handled as before
        return handler

    def _connect(self, peers: list[dict[str, Any]]) -> None:
        """Open one connection per remote producer task and request every channel's subpartition."""
        by_task = {int(p["task"]): p for p in peers}
        for task, peer in by_task.items():
            self.peers[task] = f"{peer['host']}:{peer['port']}"
        gate, transport = self.gate, self.transport
        if gate is None:
            return
        assert transport is not None
        plan = self.plan
        timeout_s = self.config.partition_request_timeout_ms / 1000.0
        for channel, producer in enumerate(self.channel_producers):
            subpartition = plan.partitioner.consumers_of(producer, plan.num_producers, plan.num_consumers).index(
                self.index
            )
            route = self.route(producer)
            if route.kind == DIRECT:
                assert self.partition is not None  # a task reading its own subpartition produces
                with self.lock:
                    gate.local_channel(
                        channel, self.partition, partition_id=self.partition_id, subpartition=subpartition
                    )
                continue
            found = by_task.get(producer)
            if found is None:
                raise CreditShuffleError(
                    f"consumer subtask {self.index}: producer subtask {producer} published no address"
                )
            peer = found
            conn = self.client_connections.get(producer)
            if conn is None:  # one connection per producer task, for its remote and local channels alike
                name = f"producer subtask {producer} at {peer['host']}:{peer['port']}"
                handler = CreditBasedPartitionRequestClientHandler(
                    credit_based=self.config.credit_based,
                    secret=self.secret,
                    max_frame_length=self.max_frame_length,
                    peer=name,
                )
                conn = transport.connect(
                    (str(peer["host"]), int(peer["port"])), handler, peer=name, timeout_s=timeout_s
                )
                self.client_connections[producer] = conn
            with self.lock:
                if route.kind == LOCAL:  # another task of this executor: no credit, its pool holds
                    gate.local_channel(
                        channel,
                        conn.handler,
                        receiver_id=channel + 1,
                        partition_id=int(peer["partition"]),
                        subpartition=subpartition,
                    )
                    continue
                gate.remote_channel(
                    channel,
                    receiver_id=channel + 1,
                    connection=conn.handler,
                    partition_id=int(peer["partition"]),
                    subpartition=subpartition,
                )
        with transport.sending(), self.lock:
            gate.setup()
            gate.request_partitions()
            if self.consumer is not None:
                self.consumer.start(time.monotonic(), time.time_ns())
            for conn in self.client_connections.values():  # closed before its channels were registered
                if conn.closed:
                    self._note_if_lost(conn)
                    raise CreditShuffleError(
                        f"consumer subtask {self.index}: the connection to {conn.peer} closed before its "
                        f"partitions were requested: {conn.error or 'closed by the producer'}"
                    )

    def _readers(self) -> Iterator[Any]:
        """The view readers of every connection this producer serves (lock held)."""
        if self.transport is None:
            return
        for conn in self.transport.connections:
            queue = getattr(conn.handler, "queue", None)
            yield from getattr(queue, "all_readers", {}).values()

    def remote_credits(self) -> dict[int, int]:
        """The credit of each subpartition a remote consumer reads (lock held); local channels have none."""
        credits: dict[int, int] = {}
        for reader in self._readers():
            view = reader.view
            if view is not None and not reader.holds_buffers:
                credits[view.parent.index] = reader.num_credits_available
        return credits

    def describe_buffer_wait(self, waited: float) -> str:
        partition = self.partition
        assert partition is not None
        pool = partition.buffer_pool
        held: dict[int, int] = {}  # per subpartition: buffers a local channel's consumer has not recycled yet
        for reader in self._readers():
            if reader.holds_buffers and reader.view is not None:
                held[reader.view.parent.index] = len(reader.held)
        stuck = []
        for sp, sub in enumerate(partition.subpartitions):
            queued = sub.queue_length()
            unrecycled = held.get(sp, 0)
            if queued or unrecycled:
                consumer = self.subpartition_consumers[sp]
                where = "local" if consumer == self.index else self.peers.get(consumer, "?")
                stuck.append(
                    (
                        queued + unrecycled,
                        f"consumer subtask {consumer} ({where}): {queued} buffers queued, "
                        + (f"{unrecycled} sent and not recycled, " if unrecycled else "")
                        + f"backlog {sub.get_buffers_in_backlog()}",
                    )
                )
        stuck.sort(reverse=True)
        names = "; ".join(text for _, text in stuck[:4]) or "no subpartition holds buffers"
        return (
            f"producer subtask {self.index} waited {waited * 1000:.0f} ms for a network buffer "
            f"(buffers_request_timeout_ms={self.config.buffers_request_timeout_ms}; pool of "
            f"{pool.current_pool_size} buffers, {pool.num_used} in use, none returned meanwhile): "
            f"its consumers are not reading: {names}"
        )

    def _on_data_sent(self, conn: Connection, buffers: int) -> None:
        """Data buffers went out (lock held): progress (events, such as keep-alives, do not count)."""
        self.last_progress = time.monotonic()

    def _on_connection_closed(self, conn: Connection) -> None:
        """A connection ended (lock held): a client connection that fails channels fails the task."""
        if conn.role != "client":
            return
        handler = conn.handler
        open_channels = [c for c in handler.input_channels.values() if not c.received_end_of_partition]
        open_channels += [v for v in handler.local_views.values() if not v.listener.received_end_of_partition]
        if open_channels:
            self._note_if_lost(conn)
        if open_channels and self._failure is None and conn.error is not None:
            hint = ""
            if conn.bytes_in == 0:  # closed before the producer answered anything: it never accepted us
                hint = (
                    " (closed before the producer answered anything; unless that task failed, its log says why: "
                    "a TLS or secret handshake it refused, or more connections waiting to authenticate there than "
                    "it allows)"
                )
            self._failure = CreditShuffleError(
                f"consumer subtask {self.index}: connection to {conn.peer} failed before the end of its "
                f"partition: {conn.error}{hint}"
            )

    def _note_if_lost(self, conn: Connection) -> None:
        """A producer's connection closed before the end of its partitions: lost, if it did not say why."""
        if conn.handler.fatal_error is None:
            self.lost_producers.add(conn.peer)

    def channel_error(self, exc: Exception) -> Exception:
        gate = self.gate
        assert gate is not None
        failed = [ch for ch, c in enumerate(gate.channels) if c is not None and getattr(c, "error", None) is not None]
        channel = failed[0] if failed else None
        if channel is None:
            return exc
        producer = self.channel_producers[channel]
        conn = self.client_connections.get(producer)
        cause = f" ({conn.error})" if conn is not None and conn.error is not None else ""
        where = "local" if producer == self.index else self.peers.get(producer, "?")
        return CreditShuffleError(
            f"consumer subtask {self.index}, channel {channel} from producer subtask {producer} ({where}): {exc}{cause}"
        )

    def connection_detail(self, producer: int, now: float) -> str:
        """What the connection to producer task ``producer`` received, for a silent channel's error."""
        conn = self.client_connections.get(producer)
        if conn is None:
            return ""
        return (
            f"; its connection received {conn.bytes_in} bytes, the last {(now - conn.last_received) * 1000:.0f} ms ago"
        )

    # -- the end --

    def await_end(self) -> None:
        """Wait until the producer finished, every subpartition was consumed and every connection closed.

        Progress is a recycled segment, a data buffer sent, or credit from a consumer. A subpartition whose
        every buffer, its end of partition included, went to a reader that is still connected waits for
        its consumer alone, which may still be working through the buffers it received (up to its exclusive
        and floating buffers, behind a slow user function): that wait counts as progress, and it ends when
        the consumer releases the subpartition or its connection closes (which releases it too)."""
        with self.cond:
            self.last_progress = time.monotonic()
            while True:
                self.raise_if_failed()
                partition = self.partition
                pending = self._pending_end()
                if (
                    pending
                    and self.producer_done
                    and partition is not None
                    and all(sub.is_released or sub.is_sent_to_reader for sub in partition.subpartitions)
                ):
                    self.last_progress = time.monotonic()
                now = time.monotonic()
                step = check_end(now, self.last_progress, self.settings, self.index, pending)
                if step is None:
                    return
                if isinstance(step, Fail):
                    raise step.error
                self.cond.wait(step.until - now)

    def _pending_end(self) -> str:
        if not self.producer_done:
            return "its producer has not finished its input"
        partition = self.partition
        if partition is not None and not all(sub.is_released for sub in partition.subpartitions):
            waiting = [
                self._consumer_name(self.subpartition_consumers[sp])
                for sp, sub in enumerate(partition.subpartitions)
                if not sub.is_released
            ]
            return "subpartitions not yet consumed by " + ", ".join(waiting)
        open_clients = [c.peer for c in self.client_connections.values() if not c.closed]
        if open_clients:
            return "connections not yet closed by " + ", ".join(open_clients)
        return ""

    def _consumer_name(self, consumer: int) -> str:
        where = "local" if consumer == self.index else self.peers.get(consumer, "?")
        return f"consumer subtask {consumer} ({where})"

    def _report_cause(self, cause: BaseException) -> bool:
        """Tell every consumer this task serves why it fails, before the connections close (Flink's fatal
        ``ErrorResponse``): their channels then fail with this first cause, which they raise in place of their
        own knock-on failure (a connection that closed), so that the driver hears the same typed error
        whichever task's failure reaches it first; an error not of this package reaches them as text, which
        their failure quotes. At most :data:`CAUSE_TEXT_BYTES` of it go: a frame holds one segment and 1 KiB.
        Whether some consumer was told."""
        remote = getattr(cause, "remote", None)
        # its own failure with the subtask that met it (a partitioner's error names no subtask yet: the consumers
        # that raise it must not be taken for where it happened); a producer's failure passed on as it came
        first = remote if remote is not None else in_subtask(cause, PRODUCER, self.index)
        if not isinstance(first, Exception):  # stopped early (the task's output closed, an interrupt): no failure
            return False
        transport = self.transport
        assert transport is not None
        text = f"{qualified_name(first)}: {first}".encode()[:CAUSE_TEXT_BYTES].decode("utf-8", "ignore")
        told = False
        try:
            with transport.sending(), self.lock:
                for conn in transport.connections:
                    if conn.role == "server" and not conn.closed:
                        conn.handler.queue.notify_fatal_error(text)
                        told = True
        except Exception as exc:  # the connections close anyway; the consumers then fail on the close
            log.info("task %d: could not report its failure to its consumers: %s", self.index, exc)
        return told

    def close(self) -> None:
        """Stop the timer, join the threads, close the sockets, release the partition and the gate."""
        self.stopping.set()
        self._notify()
        failed = self._failure is not None or self.cause is not None
        current = threading.current_thread()
        stuck = []
        for thread in self.threads:
            if thread is current:
                continue
            # A producer blocked on Spark's input cannot be interrupted; after a failure the worker exits.
            thread.join(0.5 if failed else self.config.partition_request_timeout_ms / 1000.0)
            if thread.is_alive():
                stuck.append(thread.name)
        transport_error: BaseException | None = None
        if self.transport is not None:
            linger_s = 0.0
            if self.cause is not None and self._report_cause(self.cause):
                linger_s = CAUSE_LINGER_S
            try:
                self.transport.close(self.config.partition_request_timeout_ms / 1000.0, linger_s=linger_s)
            except ExchangeTimeoutError as exc:
                transport_error = exc
        if self.monitor is not None:  # the last samples, then its thread is joined
            self.monitor.close()
        with self.lock:
            if self.gate is not None:
                self.gate.close()
            if self.partition is not None:
                self.partition.release()
        if stuck and not failed and transport_error is None:
            log.warning("task %d: threads %s did not stop in time", self.index, stuck)
        if transport_error is not None and not failed:
            raise transport_error
