"""The pipelined path between processes, measured: ``jobs/bench_pipelined_path.py`` runs it, and
``jobs/bench_path_floor.py`` measures the lean path beside it.

Pipelined tasks (:class:`~spark_credit_shuffle.runtime.pipelined.task.PipelinedTask`, as a Spark barrier task runs them)
each in a forked process of its own, on 127.0.0.1, exchange their rows (``a`` long, ``b`` int, ``c`` a
20-character string) by ``key_by("a")``: :func:`run_exchange` returns every task's CPU per thread, its metrics
and, in a profiled run, each stage's own CPU (:class:`StageTimers`); :func:`core_in_place` puts one task's rows
through the same Python core in one thread, with no network (the floor the path's cost is counted from), and
:func:`core_calls` counts its Python function calls.
Every run checks that every row arrived once.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import resource
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .common import CallCounter

SCHEMA = pa.schema([("a", pa.int64()), ("b", pa.int32()), ("c", pa.string())])
#: Rows per input batch: what Spark hands a Python task (``spark.sql.execution.arrow.maxRecordsPerBatch``).
INPUT_BATCH_ROWS = 10_000


def make_input(task: int, rows: int) -> list[pa.RecordBatch]:
    """Task ``task``'s rows: ``a`` unique over all tasks, ``b`` small, ``c`` 20 characters."""
    a = pa.array(range(task * rows, (task + 1) * rows), pa.int64())
    b = pc.cast(pc.bit_wise_and(a, pa.scalar(1023, pa.int64())), pa.int32())
    c = pc.utf8_lpad(pc.cast(a, pa.string()), width=20, padding="x")
    batch = pa.RecordBatch.from_arrays([a, b, c], schema=SCHEMA)
    return [batch.slice(i, INPUT_BATCH_ROWS) for i in range(0, rows, INPUT_BATCH_ROWS)]


def make_plan(tasks: int) -> Any:
    """The plan ``exchange(df, key_by("a"), tasks, mode="pipelined")`` builds, without a session."""
    import spark_credit_shuffle as scs
    from spark_credit_shuffle.config import NetworkConfig
    from spark_credit_shuffle.runtime.exchange_plan import ExchangePlan

    config = NetworkConfig()
    partitioner: Any = scs.key_by("a")  # a KeyBy: its own max parallelism
    return ExchangePlan(
        name="bench-pipelined-path",
        mode="pipelined",
        partitioner=partitioner,
        num_producers=tasks,
        num_consumers=tasks,
        max_parallelism=partitioner.resolve_max_parallelism(tasks, config.max_parallelism),
        config=config,
        schema=SCHEMA,
    )


# -- stage timers (profiled run only) ---------------------------------------------------------------------------


