"""The structures the simulation scales with keep their invariants: the writer's short path for a run that fits
its open buffer and a unicast buffer dropping what its reader already built (every row delivered, in order,
every segment returned), the gate's running buffer tally (equal to the walk over its channels), Flink 1.4's
flush model, and the ``simulate`` command line at a tiny size. No wall-clock time is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from buffer_helpers import ArraySelector, MemoryPartition, read_all
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_credit_shuffle.buffers import RecordWriter
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.engine.consumer import GateGauges
from spark_credit_shuffle.errors import ConfigError
from spark_credit_shuffle.metrics import TaskMetrics
from spark_credit_shuffle.protocol import RemoteInputChannel
from spark_credit_shuffle.simulation import Simulation, simulate
from spark_credit_shuffle.simulation.cli import main as simulate_main
from spark_credit_shuffle.simulation.cluster import run_cluster, steady_state_times

SCHEMA = pa.schema([("seq", pa.int64()), ("payload", pa.binary())])
HOSTS = [i // 2 for i in range(4)]  # 2 hosts x 2 slots
QUIET = ("--timeout-ms", "1", "--window", "0.002", "--quiet")


def _batch(first: int, rows: int, size: int) -> pa.RecordBatch:
    payload = pa.array([b"x" * size] * rows, type=pa.binary())
    seq = pa.array(np.arange(first, first + rows, dtype=np.int64))
    return pa.RecordBatch.from_arrays([seq, payload], schema=SCHEMA)


@settings(max_examples=40, deadline=None)
@given(
    subpartitions=st.integers(1, 6),
    steps=st.lists(
        st.tuples(st.integers(1, 40), st.integers(0, 1500), st.booleans(), st.booleans(), st.integers(0, 2**31)),
        min_size=1,
        max_size=25,
    ),
)
def test_every_row_arrives_in_order_and_every_segment_returns(subpartitions, steps):
    """Batches of random rows to random channels (sorted, so no copy is made, or not), flushes and reads in
    between: each subpartition's rows arrive in order and whole, and every segment goes back."""
    partition = MemoryPartition(subpartitions)
    channels, batches, first = [], [], 0
    for rows, size, ordered, _, seed in steps:
        chosen = np.random.default_rng(seed).integers(0, subpartitions, rows)
        channels.append(np.sort(chosen) if ordered else chosen)
        batches.append(_batch(first, rows, size))
        first += rows
    writer = RecordWriter(partition, ArraySelector(subpartitions, channels), 4096, schema=SCHEMA)
    received: list[list] = [[] for _ in range(subpartitions)]
    for batch, (_, _, _, flush, _) in zip(batches, steps):
        assert writer.emit(batch)
        if flush:
            writer.flush_all()
            for sp in range(subpartitions):
                received[sp].extend(partition.poll_readable(sp))
    writer.finish()
    expected = [[] for _ in range(subpartitions)]
    for batch, chosen in zip(batches, channels):
        seq = batch.column(0).to_pylist()
        for row, sp in enumerate(chosen.tolist()):
            expected[sp].append(seq[row])
    for sp in range(subpartitions):
        buffers = received[sp] + partition.drain(sp)
        items, _ = read_all(buffers, SCHEMA, sp)
        got = [v for item in items if isinstance(item, pa.RecordBatch) for v in item.column(0).to_pylist()]
        assert got == expected[sp]
        for buffer, _ in buffers:
            buffer.recycle()
    assert partition.segments_in_use == 0


def _gates(sim: Simulation):
    return [consumer.gate for consumer in sim.consumers]


@pytest.mark.parametrize("credit_based", [True, False])
def test_the_gate_tally_equals_the_walk_over_its_channels(credit_based):
    sim = Simulation(
        NetworkConfig(credit_based=credit_based),
        num_producers=4,
        num_consumers=4,
        producer_rate=20e6,
        consumer_rate=[2e6, 40e6, 40e6, 40e6],
        producer_hosts=HOSTS,
        consumer_hosts=HOSTS,
        latency=100e-6,
        bytes_per_producer=300_000,
    )
    seen = []

    def check(now: float) -> None:
        for gate in _gates(sim):
            remote = [c for c in gate.channels if isinstance(c, RemoteInputChannel)]
            tally = gate.buffer_tally
            assert tally.channels == len(remote)
            assert tally.exclusive == sum(c.buffer_manager.num_exclusive for c in remote)
            assert tally.floating == sum(c.buffer_manager.num_floating for c in remote)
            walked = GateGauges(gate, TaskMetrics("consumer", 0))
            walked._tally = None
            assert GateGauges(gate, TaskMetrics("consumer", 0)).values() == walked.values()
        seen.append(now)

    sim.progress, sim.progress_steps = check, 50
    report = sim.run()
    assert seen and report.finished and report.data_intact and report.buffers_returned
    check(sim.clock.now)


def test_flink_1_4_flushes_finish_buffers_and_deliver_everything():
    kwargs = dict(
        num_producers=4,
        num_consumers=4,
        producer_rate=20e6,
        consumer_rate=40e6,
        producer_hosts=HOSTS,
        consumer_hosts=HOSTS,
        latency=100e-6,
        bytes_per_producer=400_000,
    )
    config = NetworkConfig(buffer_timeout_ms=1)
    new = simulate(config, **kwargs)
    old = simulate(config, **kwargs, flush_model="1.4", producer_buffer_cost=25e-6, notification_cost=36e-6)
    for report in (new, old):
        assert report.finished and report.data_intact and report.buffers_returned

    def finished_buffers(report) -> float:
        return sum(r.value for r in report.rows if r.side == "producer" and r.metric == "numBuffersOut")

    assert finished_buffers(old) > finished_buffers(new)  # each flush finished its buffers
    with pytest.raises(ConfigError):
        simulate(config, **kwargs, flush_model="1.3")


