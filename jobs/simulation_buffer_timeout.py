"""The figure "throughput against buffer timeout" of Flink's network stack article ("A Deep-Dive into Flink's
Network Stack", flink.apache.org, 2019-06-05: Flink 1.5+ against Flink 1.4 at buffer timeouts 0, 1, 5, 10 and
100 ms), reproduced on the simulation's virtual clock.

A cluster of ``--hosts`` x ``--slots`` all-to-all (:mod:`spark_credit_shuffle.simulation.cluster`, where the
per-buffer and per-record costs and where they were measured are documented) runs at every timeout, once with
current Flink's flush (a slice of the open buffer) and once with Flink 1.4's (a flush finishes every open
buffer, and each buffer wakes the network thread). Prints the table, draws the figure (``--png``, default
docs/pictures/simulation_buffer_timeout.png) and, last, one JSON line of its headline figures: each model's
throughput at every timeout as a fraction of its 100 ms throughput.
"""

from __future__ import annotations

import argparse
import os
import sys

from spark_credit_shuffle.simulation.cluster import (
    FIGURE_TIMEOUTS_MS,
    buffer_timeout_figure,
    draw,
    dumps,
    headline,
    print_table,
)

PNG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "pictures")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument(
        "--window",
        type=float,
        default=0.05,
        help="virtual seconds of steady state per run, after a warm-up as long (both at least two timeouts)",
    )
    parser.add_argument(
        "--threading",
        choices=("netty", "loop"),
        default="netty",
        help="Flink's threads (default) or this package's one loop per task (see the module)",
    )
    parser.add_argument("--png", default=os.path.normpath(os.path.join(PNG, "simulation_buffer_timeout.png")))
    parser.add_argument("--no-png", action="store_true")
    args = parser.parse_args(argv)
    rows = buffer_timeout_figure(
        args.hosts, args.slots, timeouts_ms=FIGURE_TIMEOUTS_MS, window=args.window, threading=args.threading
    )
    print_table(rows)
    if not args.no_png:
        draw(rows, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    print(dumps({"simulation_buffer_timeout": headline(rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
