"""Benchmark: buffer hand-overs per second through the credit-based protocol core and the in-memory transport.

Topologies 1 -> 4 and 4 -> 4 (producer -> consumer subtasks, all-to-all): every producer has a
PipelinedResultPartition with one subpartition per consumer and its LocalBufferPool; every consumer a
SingleInputGate with one remote channel per producer, exclusive and floating buffers; every (consumer,
producer) pair its own MemoryConnection with server and client handlers (PartitionRequestQueue, readers,
credits, AddCredit, backlog). Producers write 32 KiB buffers round robin over their subpartitions while
their pool is available; consumers poll their gates and recycle each buffer at once. A *hand-over* is
one data buffer delivered to a consumer and recycled.

Two variants, each timed ``--runs`` times (median reported, after one warm-up); the runs of all cases are
interleaved, one of each per round in a rotated order, so every figure samples the same minutes of a
machine whose speed drifts:

* ``protocol``: the buffer's segment comes from the partition's pool (``request_segment``) and its 32 KiB
  payload is a ready bytes object in a complete buffer (its own consumer): this is the protocol's
  bookkeeping per buffer, which is what the target (>= 100,000 hand-overs per second) is about;
* ``byte_builder``: each buffer is written through a ``ByteBufferBuilder`` (two 32 KiB copies in and
  two out, as that test builder does), i.e. the bookkeeping plus the cost of filling a segment.

``--encode`` sends every message through the wire codec as well. ``--bytecodes`` also counts the bytecodes
executed and Python calls made per hand-over (traced, a few seconds): the figure to compare changes by on
a machine whose speed drifts, as the wall-clock rate can by 2x between minutes. The last line is one JSON
object with the headline figures. Example: ``python jobs/bench_protocol.py --buffers 20000 --runs 5``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time

from spark_credit_shuffle.buffers.buffer import Buffer, ByteBufferBuilder, DataType
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.protocol import (
    CreditBasedPartitionRequestClientHandler,
    NetworkBufferPool,
    PartitionRequestServerHandler,
    PipelinedResultPartition,
    ResultPartitionManager,
    SingleInputGate,
)
from spark_credit_shuffle.transport.in_memory import MemoryConnection

#: The target: protocol hand-overs per second.
TARGET = 100_000
SEGMENT = 32 * 1024


def run_exchange(
    num_producers: int, num_consumers: int, buffers_per_producer: int, *, variant: str, encode: bool = False
) -> tuple[int, float, float]:
    """Move ``buffers_per_producer`` buffers from every producer to the consumers.

    Returns (hand-overs, wall seconds, CPU seconds of this process)."""
    config = NetworkConfig(segment_size=SEGMENT, network_memory="512mb")
    network = NetworkBufferPool.from_config(config)
    manager = ResultPartitionManager()
    partitions = []
    for p in range(num_producers):
        partition = PipelinedResultPartition.create(network, num_consumers, config, partition_id=p)
        manager.register_partition(partition)
        partitions.append(partition)
    gates = []
    connections = []
    receiver_id = 0
    for _ in range(num_consumers):
        gate = SingleInputGate(network, num_producers, config)
        for p in range(num_producers):
            client = CreditBasedPartitionRequestClientHandler()
            server = PartitionRequestServerHandler(manager)
            receiver_id += 1
            gate.remote_channel(p, receiver_id, client, partition_id=p, subpartition=len(gates))
            connections.append(MemoryConnection(client, server, encode=encode))
        gates.append(gate)
    for gate in gates:
        gate.request_partitions()
    for connection in connections:
        connection.pump()

    payload = bytes(SEGMENT)
    remaining = [buffers_per_producer] * num_producers
    next_channel = [0] * num_producers
    delivered = 0
    total = buffers_per_producer * num_producers
    use_builder = variant == "byte_builder"
    data_buffer = DataType.DATA_BUFFER
    start = time.perf_counter()
    cpu_start = time.process_time()
    while delivered < total:
        for p, partition in enumerate(partitions):
            left = remaining[p]
            if not left:
                continue
            channel = next_channel[p]
            while left and partition.is_available():
                recycler = partition.request_segment(channel)
                if use_builder:
                    builder = ByteBufferBuilder(SEGMENT, recycler)
                    partition.add_consumer(channel, builder.create_buffer_consumer())
                    builder.append(payload)
                    builder.finish()
                else:
                    partition.add_consumer(channel, Buffer(data_buffer, payload, recycler))
                channel = channel + 1 if channel + 1 < num_consumers else 0
                left -= 1
            remaining[p] = left
            next_channel[p] = channel
            if not left:
                partition.finish()
                partition.close()
        for connection in connections:
            connection.pump()
        for gate in gates:
            for buffer, _, _, _ in iter(gate.poll_next, None):
                if buffer.data_type is data_buffer:
                    delivered += 1
                buffer.recycle()
        for connection in connections:
            connection.pump()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    for connection in connections:
        connection.pump()
    for gate in gates:
        while (boe := gate.poll_next()) is not None:
            boe.buffer.recycle()
    if not all(gate.is_finished for gate in gates):
        raise RuntimeError("benchmark exchange did not finish")
    for gate in gates:
        gate.close()
    for connection in connections:
        connection.pump()
    if network.num_available != network.total:
        raise RuntimeError(f"{network.total - network.num_available} network buffers were not returned")
    return delivered, elapsed, cpu


def count_bytecodes(topology: tuple[int, int], buffers: int = 4000) -> tuple[float, float]:
    """Bytecodes executed and Python calls made per hand-over in one ``protocol`` exchange (traced, so
    slow): a measure of the bookkeeping that does not depend on how fast the machine is at the moment."""
    producers, consumers = topology
    run_exchange(producers, consumers, 10, variant="protocol")  # imports and caches, outside the count
    counts = [0, 0]  # bytecodes, calls

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "opcode":
            counts[0] += 1
        elif event == "call":
            counts[1] += 1
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
        return tracer

    sys.settrace(tracer)
    try:
        delivered, _, _ = run_exchange(producers, consumers, max(1, buffers // producers), variant="protocol")
    finally:
        sys.settrace(None)
    return counts[0] / delivered, counts[1] / delivered


def calibration_seconds() -> float:
    """CPU seconds of a plain 10-million-step Python loop: compares this machine with others (a recent
    desktop core runs it in about 0.4 s)."""
    start = time.process_time()
    total = 0
    for i in range(10_000_000):
        total += i
    return time.process_time() - start


def measure(cases: list[tuple[str, tuple[int, int]]], buffers: int, runs: int, encode: bool) -> list[dict]:
    """Time every (variant, topology) case ``runs`` times, interleaved: each round runs every case once, in
    an order rotated by one per round, so that all cases see the same moments of a machine whose speed
    drifts. Returns one summary per case."""
    per_producer = {topology: max(1, buffers // topology[0]) for _, topology in cases}
    for variant, topology in cases:  # warm-up
        run_exchange(*topology, max(1, per_producer[topology] // 10), variant=variant, encode=encode)
    rates: dict[tuple[str, tuple[int, int]], list[float]] = {case: [] for case in cases}
    cpu_rates: dict[tuple[str, tuple[int, int]], list[float]] = {case: [] for case in cases}
    for round_index in range(runs):
        shift = round_index % len(cases)
        for case in cases[shift:] + cases[:shift]:
            variant, topology = case
            delivered, seconds, cpu = run_exchange(*topology, per_producer[topology], variant=variant, encode=encode)
            rates[case].append(delivered / seconds)
            cpu_rates[case].append(delivered / cpu if cpu > 0 else float("inf"))
    results = []
    for case in cases:
        variant, (producers, consumers) = case
        results.append(
            {
                "topology": f"{producers}->{consumers}",
                "variant": variant,
                "buffers": per_producer[(producers, consumers)] * producers,
                "median_handovers_per_s": statistics.median(rates[case]),
                "min_handovers_per_s": min(rates[case]),
                "max_handovers_per_s": max(rates[case]),
                "median_handovers_per_cpu_s": statistics.median(cpu_rates[case]),
                "median_mb_per_s": statistics.median(rates[case]) * SEGMENT / 1e6,
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buffers", type=int, default=40_000, help="buffers per run and topology (default 40000)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per figure; the median is reported")
    parser.add_argument("--encode", action="store_true", help="send every message through the wire codec too")
    parser.add_argument("--variants", default="protocol,byte_builder", help="comma-separated: protocol, byte_builder")
    parser.add_argument(
        "--bytecodes",
        action="store_true",
        help="also count bytecodes and Python calls per hand-over (traced; independent of the machine's speed)",
    )
    args = parser.parse_args(argv)
    if args.buffers < 1 or args.runs < 1:
        parser.error("--buffers and --runs must be >= 1")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - {"protocol", "byte_builder"}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; allowed: protocol, byte_builder")
    logging.basicConfig(level=logging.ERROR)

    calibration = calibration_seconds()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cores, load {load:.1f}, "
        f"calibration loop {calibration:.2f} s; {args.runs} runs, median, 32 KiB buffers"
    )
    cases = [(variant, topology) for variant in variants for topology in ((1, 4), (4, 4))]
    results = measure(cases, args.buffers, args.runs, args.encode)
    for result in results:
        print(
            f"{result['variant']:>12} {result['topology']}: {result['median_handovers_per_s']:>10,.0f} hand-overs/s "
            f"(min {result['min_handovers_per_s']:,.0f}, max {result['max_handovers_per_s']:,.0f}), "
            f"{result['median_mb_per_s']:,.0f} MB/s; per CPU second {result['median_handovers_per_cpu_s']:,.0f}"
        )
    bytecodes: dict[str, float] = {}
    calls: dict[str, float] = {}
    if args.bytecodes:
        for producers, consumers in ((1, 4), (4, 4)):
            name = f"{producers}->{consumers}"
            bytecodes[name], calls[name] = count_bytecodes((producers, consumers), min(4000, args.buffers))
            print(f"    protocol {name}: {bytecodes[name]:,.0f} bytecodes and {calls[name]:.1f} calls per hand-over")
    headline = {r["topology"]: round(r["median_handovers_per_s"]) for r in results if r["variant"] == "protocol"}
    summary = {
        "benchmark": "bench_protocol",
        "encode": args.encode,
        "target_handovers_per_s": TARGET,
        "protocol_handovers_per_s": headline,
        "byte_builder_handovers_per_s": {
            r["topology"]: round(r["median_handovers_per_s"]) for r in results if r["variant"] == "byte_builder"
        },
        "protocol_handovers_per_cpu_s": {
            r["topology"]: round(r["median_handovers_per_cpu_s"]) for r in results if r["variant"] == "protocol"
        },
        "meets_target": bool(headline) and min(headline.values()) >= TARGET,
        "calibration_loop_s": round(calibration, 3),
        "load_average": round(load, 2),
    }
    if args.bytecodes:
        summary["bytecodes_per_handover"] = {name: round(value) for name, value in bytecodes.items()}
        summary["calls_per_handover"] = {name: round(value, 1) for name, value in calls.items()}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