@pytest.mark.parametrize("threading", ["netty", "loop"])
def test_run_cluster_reports_its_figures(threading):
    row = run_cluster(2, 2, 5, duration=0.005, threading=threading)
    assert row["channels"] == 16 and row["buffers"] > 0 and row["throughput_mb_s"] > 0
    assert row["threading"] == threading


def test_simulate_command_prints_a_table_and_a_json_line(capsys, tmp_path):
    png = tmp_path / "figure.png"
    argv = ["--hosts", "1", "--slots", "2", "--timeout-ms", "0,10", "--flush-model", "both"]
    assert simulate_main([*argv, "--window", "0.005", "--quiet", "--png", str(png)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:2] == ["flush_model", "timeout_ms"] and len(lines) == 6
    figures = json.loads(lines[-1])["simulate"]
    assert figures["threading"] == "netty"  # Flink's threads unless --threading loop
    assert set(figures["flink_1.5"]) == {"0ms", "10ms"} and figures["flink_1.4"]["10ms"]["of_largest"] == 1.0
    assert png.stat().st_size > 0


def test_simulate_command_runs_this_packages_threads_when_asked(capsys):
    assert simulate_main(["--hosts", "2", "--slots", "1", "--threading", "loop", *QUIET]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["simulate"]
    assert figures["threading"] == "loop" and figures["flink_1.5"]["1ms"]["mb_s"] > 0


def test_python_m_simulate():
    out = subprocess.run(
        [*(sys.executable, "-m", "spark_credit_shuffle", "simulate", "--hosts", "1", "--slots", "1"), *QUIET],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert json.loads(out.strip().splitlines()[-1])["simulate"]["flink_1.5"]["1ms"]["mb_s"] > 0


def test_the_throughput_after_a_warm_up_counts_only_the_bytes_received_after_it():
    """A run is deterministic, so the same run stopped at the end of the warm-up received exactly what the whole
    run's throughput leaves out; the buffer timeout's first wait (10 ms here) is outside the window."""
    kwargs = dict(
        num_producers=2,
        num_consumers=2,
        producer_rate=5e6,
        consumer_rate=10e6,
        producer_hosts=[0, 1],
        consumer_hosts=[0, 1],
        latency=100e-6,
    )
    config = NetworkConfig(buffer_timeout_ms=10)
    whole = simulate(config, **kwargs, duration=0.06, warmup=0.02)
    prefix = simulate(config, **kwargs, duration=0.02)
    cold = simulate(config, **kwargs, duration=0.06)
    assert whole.window == pytest.approx(0.04)
    for consumer in (0, 1):
        total = cold.value("consumer", consumer, "numBytesInPerSecond", stat="mean") * 0.06
        before = prefix.value("consumer", consumer, "numBytesInPerSecond", stat="mean") * 0.02
        after = whole.value("consumer", consumer, "numBytesInPerSecond", stat="mean") * 0.04
        assert before > 0 and after == pytest.approx(total - before)
        # steady state is faster than the average from a cold start
        assert after / 0.04 > total / 0.06
    with pytest.raises(ConfigError, match="warmup"):
        Simulation(config, **kwargs, duration=0.02, warmup=0.02)


def test_a_figure_run_warms_up_and_measures_for_two_timeouts_or_the_window():
    assert steady_state_times(0, 0.05) == (0.05, 0.1)
    assert steady_state_times(100, 0.05) == (0.2, 0.4)
    with pytest.raises(ConfigError, match="window"):
        steady_state_times(1, 0)
    row = run_cluster(1, 2, 5, duration=0.02, warmup=0.01)
    assert row["warmup_s"] == 0.01 and row["virtual_s"] == 0.02 and row["throughput_mb_s"] > 0


def test_channel_weights_give_each_consumer_its_share_and_every_row_arrives_in_order():
    kwargs = dict(num_producers=2, num_consumers=3, producer_rate=20e6, consumer_rate=40e6, bytes_per_producer=1e6)
    report = simulate(NetworkConfig(), **kwargs, channel_weights=[[8, 1, 1], [0, 1, 1]])
    assert report.finished and report.data_intact and report.buffers_returned
    per_channel = {
        (r.subtask, r.channel): r.value for r in report.rows if r.metric == "numRecordsOut" and r.channel is not None
    }
    for p, weights in enumerate([[8, 1, 1], [0, 1, 1]]):
        written = sum(per_channel[(p, c)] for c in range(3))
        for c, w in enumerate(weights):
            assert per_channel[(p, c)] == pytest.approx(written * w / sum(weights), abs=2)
    for bad in ([[1, 1, 1]], [[1, 1], [1, 1]], [[1, 1, -1], [1, 1, 1]], [[0, 0, 0], [1, 1, 1]]):
        with pytest.raises(ConfigError, match="channel_weights"):
            Simulation(NetworkConfig(), **kwargs, channel_weights=bad)


def test_a_cluster_whose_full_network_buffers_outgrow_the_memory_is_warned_of_before_it_runs():
    from spark_credit_shuffle.simulation.cluster import memory_warning, network_memory_bytes

    simulation = Simulation(
        NetworkConfig(), num_producers=4, num_consumers=4, producer_rate=1e6, consumer_rate=1e6, duration=0.001,
        producer_hosts=HOSTS, consumer_hosts=HOSTS,
    )  # fmt: skip
    need = network_memory_bytes(simulation)
    assert need == sum(p.total for p in simulation.network_pools.values()) * NetworkConfig().segment_size > 0
    warning = memory_warning(simulation, need - 1)
    assert warning is not None and "2 hosts" in warning and "one timeout per process" in warning
    assert memory_warning(simulation, need) is None and memory_warning(simulation, None) is None
