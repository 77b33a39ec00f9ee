"""The protocol core end to end on virtual time: property tests over random topologies, rates and configs,
and the two pictures of the credit-based flow control article."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import ConfigError, ExchangeTimeoutError
from spark_credit_shuffle.simulation import Simulation, VirtualClock, simulate

MB = 1_000_000


@pytest.fixture(autouse=True)
def _quiet_pool_warnings(caplog):
    caplog.set_level(logging.ERROR, logger="spark_credit_shuffle.buffers.pools")


@st.composite
def scenarios(draw, credit_based: bool = True):
    producers = draw(st.integers(1, 3))
    forward = draw(st.booleans()) and producers > 0
    consumers = producers if forward else draw(st.integers(1, 3))
    bpc = draw(st.integers(0, 3))
    fpg = draw(st.integers(1 if bpc == 0 else 0, 8))
    config = NetworkConfig(
        segment_size=4096,
        buffers_per_channel=bpc,
        floating_buffers_per_gate=fpg,
        max_buffers_per_channel=draw(st.integers(2, 10)),
        max_overdraft_buffers_per_gate=draw(st.integers(0, 5)),
        buffer_timeout_ms=draw(st.sampled_from([-1, 0, 1, 10])),
        credit_based=credit_based,
    )
    hosts = draw(st.integers(1, 3))
    rates = st.floats(0.2 * MB, 20 * MB)
    return {
        "config": config,
        "num_producers": producers,
        "num_consumers": consumers,
        "consumers_of": "forward" if forward else "all_to_all",
        "producer_rate": draw(st.lists(rates, min_size=producers, max_size=producers)),
        "consumer_rate": draw(st.lists(rates, min_size=consumers, max_size=consumers)),
        "bytes_per_producer": draw(st.lists(st.integers(0, 100_000), min_size=producers, max_size=producers)),
        "record_size": draw(st.integers(64, 9000)),  # up to two segments: records span buffers
        "batch_records": draw(st.integers(1, 16)),
        "producer_hosts": draw(st.lists(st.integers(0, hosts - 1), min_size=producers, max_size=producers)),
        "consumer_hosts": draw(st.lists(st.integers(0, hosts - 1), min_size=consumers, max_size=consumers)),
        "connections": draw(st.sampled_from(["host_pair", "task_pair"])),
        "latency": draw(st.sampled_from([0.0, 0.0005])),
        "bandwidth": draw(st.sampled_from([None, 20 * MB])),
        "encode": draw(st.booleans()),
        "extra_buffers_per_host": draw(st.integers(0, 20)),
        "processes": draw(st.sampled_from(["host", "subtask"])),
        # subtasks that start late, as a real run's do: a producer before its consumers, or after them
        "producer_start": draw(st.lists(st.sampled_from([0.0, 0.003]), min_size=producers, max_size=producers)),
        "consumer_start": draw(st.lists(st.sampled_from([0.0, 0.02]), min_size=consumers, max_size=consumers)),
        "host_bandwidth": draw(st.sampled_from([None, 30 * MB])),  # every connection of a host shares it
    }


def _check_run(scenario: dict) -> None:
    config = scenario.pop("config")
    report = Simulation(config, check_invariants=True, max_steps=200_000, **scenario).run()
    assert report.finished  # no deadlock within the step budget
    assert report.data_intact  # every channel got its bytes, in order
    for consumer, producer in report.channel_origins:  # a channel's data bytes in equal its producer's bytes out
        assert report.value("consumer", consumer, "numDataBytesIn", channel=producer) == report.value(
            "producer", producer, "numBytesOut", channel=consumer
        )
    assert report.buffers_returned  # every segment back in its executor's pool, every pool destroyed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenarios())
def test_random_topologies_with_credits(scenario):
    """Credits never go negative and no data buffer is in flight without a receiver buffer reserved for it
    (checked after every simulation step); everything is delivered in order and every buffer comes back."""
    _check_run(scenario)


def test_a_pool_the_redistribution_shrinks_keeps_its_used_segments_until_they_come_back():
    """Found by the property test above: three tasks of one executor in processes of their own, two network
    buffers to spare. The global pool's redistribution shrinks producer 2's pool to 2 while 3 of its segments
    are in use; they come back as they are recycled (as with Flink's ``setNumBuffers``), and the producer takes
    no new one until it is below its size again."""
    config = NetworkConfig(
        segment_size=4096, buffers_per_channel=0, floating_buffers_per_gate=4, max_buffers_per_channel=3,
        max_overdraft_buffers_per_gate=0, buffer_timeout_ms=-1,
    )  # fmt: skip
    _check_run(
        {
            "config": config,
            "num_producers": 3,
            "num_consumers": 3,
            "consumers_of": "forward",
            "producer_rate": [200_000.0, 200_000.0, 841_069.0],
            "consumer_rate": [200_000.0, 5_279_725.0, 1_230_416.0],
            "bytes_per_producer": [100_000, 24_003, 100_000],
            "record_size": 68,
            "batch_records": 16,
            "producer_hosts": [0, 0, 0],
            "consumer_hosts": [0, 0, 0],
            "connections": "host_pair",
            "latency": 0.0005,
            "bandwidth": None,
            "encode": False,
            "extra_buffers_per_host": 2,
            "processes": "subtask",
        }
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenarios(), st.integers(1, 3))
def test_local_channels_through_connections_hold_their_buffers_in_the_producers_pool(scenario, hosts):
    """Given tasks of one executor in processes of their own (every same-host channel a local channel over
    a connection), every buffer a local channel sent and the consumer did not recycle yet holds a segment
    of the producer's pool (checked after every step), and everything arrives and comes back."""
    scenario["processes"] = "subtask"
    scenario["producer_hosts"] = [p % hosts for p in range(scenario["num_producers"])]
    scenario["consumer_hosts"] = [c % hosts for c in range(scenario["num_consumers"])]
    _check_run(scenario)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenarios(credit_based=False))
