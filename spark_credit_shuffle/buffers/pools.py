"""Network buffer pools: one :class:`NetworkBufferPool` per executor, :class:`LocalBufferPool` per partition
and per input gate (docs/flink.md, "Buffer pools and their sizes"; how Flink sizes them is
:mod:`spark_credit_shuffle.buffers.sizing`).

Segments are accounting tokens: the pools count them and never allocate memory (the bytes of a buffer live
in its ``Buffer`` object, owned by whoever wrote or received it). What the counts bound is what Flink's
counts bound: how many buffers a producer may fill before it is back-pressured and how many buffers a
consumer holds for each channel, which is what credits announce.

The two classes call each other (the global pool creates the local pools and redistributes its buffers among
them; a local pool takes and returns segments through it), so they share this module, longer than most.

Not thread-safe, like the rest of the protocol core: callers serialise access.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Protocol

from ..config import DEFAULT_SEGMENT_SIZE, NetworkConfig
from ..errors import InsufficientNetworkBuffersError, NetworkBuffersNotFreeError, NoBufferAvailableError
from .sizing import UNBOUNDED

__all__ = [
    "NETWORK_MEMORY_SETTING",
    "BufferListener",
    "LocalBufferPool",
    "NetworkBufferPool",
    "SegmentRecycler",
]

_log = logging.getLogger(__name__)

#: The setting to raise when network buffers run out.
NETWORK_MEMORY_SETTING = "spark.creditShuffle.networkMemory"
#: Flink's ``UNKNOWN_CHANNEL``: a request not counted against any subpartition.
UNKNOWN_CHANNEL = -1


# -- listeners and recyclers ---------------------------------------------------------------------------


class BufferListener(Protocol):
    """Waits for a floating buffer of a LocalBufferPool (Flink's ``BufferListener``)."""

    def notify_buffer_available(self) -> bool:
        """A segment is offered; return True to take it (it then belongs to the listener)."""


#: Returns one segment to the pool it came from (see :meth:`LocalBufferPool.segment_recycler`).
SegmentRecycler = Callable[[], None]


# -- global pool ---------------------------------------------------------------------------------------


class NetworkBufferPool:
    """All network buffers of one executor (Flink's ``NetworkBufferPool``).

    ``total`` segments, handed out either pooled, one at a time to LocalBufferPools, or unpooled, as the
    exclusive buffers of remote input channels. ``num_total_required_buffers`` is the sum of every local
    pool's minimum plus every unpooled segment handed out; exceeding ``total`` raises
    :class:`InsufficientNetworkBuffersError` when a pool is created or exclusive buffers are requested.
    The buffers above the required ones are redistributed among the resizable local pools after every
    change, in proportion to their capacity (max - min).
    """

    def __init__(self, total: int, segment_size: int = DEFAULT_SEGMENT_SIZE) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self.segment_size = segment_size
        self.num_available = total
        self.num_total_required_buffers = 0
        self.num_unpooled = 0
        self._pools: list[LocalBufferPool] = []
        self._waiting: deque[LocalBufferPool] = deque()
        self._warned = False

    @classmethod
    def from_config(cls, config: NetworkConfig) -> NetworkBufferPool:
        """A pool of ``config.total_network_buffers`` segments of ``config.segment_size`` bytes."""
        return cls(config.total_network_buffers, config.segment_size)

    # -- pooled segments (for LocalBufferPools) --

    def request_pooled_segment(self) -> bool:
        """Take one free segment; False if none is free."""
        if self.num_available > 0:
            self.num_available -= 1
            return True
        return False

    def recycle_pooled_segment(self) -> None:
        """Give back one pooled segment and let a waiting local pool take it."""
        self.num_available += 1
        if self.num_available > self.total:
            raise RuntimeError("more segments returned to the network buffer pool than it holds")
        self._serve_waiting()

    def request_segment_when_available(self, pool: LocalBufferPool) -> None:
        """Register ``pool`` to be called back (``on_global_pool_available``) when a segment is free."""
        if pool not in self._waiting:
            self._waiting.append(pool)

    def _serve_waiting(self) -> None:
        while self._waiting and self.num_available > 0:
            pool = self._waiting.popleft()
            pool.on_global_pool_available()

    @property
    def is_available(self) -> bool:
        """At least one segment is free."""
        return self.num_available > 0

    # -- unpooled segments (exclusive buffers) --

    def request_unpooled_segments(self, n: int) -> None:
        """Take ``n`` segments for exclusive use, counted as required.

        Raises :class:`InsufficientNetworkBuffersError` if the required buffers would exceed the total, and
        :class:`NetworkBuffersNotFreeError` (retry after recycling) if they are accounted for but other
        pools still hold them; in both cases nothing is taken.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n == 0:
            return
        self._check_required(n)
        self.num_total_required_buffers += n
        self._redistribute()
        if self.num_available < n:
            self.num_total_required_buffers -= n
            self._redistribute()
            raise NetworkBuffersNotFreeError(n, self.num_available)
        self.num_available -= n
        self.num_unpooled += n

    def recycle_unpooled_segments(self, n: int) -> None:
        """Give back ``n`` exclusive segments."""
        if n <= 0:
            return
        if n > self.num_unpooled:
            raise RuntimeError(f"returning {n} exclusive segments, but only {self.num_unpooled} are out")
        self.num_unpooled -= n
        self.num_total_required_buffers -= n
        self.num_available += n
        self._redistribute()
        self._serve_waiting()

    # -- local pools --

    def create_buffer_pool(
        self,
        min_buffers: int,
        max_buffers: int,
        *,
        num_subpartitions: int = 0,
        max_buffers_per_channel: int = UNBOUNDED,
        max_overdraft_buffers: int = 0,
    ) -> LocalBufferPool:
        """A LocalBufferPool of ``min_buffers`` .. ``max_buffers`` segments; its minimum is reserved now."""
        if min_buffers < 1:
            raise ValueError(f"min_buffers must be >= 1, got {min_buffers}")
        if max_buffers < min_buffers:
            raise ValueError(f"max_buffers ({max_buffers}) must be >= min_buffers ({min_buffers})")
        self._check_required(min_buffers)
        self.num_total_required_buffers += min_buffers
        pool = LocalBufferPool(
            self,
            min_buffers,
            max_buffers,
            num_subpartitions=num_subpartitions,
            max_buffers_per_channel=max_buffers_per_channel,
            max_overdraft_buffers=max_overdraft_buffers,
        )
        self._pools.append(pool)
        self._redistribute()
        pool.check_availability()
        self._check_usage()
        return pool

    def destroy_buffer_pool(self, pool: LocalBufferPool) -> None:
        """Release ``pool``'s reservation; its segments come back as they are recycled."""
        if pool not in self._pools:
            return
        self._pools.remove(pool)
        if pool in self._waiting:
            self._waiting.remove(pool)
        self.num_total_required_buffers -= pool.min_buffers
        self._redistribute()
        if self.estimated_requested_usage() < 1.0:
            self._warned = False

    @property
    def buffer_pools(self) -> tuple[LocalBufferPool, ...]:
        return tuple(self._pools)

    def _check_required(self, requested: int) -> None:
        if self.num_total_required_buffers + requested > self.total:
            raise InsufficientNetworkBuffersError(
                required=requested,
                available=self.total - self.num_total_required_buffers,
                total=self.total,
                segment_size=self.segment_size,
                setting=NETWORK_MEMORY_SETTING,
            )

    def _redistribute(self) -> None:
        excess = self.total - self.num_total_required_buffers
        resizable = [p for p in self._pools if p.max_buffers > p.min_buffers]
        if excess <= 0:
            for pool in resizable:
                pool.set_num_buffers(pool.min_buffers)
            return
        capacities = [min(excess, p.max_buffers - p.min_buffers) for p in resizable]
        total_capacity = sum(capacities)
        if total_capacity == 0:
            return
        to_distribute = min(excess, total_capacity)
        parts_used = 0
        distributed = 0
        for pool, capacity in zip(resizable, capacities, strict=True):
            parts_used += capacity
            share = to_distribute * parts_used // total_capacity - distributed
            distributed += share
            pool.set_num_buffers(pool.min_buffers + share)

    # -- usage ---

    def estimated_requested_segments(self) -> int:
        """Σ over pools of max (bounded pools) or 2 * min (unbounded ones), as Flink's usage warning."""
        total = 0
        for pool in self._pools:
            total += 2 * pool.min_buffers if pool.max_buffers >= UNBOUNDED else pool.max_buffers
        return total

    def estimated_requested_usage(self) -> float:
        """:meth:`estimated_requested_segments` / total (can exceed 1.0)."""
        return self.estimated_requested_segments() / self.total if self.total else 0.0

    def _check_usage(self) -> None:
        usage = self.estimated_requested_usage()
        if usage >= 1.0 and not self._warned:
            self._warned = True
            _log.warning(
                "Memory usage [%d%%] is too high to satisfy all of the requests. This can severely impact "
                "network throughput. Please consider increasing available network memory (%s), or decreasing "
                "configured size of network buffer pools (buffers_per_channel, floating_buffers_per_gate).",
                round(usage * 100),
                NETWORK_MEMORY_SETTING,
            )

    # -- metrics (Status.Shuffle.Netty.*) --

    @property
    def num_used(self) -> int:
        """Segments handed out (pooled or unpooled): ``UsedMemorySegments``."""
        return self.total - self.num_available


# -- local pool ----------------------------------------------------------------------------------------


class LocalBufferPool:
    """Buffers of one result partition or of one input gate's floating pool (Flink's ``LocalBufferPool``).

    Its size is set between min and max by the global pool's redistribution. It keeps one segment ready
    whenever it is below its size (taking it from the global pool proactively). It is *available*, which
    lets a producer take its next input, iff it holds a free segment, no subpartition holds
    ``max_buffers_per_channel`` buffers and it is not overdrafted. Requests beyond the size may take up to
    ``max_overdraft_buffers`` extra segments, never more: a pool takes no segment beyond its size plus the
    overdraft, and all pools together hold at most the network buffer pool's total. A pool the redistribution
    shrank gives its free segments back at once and its used ones as they are recycled, so until then it may
    hold more than its new size (as Flink's). A recycled segment is offered first to
    the FIFO of buffer listeners (input channels waiting for floating buffers), then kept.
    """

    def __init__(
        self,
        network_pool: NetworkBufferPool,
        min_buffers: int,
        max_buffers: int,
        *,
        num_subpartitions: int = 0,
        max_buffers_per_channel: int = UNBOUNDED,
        max_overdraft_buffers: int = 0,
    ) -> None:
        self.network_pool = network_pool
        self.min_buffers = min_buffers
        self.max_buffers = max_buffers
        self.current_pool_size = min_buffers
        self.num_requested = 0  # segments taken from the global pool, overdraft included
        self.num_available_segments = 0
        self.max_buffers_per_channel = max_buffers_per_channel
        self.max_overdraft_buffers = max_overdraft_buffers
        self.subpartition_buffers_count = [0] * num_subpartitions
        #: Subpartitions whose writer holds an unfinished buffer (see :meth:`builder_opened`).
        self.subpartition_builder_open = [False] * num_subpartitions
        self.unavailable_subpartitions_count = 0
        self.is_destroyed = False
        self._listeners: deque[BufferListener] = deque()
        self._availability_listeners: list[Callable[[], None]] = []
        #: The recycler of each subpartition's segments (see :meth:`segment_recycler`).
        self.segment_recyclers: list[SegmentRecycler] = [partial(self.recycle, c) for c in range(num_subpartitions)]
        self._available = False

    # -- sizing --

    def set_num_buffers(self, num_buffers: int) -> None:
        """Resize (called by redistribution); excess free segments go back to the global pool now, used
        ones as they are recycled."""
        if num_buffers < self.min_buffers:
            raise ValueError(f"pool size {num_buffers} is below the minimum {self.min_buffers}")
        self.current_pool_size = min(num_buffers, self.max_buffers)
        while self.num_available_segments and self.num_requested > self.current_pool_size:
            self.num_available_segments -= 1
            self._return_to_global()
        self.check_availability()

    @property
    def num_buffers(self) -> int:
        """The current pool size."""
        return self.current_pool_size

    # -- requests --

    def request_buffer(self, target_channel: int = UNKNOWN_CHANNEL) -> bool:
        """Take one segment, counted against ``target_channel`` if given; False if none can be had.

        Succeeds while a segment is free even if the channel is at its max (the limit only gates
        availability); at the pool size it may overdraft up to ``max_overdraft_buffers``.
        """
        remaining = self.num_available_segments - 1
        if remaining < 0:
            if self.is_destroyed:
                raise RuntimeError("buffer pool is destroyed")
            if self.num_requested < self.current_pool_size:
                if not self._request_from_global():
                    return False
            elif self.num_requested - self.current_pool_size < self.max_overdraft_buffers:
                if not self.network_pool.request_pooled_segment():
                    return False
                self.num_requested += 1
                self.num_available_segments += 1
            else:
                return False
            remaining = self.num_available_segments - 1
        self.num_available_segments = remaining
        if target_channel >= 0:
            counts = self.subpartition_buffers_count
            count = counts[target_channel] + 1
            counts[target_channel] = count
            if count - self.subpartition_builder_open[target_channel] == self.max_buffers_per_channel:
                self.unavailable_subpartitions_count += 1
                self.check_availability()
                return True
        if not remaining or self.num_requested > self.current_pool_size:
            self.check_availability()
        return True

    def request_buffer_or_raise(self, target_channel: int = UNKNOWN_CHANNEL) -> None:
        """:meth:`request_buffer`, raising :class:`NoBufferAvailableError` where it gives nothing (Flink's
        non-blocking request returns null there): never a segment beyond size + overdraft or beyond the
        network buffer pool's total."""
        if not self.request_buffer(target_channel):
            raise NoBufferAvailableError(
                target_channel,
                self.current_pool_size,
                self.max_overdraft_buffers,
                self.num_used,
                self.network_pool.total,
            )

    def builder_opened(self, target_channel: int) -> None:
        """The writer of ``target_channel`` holds an unfinished buffer of it (one of the segments counted
        against it), which it finishes by writing more rows or by an event.

        The per-channel limit does not count that buffer: only this writer can finish it, and it writes only
        while the pool is available, so counting it would let ``max_buffers_per_channel`` = 1 stop the
        producer with a partly filled buffer that nothing but a timer's event ever finishes. Buffers that are
        finished and not yet consumed, the ones a slow consumer leaves behind, are all counted.
        """
        if not self.subpartition_builder_open[target_channel]:
            self._set_builder_open(target_channel, True)

    def builder_finished(self, target_channel: int) -> None:
        """The writer's open buffer of ``target_channel`` is finished: it counts against the limit again."""
        if self.subpartition_builder_open[target_channel]:
            self._set_builder_open(target_channel, False)

    def _set_builder_open(self, channel: int, is_open: bool) -> None:
        limit = self.max_buffers_per_channel
        count = self.subpartition_buffers_count[channel]
        was_over = count - self.subpartition_builder_open[channel] >= limit
        self.subpartition_builder_open[channel] = is_open
        over = count - is_open >= limit
        if over != was_over:
            self.unavailable_subpartitions_count += 1 if over else -1
            self.check_availability()

    def segment_recycler(self, target_channel: int = UNKNOWN_CHANNEL) -> SegmentRecycler:
        """The recycler of segments requested against ``target_channel``: one call returns one segment.

        One callable per channel, made once (a producer takes one segment per buffer, so no object is
        made per buffer). Calling it once per segment is the owner's duty, which :class:`Buffer` and the
        builders' leases keep; a channel that gets back more segments than it took raises RuntimeError.
        """
        if target_channel >= 0:
            return self.segment_recyclers[target_channel]
        return self.recycle

    def recycle(self, target_channel: int = UNKNOWN_CHANNEL) -> None:
        """Return one segment: to the global pool if destroyed or over size, else to the first listener that
        takes it, else to the free list."""
        if target_channel >= 0:
            counts = self.subpartition_buffers_count
            count = counts[target_channel]
            if not count:
                raise RuntimeError(f"a segment of channel {target_channel} was recycled twice (none is out)")
            if count - self.subpartition_builder_open[target_channel] == self.max_buffers_per_channel:
                self.unavailable_subpartitions_count -= 1
            counts[target_channel] = count - 1
        if self.is_destroyed or self.num_requested > self.current_pool_size:
            self._return_to_global()
            self.check_availability()
            return
        if self._listeners:
            self._offer_segment()
            return
        self.num_available_segments += 1
        if not self._available:
            self.check_availability()

    def _offer_segment(self) -> None:
        while self._listeners:
            listener = self._listeners.popleft()
            if listener.notify_buffer_available():
                self.check_availability()
                return
        self.num_available_segments += 1
        self.check_availability()

    def add_buffer_listener(self, listener: BufferListener) -> bool:
        """Queue ``listener`` for the next recycled segment; refused (False) while a segment is free."""
        if self.num_available_segments > 0 or self.is_destroyed:
            return False
        if self.num_requested < self.current_pool_size and self._request_from_global():
            return False
        self._listeners.append(listener)
        return True

    def remove_buffer_listener(self, listener: BufferListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    @property
    def num_listeners(self) -> int:
        return len(self._listeners)

    def reserve_segments(self, n: int) -> bool:
        """Make sure ``n`` segments are held (Flink's ``reserveSegments``); False if the global pool is short."""
        while self.num_requested < n:
            if not self.network_pool.request_pooled_segment():
                return False
            self.num_requested += 1
            self.num_available_segments += 1
        self.check_availability()
        return True

    # -- availability --

    def check_availability(self) -> bool:
        """Refresh availability, taking a segment from the global pool if below size; notify on a change.

        A segment the pool gains this way goes to a waiting buffer listener first (Flink serves listeners
        only on recycle; a channel could then wait while its pool holds a free segment)."""
        if self.num_available_segments == 0 and self.num_requested < self.current_pool_size and not self.is_destroyed:
            if self._request_from_global():
                if self._listeners:
                    self.num_available_segments -= 1
                    self._offer_segment()
                    return self._available
            else:
                self.network_pool.request_segment_when_available(self)
        available = (
            self.num_available_segments > 0
            and self.unavailable_subpartitions_count == 0
            and self.num_requested <= self.current_pool_size
        )
        if available and not self._available:
            self._available = True
            for callback in tuple(self._availability_listeners):
                callback()
        else:
            self._available = available
        return available

    def is_available(self) -> bool:
        """A producer may take its next input (Flink's ``LocalBufferPool.isAvailable``)."""
        return self._available

    def add_availability_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever the pool turns from unavailable to available."""
        self._availability_listeners.append(callback)

    def remove_availability_listener(self, callback: Callable[[], None]) -> None:
        if callback in self._availability_listeners:
            self._availability_listeners.remove(callback)

    def on_global_pool_available(self) -> None:
        """The global pool has a free segment: take one if below size and offer it to a waiting listener."""
        if self.is_destroyed or self.num_available_segments or self.num_requested >= self.current_pool_size:
            return
        self.check_availability()

    def _request_from_global(self) -> bool:
        if self.network_pool.request_pooled_segment():
            self.num_requested += 1
            self.num_available_segments += 1
            return True
        return False

    def _return_to_global(self) -> None:
        self.num_requested -= 1
        self.network_pool.recycle_pooled_segment()

    # -- teardown --

    def lazy_destroy(self) -> None:
        """Return the free segments and leave the global pool; segments in use return when recycled."""
        if self.is_destroyed:
            return
        self.is_destroyed = True
        self._listeners.clear()
        self._available = False
        while self.num_available_segments:
            self.num_available_segments -= 1
            self._return_to_global()
        self.network_pool.destroy_buffer_pool(self)

    # -- metrics --

    @property
    def num_used(self) -> int:
        """Segments held outside the pool (in builders, queues, in flight or being consumed)."""
        return self.num_requested - self.num_available_segments

    @property
    def usage(self) -> float:
        """used / current size (``outPoolUsage`` of one pool; above 1.0 when overdrafted)."""
        return self.num_used / self.current_pool_size if self.current_pool_size else 0.0

    def __repr__(self) -> str:
        return (
            f"LocalBufferPool(size={self.current_pool_size}, min={self.min_buffers}, max={self.max_buffers}, "
            f"requested={self.num_requested}, available={self.num_available_segments}, "
            f"listeners={len(self._listeners)}, destroyed={self.is_destroyed})"
        )
