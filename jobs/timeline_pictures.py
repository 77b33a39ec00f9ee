"""Pictures of exchanges as users see them: the live timeline a notebook cell shows while an exchange runs,
and the timelines after the run, pipelined (local and remote channels) and blocking.

Consumer subtask 0 of each exchange runs a slow step of the user's, chained into its task
(``map_in_pandas``, ``--delay-us`` per row), so backpressure shows: the producers' pools fill, their
back-pressured time climbs into Flink's HIGH band, and ``diagnose()`` names consumer 0.
Writes into ``--out`` (default ``docs/pictures``):

- ``live_timeline.png``: the last drawing of :class:`~spark_credit_shuffle.plot.LiveTimeline`, the monitor
  callback that redraws a notebook cell while the exchange runs (here: the figure that cell showed last);
- ``pipelined_timeline.png``: the same exchange's timeline after the run, every channel between tasks remote
  (``local_channels="task"``), so credits and floating buffers show;
- ``pipelined_local_timeline.png``: the default, where every channel of one executor is local (no credit: the
  producer's pool fills instead);
- ``blocking_timeline.png``: blocking mode, its producer and consumer stages marked.

Prints each exchange's diagnosis and, as its last line, one JSON object with the files and verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from spark_credit_shuffle.cli import conf_pair, positive_int, require_plotting
from spark_credit_shuffle.jobs.common import slow_on


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=positive_int, default=60_000, help="rows of the input (default 60,000)")
    parser.add_argument("--delay-us", type=positive_int, default=100, help="consumer 0's time per row (100 us)")
    parser.add_argument("--out", default="docs/pictures", help="directory for the PNGs (default docs/pictures)")
    parser.add_argument("--master", help="Spark master under plain python (default local[4])")
    parser.add_argument("--conf", action="append", type=conf_pair, default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    require_plotting(parser, "this job", True)
    os.environ.setdefault("MPLBACKEND", "Agg")

    from pyspark.sql import functions as F

    import spark_credit_shuffle as scs
    from spark_credit_shuffle.cli import job_session
    from spark_credit_shuffle.plot import LiveTimeline, plot_timeline

    spark, created = job_session("spark_credit_shuffle timeline pictures", args.master or "local[4]", args.conf)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df = spark.range(0, args.rows, 1, 2).select("id", (F.col("id") % 101).cast("int").alias("k"))
    slow = scs.map_in_pandas(slow_on(0, args.delay_us / 1e6), "id long, k int")
    headline: dict[str, object] = {}
    try:
        live = LiveTimeline(title="live: consumer 0 slowed, as the notebook cell shows it", every_s=1.0)
        cases = [
            ("pipelined_timeline", "pipelined", {"local_channels": "task"}, live),
            ("pipelined_local_timeline", "pipelined", {}, None),
            ("blocking_timeline", "blocking", {}, None),
        ]
        for name, mode, settings, monitor in cases:
            ex = scs.exchange(
                df, scs.rebalance(), 2, mode=mode, after=slow, segment_size="4kb", monitor=monitor, **settings
            )
            ex.df.write.format("noop").mode("overwrite").save()  # ex.df: the output of the chained step
            diagnosis = ex.diagnose()
            print(f"{name}: {diagnosis}")
            title = f"{ex.plan.describe()}; a step chained into consumer 0 at {args.delay_us} us per row"
            plot_timeline(ex, title=title, path=out / f"{name}.png")
            headline[name] = {"png": str(out / f"{name}.png"), "verdict": diagnosis.verdict, "origin": diagnosis.origin}
        if live.figure is not None:  # the cell's last drawing while the exchange ran
            live.figure.savefig(out / "live_timeline.png", dpi=110, bbox_inches="tight")
            headline["live_timeline"] = {"png": str(out / "live_timeline.png"), "draws": live.num_draws}
    finally:
        if created:
            spark.stop()
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
