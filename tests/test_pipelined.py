"""The pipelined exchange between tasks running at once, over real TCP sockets on 127.0.0.1.

Most tests run the tasks as threads of this process (``run_in_threads``: the same task code as a Spark
barrier task, with the address exchange done in process); the tests marked ``spark`` run it as one
barrier stage of the session's ``local[4, 2]`` Spark.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from exchange_helpers import (
    expected_placement,
    inputs,
    make_plan,
    metric,
    run_blocking,
    spark_rows,
    table,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql import functions as F
from spark_helpers import assert_same_rows
from tcp_helpers import closed_by_peer

import spark_credit_shuffle as scs
from spark_credit_shuffle.errors import ConfigError, CreditShuffleError, ExchangeTimeoutError, InsufficientSlotsError
from spark_credit_shuffle.metrics import CONSUMER, PRODUCER
from spark_credit_shuffle.protocol import AuthResponse, Hello, encode_to_bytes
from spark_credit_shuffle.runtime import pipelined
from spark_credit_shuffle.runtime.exchange_plan import Injection
from spark_credit_shuffle.runtime.pipelined import PipelinedTask, TaskOptions, run_in_threads

pytestmark = pytest.mark.timeout(120)


# -- in process -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "partitioner",
    [scs.key_by("k"), scs.rebalance(seed=4), scs.rescale(), scs.broadcast(), scs.global_()],
    ids=lambda p: p.name,
)
@pytest.mark.parametrize("producers,consumers", [(1, 1), (3, 3), (2, 4), (4, 2)])
def test_every_row_arrives_once_on_the_subtask_flink_picks(partitioner, producers, consumers):
    plan = make_plan(partitioner, producers, consumers)
    data = inputs(producers, 3000)
    received, rows = run_in_threads(plan, data)
    for c, want in enumerate(expected_placement(plan, data)):
        assert table(received[c]).sort_by("id").equals(want), f"consumer {c}"
    total = sum(b.num_rows for batches in data for b in batches)
    copies = consumers if partitioner.is_broadcast else 1
    assert sum(r.value for r in metric(rows, CONSUMER, "numRecordsIn")) == total * copies


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    producers=st.integers(1, 3),
    consumers=st.integers(1, 3),
    rows=st.integers(0, 4000),
    batch_rows=st.integers(1, 2000),
    buffer_timeout_ms=st.sampled_from([-1, 0, 1, 10]),
    buffers_per_channel=st.integers(0, 3),
    floating=st.integers(1, 8),
    max_buffers_per_channel=st.integers(2, 10),  # 1: a producer stops at every open buffer
    credit_based=st.booleans(),
)
def test_nothing_is_lost_or_duplicated_whatever_the_network_settings(
    producers, consumers, rows, batch_rows, buffer_timeout_ms, buffers_per_channel, floating, max_buffers_per_channel,
    credit_based,
):  # fmt: skip
    plan = make_plan(
        scs.key_by("k"),
        producers,
        consumers,
        buffer_timeout_ms=buffer_timeout_ms,
        buffers_per_channel=buffers_per_channel,
        floating_buffers_per_gate=floating,
        max_buffers_per_channel=max_buffers_per_channel,
        credit_based=credit_based,
    )
    data = inputs(producers, rows, max(1, batch_rows))
    received, metric_rows = run_in_threads(plan, data)
    for c, want in enumerate(expected_placement(plan, data)):
        assert table(received[c]).sort_by("id").equals(want)
    out = {(r.subtask, r.channel): r.value for r in metric(metric_rows, PRODUCER, "numRecordsOut")}
    inn = {(r.channel, r.subtask): r.value for r in metric(metric_rows, CONSUMER, "numRecordsIn")}
    assert out == inn  # per (producer, consumer) channel, what went out came in


def test_metrics_are_flinks_and_add_up():
    # consumers reading 0.1 ms a row keep the exchange running about 0.4 s: many latency marker intervals
    slow = Injection(consumer_delay_s=tuple((c, 1e-4) for c in range(3)))
    plan = make_plan(scs.key_by("k"), 3, 3, injection=slow, buffer_timeout_ms=1)
    _, rows = run_in_threads(plan, inputs(3, 4000), options=TaskOptions(latency_interval_ms=5))
    for side in (PRODUCER, CONSUMER):
        for subtask in range(3):
            mine = [r for r in rows if r.side == side and r.subtask == subtask and r.time_ms is None]
            totals = {r.metric: r.value for r in mine if r.stat == "total" and r.channel is None}
            per_second = {r.metric: r.value for r in mine if r.metric.endswith("PerSecond")}
            assert set(per_second) == {
                "backPressuredTimeMsPerSecond",
                "idleTimeMsPerSecond",
                "busyTimeMsPerSecond",
                "softBackPressuredTimeMsPerSecond",
                "hardBackPressuredTimeMsPerSecond",
            }
            assert all(0.0 <= v <= 1000.0 for v in per_second.values())
            # Flink's identity, over the side's life: busy + idle + back-pressured = 1000 ms per second
            identity = ("busyTimeMsPerSecond", "idleTimeMsPerSecond", "backPressuredTimeMsPerSecond")
            assert sum(per_second[m] for m in identity) == pytest.approx(1000.0, abs=1.0)
            soft_hard = per_second["softBackPressuredTimeMsPerSecond"] + per_second["hardBackPressuredTimeMsPerSecond"]
            assert soft_hard == pytest.approx(per_second["backPressuredTimeMsPerSecond"], abs=1.0)
            assert {"accumulateBackPressuredTimeMs", "accumulateIdleTimeMs", "accumulateBusyTimeMs"} <= set(totals)
    buffers_out = sum(r.value for r in metric(rows, PRODUCER, "numBuffersOut"))
    buffers_in = sum(r.value for r in metric(rows, CONSUMER, "numBuffersIn"))
    assert 0 < buffers_out <= buffers_in  # flushed slices and events arrive as buffers of their own
    assert {r.channel for r in metric(rows, PRODUCER, "numRecordsOut")} == {0, 1, 2}
    assert {r.channel for r in metric(rows, PRODUCER, "outputQueueLength", "max")} == {0, 1, 2}
    for name in ("outPoolUsage", "inPoolUsage", "inputExclusiveBuffersUsage", "inputFloatingBuffersUsage"):
        assert metric(rows, None, name, "max"), name
    assert all(r.value > 0 for r in metric(rows, PRODUCER, "outPoolUsage", "max"))
    assert all(r.value > 0 for r in metric(rows, CONSUMER, "inPoolUsage", "max"))
    assert sum(r.value for r in metric(rows, CONSUMER, "numLatencyMarkersIn")) > 0
    # a latency marker is a record sent to one random channel (Flink's randomEmit): a consumer reports
    # latencyMs exactly when it received markers
    markers = {r.subtask: r.value for r in metric(rows, CONSUMER, "numLatencyMarkersIn")}
    latencies = {(r.subtask, r.stat): r.value for r in metric(rows, CONSUMER, "latencyMs")}
    for c in range(3):
        if markers.get(c, 0) > 0:
            assert 0 <= latencies[(c, "p50")] <= latencies[(c, "p99")] <= latencies[(c, "max")]
        else:
            assert not any(subtask == c for subtask, _ in latencies)
    assert all(r.value > 0 for r in metric(rows, None, "taskRssBytes", "max"))
    # the network buffers each task held, within its network memory
    held = metric(rows, None, "usedMemorySegments", "max")
    assert len(held) == 3 and all(0 < r.value <= plan.config.network_memory // plan.config.segment_size for r in held)


def test_a_slow_consumer_backpressures_its_producers_and_loses_nothing():
    # consumer 0 sleeps 40 us per row it receives (about 4 ms per network buffer); few buffers per channel,
    # so that what each producer sends it (about 17 buffers) cannot all wait in buffers
    plan = make_plan(
        scs.key_by("k"),
        3,
        3,
        injection=Injection(consumer_delay_s=((0, 4e-5),)),
        max_buffers_per_channel=4,
        floating_buffers_per_gate=2,
    )
    data = inputs(3, 8000)
    received, rows = run_in_threads(plan, data)
    for c, want in enumerate(expected_placement(plan, data)):
        assert table(received[c]).sort_by("id").equals(want)
    back_pressured = sum(r.value for r in metric(rows, PRODUCER, "accumulateBackPressuredTimeMs"))
    assert back_pressured > 0  # the producers waited for buffers held by the slow channel
    queue = {(r.subtask, r.channel): r.value for r in metric(rows, PRODUCER, "outputQueueLength", "mean")}
    for p in range(3):  # on average, every producer's queue towards the slow consumer is its longest
        assert queue[(p, 0)] > max(queue[(p, 1)], queue[(p, 2)]), queue
    assert max(r.value for r in metric(rows, PRODUCER, "outPoolUsage", "max")) >= 0.5
    busy = {r.subtask: r.value for r in metric(rows, CONSUMER, "busyTimeMsPerSecond")}
    assert busy[0] > max(busy[1], busy[2])  # the slow consumer is the busy one; the others wait for data


def test_tasks_sample_a_timeline_of_pools_credits_and_backpressure():
    # consumer 0 is slow: its producers' channels to it fill up and they wait for buffers
    plan = make_plan(
        scs.key_by("k"),
        3,
        3,
        injection=Injection(consumer_delay_s=((0, 4e-5),)),
        max_buffers_per_channel=4,
        floating_buffers_per_gate=2,
        metrics_sample_interval_ms=2,
    )
    data = inputs(3, 8000)
    received, rows = run_in_threads(plan, data)
    assert sum(b.num_rows for batches in received for b in batches) == 3 * 8000
    timeline = [r for r in rows if r.time_ms is not None]
    assert {r.stat for r in timeline} == {"sample"}
    assert all(r.stat != "sample" for r in rows if r.time_ms is None)
    by_task = collections.defaultdict(set)
    for r in timeline:
        by_task[(r.side, r.subtask)].add(r.metric)
    time_gauges = {
        "busyTimeMsPerSecond",
        "idleTimeMsPerSecond",
        "backPressuredTimeMsPerSecond",
        "softBackPressuredTimeMsPerSecond",
        "hardBackPressuredTimeMsPerSecond",
    }
    producer = {"outPoolUsage", "isBackPressured", "numRecordsOutPerSecond", *time_gauges}
    producer |= {"backlog", "outputQueueLength", "credit"}
    consumer = {"inPoolUsage", "inputExclusiveBuffersUsage", "inputFloatingBuffersUsage", "numRecordsInPerSecond"}
    consumer |= {"isBackPressured"}  # waiting to hand its output on
    consumer |= {"credit", "unannouncedCredit", "backlog", "inputQueueLength", *time_gauges}
    assert by_task == {**{(PRODUCER, i): producer for i in range(3)}, **{(CONSUMER, i): consumer for i in range(3)}}
    for side, subtask in by_task:
        mine = [r for r in timeline if (r.side, r.subtask) == (side, subtask)]
        assert len({r.time_ms for r in mine}) >= 2  # sampled over time, not once
        # per channel: producers name the consumer of each subpartition, consumers each producer;
        # credits only on remote channels (a task reads its own subpartition without credit)
        remote = {0, 1, 2} - {subtask}
        assert {r.channel for r in mine if r.metric == "credit"} == remote
        assert {r.channel for r in mine if r.metric == "backlog"} == ({0, 1, 2} if side == PRODUCER else remote)
        queue = "outputQueueLength" if side == PRODUCER else "inputQueueLength"
        assert {r.channel for r in mine if r.metric == queue} == {0, 1, 2}
        for r in mine:
            if r.metric.endswith("Usage"):  # a writer may overdraw its pool while it finishes the rows it has
                assert 0.0 <= r.value <= (2.0 if r.metric == "outPoolUsage" else 1.0), r
            if r.metric in ("credit", "backlog", "outputQueueLength", "inputQueueLength", "isBackPressured"):
                assert r.value >= 0 and r.value == int(r.value), r
    cap = plan.config.buffers_per_channel + plan.config.floating_buffers_per_gate
    assert all(r.value <= cap for r in timeline if r.metric == "credit" and r.side == CONSUMER)
    # backpressure shows over time: producers were seen waiting, and over the samples their queues to the
    # slow consumer were the longest
    assert max(r.value for r in timeline if r.metric == "isBackPressured") == 1.0
    assert max(r.value for r in timeline if r.metric == "backPressuredTimeMsPerSecond") > 0
    queued = collections.defaultdict(list)
    for r in timeline:
        if r.side == PRODUCER and r.metric == "outputQueueLength":
            queued[r.channel].append(r.value)
    mean = {c: sum(v) / len(v) for c, v in queued.items()}
    assert mean[0] > max(mean[1], mean[2]), mean
    # with sampling off, no timeline at all
    _, rows = run_in_threads(make_plan(scs.key_by("k"), 2, 2, metrics_sample_interval_ms=0), inputs(2, 500))
    assert rows and all(r.time_ms is None for r in rows)


def test_a_consumer_that_stops_reading_makes_its_producers_time_out_naming_it():
    # consumer 0 sleeps about a second on its first buffer; producers give up after 300 ms without a buffer
    plan = make_plan(
        scs.key_by("k"), 2, 2, injection=Injection(consumer_delay_s=((0, 0.01),)), buffers_request_timeout_ms=300
    )
    with pytest.raises(ExchangeTimeoutError, match=r"producer subtask \d waited \d+ ms for a network buffer") as err:
        run_in_threads(plan, inputs(2, 20_000), timeout_s=30)
    assert "consumer subtask 0" in str(err.value)


class SilentPeer:
    """A 'producer task' that accepts connections and never answers: a stalled peer; ``hangs_up``: one that
    closes every connection it accepts (a task that failed before it could answer)."""

    def __init__(self, hangs_up: bool = False) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = self.server.getsockname()
        self.accepted: list[socket.socket] = []
        self.hangs_up = hangs_up
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        try:
            while True:
                conn, _ = self.server.accept()
                if self.hangs_up:
                    conn.close()
                else:
                    self.accepted.append(conn)
        except OSError:
            return

    def close(self) -> None:
        self.server.close()
        for conn in self.accepted:
            conn.close()


def test_a_stalled_peer_fails_the_consumer_with_a_timeout_naming_it():
    plan = make_plan(scs.rebalance(), 2, 2, partition_request_timeout_ms=400)
    peer = SilentPeer()
    task = PipelinedTask(plan, 0, b"k" * 32, "127.0.0.1", attempt_id=1)

    def all_gather(message: str) -> list[str]:
        fake = {"task": 1, "host": peer.address[0], "port": peer.address[1], "partition": 2}
        import json

        return [message, json.dumps(fake)]

    try:
        with pytest.raises(ExchangeTimeoutError) as err:
            for _ in task.run(iter(inputs(1, 300)[0]), all_gather):
                pass
        text = str(err.value)
        assert f"producer subtask 1 ({peer.address[0]}:{peer.address[1]})" in text
        assert "consumer subtask 0 waited" in text and "partition_request_timeout_ms=400" in text
        assert all(not t.is_alive() for t in task.wiring.threads)  # every thread joined
        assert task.wiring.transport is not None and not task.wiring.transport.connections
    finally:
        peer.close()


def test_a_producer_that_hangs_up_unanswered_is_a_lost_producer_of_the_consumer():
    """A producer task that fails before it answers closes its connections without a cause: the consumer fails
    naming the connection and records the producer as lost, the mark the Spark glue waits on before failing
    (``pipelined.KNOCK_ON_GRACE_S``), so that the producer's own failure is the one Spark reports."""
    plan = make_plan(scs.rebalance(), 2, 2, partition_request_timeout_ms=400)
    peer = SilentPeer(hangs_up=True)
    task = PipelinedTask(plan, 0, b"k" * 32, "127.0.0.1", attempt_id=1)

    def all_gather(message: str) -> list[str]:
        fake = {"task": 1, "host": peer.address[0], "port": peer.address[1], "partition": 2}
        return [message, json.dumps(fake)]

    try:
        with pytest.raises(CreditShuffleError, match=r"connection to producer subtask 1 .* (closed|failed)"):
            for _ in task.run(iter(inputs(1, 300)[0]), all_gather):
                pass
        assert task.wiring.lost_producers == {f"producer subtask 1 at {peer.address[0]}:{peer.address[1]}"}
    finally:
        peer.close()


