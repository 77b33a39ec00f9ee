"""Checkpoint alignment demo: alignment time per checkpoint behind one slow consumer of a keyed exchange.

Two parts. **Simulation** (virtual clock, the real protocol core): 4 producers on 4 hosts feed 4 consumers
on 2 hosts all-to-all; consumer 0 reads at ``--sim-slow-rate`` (0.5 MB/s), the others 16 times faster.
Every ``--interval-ms`` each producer injects a barrier; the run is repeated with credit-based flow control
and with the pre-1.5 model without credits (a full receiver pauses its whole connection), aligned and
unaligned. **Spark** (pipelined mode, real TCP): ``--parallelism`` producers key their rows to as many
consumers, all of producer 0's rows on one hot key that goes to consumer 0, where a step chained into its task
sleeps ``--delay-ms`` per row; the exchange runs with aligned and with unaligned
barriers every ``--interval-ms``, ``--repeat`` rounds interleaved. The alignment time of a checkpoint is
Flink's ``checkpointAlignmentTime``: first barrier to last on a consumer subtask. Prints the tables, writes a
PNG with ``--png`` and ends with one JSON line of the headline figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from spark_credit_shuffle.cli import conf_pair, positive_int, require_plotting
from spark_credit_shuffle.jobs.common import slow_on

SIM_CASES = [(credit, unaligned) for credit in (True, False) for unaligned in (False, True)]


def _label(credit: bool, unaligned: bool) -> str:
    return f"{'credits' if credit else 'no credits'}, {'unaligned' if unaligned else 'aligned'}"


#: The simulated network, both flow-control models alike: a 10 Gbit/s link with 50 us one way (a LAN), and
#: the socket send + receive buffers of each connection (Linux autotunes them between about 16 KiB and
#: 4 MiB for sending, 6 MiB for receiving; 1 MiB is a middle value). The rest are Flink's defaults:
#: 32 KiB buffers, 2 exclusive per channel and 8 floating per gate, 10 per subpartition, one checkpoint
#: at a time.
SIM_BANDWIDTH = 1.25e9
SIM_LATENCY = 50e-6
SIM_SOCKET_BUFFER = 1 << 20
SWEEP_SOCKET_BUFFERS = (64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def slow_consumer_report(
    credit: bool,
    unaligned: bool,
    interval_ms: int,
    slow_rate: float,
    duration: float,
    socket_buffer_bytes: int = SIM_SOCKET_BUFFER,
    debloat_ms: int | None = None,
    sample_interval: float | None = None,
) -> Any:
    """The documented configuration, simulated (``debloat_ms``: buffer debloating to that target, else off):
    4 producers on 4 hosts, all-to-all to 4 consumers on 2 hosts,
    consumer 0 at ``slow_rate`` bytes/s and the others 16x faster, over :data:`SIM_BANDWIDTH` and
    :data:`SIM_LATENCY`; its SimulationReport."""
    from spark_credit_shuffle import NetworkConfig
    from spark_credit_shuffle.simulation import simulate

    config = NetworkConfig(
        credit_based=credit,
        checkpoint_interval_ms=interval_ms,
        unaligned_checkpoints=unaligned,
        buffer_debloat_enabled=debloat_ms is not None,
        buffer_debloat_target_ms=debloat_ms or 1000,
    )
    return simulate(
        config,
        num_producers=4,
        num_consumers=4,
        producer_rate=[4 * slow_rate, 6 * slow_rate, 8 * slow_rate, 10 * slow_rate],
        consumer_rate=[slow_rate] + [16 * slow_rate] * 3,
        duration=duration,
        producer_hosts=[0, 1, 2, 3],
        consumer_hosts=[4, 4, 5, 5],
        latency=SIM_LATENCY,
        bandwidth=SIM_BANDWIDTH,
        socket_buffer_bytes=socket_buffer_bytes,
        sample_interval=sample_interval,
    )


def second_half_throughput(report: Any, subtask: int, duration: float) -> float:
    """Consumer ``subtask``'s bytes per virtual second in the run's second half (the report sampled at half
    time): steady state, without the first seconds, in which the fast consumers take what the producers write
    while the slow consumer's in-flight data builds up (more of it without debloating)."""
    at_half = report.value_at("consumer", subtask, "numBytesIn", duration / 2)
    return (report.value("consumer", subtask, "numBytesIn") - at_half) / (duration / 2)


