"""Run one credit-based exchange over a dataset and write its output, metrics and timeline.

    spark-submit --conf spark.creditShuffle.bufferTimeoutMs=10 $(python -m spark_credit_shuffle job-path exchange) \\
        --input events.parquet --partitioner hash:user_id --parallelism 8 --mode pipelined \\
        --output out/ --metrics metrics.csv

    python -m spark_credit_shuffle.jobs.exchange_job --generate 100000 --partitioner rebalance \\
        --conf spark.creditShuffle.segmentSize=8kb

A module of the package, so an installed wheel runs it (``job-path exchange`` prints its file for
``spark-submit``); ``jobs/exchange_job.py`` in a checkout runs the same.

The input's partitions are the producer subtasks (``--producers`` repartitions it first). Under plain
``python`` a local session ``local[N]`` is started (N = the larger parallelism, or ``--master``); under
``spark-submit`` the master and the settings are spark-submit's. Settings: ``--conf
spark.creditShuffle.<name>=<value>`` here or on spark-submit. Every Spark job is labelled with the
exchange. Prints rows per consumer subtask and, as its last line, one JSON object with the headline
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from spark_credit_shuffle.cli import choice, conf_pair, positive_int, require_plotting
from spark_credit_shuffle.jobs.common import events

FORMATS = ("parquet", "csv", "json", "orc")
#: --metrics and --timeline write one file, in the format its extension names.
TABLE_FORMATS = ("csv", "json", "parquet")
PARTITIONERS = ("hash:<col>[,<col>...]", "rebalance", "rescale", "shuffle", "broadcast", "forward", "global")
MODES = ("blocking", "pipelined")  # the first is exchange()'s default, and so the job's


def parse_partitioner(text: str):
    """``hash:a,b`` (or ``key_by:a``), ``rebalance``, ``rescale``, ``shuffle``, ``broadcast``, ``forward``,
    ``global`` -> a Partitioner; ConfigError naming what is allowed otherwise."""
    import spark_credit_shuffle as scs
    from spark_credit_shuffle.errors import ConfigError

    name, _, columns = text.partition(":")
    name = name.strip().lower().replace("-", "_")
    if name in ("hash", "key_by", "keyby"):
        keys = [c.strip() for c in columns.split(",") if c.strip()]
        if not keys:
            raise ConfigError("partitioner", text, "hash:<column>[,<column>...], e.g. hash:user_id", kind="argument")
        return scs.key_by(*keys)
    simple = {
        "rebalance": scs.rebalance,
        "rescale": scs.rescale,
        "shuffle": scs.shuffle,
        "broadcast": scs.broadcast,
        "forward": scs.forward,
        "global": scs.global_,
    }
    if name not in simple or columns:
        raise ConfigError(
            "partitioner", text, "one of " + ", ".join(PARTITIONERS), choices=(*simple, "hash"), kind="argument"
        )
    return simple[name]()


def _format_of(path: str, given: str | None) -> str:
    if given:
        return given
    ext = os.path.splitext(path.rstrip("/"))[1].lstrip(".").lower()
    return ext if ext in FORMATS else "parquet"


def table_path(text: str) -> str:
    """A file path ending in .csv, .json (JSON Lines) or .parquet; argparse's error naming them otherwise."""
    ext = os.path.splitext(text)[1].lstrip(".").lower()
    if ext not in TABLE_FORMATS or text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: allowed is a file name ending in " + ", ".join(f".{f}" for f in TABLE_FORMATS)
        )
    return text


