"""Probes: silent connections flood every task's port and the driver's address service while a pipelined
exchange runs, over real sockets on 127.0.0.1. The exchange's output stays exact, and what the flood costs
the driver (threads, memory) stays within the bounds its caps allow."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
from exchange_helpers import expected_placement, inputs, make_plan, spark_rows, table
from spark_helpers import assert_same_rows

import spark_credit_shuffle as scs
from spark_credit_shuffle.runtime import pipelined
from spark_credit_shuffle.runtime.pipelined import TaskOptions, run_in_threads
from spark_credit_shuffle.runtime.pipelined.rendezvous import MAX_REQUEST, driver_rendezvous

pytestmark = pytest.mark.timeout(180)

PER_TASK = 100  # silent connections to each task's port
TO_SERVICE = 300  # silent connections to the driver's address service
#: Seconds between two silent connections to a task's port. A task closes a peer that has not authenticated
#: only when ``max_unauthenticated`` (32 here) newer connections arrived before its Hello, which a consumer
#: writes right after its connect. Unpaced, this thread opened 32 connections in about 3 ms, less than a
#: loaded test process (every task a thread of it) once took to write a Hello; paced, they take 16 ms.
PACE_S = 0.0005


class Flood:
    """A thread that opens ``per_task`` silent connections to each task's port as soon as the task
    announces it (``TaskOptions.announce_address_dir``), after ``to_service`` to ``service`` if given, and
    keeps them open, saying nothing, until :meth:`close`. When it has opened them it sets ``done`` and
    creates the file ``flood-done``: the producers' input waits for it (:func:`held`), so the exchange
    cannot end before the flood is in place, whatever the order in which the tasks connect meanwhile."""

    def __init__(self, directory: Path, tasks: int, per_task: int, service=None, to_service: int = 0) -> None:
        self.directory, self.tasks, self.per_task = directory, tasks, per_task
        self.service, self.to_service = service, to_service
        self.sockets: list[socket.socket] = []
        self.opened: dict[str, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="flood")
        self.thread.start()

    def _open(self, what: str, address: tuple[str, int], count: int, pace_s: float = 0.0) -> None:
        self.opened[what] = 0
        for _ in range(count):
            try:
                self.sockets.append(socket.create_connection(address, timeout=5))
            except OSError:
                return  # the task ended already: the probe checks how many it opened
            self.opened[what] += 1
            if pace_s:
                time.sleep(pace_s)

    def _run(self) -> None:
        try:
            if self.service is not None:
                self._open("service", self.service, self.to_service)
            waiting = set(range(self.tasks))
            deadline = time.monotonic() + 60
            while waiting and time.monotonic() < deadline:
                for task in sorted(waiting):
                    path = self.directory / f"task-{task}.addr"
                    if path.exists():
                        host, port = path.read_text().strip().rsplit(":", 1)
                        self._open(f"task {task}", (host, int(port)), self.per_task, PACE_S)
                        waiting.discard(task)
                time.sleep(0.005)
        finally:
            (self.directory / "flood-done").touch()
            self.done.set()

    def close(self) -> None:
        self.thread.join(60)
        for s in self.sockets:
            s.close()


def held(batches, marker: str, timeout_s: float = 60.0):
    """``batches``, once the file ``marker`` exists: a producer's input that waits for the flood."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.005)
    yield from batches


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_silent_connections_to_every_task_port_leave_an_in_process_exchange_exact(tmp_path):
    plan = make_plan(scs.key_by("k"), 3, 3)
    data = inputs(3, 6000)
    flood = Flood(tmp_path, 3, PER_TASK)
    marker = str(tmp_path / "flood-done")
    try:
        received, _ = run_in_threads(
            plan, [held(d, marker) for d in data], options=TaskOptions(announce_address_dir=str(tmp_path))
        )
    finally:
        flood.close()
    assert flood.opened == {f"task {t}": PER_TASK for t in range(3)}  # the flood hit the exchange while it ran
    for c, want in enumerate(expected_placement(plan, data)):
        assert table(received[c]).sort_by("id").equals(want)


@pytest.mark.spark
def test_silent_connections_to_task_ports_and_the_address_service_leave_a_spark_exchange_exact(spark, tmp_path):
    df = spark_rows(spark, 6000, 3)
    marker = str(tmp_path / "flood-done")

    def held_in_task(batches):  # pickled by value: Spark's workers cannot import this test module
        import os
        import time

        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.005)
        yield from batches

    source = df.mapInArrow(held_in_task, df.schema)  # runs in the barrier tasks, before their producers
    ex = scs.exchange(source, scs.key_by("k"), mode="pipelined")
    out, _ = pipelined.build(ex.plan, source, options=TaskOptions(announce_address_dir=str(tmp_path)))
    service = driver_rendezvous(spark.conf.get("spark.driver.host", None) or "127.0.0.1")
    threads_before, rss_before = threading.active_count(), rss_bytes()
    samples: list[tuple[int, int, int]] = []  # (threads, rss, service connections) while the flood lasts
    result: dict[str, list] = {}
    runner = threading.Thread(target=lambda: result.setdefault("rows", out.collect()), name="runner")
    runner.start()
    flood = Flood(tmp_path, 3, PER_TASK, service.address, TO_SERVICE)
    try:
        while runner.is_alive() or not flood.done.is_set():
            samples.append((threading.active_count(), rss_bytes(), service.num_connections))
            time.sleep(0.02)
        runner.join(120)
    finally:
        flood.close()
    threads_after, rss_after = threading.active_count(), rss_bytes()
    assert flood.opened == {"service": TO_SERVICE, **{f"task {t}": PER_TASK for t in range(3)}}
    assert_same_rows(spark.createDataFrame(result["rows"], df.schema), df)
    # the service runs one thread whatever connects (it was running before): the test's own two (runner,
    # flood) and at most two that PySpark may start for the action are the rest, not one per connection
    threads_max = max(s[0] for s in samples)
    assert threads_max <= threads_before + 2 + 2
    # connections held by the service: at most its cap of pending ones, plus one per task waiting
    assert max(s[2] for s in samples) <= service.max_pending + 3
    # memory: each pending connection holds at most MAX_REQUEST bytes; the rest is the test's own sockets
    # and the collected rows, a few MiB (a thread per connection cost about 100 MB here)
    rss_max = max(s[1] for s in samples)
    assert rss_max - rss_before <= service.max_pending * MAX_REQUEST + 24 * 2**20
    print(
        f"\nflood probe: threads before/max during/after {threads_before}/{threads_max}/{threads_after}; "
        f"RSS before/max during/after {rss_before / 2**20:.1f}/{rss_max / 2**20:.1f}/{rss_after / 2**20:.1f} MiB; "
        f"service connections max {max(s[2] for s in samples)} (cap {service.max_pending})"
    )
