"""Which kind of input channel connects a producer subtask to a consumer subtask, and over which connection:
the one rule the runtime's wiring, the simulation and the planner all follow.

Flink reads a subpartition of its own TaskManager through a ``LocalInputChannel`` (no credit, no copy: the
producer's pool holds the buffers) and any other through a ``RemoteInputChannel`` (exclusive buffers,
credit, one TCP connection per pair of TaskManagers shared by its channels). Here a process is a Spark
task (a Python worker) or, in the simulation, whatever the model says: three kinds follow.

- :data:`DIRECT`: producer and consumer share a process (a pipelined task's own channel; a simulated
  host run as one process): the gate reads the subpartition in place.
- :data:`LOCAL`: another process of the same executor (with ``local_channels="executor"``): a local
  channel over a connection, without credit, its buffers held by the producer's pool.
- :data:`REMOTE`: anything else: a remote channel with exclusive buffers and credit.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["DIRECT", "LOCAL", "REMOTE", "ChannelRoute", "Endpoint", "channel_route"]

DIRECT = "direct"
LOCAL = "local"
REMOTE = "remote"


@dataclass(frozen=True)
class Endpoint:
    """Where a subtask runs: its ``task`` index, its ``host`` (executor; None: unknown, shared with no one)
    and its ``process`` (a task's own, or a host's in a model of one process per host)."""

    task: int
    host: Hashable | None
    process: Hashable

    @classmethod
    def pipelined_task(cls, task: int, placement: Sequence[Hashable] | None) -> Endpoint:
        """Pipelined task ``task``, where producer and consumer subtask ``task`` share one process, on the
        executor ``placement[task]`` (None: an executor of its own)."""
        return cls(task, None if placement is None else placement[task], task)


@dataclass(frozen=True)
class ChannelRoute:
    """A channel's kind and the key of the connection that carries it (None for :data:`DIRECT`)."""

    kind: str
    connection: Hashable | None

    @property
    def is_local(self) -> bool:
        """True for a channel without exclusive buffers or credit (:data:`DIRECT` or :data:`LOCAL`)."""
        return self.kind != REMOTE


def channel_route(
    producer: Endpoint, consumer: Endpoint, local_channels: str = "executor", connections: str = "task_pair"
) -> ChannelRoute:
    """The route of the channel from ``producer`` to ``consumer``.

    ``local_channels``: ``"executor"`` makes a channel between two processes of one host local, ``"task"``
    only a process's own (the setting of the same name). ``connections``: ``"task_pair"`` gives every pair of
    tasks a connection of its own (a consumer task connects once to each producer task, for all its
    channels to that task), ``"host_pair"`` shares one connection between two hosts (Flink's).
    """
    if producer.process == consumer.process:
        return ChannelRoute(DIRECT, None)
    same_host = producer.host is not None and producer.host == consumer.host
    kind = LOCAL if same_host and local_channels == "executor" else REMOTE
    key = (producer.host, consumer.host) if connections == "host_pair" else (producer.task, consumer.task)
    return ChannelRoute(kind, key)
