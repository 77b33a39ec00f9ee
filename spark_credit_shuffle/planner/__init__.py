"""How many network buffers a topology needs, computed before anything runs.

Flink reserves each pool's minimum at task set-up and fails there with "Insufficient number of
network buffers". The planner applies the same rules (docs/flink.md, "Pool sizes") to a topology of
exchanges and the executors it will run on, so the answer comes on the driver, before a Spark job starts:

- a producer task's result partition with N subpartitions: a LocalBufferPool of min N + 1 and max
  N * buffers_per_channel + floating_buffers_per_gate (pipelined, bounded) or unbounded (blocking, sized
  as a hash blocking partition, which the blocking exchange's partition is; with
  ``sort_shuffle_min_parallelism`` set, blocking partitions of at least that many subpartitions are sized
  as Flink's sort-merge ones: min ``sort_shuffle_min_buffers`` (512), max max(min, 4 N));
- a consumer task's input gate with C channels: buffers_per_channel exclusive buffers per *remote*
  channel and a floating pool of min 1 (pipelined) and max C * buffers_per_channel +
  floating_buffers_per_gate minus the exclusive ones; blocking gates cap the required buffers at 1000 as
  Flink does. A pipelined channel is local, with no exclusive buffers, when producer and consumer run in
  tasks of one executor (with ``local_channels="executor"``, the default; with ``"task"`` only a task's own
  channel is). A blocking consumer reads every producer from Spark's shuffle: all its channels are remote.

Which halves share a task follows the runtime: a blocking exchange runs its producers in one Spark
stage and its consumers in the next; a pipelined exchange runs producer subtask *i* and consumer
subtask *i* in task *i* of one barrier stage. With ``chain=True`` consecutive exchanges share tasks
(the consumer of exchange *k* is the producer of exchange *k + 1*, as Flink's tasks have an input gate
and a result partition). An executor runs up to ``slots`` tasks of a stage at once, and the check
assumes the worst: the heaviest tasks of the stage land on the same executor. For a pipelined (barrier)
stage, which tasks share an executor also decides which channels are local, so the planner tries every
number *k* of tasks one executor can hold while all tasks run at once (from ``W - (count - 1) * slots``
to ``min(slots, W)`` of the stage's *W* tasks; in local mode exactly *W*): the *k* heaviest tasks together
on one executor, their channels among each other local, the others spread over the other executors; the
busiest executor of the worst placement is the requirement. ``Executors(placement=...)`` gives the
placement instead (the executor of every task), as a running stage knows it. Stages run one after the
other, so an executor's requirement is that of its busiest stage.

:func:`plan_network` returns a :class:`NetworkPlan` (per task, per stage, verdict);
:func:`plan_table` gives it as a pandas DataFrame. The planner is pure: on a Spark session,
:mod:`spark_credit_shuffle.runtime.planner_on_spark` reads the session's executors, gives the plan as a Spark
DataFrame (``plan_dataframe``) and runs ``check_fits`` before an exchange launches.

The package, one concept a module: :mod:`.topology` (the exchanges and executors planned for),
:mod:`.task_buffers` (one task's pools), :mod:`.network_plan` (the answer per task, stage and topology),
:mod:`.stages` (building it, with the worst placement of a barrier stage).
"""

from __future__ import annotations

from .network_plan import NetworkPlan, StagePlan, TaskPlan
from .stages import plan_network, plan_table
from .task_buffers import TaskBuffers, consumer_buffers, partition_type, producer_buffers, task_buffers
from .topology import PATTERNS, ExchangeSpec, Executors

__all__ = [
    "PATTERNS",
    "ExchangeSpec",
    "Executors",
    "NetworkPlan",
    "StagePlan",
    "TaskBuffers",
    "TaskPlan",
    "consumer_buffers",
    "partition_type",
    "plan_network",
    "plan_table",
    "producer_buffers",
    "task_buffers",
]
