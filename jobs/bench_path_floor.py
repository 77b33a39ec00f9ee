"""Benchmark: the floor under the pipelined path, next to the path itself, per 32 KiB buffer and per task count.

What the least Python can spend to move Arrow network buffers between tasks in processes of their own, and
what the pipelined runtime spends, measured in the same run, at ``--parallelism`` 2 and 4 (one process per
task, all on 127.0.0.1, as Spark's ``local[P]`` runs a pipelined exchange's tasks in P Python workers):

- ``lean path``: one thread per process, no protocol objects, no locks, no other thread. It routes each input
  batch with the exchange's own key-group selector (``key_by("a")``), groups the rows by channel (one stable
  ``take``), cuts every channel's rows into IPC messages of at most one segment at a fixed number of rows
  (from the first batch's bytes per row, with 2% to spare: no per-row size model), serialises them, and sends
  each to its consumer over a plain non-blocking socket (an 8-byte header, ``sendmsg``), at most ``CREDITS``
  buffers in flight per channel; a consumer reads what ``select`` says is there, decodes and validates every message
  (``read_record_batch``, ``validate(full=True)``, as the RecordReader does with untrusted bytes), batches the
  output to 8,192 rows, and returns one credit message per connection per read. Rows for the task's own
  consumer are decoded in place. It stops reading input while a channel has ``CREDITS`` buffers queued;
  nothing else: no backlog, no events, no barriers, no metrics, no flusher, no keep-alives;
- ``lean core``: the same routing, cutting, serialising, decoding and output batching of one task's rows in
  one process, with no socket;
- ``pipelined path``: :class:`~spark_credit_shuffle.runtime.task.PipelinedTask` in each process (its
  producer, I/O, consumer and timer threads; all tasks on one executor, so local channels through the
  connection: ``jobs/bench_pipelined_path.py --local``), and its core in place (``jobs/bench_pipelined_path.py``).

Every figure is the CPU of all processes (``getrusage``: every thread, ended ones too, from the first buffer to
the last) divided by the data buffers moved, median of ``--repeat`` rotated rounds. "Beyond the core" is a
path's figure less its own core's: what moving the buffers between processes costs. Every run checks that
every row arrived once. The last line printed is one JSON object with the headline figures. Run
``python jobs/bench_path_floor.py`` (about two minutes). The figures and what they say: docs/benchmarks.md,
"The floor under the pipelined path".
"""

from __future__ import annotations

import argparse
import json
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
from typing import Any

import bench_pipelined_path as path  # the pipelined path's own benchmark (its runs, its input): jobs/ is on the path
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from bench_exchange import rotated

#: Segment size and buffers in flight per channel: Flink's defaults (32 KiB; 2 exclusive + 8 floating).
SEGMENT = 32 * 1024
CREDITS = 10
#: Rows per output batch, as the exchange's OutputBatcher.
OUTPUT_ROWS = 8192
#: Frame header: payload bytes, kind.
_HEADER = struct.Struct("<II")
_DATA, _CREDIT, _END = 0, 1, 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000, help="rows over all tasks (default 4,000,000)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds, medians reported (default 3)")
    parser.add_argument(
        "--parallelism", type=int, nargs="+", default=[2, 4], help="task counts to measure (default 2 4)"
    )
    return parser.parse_args(argv)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class LeanCore:
    """Routing, cutting, serialising and decoding of one task's rows: the work any design must do."""

    def __init__(self, task: int, tasks: int, sample: pa.RecordBatch) -> None:
        plan = path.make_plan(tasks)
        self.tasks = tasks
        self.selector = plan.partitioner.selector(task, tasks, tasks, plan.max_parallelism)
        one = sample.slice(0, 1).serialize().size
        rows = min(sample.num_rows, 1001)
        per_row = (sample.slice(0, rows).serialize().size - one) / max(1, rows - 1)
        self.rows_per_buffer = max(1, int((SEGMENT - one) / per_row * 0.98))  # 2% for longer rows
        self.output: list[pa.RecordBatch] = []
        self.output_rows = 0
        self.rows_in = 0
        self.sum_in = 0

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

    def decode(self, message: pa.Buffer) -> None:
        batch = pa.ipc.read_record_batch(message, path.SCHEMA)
        batch.validate(full=True)
        self.output.append(batch)
        self.output_rows += batch.num_rows
        if self.output_rows >= OUTPUT_ROWS:
            self.flush_output()

    def flush_output(self) -> None:
        if self.output:
            out = pa.Table.from_batches(self.output).combine_chunks()
            self.rows_in += out.num_rows
            self.sum_in += pc.sum(out.column(0)).as_py() or 0
            self.output, self.output_rows = [], 0