def simulate_case(
    credit: bool,
    unaligned: bool,
    interval_ms: int,
    slow_rate: float,
    duration: float,
    socket_buffer_bytes: int = SIM_SOCKET_BUFFER,
) -> dict[str, Any]:
    """One simulated run: mean alignment time and start delay (ms) per checkpoint of the slow consumer
    (subtask 0) and of the others, and how many checkpoints each side completed."""
    report = slow_consumer_report(credit, unaligned, interval_ms, slow_rate, duration, socket_buffer_bytes)
    records = report.checkpoint_records()
    slow = [c for c in records if c.subtask == 0]
    rest = [c for c in records if c.subtask != 0]
    return {
        "slow_ms": _mean([c.alignment_time_ms for c in slow]),
        "others_ms": _mean([c.alignment_time_ms for c in rest]),
        "all_ms": _mean([c.alignment_time_ms for c in (*slow, *rest)]),
        "slow_start_delay_ms": _mean([c.start_delay_ms for c in slow]),
        "slow_checkpoints": len(slow),
        "connection_pauses": report.connection_pauses,
    }


def simulated(interval_ms: int, slow_rate: float, duration: float) -> dict[tuple[bool, bool], dict[str, Any]]:
    """:func:`simulate_case` for credits / no credits x aligned / unaligned."""
    return {case: simulate_case(*case, interval_ms, slow_rate, duration) for case in SIM_CASES}


#: Buffer debloating targets the demo compares with debloating off (None), credits and aligned barriers.
DEBLOAT_TARGETS = (None, 1000, 100)


def debloat_cases(interval_ms: int, slow_rate: float, duration: float) -> dict[int | None, dict[str, float]]:
    """Aligned checkpoints with credits, debloating off and to each target: the slow consumer's start delay
    (mean and median of the checkpoints of the run's second half, once the size settled) and the fast
    consumers' mean throughput, over the whole run and in its second half (steady state)."""
    out: dict[int | None, dict[str, float]] = {}
    for target in DEBLOAT_TARGETS:
        report = slow_consumer_report(
            True, False, interval_ms, slow_rate, duration, debloat_ms=target, sample_interval=duration / 2
        )
        late = [c.start_delay_ms for c in report.checkpoint_records(0) if c.end_ms > duration / 2 * 1e3]
        fast = range(1, len(report.hosts["consumer"]))
        out[target] = {
            "start_delay_mean_ms": _mean(late),
            "start_delay_median_ms": statistics.median(late) if late else 0.0,
            "fast_throughput": _mean([report.value("consumer", c, "numBytesInPerSecond", stat="mean") for c in fast]),
            "fast_throughput_late": _mean([second_half_throughput(report, c, duration) for c in fast]),
        }
    return out


def socket_sweep(interval_ms: int, slow_rate: float, duration: float) -> dict[int, dict[bool, dict[str, Any]]]:
    """Aligned checkpoints with and without credits for each socket buffer size of the sweep."""
    return {
        size: {credit: simulate_case(credit, False, interval_ms, slow_rate, duration, size) for credit in (True, False)}
        for size in SWEEP_SOCKET_BUFFERS
    }


