"""Buffer debloating (docs/flink.md, "Behaviours from Flink's test suite"): BufferDebloaterTest,
BufferSizeEMATest and ThroughputCalculatorTest, and the gate announcing a debloated size that the producer's
subpartition then hands to its writer."""

from __future__ import annotations

import pytest
from protocol_helpers import filled_finished_consumer

from spark_credit_shuffle.buffers.format import CheckpointBarrier, CheckpointOptions, encode_event
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.protocol import (
    BufferDebloater,
    BufferSizeEMA,
    CreditBasedPartitionRequestClientHandler,
    NetworkBufferPool,
    PartitionRequestServerHandler,
    PipelinedResultPartition,
    ResultPartitionManager,
    SingleInputGate,
    ThroughputCalculator,
)
from spark_credit_shuffle.transport.in_memory import MemoryConnection


def debloater(*, target_ms=1000, min_size=50, max_size=1100, threshold=25, samples=1):
    return BufferDebloater(
        max_size,
        target_ms=target_ms,
        min_buffer_size=min_size,
        threshold_percentages=threshold,
        number_of_samples=samples,
    )


def test_correct_buffer_size_calculation():
    assert debloater(target_ms=1200).recalculate_buffer_size(3333, 16) == 250


def test_calculated_buffer_size_less_than_min():
    assert debloater().recalculate_buffer_size(0, 16) == 50


def test_calculate_buffer_size_for_zero_buffers_in_use():
    """No buffer in use counts as one."""
    assert debloater(min_size=50, max_size=2400).recalculate_buffer_size(1200, 0) == 1200


def test_size_greater_than_max_size():
    """Clamped to the maximum, which is where the debloater starts: nothing to announce."""
    assert debloater(target_ms=1200, max_size=248).recalculate_buffer_size(3333, 16) is None


def test_size_less_than_threshold():
    d = debloater(target_ms=1200)
    assert d.recalculate_buffer_size(3333, 16) == 250
    assert d.recalculate_buffer_size(3400, 16) is None  # 255: within 25% of 250
    assert d.last_buffer_size == 250


def test_announce_new_size_when_min_or_max_reached_but_not_repeatedly():
    d = debloater(min_size=50, max_size=1100, threshold=50)
    assert d.recalculate_buffer_size(500, 1) == 500
    assert d.recalculate_buffer_size(60, 1) == 60
    assert d.recalculate_buffer_size(10, 1) == 50  # the min: announced although within 50% of 60
    assert d.recalculate_buffer_size(10, 1) is None  # unchanged: not again
    d = debloater(min_size=50, max_size=1100, threshold=50)
    assert d.recalculate_buffer_size(500, 1) == 500
    assert d.recalculate_buffer_size(700, 1) is None  # +200 is within 50% of 500
    assert d.recalculate_buffer_size(900, 1) == 900
    assert d.recalculate_buffer_size(5000, 1) == 1100  # the max: announced although within 50% of 900
    assert d.recalculate_buffer_size(5000, 1) is None


def test_skip_update():
    d = debloater(min_size=50, max_size=32768, threshold=30)
    d.last_buffer_size = 16384
    delta = int(16384 * 0.3)
    assert d.skip_update(16384)
    assert not d.skip_update(16384 + delta)
    assert not d.skip_update(16384 - delta)
    assert d.skip_update(16384 + delta - 1)
    assert d.skip_update(16384 - delta + 1)
    assert not d.skip_update(50) and not d.skip_update(32768)


def test_estimated_time_to_consume_buffers():
    d = debloater(target_ms=1200)
    d.recalculate_buffer_size(3333, 16)
    assert d.last_estimated_time_ms == 250 * 16 * 1000 // 3333


def test_buffer_size_ema_calculation():
    ema = BufferSizeEMA(200, 10, 3)  # alpha 0.5
    assert ema.calculate_buffer_size(111, 13) == 104
    assert [ema.calculate_buffer_size(107, 7) for _ in range(5)] == [60, 38, 26, 21, 18]
    assert [ema.calculate_buffer_size(107, 13) for _ in range(3)] == [13, 11, 10]
    # growing at most by doubling; Java's half-up rounding (22.5 -> 23)
    assert [ema.calculate_buffer_size(333, 1) for _ in range(6)] == [15, 23, 34, 51, 76, 114]


def test_buffer_size_ema_shrinks_from_max():
    ema = BufferSizeEMA(200, 10, 3)
    assert [ema.calculate_buffer_size(0, 1) for _ in range(6)] == [100, 50, 25, 13, 10, 10]