def _lean_cores(tasks: int, rows: int, results: Any) -> None:
    """Every task's rows through the lean core, one task after the other, in this process."""
    cpu = 0.0
    buffers = rows_in = sum_in = 0
    for task in range(tasks):
        data = path.make_input(task, rows)
        core = LeanCore(task, tasks, data[0])
        started = _cpu_s()
        for batch in data:
            for _, message in core.cut(batch):
                core.decode(message)
                buffers += 1
        core.flush_output()
        cpu += _cpu_s() - started
        rows_in += core.rows_in
        sum_in += core.sum_in
    results.put((cpu, buffers, rows_in, sum_in))


def _lean_task(task: int, tasks: int, rows: int, port_base: int, results: Any) -> None:
    """One task of the lean path: produce and consume in one thread over non-blocking sockets."""
    data = path.make_input(task, rows)
    core = LeanCore(task, tasks, data[0])
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port_base + task))
    server.listen(tasks)
    outs: dict[int, socket.socket] = {}
    for peer in range(tasks):
        if peer == task:
            continue
        deadline = time.monotonic() + 30
        while True:
            try:
                outs[peer] = socket.create_connection(("127.0.0.1", port_base + peer))
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"lean task {task}: task {peer} did not listen within 30 s") from None
                time.sleep(0.02)
    ins = [server.accept()[0] for _ in range(tasks - 1)]
    for sock in (*outs.values(), *ins):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
    out_socks = {sock: peer for peer, sock in outs.items()}
    credit = dict.fromkeys(outs, CREDITS)
    queued: dict[int, deque[pa.Buffer | None]] = {peer: deque() for peer in outs}
    unsent: dict[int, bytes] = dict.fromkeys(outs, b"")
    received = {sock: bytearray() for sock in (*ins, *outs.values())}
    open_socks = set(received)
    inputs = iter(data)
    input_done = False
    ends = 0
    buffers = 0
    started = _cpu_s()

    def send(peer: int) -> None:
        nonlocal buffers
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
                frame: list[Any] = [_HEADER.pack(0, _END)]
            else:
                frame = [_HEADER.pack(message.size, _DATA), message]
                credit[peer] -= 1
                buffers += 1
            try:
                sent = sock.sendmsg(frame)
            except BlockingIOError:
                sent = 0
            total = sum(len(memoryview(part)) for part in frame)
            if sent < total:
                unsent[peer] = b"".join(bytes(memoryview(part)) for part in frame)[sent:]
                return

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
                        core.decode(message)
                        buffers += 1
                    else:
                        queued[channel].append(message)
        for peer in outs:
            if queued[peer] or unsent[peer]:
                send(peer)
        can_produce = not input_done and all(len(q) < CREDITS for q in queued.values())
        writable = [outs[p] for p in outs if unsent[p]]
        readable, _, _ = select.select(list(open_socks), writable, [], 0.0 if can_produce else 10.0)
        for sock in readable:
            try:
                chunk = sock.recv(1 << 20)
            except BlockingIOError:
                continue
            if not chunk:  # the peer ended (after its end of data and what it owed): nothing more to read
                open_socks.discard(sock)
                continue
            consumer = out_socks.get(sock)
            pending = received[sock]
            pending += chunk
            if consumer is not None:  # credit from a consumer
                whole = len(pending) - len(pending) % _HEADER.size
                for offset in range(0, whole, _HEADER.size):
                    credit[consumer] += _HEADER.unpack_from(pending, offset)[0]
                del pending[:whole]
                continue
            offset, credits = 0, 0
            while len(pending) - offset >= _HEADER.size:
                size, kind = _HEADER.unpack_from(pending, offset)
                if kind == _END:
                    ends += 1
                    offset += _HEADER.size
                    continue
                if len(pending) - offset - _HEADER.size < size:
                    break
                start = offset + _HEADER.size
                core.decode(pa.py_buffer(bytes(pending[start : start + size])))
                offset = start + size
                credits += 1
            del pending[:offset]
            if credits:
                try:
                    sock.setblocking(True)
                    sock.sendall(_HEADER.pack(credits, _CREDIT))
                    sock.setblocking(False)
                except (BrokenPipeError, ConnectionResetError):  # a producer that ended needs no more credit
                    open_socks.discard(sock)
    core.flush_output()
    cpu = _cpu_s() - started
    for sock in (*outs.values(), *ins, server):
        sock.close()
    results.put((cpu, buffers, core.rows_in, core.sum_in))


