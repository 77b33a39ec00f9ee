"""Flink's threads in the simulation (``threading="netty"``): the host's network threads cut and send the slices,
so a busy thread sends fuller buffers (Flink 1.5's ``BufferConsumer``: a flushed buffer keeps filling until the
network takes it) and loses nothing; a host's connections share its threads round robin; with buffer timeout 0
the task thread pays for the notifications its flushes raise. Virtual time only: no wall-clock time is asserted."""

from __future__ import annotations

import pytest

from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import ConfigError
from spark_credit_shuffle.simulation import Simulation, simulate

BASE = dict(  # two producer hosts and two consumer hosts, 2 slots each: every channel crosses the network
    num_producers=4,
    num_consumers=4,
    producer_rate=40e6,
    consumer_rate=80e6,
    producer_hosts=[0, 0, 1, 1],
    consumer_hosts=[2, 2, 3, 3],
    latency=100e-6,
    bytes_per_producer=300_000,
    threading="netty",
    network_threads=2,
)


def _bytes_per_buffer(report) -> float:
    totals = {"numBytesIn": 0.0, "numBuffersIn": 0.0}
    for row in report.rows:
        if row.side == "consumer" and row.channel is not None and row.metric in totals:
            totals[row.metric] += row.value
    return totals["numBytesIn"] / totals["numBuffersIn"]


def _producer_busy_end(report) -> float:
    return max(r.value for r in report.rows if r.side == "producer" and r.metric == "finishTimeMs")


@pytest.mark.parametrize("flush_model", ["1.5", "1.4"])
def test_a_busy_network_thread_sends_fuller_buffers_and_loses_nothing(flush_model):
    config = NetworkConfig(buffer_timeout_ms=1)
    idle = simulate(config, **BASE, flush_model=flush_model)
    busy = simulate(config, **BASE, flush_model=flush_model, sender_cost=400e-6)
    for report in (idle, busy):
        assert report.finished and report.data_intact and report.buffers_returned
    if flush_model == "1.5":  # the flushed buffer went on filling while the thread was busy
        assert _bytes_per_buffer(busy) > 1.5 * _bytes_per_buffer(idle)
    else:  # Flink 1.4's flush finished the buffer: waiting does not fill it
        assert _bytes_per_buffer(busy) == pytest.approx(_bytes_per_buffer(idle), rel=0.25)


def test_a_hosts_connections_share_its_network_threads_round_robin():
    # one producer host serving three consumer hosts: three connections on two threads
    simulation = Simulation(
        NetworkConfig(),
        num_producers=2,
        num_consumers=3,
        producer_rate=1e6,
        consumer_rate=1e6,
        producer_hosts=[0, 0],
        consumer_hosts=[1, 2, 3],
        duration=0.001,
        threading="netty",
        sender_cost=10e-6,
        network_threads=2,
    )
    costs = sorted(round(c.downstream.cost * 1e6) for c in simulation.connections.values())
    assert costs == [10, 20, 20]  # the first thread sends for two connections, the second for one
    assert all(c.upstream.cost == 0 for c in simulation.connections.values())  # credits: the client's side


def test_with_buffer_timeout_0_the_task_thread_pays_for_the_notifications_of_its_flushes():
    config = NetworkConfig(buffer_timeout_ms=0)
    free = simulate(config, **BASE)
    simulation = Simulation(config, **BASE, notification_cost=50e-6)
    paid = simulation.run()
    for report in (free, paid):
        assert report.finished and report.data_intact and report.buffers_returned
    # every flush after a batch found the reader caught up on some channels: a notification each
    fewest = min(sum(s.flush_notifications for s in p.partition.subpartitions) for p in simulation.producers)
    assert fewest > 10
    assert _producer_busy_end(paid) - _producer_busy_end(free) > 0.5 * fewest * 50e-6 * 1e3
    # the output flusher's own thread flushes at a timeout > 0: no notification costs the producer
    timed = NetworkConfig(buffer_timeout_ms=1)
    assert _producer_busy_end(simulate(timed, **BASE, notification_cost=50e-6)) == pytest.approx(
        _producer_busy_end(simulate(timed, **BASE))
    )


@pytest.mark.parametrize(
    "bad",
    [{"threading": "fibers"}, {"network_threads": 0}, {"network_threads": True}, {"sender_cost": -1e-6}],
)
def test_bad_thread_settings_are_refused_by_name(bad):
    kwargs = {**BASE, **bad}
    with pytest.raises(ConfigError, match=next(iter(bad))):
        Simulation(NetworkConfig(), **kwargs)