def test_random_topologies_without_credits(scenario):
    _check_run(scenario)


def throughput(report, consumer: int) -> float:
    """A consumer's bytes per virtual second over the run (its ``numBytesInPerSecond`` row)."""
    return report.value("consumer", consumer, "numBytesInPerSecond", stat="mean")


def back_pressured_share(report, producer: int) -> float:
    """The share of the run a producer spent back-pressured (``accumulateBackPressuredTimeMs`` / window)."""
    return report.value("producer", producer, "accumulateBackPressuredTimeMs") / 1000.0 / report.window


def _two_receivers(credit_based: bool, slow_rate: float):
    """Two producers on one host, two consumers on another, one multiplexed connection (forward edges)."""
    return simulate(
        NetworkConfig(credit_based=credit_based),
        num_producers=2,
        num_consumers=2,
        consumers_of="forward",
        producer_rate=50 * MB,
        consumer_rate=[slow_rate, 40 * MB],
        duration=1.0,
        bandwidth=1000 * MB,
        latency=0.0005,
        connections="host_pair",
    )


def test_without_credits_a_slow_receiver_cuts_its_neighbours_to_its_pace():
    slow = _two_receivers(credit_based=False, slow_rate=2 * MB)
    alone = _two_receivers(credit_based=False, slow_rate=40 * MB)
    assert throughput(alone, 1) > 35 * MB
    # the neighbour shares the connection, which stops whenever the slow receiver has no buffer
    assert throughput(slow, 1) < 1.5 * throughput(slow, 0)
    assert throughput(slow, 1) < 0.1 * throughput(alone, 1)
    assert slow.connection_pauses > 0


def test_with_credits_the_other_receivers_keep_their_throughput():
    slow = _two_receivers(credit_based=True, slow_rate=2 * MB)
    alone = _two_receivers(credit_based=True, slow_rate=40 * MB)
    assert throughput(slow, 0) == pytest.approx(2 * MB, rel=0.05)
    assert throughput(slow, 1) >= 0.9 * throughput(alone, 1)
    assert slow.connection_pauses == 0
    # the slow receiver back-pressures its own producer only
    assert back_pressured_share(slow, 0) > 0.5
    assert back_pressured_share(slow, 1) < back_pressured_share(alone, 1) + 0.05


