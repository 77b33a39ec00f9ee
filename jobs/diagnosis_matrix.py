"""Where backpressure starts, with the user's own operators: each case of the diagnosis, run several times.

Cases (``--case``, default all), each a rebalance exchange on local Spark whose verdict is known in advance:

- ``healthy``: 4 -> 4, nothing slow. Must name no consumer (``ok``, or ``spread`` where four tasks share too
  few cores);
- ``chained``: 4 -> 4 of ``--rows`` rows of ~110 bytes, a ``map_in_pandas`` chained into the consumer tasks
  sleeping 0.1 ms per row on consumer ``--slow`` (Flink's operator chaining): ``backpressure`` at that consumer;
- ``producer``: a ``map_in_pandas`` chained into the producer tasks, 40 us per row on every producer:
  ``source-bound``;
- ``skew``: ``key_by`` of a column 80% of whose rows hold one key: ``skew``, or ``backpressure`` at the
  skewed consumer with skew named as its cause;
- ``after``: ``ex.df.mapInPandas(slow)`` with ``retryable=False``, the step outside the exchange's tasks,
  0.1 ms per row on partition ``--slow`` (slower than the exchange even on a loaded machine), ``--after-rows``
  rows (more than Spark holds between two Python steps, see docs/diagnosis.md): ``downstream`` at that consumer;
- ``blocking-chained``: the chained slow operator in blocking mode: ``straggler`` at that consumer.

Every case runs ``--repeat`` times, rotated (one of each per round). Prints one line per run (verdict, origin,
the busy / idle / back-pressured ms per second of every subtask), a table of how often each case got its
verdict and, as its last line, one JSON object with those counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from spark_credit_shuffle.cli import conf_pair, job_session, positive_int
from spark_credit_shuffle.jobs.common import slow_on

CASES = ("healthy", "chained", "producer", "skew", "after", "blocking-chained")


def expected(case: str, slow: int) -> Callable[[Any], bool]:
    """Whether a diagnosis is the right one for ``case``."""
    return {
        "healthy": lambda d: d.origin is None and d.verdict in ("ok", "spread"),
        "chained": lambda d: (d.verdict, d.origin) == ("backpressure", slow),
        "producer": lambda d: d.verdict == "source-bound",
        "skew": lambda d: d.verdict in ("skew", "backpressure") and d.origin == 3 and "skew" in d.text,
        "after": lambda d: (d.verdict, d.origin) == ("downstream", slow),
        "blocking-chained": lambda d: (d.verdict, d.origin) == ("straggler", slow),
    }[case]


def run_case(spark: Any, case: str, args: argparse.Namespace) -> tuple[Any, float]:
    """One run of ``case``: (its exchange, seconds)."""
    from pyspark.sql import functions as F

    import spark_credit_shuffle as scs

    schema = "id long, user_id long, pad string"
    data = spark.range(0, args.rows, 1, 4).select(
        "id", (F.col("id") % 1000).alias("user_id"), F.lit("x" * 90).alias("pad")
    )
    started = time.perf_counter()
    if case == "healthy":
        ex = scs.exchange(data, scs.rebalance(), 4, mode="pipelined")
        n = ex.df.count()
    elif case == "chained":
        ex = scs.exchange(data, scs.rebalance(), 4, mode="pipelined")
        n = ex.map_in_pandas(slow_on(args.slow, 1e-4), schema).count()
    elif case == "producer":
        ex = scs.exchange(
            data, scs.rebalance(), 4, mode="pipelined", before=scs.map_in_pandas(slow_on(-1, 4e-5), schema)
        )
        n = ex.df.count()
    elif case == "skew":
        hot = data.withColumn("hot", F.when(F.col("id") % 10 < 8, F.lit(7)).otherwise(F.col("user_id")))
        ex = scs.exchange(hot, scs.key_by("hot"), 4, mode="pipelined")  # key 7 goes to consumer 3
        n = ex.df.count()
    elif case == "after":
        big = spark.range(0, args.after_rows, 1, 4).select(
            "id", (F.col("id") % 1000).alias("user_id"), F.lit("x" * 90).alias("pad")
        )
        ex = scs.exchange(big, scs.rebalance(), 4, mode="pipelined", retryable=False)
        n = ex.df.mapInPandas(slow_on(args.slow, 1e-4), schema).count()
        data = big
    else:  # blocking-chained
        ex = scs.exchange(data, scs.rebalance(), 4, mode="blocking")
        n = ex.map_in_pandas(slow_on(args.slow, 2e-5), schema).count()
    seconds = time.perf_counter() - started
    if n != data.count():
        raise RuntimeError(f"{case}: {n} rows came out of {data.count()}")
    return ex, seconds


def times(ex: Any) -> str:
    return " ".join(
        f"{s.side[0]}{s.subtask}:{s.busy_ms_per_second or 0:.0f}/{s.idle_ms_per_second or 0:.0f}/"
        f"{s.back_pressured_ms_per_second or 0:.0f}"
        for s in ex.summary_rows()
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=(*CASES, "all"), default="all")
    parser.add_argument("--rows", type=positive_int, default=400_000)
    parser.add_argument("--after-rows", type=positive_int, default=1_200_000)
    parser.add_argument("--slow", type=int, choices=range(4), default=2, help="the slow consumer subtask")
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--master", default="local[4]")
    parser.add_argument("--conf", type=conf_pair, action="append", default=[])
    args = parser.parse_args(argv)
    cases = CASES if args.case == "all" else (args.case,)
    spark, owned = job_session("diagnosis_matrix", args.master, args.conf)
    right: dict[str, int] = {case: 0 for case in cases}
    seconds: dict[str, list[float]] = {case: [] for case in cases}
    try:
        for round_ in range(args.repeat):
            for case in cases:
                ex, took = run_case(spark, case, args)
                d = ex.diagnose()
                ok = expected(case, args.slow)(d)
                right[case] += ok
                seconds[case].append(took)
                print(
                    f"round {round_ + 1} {case:17s} {took:5.1f} s {'right' if ok else 'WRONG'}: {d.verdict} "
                    f"origin={d.origin}  [{times(ex)}]",
                    flush=True,
                )
                print(f"    {d}", flush=True)
    finally:
        if owned:
            spark.stop()
    print()
    print(f"{'case':18s} {'right':>7s} {'median s':>9s}")
    for case in cases:
        median = sorted(seconds[case])[len(seconds[case]) // 2]
        print(f"{case:18s} {right[case]:>3d} of {args.repeat} {median:>9.1f}")
    headline = {
        "benchmark": "diagnosis_matrix",
        "master": args.master,
        "repeat": args.repeat,
        "right": right,
        "runs": args.repeat,
        "all_right": all(n == args.repeat for n in right.values()),
    }
    print(json.dumps(headline))
    return headline


if __name__ == "__main__":
    sys.exit(0 if main()["all_right"] else 1)
