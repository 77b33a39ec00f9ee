"""Benchmark: write + read throughput of the network buffers, next to pyarrow's own IPC stream.

It generates ``--rows`` rows (int64, int32, 20-character string) as Arrow batches of ``--batch-rows``
rows, then times, in one run and interleaved, ``--runs`` times each (after one warm-up):

1. **buffers**: every batch through a :class:`RecordWriter` (round robin over ``--channels``
   subpartitions, like ``rebalance()``, ``--segment-size`` segments, buffer timeout -1) into a small
   in-process partition whose consumers hand each finished buffer to the channel's
   :class:`RecordReader` right away, as a local input channel that keeps up; ``finish()`` at the end;
2. **raw IPC**: the same batches through ``pa.ipc.new_stream`` into memory and back with
   ``pa.ipc.open_stream`` (one stream, no routing, no segment limit): the upper bound. It is also
   timed into a preallocated, already touched sink, which leaves out the page faults of growing a
   fresh output buffer of the whole data size on every run.

It prints the medians in MB/s (bytes: the Arrow bytes of the rows) with every run's wall-clock time,
the ratio (wall-clock, as the target is stated, and in CPU time, which other processes on a shared
machine disturb much less), the number of buffers against the ideal ``ceil(bytes / segment size)``,
then a breakdown of the Arrow work inside the buffers path (routing take, serialisation, decoding,
validation) measured alone on the same data, with the ratio that work alone would allow (the
ceiling of any Python around it), and as its last line one JSON object with the headline figures.
``--profile`` prints a cProfile of one buffers run instead.
Run ``python jobs/bench_buffers.py --rows 1000000`` for a quick check.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import pstats
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from spark_credit_shuffle.buffers import Buffer, BufferConsumer, DataType, RecordReader, RecordWriter
from spark_credit_shuffle.partitioners import RoundRobinSelector

ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", dtype=np.uint8)
#: The targets: write + read at >= 50% of raw IPC, buffers within 5% of the ideal count.
TARGET_RATIO = 0.5
TARGET_BUFFER_EXCESS = 0.05


def make_batches(rows: int, batch_rows: int, seed: int = 0) -> list[pa.RecordBatch]:
    """``rows`` rows of (int64 id, int32 value, 20-character string) in batches, without a per-row loop."""
    rng = np.random.default_rng(seed)
    batches = []
    for start in range(0, rows, batch_rows):
        n = min(batch_rows, rows - start)
        chars = ALPHABET[rng.integers(0, len(ALPHABET), size=n * 20)]
        offsets = np.arange(0, n * 20 + 1, 20, dtype=np.int32)
        text = pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(chars.tobytes()))
        ids = pa.array(np.arange(start, start + n, dtype=np.int64))
        values = pa.array(rng.integers(0, 1 << 31, size=n, dtype=np.int64).astype(np.int32))
        batches.append(pa.record_batch({"id": ids, "value": values, "text": text}))
    return batches


class LocalPartition:
    """A pipelined partition whose consumer keeps up: finished buffers go to the readers at once.

    Implements the RecordWriter's ``ResultPartitionWriter`` side with a queue per subpartition;
    :meth:`deliver` polls every queue as ``PipelinedSubpartition.pollBuffer`` does (build the head,
    drop it once finished) and feeds each buffer to that channel's reader.
    """

    def __init__(self, num_subpartitions: int, readers: list[RecordReader]) -> None:
        self.num_subpartitions = num_subpartitions
        self.readers = readers
        self.queues: list[deque] = [deque() for _ in range(num_subpartitions)]
        self.sequence = [0] * num_subpartitions
        self.rows_read = 0
        self.max_payload = 0

    def request_segment(self, subpartition: int) -> Callable[[], None]:
        return _no_op

    def add_consumer(self, subpartition: int, consumer: BufferConsumer, partial_record_length: int = 0) -> None:
        self.queues[subpartition].append(consumer)

    def add_event(self, subpartition: int, buffer: Buffer) -> None:
        self.queues[subpartition].append(_Finished(buffer))

    def flush(self, subpartition: int) -> None:
        pass

    def flush_all(self) -> None:
        pass

    def finish(self) -> None:
        for sp in range(self.num_subpartitions):
            self.add_event(sp, Buffer(DataType.END_OF_PARTITION, b""))

    def is_available(self) -> bool:
        return True

    def deliver(self, everything: bool = False) -> None:
        """Feed the finished buffers (all buffers if ``everything``) of every queue to its reader."""
        for sp, queue in enumerate(self.queues):
            reader = self.readers[sp]
            while queue and (everything or len(queue) > 1):
                consumer = queue[0]
                buffer = consumer.build()
                if consumer.is_finished():
                    queue.popleft()
                if buffer.size or buffer.data_type.is_event:
                    if buffer.size > self.max_payload:
                        self.max_payload = buffer.size
                    for item in reader.feed(buffer, self.sequence[sp]):
                        if isinstance(item, pa.RecordBatch):
                            self.rows_read += item.num_rows
                    self.sequence[sp] += 1
                elif not consumer.is_finished():
                    break


class _Finished:
    """A consumer over one ready event buffer."""

    __slots__ = ("_buffer",)

    def __init__(self, buffer: Buffer) -> None:
        self._buffer = buffer

    @property
    def data_type(self) -> DataType:
        return self._buffer.data_type

    def is_finished(self) -> bool:
        return True

    def build(self) -> Buffer:
        return self._buffer


def _no_op() -> None:
    pass


class Timing:
    """Wall-clock and CPU seconds (this process, user + system) of one run."""

    __slots__ = ("cpu", "wall")

    def __init__(self) -> None:
        self.wall = -time.perf_counter()
        self.cpu = -time.process_time()

    def stop(self) -> Timing:
        self.wall += time.perf_counter()
        self.cpu += time.process_time()
        return self


def run_buffers(
    batches: list[pa.RecordBatch], channels: int, segment_size: int, validate: bool = True
) -> tuple[Timing, RecordWriter]:
    """Time to write and read every batch through the buffers; the writer for its counters."""
    schema = batches[0].schema
    timing = Timing()
    readers = [RecordReader(schema, sp, validate=validate) for sp in range(channels)]
    partition = LocalPartition(channels, readers)
    writer = RecordWriter(partition, RoundRobinSelector(channels, 0), segment_size)
    for batch in batches:
        writer.emit(batch)
        partition.deliver()
    writer.finish()
    partition.deliver(everything=True)
    timing.stop()
    rows = sum(b.num_rows for b in batches)
    if partition.rows_read != rows or not all(r.is_finished for r in readers):
        raise AssertionError(f"read {partition.rows_read} rows of {rows}")
    if partition.max_payload > segment_size:
        raise AssertionError(f"a payload of {partition.max_payload} bytes exceeds the segment")
    return timing, writer


def run_raw_ipc(batches: list[pa.RecordBatch]) -> Timing:
    """Time to write every batch into one in-memory IPC stream and read it back."""
    timing = Timing()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batches[0].schema) as stream:
        for batch in batches:
            stream.write_batch(batch)
    rows = 0
    for batch in pa.ipc.open_stream(sink.getvalue()):
        rows += batch.num_rows
    timing.stop()
    if rows != sum(b.num_rows for b in batches):
        raise AssertionError("raw IPC lost rows")
    return timing


class WarmSink:
    """One preallocated, already touched buffer that raw IPC runs write into again and again.

    ``pa.BufferOutputStream`` grows a fresh buffer on every run, so the raw IPC time also counts
    first-touch page faults of hundreds of MB; this sink shows raw IPC without them.
    """

    def __init__(self, batches: list[pa.RecordBatch]) -> None:
        counter = pa.MockOutputStream()
        with pa.ipc.new_stream(counter, batches[0].schema) as stream:
            for batch in batches:
                stream.write_batch(batch)
        self.buffer = pa.allocate_buffer(counter.size())
        np.frombuffer(self.buffer, dtype=np.uint8)[:] = 0  # map every page now

    def run(self, batches: list[pa.RecordBatch]) -> Timing:
        timing = Timing()
        sink = pa.FixedSizeBufferWriter(self.buffer)
        with pa.ipc.new_stream(sink, batches[0].schema) as stream:
            for batch in batches:
                stream.write_batch(batch)
        rows = 0
        for batch in pa.ipc.open_stream(self.buffer.slice(0, sink.tell())):
            rows += batch.num_rows
        timing.stop()
        if rows != sum(b.num_rows for b in batches):
            raise AssertionError("raw IPC lost rows")
        return timing


def breakdown(batches: list[pa.RecordBatch], channels: int, segment_size: int) -> dict[str, float]:
    """Seconds of the Arrow work inside the buffers path, each step alone on the same data."""
    schema = batches[0].schema
    rows_per_buffer = max(1, segment_size // 37)
    selector = RoundRobinSelector(channels, 0)
    times = {"select+group (take)": 0.0, "serialize 32 KiB slices": 0.0, "read_record_batch": 0.0, "validate": 0.0}
    for batch in batches:
        t0 = time.perf_counter()
        ch = selector.select_channels(batch)
        grouped = batch.take(np.concatenate([np.flatnonzero(ch == c) for c in range(channels)]))
        t1 = time.perf_counter()
        messages = [grouped.slice(i, rows_per_buffer).serialize() for i in range(0, grouped.num_rows, rows_per_buffer)]
        t2 = time.perf_counter()
        decoded = [pa.ipc.read_record_batch(m, schema) for m in messages]
        t3 = time.perf_counter()
        for d in decoded:
            d.validate(full=True)
        t4 = time.perf_counter()
        times["select+group (take)"] += t1 - t0
        times["serialize 32 KiB slices"] += t2 - t1
        times["read_record_batch"] += t3 - t2
        times["validate"] += t4 - t3
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--batch-rows", type=int, default=65_536)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--segment-size", type=int, default=32 * 1024)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-validate", action="store_true", help="readers skip Arrow's full validation")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one buffers run and stop")
    args = parser.parse_args(argv)

    batches = make_batches(args.rows, args.batch_rows)
    data_bytes = sum(b.nbytes for b in batches)
    print(
        f"{args.rows:,} rows, {data_bytes / 1e6:.0f} MB in {len(batches)} batches; {args.channels} channels, "
        f"{args.segment_size} B segments; readers validate: {not args.no_validate}; median of {args.runs}"
    )

    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        run_buffers(batches, args.channels, args.segment_size, not args.no_validate)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return 0

    warm = WarmSink(batches)
    validate = not args.no_validate
    run_buffers(batches, args.channels, args.segment_size, validate)  # warm-up (allocator, imports)
    run_raw_ipc(batches)
    warm.run(batches)
    runs: dict[str, list[Timing]] = {"buffers": [], "raw": [], "warm": []}
    writer = None
    for _ in range(args.runs):
        timing, writer = run_buffers(batches, args.channels, args.segment_size, validate)
        runs["buffers"].append(timing)
        runs["raw"].append(run_raw_ipc(batches))
        runs["warm"].append(warm.run(batches))
    assert writer is not None
    wall = {name: statistics.median(t.wall for t in timings) for name, timings in runs.items()}
    cpu = {name: statistics.median(t.cpu for t in timings) for name, timings in runs.items()}
    mbs = {name: data_bytes / seconds / 1e6 for name, seconds in wall.items()}
    ratio = mbs["buffers"] / mbs["raw"]
    cpu_ratio = cpu["raw"] / cpu["buffers"]
    buffers = sum(writer.num_buffers_out)
    payload_bytes = sum(writer.num_bytes_out)
    ideal = math.ceil(data_bytes / args.segment_size)
    excess = buffers / ideal - 1

    print(f"{'path':<24}{'wall s':>9}{'MB/s':>8}{'CPU s':>9}   (medians; wall runs)")
    for name, label in (("buffers", "buffers write+read"), ("raw", "raw IPC stream"), ("warm", "raw IPC, warm sink")):
        walls = ", ".join(f"{t.wall:.3f}" for t in runs[name])
        print(f"{label:<24}{wall[name]:>9.3f}{mbs[name]:>8.0f}{cpu[name]:>9.3f}   ({walls})")
    print(
        f"ratio buffers / raw IPC: {ratio:.2f} wall-clock (target >= {TARGET_RATIO}), {cpu_ratio:.2f} in CPU time; "
        f"against the warm sink: {mbs['buffers'] / mbs['warm']:.2f} wall, {cpu['warm'] / cpu['buffers']:.2f} CPU"
    )
    print(
        f"buffers: {buffers:,}, ideal ceil(bytes / segment) = {ideal:,}, excess {excess:+.1%} "
        f"(target <= {TARGET_BUFFER_EXCESS:.0%}); payload bytes {payload_bytes / 1e6:.0f} MB, "
        f"mean fill {payload_bytes / buffers / args.segment_size:.1%}"
    )
    parts = breakdown(batches, args.channels, args.segment_size)
    print("Arrow work inside the buffers path, each step alone (s):")
    for name, seconds in parts.items():
        print(f"  {name:<26}{seconds:>8.3f}")
    floor = sum(parts.values())
    print(f"  {'sum':<26}{floor:>8.3f}   (raw IPC: {wall['raw']:.3f} wall, {cpu['raw']:.3f} CPU)")
    print(
        f"ratio this path could reach with no Python at all (raw IPC / Arrow work alone): {cpu['raw'] / floor:.2f}; "
        f"Python's share of the buffers path: {max(0.0, 1 - floor / cpu['buffers']):.0%}"
    )

    result = {
        "rows": args.rows,
        "bytes": data_bytes,
        "segment_size": args.segment_size,
        "channels": args.channels,
        "validate": validate,
        "buffers_s": round(wall["buffers"], 4),
        "raw_ipc_s": round(wall["raw"], 4),
        "buffers_mb_s": round(mbs["buffers"], 1),
        "raw_ipc_mb_s": round(mbs["raw"], 1),
        "raw_ipc_warm_sink_mb_s": round(mbs["warm"], 1),
        "ratio": round(ratio, 3),
        "ratio_cpu": round(cpu_ratio, 3),
        "ratio_warm_sink": round(mbs["buffers"] / mbs["warm"], 3),
        "buffers": buffers,
        "ideal_buffers": ideal,
        "buffer_excess": round(excess, 4),
        "arrow_floor_s": round(floor, 4),
        "ratio_ceiling_arrow_floor": round(cpu["raw"] / floor, 3),
        "meets_ratio": ratio >= TARGET_RATIO,
        "meets_ratio_cpu": cpu_ratio >= TARGET_RATIO,
        "meets_ratio_warm_sink": mbs["buffers"] / mbs["warm"] >= TARGET_RATIO,
        "meets_buffers": excess <= TARGET_BUFFER_EXCESS,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
