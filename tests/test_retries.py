"""Single faults, several times each, and the first retry exact every time.

On Spark (``spark`` marker): a pipelined exchange whose producer raises once, whose consumer raises once, or
one of whose Python workers is killed with SIGKILL before it got to the exchange, in the same barrier stage.
Spark re-runs the barrier stage whole, once: the first attempt fails with the injected fault, the second is
exact, and no stage runs a third time (a retry that met anything of the attempt before it, an address, a
connection, or a partition output kept from it, would fail again). The blocking exchange, whose tasks Spark
retries one by one, gets the same faults.

Without Spark: the driver's address service groups the tasks of each stage attempt apart whatever the order
in which they come, stops the tasks of an attempt that is over, and holds every task of an address group at
the end until all of them got there, failing them all when one leaves (see
``spark_credit_shuffle/runtime/pipelined/rendezvous/``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F
from tcp_helpers import wait_until

import spark_credit_shuffle as scs
from spark_credit_shuffle.errors import CreditShuffleError, ExchangeTimeoutError
from spark_credit_shuffle.runtime.pipelined.rendezvous import (
    OVER_CHECK_S,
    AddressRendezvous,
    Attempt,
    SparkStageAttempts,
    all_gather_via,
    end_barrier_via,
    group_token,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS = 600
#: Runs per kind of fault and mode: each fails its first attempt once. ``SCS_RETRY_RUNS=10`` for the long count.
RUNS = int(os.environ.get("SCS_RETRY_RUNS", "3"))
SECRET = os.urandom(32)
EXCHANGE = "ex/retries"
#: How long a test waits for a task's answer that should come (the service's own bound on a group is 30 s).
ANSWER_WAIT_S = 10.0


# -- the driver's address service, with a scheduler that says which attempt a task attempt belongs to --------


class Scheduler:
    """Stage attempts as a test sets them: ``tasks[(stage, attempt)]`` its task attempt ids; an attempt is over
    once in ``over`` or once a later attempt of its stage exists (as Spark's task sets say); ``blind``: it
    cannot tell (None), as when the driver's scheduler cannot be read."""

    def __init__(self) -> None:
        self.tasks: dict[tuple[int, int], set[int]] = {}
        self.over: set[tuple[int, int]] = set()
        self.blind = False

    def attempt_of(self, stage: int, task_attempt_id: int) -> Attempt | None:
        if self.blind:
            return None
        for (s, number), ids in self.tasks.items():
            if s == stage and task_attempt_id in ids:
                return Attempt(number, bool(self.is_over(stage, number)))
        return Attempt(-1, True)

    def is_over(self, stage: int, attempt: int) -> bool | None:
        if self.blind:
            return None
        newest = max(a for s, a in self.tasks if s == stage)
        return (stage, attempt) in self.over or attempt < newest


class Outcome:
    """What one task's call returned or raised, from a thread of its own."""

    def __init__(self, call, what: str) -> None:
        self.what = what
        self.value: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call) -> None:
        try:
            self.value = call()
        except BaseException as exc:
            self.error = exc

    def done(self, timeout_s: float = ANSWER_WAIT_S) -> Outcome:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"{self.what}: no answer within {timeout_s} s"
        return self


@pytest.fixture
def service() -> Iterator[tuple[AddressRendezvous, Scheduler]]:
    scheduler = Scheduler()
    rendezvous = AddressRendezvous("127.0.0.1", timeout_s=30, attempts=scheduler)
    rendezvous.register(EXCHANGE, SECRET, 3)
    try:
        yield rendezvous, scheduler
    finally:
        rendezvous.close()


def _ask(rendezvous: AddressRendezvous, task: int, task_attempt_id: int, stage: int = 5) -> Outcome:
    gather = all_gather_via(
        rendezvous.address, EXCHANGE, SECRET, f"stage {stage}", task, task_attempt_id, 20.0, stage=stage
    )
    what = f"the addresses for task {task} (task attempt {task_attempt_id})"
    return Outcome(lambda: gather(f"task {task} attempt {task_attempt_id}"), what)


def _wait_for_waiting(rendezvous: AddressRendezvous, count: int) -> None:
    def waiting() -> int:
        return sum(len(g.waiting) for g in list(rendezvous._groups.values()))

    assert wait_until(lambda: waiting() == count), f"{count} tasks waiting in the service: {waiting()} after 10 s"


