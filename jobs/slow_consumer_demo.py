"""Slow-consumer demo: round robin vs adaptive rebalance, the fast consumer's throughput in both.

Two producer subtasks rebalance rows to two consumer subtasks in a pipelined exchange; consumer subtask 0
sleeps ``--delay-ms`` (1 ms) per row. Plain round robin is blind to that: every producer sends half its rows
to consumer 0, fills that channel, is back-pressured, and consumer 1 starves, getting about the slow one's
rate. Adaptive rebalance (``rebalance(adaptive=True)``, Flink 2.x's adaptive partitioner) sends each small
chunk of rows to the channel with the fewest bytes queued, so consumer 1 keeps its own pace.

Runs, each with the same input: round robin without delay (the fast consumer's unthrottled rate), round
robin with consumer 0 slowed, adaptive with consumer 0 slowed. A consumer's throughput is the rows it
received over its life (from its partition requests to its last end of partition: Flink's busy + idle +
back-pressured time, as the exchange's metrics report them). Prints one progress line per run, the table
and, as its last line, one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {value}: allowed is an integer >= 1")
    return value


def consumer_rates(rows: list[Any]) -> dict[int, tuple[float, float]]:
    """(rows received, life in seconds) per consumer subtask, from an exchange's metric rows."""
    received: dict[int, float] = {}
    life: dict[int, float] = {}
    for r in rows:
        if r.side != "consumer" or r.stat != "total":
            continue
        if r.metric == "numRecordsIn":
            received[r.subtask] = received.get(r.subtask, 0.0) + r.value
        elif r.metric in ("accumulateBusyTimeMs", "accumulateIdleTimeMs", "accumulateBackPressuredTimeMs"):
            life[r.subtask] = life.get(r.subtask, 0.0) + r.value / 1000.0
    if not life:
        raise RuntimeError("the exchange reported no busy/idle time: the demo needs the pipelined runtime")
    return {c: (received.get(c, 0.0), life[c]) for c in sorted(life)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=_positive, default=5000, help="rows per producer subtask (5000)")
    parser.add_argument("--delay-ms", type=float, default=1.0, help="consumer 0's sleep per row, ms (1.0)")
    parser.add_argument("--payload-bytes", type=_positive, default=100, help="bytes of the string column (100)")
    parser.add_argument("--batch-rows", type=_positive, default=100, help="rows per input Arrow batch (100)")
    parser.add_argument("--max-traverse", type=_positive, default=4, help="channels adaptive looks at (4)")
    parser.add_argument(
        "--segment-size",
        default="4kb",
        help="network buffer size (4kb: the buffers in front of the slow consumer hold about 800 rows, so "
        "backpressure shows on small data)",
    )
    parser.add_argument("--master", help="Spark master under plain python (default local[4])")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="Spark or exchange setting")
    args = parser.parse_args(argv)
    if args.delay_ms <= 0:
        parser.error("--delay-ms: allowed is a delay > 0 ms")
    conf = []
    for text in args.conf:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            parser.error(f"--conf {text!r}: allowed is KEY=VALUE")
        conf.append((key.strip(), value.strip()))

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import spark_credit_shuffle as scs

    existing = SparkSession.getActiveSession()
    if existing is not None:
        spark = existing
    else:
        builder = SparkSession.builder.appName("spark_credit_shuffle slow-consumer demo")
        if not os.environ.get("PYSPARK_GATEWAY_PORT"):  # plain python: nobody chose a master
            builder = (
                builder.master(args.master or "local[4]")
                .config("spark.ui.showConsoleProgress", "false")
                .config("spark.sql.adaptive.enabled", "false")
                .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
            )
        for key, value in conf:
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("WARN")
    # small input batches: a producer takes its next batch only when its pool has room (backpressure acts
    # between batches), and the adaptive choice reads the queues between chunks of a batch
    keys = [k for k, _ in conf if k.startswith(scs.config.CONF_PREFIX)] + [
        "spark.sql.execution.arrow.maxRecordsPerBatch"
    ]
    previous = {key: spark.conf.get(key, None) for key in keys}
    for key, value in conf:
        if key.startswith(scs.config.CONF_PREFIX):
            spark.conf.set(key, value)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", str(args.batch_rows))
    try:
        rows = spark.range(0, 2 * args.rows, 1, 2).select(
            F.col("id"), F.concat(F.lit("p" * args.payload_bytes), F.col("id").cast("string")).alias("payload")
        )
        slow = scs.Injection(consumer_delay_s=((0, args.delay_ms / 1000.0),))
        runs = [
            ("warm-up", scs.rebalance(seed=1), None),
            ("round robin, no delay", scs.rebalance(seed=1), None),
            ("round robin, consumer 0 slow", scs.rebalance(seed=1), slow),
            ("adaptive, consumer 0 slow", scs.rebalance(seed=1, adaptive=True, max_traverse=args.max_traverse), slow),
        ]
        results: dict[str, dict[int, tuple[float, float]]] = {}
        for step, (label, partitioner, injection) in enumerate(runs, 1):
            started = time.perf_counter()
            ex = scs.exchange(
                rows, partitioner, parallelism=2, mode="pipelined", injection=injection, segment_size=args.segment_size
            )
            with ex.labelled():
                count = ex.df.count()
            elapsed = time.perf_counter() - started
            if count != 2 * args.rows:
                raise RuntimeError(f"{label}: {count} rows came out of {2 * args.rows}")
            if label != "warm-up":
                results[label] = consumer_rates(ex.metric_rows())
            print(f"[{step}/{len(runs)}] {label}: {count} rows in {elapsed:.2f} s", flush=True)
    finally:
        for key, value in previous.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
        if existing is None:
            spark.stop()

    print()
    print(f"{'run':<30} {'consumer':>8} {'rows':>7} {'life s':>7} {'rows/s':>9}")
    for label, per_consumer in results.items():
        for consumer, (received, life) in per_consumer.items():
            rate = received / life if life else 0.0
            print(f"{label:<30} {consumer:>8} {int(received):>7} {life:>7.2f} {rate:>9.0f}")

    def rate(label: str, consumer: int) -> float:
        received, life = results[label][consumer]
        return received / life if life else 0.0

    unthrottled = rate("round robin, no delay", 1)
    rr_fast, rr_slow = rate("round robin, consumer 0 slow", 1), rate("round robin, consumer 0 slow", 0)
    ad_fast = rate("adaptive, consumer 0 slow", 1)
    print()
    print(
        f"consumer 1 (fast): unthrottled {unthrottled:.0f} rows/s; behind round robin {rr_fast:.0f} rows/s "
        f"({rr_fast / unthrottled:.0%}, consumer 0 itself {rr_slow:.0f} rows/s); behind adaptive rebalance "
        f"{ad_fast:.0f} rows/s ({ad_fast / unthrottled:.0%})"
    )
    print(
        json.dumps(
            {
                "rows": 2 * args.rows,
                "delay_ms": args.delay_ms,
                "fast_unthrottled_rows_s": round(unthrottled),
                "fast_round_robin_rows_s": round(rr_fast),
                "slow_round_robin_rows_s": round(rr_slow),
                "fast_adaptive_rows_s": round(ad_fast),
                "round_robin_share": round(rr_fast / unthrottled, 4),
                "adaptive_share": round(ad_fast / unthrottled, 4),
                "rows_to_slow_consumer_adaptive": int(results["adaptive, consumer 0 slow"][0][0]),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
