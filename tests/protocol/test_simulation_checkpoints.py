"""Checkpoint barriers on the virtual clock: one checkpoint at a time, rows conserved in both flow-control
models, and the seed's claim as a model property: behind a slow consumer, aligned checkpoints align faster
with credits than without, because without credits the data ahead of a barrier fills the shared connection
(socket buffers and the receiver's floating buffers), and more of it the larger the socket buffers."""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest

from spark_credit_shuffle import NetworkConfig
from spark_credit_shuffle.simulation import Simulation

SLOW = 500_000.0  # bytes per virtual second
_DEMO = Path(__file__).resolve().parents[2] / "jobs" / "checkpoint_alignment_demo.py"


def _demo():
    spec = importlib.util.spec_from_file_location("checkpoint_alignment_demo", _DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


DEMO = _demo()


def slow_consumer_run(credit: bool, socket_buffer_bytes: int = 1 << 20, duration: float = 30.0):
    """The checkpoint demo's documented configuration (its own function, so the two cannot drift apart):
    aligned barriers every 100 ms, consumer 0 at 0.5 MB/s, Flink's default buffers."""
    return DEMO.slow_consumer_report(credit, False, 100, SLOW, duration, socket_buffer_bytes)


def slow_alignment_ms(report) -> float:
    return statistics.fmean(c.alignment_time_ms for c in report.checkpoint_records(0))


@pytest.mark.parametrize("credit", [True, False], ids=["credits", "no-credits"])
@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
def test_rows_are_conserved_and_checkpoints_complete_one_at_a_time(credit, unaligned):
    # given a slow consumer, barriers every 5 ms and finite data
    sim = Simulation(
        NetworkConfig(
            credit_based=credit, checkpoint_interval_ms=5, unaligned_checkpoints=unaligned, segment_size=4096
        ),
        num_producers=3,
        num_consumers=2,
        producer_rate=[1e6, 2e6, 3e6],
        consumer_rate=[2e6, 8e6],
        bytes_per_producer=256 * 1024,
        producer_hosts=[0, 1, 2],
        consumer_hosts=[3, 3],
        socket_buffer_bytes=64 * 1024,
        check_invariants=True,
    )
    report = sim.run()
    # then every byte arrived once and in order, every buffer went back to its pool
    assert report.finished and report.data_intact and report.buffers_returned
    if not credit and not unaligned:  # aligned without credits: blocked channels' buffers were spilled and replayed
        assert sim.consumers[0].spilled_bytes > 0
    for consumer in range(len(report.hosts["consumer"])):
        records = report.checkpoint_records(consumer)
        ids = [c.checkpoint_id for c in records]
        # the coordinator triggers the next checkpoint only once the last completed: none is subsumed
        assert len(ids) > 1 and ids == list(range(1, len(ids) + 1))
        assert all(c.alignment_time_ms >= 0 and c.start_delay_ms >= 0 for c in records)


def test_aligned_checkpoints_align_faster_with_credits_than_without_behind_a_slow_consumer():
    with_credits, without = slow_consumer_run(True), slow_consumer_run(False)
    # without credits the slow receiver runs out of floating buffers and stops reading whole connections
    assert without.connection_pauses > 0 == with_credits.connection_pauses
    assert slow_alignment_ms(with_credits) < slow_alignment_ms(without)
    # and the barriers reach it later: more data ahead of them (checkpointStartDelay)
    delay = [statistics.fmean(c.start_delay_ms for c in r.checkpoint_records(0)) for r in (with_credits, without)]
    assert delay[0] < delay[1]


def test_only_the_model_without_credits_waits_longer_with_larger_socket_buffers():
    small, large = 64 * 1024, 4 << 20
    # with credits nothing beyond the credits is on the wire: the socket buffers never fill
    assert slow_alignment_ms(slow_consumer_run(True, small)) == slow_alignment_ms(slow_consumer_run(True, large))
    # without credits a barrier queues behind whatever the connection holds
    assert slow_alignment_ms(slow_consumer_run(False, small)) < slow_alignment_ms(slow_consumer_run(False, large))
