"""A pipelined exchange between threads of one process, over real TCP sockets, without Spark (tests, demos)."""

from __future__ import annotations

import json
import secrets as _secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

from ...errors import CreditShuffleError, ExchangeTimeoutError
from ...metrics import MetricRow
from ...transport.tls import TlsIdentity
from .task import PipelinedTask, TaskOptions

if TYPE_CHECKING:
    from ..exchange_plan import ExchangePlan

__all__ = ["run_in_threads"]


def run_in_threads(
    plan: ExchangePlan,
    partitions: list[Iterable[pa.RecordBatch]],
    *,
    secret: bytes | None = None,
    options: TaskOptions | None = None,
    host: str = "127.0.0.1",
    timeout_s: float = 60.0,
    on_batch: Callable[[int, pa.RecordBatch], None] | None = None,
    executors: Sequence[object] | None = None,
    tls: TlsIdentity | None = None,
) -> tuple[list[list[pa.RecordBatch]], list[MetricRow]]:
    """Run a pipelined exchange between threads of this process over real TCP sockets, without Spark.

    ``partitions[p]`` are producer p's input batches (any iterable, consumed as the producer goes).
    ``executors[i]`` names the executor task ``i`` plays on (tasks of one executor talk through local
    channels); default: every task its own executor, so every channel between tasks is remote.
    Returns (the data batches each consumer received, every metric row); ``on_batch(consumer, batch)``
    sees each data batch as it arrives. Raises the error of the task that failed first. ``tls``: the key
    pair of an exchange whose connections run TLS (made here if ``plan.tls`` and none is given).
    """
    width = max(plan.num_producers, plan.num_consumers)
    if len(partitions) != plan.num_producers:
        raise ValueError(f"{len(partitions)} input partitions for {plan.num_producers} producers")
    secret = secret if secret is not None else _secrets.token_bytes(32)
    if tls is None and plan.tls:
        tls = TlsIdentity.generate(plan.name)
    options = options or TaskOptions()
    gather = _ThreadAllGather(width, timeout_s)
    outputs: list[list[pa.RecordBatch]] = [[] for _ in range(width)]
    errors: list[tuple[float, BaseException] | None] = [None] * width
    metric_rows: list[list[MetricRow]] = [[] for _ in range(width)]

    def task_main(i: int) -> None:
        data = partitions[i] if i < plan.num_producers else []
        task = PipelinedTask(plan, i, secret, host, options, attempt_id=i, executors=executors, tls=tls)
        try:
            for batch in task.run(iter(data), gather.all_gather):
                outputs[i].append(batch)
                if on_batch is not None and batch.column(batch.num_columns - 1).null_count == batch.num_rows:
                    on_batch(i, batch.drop_columns([batch.schema.names[-1]]))
        except BaseException as exc:
            failed_at = task.wiring.failed_at
            errors[i] = (failed_at if failed_at is not None else time.monotonic(), exc)
            gather.abort()

    threads = [threading.Thread(target=task_main, args=(i,), name=f"task-{i}", daemon=True) for i in range(width)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    failures = sorted((e for e in errors if e is not None), key=lambda e: e[0])
    if failures:  # the first failure is the cause; the others follow from it
        raise failures[0][1]
    if stuck:
        raise ExchangeTimeoutError(f"tasks {stuck} still running after {timeout_s:.0f} s")
    received: list[list[pa.RecordBatch]] = [[] for _ in range(plan.num_consumers)]
    for i, batches in enumerate(outputs):
        for batch in batches:
            cells = batch.column(batch.num_columns - 1)
            if cells.null_count == batch.num_rows:
                received[i].append(batch.drop_columns([batch.schema.names[-1]]))
            else:
                for cell in cells.to_pylist():
                    for r in cell or []:
                        metric_rows[i].append(MetricRow(**r))
    return received, [r for rows in metric_rows for r in rows]


class _ThreadAllGather:
    """``allGather`` between threads: everyone's message, in task order, once all have called."""

    def __init__(self, parties: int, timeout_s: float) -> None:
        self._barrier = threading.Barrier(parties, timeout=timeout_s)
        self._timeout_s = timeout_s
        self._aborted = False
        self._messages: list[str] = [""] * parties
        self._lock = threading.Lock()

    def all_gather(self, message: str) -> list[str]:
        index = json.loads(message)["task"]
        with self._lock:
            self._messages[index] = message
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            if self._aborted:
                raise CreditShuffleError("another task failed before the addresses were exchanged") from None
            raise ExchangeTimeoutError(
                f"task {index}: not every task published its address within {self._timeout_s:.0f} s"
            ) from None
        return list(self._messages)

    def abort(self) -> None:
        self._aborted = True
        self._barrier.abort()