def test_samples_report_flink_metrics_over_virtual_time():
    report = simulate(
        NetworkConfig(),
        num_producers=1,
        num_consumers=2,
        producer_rate=20 * MB,
        consumer_rate=[1 * MB, 20 * MB],
        bytes_per_producer=2 * MB,
        sample_interval=0.05,
        bandwidth=100 * MB,
    )
    assert report.finished and report.data_intact and report.buffers_returned
    rows = report.timeline_rows()  # the runtimes' timeline rows, in virtual milliseconds

    def values(side: str, metric: str, subtask: int = 0) -> list[float]:
        return [r.value for r in rows if (r.side, r.metric, r.subtask, r.channel) == (side, metric, subtask, None)]

    times = sorted({r.time_ms for r in rows if r.side == "producer" and r.metric == "outPoolUsage"})
    assert times[:3] == pytest.approx([0.0, 50.0, 100.0])
    # the slow consumer's subpartition reaches max_buffers_per_channel (10 of the pool's 12 buffers), which
    # makes the pool unavailable: the producer is back-pressured
    assert max(values("producer", "outPoolUsage")) >= 10 / 12
    assert any(values("producer", "isBackPressured"))
    assert max(values("consumer", "inPoolUsage")) > 0.5
    assert all(0.0 <= v <= 1.0 for v in values("consumer", "inputExclusiveBuffersUsage"))
    unthrottled = simulate(
        NetworkConfig(),
        num_producers=1,
        num_consumers=2,
        producer_rate=20 * MB,
        consumer_rate=[20 * MB, 20 * MB],
        bytes_per_producer=2 * MB,
        bandwidth=100 * MB,
    )
    assert back_pressured_share(report, 0) > back_pressured_share(unthrottled, 0) + 0.2


def test_virtual_time_runs_are_deterministic():
    kwargs = {
        "num_producers": 2,
        "num_consumers": 3,
        "producer_rate": [3 * MB, 5 * MB],
        "consumer_rate": [1 * MB, 2 * MB, 4 * MB],
        "bytes_per_producer": 500_000,
        "producer_hosts": [0, 1],
        "consumer_hosts": [1, 0, 2],
        "latency": 0.001,
        "bandwidth": 50 * MB,
    }
    first = simulate(NetworkConfig(segment_size=4096), **kwargs)
    second = simulate(NetworkConfig(segment_size=4096), **kwargs)
    assert first.end_time == second.end_time
    assert first.rows == second.rows  # every channel's and subtask's measurements
    assert first.channel_origins == second.channel_origins
    assert first.steps == second.steps


def test_the_report_is_the_runtimes_metric_rows_with_the_topology_beside_them():
    """Given 2 producers on hosts 0 and 1 all-to-all to 2 consumers on host 1, the report's measurements are
    metric rows: the engine's per-channel counters, each subtask's finish time in virtual ms, each consumer's
    throughput over the run; the hosts and the channels' origins are plain facts of the topology."""
    report = simulate(
        NetworkConfig(segment_size=4096),
        num_producers=2,
        num_consumers=2,
        producer_rate=2 * MB,
        consumer_rate=[1 * MB, 4 * MB],
        bytes_per_producer=200_000,
        producer_hosts=[0, 1],
        consumer_hosts=[1, 1],
    )
    assert report.finished and report.data_intact
    assert all(r.time_ms is None for r in report.metric_rows())
    finish = {(side, s): report.value(side, s, "finishTimeMs") for side in ("producer", "consumer") for s in (0, 1)}
    # the run ends when the last consumer read its last end of partition; no producer finishes after it
    assert max(finish["consumer", c] for c in (0, 1)) == pytest.approx(report.end_time * 1000.0)
    assert all(finish["producer", p] <= finish["consumer", c] for p in (0, 1) for c in (0, 1))
    for c in (0, 1):
        bytes_in = report.value("consumer", c, "numBytesIn")  # no subtask-level row: the channels' sum
        assert bytes_in == sum(report.value("consumer", c, "numBytesIn", channel=p) for p in (0, 1))
        rate = report.value("consumer", c, "numBytesInPerSecond", stat="mean")
        assert rate == pytest.approx(bytes_in / report.window)
        for p in (0, 1):  # numBytesIn counts the events too (schema, end of partition), numDataBytesIn not
            assert report.value("consumer", c, "numDataBytesIn", channel=p) < report.value(
                "consumer", c, "numBytesIn", channel=p
            )
            assert report.channel_origin(c, p).local == (report.hosts["producer"][p] == report.hosts["consumer"][c])
    assert report.hosts == {"producer": [0, 1], "consumer": [1, 1]}
    assert report.checkpoint_records() == []  # no checkpoints without checkpoint_interval_ms
    with pytest.raises(KeyError, match="numBytesOut"):
        report.value("producer", 0, "numBytesOut", channel=5)


