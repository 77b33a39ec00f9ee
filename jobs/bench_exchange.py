"""Benchmark: the exchange next to Spark's own ``repartition``, measured in the same run.

Data: ``--rows`` rows (``a`` long, ``b`` int, ``c`` a 20-character string), generated deterministically,
cached in ``--parallelism`` partitions and materialised before anything is timed. Each case is one
action, ``write.format("noop")``, repeated ``--repeat`` times; the table shows the median:

- ``repartition``: ``df.repartition(P, "a")``;
- ``mapInArrow``: an identity ``mapInArrow`` alone, no shuffle: the hop into Python and back that any
  Python step pays, the floor of the streaming exchange;
- ``repartition + mapInArrow``: the same followed by an identity ``mapInArrow`` (what a user pays to get
  the rows into Python after Spark's own shuffle): the reference of the ratios;
- ``exchange core in place``: a ``mapInArrow`` whose tasks put their own rows through the pipelined exchange's
  Python core and back, in the task's own thread: the RecordWriter over ``key_by("a")``'s P channels into a
  pipelined result partition, a gate reading every subpartition, the RecordReaders (with the full validation
  of data from another process) and the output batching; no network, no threads, no rows move between tasks.
  The least a streaming exchange built on this core can cost, next to ``mapInArrow`` alone;
- ``exchange blocking``: ``exchange(df, key_by("a"), P, mode="blocking")``;
- ``exchange pipelined``: ``exchange(..., mode="pipelined")`` as it comes (its output placed by an
  identity shuffle of nested rows, so that Spark can retry the barrier stage);
- ``pipelined, streaming``: the same barrier stage writing straight into the sink (``retryable=False``);
- ``pipelined, streaming, deep``: the same with more buffers in flight per channel (``DEEP_BUFFERS``);
- ``pipelined, checkpoints``: the streaming form with aligned checkpoint barriers every
  ``CHECKPOINT_MS`` (100 ms); its throughput against the streaming form's must stay within 5%;
- ``pipelined, debloating``: the streaming form with buffer debloating on (``buffer_debloat_enabled``,
  Flink's defaults: target 1 s, period 200 ms); a healthy exchange's throughput with it against the
  streaming form's must stay within 5% (``DEBLOAT_COST``);
- ``exchange pipelined, TLS`` and ``pipelined, streaming, TLS``: the two forms with every connection of
  the exchange under mutual TLS (``ssl=True``, what a session with ``spark.network.crypto.enabled`` gets):
  the cost of encryption, next to the same forms without it.

Pipelined mode also gets a buffer-timeout sweep (0, 1, 10, 100 ms and -1) of the streaming form with a
latency marker every ``--marker-ms`` from every producer, printing throughput and the per-record latency
(p50, p99 of the markers: the worst task's), drawn into ``--png`` (``buffer_timeout_sweep.png``), and the
peak resident memory of a task at 1x (``--rows / 10``) and 10x (``--rows``) input, which must stay flat.

Beside each case's time it prints the CPU the case used, the JVM's and the Python workers' (from ``/proc``, on
Linux), and the headline ratios in CPU (``*_cpu_ratio``): on a shared machine one run's wall time moves by up
to 2x, the CPU much less (docs/benchmarks.md, "The floor under the pipelined path").

Then the same cases (no sweep) run again on two executors, Spark's ``local-cluster[2,2,2048]`` master in a
subprocess (``--cluster-master``; ``--no-cluster`` skips it), so that the channels between executors go
over TCP between processes of different executors; their headline figures come back prefixed ``cluster_``.

Run ``python jobs/bench_exchange.py --mode pipelined --rows 1000000 --repeat 1 --no-cluster`` for a quick
check; ``--checkpoint-cost`` runs only the streaming and checkpointed cases (and prints the checkpoints'
alignment figures); ``--debloat-cost`` only the streaming and debloating cases (and prints the buffer sizes the
consumers announced); ``--tls-cost`` only the two pipelined forms with TLS and without (and the tasks' CPU);
``--headline-cases`` only the cases of the three headline ratios (no sweep).
The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from spark_credit_shuffle.cli import conf_pair, require_plotting
from spark_credit_shuffle.jobs.common import (
    TARGET_STREAMING_VS_MAP,
    bench_session,
    cached_rows,
    metric_rows,
    noop,
    process_tree_cpu,
    rotated,
    timed,
    worst,
)

#: Targets: pipelined throughput (retryable, the default) >= 1.0x repartition + identity mapInArrow;
#: streaming >= 0.88x identity mapInArrow alone (TARGET_STREAMING_VS_MAP, jobs.common); blocking at most 1.0x
#: the time of repartition + mapInArrow;
#: 1 ms keeps >= 90% of the 100 ms throughput; a task's peak memory within 10% at 10x the input.
TARGET_PIPELINED = 1.0
TARGET_TIMEOUT_RATIO = 0.9
TARGET_MEMORY_GROWTH = 0.10
TARGET_BLOCKING_TIME = 1.0
#: The cases of the three headline ratios (``--headline-cases``).
HEADLINE_CASES = (
    "mapInArrow",
    "repartition + mapInArrow",
    "exchange blocking",
    "exchange pipelined",
    "pipelined, streaming",
)
#: The two-executor case: two workers of two cores and 2 GiB each (Spark's own test master).
CLUSTER_MASTER = "local-cluster[2,2,2048]"
SWEEP = (0, 1, 10, 100, -1)
#: More buffers in flight per channel than Flink's defaults (2 exclusive, 8 floating, 10 per subpartition):
#: a channel's throughput is its buffers in flight over the credit round trip, which between Python
#: processes on a busy machine is milliseconds, not Flink's microseconds.
DEEP_BUFFERS = {"buffers_per_channel": 16, "floating_buffers_per_gate": 128, "max_buffers_per_channel": 128}
#: Checkpoint barriers every this many ms in the checkpointed case, and the throughput they may cost.
CHECKPOINT_MS = 100
CHECKPOINT_COST = 0.05
#: The throughput buffer debloating may cost a healthy exchange.
DEBLOAT_COST = 0.05


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("blocking", "pipelined", "both"), default="both")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--parallelism", type=int, default=4)
    parser.add_argument("--master", default=None, help="Spark master when not under spark-submit (local[P])")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--marker-ms", type=int, default=10, help="latency marker interval in the sweep")
    parser.add_argument("--driver-memory", default="4g", help="when this script starts the JVM")
    parser.add_argument("--no-sweep", action="store_true", help="skip the buffer-timeout sweep and memory runs")
    parser.add_argument("--no-cluster", action="store_true", help="skip the two-executor run")
    parser.add_argument(
        "--cluster-master", default=CLUSTER_MASTER, help="master of the two-executor run (a subprocess)"
    )
    parser.add_argument("--executor-memory", default="1g", help="per executor, on a local-cluster master")
    parser.add_argument(
        "--conf", action="append", type=conf_pair, default=[], metavar="KEY=VALUE", help="Spark or exchange setting"
    )
    parser.add_argument(
        "--checkpoint-cost",
        action="store_true",
        help="only the pipelined streaming and checkpointed cases (no sweep): the cost of checkpoint barriers",
    )
    parser.add_argument(
        "--debloat-cost",
        action="store_true",
        help="only the pipelined streaming and debloating cases (no sweep): the cost of buffer debloating",
    )
    parser.add_argument(
        "--tls-cost",
        action="store_true",
        help="only the pipelined cases with TLS and without (no sweep): the cost of encrypting the exchange",
    )
    parser.add_argument(
        "--headline-cases",
        action="store_true",
        help="only the cases of the three headline ratios (mapInArrow alone, repartition + mapInArrow, blocking, "
        "pipelined retryable and streaming; no sweep): the quick way to compare two versions of the exchange",
    )
    parser.add_argument(
        "--png",
        default="buffer_timeout_sweep.png",
        help="where the sweep's picture goes (throughput and latency against the timeout); '' for none",
    )
    args = parser.parse_args(argv)
    require_plotting(parser, "--png", args.png)
    if args.rows < 10 or args.parallelism < 1 or args.repeat < 1:
        parser.error("--rows must be >= 10, --parallelism and --repeat >= 1")
    if args.checkpoint_cost:
        if args.mode == "blocking":
            parser.error("--checkpoint-cost: checkpoint barriers are timed in pipelined mode, not --mode blocking")
        args.mode, args.no_sweep = "pipelined", True
    if args.debloat_cost:
        if args.mode == "blocking" or args.checkpoint_cost:
            parser.error("--debloat-cost: buffer debloating is timed in pipelined mode, alone")
        args.mode, args.no_sweep = "pipelined", True
    if args.tls_cost:
        if args.mode == "blocking" or args.checkpoint_cost or args.debloat_cost:
            parser.error("--tls-cost: TLS is timed in pipelined mode, alone")
        args.mode, args.no_sweep = "pipelined", True
    if args.headline_cases:
        if args.checkpoint_cost or args.debloat_cost or args.tls_cost:
            parser.error("--headline-cases: runs the headline cases alone")
        args.no_sweep = True
    return args


def session(args: argparse.Namespace) -> tuple[Any, bool]:
    """The SparkSession: spark-submit's, or a local one this script starts (and so stops)."""
    return bench_session(
        "bench_exchange",
        args.master or f"local[{args.parallelism}]",
        driver_memory=args.driver_memory,
        executor_memory=args.executor_memory,
        shuffle_partitions=args.parallelism,
        conf=args.conf,
    )


