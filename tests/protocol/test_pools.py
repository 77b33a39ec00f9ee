"""LocalBufferPoolTest, NetworkBufferPoolTest, SingleInputGateTest, NettyShuffleUtilsTest (docs/flink.md,
"Behaviours from Flink's test suite"); and the pool sizes (docs/flink.md, "Pool sizes")."""

from __future__ import annotations

import logging

import pytest

from spark_credit_shuffle.buffers.sizing import UNBOUNDED
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import (
    InsufficientNetworkBuffersError,
    NetworkBuffersNotFreeError,
    NoBufferAvailableError,
)
from spark_credit_shuffle.protocol import (
    CreditBasedPartitionRequestClientHandler,
    NetworkBufferPool,
    PartitionType,
    PipelinedResultPartition,
    SingleInputGate,
    input_gate_buffers_spec,
    network_buffers_for_announcing,
    result_partition_pool_size,
)


def test_bounded_buffer():
    network = NetworkBufferPool(10, 128)
    pool = network.create_buffer_pool(1, 2)
    assert pool.max_buffers == 2
    pool.set_num_buffers(1)
    assert pool.num_available_segments == 1
    assert pool.request_buffer()
    assert pool.num_available_segments == 0
    assert not pool.request_buffer()
    pool.recycle()
    assert pool.num_available_segments == 1

    pool.set_num_buffers(2)
    assert pool.num_available_segments == 1
    assert pool.request_buffer()
    assert pool.num_available_segments == 1
    assert pool.request_buffer()
    assert pool.num_available_segments == 0
    assert not pool.request_buffer()
    pool.recycle()
    assert pool.num_available_segments == 1
    pool.recycle()
    assert pool.num_available_segments == 2

    pool.set_num_buffers(3)  # above max: stays at 2
    assert pool.num_buffers == 2
    assert pool.request_buffer() and pool.request_buffer()
    assert not pool.request_buffer()
    pool.recycle()
    pool.recycle()
    assert pool.num_available_segments == 2
    pool.set_num_buffers(1)
    assert pool.num_available_segments == 1
    assert network.num_available == 9


def test_max_buffers_per_channel_and_availability():
    network = NetworkBufferPool(20, 128)
    pool = network.create_buffer_pool(1, UNBOUNDED, num_subpartitions=3, max_buffers_per_channel=2)
    pool.set_num_buffers(10)
    assert pool.is_available()
    b01 = pool.segment_recycler(0) if pool.request_buffer(0) else None
    b11 = pool.segment_recycler(1) if pool.request_buffer(1) else None
    assert pool.is_available()
    b02 = pool.segment_recycler(0) if pool.request_buffer(0) else None
    assert not pool.is_available()
    # a channel at its max still gets buffers; the limit only gates availability
    b03 = pool.segment_recycler(0) if pool.request_buffer(0) else None
    b21 = pool.segment_recycler(2) if pool.request_buffer(2) else None
    b22 = pool.segment_recycler(2) if pool.request_buffer(2) else None
    assert None not in (b01, b11, b02, b03, b21, b22)
    assert not pool.is_available()
    for recycler, available in ((b11, False), (b21, False), (b02, False), (b01, True), (b03, True), (b22, True)):
        recycler()
        assert pool.is_available() == available
    with pytest.raises(RuntimeError, match="twice"):
        b22()


def test_overdraft():
    network = NetworkBufferPool(20, 128)
    pool = network.create_buffer_pool(2, 2, num_subpartitions=1, max_overdraft_buffers=3)
    assert pool.request_buffer(0) and pool.request_buffer(0)
    assert not pool.is_available()  # the pool size is reached
    for _ in range(3):
        assert pool.request_buffer(0)
        assert not pool.is_available()
    assert not pool.request_buffer(0)
    assert pool.usage == 5 / 2  # outPoolUsage above 100% while overdrafted
    for _ in range(5):
        pool.recycle(0)
    assert pool.is_available()
    assert pool.num_requested == 2
    assert network.num_available == 18


def test_a_request_beyond_size_overdraft_or_network_memory_gets_nothing():
    """Flink's non-blocking request: nothing beyond the pool size plus the overdraft, nor beyond the network
    buffer pool's total; the raising form names the pool's numbers."""
    network = NetworkBufferPool(3, 128)
    pool = network.create_buffer_pool(2, 2, num_subpartitions=1, max_overdraft_buffers=5)
    taken = 0
    while pool.request_buffer(0):
        taken += 1
    assert taken == 3 and pool.num_used == 3 and network.num_available == 0  # size 2 + 1 overdraft: memory's end
    with pytest.raises(NoBufferAvailableError, match=r"size 2 \+ overdraft 5.*3 network buffers"):
        pool.request_buffer_or_raise(0)
    assert not pool.is_available()
    for _ in range(3):
        pool.recycle(0)
    assert pool.num_used == 0 and pool.is_available()


def test_insufficient_number_of_buffers():
    network = NetworkBufferPool(5, 128)
    network.request_unpooled_segments(5)
    assert not network.is_available
    with pytest.raises(InsufficientNetworkBuffersError) as caught:
        network.request_unpooled_segments(1)
    error = caught.value
    assert (error.required, error.available, error.total) == (1, 0, 5)
    assert error.setting == "spark.creditShuffle.networkMemory" == NetworkConfig.conf_key("network_memory")
    assert "Insufficient number of network buffers" in str(error)
    network.recycle_unpooled_segments(5)
    assert network.is_available
    with pytest.raises(InsufficientNetworkBuffersError):
        network.create_buffer_pool(6, 6)


