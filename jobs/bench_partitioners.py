"""Benchmark: Flink key-group channels per second, next to Spark's own ``pmod(hash(col), n)``.

For int, long and short-string keys (10 M each by default) it times, in one run:

1. ``key_group_channels`` alone: the pure vectorised function over one Arrow array, on one core
   (numpy element-wise work is single-threaded), median of ``--runs`` runs;
2. Spark's ``pmod(hash(col), n)`` on the same data (cached in a local session), written to the ``noop`` sink;
3. the same data through ``with_channel(df, key_by(col))``, also to the ``noop`` sink, which adds the
   JVM <-> Python Arrow hop that any Python-side partitioner pays;
4. that hop alone: an identity ``mapInArrow`` on the same data, so the table shows how much of
   ``with_channel``'s time is the hop and how much is the partitioner.

It prints a table with keys per second and ratios, then, as its last line, one JSON object with the
headline figures. Run ``python jobs/bench_partitioners.py --rows 100000`` for a quick check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from spark_credit_shuffle import key_by, key_group_channels, with_channel
from spark_credit_shuffle.jobs.common import bench_session, timed

#: The targets, one core, median of 5.
TARGETS = {"int": 20e6, "string": 5e6}
ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", dtype=np.uint8)


def make_keys(rows: int, seed: int) -> pa.Table:
    """``rows`` random int32, int64 and 8-12 character ASCII string keys, built without a per-row loop."""
    rng = np.random.default_rng(seed)
    ints = rng.integers(-(2**31), 2**31, size=rows, dtype=np.int64).astype(np.int32)
    longs = rng.integers(-(2**63), 2**63 - 1, size=rows, dtype=np.int64)
    lengths = rng.integers(8, 13, size=rows)
    offsets = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    data = ALPHABET[rng.integers(0, len(ALPHABET), size=int(offsets[-1]))]
    strings = pa.StringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(data))
    return pa.table({"int": ints, "long": longs, "string": strings})


def _identity(batches):
    """The JVM <-> Python Arrow hop with no work in Python."""
    yield from batches


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="keys per type (default 10 M)")
    parser.add_argument("--runs", type=int, default=5, help="runs per measurement; the median is reported")
    parser.add_argument("--parallelism", type=int, default=4, help="number of channels (consumer subtasks)")
    parser.add_argument("--max-parallelism", type=int, default=128, help="number of key groups")
    parser.add_argument("--master", default="local[2]", help="Spark master for the comparison")
    parser.add_argument("--driver-memory", default="4g", help="spark.driver.memory of the local session")
    parser.add_argument("--no-spark", action="store_true", help="time key_group_channels only")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.rows < 1 or args.runs < 1:
        parser.error("--rows and --runs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    table = make_keys(args.rows, args.seed)
    n, max_p = args.parallelism, args.max_parallelism
    results: dict[str, dict[str, float]] = {}
    for name in table.column_names:
        values = table.column(name).combine_chunks()
        key_group_channels(values, n, max_p)  # warm up (power tables, allocator)
        seconds = timed(lambda values=values: key_group_channels(values, n, max_p), args.runs)[0]
        results[name] = {"key_group_channels": args.rows / seconds}
        print(
            f"key_group_channels {name:>6}: {seconds * 1e3:8.1f} ms median, {args.rows / seconds / 1e6:7.1f} M keys/s"
        )

    if not args.no_spark:
        from pyspark.sql import functions as F

        spark, created = bench_session("bench_partitioners", args.master, driver_memory=args.driver_memory)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "keys.parquet")
            pq.write_table(table, path)
            df = spark.read.parquet(path).cache()
            df.count()
            for name in table.column_names:
                keys = df.select(name)

                def spark_hash(keys=keys, name=name):
                    keys.select(F.pmod(F.hash(name), F.lit(n))).write.format("noop").mode("overwrite").save()

                def python_channels(keys=keys, name=name):
                    out = with_channel(keys, key_by(name), parallelism=n, max_parallelism=max_p)
                    out.write.format("noop").mode("overwrite").save()

                def arrow_hop(keys=keys):
                    keys.mapInArrow(_identity, keys.schema).write.format("noop").mode("overwrite").save()

                spark_hash()
                python_channels()
                arrow_hop()
                spark_seconds = timed(spark_hash, args.runs)[0]
                channel_seconds = timed(python_channels, args.runs)[0]
                hop_seconds = timed(arrow_hop, args.runs)[0]
                results[name]["spark_pmod_hash"] = args.rows / spark_seconds
                results[name]["with_channel"] = args.rows / channel_seconds
                results[name]["identity_map_in_arrow"] = args.rows / hop_seconds
                print(
                    f"spark {name:>6}: pmod(hash) {spark_seconds:6.2f} s, "
                    f"with_channel(key_by) {channel_seconds:6.2f} s, "
                    f"identity mapInArrow {hop_seconds:6.2f} s"
                )
            df.unpersist()
        if created:
            spark.stop()

    print()
    print(f"{args.rows:,} keys per type, {n} channels, max parallelism {max_p}, median of {args.runs}")
    print("key_group_channels: one core; Spark: " + ("not run" if args.no_spark else args.master))
    header = f"{'key':>7} | {'key_group_channels':>18} | {'Spark pmod(hash)':>16} | {'with_channel':>12} | "
    header += f"{'identity hop':>12} | {'kgc / Spark':>11} | {'with_channel / Spark':>20} | {'with_channel / hop':>18}"
    print(header)
    print("-" * len(header))
    headline: dict[str, dict[str, float | None]] = {}
    for name, figures in results.items():
        kgc = figures["key_group_channels"]
        spark_rate = figures.get("spark_pmod_hash")
        channel_rate = figures.get("with_channel")
        hop_rate = figures.get("identity_map_in_arrow")
        ratio = kgc / spark_rate if spark_rate else None
        channel_ratio = channel_rate / spark_rate if spark_rate and channel_rate else None
        hop_ratio = channel_rate / hop_rate if hop_rate and channel_rate else None

        def cell(value: float | None, width: int, unit: str = "M/s") -> str:
            if value is None:
                return f"{'-':>{width}}"
            return f"{value / 1e6:>{width - len(unit) - 1}.1f} {unit}" if unit == "M/s" else f"{value:>{width}.2f}"

        print(
            f"{name:>7} | {cell(kgc, 18)} | {cell(spark_rate, 16)} | {cell(channel_rate, 12)} | "
            f"{cell(hop_rate, 12)} | {cell(ratio, 11, 'x')} | {cell(channel_ratio, 20, 'x')} | "
            f"{cell(hop_ratio, 18, 'x')}"
        )
        headline[name] = {
            "key_group_channels_keys_per_s": round(kgc),
            "spark_pmod_hash_keys_per_s": round(spark_rate) if spark_rate else None,
            "with_channel_keys_per_s": round(channel_rate) if channel_rate else None,
            "ratio_key_group_channels_to_spark": round(ratio, 3) if ratio else None,
            "identity_map_in_arrow_keys_per_s": round(hop_rate) if hop_rate else None,
            "ratio_with_channel_to_spark": round(channel_ratio, 3) if channel_ratio else None,
            "ratio_with_channel_to_identity_map_in_arrow": round(hop_ratio, 3) if hop_ratio else None,
        }
    meets = {
        "int": results["int"]["key_group_channels"] >= TARGETS["int"],
        "string": results["string"]["key_group_channels"] >= TARGETS["string"],
    }
    print(
        json.dumps(
            {
                "benchmark": "bench_partitioners",
                "unit": "keys/s",
                "rows": args.rows,
                "runs": args.runs,
                "statistic": "median",
                "channels": n,
                "max_parallelism": max_p,
                "spark_master": None if args.no_spark else args.master,
                "key_group_channels_cores": 1,
                "results": headline,
                "targets_keys_per_s": {"int": TARGETS["int"], "string": TARGETS["string"]},
                "meets_targets": meets,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