def print_cpu(cpu_s: dict[str, dict[str, float]], headline: dict[str, Any]) -> None:
    """The CPU each case used (medians of its runs; JVM and Python workers) and the CPU ratios of the targets:
    what each case costs, less moved by the machine's other work than its wall time."""
    totals = {name: used["jvm"] + used["python"] for name, used in cpu_s.items()}
    print(f"\n{'CPU per run (s, medians)':<28} {'JVM':>7} {'Python':>7} {'total':>7}")
    for name, used in cpu_s.items():
        print(f"{name:<28} {used['jvm']:7.2f} {used['python']:7.2f} {totals[name]:7.2f}")
        key = name.replace(" ", "_").replace(",", "").replace("+", "plus")
        headline[f"cpu_s_{key}"] = round(totals[name], 3)
        headline[f"cpu_python_s_{key}"] = round(used["python"], 3)
    reference = totals.get("repartition + mapInArrow")
    pairs = (  # (headline key, what it says, numerator case, denominator case)
        ("blocking_cpu_ratio", "blocking, CPU against repartition + mapInArrow", "exchange blocking", None),
        ("pipelined_retryable_cpu_ratio", "pipelined retryable, CPU against the reference", "exchange pipelined", None),
        (
            "pipelined_streaming_cpu_ratio",
            "pipelined streaming, CPU against the reference",
            "pipelined, streaming",
            None,
        ),
        (
            "pipelined_streaming_vs_mapinarrow_cpu_ratio",
            "pipelined streaming, CPU against mapInArrow alone",
            "pipelined, streaming",
            "mapInArrow",
        ),
    )
    for key, text, case, against in pairs:
        used, base = totals.get(case), (totals.get(against) if against else reference)
        if used is not None and base:
            headline[key] = round(used / base, 3)
            print(f"  {text}: {used / base:.2f}x")


