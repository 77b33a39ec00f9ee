"""The live monitor: timeline samples reach the driver while the exchange runs, over an authenticated,
bounded channel; a line per exchange on stderr, or a callback; nothing on Spark Connect but a word."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from pyspark.sql import functions as F

import spark_credit_shuffle as scs
from spark_credit_shuffle.metrics import CONSUMER, PRODUCER, MetricRow
from spark_credit_shuffle.runtime.monitor import Monitor, MonitorClient, MonitorService


def wait_until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def sample(subtask, value):
    return [MetricRow(PRODUCER, subtask, None, "outPoolUsage", "sample", value, time.time() * 1000.0)]


def test_samples_from_a_task_reach_the_callback_and_forged_or_replayed_lines_are_refused():
    got: list[list[MetricRow]] = []
    service = MonitorService("127.0.0.1")
    try:
        address = service.register("hash-pipelined-1", Monitor("hash-pipelined-1", callback=got.append))
        client = MonitorClient(address, attempt=7)
        client.publish(sample(0, 0.5))
        client.close()
        assert wait_until(lambda: got)
        assert got[0][0].value == 0.5 and got[0][0].time_ms is not None

        host, port = service.address
        body = json.dumps(
            {"key": address.key, "attempt": 7, "seq": 99, "rows": [["producer", 0, None, "x", "sample", 1.0, 1.0]]}
        )
        for line in (
            address.key.encode() + b" " + b"0" * 64 + b" " + body.encode() + b"\n",  # a mac without the secret
            b"not json at all\n",
        ):
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.sendall(line)
                sock.settimeout(5)
                assert sock.recv(1) == b""  # closed by the service
        # a line with the secret's mac but the sequence number the attempt used already: a replay
        again = MonitorClient(address, attempt=7)
        replay = next(again._lines(sample(1, 0.25)))
        again.close()
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(replay)
            sock.settimeout(5)
            assert sock.recv(1) == b""
        assert len(got) == 1 and service.num_rejected == 3
    finally:
        service.close()


def test_a_line_per_exchange_with_what_the_last_samples_say():
    monitor = Monitor("hash-pipelined-2", producers=3)
    now = time.time() * 1000.0
    monitor.accept(
        [
            MetricRow(PRODUCER, 0, None, "numRecordsOut", "sample", 1500.0, now),
            MetricRow(PRODUCER, 0, None, "numBuffersOut", "sample", 7.0, now),
            MetricRow(PRODUCER, 1, None, "numBuffersOut", "sample", 3.0, now),
            MetricRow(PRODUCER, 0, None, "isBackPressured", "sample", 1.0, now),
            MetricRow(PRODUCER, 0, None, "outPoolUsage", "sample", 1.0, now),
            MetricRow(PRODUCER, 1, None, "numRecordsOut", "sample", 500.0, now),
            MetricRow(CONSUMER, 0, None, "numRecordsIn", "sample", 900.0, now),
            MetricRow(CONSUMER, 0, None, "numRecordsInPerSecond", "sample", 100.0, now),
            MetricRow(CONSUMER, 1, None, "numRecordsIn", "sample", 1000.0, now),
            MetricRow(CONSUMER, 1, None, "numRecordsInPerSecond", "sample", 5000.0, now),
            MetricRow(CONSUMER, 1, None, "inPoolUsage", "sample", 0.25, now),
        ]
    )
    line = monitor.line()
    assert "2,000 rows out in 10 buffers, 1,900 in" in line
    # counted against the exchange's 3 producers, not the 2 sampled so far; the back-pressured one named
    assert "back-pressured producers: 1 of 3 (0)" in line
    assert "outPool max 1.00, inPool max 0.25" in line


def consumer_times(subtask, busy, idle, back_pressured, now, rate=0.0):
    return [
        MetricRow(CONSUMER, subtask, None, "busyTimeMsPerSecond", "sample", busy, now),
        MetricRow(CONSUMER, subtask, None, "idleTimeMsPerSecond", "sample", idle, now),
        MetricRow(CONSUMER, subtask, None, "backPressuredTimeMsPerSecond", "sample", back_pressured, now),
        MetricRow(CONSUMER, subtask, None, "numRecordsInPerSecond", "sample", rate, now),
    ]


def test_the_line_names_the_busy_consumer_not_the_starved_one():
    """Flink's way to the origin: the consumer busy and not back-pressured while the producers wait; a consumer
    starved at 0 rows/s is a victim, not the cause."""
    now = time.time() * 1000.0
    producers = [MetricRow(PRODUCER, p, None, "isBackPressured", "sample", 1.0, now) for p in range(4)]

    def line(*consumers):
        monitor = Monitor("rebalance-pipelined-9", producers=4)
        monitor.accept(producers + [row for c in consumers for row in consumer_times(*c, now)])
        return monitor.line()

    slow_two = line((0, 30.0, 970.0, 0.0), (1, 35.0, 965.0, 0.0), (2, 995.0, 5.0, 0.0), (3, 28.0, 972.0, 0.0))
    assert "back-pressured producers: 4 of 4 (0, 1, 2, 3)" in slow_two
    assert "backpressure from consumer 2 (busy 995 ms/s)" in slow_two
    after_one = line((0, 40.0, 900.0, 60.0), (1, 30.0, 80.0, 890.0), (2, 40.0, 930.0, 30.0), (3, 45.0, 900.0, 55.0))
    assert "backpressure from the step after consumer 1 (back-pressured on its output 890 ms/s)" in after_one
    spread = line((0, 500.0, 450.0, 50.0), (1, 480.0, 500.0, 20.0), (2, 560.0, 400.0, 40.0), (3, 420.0, 560.0, 20.0))
    assert "backpressure spread over the consumers (busy 420-560 ms/s)" in spread
    assert "from consumer" not in spread


def slow_df(spark, n=30_000):
    return spark.range(0, n, 1, 2).select("id", (F.col("id") % 101).cast("int").alias("k"))


@pytest.mark.spark
@pytest.mark.parametrize("mode", ["pipelined", "blocking"])
def test_samples_arrive_while_the_action_runs(spark, mode):
    got: list[tuple[float, list[MetricRow]]] = []
    ex = scs.exchange(
        slow_df(spark),
        scs.rebalance(),
        2,
        mode=mode,
        injection=scs.Injection(consumer_delay_s=((0, 0.0001),)),  # 1.5 s on consumer 0
        segment_size="4kb",
        monitor=lambda rows: got.append((time.monotonic(), rows)),
    )
    assert ex.df.count() == 30_000
    finished = time.monotonic()
    before = [rows for at, rows in got if at < finished]
    assert len(before) >= 3, f"{len(before)} samples before the action returned"
    assert wait_until(lambda: {(r.side, r.subtask) for _, rows in got for r in rows} >= {(PRODUCER, 0), (CONSUMER, 0)})
    assert all(r.stat == "sample" and r.time_ms is not None for _, rows in got for r in rows)
    # the counters so far come with every sample: the last ones are the run's
    last_in = {}
    for _, rows in got:
        for r in rows:
            if r.metric == "numRecordsIn":
                last_in[r.subtask] = r.value
    assert sum(last_in.values()) == 30_000


@pytest.mark.spark
def test_monitor_true_prints_lines_to_stderr(spark, capsys):
    ex = scs.exchange(
        slow_df(spark, 60_000),
        scs.rebalance(),
        2,
        mode="pipelined",
        injection=scs.Injection(consumer_delay_s=((0, 0.0001),)),  # 3 s on consumer 0
        segment_size="4kb",
        monitor=True,
    )
    ex.df.count()
    err = ""

    def printed() -> bool:  # the service prints on its rounds: read what it wrote so far
        nonlocal err
        err += capsys.readouterr().err
        return any(line.startswith(f"[{ex.name} ") for line in err.splitlines())

    assert wait_until(printed), err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith(f"[{ex.name} ")]
    assert "back-pressured producers:" in lines[-1] and "rows out" in lines[-1]


@pytest.mark.spark
def test_the_setting_turns_it_on(spark):
    spark.conf.set("spark.creditShuffle.monitor", "true")
    try:
        ex = scs.exchange(spark.range(0, 100, 1, 2), scs.rebalance(), 2)
        assert ex.plan.monitor is not None
    finally:
        spark.conf.unset("spark.creditShuffle.monitor")
    assert scs.exchange(spark.range(0, 100, 1, 2), scs.rebalance(), 2).plan.monitor is None
    with pytest.raises(scs.ConfigError, match=r"argument 'monitor'"):
        scs.exchange(spark.range(3), scs.rebalance(), 1, monitor="yes")


@pytest.mark.spark
def test_on_spark_connect_the_exchange_runs_without_a_monitor(connect_spark):
    got = threading.Event()
    ex = scs.exchange(connect_spark.range(0, 100, 1, 2), scs.rebalance(), 2, monitor=lambda rows: got.set())
    assert ex.plan.monitor is None and ex.df.count() == 100
    assert not got.is_set()


def test_a_quiet_exchange_keeps_no_thread_and_an_old_one_no_key(monkeypatch):
    from spark_credit_shuffle.runtime import monitor as monitor_module

    monkeypatch.setattr(monitor_module, "_DISPATCH_IDLE_S", 0.2)
    monkeypatch.setattr(monitor_module, "EXCHANGE_TTL_S", 1.0)
    got: list[list[MetricRow]] = []
    service = MonitorService("127.0.0.1")
    try:
        address = service.register("quiet-1", Monitor("quiet-1", callback=got.append))

        def dispatching() -> bool:
            return any(t.name == "credit-shuffle-monitor-quiet-1" for t in threading.enumerate())

        for value in (0.5, 0.75):  # a sample starts the callback's thread; with none for a while it ends
            client = MonitorClient(address, attempt=int(value * 100))
            client.publish(sample(0, value))
            client.close()
            assert wait_until(lambda v=value: got and got[-1][0].value == v)
            assert wait_until(lambda: not dispatching())
        # a key unused for longer than EXCHANGE_TTL_S is forgotten: its samples are refused from then on
        assert wait_until(lambda: address.key not in service._exchanges)
        late = MonitorClient(address, attempt=99)
        late.publish(sample(0, 1.0))
        late.close()
        assert wait_until(lambda: service.num_rejected == 1)
        assert len(got) == 2
    finally:
        service.close()
