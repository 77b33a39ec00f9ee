"""Calibration: real pipelined exchanges on local Spark, each simulated from its own metrics
(``simulation.calibrate.from_exchange``), the simulation's throughput and producers' back-pressured time held
against the measured ones; then two exchanges predicted under changed settings and run with them.

Cases (``--rows`` rows of about 110 bytes, rebalance unless said): ``healthy`` 4 -> 4; ``slow-chained`` 4 -> 4
with a ``map_in_pandas`` step chained into consumer 2 sleeping ``--delay-us`` per row; ``skew`` key_by over a
column 80% of whose rows hold one key (the simulation gets each producer's shares per consumer); ``tight`` 4 -> 4
with 4 KiB segments and one buffer per channel; ``many-channels`` 8 -> 8 (64 channels, on ``local[8]`` slots);
all after a warm-up exchange that starts Spark's Python workers. Each simulation starts every subtask when the real
one started (its first timeline sample) and writes Spark's input batches whole; the throughput is taken over the
run's span, from the first start to the last end, on both sides. Changed settings: ``slow-chained`` with
``max_buffers_per_channel=2`` and ``healthy`` with ``segment_size=8kb``, each predicted from the default run's
calibration and run for real, and ``healthy`` at parallelism 8
(:func:`~spark_credit_shuffle.simulation.calibrate.with_parallelism`), held against a run of ``many-channels``.

Each run is simulated with each transport :func:`~spark_credit_shuffle.simulation.calibrate.fit_transport` fits
to the segments' hold time: ``bandwidth`` (the host's bytes per second, shared by its connections: a cost per byte)
and ``latency`` (each message's: a cost per buffer). Every case runs ``--repeat`` times (default 3; each repeat's
changed settings predicted from that repeat's default run): one run of an exchange of a few hundred milliseconds on
2 cores does not repeat within 25%, so each row holds the median of the measured figures and the median of the
predicted ones (each run's line, and its errors, go to stderr and into the JSON). Prints one row per case and
transport (measured, predicted, the error of each) and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

from spark_credit_shuffle.cli import conf_pair, job_session, positive_int
from spark_credit_shuffle.jobs.common import slow_on


def error(predicted: float, measured: float) -> float:
    """The prediction's relative error (0.1: 10% off); 0 when both are 0."""
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return (predicted - measured) / measured


#: The figures held against each other: the throughput, and the producers' back-pressure.
KEYS = ("throughput_mb_per_s", "producers_back_pressured_ms_per_s")


