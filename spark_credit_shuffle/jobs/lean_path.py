"""The lean path: the least Python can spend to move Arrow network buffers between tasks in processes of their
own, beside the pipelined path (:mod:`.pipelined_path`), in processes and in Spark barrier stages. Measured by
``jobs/bench_path_floor.py``, whose docstring says what the lean path does and leaves out.

Every run checks that every row arrived once.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import queue
import resource
import select
import socket
import statistics
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import pipelined_path as path
from .common import CallCounter, cached_rows, noop, process_tree_cpu, rotated

#: Segment size and buffers in flight per channel: Flink's defaults (32 KiB; 2 exclusive + 8 floating).
SEGMENT = 32 * 1024
CREDITS = 10
#: A lean task that hears nothing from its peers this long stops, naming the wait (a peer that failed).
STALL_S = 60.0
#: Ports a run of the lean path may listen on, one per task from its base (at most this many tasks).
PORTS_PER_RUN = 20
#: Rows per output batch, as the exchange's OutputBatcher.
OUTPUT_ROWS = 8192
#: Frame header: payload bytes, kind (a format: a ``struct.Struct`` does not pickle into a Spark task).
_HEADER_FORMAT = "<II"
_DATA, _CREDIT, _END = 0, 1, 2


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class LeanCore:
    """Routing, cutting, serialising and decoding of one task's rows: the work any design must do.

    ``selector`` is the task's channel selector (the exchange's own), ``sample`` an input batch (its schema
    and bytes per row size the messages)."""

    def __init__(self, selector: Any, tasks: int, sample: pa.RecordBatch) -> None:
        self.tasks = tasks
        self.selector = selector
        self.schema = sample.schema
        one = sample.slice(0, 1).serialize().size
        rows = min(sample.num_rows, 1001)
        per_row = (sample.slice(0, rows).serialize().size - one) / max(1, rows - 1)
        self.rows_per_buffer = max(1, int((SEGMENT - one) / per_row * 0.98))  # 2% for longer rows
        self.output: list[pa.RecordBatch] = []
        self.output_rows = 0

    def cut(self, batch: pa.RecordBatch) -> list[tuple[int, pa.Buffer]]:
        """(channel, IPC message of at most a segment) for every buffer of ``batch``, by channel."""
        channels = np.asarray(self.selector.select_channels(batch))
        order = np.argsort(channels, kind="stable")
        grouped = batch.take(pa.array(order))
        counts = np.bincount(channels, minlength=self.tasks).tolist()
        out = []
        step = self.rows_per_buffer
        lo = 0
        for channel, count in enumerate(counts):
            for start in range(lo, lo + count, step):
                message = grouped.slice(start, min(step, lo + count - start)).serialize()
                if message.size > SEGMENT:
                    raise SystemExit(f"lean cut: a message of {message.size} bytes exceeds the segment")
                out.append((channel, message))
            lo += count
        return out

    def decode(self, message: pa.Buffer) -> pa.RecordBatch | None:
        """Decode and validate one message; an output batch once :data:`OUTPUT_ROWS` rows are there."""
        batch = pa.ipc.read_record_batch(message, self.schema)
        batch.validate(full=True)
        self.output.append(batch)
        self.output_rows += batch.num_rows
        return self.flush_output() if self.output_rows >= OUTPUT_ROWS else None

    def flush_output(self) -> pa.RecordBatch | None:
        """The rows decoded since the last output batch, as one batch (None if there are none)."""
        if not self.output:
            return None
        out = pa.Table.from_batches(self.output).combine_chunks().to_batches()[0]
        self.output, self.output_rows = [], 0
        return out


class LeanTask:
    """One task of the lean path: produces and consumes in one thread over non-blocking sockets.

    Task ``task`` of ``tasks`` listens on ``port_base + task`` of ``host`` and connects to every other task's
    port; :meth:`run` takes the task's input batches and yields its output batches."""

    def __init__(self, task: int, tasks: int, selector: Any, port_base: int, host: str = "127.0.0.1") -> None:
        self.task, self.tasks, self.selector = task, tasks, selector
        self.port_base, self.host = port_base, host
        #: Data buffers this task sent or decoded in place.
        self.buffers = 0

    def _connect(self) -> tuple[socket.socket, dict[int, socket.socket], list[socket.socket]]:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((self.host, self.port_base + self.task))
        server.listen(self.tasks)
        outs: dict[int, socket.socket] = {}
        for peer in range(self.tasks):
            if peer == self.task:
                continue
            deadline = time.monotonic() + 30
            while True:
                try:
                    outs[peer] = socket.create_connection((self.host, self.port_base + peer))
                    break
                except ConnectionRefusedError:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"lean task {self.task}: task {peer} did not listen within 30 s") from None
                    time.sleep(0.01)
        server.settimeout(30)
        ins = [server.accept()[0] for _ in range(self.tasks - 1)]
        for sock in (*outs.values(), *ins):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
        return server, outs, ins

    def run(self, inputs: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """The task's output batches, while its input batches go out to their channels."""
        inputs = iter(inputs)
        first = next(inputs, None)
        if first is None:
            raise SystemExit(f"lean task {self.task}: no input (every task of this benchmark has rows)")
        core = LeanCore(self.selector, self.tasks, first)
        header = struct.Struct(_HEADER_FORMAT)
        tasks, task = self.tasks, self.task
        server, outs, ins = self._connect()
        out_socks = {sock: peer for peer, sock in outs.items()}
        credit = dict.fromkeys(outs, CREDITS)
        queued: dict[int, deque[pa.Buffer | None]] = {peer: deque() for peer in outs}
        unsent: dict[int, bytes] = dict.fromkeys(outs, b"")
        received = {sock: bytearray() for sock in (*ins, *outs.values())}
        open_socks = set(received)
        inputs = itertools.chain([first], inputs)
        input_done = False
        ends = 0
        ready: list[pa.RecordBatch] = []

        def decode(message: pa.Buffer) -> None:
            out = core.decode(message)
            if out is not None:
                ready.append(out)

        def send(peer: int) -> None:
            sock, queue = outs[peer], queued[peer]
            if unsent[peer]:
                try:
                    sent = sock.send(unsent[peer])
                except BlockingIOError:
                    return
                unsent[peer] = unsent[peer][sent:]
                if unsent[peer]:
                    return
            while queue and (credit[peer] > 0 or queue[0] is None):
                message = queue.popleft()
                if message is None:
                    frame: list[Any] = [header.pack(0, _END)]
                else:
                    frame = [header.pack(message.size, _DATA), message]
                    credit[peer] -= 1
                    self.buffers += 1
                try:
                    sent = sock.sendmsg(frame)
                except BlockingIOError:
                    sent = 0
                total = sum(len(memoryview(part)) for part in frame)
                if sent < total:
                    unsent[peer] = b"".join(bytes(memoryview(part)) for part in frame)[sent:]
                    return

        progressed = time.monotonic()
        try:
            while ends < tasks - 1 or not input_done or any(queued.values()) or any(unsent.values()):
                can_produce = not input_done and all(len(q) < CREDITS for q in queued.values())
                if can_produce:
                    batch = next(inputs, None)
                    if batch is None:
                        input_done = True
                        for queue in queued.values():
                            queue.append(None)
                    else:
                        for channel, message in core.cut(batch):
                            if channel == task:
                                decode(message)
                                self.buffers += 1
                            else:
                                queued[channel].append(message)
                for peer in outs:
                    if queued[peer] or unsent[peer]:
                        send(peer)
                can_produce = not input_done and all(len(q) < CREDITS for q in queued.values())
                writable = [outs[p] for p in outs if unsent[p]]
                readable, ready_to_write, _ = select.select(
                    list(open_socks), writable, [], 0.0 if can_produce else 10.0
                )
                if readable or ready_to_write or can_produce:
                    progressed = time.monotonic()
                elif time.monotonic() - progressed > STALL_S:
                    raise SystemExit(f"lean task {task}: no data, credit or end from its peers for {STALL_S:.0f} s")
                for sock in readable:
                    try:
                        chunk = sock.recv(1 << 20)
                    except BlockingIOError:
                        continue
                    except ConnectionResetError:
                        # a peer that ended closed its socket with credit we sent it unread, after everything
                        # it sent us (read first; were any lost, the row check says so): as its end
                        chunk = b""
                    if not chunk:  # the peer ended (after its end of data and what it owed): nothing more to read
                        open_socks.discard(sock)
                        continue
                    consumer = out_socks.get(sock)
                    pending = received[sock]
                    pending += chunk
                    if consumer is not None:  # credit from a consumer
                        whole = len(pending) - len(pending) % header.size
                        for offset in range(0, whole, header.size):
                            credit[consumer] += header.unpack_from(pending, offset)[0]
                        del pending[:whole]
                        continue
                    offset, credits = 0, 0
                    while len(pending) - offset >= header.size:
                        size, kind = header.unpack_from(pending, offset)
                        if kind == _END:
                            ends += 1
                            offset += header.size
                            continue
                        if len(pending) - offset - header.size < size:
                            break
                        start = offset + header.size
                        decode(pa.py_buffer(bytes(pending[start : start + size])))
                        offset = start + size
                        credits += 1
                    del pending[:offset]
                    if credits:
                        try:
                            sock.setblocking(True)
                            sock.sendall(header.pack(credits, _CREDIT))
                            sock.setblocking(False)
                        except (BrokenPipeError, ConnectionResetError):  # a producer that ended needs no credit
                            open_socks.discard(sock)
                if ready:
                    yield from ready
                    ready.clear()
            last = core.flush_output()
            if last is not None:
                yield last
        finally:
            for sock in (*outs.values(), *ins, server):
                sock.close()


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_bases() -> Iterator[int]:
    """Bases of :data:`PORTS_PER_RUN` ports that nothing holds when it is taken, for the lean tasks of one run
    each. Below Linux's ephemeral range (32768-60999), where no connection of Spark's or of the pipelined
    runtime takes a port by chance, and from a place per process, so runs one after the other use fresh ports."""
    bases = list(range(10_000, 32_000, PORTS_PER_RUN))
    k = os.getpid() % len(bases)
    for base in bases[k:] + bases[:k]:
        if all(_bindable(base + i) for i in range(PORTS_PER_RUN)):
            yield base


def _tally(batch: pa.RecordBatch) -> tuple[int, int]:
    """Rows of ``batch`` and the sum of its ``a``: what the checks compare."""
    return batch.num_rows, pc.sum(batch.column(0)).as_py() or 0


def _selector(task: int, tasks: int, plan: Any) -> Any:
    return plan.partitioner.selector(task, tasks, tasks, plan.max_parallelism)


def _lean_cores(tasks: int, rows: int, count_calls: bool, results: Any) -> None:
    """Every task's rows through the lean core, one task after the other, in this process; reports the CPU (or,
    with ``count_calls``, the Python function calls) of the cutting and decoding, buffers, rows and sum."""
    plan = path.make_plan(tasks)
    cpu = 0.0
    buffers = rows_in = sum_in = calls = 0
    for task in range(tasks):
        data = path.make_input(task, rows)
        core = LeanCore(_selector(task, tasks, plan), tasks, data[0])
        outputs = []
        started = _cpu_s()
        with CallCounter() if count_calls else nullcontext() as counter:
            for batch in data:
                for _, message in core.cut(batch):
                    outputs.append(core.decode(message))
                    buffers += 1
            outputs.append(core.flush_output())
        cpu += _cpu_s() - started
        calls += counter.calls if counter is not None else 0
        for out in outputs:
            if out is not None:
                n, s = _tally(out)
                rows_in, sum_in = rows_in + n, sum_in + s
    results.put((cpu, buffers, rows_in, sum_in, calls))


def _lean_task(task: int, tasks: int, rows: int, port_base: int, count_calls: bool, results: Any) -> None:
    """One task of the lean path in this process; reports its CPU (or, with ``count_calls``, its Python function
    calls), buffers, rows and sum."""
    data = path.make_input(task, rows)
    lean = LeanTask(task, tasks, _selector(task, tasks, path.make_plan(tasks)), port_base)
    rows_in = sum_in = 0
    started = _cpu_s()
    with CallCounter() if count_calls else nullcontext() as counter:
        for out in lean.run(iter(data)):
            n, s = _tally(out)
            rows_in, sum_in = rows_in + n, sum_in + s
    cpu = _cpu_s() - started
    results.put((cpu, lean.buffers, rows_in, sum_in, counter.calls if counter is not None else 0))


def _run_processes(target: Any, arguments: list[tuple[Any, ...]]) -> tuple[float, int, int, int, int]:
    """Run ``target(*args, results)`` in a process per tuple of ``arguments``: (CPU seconds of all, data
    buffers, rows and sum of ``a`` that arrived, Python function calls counted)."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, results)) for args in arguments]
    for p in procs:
        p.start()
    try:
        try:
            got = [results.get(timeout=300) for _ in procs]
        except queue.Empty:
            raise SystemExit(f"{target.__name__}: a process did not report within 300 s") from None
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
    cpu, buffers, rows, total, calls = (sum(g[k] for g in got) for k in range(5))
    return cpu, buffers, rows, total, calls


def lean_core(tasks: int, rows: int) -> tuple[float, int]:
    """(CPU us per buffer, data buffers) of the lean core over every task's rows."""
    cpu, buffers, got_rows, got_sum, _ = _run_processes(_lean_cores, [(tasks, rows, False)])
    _check(tasks, rows, got_rows, got_sum, "lean core")
    return cpu / buffers * 1e6, buffers


def lean_path(tasks: int, rows: int, port_base: int) -> tuple[float, int]:
    """(CPU us per buffer, data buffers) of the lean path between ``tasks`` processes. It cuts each input
    batch's rows of a channel on their own, so the last buffer of each is partly filled: more buffers than the
    pipelined path's for the same rows (whose buffers take the next batch's rows)."""
    cpu, buffers, got_rows, got_sum, _ = _run_processes(
        _lean_task, [(task, tasks, rows, port_base, False) for task in range(tasks)]
    )
    _check(tasks, rows, got_rows, got_sum, "lean path")
    return cpu / buffers * 1e6, buffers


def _check(tasks: int, rows: int, got_rows: int, got_sum: int, what: str) -> None:
    expected = tasks * rows
    if (got_rows, got_sum) != (expected, expected * (expected - 1) // 2):
        raise SystemExit(f"{what}: {got_rows} rows (sum {got_sum}) arrived, expected {expected}")


def pipelined_path(tasks: int, rows: int) -> tuple[float, int]:
    """(CPU us per buffer, data buffers) of the pipelined runtime between ``tasks`` processes on one executor."""
    run = path.run_exchange(tasks, rows, local=True)
    out, _, _ = path.buffers_of(run)
    return path.thread_cpu_s(run)["total"] / out * 1e6, out


def pipelined_core(tasks: int, rows: int) -> tuple[float, int]:
    """(CPU us per buffer, data buffers) of the pipelined runtime's core in place."""
    cpu, _, buffers = path.core_in_place(tasks, rows)
    return cpu / buffers * 1e6, buffers


#: The cases of :func:`python_calls`, in the order printed.
CALL_CASES = ("lean core", "lean path", "pipelined core", "pipelined path")


def python_calls(tasks: int, rows: int, port_base: int) -> dict[str, float]:
    """Python function calls per data buffer of each of :data:`CALL_CASES` (one counted run each, every thread
    that works for a path counted, each checking that every row arrived once): how much Python a buffer costs,
    in a figure that does not drift with the machine's speed as CPU time does."""
    _, buffers, got_rows, got_sum, calls = _run_processes(_lean_cores, [(tasks, rows, True)])
    _check(tasks, rows, got_rows, got_sum, "lean core")
    out = {"lean core": calls / buffers}
    _, buffers, got_rows, got_sum, calls = _run_processes(
        _lean_task, [(task, tasks, rows, port_base, True) for task in range(tasks)]
    )
    _check(tasks, rows, got_rows, got_sum, "lean path")
    out["lean path"] = calls / buffers
    calls, buffers = path.core_calls(tasks, rows)
    out["pipelined core"] = calls / buffers
    run = path.run_exchange(tasks, rows, local=True, profile="calls")
    sent, _, _ = path.buffers_of(run)
    out["pipelined path"] = sum(sum(task["python_calls"].values()) for task in run["tasks"]) / sent
    return out


# -- the same paths inside Spark -----------------------------------------------------------------------------------

#: The cases of the Spark part, in the order printed.
SPARK_CASES = (
    "mapInArrow",
    "repartition + mapInArrow",
    "lean, streaming",
    "lean, retryable",
    "pipelined, streaming",
    "pipelined, retryable",
)


def _barrier_lean(plan: Any, tasks: int, port_base: int, nested: tuple[str, str, bool] | None) -> Any:
    """The function of a barrier ``mapInArrow`` whose task *i* is lean task *i*; with ``nested`` (tag, rows
    column, columnar) its output batches leave as the retryable exchange's nested rows."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import BarrierTaskContext

        from spark_credit_shuffle.runtime.pipelined.nested_output import nest

        task = BarrierTaskContext.get().partitionId()
        out = LeanTask(task, tasks, _selector(task, tasks, plan), port_base).run(batches)
        if nested is not None:
            out = nest(out, task, *nested)
        yield from out

    return run


def spark_floor(spark: Any, rows: int, tasks: int, repeat: int, ports: Iterator[int]) -> dict[str, Any]:
    """The lean path and the pipelined exchange in Spark barrier stages of ``tasks`` tasks, beside an identity
    ``mapInArrow`` alone and ``repartition`` + identity ``mapInArrow``; both forms of each path (streaming
    into the sink, and retryable: its output placed by the exchange's nested rows and identity shuffle).
    Returns each case's seconds and CPU (JVM, Python workers) per run, medians of ``repeat`` rotated rounds,
    and the targets' ratios. Every case of a path first checks that each row arrives once. The workers import
    the lean code from the installed package, as the exchange's own."""
    import spark_credit_shuffle as scs
    from spark_credit_shuffle.runtime import pipelined
    from spark_credit_shuffle.runtime.pipelined.nested_output import columnar_layout, nested_spark_type, unnest
    from spark_credit_shuffle.runtime.placement import place_by
    from spark_credit_shuffle.runtime.session import ansi_mode

    df = cached_rows(spark, rows, tasks)
    plan = path.make_plan(tasks)
    pipelined.check_slots(plan, spark)  # the lean barrier stages too need every task slot registered
    columnar = columnar_layout(df.schema, ansi_mode(spark))
    tag, rows_column = "lean_tag", "lean_rows"

    def identity(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield from batches

    def lean(retryable: bool) -> Any:
        port_base = next(ports)
        if not retryable:
            return df.mapInArrow(_barrier_lean(plan, tasks, port_base, None), df.schema, barrier=True)
        nested = nested_spark_type(df.schema, tag, rows_column, columnar)
        placed = df.mapInArrow(
            _barrier_lean(plan, tasks, port_base, (tag, rows_column, columnar)), nested, barrier=True
        )
        return unnest(place_by(placed, tasks, tag), rows_column, df.schema, columnar)

    streaming_metrics: list[Any] = []  # the metrics of the pipelined streaming form's last run

    def pipelined_form(retryable: bool) -> Any:
        ex = scs.exchange(df, scs.key_by("a"), tasks, mode="pipelined")
        out, collected = pipelined.build(ex.plan, df, retryable=retryable)
        if not retryable:
            streaming_metrics[:] = [collected]
        return out

    forms = {
        "lean, streaming": lambda: lean(False),
        "lean, retryable": lambda: lean(True),
        "pipelined, streaming": lambda: pipelined_form(False),
        "pipelined, retryable": lambda: pipelined_form(True),
    }

    def sunk(form: Callable[[], Any]) -> Callable[[], None]:
        return lambda: noop(form())

    cases: dict[str, Callable[[], None]] = {
        "mapInArrow": lambda: noop(df.mapInArrow(identity, df.schema)),
        "repartition + mapInArrow": lambda: noop(df.repartition(tasks, "a").mapInArrow(identity, df.schema)),
        **{name: sunk(form) for name, form in forms.items()},
    }
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    threads: list[dict[str, float]] = []  # the pipelined streaming form's CPU per data buffer, by thread
    expected = (rows, rows * (rows - 1) // 2)
    try:
        for name, form in forms.items():  # each row once, then the warm-up of every case
            got = tuple(form().selectExpr("count(*)", "sum(a)").first())
            if got != expected:
                raise SystemExit(f"{name}: {got[0]} rows (sum of a {got[1]}) arrived, expected {expected[0]}")
        for action in cases.values():
            action()
        for round_ in range(repeat):
            for name in rotated(list(cases), round_):
                before = process_tree_cpu()
                started = time.perf_counter()
                cases[name]()
                seconds[name].append(time.perf_counter() - started)
                after = process_tree_cpu()
                if before is not None and after is not None:
                    cpu[name].append({kind: after[kind] - before[kind] for kind in after})
                if name == "pipelined, streaming":
                    threads.append(_thread_cpu_per_buffer(streaming_metrics[0]))
    finally:
        df.unpersist()
    out: dict[str, Any] = {"seconds": {}, "cpu_jvm_s": {}, "cpu_python_s": {}, "runs": seconds}
    for name in cases:
        out["seconds"][name] = statistics.median(seconds[name])
        if cpu[name]:
            out["cpu_jvm_s"][name] = statistics.median(c["jvm"] for c in cpu[name])
            out["cpu_python_s"][name] = statistics.median(c["python"] for c in cpu[name])
    out["pipelined_streaming_us_per_buffer"] = {
        thread: statistics.median(run[thread] for run in threads) for thread in threads[0]
    }
    out["ratios"] = _throughput_ratios(out["seconds"])
    # each round's own ratios (its cases ran within a minute of each other), their medians: steadier than the
    # ratios of the medians when the machine's speed drifts between rounds
    rounds = [_throughput_ratios({name: runs[r] for name, runs in seconds.items()}) for r in range(repeat)]
    out["ratios_paired"] = {key: statistics.median(ratios[key] for ratios in rounds) for key in out["ratios"]}
    return out


def _throughput_ratios(s: dict[str, float]) -> dict[str, float]:
    """The targets' throughput ratios from each case's seconds ``s``."""
    return (
        {
            f"{form}_streaming_vs_mapinarrow_throughput": s["mapInArrow"] / s[f"{form}, streaming"]
            for form in ("lean", "pipelined")
        }
        | {
            f"{form}_retryable_vs_reference_throughput": s["repartition + mapInArrow"] / s[f"{form}, retryable"]
            for form in ("lean", "pipelined")
        }
        | {
            f"pipelined_{form}_vs_lean_throughput": s[f"lean, {form}"] / s[f"pipelined, {form}"]
            for form in ("streaming", "retryable")
        }
    )


#: The pipelined tasks' CPU metrics by thread (``PipelinedTask``'s: the task thread is the consumer, and Spark's
#: own work for the task runs on the thread that reads its input, the producer, or writes its output, the
#: consumer), and the whole task's.
THREAD_METRICS = {
    "input thread": "inputThreadCpuTimeMs",
    "loop thread": "loopThreadCpuTimeMs",
    "output thread": "outputThreadCpuTimeMs",
    "task": "taskCpuTimeMs",
}


def _thread_cpu_per_buffer(collected: Any) -> dict[str, float]:
    """us of CPU per data buffer of a pipelined exchange's run, by thread, over all its tasks."""
    rows = list(collected.rows())
    buffers = sum(r.value for r in rows if r.metric == "numBuffersOut" and r.channel is not None)
    return {
        thread: sum(r.value for r in rows if r.metric == metric) * 1000.0 / max(1.0, buffers)
        for thread, metric in THREAD_METRICS.items()
    } | {"buffers": buffers}