def checkpoint_times(ex: Any) -> dict[int, list[float]]:
    """Alignment times (ms) of the completed checkpoints per consumer subtask."""
    out: dict[int, list[float]] = {}
    for record in ex.checkpoint_records():
        out.setdefault(record.subtask, []).append(record.alignment_time_ms)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=positive_int, default=6000, help="rows per producer subtask (6,000)")
    parser.add_argument("--parallelism", type=positive_int, default=3, help="producers and consumers (3)")
    parser.add_argument("--delay-ms", type=float, default=0.5, help="consumer 0's sleep per row, ms (0.5)")
    parser.add_argument("--interval-ms", type=positive_int, default=100, help="checkpoint interval, ms (100)")
    parser.add_argument("--repeat", type=positive_int, default=1, help="rounds of aligned and unaligned (1)")
    parser.add_argument("--segment-size", default="4kb", help="network buffer size (4kb)")
    parser.add_argument("--sim-duration", type=float, default=60.0, help="virtual seconds per simulation (60)")
    parser.add_argument(
        "--sim-slow-rate", type=float, default=500_000.0, help="the simulated slow consumer, bytes/s (500,000)"
    )
    parser.add_argument("--skip-spark", action="store_true", help="only the simulation")
    parser.add_argument("--png", help="write a bar chart of the alignment times here")
    parser.add_argument("--master", help="Spark master under plain python (default local[4])")
    parser.add_argument(
        "--conf", action="append", type=conf_pair, default=[], metavar="KEY=VALUE", help="Spark or exchange setting"
    )
    args = parser.parse_args(argv)
    require_plotting(parser, "--png", args.png)
    if args.delay_ms <= 0:
        parser.error("--delay-ms: allowed is a delay > 0 ms")
    if not (args.sim_duration > 0 and args.sim_slow_rate > 0):
        parser.error("--sim-duration and --sim-slow-rate: allowed are values > 0")

    sim = simulated(args.interval_ms, args.sim_slow_rate, args.sim_duration)
    print(
        f"simulation ({args.sim_duration:g} virtual s, socket buffers {SIM_SOCKET_BUFFER >> 10} KiB, 10 Gbit/s, "
        "50 us): mean per checkpoint, ms"
    )
    print(
        f"{'case':<24} {'alignment: slow':>15} {'others':>8} {'all':>8} {'start delay: slow':>18} "
        f"{'slow done':>10} {'pauses':>7}"
    )
    for case, values in sim.items():
        print(
            f"{_label(*case):<24} {values['slow_ms']:>15.2f} {values['others_ms']:>8.2f} {values['all_ms']:>8.2f} "
            f"{values['slow_start_delay_ms']:>18.1f} {values['slow_checkpoints']:>10} {values['connection_pauses']:>7}"
        )
    sweep = socket_sweep(args.interval_ms, args.sim_slow_rate, args.sim_duration)
    print()
    print("simulation, aligned: the slow consumer's mean checkpointAlignmentTime (ms) by socket buffer size")
    print(f"{'socket buffers':<15} {'credits':>9} {'no credits':>11} {'ratio':>7}")
    for size, values in sweep.items():
        with_credits, without = values[True]["slow_ms"], values[False]["slow_ms"]
        ratio = f"{without / with_credits:>7.1f}" if with_credits else f"{'-':>7}"
        print(f"{f'{size >> 10} KiB':<15} {with_credits:>9.2f} {without:>11.2f} {ratio}")

    debloat = debloat_cases(args.interval_ms, args.sim_slow_rate, args.sim_duration)
    print()
    print("simulation, credits, aligned: buffer debloating against the slow consumer's start delay (second half)")
    print(f"{'debloating':<15} {'start delay mean':>17} {'median':>8} {'fast consumers: run':>20} {'second half':>12}")
    base = debloat[None]["fast_throughput"] or 1.0
    base_late = debloat[None]["fast_throughput_late"] or 1.0
    for target, values in debloat.items():
        label = "off" if target is None else f"target {target} ms"
        print(
            f"{label:<15} {values['start_delay_mean_ms']:>15.1f}ms {values['start_delay_median_ms']:>6.1f}ms "
            f"{values['fast_throughput'] / base:>19.3f}x {values['fast_throughput_late'] / base_late:>11.3f}x"
        )

    spark_results: dict[str, list[dict[int, list[float]]]] = {"aligned": [], "unaligned": []}
    if not args.skip_spark:
        import pyarrow as pa
        from pyspark.sql import functions as F

        import spark_credit_shuffle as scs
        from spark_credit_shuffle.cli import job_session

        spark, created = job_session(
            "spark_credit_shuffle checkpoint alignment demo", args.master or "local[4]", args.conf
        )
        n = args.parallelism
        # keyed, with a hot key: every row of producer 0 goes to consumer 0, so that channel carries far more
        # than consumer 0's other channels (its queue is deep when a barrier is injected, theirs shallow)
        max_parallelism = scs.default_max_parallelism(n)
        keys = pa.array(range(1000), pa.int32())
        hot = scs.key_group_channels(keys, n, max_parallelism).tolist().index(0)
        df = spark.range(0, n * args.rows, 1, n).select(
            F.col("id"),
            F.when(F.col("id") < args.rows, F.lit(hot)).otherwise(F.col("id") % 97).cast("int").alias("k"),
            F.lit("x" * 40).alias("payload"),
        )
        # the user's slow step, chained into consumer 0's task (its time is that consumer's busy time)
        slow = scs.map_in_pandas(slow_on(0, args.delay_ms / 1000.0), df.schema)
        cases = (("aligned", False), ("unaligned", True))
        runs = [case for _ in range(args.repeat) for case in cases]
        try:
            for step, (mode, unaligned) in enumerate(runs, 1):
                started = time.perf_counter()
                ex = scs.exchange(
                    df,
                    scs.key_by("k"),
                    parallelism=n,
                    mode="pipelined",
                    after=slow,
                    segment_size=args.segment_size,
                    checkpoint_interval_ms=args.interval_ms,
                    unaligned_checkpoints=unaligned,
                )
                count = ex.df.count()
                if count != n * args.rows:
                    raise RuntimeError(f"{mode}: {count} rows came out of {n * args.rows}")
                times = checkpoint_times(ex)
                spark_results[mode].append(times)
                done = sum(len(v) for v in times.values())
                print(
                    f"[{step}/{len(runs)}] spark {mode}: {count} rows in {time.perf_counter() - started:.2f} s, "
                    f"{done} checkpoints completed",
                    flush=True,
                )
        finally:
            if created:
                spark.stop()

    def values_of(mode: str, subtask: int | None) -> list[float]:
        return [
            t for times in spark_results[mode] for s, v in times.items() if subtask is None or s == subtask for t in v
        ]

    def mean_of(mode: str, subtask: int | None) -> float:
        values = values_of(mode, subtask)
        return statistics.fmean(values) if values else 0.0

    def median_of(mode: str, subtask: int | None) -> float:
        values = values_of(mode, subtask)
        return statistics.median(values) if values else 0.0

    headline: dict[str, Any] = {
        "interval_ms": args.interval_ms,
        "sim_aligned_credits_ms": round(sim[(True, False)]["all_ms"], 3),
        "sim_aligned_no_credits_ms": round(sim[(False, False)]["all_ms"], 3),
        "sim_unaligned_credits_ms": round(sim[(True, True)]["all_ms"], 3),
        "sim_unaligned_no_credits_ms": round(sim[(False, True)]["all_ms"], 3),
        "sim_slow_aligned_credits_ms": round(sim[(True, False)]["slow_ms"], 3),
        "sim_slow_aligned_no_credits_ms": round(sim[(False, False)]["slow_ms"], 3),
        "sim_slow_unaligned_credits_ms": round(sim[(True, True)]["slow_ms"], 3),
        "sim_slow_unaligned_no_credits_ms": round(sim[(False, True)]["slow_ms"], 3),
        "sim_slow_start_delay_credits_ms": round(sim[(True, False)]["slow_start_delay_ms"], 1),
        "sim_slow_start_delay_no_credits_ms": round(sim[(False, False)]["slow_start_delay_ms"], 1),
        "sim_socket_sweep_slow_aligned_ms": {
            size: [round(values[True]["slow_ms"], 3), round(values[False]["slow_ms"], 3)]
            for size, values in sweep.items()
        },
        "sim_debloat_slow_start_delay_ms": {
            str(target): round(values["start_delay_median_ms"], 1) for target, values in debloat.items()
        },
        "sim_debloat_fast_throughput_ratio": {
            str(target): round(values["fast_throughput"] / base, 3) for target, values in debloat.items()
        },
        "sim_debloat_fast_throughput_ratio_second_half": {
            str(target): round(values["fast_throughput_late"] / base_late, 3) for target, values in debloat.items()
        },
        "sim_debloat_slow_start_delay_mean_ms": {
            str(target): round(values["start_delay_mean_ms"], 1) for target, values in debloat.items()
        },
    }
    if not args.skip_spark:
        aligned_slow, unaligned_slow = mean_of("aligned", 0), mean_of("unaligned", 0)
        print()
        print("spark, pipelined: checkpointAlignmentTime per checkpoint, ms")
        print(f"{'barriers':<10} {'consumer 0 mean':>16} {'median':>8} {'all mean':>9} {'median':>8}")
        for mode in ("aligned", "unaligned"):
            print(
                f"{mode:<10} {mean_of(mode, 0):>16.2f} {median_of(mode, 0):>8.2f} {mean_of(mode, None):>9.2f} "
                f"{median_of(mode, None):>8.2f}"
            )
        headline.update(
            {
                # checkpoints the slow consumer completed: a mean of none is 0.0, as is a mean of zeros
                "spark_slow_checkpoints": {mode: len(values_of(mode, 0)) for mode in ("aligned", "unaligned")},
                "spark_aligned_slow_ms": round(aligned_slow, 3),
                "spark_unaligned_slow_ms": round(unaligned_slow, 3),
                "spark_aligned_slow_median_ms": round(median_of("aligned", 0), 3),
                "spark_unaligned_slow_median_ms": round(median_of("unaligned", 0), 3),
                "spark_aligned_all_ms": round(mean_of("aligned", None), 3),
                "spark_unaligned_all_ms": round(mean_of("unaligned", None), 3),
                "spark_aligned_over_unaligned_slow": round(aligned_slow / unaligned_slow, 2)
                if unaligned_slow
                else None,
            }
        )
    if args.png:
        from spark_credit_shuffle import plot

        categories = ["sim aligned", "sim unaligned"]
        series = {
            "credits": [sim[(True, False)]["all_ms"], sim[(True, True)]["all_ms"]],
            "no credits (simulation only)": [sim[(False, False)]["all_ms"], sim[(False, True)]["all_ms"]],
        }
        if not args.skip_spark:  # Spark's pipelined mode always has credits; its slow consumer 0
            categories += ["spark aligned (consumer 0)", "spark unaligned (consumer 0)"]
            series["credits"] += [mean_of("aligned", 0), mean_of("unaligned", 0)]
            series["no credits (simulation only)"] += [0.0, 0.0]
        fig = plot._figure_class()(figsize=(11, 3.8), layout="constrained")
        bars, lines = fig.subplots(1, 2, width_ratios=[3, 2])
        width = 0.8 / len(series)
        for k, (name, values) in enumerate(series.items()):
            bars.bar([i + (k - 0.5) * width for i in range(len(categories))], values, width, label=name)
        bars.set_xticks(range(len(categories)), categories, fontsize=7)
        bars.set_ylabel("alignment time per checkpoint, ms")
        bars.set_title("checkpointAlignmentTime, every consumer", fontsize=10)
        bars.grid(True, axis="y", alpha=0.3)
        bars.legend(fontsize=8)
        sizes = [size >> 10 for size in sweep]
        for credit, name in ((True, "credits"), (False, "no credits")):
            lines.plot(sizes, [v[credit]["slow_ms"] for v in sweep.values()], marker="o", label=name)
        lines.set_xscale("log", base=2)
        lines.set_xlabel("socket send + receive buffers, KiB")
        lines.set_ylabel("slow consumer, ms per checkpoint")
        lines.set_title("simulation, aligned: by socket buffer size", fontsize=10)
        lines.grid(True, alpha=0.3)
        lines.legend(fontsize=8)
        fig.savefig(args.png, dpi=110)
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