def test_a_retried_attempt_is_never_handed_an_address_of_the_attempt_before_it(service):
    rendezvous, scheduler = service
    scheduler.tasks = {(5, 0): {10, 11, 12}}
    stale = [_ask(rendezvous, 0, 10), _ask(rendezvous, 2, 12)]  # task 1 of attempt 0 died before it asked
    _wait_for_waiting(rendezvous, 2)
    scheduler.tasks[(5, 1)] = {20, 21, 22}  # Spark re-runs the stage; attempt 0's tasks are not killed yet
    first = _ask(rendezvous, 1, 21)  # would complete attempt 0's group if groups were by stage
    for outcome in stale:  # told at the next look at attempts: their attempt is over
        assert isinstance(outcome.done().error, CreditShuffleError)
        assert "attempt 0 of stage 5" in str(outcome.error) and "is over" in str(outcome.error)
    late = _ask(rendezvous, 0, 10).done()  # a task of attempt 0 that asks only now takes part in nothing
    assert isinstance(late.error, CreditShuffleError) and "is over" in str(late.error)
    rest = [_ask(rendezvous, 0, 20), _ask(rendezvous, 2, 22)]
    expected = ["task 0 attempt 20", "task 1 attempt 21", "task 2 attempt 22"]
    for outcome in [first, *rest]:
        assert outcome.done().error is None and outcome.value == expected


def test_the_tasks_of_an_attempt_that_fails_while_they_wait_stop_before_their_group_times_out(service):
    rendezvous, scheduler = service
    scheduler.tasks = {(5, 0): {10, 11, 12}}
    waiting = [_ask(rendezvous, 0, 10), _ask(rendezvous, 1, 11)]
    _wait_for_waiting(rendezvous, 2)
    scheduler.over.add((5, 0))  # task 2 failed before it asked: Spark marks the attempt's task set a zombie
    for outcome in waiting:  # well within the group's 30 s: at a look at attempts
        assert isinstance(outcome.done().error, CreditShuffleError)
        assert "attempt 0 of stage 5 of ex/retries is over" in str(outcome.error)
    assert not rendezvous._groups


def test_a_task_the_scheduler_cannot_place_joins_the_group_of_the_newest_attempt_waiting(service):
    rendezvous, scheduler = service
    scheduler.tasks = {(5, 0): {10, 11, 12}}
    placed = [_ask(rendezvous, 0, 10), _ask(rendezvous, 1, 11)]
    _wait_for_waiting(rendezvous, 2)
    scheduler.blind = True  # a look at the scheduler failed: not split into a group of its own
    unplaced = _ask(rendezvous, 2, 12)
    expected = ["task 0 attempt 10", "task 1 attempt 11", "task 2 attempt 12"]
    for outcome in [*placed, unplaced]:
        assert outcome.done().error is None and outcome.value == expected


def test_without_a_scheduler_to_ask_the_tasks_of_a_stage_are_grouped_by_the_stage(service):
    rendezvous, scheduler = service
    scheduler.blind = True
    outcomes = [_ask(rendezvous, i, 30 + i) for i in range(3)]
    expected = [f"task {i} attempt {30 + i}" for i in range(3)]
    for outcome in outcomes:
        assert outcome.done().error is None and outcome.value == expected


def _end(rendezvous: AddressRendezvous, task: int, token: str, timeout_s: float = 20.0) -> Outcome:
    end = end_barrier_via(rendezvous.address, EXCHANGE, SECRET, 5, task, 10 + task, timeout_s)
    return Outcome(lambda: end(token), f"the end barrier of task {task}")


def test_no_task_passes_the_end_barrier_before_every_task_of_its_address_group_got_there(service):
    rendezvous, scheduler = service
    scheduler.tasks = {(5, 0): {10, 11, 12}}
    token = group_token(["a", "b", "c"])
    assert token == group_token(["a", "b", "c"]) != group_token(["a", "b", "d"])
    first = [_end(rendezvous, 0, token), _end(rendezvous, 1, token)]
    _wait_for_waiting(rendezvous, 2)
    other = _end(rendezvous, 2, group_token(["x"]))  # another address group's task: no member of this one
    _wait_for_waiting(rendezvous, 3)
    time.sleep(3 * OVER_CHECK_S)  # several looks at the attempts later: still waiting, none of them over
    assert all(o.thread.is_alive() for o in first), "a task passed the end barrier before task 2 got there"
    last = _end(rendezvous, 2, token)
    for outcome in [*first, last]:
        assert outcome.done().error is None
    assert other.thread.is_alive(), "a task of another address group passed the end barrier alone"