def write_table(frame: Any, path: str) -> None:
    """Write a small pandas DataFrame to the single file ``path``, in the format of its extension. A
    ``channel`` column is written as integers (pandas' nullable ``Int64``: ``0``, not ``0.0``, and empty where
    null); ``value`` stays a double, as in ``Exchange.metrics()``."""
    if "channel" in frame:
        frame = frame.assign(channel=frame["channel"].astype("Int64"))
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    if ext == "csv":
        frame.to_csv(path, index=False)
    elif ext == "json":
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_parquet(path, index=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="input path (file or directory)")
    source.add_argument("--generate", type=positive_int, metavar="ROWS", help="generate ROWS rows instead of reading")
    parser.add_argument(
        "--format",
        type=choice(*FORMATS),
        choices=FORMATS,
        help="input format (default: from the extension, else parquet)",
    )
    parser.add_argument("--partitioner", default="rebalance", help="one of " + ", ".join(PARTITIONERS))
    parser.add_argument("--parallelism", type=positive_int, help="consumer subtasks (default: the producer count)")
    parser.add_argument("--producers", type=positive_int, help="repartition the input to this many producers first")
    parser.add_argument("--mode", type=choice(*MODES), choices=MODES, default=MODES[0])
    parser.add_argument("--output", help="where to write the exchanged rows (default: count them only)")
    parser.add_argument(
        "--output-format", type=choice(*FORMATS), choices=FORMATS, help="default: from the extension, else parquet"
    )
    parser.add_argument(
        "--metrics", type=table_path, help="file for the summary metrics: .csv, .json (JSON Lines) or .parquet"
    )
    parser.add_argument(
        "--timeline", type=table_path, help="file for the metrics timeline: .csv, .json (JSON Lines) or .parquet"
    )
    parser.add_argument("--timeline-png", help="draw the timeline into this PNG (needs matplotlib)")
    parser.add_argument("--master", help="Spark master under plain python (default local[N])")
    parser.add_argument(
        "--conf", action="append", type=conf_pair, default=[], metavar="KEY=VALUE", help="Spark or exchange setting"
    )
    args = parser.parse_args(argv)
    require_plotting(parser, "--timeline-png", args.timeline_png)

    from spark_credit_shuffle.cli import job_session
    from spark_credit_shuffle.config import CONF_PREFIX
    from spark_credit_shuffle.errors import CreditShuffleError

    try:
        partitioner = parse_partitioner(args.partitioner)
    except CreditShuffleError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")

    width = max(args.producers or 2, args.parallelism or 2)
    spark, created = job_session("spark_credit_shuffle exchange job", args.master or f"local[{width}]", args.conf)
    previous = {}
    if not created:  # a notebook's or a test's session: set the exchange's settings, give them back after
        ours = [(k, v) for k, v in args.conf if k.startswith(CONF_PREFIX)]
        previous = {key: spark.conf.get(key, None) for key, _ in ours}
        for key, value in ours:
            spark.conf.set(key, value)
    try:
        return _run(args, spark, partitioner)
    finally:
        if created:
            spark.stop()
        for key, value in previous.items():  # give the session back as it was
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


def _run(args: argparse.Namespace, spark: Any, partitioner: Any) -> int:
    import spark_credit_shuffle as scs
    from spark_credit_shuffle.errors import CreditShuffleError
    from spark_credit_shuffle.runtime.session import spark_context

    sc = spark_context(spark)  # None on Spark Connect: no job descriptions there
    if args.input:
        fmt = _format_of(args.input, args.format)
        reader = spark.read.format(fmt)
        if fmt == "csv":
            reader = reader.option("header", "true").option("inferSchema", "true")
        df = reader.load(args.input)
    else:
        df = events(spark, args.generate, args.producers or 2)
    try:
        ex = scs.exchange(df, partitioner, args.parallelism, args.mode, num_producers=args.producers)
    except CreditShuffleError as e:
        print(f"error before launch: {e}", file=sys.stderr)
        return 2
    plan = ex.plan
    print(f"{plan.describe()}")
    started = time.perf_counter()
    with ex.labelled():
        if args.output:
            out_format = _format_of(args.output, args.output_format)
            writer = ex.df.write.mode("overwrite").format(out_format)
            writer = writer.option("header", "true") if out_format == "csv" else writer
            writer.save(args.output)
        else:
            ex.df.write.format("noop").mode("overwrite").save()
    elapsed = time.perf_counter() - started
    rows = ex.metric_rows()
    per_consumer: dict[int, float] = {}
    for r in rows:
        if r.side == "consumer" and r.metric == "numRecordsIn":
            per_consumer[r.subtask] = per_consumer.get(r.subtask, 0.0) + r.value
    for subtask in sorted(per_consumer):
        print(f"  consumer subtask {subtask}: {int(per_consumer[subtask])} rows")
    total = int(sum(per_consumer.values()))
    buffers = int(sum(r.value for r in rows if r.metric == "numBuffersOut"))
    print(f"  {total} rows in {buffers} network buffers, {elapsed:.2f} s")

    timeline_rows = ex.timeline_rows()
    for path, frame, what in (
        (args.metrics, ex.metrics, "metrics"),
        (args.timeline, ex.timeline, "timeline"),
    ):
        if path:
            if sc is not None:
                sc.setJobDescription(f"{plan.describe()}: write {what}")
            write_table(frame().toPandas(), path)
            if sc is not None:
                sc.setJobDescription(None)  # type: ignore[arg-type]  # None clears it
            print(f"  {what}: {path}")
    if args.timeline_png:
        from spark_credit_shuffle.plot import plot_timeline

        plot_timeline(timeline_rows, title=plan.describe(), path=args.timeline_png)
        print(f"  timeline picture: {args.timeline_png}")
    headline = {
        "exchange": plan.name,
        "mode": plan.mode,
        "partitioner": plan.partitioner.name,
        "producers": plan.num_producers,
        "consumers": plan.num_consumers,
        "rows": total,
        "buffers": buffers,
        "seconds": round(elapsed, 3),
        "rows_per_second": round(total / elapsed) if elapsed > 0 else None,
        "timeline_samples": len({(r.side, r.subtask, r.time_ms) for r in timeline_rows}),
        "output": args.output,
        "metrics": args.metrics,
    }
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
