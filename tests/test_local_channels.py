"""Channels between tasks of one executor are local in the pipelined exchange, as between two tasks of one
Flink TaskManager: no credit and no exclusive buffers; the producer's pool bounds what they hold.

The tasks run as threads over real sockets (``run_in_threads`` with ``executors``); ``test_local_cluster.py``
runs a Spark job on ``local-cluster`` (two executors of two slots), where Spark decides the placement.
"""

from __future__ import annotations

import pytest
from exchange_helpers import expected_placement, inputs, make_plan, table

import spark_credit_shuffle as scs
from spark_credit_shuffle.metrics import CONSUMER, PRODUCER
from spark_credit_shuffle.runtime.exchange_plan import Injection
from spark_credit_shuffle.runtime.pipelined import run_in_threads

pytestmark = pytest.mark.timeout(180)


def _check_exact(plan, data, received) -> None:
    for c, want in enumerate(expected_placement(plan, data)):
        assert table(received[c]).sort_by("id").equals(want)


def _timeline(rows, side, subtask, metric):
    return [r for r in rows if r.time_ms is not None and (r.side, r.subtask, r.metric) == (side, subtask, metric)]


@pytest.mark.parametrize("executors", [(0, 0, 0), (0, 1, 0), (0, 1, 2)], ids=["one", "two", "three"])
def test_tasks_sharing_an_executor_exchange_every_row_exactly_over_local_channels(executors):
    plan = make_plan(scs.key_by("k"), 3, 3, metrics_sample_interval_ms=5)
    data = inputs(3, 6000)
    received, rows = run_in_threads(plan, data, executors=list(executors))
    _check_exact(plan, data, received)
    for c in range(3):  # credits are sampled on remote channels only: those from another executor
        remote = {p for p in range(3) if executors[p] != executors[c]}
        assert {r.channel for r in _timeline(rows, CONSUMER, c, "credit")} == remote
        assert {r.channel for r in _timeline(rows, PRODUCER, c, "credit")} == remote


def test_a_slow_consumer_on_a_local_channel_backpressures_through_the_producers_pool():
    # given every task on one executor and consumer 0 slow (40 us per row): no channel has credit, so only
    # the producers' pools (4 buffers per subpartition) can hold them back
    plan = make_plan(
        scs.key_by("k"),
        3,
        3,
        injection=Injection(consumer_delay_s=((0, 4e-5),)),
        max_buffers_per_channel=4,
        metrics_sample_interval_ms=2,
    )
    data = inputs(3, 8000)
    received, rows = run_in_threads(plan, data, executors=[0, 0, 0])
    _check_exact(plan, data, received)
    assert not [r for r in rows if r.metric == "credit"]
    back_pressured = sum(r.value for r in rows if r.metric == "accumulateBackPressuredTimeMs" and r.side == PRODUCER)
    assert back_pressured > 0
    # what each producer held for the slow consumer never exceeded its subpartition limit (plus the
    # overdraft a writer may take to finish the rows it was given)
    limit = plan.config.max_buffers_per_channel + plan.config.max_overdraft_buffers_per_gate
    for p in range(3):
        queued = [r.value for r in _timeline(rows, PRODUCER, p, "outputQueueLength") if r.channel == 0]
        assert queued and max(queued) <= limit
    # the consumers took no floating buffers: a local channel brings its own (the producer's)
    assert all(r.value == 0 for r in rows if r.metric == "inputFloatingBuffersUsage")


def test_local_channels_task_setting_makes_every_channel_between_tasks_remote():
    plan = make_plan(scs.rebalance(), 2, 2, local_channels="task", metrics_sample_interval_ms=5)
    data = inputs(2, 3000)
    received, rows = run_in_threads(plan, data, executors=[0, 0])
    assert sum(b.num_rows for batches in received for b in batches) == 6000
    assert {r.channel for r in _timeline(rows, CONSUMER, 0, "credit")} == {1}
    assert {r.channel for r in _timeline(rows, CONSUMER, 1, "credit")} == {0}
