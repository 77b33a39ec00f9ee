"""Slow-consumer demo: round robin vs adaptive rebalance, the fast consumer's throughput in both.

Two producer subtasks rebalance rows to two consumer subtasks in a pipelined exchange; a step of the user's
chained into consumer subtask 0's task (``exchange(..., after=scs.map_in_pandas(...))``) sleeps ``--delay-ms``
(1 ms) per row. Plain round robin is blind to that: every producer sends half its rows
to consumer 0, fills that channel, is back-pressured, and consumer 1 starves, getting about the slow one's
rate. Adaptive rebalance (``rebalance(adaptive=True)``, Flink 2.x's adaptive partitioner) sends each small
chunk of rows to the channel with the fewest bytes queued, so consumer 1 keeps its own pace.

Three cases, run ``--repeat`` times interleaved (one of each per round, so a busy moment of the machine
hits every case alike), after one warm-up: round robin without delay (consumer 1's unthrottled rate),
round robin with consumer 0 slowed, adaptive with consumer 0 slowed. The unthrottled and adaptive cases
move ``--rows`` rows per producer (enough that start-up does not dominate a consumer's life); the slowed
round robin moves ``--round-robin-rows`` per producer, since there every other row waits ``--delay-ms``.
A consumer's throughput is the rows it received over its life (from its partition requests to its last
end of partition: Flink's busy + idle + back-pressured time, as the exchange's metrics report them). The
shares compare each round's slowed case with the same round's unthrottled rate; the headline is the
median over rounds. Prints one progress line per run, the table and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from spark_credit_shuffle.cli import conf_pair, positive_int
from spark_credit_shuffle.jobs.common import slow_on

UNTHROTTLED = "round robin, no delay"
ROUND_ROBIN = "round robin, consumer 0 slow"
ADAPTIVE = "adaptive, consumer 0 slow"
#: The fast consumer's throughput behind adaptive rebalance, as a share of its unthrottled rate.
ADAPTIVE_GOAL = 0.8


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


def rate(per_consumer: dict[int, tuple[float, float]], consumer: int) -> float:
    """Rows per second of ``consumer`` over its life."""
    received, life = per_consumer.get(consumer, (0.0, 0.0))
    return received / life if life else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=positive_int, default=40_000, help="rows per producer subtask (40,000)")
    parser.add_argument(
        "--round-robin-rows",
        type=positive_int,
        default=4000,
        help="rows per producer behind round robin with the slow consumer (4,000: half of them wait --delay-ms; "
        "several times what the buffers in front of the slow consumer hold, so that their filling does not dominate)",
    )
    parser.add_argument("--repeat", type=positive_int, default=3, help="rounds of the three cases (3)")
    parser.add_argument("--delay-ms", type=float, default=1.0, help="consumer 0's sleep per row, ms (1.0)")
    parser.add_argument("--payload-bytes", type=positive_int, default=100, help="bytes of the string column (100)")
    parser.add_argument("--batch-rows", type=positive_int, default=100, help="rows per input Arrow batch (100)")
    parser.add_argument("--max-traverse", type=positive_int, default=4, help="channels adaptive looks at (4)")
    parser.add_argument(
        "--segment-size",
        default="4kb",
        help="network buffer size (4kb: the buffers in front of the slow consumer hold about 800 rows, so "
        "backpressure shows on small data)",
    )
    parser.add_argument("--master", help="Spark master under plain python (default local[4])")
    parser.add_argument(
        "--conf", action="append", type=conf_pair, default=[], metavar="KEY=VALUE", help="Spark or exchange setting"
    )
    args = parser.parse_args(argv)
    if args.delay_ms <= 0:
        parser.error("--delay-ms: allowed is a delay > 0 ms")
    conf: list[tuple[str, str]] = args.conf

    from pyspark.sql import functions as F

    import spark_credit_shuffle as scs
    from spark_credit_shuffle.cli import job_session

    spark, created = job_session("spark_credit_shuffle slow-consumer demo", args.master or "local[4]", conf)
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

    def rows_of(per_producer: int) -> Any:
        return spark.range(0, 2 * per_producer, 1, 2).select(
            F.col("id"), F.concat(F.lit("p" * args.payload_bytes), F.col("id").cast("string")).alias("payload")
        )

    # the user's slow step, chained into consumer 0's task (its time is that consumer's busy time)
    slow = scs.map_in_pandas(slow_on(0, args.delay_ms / 1000.0), rows_of(1).schema)
    round_robin = scs.rebalance(seed=1)
    adaptive = scs.rebalance(seed=1, adaptive=True, max_traverse=args.max_traverse)
    cases = [
        (UNTHROTTLED, round_robin, None, args.rows),
        (ROUND_ROBIN, round_robin, slow, args.round_robin_rows),
        (ADAPTIVE, adaptive, slow, args.rows),
    ]
    runs = [("warm-up", round_robin, None, min(args.rows, 2000))]
    runs += [case for _ in range(args.repeat) for case in cases]
    results: dict[str, list[dict[int, tuple[float, float]]]] = {label: [] for label, *_ in cases}
    try:
        for step, (label, partitioner, after, per_producer) in enumerate(runs, 1):
            started = time.perf_counter()
            ex = scs.exchange(
                rows_of(per_producer),
                partitioner,
                parallelism=2,
                mode="pipelined",
                after=after,
                segment_size=args.segment_size,
            )
            with ex.labelled():
                count = ex.df.count()
            elapsed = time.perf_counter() - started
            if count != 2 * per_producer:
                raise RuntimeError(f"{label}: {count} rows came out of {2 * per_producer}")
            note = ""
            if label != "warm-up":
                rates = consumer_rates(ex.metric_rows())
                results[label].append(rates)
                note = ", consumer 1: " + f"{rate(rates, 1):,.0f} rows/s"
            print(f"[{step}/{len(runs)}] {label}: {count} rows in {elapsed:.2f} s{note}", flush=True)
    finally:
        for key, value in previous.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
        if created:
            spark.stop()

    print()
    print(f"{'run':<30} {'round':>5} {'consumer':>8} {'rows':>7} {'life s':>7} {'rows/s':>9}")
    for label, rounds in results.items():
        for i, per_consumer in enumerate(rounds, 1):
            for consumer, (received, life) in per_consumer.items():
                speed = rate(per_consumer, consumer)
                print(f"{label:<30} {i:>5} {consumer:>8} {int(received):>7} {life:>7.2f} {speed:>9.0f}")

    unthrottled = [rate(r, 1) for r in results[UNTHROTTLED]]
    rr_fast = [rate(r, 1) for r in results[ROUND_ROBIN]]
    rr_slow = [rate(r, 0) for r in results[ROUND_ROBIN]]
    ad_fast = [rate(r, 1) for r in results[ADAPTIVE]]
    rr_shares = [f / u if u else 0.0 for f, u in zip(rr_fast, unthrottled)]
    rr_vs_slow = [f / s if s else 0.0 for f, s in zip(rr_fast, rr_slow)]
    ad_shares = [f / u if u else 0.0 for f, u in zip(ad_fast, unthrottled)]
    med = statistics.median
    print()
    print(
        f"consumer 1 (fast), medians of {args.repeat} rounds: unthrottled {med(unthrottled):,.0f} rows/s; behind "
        f"round robin {med(rr_fast):,.0f} rows/s ({med(rr_shares):.1%} of unthrottled, {med(rr_vs_slow):.2f}x "
        f"consumer 0's own {med(rr_slow):,.0f} rows/s); behind adaptive rebalance {med(ad_fast):,.0f} rows/s "
        f"({med(ad_shares):.0%} of unthrottled; rounds: {', '.join(f'{x:.0%}' for x in ad_shares)}; goal >= "
        f"{ADAPTIVE_GOAL:.0%})"
    )
    print(
        json.dumps(
            {
                "rows": 2 * args.rows,
                "round_robin_rows": 2 * args.round_robin_rows,
                "repeat": args.repeat,
                "delay_ms": args.delay_ms,
                "fast_unthrottled_rows_s": round(med(unthrottled)),
                "fast_round_robin_rows_s": round(med(rr_fast)),
                "slow_round_robin_rows_s": round(med(rr_slow)),
                "fast_adaptive_rows_s": round(med(ad_fast)),
                "round_robin_share": round(med(rr_shares), 4),
                "round_robin_fast_vs_slow": round(med(rr_vs_slow), 3),
                "adaptive_share": round(med(ad_shares), 4),
                "adaptive_shares": [round(x, 4) for x in ad_shares],
                "adaptive_goal_met": med(ad_shares) >= ADAPTIVE_GOAL,
                "rows_to_slow_consumer_adaptive": int(med(r[0][0] for r in results[ADAPTIVE])),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
