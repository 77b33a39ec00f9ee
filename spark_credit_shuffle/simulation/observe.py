"""What the simulation watches while it runs: the Flink metrics sampled over virtual time (the runtimes'
timeline rows, from the task engine's gauges) and the invariants checked after every step."""

from __future__ import annotations

from typing import Any

from ..engine import GateGauges
from ..metrics import CONSUMER, PRODUCER, SAMPLE, MetricRow

__all__ = ["check_invariants", "sample"]


def sample(sim: Any, now: float) -> None:
    """Every subtask's Flink metrics at ``now``: the task engine's gauges as the runtimes' timeline rows,
    stamped in virtual milliseconds."""
    stamp = now * 1000.0
    rows = sim.timeline
    for producer in sim.producers:
        gauges = producer.engine.gauges(now, {})
        rows.extend(MetricRow(PRODUCER, producer.index, ch, m, SAMPLE, float(v), stamp) for m, ch, v in gauges)
        # the counter so far too: a window's throughput is the difference of two samples
        rows.append(
            MetricRow(PRODUCER, producer.index, None, "numBytesOut", SAMPLE, float(sum(producer.bytes_written)), stamp)
        )
    for consumer in sim.consumers:
        if consumer.gate.is_closed:
            gauges = ((name, None, 0.0) for name in GateGauges.NAMES)
        else:
            gauges = consumer.engine.gauges(now)
        rows.extend(MetricRow(CONSUMER, consumer.index, ch, m, SAMPLE, float(v), stamp) for m, ch, v in gauges)
        bytes_in = sum(r.num_bytes_in for r in consumer.engine.readers)  # the summary's numBytesIn so far
        rows.append(MetricRow(CONSUMER, consumer.index, None, "numBytesIn", SAMPLE, float(bytes_in), stamp))


def check_invariants(sim: Any) -> None:
    """No producer takes a segment beyond its pool size plus the overdraft (a record's fragments included),
    no executor's pools hold more than its network buffers, no data buffer is in flight or sendable without a
    receiver buffer reserved for it, and on a local channel through a connection every buffer sent and not yet
    recycled holds a segment of the producer's pool.

    A pool may hold more than its size plus the overdraft after the global pool's redistribution shrank it:
    as Flink's ``LocalBufferPool.setNumBuffers``, it gives its free segments back at once and the used ones as
    they are recycled. Above that bound it keeps no free segment, and what it holds does not grow unless its
    size shrank since the last check."""
    sim.invariant_checks += 1
    for producer in sim.producers:
        pool = producer.partition.buffer_pool
        held, size = pool.num_requested, pool.current_pool_size
        before_held, before_size = sim.pool_seen.get(producer.index, (0, size))
        sim.pool_seen[producer.index] = (held, size)
        if held <= size + pool.max_overdraft_buffers:
            continue
        if pool.num_available_segments or (held > before_held and size >= before_size):
            raise AssertionError(
                f"producer {producer.index} holds {held} segments ({pool.num_available_segments} free), beyond "
                f"its pool size {size} + overdraft {pool.max_overdraft_buffers}, and took more than it held "
                f"before ({before_held}, at pool size {before_size}) or kept a free one"
            )
    for host, network in sim.network_pools.items():
        held = sum(p.num_requested for p in network.buffer_pools) + network.num_unpooled
        if held > network.total or network.num_available < 0:
            raise AssertionError(f"host {host}: pools hold {held} segments of {network.total} network buffers")
    segments: dict[int, set[int]] = {}  # per producer partition: the segments its local channels hold
    for receiver_id, connection, partition in sim._local_links:
        reader = connection.server.queue.all_readers.get(receiver_id)
        if reader is not None:
            mine = segments.setdefault(id(partition), set())
            for buffer in reader.held:
                recycler = buffer._recycler  # a slice's recycler is bound to its segment's builder
                if recycler is None and buffer.size == 0:
                    continue  # an empty flush slice: no segment behind it
                if recycler is None:
                    raise AssertionError(f"local channel {receiver_id} holds a buffer already recycled")
                mine.add(id(getattr(recycler, "__self__", recycler)))
    for partition in {id(p): p for _, _, p in sim._local_links}.values():
        held = len(segments.get(id(partition), ()))
        if held > partition.buffer_pool.num_used:
            raise AssertionError(
                f"producer {partition.partition_id}: {held} segments held by local channels, "
                f"{partition.buffer_pool.num_used} in use in its pool"
            )
    if not sim.config.credit_based:
        return
    for channel, connection in sim._remote:
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