def test_a_task_that_leaves_the_end_barrier_fails_the_others_and_those_that_come_later(service):
    rendezvous, scheduler = service
    scheduler.tasks = {(5, 0): {10, 11, 12}}
    token = group_token(["a", "b", "c"])
    waiting = _end(rendezvous, 0, token)
    leaving = _end(rendezvous, 1, token, timeout_s=0.5)  # its connection closes when it gives up
    assert isinstance(leaving.done().error, ExchangeTimeoutError)
    assert "to reach the end of the exchange" in str(leaving.error)
    assert isinstance(waiting.done().error, CreditShuffleError)
    assert "task 1" in str(waiting.error) and "left the end" in str(waiting.error)
    late = _end(rendezvous, 2, token).done()
    assert isinstance(late.error, CreditShuffleError) and "left the end" in str(late.error)


def test_the_end_barrier_of_an_attempt_that_fails_while_its_tasks_wait_stops_them(service):
    rendezvous, scheduler = service
    scheduler.tasks = {(5, 0): {10, 11, 12}}
    token = group_token(["a", "b", "c"])
    waiting = [_end(rendezvous, 0, token), _end(rendezvous, 1, token)]
    _wait_for_waiting(rendezvous, 2)
    scheduler.over.add((5, 0))  # task 2 failed in its part of the exchange: Spark fails the attempt
    for outcome in waiting:
        assert isinstance(outcome.done().error, CreditShuffleError) and "is over" in str(outcome.error)


def test_a_request_without_its_stage_is_grouped_as_before(service):
    rendezvous, _ = service
    gathers = [all_gather_via(rendezvous.address, EXCHANGE, SECRET, "stage 9", i, i, 10.0) for i in range(3)]
    outcomes = [Outcome(lambda g=g, i=i: g(str(i)), f"the addresses for task {i}") for i, g in enumerate(gathers)]
    for outcome in outcomes:
        assert outcome.done().value == ["0", "1", "2"]


# -- on Spark -------------------------------------------------------------------------------------------------


def _killer(marker: str):
    """A step before the exchange, in the same barrier stage: partition 1's Python worker kills itself with
    SIGKILL on its first attempt (the marker file remembers it), as a worker lost to the OOM killer."""

    def fn(batches):
        import os
        import signal

        from pyspark import TaskContext

        for batch in batches:
            if TaskContext.get().partitionId() == 1 and not os.path.exists(marker):
                with open(marker, "w"):
                    pass
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch

    return fn


def _stage_attempts(spark, group: str) -> list[tuple[int, int, str, str, int]]:
    """(stage, attempt, status, failure reason, failed tasks) of every attempt of every stage the jobs of
    ``group`` ran, once the driver's listener bus delivered every event of them (Spark's status store)."""
    sc = spark.sparkContext
    jvm_sc = sc._jsc.sc()
    jvm_sc.listenerBus().waitUntilEmpty()
    store = jvm_sc.statusStore()
    tracker = sc.statusTracker()
    stages = sorted({s for job in tracker.getJobIdsForGroup(group) for s in tracker.getJobInfo(job).stageIds})
    found = []
    for stage in stages:
        no_quantiles = sc._gateway.new_array(sc._jvm.double, 0)
        attempts = store.stageData(stage, False, sc._jvm.java.util.ArrayList(), False, no_quantiles)
        for i in range(attempts.size()):
            data = attempts.apply(i)
            reason = data.failureReason()
            text = reason.get() if reason.isDefined() else ""
            found.append((stage, data.attemptId(), str(data.status()), text, data.numFailedTasks()))
    return found


def _task_errors(spark, stage: int, attempt: int) -> list[str]:
    """The errors the tasks of an attempt of ``stage`` failed with (Spark's status store)."""
    tasks = spark.sparkContext._jsc.sc().statusStore().taskList(stage, attempt, 1000)
    found = [tasks.apply(i).errorMessage() for i in range(tasks.size())]
    return [error.get() for error in found if error.isDefined()]


def _run(spark, source, mode: str, injection) -> tuple[list[int], list[tuple[int, int, str, str, int]]]:
    """The ids an exchange of ``source`` outputs, and the attempts of the stages it ran."""
    sc = spark.sparkContext
    group = f"retries-{uuid.uuid4()}"
    sc.setJobGroup(group, "single fault")
    try:
        ex = scs.exchange(source, scs.key_by("k"), parallelism=3, mode=mode, injection=injection)
        ids = sorted(row.id for row in ex.df.select("id").collect())
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
    return ids, _stage_attempts(spark, group)


def _source(spark, fault: str, marker_dir: str):
    df = spark.range(0, ROWS, 1, 3).select(F.col("id"), (F.col("id") % 17).cast("int").alias("k"))
    if fault == "kill":
        return df.mapInArrow(_killer(os.path.join(marker_dir, "killed")), df.schema), None
    return df, scs.Injection(fail_once=(fault, 1), marker_dir=marker_dir)