def tls_cost(results: dict[str, tuple[float, list[float]]], plain_cpu: list[float], tls_cpu: list[float]) -> dict:
    """Throughput with TLS against without, for both pipelined forms, and the streaming tasks' CPU time."""
    out: dict[str, float] = {}
    for form, key in (("exchange pipelined", "retryable"), ("pipelined, streaming", "streaming")):
        ratio = results[form][0] / results[f"{form}, TLS"][0]
        out[f"pipelined_{key}_tls_throughput_ratio"] = round(ratio, 3)
        print(f"{form}: with TLS {ratio:.2f}x the throughput without")
    plain = statistics.median(plain_cpu[1:] or plain_cpu) / 1000.0  # the warm-up run left out
    tls = statistics.median(tls_cpu[1:] or tls_cpu) / 1000.0
    out["pipelined_streaming_task_cpu_s"] = round(plain, 3)
    out["pipelined_streaming_tls_task_cpu_s"] = round(tls, 3)
    print(f"the streaming tasks' CPU time (taskCpuTimeMs, all tasks): {plain:.2f} s without TLS, {tls:.2f} s with")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spark, created = session(args)
    import spark_credit_shuffle as scs
    from spark_credit_shuffle.runtime import pipelined

    p = args.parallelism
    df = cached_rows(spark, args.rows, p)
    data_bytes = args.rows * (8 + 4 + 20)
    modes = ("blocking", "pipelined") if args.mode == "both" else (args.mode,)

    def identity(batches):  # nested: pickled by value, so workers need not import this script
        yield from batches

    core_plan = scs.exchange(df, scs.key_by("a"), p, mode="pipelined").plan

    def in_place(batches):  # the "exchange core in place" case: the pipelined core in the task's own thread
        import pyarrow as pa

        from spark_credit_shuffle.buffers.reader import RecordReader
        from spark_credit_shuffle.buffers.writer import RecordWriter
        from spark_credit_shuffle.engine import OutputBatcher
        from spark_credit_shuffle.protocol import NetworkBufferPool, PipelinedResultPartition, SingleInputGate

        config, n, schema = core_plan.config, core_plan.num_consumers, core_plan.schema
        network = NetworkBufferPool.from_config(config)
        partition = PipelinedResultPartition.create(network, n, config)
        gate = SingleInputGate(network, n, config)
        for channel in range(n):  # one channel per subpartition, each read as a remote consumer reads it
            gate.local_channel(channel, partition, subpartition=channel)
        gate.request_partitions()
        selector = core_plan.partitioner.selector(0, 1, n, core_plan.max_parallelism)
        writer = RecordWriter(partition, selector, config.segment_size, schema=schema, resumable=True)
        readers = [RecordReader(schema, channel=c, validate=True) for c in range(n)]
        output = OutputBatcher(8192, 0.0)

        def drain():
            while (polled := gate.poll_next()) is not None:
                for item in readers[polled.channel_index].feed(polled.buffer, polled.sequence_number):
                    if isinstance(item, pa.RecordBatch):
                        output.add(item)
                ready = output.ready(polled.more_available, 0.0)
                if ready is not None:
                    yield ready

        for batch in batches:
            done = writer.emit(batch)
            yield from drain()
            while not done:  # the pool ran out: the consumers above returned its buffers
                done = writer.resume()
                yield from drain()
        writer.finish()
        partition.close()
        yield from drain()
        if output.pending:
            yield output.take()
        assert gate.is_finished, "every channel reads its end of partition"

    cases: list[tuple[str, Callable[[], Any]]] = [
        ("repartition", lambda: noop(df.repartition(p, "a"))),
        ("mapInArrow", lambda: noop(df.mapInArrow(identity, df.schema))),
        ("repartition + mapInArrow", lambda: noop(df.repartition(p, "a").mapInArrow(identity, df.schema))),
        ("exchange core in place", lambda: noop(df.mapInArrow(in_place, df.schema))),
    ]
    if "blocking" in modes:
        cases.append(("exchange blocking", lambda: noop(scs.exchange(df, scs.key_by("a"), p, mode="blocking").df)))
    if "pipelined" in modes:
        streaming_cpu: list[float] = []
        tls_cpu: list[float] = []

        def streaming(tls: bool = False) -> None:
            ex = scs.exchange(df, scs.key_by("a"), p, mode="pipelined", ssl=tls)
            assert ex.plan.tls == tls
            out, collected = pipelined.build(ex.plan, df, retryable=False)
            noop(out)
            cpu = sum(r["value"] for r in metric_rows(collected) if r["metric"] == "taskCpuTimeMs")
            (tls_cpu if tls else streaming_cpu).append(cpu)

        def deep() -> None:
            ex = scs.exchange(df, scs.key_by("a"), p, mode="pipelined", **DEEP_BUFFERS)
            noop(pipelined.build(ex.plan, df, retryable=False)[0])

        checkpoint_metrics: list[Any] = []

        def checkpointed() -> None:  # aligned checkpoint barriers every 100 ms (Flink's default alignment)
            ex = scs.exchange(df, scs.key_by("a"), p, mode="pipelined", checkpoint_interval_ms=CHECKPOINT_MS)
            out, collected = pipelined.build(ex.plan, df, retryable=False)
            noop(out)
            checkpoint_metrics.append(collected)

        debloat_metrics: list[Any] = []

        def debloated() -> None:  # buffer debloating on, Flink's defaults otherwise
            ex = scs.exchange(df, scs.key_by("a"), p, mode="pipelined", buffer_debloat_enabled=True)
            out, collected = pipelined.build(ex.plan, df, retryable=False)
            noop(out)
            debloat_metrics.append(collected)

        cases.append(("exchange pipelined", lambda: noop(scs.exchange(df, scs.key_by("a"), p, mode="pipelined").df)))
        cases.append(("pipelined, streaming", streaming))
        cases.append(("pipelined, checkpoints", checkpointed))
        cases.append(("pipelined, debloating", debloated))
        cases.append(("pipelined, streaming, deep", deep))
        cases.append(
            (
                "exchange pipelined, TLS",
                lambda: noop(scs.exchange(df, scs.key_by("a"), p, mode="pipelined", ssl=True).df),
            )
        )
        cases.append(("pipelined, streaming, TLS", lambda: streaming(tls=True)))
    if args.checkpoint_cost:
        cases = [case for case in cases if case[0] in ("pipelined, streaming", "pipelined, checkpoints")]
    if args.debloat_cost:
        cases = [case for case in cases if case[0] in ("pipelined, streaming", "pipelined, debloating")]
    if args.tls_cost:
        tls_cases = (
            "exchange pipelined",
            "pipelined, streaming",
            "exchange pipelined, TLS",
            "pipelined, streaming, TLS",
        )
        cases = [case for case in cases if case[0] in ("mapInArrow", *tls_cases)]
    if args.headline_cases:
        cases = [case for case in cases if case[0] in HEADLINE_CASES]

    print(
        f"{args.rows:,} rows ({data_bytes / 1e6:.0f} MB of values), parallelism {p}, {spark.conf.get('spark.master')}"
    )
    for _, action in cases:  # warm-up: Python workers started, code loaded
        action()
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    cpu_used: dict[str, list[dict[str, float]]] = {name: [] for name, _ in cases}
    for round_ in range(args.repeat):  # interleaved and rotated: see rotated()
        for name, action in rotated(cases, round_):
            before = process_tree_cpu()
            times[name].append(timed(action, 1)[0])
            after = process_tree_cpu()
            if before is not None and after is not None:
                cpu_used[name].append({k: after[k] - before[k] for k in after})
    results = {name: (statistics.median(ts), ts) for name, ts in times.items()}
    for name, (median, ts) in results.items():
        print(f"  {name:<28} median {median:7.2f} s   runs {', '.join(f'{t:.2f}' for t in ts)}", flush=True)
    cpu_s = {
        name: {k: statistics.median(run[k] for run in runs) for k in ("jvm", "python")}
        for name, runs in cpu_used.items()
        if runs
    }

    headline: dict[str, Any] = {"rows": args.rows, "parallelism": p, "master": spark.conf.get("spark.master")}
    headline.update(
        {f"seconds_{k.replace(' ', '_').replace(',', '').replace('+', 'plus')}": v[0] for k, v in results.items()}
    )
    if args.checkpoint_cost:
        headline.update(checkpoint_cost(results, metric_rows(checkpoint_metrics[-1])))
        print(json.dumps(headline, sort_keys=True))
        return 0
    if args.debloat_cost:
        headline.update(debloat_cost(results, metric_rows(debloat_metrics[-1])))
        print(json.dumps(headline, sort_keys=True))
        return 0
    if "pipelined" in modes and "exchange pipelined, TLS" in results:
        headline.update(tls_cost(results, streaming_cpu, tls_cpu))
    if args.tls_cost:
        print(json.dumps(headline, sort_keys=True))
        return 0
    reference = results["repartition + mapInArrow"][0]
    print(f"\n{'case':<28} {'median s':>9} {'rows/s':>12} {'MB/s':>8} {'vs repartition+mapInArrow':>26}")
    for name, (median, _) in results.items():
        print(
            f"{name:<28} {median:9.2f} {args.rows / median:12,.0f} {data_bytes / median / 1e6:8.1f} "
            f"{reference / median:25.2f}x"
        )
    if cpu_s:
        print_cpu(cpu_s, headline)
    if "blocking" in modes:
        blocking_time = results["exchange blocking"][0] / reference
        headline["blocking_time_ratio"] = round(blocking_time, 3)
        print(
            f"\nblocking: {blocking_time:.2f}x the time of repartition + mapInArrow (target <= {TARGET_BLOCKING_TIME}x)"
        )
    if "pipelined" in modes:
        streaming_ratio = reference / results["pipelined, streaming"][0]
        default_ratio = reference / results["exchange pipelined"][0]
        vs_map = results["mapInArrow"][0] / results["pipelined, streaming"][0]
        headline["pipelined_streaming_vs_mapinarrow_throughput_ratio"] = round(vs_map, 3)
        headline["pipelined_throughput_ratio"] = round(streaming_ratio, 3)
        headline["pipelined_retryable_throughput_ratio"] = round(default_ratio, 3)
        deep = ""
        if "pipelined, streaming, deep" in results:
            deep_ratio = reference / results["pipelined, streaming, deep"][0]
            headline["pipelined_deep_buffers_throughput_ratio"] = round(deep_ratio, 3)
            deep = f", {deep_ratio:.2f}x streaming with {DEEP_BUFFERS}"
        if checkpoint_metrics:
            headline.update(checkpoint_cost(results, metric_rows(checkpoint_metrics[-1])))
        if debloat_metrics:
            headline.update(debloat_cost(results, metric_rows(debloat_metrics[-1])))
        print(
            f"\npipelined throughput: {streaming_ratio:.2f}x repartition + mapInArrow streaming into the sink, "
            f"{default_ratio:.2f}x with its retryable output{deep} "
            f"(target >= {TARGET_PIPELINED}x for the retryable default)"
        )
        print(
            f"pipelined streaming: {vs_map:.2f}x the throughput of an identity mapInArrow alone "
            f"(target >= {TARGET_STREAMING_VS_MAP}x)"
        )
        cpu = statistics.median(streaming_cpu[1:] or streaming_cpu) / 1000.0  # the warm-up run left out
        headline["pipelined_streaming_task_cpu_s"] = round(cpu, 3)
        print(f"  the streaming tasks' CPU time (taskCpuTimeMs, all tasks): {cpu:.2f} s")
        if "exchange core in place" in results:
            core_vs_map = results["mapInArrow"][0] / results["exchange core in place"][0]
            headline["core_in_place_vs_mapinarrow_throughput_ratio"] = round(core_vs_map, 3)
            print(
                f"  the pipelined exchange's Python core on each task's own rows, in its own thread (RecordWriter, "
                f"partition, gate, RecordReaders; no network, no threads): {core_vs_map:.2f}x mapInArrow alone, "
                f"the most this core allows"
            )
        if not args.no_sweep:
            headline.update(sweep(spark, df, args, data_bytes))
            headline.update(memory(spark, args))
    if created:  # started here: stopped here, before the cluster's JVMs start
        spark.stop()
    if not args.no_cluster and not args.master:
        headline.update({f"cluster_{k}": v for k, v in cluster(args).items()})
    print(json.dumps(headline, sort_keys=True))
    return 0