def test_buffer_size_ema_rejects_bad_input():
    ema = BufferSizeEMA(200, 10, 3)
    with pytest.raises(ValueError, match="number of buffers"):
        ema.calculate_buffer_size(10, 0)
    with pytest.raises(ValueError, match="total buffer size"):
        ema.calculate_buffer_size(-1, 1)
    with pytest.raises(ValueError, match="min_buffer_size"):
        BufferSizeEMA(10, 20, 3)


def test_correct_throughput_calculation():
    calculator = ThroughputCalculator()
    calculator.incoming_data_size(6666, now_ms=0)
    calculator.incoming_data_size(3334, now_ms=50)
    assert calculator.calculate_throughput(now_ms=100) == 100_000


def test_calculation_during_idle_time():
    calculator = ThroughputCalculator()
    calculator.incoming_data_size(7, now_ms=0)
    calculator.pause_measurement(now_ms=1)
    calculator.resume_measurement(now_ms=100)  # 99 idle ms do not count
    calculator.incoming_data_size(3, now_ms=100)
    assert calculator.calculate_throughput(now_ms=101) == 5000


def test_calculate_throughput_without_elapsed_time_returns_previous_value():
    calculator = ThroughputCalculator()
    calculator.incoming_data_size(10_000, now_ms=0)
    assert calculator.calculate_throughput(now_ms=100) == 100_000
    calculator.pause_measurement(now_ms=100)
    assert calculator.calculate_throughput(now_ms=200) == 100_000  # paused: no measured time


def _one_remote_channel(config: NetworkConfig):
    """(partition, gate, channel, connection): a producer's one-subpartition partition read by a gate's one
    remote channel over an in-memory connection, requested."""
    network = NetworkBufferPool.from_config(config)
    manager = ResultPartitionManager()
    partition = PipelinedResultPartition.create(network, 1, config, partition_id=0)
    manager.register_partition(partition)
    gate = SingleInputGate(network, 1, config)
    client = CreditBasedPartitionRequestClientHandler()
    channel = gate.remote_channel(0, 1, client, partition_id=0, subpartition=0)
    connection = MemoryConnection(client, PartitionRequestServerHandler(manager))
    gate.request_partitions()
    connection.pump()
    return partition, gate, channel, connection


def test_gate_announces_debloated_size_to_its_producers():
    """A gate that consumes slowly with much data in flight announces a smaller size; the producer's
    subpartition returns it from ``add`` (the size its writer cuts the next buffers at)."""
    config = NetworkConfig(segment_size=32 * 1024)
    partition, gate, _, connection = _one_remote_channel(config)
    for _ in range(6):
        partition.add_consumer(0, filled_finished_consumer(32 * 1024))
    connection.pump()
    assert gate.buffers_in_use_count() > 1
    d = BufferDebloater(config.segment_size, target_ms=1000, number_of_samples=1)
    size = d.recalculate_buffer_size(throughput=16 * 1024, buffers_in_use=gate.buffers_in_use_count())
    assert size is not None and 256 <= size < config.segment_size
    gate.announce_buffer_size(size)
    connection.pump()
    assert partition.subpartitions[0].add(filled_finished_consumer(10)) == size
    with pytest.raises(ValueError, match="buffer size"):
        gate.announce_buffer_size(0)


def test_a_channel_blocked_behind_an_aligned_barrier_still_counts_the_senders_backlog():
    """A sender blocked behind an aligned barrier announces a backlog of 0 with it, though its queue stays;
    for debloating the channel counts the backlog announced before the barrier until consumption resumes."""
    config = NetworkConfig(segment_size=32 * 1024)
    partition, gate, channel, connection = _one_remote_channel(config)
    # given 3 buffers, an aligned barrier and 4 buffers behind it, all received up to the barrier
    for _ in range(3):
        partition.add_consumer(0, filled_finished_consumer(1024))
    partition.add_event(0, encode_event(CheckpointBarrier(1, 0, CheckpointOptions())))
    for _ in range(4):
        partition.add_consumer(0, filled_finished_consumer(1024))
    connection.pump()
    assert partition.subpartitions[0].is_blocked and len(channel.received_buffers) == 4  # 3 buffers, the barrier
    # then the buffers queued behind the barrier still count as the sender announced them before it (its last
    # buffer left out, which may still be written), though the barrier announced a backlog of 0
    assert channel.buffer_manager.num_required_buffers == channel.initial_credit
    assert gate.buffers_in_use_count() == 4 + 3
    # and once consumption resumes, what the sender announces counts again
    while gate.poll_next() is not None:
        pass
    gate.resume_consumption(0)
    connection.pump()
    assert channel.backlog_before_block is None
    assert gate.buffers_in_use_count() == len(channel.received_buffers) + max(
        0, channel.buffer_manager.num_required_buffers - channel.initial_credit
    )