def describe(case: str, source: str, transport: str, real: dict[str, float], sim: dict[str, float]) -> str:
    """One printed line: the measured and the predicted figures, and the throughput's error."""
    mb, bp = KEYS
    return (
        f"{case:<40} {source:<34} {transport:<9} MB/s {real[mb]:>7.2f} -> {sim[mb]:>7.2f} "
        f"({error(sim[mb], real[mb]):+.0%})   bp ms/s {real[bp]:>6.0f} -> {sim[bp]:>6.0f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=positive_int, default=400_000, help="rows per exchange (400,000)")
    parser.add_argument("--delay-us", type=positive_int, default=50, help="the slow chained step's us per row")
    parser.add_argument("--repeat", type=positive_int, default=3, help="runs of every case (medians reported)")
    parser.add_argument("--master", default="local[8]", help="Spark master under plain python (local[8])")
    parser.add_argument("--conf", action="append", type=conf_pair, default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)

    from pyspark.sql import functions as F

    import spark_credit_shuffle as scs
    from spark_credit_shuffle.simulation.calibrate import (
        TRANSPORTS,
        from_exchange,
        measured,
        predicted,
        with_parallelism,
    )

    spark, created = job_session("spark_credit_shuffle calibration", args.master, args.conf)

    def data(parts: int) -> Any:
        return spark.range(0, args.rows, 1, parts).select(
            "id", (F.col("id") % 1000).alias("k"), F.lit("x" * 80).alias("pad")
        )

    schema = "id long, k long, pad string"
    slow = scs.map_in_pandas(slow_on(2, args.delay_us / 1e6), schema)
    skewed = spark.range(0, args.rows, 1, 4).select(
        "id",
        F.when(F.col("id") % 5 != 0, F.lit(7)).otherwise(F.col("id") % 1000).alias("k"),
        F.lit("x" * 80).alias("pad"),
    )
    cases: dict[str, Callable[..., Any]] = {
        "healthy": lambda **kw: scs.exchange(data(4), scs.rebalance(), 4, mode="pipelined", **kw),
        "slow-chained": lambda **kw: scs.exchange(data(4), scs.rebalance(), 4, mode="pipelined", after=slow, **kw),
        "skew": lambda **kw: scs.exchange(skewed, scs.key_by("k"), 4, mode="pipelined", **kw),
        "tight": lambda **kw: scs.exchange(
            data(4),
            scs.rebalance(),
            4,
            mode="pipelined",
            segment_size="4kb",
            max_buffers_per_channel=1,
            buffers_per_channel=1,
            **kw,
        ),
        "many-channels": lambda **kw: scs.exchange(data(8), scs.rebalance(), 8, mode="pipelined", **kw),
    }
    #: Changed settings: (the case calibrated, its settings changed, the parallelism; the case run for real).
    changed = [
        ("slow-chained", {"max_buffers_per_channel": 2}, None, "slow-chained"),
        ("healthy", {"segment_size": 8192}, None, "healthy"),
        ("healthy", {}, 8, "many-channels"),  # the same rows, 8 -> 8: what many-channels runs
    ]
    #: Per case and transport: the (measured, predicted) figures of each repeat.
    pairs: dict[tuple[str, str, str], list[tuple[dict[str, float], dict[str, float]]]] = {}

    def run(name: str, settings: dict[str, Any], points: dict[str, Any] | None, case: str | None = None) -> Any:
        ex = cases[name](**settings)
        count = ex.df.count()
        if count != args.rows:
            raise SystemExit(f"{name}: {count} rows came out of {args.rows}")
        real = measured(ex.summary_rows(), ex.timeline_rows())
        if case is None:
            case = name + (" " + ",".join(f"{k}={v}" for k, v in settings.items()) if settings else "")
        source = "its own run" if points is None else "the default run, settings changed"
        for transport in TRANSPORTS:
            calibrated = from_exchange(ex, transport=transport) if points is None else points[transport]
            sim = predicted(calibrated.run())
            pairs.setdefault((case, source, transport), []).append((real, sim))
            print(describe(case, source, transport, real, sim), file=sys.stderr, flush=True)
        return ex

    try:
        # Spark starts a Python worker per task slot the first time one is needed (about a second each here): a
        # warm-up exchange of the largest case first, so that the cases measure exchanges, not workers starting
        warm = cases["many-channels"]()
        warm.df.count()
        for _ in range(args.repeat):
            runs = {name: run(name, {}, None) for name in cases}
            for name, settings, parallelism, real_case in changed:
                points = {}
                for transport in TRANSPORTS:
                    point = from_exchange(runs[name], transport=transport)
                    point = dataclasses.replace(point, settings={**point.settings, **settings})
                    points[transport] = point if parallelism is None else with_parallelism(point, parallelism)
                label = None if parallelism is None else f"{name} parallelism={parallelism}"
                run(real_case, settings, points, label)
    finally:
        if created:
            spark.stop()
    rows: list[dict[str, Any]] = []
    for (case, source, transport), runs_of_case in pairs.items():
        row: dict[str, Any] = {"case": case, "from": source, "transport": transport, "repeats": len(runs_of_case)}
        real_median = {key: statistics.median(real[key] for real, _ in runs_of_case) for key in KEYS}
        sim_median = {key: statistics.median(sim[key] for _, sim in runs_of_case) for key in KEYS}
        for key in KEYS:
            row[f"measured_{key}"] = round(real_median[key], 2)
            row[f"predicted_{key}"] = round(sim_median[key], 2)
            row[f"error_{key}"] = round(error(sim_median[key], real_median[key]), 3)
            row[f"errors_{key}"] = [round(error(sim[key], real[key]), 3) for real, sim in runs_of_case]
        rows.append(row)
        print(describe(case, source, transport, real_median, sim_median), flush=True)
    within = {
        transport: [
            r["case"]
            for r in rows
            if r["transport"] == transport
            and abs(r["error_throughput_mb_per_s"]) <= 0.25
            and abs(r["predicted_producers_back_pressured_ms_per_s"] - r["measured_producers_back_pressured_ms_per_s"])
            <= 0.25 * max(r["measured_producers_back_pressured_ms_per_s"], 100.0)
        ]
        for transport in TRANSPORTS
    }
    print(json.dumps({"benchmark": "simulation_calibration", "rows": rows, "within_25_percent": within}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
