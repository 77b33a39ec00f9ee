"""A deterministic in-memory transport between a client and a server connection handler.

:class:`MemoryConnection` joins a :class:`~spark_credit_shuffle.protocol.CreditBasedPartitionRequestClientHandler`
(consumer side) and a :class:`~spark_credit_shuffle.protocol.PartitionRequestServerHandler` (producer side)
like a TCP connection would. Each direction is a link that takes one message at a time from its sender
while it is writable: with a ``bandwidth`` (bytes per virtual second) a message occupies the link for
``size / bandwidth``, then arrives ``latency`` later; a ``sender_cost`` (virtual seconds per message) keeps the
server's side busy that much longer per message it sends, as a network thread that builds and writes each
buffer (it takes the next message from its queue only when done, so data written meanwhile goes with it);
``socket_buffer_bytes`` bounds the bytes written but not yet read by the other side (TCP's send and receive
buffers), so a receiver that stops reading stops its sender too. ``shared`` gives each side a
:class:`SharedBandwidth` it sends on together with other connections (its machine's), one message after
another. Without bandwidth and latency everything moves at once.

Time is an argument (``pump(now)``): the transport reads no clock and is driven either directly (tests,
benchmarks, the in-process blocking exchange) or by the virtual-clock simulation. With ``encode=True``
every message goes through the wire codec, so the framing is exercised too.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator

from ..buffers.buffer import Buffer, DataType
from ..buffers.pools import NetworkBufferPool
from ..config import DEFAULT_SEGMENT_SIZE, NetworkConfig
from ..errors import ProtocolError
from ..protocol.client import CreditBasedPartitionRequestClientHandler
from ..protocol.codec import FrameDecoder, default_max_frame_length, encode, encoded_size
from ..protocol.gate import BufferOrEvent, SingleInputGate
from ..protocol.messages import BufferResponse, Message
from ..protocol.partition import ResultPartitionManager
from ..protocol.sender import PartitionRequestServerHandler
from ..protocol.subpartition import BufferAvailabilityListener, PipelinedSubpartition, PipelinedSubpartitionView

#: The frame of a BufferResponse without its payload (``encoded_size``'s).
_BUFFER_RESPONSE_FRAME = encoded_size(BufferResponse(0, 0, 0, 0, DataType.DATA_BUFFER, False, b""))

__all__ = ["Link", "MemoryConnection", "MemoryNetwork", "SharedBandwidth", "StoredBuffersExchange"]


class SharedBandwidth:
    """Bytes per virtual second that several links move together, one message after another: the CPU of a
    machine whose processes copy, frame and decode every message, shared by all its connections. A link that
    takes a message starts it once this is free (``busy_until``) and holds it ``size / bandwidth``."""

    __slots__ = ("bandwidth", "busy_until")

    def __init__(self, bandwidth: float) -> None:
        if not (bandwidth > 0 and math.isfinite(bandwidth)):
            raise ValueError(f"bandwidth must be > 0 bytes per virtual second, got {bandwidth}")
        self.bandwidth = bandwidth
        self.busy_until = 0.0


class Link:
    """One direction of a connection: messages in flight, in order, with their arrival times."""

    __slots__ = (
        "bandwidth",
        "busy_until",
        "bytes_sent",
        "capacity",
        "cost",
        "decoder",
        "deliver",
        "encode",
        "is_reading",
        "latency",
        "messages_sent",
        "queue",
        "queued_bytes",
        "shared",
        "source",
        "timed",
    )

    def __init__(
        self,
        source: Callable[[], Message | None],
        deliver: Callable[[Message], None],
        is_reading: Callable[[], bool],
        *,
        latency: float,
        bandwidth: float | None,
        capacity: int | None,
        encode_frames: bool,
        max_frame_length: int,
        cost: float = 0.0,
        shared: SharedBandwidth | None = None,
    ) -> None:
        self.source = source
        self.deliver = deliver
        self.is_reading = is_reading
        self.latency = latency
        self.bandwidth = bandwidth
        self.capacity = capacity
        #: Virtual seconds the sender spends on each message, besides its bytes on the wire.
        self.cost = cost
        #: The bandwidth this link shares with others (its sender's machine), on top of its own.
        self.shared = shared
        self.timed = latency > 0 or bandwidth is not None or cost > 0 or shared is not None
        self.encode = encode_frames
        self.decoder = FrameDecoder(max_frame_length) if encode_frames else None
        self.queue: deque[tuple[float, Message | bytes, int]] = deque()
        self.queued_bytes = 0
        self.busy_until = 0.0
        self.messages_sent = 0
        self.bytes_sent = 0

    def send(self, now: float) -> int:
        """Take messages from the sender while the link is writable at ``now``; the number taken."""
        if self.bandwidth is None and not self.encode and not self.cost and self.shared is None:
            return self._send_unlimited(now)
        taken = 0
        capacity = self.capacity
        timed = self.timed
        need_size = timed or capacity is not None
        queue = self.queue
        while now >= self.busy_until and (capacity is None or self.queued_bytes < capacity):
            message = self.source()
            if message is None:
                break
            size = encoded_size(message) if need_size or self.encode else 0
            if timed:
                start = max(now, self.busy_until)
                shared = self.shared
                if shared is not None:  # after what the other links took before it, on the shared bandwidth
                    start = max(start, shared.busy_until)
                    start = shared.busy_until = start + size / shared.bandwidth
                done = start + self.cost + (size / self.bandwidth if self.bandwidth else 0.0)
                self.busy_until = done
                arrival = done + self.latency
            else:
                arrival = now
            item = b"".join(bytes(c) for c in encode(message)) if self.encode else message
            queue.append((arrival, item, size))
            self.queued_bytes += size
            self.messages_sent += 1
            self.bytes_sent += size
            taken += 1
        return taken

    def _send_unlimited(self, now: float) -> int:
        """:meth:`send` for a link without bandwidth or encoding (the simulation's): a message occupies the
        link for no time, so every message taken at ``now`` arrives at ``now + latency``; the same queue,
        sizes and counts, with one arrival time computed per call instead of per message."""
        capacity = self.capacity
        queued = self.queued_bytes
        if now < self.busy_until or (capacity is not None and queued >= capacity):
            return 0
        timed = self.timed
        need_size = timed or capacity is not None
        arrival = now + self.latency if timed else now
        source = self.source
        append = self.queue.append
        sent = 0
        taken = 0
        while True:
            message = source()
            if message is None:
                break
            if not need_size:
                size = 0
            elif type(message) is BufferResponse:
                size = _BUFFER_RESPONSE_FRAME + len(message.payload)
            else:
                size = encoded_size(message)
            append((arrival, message, size))
            queued += size
            sent += size
            taken += 1
            if capacity is not None and queued >= capacity:
                break
        if taken:
            self.queued_bytes = queued
            self.messages_sent += taken
            self.bytes_sent += sent
            if timed:
                self.busy_until = now  # where a message of no duration leaves the link (as in send)
        return taken

    def receive(self, now: float) -> int:
        """Deliver the messages that arrived by ``now`` while the receiver reads; the number delivered."""
        queue = self.queue
        if not queue or queue[0][0] > now:
            return 0
        delivered = 0
        deliver = self.deliver
        is_reading = self.is_reading
        decoder = self.decoder
        while queue and queue[0][0] <= now and is_reading():
            _, item, size = queue.popleft()
            self.queued_bytes -= size
            if isinstance(item, bytes):
                assert decoder is not None  # only a link that encodes queues frames
                for message in decoder.receive_data(item):
                    deliver(message)
            else:
                deliver(item)
            delivered += 1
        return delivered

    def next_arrival(self) -> float | None:
        return self.queue[0][0] if self.queue else None

    def in_flight(self) -> list[Message]:
        """The messages written and not yet delivered (decoded again when the link encodes)."""
        decoder = FrameDecoder(self.decoder.max_frame_length) if self.decoder is not None else None
        out: list[Message] = []
        for _, item, _ in self.queue:
            if isinstance(item, bytes):
                assert decoder is not None  # only a link that encodes queues frames
                out.extend(decoder.receive_data(item))
            else:
                out.append(item)
        return out


class MemoryConnection:
    """A connection between one client handler and one server handler, in memory."""

    def __init__(
        self,
        client: CreditBasedPartitionRequestClientHandler,
        server: PartitionRequestServerHandler,
        *,
        latency: float = 0.0,
        bandwidth: float | None = None,
        socket_buffer_bytes: int | None = None,
        encode: bool = False,
        max_frame_length: int = default_max_frame_length(DEFAULT_SEGMENT_SIZE),
        sender_cost: float = 0.0,
        shared: tuple[SharedBandwidth | None, SharedBandwidth | None] = (None, None),
    ) -> None:
        if latency < 0:
            raise ValueError(f"latency must be >= 0 virtual seconds, got {latency}")
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes per virtual second, got {bandwidth}")
        if socket_buffer_bytes is not None and socket_buffer_bytes <= 0:
            raise ValueError(f"socket_buffer_bytes must be > 0, got {socket_buffer_bytes}")
        self.client = client
        self.server = server

        def link(
            source: Callable[[], Message | None],
            deliver: Callable[[Message], None],
            is_reading: Callable[[], bool],
            on: SharedBandwidth | None,
        ) -> Link:
            return Link(
                source,
                deliver,
                is_reading,
                latency=latency,
                bandwidth=bandwidth,
                capacity=socket_buffer_bytes,
                encode_frames=encode,
                max_frame_length=max_frame_length,
                shared=on,
            )

        client_side, server_side = shared
        self.upstream = link(client.next_message, server.receive_message, lambda: True, client_side)
        self.downstream = link(server.next_message, client.receive_message, lambda: client.is_reading, server_side)
        # the fast pumps below move messages without a shared bandwidth's busy time: only without one
        unshared = client_side is None and server_side is None
        if unshared and latency == 0 and bandwidth is None and socket_buffer_bytes is None and not encode:
            # nothing is ever held on the links: every pump hands each message straight to the other side
            client_parts = (client.next_message, client.receive_message, client._outbound)
            server_parts = (server.next_message, server.receive_message, server.queue._outbox)
            self._parts = (*client_parts, *server_parts, server.queue.available_readers)
            self.pump = self._pump_direct  # type: ignore[method-assign]  # no link test on every pump
        elif unshared and bandwidth is None and not encode:  # latency and a socket buffer only: the simulation's
            self.pump = self._pump_unlimited  # type: ignore[method-assign]
            self.next_event_time = self._next_event_unlimited  # type: ignore[method-assign]
        if sender_cost:
            self.set_sender_cost(sender_cost)

    def set_sender_cost(self, cost: float) -> None:
        """The server's side spends ``cost`` virtual seconds on each message it sends from now on (see the
        module's docstring); the connection then takes the generic pump, which heeds the sender's busy time."""
        if not (cost >= 0 and math.isfinite(cost)):
            raise ValueError(f"sender_cost must be a finite time >= 0 virtual seconds, got {cost}")
        self.downstream.cost = cost
        self.downstream.timed = self.downstream.timed or cost > 0
        if cost:  # the fast pumps chosen at construction move messages without the sender's busy time
            self.__dict__.pop("pump", None)
            self.__dict__.pop("next_event_time", None)

    def pump(self, now: float = 0.0) -> int:
        """Move every message that can move at ``now`` (both ways, until nothing changes); the count moved."""
        up, down = self.upstream, self.downstream
        moved = 0
        while True:
            step = up.send(now) + up.receive(now) + down.send(now) + down.receive(now)
            if not step:
                return moved
            moved += step

    def _pump_direct(self, now: float = 0.0) -> int:
        """:meth:`pump` with no latency, bandwidth, socket buffer or encoding: each message goes straight to
        the other side (the handlers' queues are read directly: this is the hot loop of every simulation
        and benchmark)."""
        client_next, client_receive, client_outbound, server_next, server_receive, server_outbox, server_readers = (
            self._parts
        )
        client = self.client
        up = down = 0
        while True:
            before = up + down
            while client_outbound and (request := client_next()) is not None:
                server_receive(request)
                up += 1
            while (server_outbox or server_readers) and client.is_reading and (response := server_next()) is not None:
                client_receive(response)
                down += 1
            if up + down == before:
                self.upstream.messages_sent += up
                self.downstream.messages_sent += down
                return up + down

    def _pump_unlimited(self, now: float = 0.0) -> int:
        """:meth:`pump` over links without bandwidth or encoding (each link's :meth:`Link.send` for them
        called directly)."""
        up, down = self.upstream, self.downstream
        up_send, up_receive, down_send, down_receive = (
            up._send_unlimited,
            up.receive,
            down._send_unlimited,
            down.receive,
        )
        moved = 0
        while True:
            step = up_send(now) + up_receive(now) + down_send(now) + down_receive(now)
            if not step:
                return moved
            moved += step

    def _next_event_unlimited(self, now: float) -> float | None:
        """:meth:`next_event_time` over links without bandwidth (the same answer, without the generic loop)."""
        up, down = self.upstream, self.downstream
        at: float | None = None
        queue = up.queue
        if queue and queue[0][0] > now:
            at = queue[0][0]
        if up.busy_until > now and self.client.has_data() and (at is None or up.busy_until < at):
            at = up.busy_until
        queue = down.queue
        if queue and queue[0][0] > now and (at is None or queue[0][0] < at):
            at = queue[0][0]
        if down.busy_until > now and self.server.has_data() and (at is None or down.busy_until < at):
            at = down.busy_until
        return at

    def next_event_time(self, now: float) -> float | None:
        """The earliest virtual time after ``now`` at which :meth:`pump` can do something new."""
        times = []
        for link, has_data in (
            (self.upstream, self.client.has_data),
            (self.downstream, self.server.has_data),
        ):
            arrival = link.next_arrival()
            if arrival is not None and arrival > now:
                times.append(arrival)
            if link.busy_until > now and has_data():
                times.append(link.busy_until)
        return min(times) if times else None

    def data_in_flight(self, receiver_id: int) -> int:
        """Data buffers written for ``receiver_id`` and not yet delivered (for credit invariant checks)."""
        return sum(
            1
            for m in self.downstream.in_flight()
            if type(m) is BufferResponse and m.receiver_id == receiver_id and m.data_type.is_buffer and m.size
        )


class MemoryNetwork:
    """In-memory connections, each pumped when one of its handlers says it has something to move: the
    pump of the blocking replay and of the simulation (which also asks when a connection with latency or
    bandwidth can move more: :meth:`pump`'s ``later``)."""

    def __init__(self) -> None:
        self.connections: list[MemoryConnection] = []
        self._dirty: dict[MemoryConnection, None] = {}

    def connect(
        self,
        client: CreditBasedPartitionRequestClientHandler,
        server: PartitionRequestServerHandler,
        **link: object,
    ) -> MemoryConnection:
        """A :class:`MemoryConnection` between ``client`` and ``server`` (``link``: its latency, bandwidth,
        socket buffer, encoding), pumped whenever either handler has something new."""
        connection = MemoryConnection(client, server, **link)  # type: ignore[arg-type]  # link: MemoryConnection's keywords
        dirty = self._dirty

        def mark() -> None:
            dirty[connection] = None

        client.listener = server.queue.listener = mark
        self.connections.append(connection)
        dirty[connection] = None
        return connection

    def mark(self, connection: MemoryConnection) -> None:
        """Pump ``connection`` at the next :meth:`pump` (its link can move more now)."""
        self._dirty[connection] = None

    def pump(self, now: float = 0.0, later: Callable[[MemoryConnection, float], None] | None = None) -> None:
        """Pump every connection with something to move at ``now`` until none has; ``later(connection, t)``
        is told the next time a connection can move more (messages in flight, a busy link)."""
        dirty = self._dirty
        while dirty:
            connection = next(iter(dirty))
            del dirty[connection]
            connection.pump(now)
            if later is not None:
                at = connection.next_event_time(now)
                if at is not None:
                    later(connection, at)


class StoredBuffersExchange:
    """A consumer subtask's input gate fed, in process, with the stored buffers of each of its producers.

    The blocking exchange's consumer side. Stored buffers are pushed as they come out of storage
    (:meth:`add`: channel ``i``'s buffers in the order producer ``i`` stored them, ending with
    END_OF_PARTITION); each channel queues them in a subpartition on the sending side of a connection of its
    own and they reach the gate's remote input channel only as BufferResponses a credit allowed: exclusive
    and floating buffers, backlog and AddCredit work exactly as over TCP, so at most the gate's buffers are
    held on the receiving side. :meth:`poll` returns :class:`BufferOrEvent` items; recycle each buffer when
    done with it. A consumer that holds every receive buffer gets a :class:`ProtocolError` when it iterates,
    not a hang.
    """

    def __init__(
        self,
        config: NetworkConfig,
        num_channels: int,
        *,
        network_pool: NetworkBufferPool | None = None,
        encode: bool = False,
    ) -> None:
        if num_channels < 1:
            raise ValueError("a gate needs at least one source channel")
        self.network_pool = network_pool if network_pool is not None else NetworkBufferPool.from_config(config)
        self.gate = SingleInputGate(self.network_pool, num_channels, config, blocking=True)
        manager = ResultPartitionManager()
        self.network = MemoryNetwork()
        self.connections = self.network.connections
        self._subpartitions: list[PipelinedSubpartition] = []
        max_frame = default_max_frame_length(config.segment_size)
        exclusive = self.gate.spec.exclusive_per_channel
        for index in range(num_channels):
            stored = _StoredPartition(index, exclusive)
            self._subpartitions.append(stored.subpartition)
            manager.register_partition(stored)
            client = CreditBasedPartitionRequestClientHandler(
                credit_based=config.credit_based, max_frame_length=max_frame
            )
            server = PartitionRequestServerHandler(
                manager, credit_based=config.credit_based, max_frame_length=max_frame
            )
            self.network.connect(client, server, encode=encode, max_frame_length=max_frame)
            self.gate.remote_channel(index, index + 1, client, partition_id=index)
        self.gate.request_partitions()
        self._pump = self.network.pump

    def add(self, channel: int, data_type: DataType, payload: object) -> None:
        """Queue one stored buffer of ``channel``; END_OF_PARTITION ends the channel."""
        subpartition = self._subpartitions[channel]
        if data_type is DataType.END_OF_PARTITION:
            subpartition.finish()
        else:
            subpartition.add(Buffer(data_type, payload))

    def poll(self) -> BufferOrEvent | None:
        """The next buffer or event, or None if none can arrive until more is added or held buffers recycled."""
        self._pump()
        item = self.gate.poll_next()
        if item is not None:
            return item
        self._pump()
        return self.gate.poll_next()

    def __iter__(self) -> Iterator[BufferOrEvent]:
        """Every item until the gate finished; everything must have been added before."""
        while not self.gate.is_finished:
            item = self.poll()
            if item is None:
                raise ProtocolError(
                    "stored-buffer exchange stalled: every receive buffer of the gate is held by the consumer "
                    "or a channel's end of partition was never added; recycle the buffers already returned"
                )
            yield item

    @property
    def is_finished(self) -> bool:
        return self.gate.is_finished

    def sender_credit(self, channel: int) -> int:
        """Credits the sending side of ``channel`` holds now (0 once the channel finished)."""
        reader = self.connections[channel].server.queue.all_readers.get(channel + 1)
        return reader.num_credits_available if reader is not None else 0

    def close(self) -> None:
        """Release the gate and its connections (buffers still held return when recycled)."""
        self.gate.close()
        self._pump()


class _StoredPartition:
    """The stored output of one producer for this consumer, served as it arrives from storage."""

    def __init__(self, partition_id: int, receiver_exclusive_buffers: int) -> None:
        self.partition_id = partition_id
        self.subpartition = PipelinedSubpartition(0, None, receiver_exclusive_buffers)

    def create_subpartition_view(
        self, subpartition: int, listener: BufferAvailabilityListener
    ) -> PipelinedSubpartitionView:
        return self.subpartition.create_read_view(listener)