def test_a_producer_failing_with_any_error_tells_its_consumer_why():
    """A task that fails with an error that is not this package's (a user's input raising) still sends it in
    its fatal ErrorResponse: its consumer's failure quotes it, and that producer does not count as lost (no
    knock-on wait before the consumer's task fails)."""
    from spark_credit_shuffle.runtime.pipelined.in_threads import _ThreadAllGather

    plan = make_plan(scs.rebalance(), 2, 2, buffer_timeout_ms=5)
    first_rows = threading.Event()
    data = inputs(2, 2000)

    def failing_input():
        yield data[1][0]
        assert first_rows.wait(30), "consumer 0 received no rows of producer 1"
        raise RuntimeError("the user's input failed")

    gather = _ThreadAllGather(2, timeout_s=30)
    tasks = [PipelinedTask(plan, i, b"k" * 32, "127.0.0.1", attempt_id=i) for i in range(2)]
    errors: dict[int, BaseException] = {}

    def run(i: int, batches) -> None:
        try:
            for batch in tasks[i].run(batches, gather.all_gather):
                # producer 1's rows (ids from 2000 on) prove its connection to consumer 0 is up
                if i == 0 and batch.num_rows and pc.max(batch.column("id")).as_py() >= 2000:
                    first_rows.set()
        except BaseException as exc:
            errors[i] = exc

    threads = [
        threading.Thread(target=run, args=(0, iter(data[0])), daemon=True),
        threading.Thread(target=run, args=(1, failing_input()), daemon=True),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(errors.get(1), RuntimeError) and "the user's input failed" in str(errors[1])
    assert isinstance(errors.get(0), CreditShuffleError), errors.get(0)
    assert "remote error: builtins.RuntimeError: the user's input failed" in str(errors[0])
    assert tasks[0].wiring.lost_producers == set()


def test_a_failing_task_fails_the_exchange_and_stops_every_task(tmp_path):
    plan = make_plan(scs.key_by("k"), 3, 3, injection=Injection(fail_once=("producer", 2), marker_dir=str(tmp_path)))
    with pytest.raises(RuntimeError, match="injected failure of producer subtask 2"):
        run_in_threads(plan, inputs(3, 2000), timeout_s=30)
    received, _ = run_in_threads(plan, inputs(3, 2000))  # the second attempt runs normally
    assert sum(b.num_rows for c in received for b in c) == 6000


@pytest.mark.parametrize("timeout_ms,flushed", [(0, True), (10, True), (-1, False)])
def test_the_buffer_timeout_hands_on_partly_filled_buffers(timeout_ms, flushed):
    plan = make_plan(scs.rebalance(), 1, 1, buffer_timeout_ms=timeout_ms, partition_request_timeout_ms=20_000)
    first, second = inputs(1, 20, batch_rows=10)[0]  # far less than one buffer
    arrived = threading.Event()

    def slow_input():
        yield first
        arrived.wait(1.0)  # the producer holds its second batch until the first rows arrived (or 1 s)
        yield second

    seen_before_end = []

    def on_batch(consumer, batch):
        seen_before_end.append(not arrived.is_set())
        arrived.set()

    received, _ = run_in_threads(plan, [slow_input()], on_batch=on_batch)
    assert sum(b.num_rows for b in received[0]) == 20
    # with a timeout the first rows arrive while the producer still waits; with -1 only at its end
    assert (received[0][0].num_rows == 10) is flushed


def test_one_credit_keeps_flowing_while_the_consumers_own_subpartition_holds_an_unfinished_buffer():
    """A consumer whose own subpartition's head is still being written (no buffer timeout) keeps returning
    credit to a remote producer: it announces the credit of buffers decoded together after the last of
    them, and never keeps it back while it waits.

    Producer 0 writes two and a bit buffers to its own consumer and then holds on to its input until
    consumer 0 has every row of producer 1, which has one credit on its channel to consumer 0.
    """
    plan = make_plan(
        scs.custom(lambda keys, n: np.zeros(len(keys), dtype=np.int64), "k"),
        2,
        2,
        buffers_per_channel=1,
        floating_buffers_per_gate=1,
        buffer_timeout_ms=-1,
    )
    own, remote = inputs(2, 4000, batch_rows=4000)
    own_rows = own[0].slice(0, 300)  # 4 KiB segments: two full buffers and a partly written one
    remote_rows = remote[0].num_rows
    remote_done = threading.Event()
    seen = collections.Counter()

    def holding_input():
        yield own_rows
        remote_done.wait(20.0)

    def on_batch(consumer, batch):
        seen[consumer] += pa.compute.sum(pa.compute.greater_equal(batch.column("id"), 4000)).as_py() or 0
        if seen[0] == remote_rows:
            remote_done.set()

    received, _ = run_in_threads(plan, [holding_input(), remote], on_batch=on_batch, timeout_s=30)
    assert remote_done.is_set()
    assert sum(b.num_rows for b in received[0]) == 300 + remote_rows


def test_rogue_clients_during_an_exchange_are_closed_logged_and_the_exchange_carries_on(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="spark_credit_shuffle")
    plan = make_plan(scs.key_by("k"), 3, 3, injection=Injection(consumer_delay_s=((0, 1e-4),)))
    data = inputs(3, 6000)
    options = TaskOptions(announce_address_dir=str(tmp_path))
    result = {}

    def run():
        result["out"] = run_in_threads(plan, data, options=options)

    runner = threading.Thread(target=run)
    runner.start()
    closed = []
    for task in range(3):
        path = tmp_path / f"task-{task}.addr"
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        host, port = path.read_text().strip().rsplit(":", 1)
        wrong_secret = encode_to_bytes(Hello(b"n" * 32)) + encode_to_bytes(AuthResponse(b"x" * 32))
        for payload in (wrong_secret, b"\x00\x00\x00\x0a garbage!!", b"\xff" * 64):
            with socket.create_connection((host, int(port))) as rogue:
                rogue.sendall(payload)
                closed.append(closed_by_peer(rogue))
    runner.join(60)
    assert all(closed) and len(closed) == 9
    received, _ = result["out"]
    for c, want in enumerate(expected_placement(plan, data)):
        assert table(received[c]).sort_by("id").equals(want)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("closing connection" in w for w in warnings) == 9
    assert any("wrong secret" in w for w in warnings)


# -- on Spark -----------------------------------------------------------------------------------------


@pytest.mark.spark
def test_insufficient_slots_are_reported_before_launch(spark):
    df = spark_rows(spark, 100, 2)
    jobs_before = len(spark.sparkContext.statusTracker().getJobIdsForGroup(None))
    with pytest.raises(InsufficientSlotsError, match=r"runs 5 barrier tasks .* only 4 task slots"):
        scs.exchange(df, scs.key_by("k"), parallelism=5, mode="pipelined")
    assert len(spark.sparkContext.statusTracker().getJobIdsForGroup(None)) == jobs_before
    assert pipelined.available_slots(spark) == (4, 1, 4)


def test_a_barrier_stage_waits_for_the_executors_still_registering():
    seen: list[int] = []

    def registered() -> int:  # executors register one by one after the session starts
        seen.append(len(seen))
        return seen[-1]

    # 4 tasks on executors of 2 slots: the wait ends when the second executor is there, long before its bound
    pipelined.await_executors("hash-pipelined-4", 4, 2, 2, registered, timeout_ms=60_000)
    assert seen == [0, 1, 2]


def test_executors_that_do_not_register_fail_the_exchange_naming_the_wait_and_its_setting():
    with pytest.raises(InsufficientSlotsError) as info:
        pipelined.await_executors("hash-pipelined-4", 4, 2, 2, lambda: 1, timeout_ms=50)
    text = str(info.value)
    assert "runs 4 barrier tasks" in text and "spark.scheduler.maxRegisteredResourcesWaitingTime=50 ms" in text
    assert "1 of the 2 the session is configured with, offer only 2 task slots" in text


@pytest.mark.spark
def test_local_mode_runs_a_barrier_stage_without_waiting_for_executors(spark):
    assert pipelined.registered_executors(spark) is None  # its one executor is the driver: nothing registers
    ex = scs.exchange(spark_rows(spark, 200, 2), scs.key_by("k"), parallelism=2, mode="pipelined")
    assert ex.df.count() == 200


@pytest.mark.spark
def test_streaming_into_the_sink_is_exact_and_keeps_flinks_placement(spark):
    df = spark_rows(spark, 3000, 4)
    ex = scs.exchange(df, scs.key_by("k"), mode="pipelined", buffer_timeout_ms=1)
    out, collected = pipelined.build(ex.plan, df, retryable=False)  # straight from the consumers, no shuffle
    got = out.withColumn("_subtask", F.spark_partition_id()).collect()
    assert sorted(r["id"] for r in got) == list(range(3000))
    keys = sorted({(r["k"], r["_subtask"]) for r in got})
    channels = scs.key_group_channels(pa.array([k for k, _ in keys], pa.int32()), 4, 128).tolist()
    assert [s for _, s in keys] == channels
    assert out.columns == df.columns
    assert sum(r.value for r in collected.rows() if r.metric == "numRecordsIn") == 3000


@pytest.mark.spark
def test_the_retryable_keyword_chooses_how_the_output_is_placed(spark):
    df = spark_rows(spark, 2000, 2)

    def shuffles(ex) -> int:
        return ex.df._jdf.queryExecution().executedPlan().toString().count("Exchange")

    streaming = scs.exchange(df, scs.key_by("k"), mode="pipelined", retryable=False)
    retryable = scs.exchange(df, scs.key_by("k"), mode="pipelined", retryable=True)
    default = scs.exchange(df, scs.key_by("k"), mode="pipelined")
    assert (streaming.plan.retryable, retryable.plan.retryable, default.plan.retryable) == (False, True, None)
    assert shuffles(streaming) == 0 and shuffles(retryable) == shuffles(default) == 1  # the output's placement
    for ex in (streaming, retryable):
        got = ex.df.withColumn("_subtask", F.spark_partition_id()).collect()
        assert sorted(r["id"] for r in got) == list(range(2000))
        keys = sorted({(r["k"], r["_subtask"]) for r in got})  # same placement either way
        assert [s for _, s in keys] == scs.key_group_channels(
            pa.array([k for k, _ in keys], pa.int32()), 2, 128
        ).tolist()
    blocking = scs.exchange(df, scs.key_by("k"), mode="blocking", retryable=False)  # always retryable there
    assert blocking.df.count() == 2000
    with pytest.raises(ConfigError, match="retryable"):
        scs.exchange(df, scs.key_by("k"), mode="pipelined", retryable="yes")


@pytest.mark.spark
def test_streaming_on_spark_connect_is_exact_and_reports_its_metrics(connect_spark):
    """retryable=False on Spark Connect: the consumers' rows go straight into the action, the metrics in band;
    a pipelined exchange checks the task slots from the session's conf (local[4, 2]: 4) before launch."""
    df = spark_rows(connect_spark, 2000, 2)
    ex = scs.exchange(df, scs.key_by("k"), mode="pipelined", retryable=False)
    got = ex.df.withColumn("_subtask", F.spark_partition_id()).collect()
    assert sorted(r["id"] for r in got) == list(range(2000))
    keys = sorted({(r["k"], r["_subtask"]) for r in got})
    assert [s for _, s in keys] == scs.key_group_channels(pa.array([k for k, _ in keys], pa.int32()), 2, 128).tolist()
    assert sum(r.value for r in ex.metric_rows() if r.metric == "numRecordsIn") == 2000
    assert pipelined.available_slots(connect_spark) == (4, 1, 4)
    with pytest.raises(InsufficientSlotsError, match=r"runs 5 barrier tasks .* only 4 task slots"):
        scs.exchange(df, scs.key_by("k"), parallelism=5, mode="pipelined")


@pytest.mark.spark
def test_a_task_killed_on_its_first_attempt_is_retried_and_the_output_is_exact(spark, tmp_path):
    df = spark_rows(spark, 2000, 3)
    injection = scs.Injection(fail_once=("consumer", 1), marker_dir=str(tmp_path))
    ex = scs.exchange(df, scs.key_by("k"), parallelism=3, mode="pipelined", injection=injection)
    assert_same_rows(ex.df, df)
    assert (tmp_path / "failed-consumer-1").exists()
    rows = ex.metric_rows()
    assert sum(r.value for r in rows if r.metric == "numRecordsIn") == 2000  # the successful attempt, once
    assert collections.Counter(r.subtask for r in rows if r.metric == "numRecordsIn") == {0: 3, 1: 3, 2: 3}


@pytest.mark.spark
def test_a_slow_consumer_shows_as_backpressure_in_the_metrics(spark):
    df = spark_rows(spark, 60_000, 3)  # about 50 buffers from each producer to each consumer
    injection = scs.Injection(consumer_delay_s=((0, 3e-5),))  # consumer 0: about 3 ms per buffer
    ex = scs.exchange(df, scs.key_by("k"), mode="pipelined", injection=injection, segment_size=4096)
    assert ex.df.count() == 60_000
    m = ex.metrics()
    back_pressured = m.where("side = 'producer' and metric = 'accumulateBackPressuredTimeMs'").agg(F.sum("value"))
    assert back_pressured.first()[0] > 0
    busy = {r.subtask: r.value for r in m.where("side = 'consumer' and metric = 'busyTimeMsPerSecond'").collect()}
    assert busy[0] == max(busy.values())


@pytest.mark.spark
def test_a_stalled_consumer_fails_the_stage_with_a_named_timeout(spark):
    df = spark_rows(spark, 20_000, 2)
    # consumer 1 sleeps ~5 s on its first buffer; the timeout is long enough that a busy machine does not make
    # a healthy consumer look stalled first
    injection = scs.Injection(consumer_delay_s=((1, 0.05),))
    ex = scs.exchange(
        df, scs.key_by("k"), mode="pipelined", injection=injection, segment_size=4096, buffers_request_timeout_ms=1500
    )
    out, _ = pipelined.build(ex.plan, df, retryable=False)  # no stage retry: fail once, fast
    # whichever task's failure reaches the driver first (a producer's timeout, or a consumer whose producer
    # failed), it is the first cause: the producers' typed timeout, naming the stalled consumer
    with pytest.raises(ExchangeTimeoutError, match=r"waited \d+ ms for a network buffer") as err, scs.typed_errors():
        out.write.format("noop").mode("overwrite").save()
    assert "consumer subtask 1" in str(err.value)


def test_a_consumer_s_chained_failure_names_its_producer_s_typed_error():
    """When the consumer's task, not the producer's, fails the stage first, Spark's message holds the consumer's
    chained traceback: its channel error (the cause, printed first) and the producer's failure it raised."""
    cause = (
        "spark_credit_shuffle.protocol.channels.InputChannelError: producer subtask 1 at 127.0.0.1:36931: remote "
        "error: spark_credit_shuffle.errors.ExchangeTimeoutError: producer subtask 1 waited 1500 ms for a network "
        "buffer"
    )
    raised = "spark_credit_shuffle.errors.ExchangeTimeoutError: producer subtask 1 waited 1500 ms for a network buffer"
    chained = (
        'Traceback (most recent call last):\n  File "task.py", line 583, in _next_burst\n'
        f"{cause}\n\nThe above exception was the direct cause of the following exception:\n\n"
        'Traceback (most recent call last):\n  File "task.py", line 254, in run\n    raise remote from exc\n'
        f"{raised}\n SQLSTATE: 38000\n\tat org.apache.spark.api.python.BasePythonRunner"
    )
    error = scs.task_error(RuntimeError(chained))
    assert type(error) is ExchangeTimeoutError and str(error).startswith("producer subtask 1 waited 1500 ms")
    # a cause with nothing of this package raised after it is still the typed error
    alone = chained.replace(raised, "ValueError: the user's code")
    assert type(scs.task_error(RuntimeError(alone))).__name__ == "InputChannelError"


@pytest.mark.spark
def test_a_rogue_connection_during_a_spark_exchange_changes_nothing(spark, tmp_path):
    df = spark_rows(spark, 6000, 3)
    ex = scs.exchange(df, scs.key_by("k"), mode="pipelined", injection=Injection(consumer_delay_s=((0, 3e-4),)))
    out, _ = pipelined.build(ex.plan, df, options=TaskOptions(announce_address_dir=str(tmp_path)))
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("rows", out.collect()))
    runner.start()
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("task-*.addr"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    for path in sorted(tmp_path.glob("task-*.addr")):
        host, port = path.read_text().strip().rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as rogue:
            rogue.sendall(encode_to_bytes(Hello(os.urandom(32))) + encode_to_bytes(AuthResponse(os.urandom(32))))
            assert closed_by_peer(rogue)
    runner.join(60)
    assert sorted(r["id"] for r in result["rows"]) == list(range(6000))


# -- the driver's address service -----------------------------------------------------------------------


def test_the_address_service_answers_every_task_in_order_and_turns_away_strangers(caplog):
    from spark_credit_shuffle.errors import CreditShuffleError
    from spark_credit_shuffle.runtime.pipelined.rendezvous import AddressRendezvous, all_gather_via

    service = AddressRendezvous("127.0.0.1", timeout_s=30)
    try:
        secret = os.urandom(32)
        service.register("ex/1", secret, 3)
        answers: dict[int, list[str]] = {}

        def task(i: int, attempt: int, key: str = "ex/1", secret: bytes = secret) -> None:
            gather = all_gather_via(service.address, key, secret, "stage 7", i, attempt, 10.0)
            try:
                answers[i] = gather(f"address of {i}")
            except CreditShuffleError as exc:
                answers[i] = [str(exc)]

        threads = [threading.Thread(target=task, args=(i, 10 + i)) for i in (2, 0)]
        for t in threads:
            t.start()
        with caplog.at_level(logging.WARNING, logger="spark_credit_shuffle"):
            for bad in (  # none of these joins the group: a wrong secret (the task finds the service's proof
                # wrong and leaves), an unknown exchange
                lambda: all_gather_via(service.address, "ex/1", os.urandom(32), "stage 7", 1, 99, 5.0)("rogue"),
                lambda: all_gather_via(service.address, "ex/9", secret, "stage 7", 1, 99, 5.0)("rogue"),
            ):
                with pytest.raises(CreditShuffleError, match="address service"):
                    bad()
            with socket.create_connection(service.address, timeout=5) as rogue:
                rogue.sendall(b"\x00garbage\n")
                assert closed_by_peer(rogue)
        assert service.num_rejected == 3
        assert service.rejected_by_cause == {"closed early": 1, "unknown exchange": 1, "bad request": 1}
        task(1, 11)  # the last task completes the group: everyone gets every message, in task order
        for t in threads:
            t.join(10)
        assert answers == {i: ["address of 0", "address of 1", "address of 2"] for i in range(3)}
        # the stage again: a late task of an older attempt is turned away, the newer attempt keeps its place
        answers.clear()
        waiting = threading.Thread(target=task, args=(0, 20))
        waiting.start()
        deadline = time.monotonic() + 10
        while not service._groups and time.monotonic() < deadline:
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="spark_credit_shuffle"):
            task(0, 5)
        assert "attempt 5 is older than attempt 20" in caplog.text and "address service" in answers[0][0]
        others = [threading.Thread(target=task, args=(i, 20 + i)) for i in (1, 2)]
        for t in others:
            t.start()
        for t in [*others, waiting]:
            t.join(10)
        assert answers == {i: ["address of 0", "address of 1", "address of 2"] for i in range(3)}
    finally:
        service.close()