def _cause(reason: str) -> str:
    """The Python error a stage's failure reason quotes, or its first line."""
    errors = [line.strip() for line in reason.splitlines() if "Error" in line and not line.strip().startswith("at ")]
    return (errors[-1] if errors else reason.splitlines()[0] if reason else "")[:400]


#: What the first attempt's failure says, per fault.
FAULTS = {
    "producer": "injected failure of producer subtask 1",
    "consumer": "injected failure of consumer subtask 1",
    "kill": "Python worker exited unexpectedly",
}


def _assert_runs_twice_and_first_retry_exact(spark, fault: str, run: int, marker_dir: str) -> None:
    source, injection = _source(spark, fault, marker_dir)
    ids, attempts = _run(spark, source, "pipelined", injection)
    assert os.listdir(marker_dir), f"run {run}: the first attempt did not fail"
    assert ids == list(range(ROWS)), f"run {run}: the output is not exact"
    failed = [(s, a, why) for s, a, status, why, _ in attempts if status == "FAILED"]
    causes = [f"stage {s} attempt {a}: {_cause(why)}" for s, a, why in failed]
    assert len(failed) == 1, f"run {run}: {len(failed)} failed stage attempts, one expected: {causes}"
    stage, attempt, _ = failed[0]
    assert attempt == 0, f"run {run}: the failed attempt is not the first: {causes}"
    errors = _task_errors(spark, stage, attempt)  # the stage's reason is only the last one Spark took
    assert any(FAULTS[fault] in e for e in errors), f"run {run}: the first attempt failed for: {errors}"
    reruns = sorted((s, a) for s, a, *_ in attempts if a > 0)
    assert reruns == [(stage, 1)], f"run {run}: stage attempts after the first: {reruns}"


@pytest.mark.spark
@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", range(RUNS))
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_pipelined_stage_with_a_single_fault_runs_twice_and_its_first_retry_is_exact(spark, tmp_path, fault, run):
    _assert_runs_twice_and_first_retry_exact(spark, fault, run, str(tmp_path))


@pytest.mark.spark
@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", range(RUNS))
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_blocking_exchange_with_a_single_fault_retries_that_task_once(spark, tmp_path, fault, run):
    source, injection = _source(spark, fault, str(tmp_path))
    ids, attempts = _run(spark, source, "blocking", injection)
    assert os.listdir(tmp_path), f"run {run}: the first attempt did not fail"
    assert ids == list(range(ROWS)), f"run {run}: the output is not exact"
    # Spark retried the failed task alone, within the first attempt of its stage
    assert all(status == "COMPLETE" and a == 0 for _, a, status, *_ in attempts), f"run {run}: {attempts}"
    assert sum(failed_tasks for *_, failed_tasks in attempts) == 1, f"run {run}: {attempts}"


def _held_until(marker: str):
    """A barrier task's body that returns its task attempt id once ``marker`` exists (60 s at most)."""

    def fn(rows):
        import os
        import time

        from pyspark import BarrierTaskContext

        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        yield BarrierTaskContext.get().taskAttemptId()

    return fn


@pytest.mark.spark
@pytest.mark.timeout(120)
def test_the_driver_scheduler_tells_the_stage_attempt_of_a_running_barrier_task(spark, tmp_path):
    sc = spark.sparkContext
    marker = str(tmp_path / "release")
    found: dict[str, object] = {}

    def job() -> None:
        rdd = sc.parallelize(range(2), 2).barrier().mapPartitions(_held_until(marker))
        found["ids"] = rdd.collect()

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    try:
        tracker = sc.statusTracker()

        def running() -> list[int]:  # the stage, once both its tasks run
            infos = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
            return [info.stageId for info in infos if info is not None and info.numActiveTasks == 2]

        assert wait_until(running, timeout=60), "the barrier stage's 2 tasks running, after 60 s"
        stage = running()[0]
        attempts = SparkStageAttempts()
        assert attempts._look(stage) is not None, "the scheduler's task sets of the stage could not be read"
        task_sets = attempts._look(stage)
        assert list(task_sets) == [0] and len(task_sets[0][0]) == 2 and not task_sets[0][1], task_sets
        for task_attempt_id in task_sets[0][0]:
            assert attempts.attempt_of(stage, task_attempt_id) == Attempt(0, False)
        assert attempts.attempt_of(stage, max(task_sets[0][0]) + 1000) == Attempt(-1, True)
        assert attempts.is_over(stage, 0) is False
    finally:
        open(marker, "w").close()
        thread.join(60)
    assert not thread.is_alive(), "the barrier job did not end within 60 s of its release"
    assert sorted(found["ids"]) == sorted(task_sets[0][0])
