"""Which attempt of a barrier stage a task belongs to, and whether that attempt is over, as the driver's Spark
scheduler knows it.

A Python task cannot tell its stage attempt: PySpark hands it ``stageId()``, ``partitionId()``,
``attemptNumber()`` (0 in every attempt of a barrier stage: Spark re-runs the stage, not the task) and
``taskAttemptId()``, but not the JVM's ``TaskContext.stageAttemptNumber()``, and nothing else it is given
(local properties, the barrier's task addresses) differs between two attempts. The driver's task scheduler
knows: Spark's ``TaskSchedulerImpl`` keeps one ``TaskSetManager`` per stage attempt
(``taskSetsByStageIdAndAttempt``), each holding the ``TaskInfo`` of every task attempt it launched
(``taskInfos``, keyed by task attempt id), and marks it a zombie once that attempt can no longer succeed (a
barrier task failed, the stage was cancelled). A barrier stage attempt launches all its tasks at once, so by
the time one of them runs its Python code, its attempt's task set holds every task attempt id of it, and
nothing there lags behind (the status tracker and the listener bus do: they learn of a task after its launch).

:class:`SparkStageAttempts` reads those through the driver's py4j gateway, from the address service's thread
(PySpark's gateway serves every Python thread, each on a connection of its own). Those are fields of Spark's
scheduler, not a public API, and the scheduler changes them under its own lock, which a reader from outside
cannot take: a look that fails is repeated (:data:`READS`), a task attempt id not found is looked for once
more before its attempt is called over, and where the scheduler cannot answer at all (no SparkContext in this
process, a scheduler without those fields, a stage it holds no task set of) the answer is None and the
service keys its groups by the stage alone, as Spark's ``allGather`` path would not need to.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["READS", "REFRESH_S", "Attempt", "SparkStageAttempts", "StageAttempts"]

log = logging.getLogger("spark_credit_shuffle")

#: How long what the scheduler said of a stage is taken as still true: the requests of one stage attempt arrive
#: within a fraction of a second of each other, and one look answers them all (a task attempt id it does not
#: hold is looked up again at once); a group of an attempt that failed meanwhile is stopped at a later look.
REFRESH_S = 0.2
#: How many times a look that fails (a py4j error other than a missing field) is tried before it says None.
READS = 3
#: Past this many stages read, what was read of those not looked at for :data:`FORGET_S` is dropped.
KEPT_STAGES = 64
FORGET_S = 60.0

#: {stage attempt number: (its task attempt ids, zombie)}
TaskSets = dict[int, tuple[frozenset[int], bool]]


@dataclass(frozen=True)
class Attempt:
    """The stage attempt ``number`` a task attempt belongs to; ``over``: that attempt can no longer succeed
    (failed, cancelled, or a later attempt of the stage exists), or the task attempt is in no task set Spark
    still keeps of its stage (``number`` -1: its attempt ended, it is a leftover of it)."""

    number: int
    over: bool


class StageAttempts(Protocol):
    """What the address service asks of the scheduler (see the module documentation)."""

    def attempt_of(self, stage: int, task_attempt_id: int) -> Attempt | None:
        """The attempt of stage ``stage`` that task attempt ``task_attempt_id`` belongs to; None: cannot tell."""
        ...

    def is_over(self, stage: int, attempt: int) -> bool | None:
        """Whether attempt ``attempt`` of stage ``stage`` can no longer succeed; None: cannot tell."""
        ...


class SparkStageAttempts:
    """:class:`StageAttempts` from the task scheduler of this process's active SparkContext (the driver's).

    Each look at a stage reads its task sets (``TaskSchedulerImpl.taskSetsByStageIdAndAttempt``): a few py4j
    calls per stage attempt, the task attempt ids of each in one (``taskInfos.keys.mkString``); a look less
    than :data:`REFRESH_S` old answers again. What was read belongs to the SparkContext it was read from: a
    new one (stage and task ids start again at 0) starts afresh. A scheduler without those fields turns this
    off for the life of the process (logged once).
    """

    def __init__(self) -> None:
        #: stage -> (when looked at, its task sets); read from the SparkContext ``_context``
        self._stages: dict[int, tuple[float, TaskSets]] = {}
        self._context: Any = None
        self._unsupported = False

    def attempt_of(self, stage: int, task_attempt_id: int) -> Attempt | None:
        attempts = self._look(stage, must_know=task_attempt_id)
        if not attempts:  # cannot tell, or no task set of the stage at all: not a verdict on this task
            return None
        newest = max(attempts)
        for number, (task_ids, over) in attempts.items():
            if task_attempt_id in task_ids:
                return Attempt(number, over or number < newest)
        return Attempt(-1, True)  # in no task set Spark keeps of a stage it runs: its attempt ended

    def is_over(self, stage: int, attempt: int) -> bool | None:
        attempts = self._look(stage)
        if attempts is None or not _over(attempts, attempt):
            return None if attempts is None else False
        attempts = self._look(stage, fresh=True)  # a verdict that stops tasks: confirmed by a read of its own
        return None if attempts is None else _over(attempts, attempt)

    def _forget_old(self, now: float) -> None:
        """Drop what was read of stages not looked at for :data:`FORGET_S` (their exchanges ended)."""
        for stage, (seen, _) in list(self._stages.items()):
            if now - seen > FORGET_S:
                del self._stages[stage]

    def _look(self, stage: int, must_know: int | None = None, fresh: bool = False) -> TaskSets | None:
        if self._unsupported:
            return None
        found = _task_scheduler()
        if found is None:
            return None
        context, scheduler = found
        if context is not self._context:  # another SparkContext: its stage and task ids start again at 0
            self._stages.clear()
            self._context = context
        now = time.monotonic()
        seen = self._stages.get(stage)
        recent = seen is not None and now - seen[0] < REFRESH_S and not fresh
        if seen is not None and recent and (must_know is None or _holds(seen[1], must_know)):
            return seen[1]
        attempts = self._read_repeated(scheduler, stage)
        if attempts is not None and attempts and must_know is not None and not _holds(attempts, must_know):
            # the scheduler's maps are read without its lock: a task attempt id missed is looked for once more
            attempts = self._read_repeated(scheduler, stage)
        if attempts is None:
            return None
        self._stages[stage] = (now, attempts)
        if len(self._stages) > KEPT_STAGES:
            self._forget_old(now)
        return attempts

    def _read_repeated(self, scheduler: Any, stage: int) -> TaskSets | None:
        """:meth:`_read`, tried :data:`READS` times; None if every try failed or the fields are missing."""
        for tried in range(1, READS + 1):
            try:
                return _read(scheduler, stage)
            except Exception as exc:  # py4j: no such field (another scheduler), a map changed under it, no JVM
                first_line = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                if _is_missing_member(exc):
                    self._unsupported = True
                    log.warning(
                        "the driver's task scheduler (%s) keeps no task sets per stage attempt where they are "
                        "looked for (%s): the address service keys its groups by stage alone",
                        type(scheduler).__name__,
                        first_line,
                    )
                    return None
                if tried == READS:
                    log.info("could not read the task sets of stage %d (%d tries): %s", stage, READS, first_line)
        return None


def _read(scheduler: Any, stage: int) -> TaskSets:
    """{attempt: (task attempt ids, zombie)} of every task set of ``stage`` the scheduler keeps."""
    found = scheduler.taskSetsByStageIdAndAttempt().get(stage)
    if not found.isDefined():
        return {}
    attempts: TaskSets = {}
    pairs = found.get().iterator()
    while pairs.hasNext():
        pair = pairs.next()
        number, manager = int(pair._1()), pair._2()
        listed = str(manager.taskInfos().keys().mkString(","))
        task_ids = frozenset(int(i) for i in listed.split(",") if i)
        attempts[number] = (task_ids, bool(manager.isZombie()))
    return attempts


def _over(attempts: TaskSets, attempt: int) -> bool:
    """Whether ``attempts`` say attempt ``attempt`` can no longer succeed: gone, a zombie, or not the newest."""
    known = attempts.get(attempt)
    return known is None or known[1] or attempt < max(attempts, default=-1)


def _holds(attempts: TaskSets, task_attempt_id: int) -> bool:
    return any(task_attempt_id in ids for ids, _ in attempts.values())


def _task_scheduler() -> tuple[Any, Any] | None:
    """This process's active SparkContext and its JVM task scheduler, if there is one."""
    try:
        from pyspark import SparkContext
    except ImportError:
        return None
    sc = SparkContext._active_spark_context
    if sc is None or getattr(sc, "_jsc", None) is None:
        return None
    try:
        return sc, sc._jsc.sc().taskScheduler()
    except Exception as exc:
        log.info("no task scheduler to ask for stage attempts: %s", str(exc).splitlines()[0][:200])
        return None


def _is_missing_member(exc: Exception) -> bool:
    """A py4j error saying the JVM object has no such method or field (not a passing failure)."""
    text = str(exc)
    return "does not exist" in text or "NoSuchMethod" in text or "NoSuchField" in text