@pytest.mark.spark
def test_tasks_exchange_addresses_through_spark_allgather_when_asked(spark):
    """The public setting (keyword or spark.creditShuffle.addressExchange) reaches the tasks."""
    df = spark_rows(spark, 2000, 2)
    ex = scs.exchange(df, scs.key_by("k"), mode="pipelined", address_exchange="allgather", retryable=False)
    assert ex.plan.config.address_exchange == "allgather"
    assert sorted(r["id"] for r in ex.df.collect()) == list(range(2000))
    with pytest.raises(ConfigError, match="address_exchange"):
        TaskOptions(address_exchange="carrier pigeon")


def test_with_timeout_minus_one_markers_and_keep_alives_move_no_partly_filled_buffer():
    # given buffer timeout -1, a latency marker every 20 ms and a partition request timeout of 600 ms (a
    # keep-alive every 150 ms), and a producer that writes far less than a buffer, then holds its input 1.5 s
    plan = make_plan(scs.rebalance(), 1, 1, buffer_timeout_ms=-1, partition_request_timeout_ms=600)
    first, second = inputs(1, 20, batch_rows=10)[0]
    arrivals_before_end: list[bool] = []
    released = threading.Event()

    def holding_input():
        yield first
        time.sleep(1.5)  # longer than the partition request timeout: only keep-alives say it is alive
        released.set()
        yield second

    def on_batch(consumer, batch):
        arrivals_before_end.append(not released.is_set())

    # when the exchange runs
    received, rows = run_in_threads(
        plan, [holding_input()], options=TaskOptions(latency_interval_ms=20), on_batch=on_batch, timeout_s=30
    )
    # then the consumer did not time out, nothing arrived while the buffer was partly filled, every row
    # arrived at the end, and the latency markers (records inside the buffers) were still measured
    assert sum(b.num_rows for b in received[0]) == 20
    assert arrivals_before_end and not any(arrivals_before_end)
    assert metric(rows, CONSUMER, "latencyMs")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["pipelined", "blocking"]),
    partitioner=st.sampled_from(["key_by", "rebalance", "broadcast"]),
    producers=st.integers(1, 3),
    consumers=st.integers(1, 3),
    segment=st.sampled_from([4096, 8192]),
    buffers_per_channel=st.integers(0, 2),
    max_buffers_per_channel=st.integers(1, 3),
    floating=st.integers(0, 2),
    overdraft=st.integers(0, 2),
    timeout_ms=st.sampled_from([-1, 0, 5]),
)
def test_tight_configurations_finish_without_timeouts_and_conserve_rows(
    mode, partitioner, producers, consumers, segment, buffers_per_channel, max_buffers_per_channel, floating,
    overdraft, timeout_ms,
):  # fmt: skip
    # given a legal but tight configuration: few buffers per channel, little floating and overdraft
    part = {"key_by": scs.key_by("k"), "rebalance": scs.rebalance(seed=2), "broadcast": scs.broadcast()}[partitioner]
    plan = make_plan(
        part,
        producers,
        consumers,
        segment_size=segment,
        buffers_per_channel=buffers_per_channel,
        max_buffers_per_channel=max_buffers_per_channel,
        floating_buffers_per_gate=max(floating, 1 if buffers_per_channel == 0 else 0),
        max_overdraft_buffers_per_gate=overdraft,
        buffer_timeout_ms=timeout_ms,
        buffers_request_timeout_ms=10_000,
    )
    data = inputs(producers, 1500, batch_rows=700)
    # when the exchange runs
    if mode == "pipelined":
        received, _ = run_in_threads(plan, data, timeout_s=60)
        got = [table(batches).sort_by("id") for batches in received]
    else:
        outputs = run_blocking(plan, dict(enumerate(data)))
        got = [outputs[c][0].sort_by("id") for c in range(consumers)]
    # then it finished (no timeout) and every consumer got exactly the rows the partitioner chose for it
    expected = expected_placement(plan, data)
    for c in range(consumers):
        assert got[c].equals(expected[c]), f"consumer {c}"


