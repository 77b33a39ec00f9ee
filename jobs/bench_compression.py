"""Benchmark: per-buffer compression of the blocking exchange (Flink's blocking-shuffle compression), codec
by codec, in one run.

Data: ``--rows`` rows (``a`` long, ``b`` int, ``c`` a 20-character string, as ``bench_exchange.py``), cached in
``--parallelism`` partitions and materialised before anything is timed. Each case is
``exchange(df, key_by("a"), P, mode="blocking", blocking_shuffle_compression=..., compression_codec=...)``
written to Spark's ``noop`` sink, ``--repeat`` times (median), after one untimed warm-up of the first case:

- ``none``: compression off (the default here);
- ``lz4``: Flink's default codec;
- ``zstd``.

For each: the wall time, ``numBytesOut`` (the raw network buffers), ``numBytesStored`` (the payloads handed to
Spark's shuffle, compressed or not) and the bytes Spark's shuffle wrote for the exchange's stages (from the Spark
UI's REST API; Spark compresses its shuffle with ``spark.io.compression.codec``, lz4 by default, on top). The
last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from typing import Any

from spark_credit_shuffle.cli import conf_pair, job_session, positive_int
from spark_credit_shuffle.jobs.common import cached_rows

CODECS = ("none", "lz4", "zstd")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=positive_int, default=10_000_000, help="rows (10,000,000)")
    parser.add_argument("--parallelism", type=positive_int, default=4, help="producers and consumers (4)")
    parser.add_argument("--repeat", type=positive_int, default=1, help="timed runs per codec (1)")
    parser.add_argument("--master", default="local[4]", help="Spark master under plain python (local[4])")
    parser.add_argument(
        "--conf", action="append", type=conf_pair, default=[], metavar="KEY=VALUE", help="Spark or exchange setting"
    )
    return parser.parse_args(argv)


def shuffle_write_bytes(spark: Any) -> dict[int, int]:
    """Shuffle bytes written per completed stage, from the Spark UI's REST API ({} if it is not reachable)."""
    try:
        sc = spark.sparkContext
        url = f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}/stages?status=complete"
        with urllib.request.urlopen(url, timeout=10) as answer:
            stages = json.load(answer)
    except Exception:  # no UI (disabled, Spark Connect): the column stays empty
        return {}
    return {int(s["stageId"]): int(s.get("shuffleWriteBytes", 0)) for s in stages}


def run_case(spark: Any, df: Any, codec: str, parallelism: int) -> dict[str, Any]:
    import spark_credit_shuffle as scs

    before = shuffle_write_bytes(spark)
    ex = scs.exchange(
        df,
        scs.key_by("a"),
        parallelism=parallelism,
        mode="blocking",
        blocking_shuffle_compression=codec != "none",
        compression_codec=codec,
    )
    started = time.perf_counter()
    ex.df.write.format("noop").mode("overwrite").save()
    seconds = time.perf_counter() - started
    after = shuffle_write_bytes(spark)
    metrics = {
        r["metric"]: r["total"]
        for r in ex.metrics()
        .groupBy("metric")
        .sum("value")
        .withColumnRenamed("sum(value)", "total")
        .where("metric in ('numBytesOut', 'numBytesStored')")
        .collect()
    }
    spark_bytes = sum(b for stage, b in after.items() if stage not in before) if after else None
    return {
        "seconds": seconds,
        "bytes_out": int(metrics.get("numBytesOut", 0)),
        "bytes_stored": int(metrics.get("numBytesStored", 0)),
        "spark_shuffle_bytes": spark_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spark, owned = job_session("bench_compression", args.master, args.conf)
    try:
        df = cached_rows(spark, args.rows, args.parallelism)
        run_case(spark, df, CODECS[0], args.parallelism)  # warm-up: workers, imports, caches
        results: dict[str, list[dict[str, Any]]] = {codec: [] for codec in CODECS}
        for round_ in range(args.repeat):
            for codec in CODECS[round_ % len(CODECS) :] + CODECS[: round_ % len(CODECS)]:
                results[codec].append(run_case(spark, df, codec, args.parallelism))
    finally:
        if owned:
            spark.stop()
    print(f"blocking exchange, {args.rows:,} rows, key_by, parallelism {args.parallelism}, median of {args.repeat}")
    header = f"{'codec':<6} {'seconds':>8} {'numBytesOut':>14} {'numBytesStored':>15} {'stored/out':>10}"
    print(f"{header} {'Spark shuffle':>14}")
    headline: dict[str, Any] = {"rows": args.rows}
    for codec, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        out, stored = runs[-1]["bytes_out"], runs[-1]["bytes_stored"]
        spark_bytes = runs[-1]["spark_shuffle_bytes"]
        shown = f"{spark_bytes:>14,}" if spark_bytes is not None else f"{'?':>14}"
        print(f"{codec:<6} {seconds:>8.2f} {out:>14,} {stored:>15,} {stored / max(1, out):>10.3f} {shown}")
        headline[codec] = {"seconds": round(seconds, 2), "bytes_out": out, "bytes_stored": stored}
        headline[codec]["spark_shuffle_bytes"] = spark_bytes
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