class StageTimers:
    """CPU of each stage per thread role, exclusive of the timed stages it calls (a per-thread stack)."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self._local = threading.local()

    def wrap(self, owner: Any, name: str, label: str | Callable[..., str]) -> None:
        """Time ``owner.name`` (a class's function or a module's) as stage ``label`` (or ``label(*args)``)."""
        original = getattr(owner, name)
        timers = self
        clock = time.thread_time
        local = self._local
        seconds, calls = self.seconds, self.calls

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = []
            stack.append(0.0)
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                spent = clock() - start
                children = stack.pop()
                if stack:
                    stack[-1] += spent
                key = (timers.role(), label if isinstance(label, str) else label(*args))
                seconds[key] += spent - children
                calls[key] += 1

        setattr(owner, name, timed)

    @staticmethod
    def role() -> str:
        name = threading.current_thread().name
        for role in ("input", "loop"):
            if name.startswith(f"credit-shuffle-{role}"):
                return role
        return "output" if threading.current_thread() is threading.main_thread() else name

    def overhead_s(self) -> float:
        """The CPU one timed call adds (measured on an empty function)."""

        class Probe:
            def f(self) -> None:
                pass

        probe = StageTimers()
        probe.wrap(Probe, "f", "probe")
        p = Probe()
        n = 20_000
        start = time.thread_time()
        for _ in range(n):
            p.f()
        return (time.thread_time() - start) / n


def install_timers(timers: StageTimers) -> None:
    """Wrap the functions of every stage of the pipelined path (see the module documentation)."""
    from spark_credit_shuffle.buffers.buffer import Buffer
    from spark_credit_shuffle.buffers.reader import RecordReader
    from spark_credit_shuffle.buffers.writer import RecordWriter
    from spark_credit_shuffle.engine.consumer import ConsumerEngine, OutputBatcher
    from spark_credit_shuffle.protocol import PipelinedResultPartition, client, gate, sender
    from spark_credit_shuffle.protocol.channels import RemoteInputChannel
    from spark_credit_shuffle.protocol.messages import BufferResponse
    from spark_credit_shuffle.runtime import handoff
    from spark_credit_shuffle.runtime.pipelined import loop, partition_writer, wiring
    from spark_credit_shuffle.transport import connection, event_loop, tcp

    def data_or_control(*args: Any) -> str:
        message = args[0]
        if type(message) is BufferResponse:
            return "sender: encode data"
        return f"encode {type(message).__name__}"

    def write_side(conn: Any) -> str:
        return "sender: write (sendmsg)" if conn.role == "server" else "credit/recycle out: write (sendmsg)"

    def fill_side(conn: Any, *_: Any) -> str:
        return "sender: fill (pull + frame)" if conn.role == "server" else "credit/recycle out: fill"

    wrap = timers.wrap
    for method in ("emit", "resume", "finish", "broadcast_event"):
        wrap(RecordWriter, method, "producer: slice + IPC write")
    wrap(partition_writer.TaskPartitionWriter, "request_segment", "producer: enqueue (partition)")
    for method in ("add_consumer", "builder_opened", "builder_finished", "flush", "add_event"):
        wrap(PipelinedResultPartition, method, "producer: enqueue (partition)")
    wrap(sender.PartitionRequestQueue, "notify_reader_non_empty", "producer: notify (reader available)")
    wrap(tcp.TcpTransport, "_ready", "notify: transport ready")
    wrap(event_loop.EventLoop, "wakeup", "notify: loop wakeup (socket)")
    wrap(wiring.TaskWiring, "notify_gate", "notify: gate (the loop's consumer half)")
    wrap(wiring.TaskWiring, "notify_loop", "notify: loop (a buffer back)")
    wrap(handoff.InputHandoff, "put", "input: hand-over (wait, condition)")
    wrap(handoff.InputHandoff, "pop", "producer: input hand-over")
    wrap(handoff.OutputHandoff, "offer", "consumer: output hand-over")
    wrap(handoff.OutputHandoff, "take", "Spark thread: output hand-over (wait, condition)")
    wrap(wiring.TaskWiring, "_on_transport_event", "notify: transport event")
    wrap(sender.PartitionRequestQueue, "next_message", "sender: poll (reader, credit)")
    wrap(client.CreditBasedPartitionRequestClientHandler, "next_message", "credit/recycle out: poll")
    wrap(connection, "encode", data_or_control)
    wrap(connection, "buffer_response_header", "sender: encode data")
    wrap(connection.Connection, "fill", fill_side)
    wrap(connection.Connection, "write", write_side)
    wrap(tcp.TcpTransport, "flush", "transport: flush (dirty connections)")
    wrap(tcp.TcpTransport, "_pump", "transport: pump (I/O round)")
    wrap(event_loop.EventLoop, "poll", "transport: select")
    wrap(tcp.TcpTransport, "_read", "receiver: read (recv, lock)")
    wrap(client.CreditBasedPartitionRequestClientHandler, "receive_data", "receiver: decode frames")
    wrap(client.CreditBasedPartitionRequestClientHandler, "receive_message", "receiver: dispatch")
    wrap(client.CreditBasedPartitionRequestClientHandler, "_on_buffer_response", "receiver: dispatch")
    wrap(RemoteInputChannel, "on_buffer", "receiver: enqueue (channel)")
    wrap(client.ConnectionSubpartitionView, "on_buffer", "receiver: enqueue (local view)")
    wrap(gate.SingleInputGate, "notify_channel_non_empty", "receiver: enqueue (gate)")
    wrap(sender.PartitionRequestServerHandler, "receive_data", "credit/recycle in: decode")
    wrap(sender.PartitionRequestServerHandler, "receive_message", "credit/recycle in: dispatch")
    wrap(loop.TaskLoop, "_timers", "loop: timers")
    wrap(ConsumerEngine, "next", "consumer: poll (gate)")
    wrap(ConsumerEngine, "take", "consumer: take")
    wrap(RecordReader, "feed", "consumer: decode (RecordReader)")
    for method in ("add", "ready", "take"):
        wrap(OutputBatcher, method, "consumer: output")
    wrap(Buffer, "recycle", "consumer: recycle (credit)")


# -- one task in a process --------------------------------------------------------------------------------------


def _count_calls(counts: dict[str, int]) -> None:
    """Count the Python function calls of every thread from now on, by thread role, into ``counts``."""

    def counter(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            counts[StageTimers.role()] += 1

    threading.setprofile(counter)
    sys.setprofile(counter)


def _count_thread_switches() -> dict[str, int]:
    """Count each ending thread's voluntary context switches (waits: a lock, a condition, the interpreter
    lock, a socket) by thread role, from now on in this process (``getrusage(RUSAGE_THREAD)`` at its end)."""
    counts: dict[str, int] = defaultdict(int)
    run = threading.Thread.run

    def counted_run(self: threading.Thread) -> None:
        try:
            run(self)
        finally:
            counts[StageTimers.role()] += resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw

    threading.Thread.run = counted_run  # type: ignore[method-assign]
    return counts


def _task_process(index: int, tasks: int, rows: int, local: bool, profile: str, to_parent: Any, to_child: Any) -> None:
    """Run pipelined task ``index`` (a process of its own), report its CPU figures to the parent.
    ``profile``: "" (plain), "stages" (stage timers) or "calls" (Python calls per thread)."""
    from spark_credit_shuffle.runtime.pipelined.task import PipelinedTask, TaskOptions

    timers = StageTimers()
    if profile == "stages":
        install_timers(timers)
    calls: dict[str, int] = defaultdict(int)
    plan = make_plan(tasks)
    data = make_input(index, rows)

    def all_gather(message: str) -> list[str]:
        to_parent.put(("gather", index, message))
        return list(to_child.get(timeout=60))

    switches = _count_thread_switches()
    executors = ["executor"] * tasks if local else None
    task = PipelinedTask(plan, index, b"s" * 32, "127.0.0.1", TaskOptions(), attempt_id=index, executors=executors)
    received_rows = 0
    received: list[pa.Array] = []
    metrics: dict[str, float] = defaultdict(float)
    before = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process, ended ones too
    main_before = resource.getrusage(resource.RUSAGE_THREAD)
    if profile == "calls":
        _count_calls(calls)
    for batch in task.run(iter(data), all_gather):
        cells = batch.column(batch.num_columns - 1)
        if cells.null_count == batch.num_rows:  # summed after the run: not in the consumer thread's CPU
            received_rows += batch.num_rows
            received.append(batch.column(0))
            continue
        for cell in cells.to_pylist():
            for row in cell or []:
                if row["stat"] == "total":  # counters (per channel or for the task): summed
                    metrics[row["metric"]] += row["value"]
    sys.setprofile(None)
    after = resource.getrusage(resource.RUSAGE_SELF)
    main_after = resource.getrusage(resource.RUSAGE_THREAD)
    switches["output"] += main_after.ru_nvcsw - main_before.ru_nvcsw
    received_sum = sum(pc.sum(a).as_py() or 0 for a in received)
    metrics["voluntarySwitches"] = float(after.ru_nvcsw - before.ru_nvcsw)
    metrics["involuntarySwitches"] = float(after.ru_nivcsw - before.ru_nivcsw)
    result = {
        "task": index,
        "rows": received_rows,
        "sum": received_sum,
        "metrics": dict(metrics),
        "stages": {f"{r}|{label}": s for (r, label), s in timers.seconds.items()},
        "calls": {f"{r}|{label}": c for (r, label), c in timers.calls.items()},
        "overhead_s": timers.overhead_s() if profile == "stages" else 0.0,
        "python_calls": dict(calls),
        "switches": dict(switches),
    }
    to_parent.put(("result", index, result))


def run_exchange(tasks: int, rows: int, local: bool, profile: str = "") -> dict[str, Any]:
    """One exchange between ``tasks`` processes; the per-thread CPU and stage figures of every task."""
    ctx = mp.get_context("fork")
    to_parent = ctx.Queue()
    to_children = [ctx.Queue() for _ in range(tasks)]
    procs = [
        ctx.Process(target=_task_process, args=(i, tasks, rows, local, profile, to_parent, to_children[i]))
        for i in range(tasks)
    ]
    for p in procs:
        p.start()
    messages: dict[int, str] = {}
    results: dict[int, dict[str, Any]] = {}
    started = None
    try:
        while len(results) < tasks:
            kind, index, payload = to_parent.get(timeout=300)
            if kind == "gather":
                messages[index] = payload
                if len(messages) == tasks:
                    started = time.perf_counter()
                    ordered = [messages[i] for i in range(tasks)]
                    for q in to_children:
                        q.put(ordered)
            else:
                results[index] = payload
        wall = time.perf_counter() - (started or time.perf_counter())
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
    expected_rows = tasks * rows
    expected_sum = expected_rows * (expected_rows - 1) // 2
    got_rows = sum(r["rows"] for r in results.values())
    got_sum = sum(r["sum"] for r in results.values())
    if (got_rows, got_sum) != (expected_rows, expected_sum):
        raise SystemExit(f"rows lost or duplicated: {got_rows} rows (sum {got_sum}), expected {expected_rows}")
    return {"wall_s": wall, "tasks": [results[i] for i in range(tasks)]}


THREADS = (
    ("input", "inputThreadCpuTimeMs"),
    ("loop", "loopThreadCpuTimeMs"),
    ("output", "outputThreadCpuTimeMs"),
)


def thread_cpu_s(run: dict[str, Any]) -> dict[str, float]:
    """CPU seconds of each thread role summed over the tasks (timer and set-up: the process's rest)."""
    out: dict[str, float] = defaultdict(float)
    for task in run["tasks"]:
        m = task["metrics"]
        total = m.get("taskCpuTimeMs", 0.0) / 1000.0
        named = 0.0
        for role, metric in THREADS:
            seconds = m.get(metric, 0.0) / 1000.0
            out[role] += seconds
            named += seconds
        out["rest"] += max(0.0, total - named)
        out["total"] += total
    return dict(out)


def buffers_of(run: dict[str, Any]) -> tuple[int, int, int]:
    """(data buffers sent by all producers, received over remote channels, over local and own ones)."""
    out = sum(t["metrics"].get("numBuffersOut", 0.0) for t in run["tasks"])
    remote = sum(t["metrics"].get("numBuffersInRemote", 0.0) for t in run["tasks"])
    local = sum(t["metrics"].get("numBuffersInLocal", 0.0) for t in run["tasks"])
    return int(out), int(remote), int(local)


# -- the core in place ------------------------------------------------------------------------------------------


def core_in_place(tasks: int, rows: int) -> tuple[float, float, int]:
    """(thread CPU seconds, of which the writer's, data buffers) of every task's rows through the exchange's
    core in one thread (jobs/bench_exchange.py's ``exchange core in place``: writer, partition, gate,
    readers, output batches)."""
    plan = make_plan(tasks)
    cpu = writing = 0.0
    buffers = 0
    for task in range(tasks):
        seconds, writer_seconds, count = _core_of_task(plan, task, make_input(task, rows))
        cpu += seconds
        writing += writer_seconds
        buffers += count
    return cpu, writing, buffers


def core_calls(tasks: int, rows: int) -> tuple[int, int]:
    """(Python function calls, data buffers) of every task's rows through the core in place (one thread)."""
    plan = make_plan(tasks)
    calls = buffers = 0
    for task in range(tasks):
        data = make_input(task, rows)
        with CallCounter() as counter:
            _, _, count = _core_of_task(plan, task, data)
        calls += counter.calls
        buffers += count
    return calls, buffers


def _core_of_task(plan: Any, task: int, data: list[pa.RecordBatch]) -> tuple[float, float, int]:
    """One task's rows through the core in place: (thread CPU seconds, of which the writer's, data buffers)."""
    from spark_credit_shuffle.buffers.reader import RecordReader
    from spark_credit_shuffle.buffers.writer import RecordWriter
    from spark_credit_shuffle.engine import OutputBatcher
    from spark_credit_shuffle.protocol import NetworkBufferPool, PipelinedResultPartition, SingleInputGate

    config, n, schema = plan.config, plan.num_consumers, plan.schema
    network = NetworkBufferPool.from_config(config)
    partition = PipelinedResultPartition.create(network, n, config)
    gate = SingleInputGate(network, n, config)
    for channel in range(n):  # one channel per subpartition, each read as a remote consumer reads it
        gate.local_channel(channel, partition, subpartition=channel)
    gate.request_partitions()
    selector = plan.partitioner.selector(task, plan.num_producers, n, plan.max_parallelism)
    writer = RecordWriter(partition, selector, config.segment_size, schema=schema, resumable=True)
    readers = [RecordReader(schema, channel=c, validate=True) for c in range(n)]
    output = OutputBatcher(8192, 0.0)
    out_rows = 0

    def drain() -> int:
        handed = 0
        while (polled := gate.poll_next()) is not None:
            for item in readers[polled.channel_index].feed(polled.buffer, polled.sequence_number):
                if isinstance(item, pa.RecordBatch):
                    output.add(item)
            ready = output.ready(polled.more_available, 0.0)
            if ready is not None:
                handed += ready.num_rows
        return handed

    clock = time.thread_time
    writing = 0.0
    start = clock()
    for batch in data:
        began = clock()
        done = writer.emit(batch)
        writing += clock() - began
        out_rows += drain()
        while not done:  # the pool ran out: the consumers above returned its buffers
            began = clock()
            done = writer.resume()
            writing += clock() - began
            out_rows += drain()
    began = clock()
    writer.finish()
    writing += clock() - began
    out_rows += drain()
    if output.pending:
        out_rows += output.take().num_rows
    cpu = time.thread_time() - start
    expected = sum(b.num_rows for b in data)
    if out_rows != expected:
        raise SystemExit(f"core in place: {out_rows} rows out of {expected}")
    return cpu, writing, sum(writer.num_buffers_out)


# -- report -----------------------------------------------------------------------------------------------------


def stage_table(run: dict[str, Any], buffers: int) -> tuple[list[tuple[str, str, float, float]], float]:
    """(role, stage, us of CPU per data buffer, calls per buffer) of the profiled run, and the timer
    overhead per call in us; the threads' untimed rest as ``(other)``."""
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    for task in run["tasks"]:
        for key, value in task["stages"].items():
            role, label = key.split("|", 1)
            seconds[(role, label)] += value
            calls[(role, label)] += task["calls"][key]
    cpu = thread_cpu_s(run)
    rows = []
    order = {"input": 0, "loop": 1, "output": 2, "rest": 3}
    for role in sorted({r for r, _ in seconds} | {"input", "loop", "output"}, key=lambda r: order.get(r, 9)):
        timed = 0.0
        for (r, label), value in sorted(seconds.items(), key=lambda kv: -kv[1]):
            if r != role:
                continue
            timed += value
            if value / buffers * 1e6 < 0.05:  # set-up messages, handshakes: nothing per buffer
                continue
            rows.append((role, label, value / buffers * 1e6, calls[(r, label)] / buffers))
        total = cpu.get(role, 0.0)
        if role in ("input", "loop", "output"):
            rows.append((role, "(other: untimed)", (total - timed) / buffers * 1e6, 0.0))
            rows.append((role, "= thread total", total / buffers * 1e6, 0.0))
    overhead = statistics.median(t["overhead_s"] for t in run["tasks"]) * 1e6
    return rows, overhead