def test_one_buffer_per_channel_with_timeout_minus_one_does_not_stall_the_producer():
    """With max_buffers_per_channel=1 the open buffer of a subpartition used to keep the pool unavailable on
    its own: the producer could never write the rest of that buffer. The limit does not count the buffer the
    writer holds open, so the producer writes on and waits only for finished buffers nobody consumed."""
    report = simulate(
        NetworkConfig(max_buffers_per_channel=1, buffer_timeout_ms=-1),
        num_producers=1,
        num_consumers=1,
        producer_rate=MB,
        consumer_rate=MB,
        bytes_per_producer=100_000,
        record_size=100,
        check_invariants=True,
    )
    assert report.finished and report.data_intact


def test_a_consumer_that_starts_late_back_pressures_its_producers_until_it_asks_for_their_data():
    """The producers fill their pools and wait while the consumer has not asked for their subpartitions; it then
    reads everything, in order, and every buffer comes back. A producer that starts late ends late."""
    base = {
        "num_producers": 2,
        "num_consumers": 1,
        "producer_rate": 20 * MB,
        "consumer_rate": 100 * MB,
        "bytes_per_producer": 2 * MB,
        "processes": "subtask",
        "latency": 100e-6,
    }
    on_time = simulate(**base)
    late = simulate(**base, consumer_start=0.2)
    for report in (on_time, late):
        assert report.finished and report.data_intact and report.buffers_returned
    waited = [late.value("producer", p, "accumulateBackPressuredTimeMs") for p in (0, 1)]
    assert all(w > 100 for w in waited)  # of the 200 ms the consumer was not there, in ms
    assert all(on_time.value("producer", p, "accumulateBackPressuredTimeMs") < 20 for p in (0, 1))
    assert late.end_time > on_time.end_time + 0.1
    assert late.value("consumer", 0, "finishTimeMs") > 200
    later_producer = simulate(**base, producer_start=[0.0, 0.3])
    assert later_producer.data_intact and later_producer.end_time > 0.3 + on_time.end_time * 0.9


def test_a_hosts_bandwidth_caps_what_all_its_connections_move_together():
    """Four producers and four consumers in processes of their own on one host, a connection per pair: alone
    they move about 200 MB/s; with the host's 100 MB/s shared by its sixteen connections, at most that, and all
    of it in order, every buffer back."""
    base = {
        "num_producers": 4,
        "num_consumers": 4,
        "producer_rate": 50 * MB,
        "consumer_rate": 100 * MB,
        "bytes_per_producer": 4 * MB,
        "processes": "subtask",
        "connections": "task_pair",
        "latency": 50e-6,
        "producer_hosts": [0] * 4,
        "consumer_hosts": [0] * 4,
    }
    free = simulate(**base)
    shared = simulate(**base, host_bandwidth=100 * MB)
    for report in (free, shared):
        assert report.finished and report.data_intact and report.buffers_returned
    moved = 16 * MB  # four producers' 4 MB

    def rate(report):
        return moved / report.end_time / MB

    assert rate(free) > 180
    assert 85 < rate(shared) <= 100
    assert shared.value("producer", 0, "accumulateBackPressuredTimeMs") > 20  # ms: the wire, not the consumers