def cluster(args: argparse.Namespace) -> dict[str, Any]:
    """The same cases on two executors (``--cluster-master``, a subprocess of this script): its headline."""
    import subprocess

    print(f"\ntwo executors: {args.cluster_master}", flush=True)
    command = [
        sys.executable, __file__, "--master", args.cluster_master, "--no-sweep", "--no-cluster",
        "--mode", args.mode, "--rows", str(args.rows), "--parallelism", str(args.parallelism),
        "--repeat", str(args.repeat), "--driver-memory", args.driver_memory, "--png", "",
    ]  # fmt: skip
    if args.headline_cases:  # the same cases on both masters
        command.append("--headline-cases")
    for key, value in args.conf:
        command += ["--conf", f"{key}={value}"]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as child:
        assert child.stdout is not None
        lines = []
        for line in child.stdout:
            print("  " + line, end="", flush=True)
            lines.append(line)
    if child.returncode != 0 or not lines:
        raise SystemExit(f"the two-executor run ({args.cluster_master}) failed with exit code {child.returncode}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def checkpoint_cost(results: dict[str, tuple[float, list[float]]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The checkpointed case's throughput against the streaming case's, and the alignment figures of the
    last checkpointed run (``rows``: its metric rows)."""
    share = results["pipelined, streaming"][0] / results["pipelined, checkpoints"][0]
    print(
        f"pipelined with aligned checkpoint barriers every {CHECKPOINT_MS} ms: {share:.1%} of the "
        f"throughput without (target >= {1 - CHECKPOINT_COST:.0%})"
    )

    def values(metric: str, stat: str) -> list[float]:
        return [r["value"] for r in rows if r["side"] == "consumer" and r["metric"] == metric and r["stat"] == stat]

    alignment = values("checkpointAlignmentTime", "mean")
    delay = values("checkpointStartDelayNanos", "mean")
    completed, failed = values("numberOfCompletedCheckpoints", "total"), values("numberOfFailedCheckpoints", "total")
    figures = {
        "pipelined_checkpoints_throughput_share": round(share, 3),
        "checkpoint_alignment_ms_mean": round(statistics.fmean(alignment) / 1e6, 3) if alignment else None,
        "checkpoint_start_delay_ms_mean": round(statistics.fmean(delay) / 1e6, 3) if delay else None,
        "checkpoints_completed": sum(completed),
        "checkpoints_failed": sum(failed),
    }
    print(
        f"  last checkpointed run, per consumer subtask: alignment {figures['checkpoint_alignment_ms_mean']} ms "
        f"and start delay {figures['checkpoint_start_delay_ms_mean']} ms (means), "
        f"{figures['checkpoints_completed']:.0f} checkpoints completed and {figures['checkpoints_failed']:.0f} aborted"
    )
    return figures


def debloat_cost(results: dict[str, tuple[float, list[float]]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The debloating case's throughput against the streaming case's: the ratio of the medians and the median
    of the ratios of each round's pair (the two ran next to each other); the buffer sizes the consumers of
    the last debloating run announced (``rows``: its metric rows)."""
    streaming, debloating = results["pipelined, streaming"], results["pipelined, debloating"]
    share = streaming[0] / debloating[0]
    paired = statistics.median(s / d for s, d in zip(streaming[1], debloating[1], strict=True))
    sizes = [
        r["value"]
        for r in rows
        if r["side"] == "consumer" and r["metric"] == "debloatedBufferSize" and r["stat"] == "mean"
    ]
    print(
        f"pipelined with buffer debloating (target 1 s): {share:.1%} of the throughput without by the medians, "
        f"{paired:.1%} by the median of the paired runs (target >= {1 - DEBLOAT_COST:.0%}); "
        f"mean debloatedBufferSize per consumer: {', '.join(f'{v:.0f}' for v in sizes) or '-'} bytes"
    )
    return {
        "pipelined_debloat_throughput_share": round(share, 3),
        "pipelined_debloat_throughput_share_paired": round(paired, 3),
        "debloated_buffer_size_mean": round(statistics.fmean(sizes)) if sizes else None,
    }


def run_streaming(df: Any, rows: int, p: int, timeout_ms: int, marker_ms: int) -> tuple[float, list[dict[str, Any]]]:
    """One streaming pipelined exchange with latency markers: (seconds, metric rows)."""
    import spark_credit_shuffle as scs
    from spark_credit_shuffle.runtime import pipelined

    ex = scs.exchange(df, scs.key_by("a"), p, mode="pipelined", buffer_timeout_ms=timeout_ms)
    options = pipelined.TaskOptions(latency_interval_ms=marker_ms)
    out, collected = pipelined.build(ex.plan, df, retryable=False, options=options)
    started = time.perf_counter()
    noop(out)
    seconds = time.perf_counter() - started
    return seconds, metric_rows(collected)


def sweep(spark: Any, df: Any, args: argparse.Namespace, data_bytes: int) -> dict[str, Any]:
    """Throughput and marker latency for each buffer timeout."""
    p = args.parallelism
    print(f"\nbuffer-timeout sweep (pipelined, streaming, a latency marker every {args.marker_ms} ms per producer)")
    print(f"{'timeout ms':>10} {'median s':>9} {'MB/s':>8} {'latency p50 ms':>15} {'p99 ms':>9} {'markers':>8}")
    out: dict[str, Any] = {}
    throughput: dict[int, float] = {}
    run_streaming(df, args.rows, p, 100, args.marker_ms)  # warm-up
    all_runs: dict[int, list[tuple[float, list[dict[str, Any]]]]] = {t: [] for t in SWEEP}
    for round_ in range(args.repeat):  # interleaved and rotated: see rotated()
        for timeout_ms in rotated(list(SWEEP), round_):
            all_runs[timeout_ms].append(run_streaming(df, args.rows, p, timeout_ms, args.marker_ms))
    for timeout_ms in SWEEP:
        runs = all_runs[timeout_ms]
        seconds = statistics.median(r[0] for r in runs)
        rows = runs[[r[0] for r in runs].index(sorted(r[0] for r in runs)[len(runs) // 2])][1]
        p50, p99 = worst(rows, "latencyMs", "p50"), worst(rows, "latencyMs", "p99")
        markers = sum(r["value"] for r in rows if r["metric"] == "numLatencyMarkersIn")
        throughput[timeout_ms] = data_bytes / seconds
        print(
            f"{timeout_ms:>10} {seconds:9.2f} {data_bytes / seconds / 1e6:8.1f} "
            f"{p50 or 0:15.2f} {p99 or 0:9.2f} {markers:8.0f}"
        )
        out[f"sweep_{timeout_ms}ms"] = {"seconds": round(seconds, 3), "p50_ms": p50, "p99_ms": p99}
    ratio = throughput[1] / throughput[100]
    out["timeout_1ms_vs_100ms_throughput"] = round(ratio, 3)
    print(f"1 ms keeps {ratio:.0%} of the 100 ms throughput (target >= {TARGET_TIMEOUT_RATIO:.0%})")
    if args.png:
        from spark_credit_shuffle.plot import plot_timeout_sweep

        plot_timeout_sweep(
            list(SWEEP),
            [throughput[t] / 1e6 for t in SWEEP],
            [out[f"sweep_{t}ms"]["p50_ms"] for t in SWEEP],
            [out[f"sweep_{t}ms"]["p99_ms"] for t in SWEEP],
            title=f"buffer timeout sweep: {args.rows:,} rows, parallelism {p}, pipelined",
            path=args.png,
        )
        out["sweep_png"] = args.png
        print(f"sweep picture: {args.png}")
    return out


def memory(spark: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Peak resident memory of a task (the worst task) at 1x and 10x input."""
    p = args.parallelism
    small_rows = max(10, args.rows // 10)
    peaks = {}
    for label, rows in (("1x", small_rows), ("10x", args.rows)):
        data = cached_rows(spark, rows, p)
        run_streaming(data, rows, p, 100, 0)  # warm the workers on this input
        _, metrics = run_streaming(data, rows, p, 100, 0)
        peaks[label] = (
            worst(metrics, "taskRssBytes", "max") or 0.0,
            worst(metrics, "taskArrowAllocatedBytes", "max") or 0.0,
        )
        data.unpersist()
    growth = peaks["10x"][0] / peaks["1x"][0] - 1 if peaks["1x"][0] else float("nan")
    print(
        f"\npeak task memory (worst task, pipelined, streaming): {small_rows:,} rows (1x) vs {args.rows:,} rows (10x)"
    )
    for label in ("1x", "10x"):
        rss, arrow = peaks[label]
        print(f"  {label:>3}: resident {rss / 2**20:8.1f} MiB, Arrow allocated {arrow / 2**20:7.1f} MiB")
    print(f"  growth {growth:+.1%} (target within {TARGET_MEMORY_GROWTH:.0%})")
    return {
        "task_peak_rss_mib_1x": round(peaks["1x"][0] / 2**20, 1),
        "task_peak_rss_mib_10x": round(peaks["10x"][0] / 2**20, 1),
        "task_peak_rss_growth": round(growth, 4),
    }


if __name__ == "__main__":
    sys.exit(main())