def test_exclusive_buffers_held_by_other_pools():
    network = NetworkBufferPool(4, 128)
    pool = network.create_buffer_pool(1, 4)
    for _ in range(4):
        assert pool.request_buffer()
    with pytest.raises(NetworkBuffersNotFreeError):
        network.request_unpooled_segments(2)
    assert network.num_total_required_buffers == 1  # nothing was taken
    pool.recycle()
    pool.recycle()  # the pool is over its new size: these go back to the global pool
    network.request_unpooled_segments(2)


def test_segments_usage(caplog):
    network = NetworkBufferPool(50, 128)
    first = network.create_buffer_pool(10, 20)
    assert network.estimated_requested_segments() == 20
    assert network.estimated_requested_usage() == pytest.approx(0.4)
    second = network.create_buffer_pool(5, UNBOUNDED)
    assert network.estimated_requested_segments() == 30
    assert network.estimated_requested_usage() == pytest.approx(0.6)
    with caplog.at_level(logging.WARNING):
        third = network.create_buffer_pool(10, 30)
    assert network.estimated_requested_segments() == 60
    assert network.estimated_requested_usage() == pytest.approx(1.2)
    assert "Memory usage [120%] is too high" in caplog.text
    for pool in (first, second, third):
        pool.lazy_destroy()
    assert network.estimated_requested_segments() == 0
    assert network.num_available == 50 and network.num_total_required_buffers == 0


def test_redistribution_proportional_to_capacity():
    network = NetworkBufferPool(100, 128)
    a = network.create_buffer_pool(10, 30)  # capacity 20
    b = network.create_buffer_pool(10, 70)  # capacity 60
    fixed = network.create_buffer_pool(5, 5)
    excess = 100 - 25
    assert a.num_buffers + b.num_buffers - 20 == min(excess, 80)
    assert (a.num_buffers, b.num_buffers) == (10 + 18, 10 + 57)
    assert fixed.num_buffers == 5
    network.request_unpooled_segments(75)  # no excess left: every pool at its minimum
    assert (a.num_buffers, b.num_buffers) == (10, 10)


def test_request_buffers_with_remote_input_channel():
    config = NetworkConfig()
    network = NetworkBufferPool(100, config.segment_size)
    gate = SingleInputGate(network, 1, config)
    client = CreditBasedPartitionRequestClientHandler()
    gate.remote_channel(0, 1, client)
    gate.setup()
    channel = gate.channels[0]
    assert channel.num_available_buffers == 2
    assert network.num_available == 100 - 2 - 1  # 2 exclusive + 1 reserved floating
    assert sum(pool.num_buffers for pool in network.buffer_pools) == 8


def test_local_channels_get_no_exclusive_buffers():
    config = NetworkConfig()
    network = NetworkBufferPool(100, config.segment_size)
    partition = PipelinedResultPartition.create(network, 2, config)
    gate = SingleInputGate(network, 2, config, num_remote_channels=1)
    gate.local_channel(0, partition, subpartition=0)
    gate.remote_channel(1, 9, CreditBasedPartitionRequestClientHandler())
    gate.setup()
    assert gate.spec.exclusive_total == 2
    assert network.num_unpooled == 2


def test_compute_required_network_buffers():
    config = NetworkConfig(buffers_per_channel=5, floating_buffers_per_gate=8)
    total = network_buffers_for_announcing(
        gates=[(3, False), (4, True)],
        partitions=[(5, PartitionType.PIPELINED_BOUNDED), (6, PartitionType.BLOCKING), (10, PartitionType.BLOCKING)],
        config=config,
        sort_shuffle_min_parallelism=8,
        sort_shuffle_min_buffers=12,
    )
    assert total == 23 + 28 + 33 + 7 + 12 == 103


def test_pool_sizes():
    config = NetworkConfig()
    assert result_partition_pool_size(4, config) == (5, 4 * 2 + 8)
    assert result_partition_pool_size(4, config, PartitionType.PIPELINED) == (5, UNBOUNDED)
    assert result_partition_pool_size(4, config, PartitionType.BLOCKING) == (5, UNBOUNDED)
    streaming = input_gate_buffers_spec(4, config)
    assert (streaming.exclusive_per_channel, streaming.floating_min, streaming.floating_max) == (2, 1, 8)
    batch = input_gate_buffers_spec(1500, config, blocking=True)
    assert (batch.exclusive_per_channel, batch.floating_min, batch.floating_max) == (0, 1000, 3008)
    no_credit = input_gate_buffers_spec(4, config.replace(credit_based=False))
    assert (no_credit.exclusive_per_channel, no_credit.floating_min, no_credit.floating_max) == (0, 4, 16)
    local = input_gate_buffers_spec(4, config, num_remote_channels=3)
    assert (local.exclusive_total, local.required, local.maximum) == (6, 7, 14)


def test_partition_creation_reserves_its_minimum():
    config = NetworkConfig(network_memory="1mb")  # 32 buffers
    network = NetworkBufferPool.from_config(config)
    PipelinedResultPartition.create(network, 30, config)  # min 31
    with pytest.raises(InsufficientNetworkBuffersError) as caught:
        PipelinedResultPartition.create(network, 1, config)  # min 2, only 1 left
    assert (caught.value.required, caught.value.available, caught.value.total) == (2, 1, 32)