def _run_processes(target: Any, arguments: list[tuple[Any, ...]]) -> tuple[float, int, int, int]:
    """Run ``target(*args, results)`` in a process per tuple of ``arguments``: (CPU seconds of all, data
    buffers, rows and sum of ``a`` that arrived)."""
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
    return sum(g[0] for g in got), sum(g[1] for g in got), sum(g[2] for g in got), sum(g[3] for g in got)


def lean_core(tasks: int, rows: int) -> float:
    """CPU us per buffer of the lean core over every task's rows."""
    cpu, buffers, got_rows, got_sum = _run_processes(_lean_cores, [(tasks, rows)])
    _check(tasks, rows, got_rows, got_sum, "lean core")
    return cpu / buffers * 1e6


def lean_path(tasks: int, rows: int, port_base: int) -> float:
    """CPU us per buffer of the lean path between ``tasks`` processes."""
    cpu, buffers, got_rows, got_sum = _run_processes(
        _lean_task, [(task, tasks, rows, port_base) for task in range(tasks)]
    )
    _check(tasks, rows, got_rows, got_sum, "lean path")
    return cpu / buffers * 1e6


def _check(tasks: int, rows: int, got_rows: int, got_sum: int, what: str) -> None:
    expected = tasks * rows
    if (got_rows, got_sum) != (expected, expected * (expected - 1) // 2):
        raise SystemExit(f"{what}: {got_rows} rows (sum {got_sum}) arrived, expected {expected}")


def pipelined_path(tasks: int, rows: int) -> float:
    """CPU us per buffer of the pipelined runtime between ``tasks`` processes on one executor."""
    run = path.run_exchange(tasks, rows, local=True)
    out, _, _ = path.buffers_of(run)
    return path.thread_cpu_s(run)["total"] / out * 1e6


def pipelined_core(tasks: int, rows: int) -> float:
    cpu, _, buffers = path.core_in_place(tasks, rows)
    return cpu / buffers * 1e6


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"{args.rows:,} rows over P tasks in processes of their own, key_by('a'), 32 KiB buffers, "
        f"{CREDITS} in flight per channel; CPU of all processes per data buffer, median of {args.repeat} rounds"
    )
    figures: dict[int, dict[str, list[float]]] = {}
    ports = iter(range(20000 + (os.getpid() % 500) * 40, 65000, 20))  # fresh ports each run: no TIME_WAIT
    for parallelism in args.parallelism:
        rows = args.rows // parallelism
        cases = {
            "lean core": lambda p=parallelism, r=rows: lean_core(p, r),
            "lean path": lambda p=parallelism, r=rows: lean_path(p, r, next(ports)),
            "pipelined core": lambda p=parallelism, r=rows: pipelined_core(p, r),
            "pipelined path": lambda p=parallelism, r=rows: pipelined_path(p, r),
        }
        got: dict[str, list[float]] = {name: [] for name in cases}
        for round_ in range(args.repeat):  # rotated, so that no case always runs first or last
            for name in rotated(list(cases), round_):
                got[name].append(cases[name]())
        figures[parallelism] = got
    print()
    print("  P   lean core   lean path   beyond   pipelined core   pipelined path   beyond   path / lean path")
    headline: dict[str, Any] = {"rows": args.rows, "credits_per_channel": CREDITS, "unit": "us of CPU per buffer"}
    for parallelism, got in figures.items():
        med = {name: statistics.median(values) for name, values in got.items()}
        lean_beyond = med["lean path"] - med["lean core"]
        beyond = med["pipelined path"] - med["pipelined core"]
        ratio = med["pipelined path"] / med["lean path"]
        print(
            f"{parallelism:3d} {med['lean core']:10.1f} {med['lean path']:11.1f} {lean_beyond:8.1f} "
            f"{med['pipelined core']:16.1f} {med['pipelined path']:16.1f} {beyond:8.1f} {ratio:18.2f}x"
        )
        print("      runs: " + "; ".join(f"{n} " + ", ".join(f"{v:.0f}" for v in vs) for n, vs in got.items()))
        headline[f"p{parallelism}_lean_core_us"] = round(med["lean core"], 1)
        headline[f"p{parallelism}_lean_path_us"] = round(med["lean path"], 1)
        headline[f"p{parallelism}_lean_beyond_core_us"] = round(lean_beyond, 1)
        headline[f"p{parallelism}_pipelined_core_us"] = round(med["pipelined core"], 1)
        headline[f"p{parallelism}_pipelined_path_us"] = round(med["pipelined path"], 1)
        headline[f"p{parallelism}_pipelined_beyond_core_us"] = round(beyond, 1)
        headline[f"p{parallelism}_pipelined_vs_lean_path_ratio"] = round(ratio, 2)
    print(json.dumps(headline, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
