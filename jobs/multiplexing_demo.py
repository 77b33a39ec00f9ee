"""Multiplexing demo on a virtual clock: one slow receiver, with and without credit-based flow control.

Two producer subtasks on one host feed two consumer subtasks on another (forward edges), and both
channels share ONE connection, as Flink multiplexes every channel between two task managers over one
TCP connection. Consumer 0 is slow. Without credits (Flink before 1.5) a buffer that finds no free
buffer at the receiver stops the whole connection, so the neighbour, consumer 1, is cut to the slow
one's pace. With credits a sender only sends what the receiver has room for, the connection never
stops, and the neighbour keeps its throughput. This runs the real protocol core on virtual time
(deterministic, independent of the machine; no Spark needed).

Prints one progress line per run, the throughput table, writes a PNG (bars per consumer, with and
without credits), and as its last line one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MB = 1_000_000


def _rate(text: str) -> float:
    """'2' or '2MB' -> 2e6 bytes per second."""
    value = text.strip().lower().removesuffix("/s").removesuffix("mb").strip()
    try:
        rate = float(value) * MB
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid rate {text!r}: allowed is MB per second, e.g. 2 or 2MB") from None
    if rate <= 0:
        raise argparse.ArgumentTypeError(f"invalid rate {text!r}: allowed is a rate > 0")
    return rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slow-rate", type=_rate, default=2 * MB, help="slow consumer, MB per second (2)")
    parser.add_argument("--fast-rate", type=_rate, default=40 * MB, help="the other consumer, MB per second (40)")
    parser.add_argument("--producer-rate", type=_rate, default=50 * MB, help="each producer, MB per second (50)")
    parser.add_argument("--duration", type=float, default=1.0, help="virtual seconds per run (1.0)")
    parser.add_argument("--latency-ms", type=float, default=0.5, help="one-way link latency, ms (0.5)")
    parser.add_argument("--png", default="multiplexing.png", help="where to write the picture ('' for none)")
    args = parser.parse_args(argv)
    if args.duration <= 0:
        parser.error("--duration: allowed is a number of virtual seconds > 0")

    from spark_credit_shuffle.config import NetworkConfig
    from spark_credit_shuffle.simulation import SimulationReport, simulate

    runs = [
        ("without credits", False, args.slow_rate),
        ("without credits", False, args.fast_rate),
        ("with credits", True, args.slow_rate),
        ("with credits", True, args.fast_rate),
    ]
    results = {}
    for step, (label, credit_based, slow) in enumerate(runs, 1):
        started = time.perf_counter()
        report = simulate(
            NetworkConfig(credit_based=credit_based),
            num_producers=2,
            num_consumers=2,
            consumers_of="forward",
            producer_rate=args.producer_rate,
            consumer_rate=[slow, args.fast_rate],
            duration=args.duration,
            bandwidth=1000 * MB,
            latency=args.latency_ms / 1000.0,
            connections="host_pair",
        )
        scenario = "consumer 0 slow" if slow == args.slow_rate else "consumer 0 fast"
        results[(label, scenario)] = report
        print(
            f"[{step}/{len(runs)}] {label}, {scenario}: {report.steps} events, "
            f"{time.perf_counter() - started:.2f} s of wall time",
            flush=True,
        )

    def throughput(report: SimulationReport, consumer: int) -> float:  # bytes per virtual second over the run
        return report.value("consumer", consumer, "numBytesInPerSecond", stat="mean")

    def back_pressured(report: SimulationReport, producer: int) -> float:  # share of the run spent back-pressured
        return report.value("producer", producer, "accumulateBackPressuredTimeMs") / 1000.0 / report.window

    print()
    header = (
        f"{'flow control':<16} {'consumer 0':<16} {'c0 MB/s':>9} {'c1 MB/s':>9} {'pauses':>7} {'p0 bp':>6} {'p1 bp':>6}"
    )
    print(header)
    print("-" * len(header))
    for (label, scenario), r in results.items():
        print(
            f"{label:<16} {scenario.removeprefix('consumer 0 '):<16} {throughput(r, 0) / MB:>9.2f} "
            f"{throughput(r, 1) / MB:>9.2f} {r.connection_pauses:>7} "
            f"{back_pressured(r, 0):>6.0%} {back_pressured(r, 1):>6.0%}"
        )
    print("(c0, c1: consumer throughput; pauses: times the shared connection stopped reading; p0, p1 bp: share of")
    print(" the time each producer was back-pressured)")

    without = results[("without credits", "consumer 0 slow")]
    with_credits = results[("with credits", "consumer 0 slow")]
    alone = results[("with credits", "consumer 0 fast")]
    neighbour_without = throughput(without, 1)
    neighbour_with = throughput(with_credits, 1)
    neighbour_alone = throughput(alone, 1)
    print()
    print(
        f"the neighbour of a slow receiver gets {neighbour_without / neighbour_alone:.0%} of its own rate without "
        f"credits and {neighbour_with / neighbour_alone:.0%} with credits"
    )
    png = None
    if args.png:
        try:
            from spark_credit_shuffle.plot import bar_chart
        except ImportError:  # pragma: no cover - matplotlib missing
            print("matplotlib is not installed: no picture (pip install 'spark-credit-shuffle[plot]')")
        else:
            bar_chart(
                ["consumer 0", "consumer 1 (its neighbour)"],
                {
                    "consumer 0 slow, without credits": [throughput(without, c) / MB for c in (0, 1)],
                    "consumer 0 slow, with credits": [throughput(with_credits, c) / MB for c in (0, 1)],
                    "consumer 0 fast (reference)": [throughput(alone, c) / MB for c in (0, 1)],
                },
                ylabel="MB per virtual second",
                title="Two channels on one connection, one slow receiver",
                path=args.png,
            )
            png = args.png
            print(f"picture: {png}")
    print(
        json.dumps(
            {
                "slow_mb_s": round(args.slow_rate / MB, 3),
                "neighbour_alone_mb_s": round(neighbour_alone / MB, 3),
                "neighbour_without_credits_mb_s": round(neighbour_without / MB, 3),
                "neighbour_with_credits_mb_s": round(neighbour_with / MB, 3),
                "neighbour_share_without_credits": round(neighbour_without / neighbour_alone, 4),
                "neighbour_share_with_credits": round(neighbour_with / neighbour_alone, 4),
                "connection_pauses_without_credits": without.connection_pauses,
                "connection_pauses_with_credits": with_credits.connection_pauses,
                "png": png,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