def test_a_producer_waits_for_a_slow_consumer_that_works_through_the_buffers_it_received():
    # given a consumer that sleeps 0.2 ms per row and a partition request timeout shorter than the time it
    # takes to work through the buffers (32 KiB, up to 10 per channel) it holds from a producer that has
    # sent everything (its 10,000 rows: 2 s, twice the timeout)
    plan = make_plan(
        scs.rebalance(seed=1),
        2,
        2,
        injection=Injection(consumer_delay_s=((0, 2e-4),)),
        partition_request_timeout_ms=1000,
        segment_size=32768,
    )
    data = inputs(2, 10_000, batch_rows=500)
    # when the exchange runs, then no task times out waiting for the end, and every row arrives once
    received, _ = run_in_threads(plan, data, timeout_s=60)
    assert sum(b.num_rows for c in received for b in c) == 20_000


def test_the_in_process_address_exchange_names_a_timeout_apart_from_a_failed_task():
    from spark_credit_shuffle.errors import CreditShuffleError
    from spark_credit_shuffle.runtime.pipelined.in_threads import _ThreadAllGather

    # given two tasks of which only one ever publishes its address: a timeout that says what it waited for
    lonely = _ThreadAllGather(2, timeout_s=0.2)
    with pytest.raises(ExchangeTimeoutError, match="not every task published its address within"):
        lonely.all_gather('{"task": 0}')
    # given a task that failed (abort) while another waits: the failure, not a timeout
    gather = _ThreadAllGather(2, timeout_s=30)
    threading.Timer(0.05, gather.abort).start()
    with pytest.raises(CreditShuffleError, match="another task failed") as err:
        gather.all_gather('{"task": 0}')
    assert not isinstance(err.value, ExchangeTimeoutError)


def test_a_task_without_a_producer_half_reads_its_empty_input_to_the_end():
    """Spark reuses a Python worker only once the worker read its task's input to the end; a task of the
    barrier stage that only consumes (more consumers than producers) gets an empty input and must still read
    it, or every such exchange waits for a new Python worker to start (1-2 s) in place of the one that quit."""
    plan = make_plan(scs.rebalance(), 1, 2)
    gather = pipelined._ThreadAllGather(2, 30)
    ended = threading.Event()
    received: dict[int, int] = {}
    errors: list[BaseException] = []

    def empty():
        yield from ()
        ended.set()  # reached only when the task asks for the input after its last batch

    def run(i: int) -> None:
        task = PipelinedTask(plan, i, b"s" * 32, "127.0.0.1", attempt_id=i)
        batches = iter(inputs(1, 300)[0]) if i == 0 else empty()
        try:
            out = task.run(batches, gather.all_gather)  # data rows (metrics cell null), then the metrics row
            received[i] = sum(b.column(b.num_columns - 1).null_count for b in out)
        except BaseException as exc:
            errors.append(exc)
            gather.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and ended.is_set()
    assert sum(received.values()) == 300
