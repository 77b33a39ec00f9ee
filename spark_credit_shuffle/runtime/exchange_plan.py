"""The plan of one exchange: what the driver decides and every task of the exchange reads.

:class:`ExchangePlan` is built and checked on the driver by :func:`~spark_credit_shuffle.exchange.exchange`
and shipped to the tasks of the runtimes (``runtime/blocking/``, ``runtime/pipelined/``); the planner
sizes its network memory (``runtime/planner_on_spark.py`` hands it over). It lives here, at the bottom of the runtime
layer, because all of them read it:
in ``exchange.py`` the runtimes would have to import the module that imports them (a circle), and the
planner, the runtimes and the public exchange could not be read one floor at a time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow as pa

from ..config import NetworkConfig
from ..partitioners import Partitioner
from .chain import ChainedOperator
from .monitor import MonitorAddress

__all__ = ["ExchangePlan", "Injection"]


@dataclass(frozen=True)
class Injection:
    """Faults and slowness injected into an exchange, for tests and demos.

    ``consumer_delay_s``: seconds a consumer subtask sleeps per record it receives, by subtask
    index (``{0: 0.001}`` makes subtask 0 a slow receiver); in pipelined mode the sleep ends when the task
    fails, as the kill of a failed stage's tasks ends their user code. ``fail_once``: (side, subtask) whose
    first attempt raises; the marker file in ``marker_dir`` remembers that it failed, so the
    retried attempt runs normally.
    """

    consumer_delay_s: tuple[tuple[int, float], ...] = ()
    fail_once: tuple[str, int] | None = None
    marker_dir: str | None = None

    def delay_of(self, consumer: int) -> float:
        return dict(self.consumer_delay_s).get(consumer, 0.0)

    def maybe_fail(self, side: str, subtask: int) -> None:
        """Raise on the first attempt of the configured (side, subtask); do nothing after that."""
        if self.fail_once is None or self.fail_once != (side, subtask) or self.marker_dir is None:
            return
        marker = os.path.join(self.marker_dir, f"failed-{side}-{subtask}")
        if not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write("failed once\n")
            raise RuntimeError(f"injected failure of {side} subtask {subtask} (first attempt)")


@dataclass(frozen=True)
class ExchangePlan:
    """Everything a task needs to play its part; built and checked on the driver, shipped to tasks."""

    name: str
    mode: str
    partitioner: Partitioner
    num_producers: int
    num_consumers: int
    max_parallelism: int
    config: NetworkConfig
    schema: pa.Schema
    injection: Injection | None = None
    #: Pipelined mode: place the output with an identity shuffle after the barrier stage (True, the
    #: default when None), or stream it straight into what follows (False). Blocking output always is.
    retryable: bool | None = None
    #: Where the tasks send their timeline samples while they run (the live monitor), if anywhere.
    monitor: MonitorAddress | None = None
    #: Pipelined mode: every connection of the exchange runs mutual TLS with a key pair made for it on the
    #: driver (decided before launch, :func:`~spark_credit_shuffle.runtime.security.use_tls`).
    tls: bool = False
    #: Operators chained into the producer tasks, on the input before it is written (:mod:`.chain`); ``schema``
    #: is then the last one's output.
    before: tuple[ChainedOperator, ...] = ()
    #: Operators chained into the consumer tasks, on the rows they receive; their last one's output is the
    #: exchange's.
    after: tuple[ChainedOperator, ...] = ()

    @property
    def output_schema(self) -> pa.Schema:
        """The Arrow schema of what the consumer tasks hand to Spark: the received rows', or the last chained
        operator's."""
        if self.after:
            schema = self.after[-1].arrow_schema
            assert schema is not None, "chained operators are resolved on the driver"
            return schema
        return self.schema

    def describe(self) -> str:
        chained = "".join(
            f", {where} {', '.join(op.name for op in ops)} chained"
            for where, ops in (("producers", self.before), ("consumers", self.after))
            if ops
        )
        return (
            f"credit shuffle {self.name}: {self.partitioner.name} {self.mode} exchange, "
            f"{self.num_producers} -> {self.num_consumers} subtasks{chained}"
        )