def test_bad_simulation_settings_are_rejected():
    with pytest.raises(ConfigError, match="host_bandwidth"):
        simulate(num_producers=1, num_consumers=1, producer_rate=1.0, consumer_rate=1.0, duration=1, host_bandwidth=0)
    for name, bad in (("producer_start", -0.1), ("consumer_start", [0.0, float("nan")])):
        with pytest.raises(ConfigError, match=name):
            simulate(
                num_producers=1, num_consumers=2, producer_rate=1.0, consumer_rate=1.0, duration=1.0, **{name: bad}
            )
    with pytest.raises(ConfigError, match="consumer_rate"):
        simulate(num_producers=1, num_consumers=2, producer_rate=1.0, consumer_rate=[1.0], duration=1.0)
    with pytest.raises(ConfigError, match="duration"):
        simulate(num_producers=1, num_consumers=1, producer_rate=1.0, consumer_rate=1.0)
    with pytest.raises(ConfigError, match="forward"):
        simulate(
            num_producers=1, num_consumers=2, producer_rate=1.0, consumer_rate=1.0, consumers_of="forward", duration=1
        )
    with pytest.raises(ConfigError, match="each consumer at most once per producer"):  # one channel per pair
        simulate(
            num_producers=1,
            num_consumers=1,
            producer_rate=1.0,
            consumer_rate=1.0,
            consumers_of=lambda p: [0, 0],
            duration=1,
        )


def test_virtual_clock_orders_events_by_time_then_insertion():
    clock = VirtualClock()
    seen = []
    clock.schedule(2.0, lambda t: seen.append(("b", t)))
    clock.schedule(1.0, lambda t: seen.append(("a", t)))
    clock.schedule(2.0, lambda t: seen.append(("c", t)))
    while clock.run_next():
        pass
    assert seen == [("a", 1.0), ("b", 2.0), ("c", 2.0)]
    assert clock.now == 2.0


_FEW_BUFFERS = {
    "one connection, no exclusive buffers": (
        {"buffers_per_channel": 0, "floating_buffers_per_gate": 1, "buffer_timeout_ms": 10},
        {"num_producers": 3, "num_consumers": 3, "bytes_per_producer": [0, 53_033, 75_003], "record_size": 2378,
         "batch_records": 12},
    ),
    "one connection, no floating buffers": (
        {"buffers_per_channel": 1, "floating_buffers_per_gate": 0, "buffer_timeout_ms": -1},
        {"num_producers": 3, "num_consumers": 3, "bytes_per_producer": [0, 53_033, 75_003], "record_size": 2378,
         "batch_records": 12},
    ),
    # a producer that had to borrow a segment beyond network memory got a pooled one back while the borrowed
    # one sat in an open buffer: it must count as settled, or the producer waits for its own segment
    "borrowed segment settled by a pooled one": (
        {"buffers_per_channel": 0, "floating_buffers_per_gate": 1, "buffer_timeout_ms": -1},
        {"num_producers": 2, "num_consumers": 3, "bytes_per_producer": [12_294, 14_343], "record_size": 2049,
         "batch_records": 6, "extra_buffers_per_host": 0},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_FEW_BUFFERS))
def test_few_buffers_on_one_host_do_not_deadlock(case):
    """All subtasks on one host, at most two buffers per channel and no overdraft: channels without exclusive
    buffers, empty buffers that spend a credit, records spanning buffers and segments borrowed beyond
    network memory must still let everything through."""
    settings, scenario = _FEW_BUFFERS[case]
    config = NetworkConfig(segment_size=4096, max_buffers_per_channel=2, max_overdraft_buffers_per_gate=0, **settings)
    producers, consumers = scenario["num_producers"], scenario["num_consumers"]
    _check_run(
        {
            "config": config,
            "producer_rate": [2e5] * producers,
            "consumer_rate": [2e5] * consumers,
            "producer_hosts": [0] * producers,
            "consumer_hosts": [0] * consumers,
            "connections": "host_pair",
            **scenario,
        }
    )


def test_a_producer_whose_buffers_never_come_back_in_time_fails_as_the_runtimes_do():
    """Given a consumer that spends 4 virtual seconds on each 4 KiB buffer and a 500 ms buffers request
    timeout, the simulated producer (the task engine's producer half) fills its pool, waits, and fails with
    the engine's typed error naming the setting, as a task of either runtime would."""
    with pytest.raises(ExchangeTimeoutError, match="buffers_request_timeout_ms=500"):
        simulate(
            NetworkConfig(segment_size=4096, buffers_request_timeout_ms=500, partition_request_timeout_ms=60_000),
            num_producers=1,
            num_consumers=1,
            producer_rate=MB,
            consumer_rate=1024,
            bytes_per_producer=MB,
        )
