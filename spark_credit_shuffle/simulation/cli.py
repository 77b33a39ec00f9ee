"""``python -m spark_credit_shuffle simulate``: a cluster of hosts x slots all-to-all on the virtual clock at
one or more buffer timeouts (:mod:`.cluster`), for current Flink, Flink 1.4 or both; prints a table and, last,
one JSON line of its figures; ``--png`` draws throughput against buffer timeout. Long runs print a progress
line (virtual time done, wall time left) on stderr."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .cluster import FIGURE_TIMEOUTS_MS, buffer_timeout_figure, draw, dumps, headline, print_table

__all__ = ["main", "parser"]


def _timeouts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers (ms), got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"timeouts >= 0 ms, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spark-credit-shuffle simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4, help="hosts (default 4)")
    p.add_argument("--slots", type=int, default=4, help="slots per host: producers and consumers each (default 4)")
    p.add_argument(
        "--timeout-ms",
        type=_timeouts,
        default=list(FIGURE_TIMEOUTS_MS),
        help="buffer timeout(s) in ms, comma-separated (default 0,1,5,10,100)",
    )
    p.add_argument(
        "--flush-model", choices=("1.5", "1.4", "both"), default="1.5", help="Flink 1.5+ (default), 1.4 or both"
    )
    p.add_argument(
        "--threading",
        choices=("netty", "loop"),
        default="netty",
        help="who pays for a buffer: Flink's threads (netty, default: the task writes records, a network thread per "
        "slot cuts and sends the buffers) or this package's runtime (loop: the task's loop does both)",
    )
    p.add_argument(
        "--window",
        type=float,
        default=0.05,
        help="virtual seconds of steady state each throughput is measured over, after a warm-up as long (both at "
        "least two timeouts; default 0.05)",
    )
    p.add_argument("--png", default=None, help="draw throughput against buffer timeout into this PNG")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.hosts < 1 or args.slots < 1 or not args.window > 0:
        print("simulate: --hosts, --slots >= 1 and --window > 0", file=sys.stderr)
        return 2
    models = ("1.5", "1.4") if args.flush_model == "both" else (args.flush_model,)
    rows = buffer_timeout_figure(
        args.hosts,
        args.slots,
        timeouts_ms=args.timeout_ms,
        flush_models=models,
        window=args.window,
        progress=not args.quiet,
        threading=args.threading,
    )
    print_table(rows)
    if args.png:
        draw(rows, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    print(dumps({"simulate": headline(rows)}))
    return 0
