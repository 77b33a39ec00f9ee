"""The command line, ``spark-credit-shuffle`` (also ``python -m spark_credit_shuffle``), and the argument types
and SparkSession (:func:`job_session`) it shares with the jobs (:mod:`.jobs`, ``jobs/``).

Its ``plan`` subcommand prints the network buffers and memory a topology needs per task and per executor,
and whether it fits: one row per stage, a summary, and as its last line one JSON object with the headline
figures. Exit status: 0 if the topology fits, 1 if it does not, 2 for invalid arguments (the message names
the argument or setting, what is allowed and, for a misspelt word, the one probably meant). Defaults are
those of ``exchange()`` (mode ``blocking``). ``--help`` text is plain: no markup, the installed command's
name (:data:`PROG`).

Its ``job-path`` subcommand prints the file of one of the package's jobs (:mod:`.jobs`) in the installed
package: ``spark-submit`` runs a file, not a module, so ``spark-submit $(spark-credit-shuffle job-path
exchange) ...`` runs the exchange job from an installed wheel. Its ``sweep`` subcommand runs a grid of
simulations (:mod:`.simulation.sweep`), on Spark or in this process.

The argument types turn a bad value into ``argparse.ArgumentTypeError`` saying what is allowed (and, for a
word close to an allowed one, "did you mean"), so argparse reports it with the option's name and exits with
status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .config import CONF_PREFIX, NetworkConfig, has_conf_prefix
from .errors import ConfigError, PartitionerError, suggest
from .jobs import JOBS, job_path

__all__ = [
    "PROG",
    "build_parser",
    "choice",
    "conf_pair",
    "job_session",
    "main",
    "plan_from_args",
    "positive_int",
    "require_plotting",
]


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of rows, tasks, rounds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}: allowed is an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {value}: allowed is an integer >= 1")
    return value


def choice(*allowed: str) -> Callable[[str], str]:
    """An argument type taking one of the words ``allowed`` (any case, returned as spelled in ``allowed``):
    argparse's own ``choices`` says only "invalid choice", this also says which word was probably meant.
    Pass the same words as ``choices=`` too, so that ``--help`` lists them."""
    by_lower = {word.lower(): word for word in allowed}

    def parse(text: str) -> str:
        word = by_lower.get(text.strip().lower())
        if word is not None:
            return word
        message = f"invalid value {text!r}: allowed is " + ", ".join(repr(w) for w in allowed)
        nearest = suggest(text, allowed)
        if nearest is not None:
            message += f"; did you mean {nearest!r}?"
        raise argparse.ArgumentTypeError(message)

    parse.__name__ = "one of " + ", ".join(allowed)  # argparse names a type by it in some messages
    return parse


def conf_pair(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` of ``--conf``: a Spark setting or an exchange setting (conf key or keyword name)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"invalid --conf {text!r}: allowed is KEY=VALUE, e.g. {CONF_PREFIX}buffersPerChannel=4 or "
            f"buffers_per_channel=4"
        )
    return key.strip(), value.strip()


def require_plotting(parser: argparse.ArgumentParser, option: str, value: object) -> None:
    """Exit with status 2 (argparse's usage error) if ``option`` asks for a picture (``value`` set) and matplotlib
    is not installed: checked with the arguments, before the job runs anything."""
    if not value:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.exit(
            2,
            f"{parser.prog}: error: {option} draws a picture, which needs matplotlib: pip install "
            f"'spark-credit-shuffle[plot]' (or pip install matplotlib), or leave {option} out\n",
        )


def job_session(
    app_name: str,
    master: str,
    conf: Iterable[tuple[str, str]] = (),
    *,
    local_conf: Iterable[tuple[str, str]] = (),
    quick_start: bool = True,
    log_level: str = "WARN",
) -> tuple[Any, bool]:
    """A job's SparkSession and whether the job created it (and so stops it at its end).

    The active session (a notebook's, a test's, ``spark-submit``'s) is used as it is. Otherwise one is built
    with ``conf``; under plain ``python``, where nobody chose a master, on ``master`` with ``local_conf`` too (a
    benchmark's driver memory, its UI off) and a quiet driver. ``quick_start``: that local driver's JVM starts
    fast (the first JIT tier only, the serial collector), which suits a short job, not a benchmark timing the
    JVM's share of the work. ``log_level``: Spark's log level of the session (not on Spark Connect).
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from .runtime.session import spark_context

    existing = SparkSession.getActiveSession()
    if existing is not None:
        return existing, False
    builder = SparkSession.builder.appName(app_name)
    if not os.environ.get("PYSPARK_GATEWAY_PORT"):  # plain python: nobody chose a master
        builder = (
            builder.master(master)
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.adaptive.enabled", "false")
        )
        if quick_start:
            builder = builder.config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        for key, value in local_conf:
            builder = builder.config(key, value)
    for key, value in conf:
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    sc = spark_context(spark)
    if sc is not None:  # Spark Connect: the log level is the server's
        sc.setLogLevel(log_level)
    return spark, True


#: The installed command's name, as ``--help`` and error messages show it.
PROG = "spark-credit-shuffle"
#: The modes of an exchange; the first is ``exchange()``'s default, and so the command's.
MODES = ("blocking", "pipelined")
DESCRIPTION = "The network buffers and memory of credit-based exchanges between Spark tasks, planned before launch."
PLAN_EXAMPLE = f"""example:
  {PROG} plan --producers 4 --consumers 4 --partitioner hash --mode pipelined \\
      --executors 2 --slots 4 --network-memory 64mb

Prints one row per stage (tasks, buffers one executor reserves at worst, memory, verdict), a summary,
and as its last line one JSON object with the headline figures. Exit status: 0 if the topology fits,
1 if it does not, 2 for invalid arguments."""


JOB_PATH_EXAMPLE = f"""example:
  spark-submit $({PROG} job-path exchange) --generate 100000 --partitioner hash:user_id --parallelism 4"""


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The planner's options (shared by the CLI and jobs/plan.py)."""
    from .planner import PATTERNS

    topo = parser.add_argument_group("topology (one exchange, or several with --exchange)")
    topo.add_argument("--producers", type=positive_int, default=4, help="producer subtasks (default 4)")
    topo.add_argument("--consumers", type=positive_int, default=None, help="consumer subtasks (default: --producers)")
    topo.add_argument(
        "--partitioner",
        default="hash",
        help="partitioner or pattern: " + ", ".join(PATTERNS) + " (default hash)",
    )
    topo.add_argument(
        "--mode",
        type=choice(*MODES),
        choices=MODES,
        default=MODES[0],
        help=f"exchange mode (default {MODES[0]}, as exchange())",
    )
    topo.add_argument(
        "--exchange",
        action="append",
        metavar="P:C[:PARTITIONER[:MODE]]",
        help="an exchange of the topology, e.g. 4:8:hash:pipelined (mode default blocking); repeat for several "
        "(replaces --producers/--consumers/--partitioner/--mode)",
    )
    topo.add_argument(
        "--chain",
        action="store_true",
        help="consecutive exchanges share tasks (consumer i of one is producer i of the next)",
    )
    ex = parser.add_argument_group("executors")
    ex.add_argument("--executors", type=positive_int, default=None, help="number of executors (default 1)")
    ex.add_argument("--slots", type=positive_int, default=None, help="task slots per executor (default 1)")
    ex.add_argument("--network-memory", default=None, help="network memory per executor, e.g. 64mb (default 64 MiB)")
    cfg = parser.add_argument_group("network settings")
    cfg.add_argument("--segment-size", default=None, help="bytes per network buffer, e.g. 32kb")
    cfg.add_argument("--buffers-per-channel", default=None, help="exclusive buffers per remote channel (2)")
    cfg.add_argument("--floating-buffers-per-gate", default=None, help="floating buffers per input gate (8)")
    cfg.add_argument(
        "--conf",
        action="append",
        type=conf_pair,
        default=[],
        metavar="KEY=VALUE",
        help=f"any setting, as {CONF_PREFIX}<name>=value or <python_name>=value; repeatable",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--tasks", action="store_true", help="also print one row per task")


def config_from_args(args: argparse.Namespace, base: dict[str, Any] | None = None) -> NetworkConfig:
    """The NetworkConfig of ``base`` (a Spark conf) with --conf and the explicit flags applied."""
    conf: dict[str, str] = dict(base or {})
    overrides: dict[str, Any] = {}
    names = NetworkConfig.settings()
    for key, value in args.conf:
        if has_conf_prefix(key):
            conf[key] = value
        elif key in names:
            overrides[key] = value
        else:
            conf[CONF_PREFIX + key] = value  # unknown: NetworkConfig names the known settings
    for name in ("segment_size", "buffers_per_channel", "floating_buffers_per_gate", "network_memory"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return NetworkConfig.from_conf(conf, **overrides)


def plan_from_args(args: argparse.Namespace, config: NetworkConfig, executors: Any = None):
    """The NetworkPlan the parsed arguments describe."""
    from .planner import ExchangeSpec, Executors, plan_network

    if args.exchange:
        specs = [ExchangeSpec.parse(text) for text in args.exchange]
    else:
        consumers = args.consumers if args.consumers is not None else args.producers
        specs = [ExchangeSpec(args.producers, consumers, args.partitioner, args.mode)]
    if executors is None:
        executors = Executors(args.executors or 1, args.slots or 1)
    else:
        executors = Executors(args.executors or executors.count, args.slots or executors.slots)
    return plan_network(specs, executors, config, chain=args.chain)


def print_plan(plan: Any, show_tasks: bool = False, out: Any = None) -> None:
    """The stage table, optionally the task table, and the summary."""
    import pandas as pd

    out = out or sys.stdout
    with pd.option_context("display.width", 200, "display.max_columns", 50, "display.max_colwidth", 60):
        columns = [
            "stage",
            "tasks",
            "tasks_per_executor",
            "buffers_per_task",
            "required_per_executor",
            "max_per_executor",
            "network_buffers",
            "required_mib",
            "network_mib",
            "fits",
        ]
        print(plan.stages_table()[columns].to_string(index=False), file=out)
        if show_tasks:
            tasks = plan.tasks().drop(columns=["required_bytes", "max_bytes"])
            print("", file=out)
            print(tasks.to_string(index=False), file=out)
    print("", file=out)
    print(plan.summary(), file=out)


def build_parser() -> argparse.ArgumentParser:
    """The command's parser: ``plan`` and its options, ``--version``."""
    from . import __version__

    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"spark-credit-shuffle {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    plan = commands.add_parser(
        "plan",
        help="network buffers and memory a topology needs per task and per executor, and whether it fits",
        description="Network buffers and memory a topology of exchanges needs per task and per executor "
        "(Flink's pool sizing rules), and whether it fits the executors' network memory.",
        epilog=PLAN_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_plan_arguments(plan)
    job_path = commands.add_parser(
        "job-path",
        help="the file of one of the package's jobs, for spark-submit (which runs a file, not a module)",
        description="Prints the file of one of the package's jobs in the installed package, for spark-submit.",
        epilog=JOB_PATH_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    job_path.add_argument("job", type=choice(*JOBS), choices=tuple(JOBS), help="the job: " + ", ".join(JOBS))
    commands.add_parser(
        "simulate",
        add_help=False,
        help="the simulation's cluster (hosts x slots, all-to-all) at buffer timeouts, Flink 1.5+ and 1.4: a table, "
        "a JSON line, --png (its options: spark-credit-shuffle simulate --help)",
    ).add_argument("options", nargs=argparse.REMAINDER)
    sweep = commands.add_parser(
        "sweep",
        help="a grid of simulations on the virtual clock, one per Spark task, and their headline figures",
        description="Runs a grid of simulations (the product of the --axis values over the --set base), one per "
        "Spark task (or in this process with --local), and prints their figures: a table, then one JSON line.",
        epilog=SWEEP_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep.add_argument(
        "--set",
        action="append",
        type=_name_value,
        default=[],
        metavar="NAME=VALUE",
        help="a setting of NetworkConfig or an argument of simulate() for every point (VALUE as JSON: 4, 20e6, "
        "[5e6, 40e6], true; anything else is a string); repeat for several",
    )
    sweep.add_argument(
        "--axis",
        action="append",
        type=_axis,
        default=[],
        metavar="NAME=V1,V2,...",
        help="the values one setting or argument takes across the grid (or NAME=[JSON list]); repeat for several",
    )
    sweep.add_argument("--local", action="store_true", help="run the points in this process, without Spark")
    sweep.add_argument("--master", default="local[2]", help="Spark master under plain python (default local[2])")
    sweep.add_argument("--png", metavar="PATH", help="draw --y against the first axis, one line per second-axis value")
    sweep.add_argument("--y", default="throughput_mb_per_s", help="the figure --png draws (default throughput)")
    return parser


SWEEP_EXAMPLE = f"""example:
  {PROG} sweep --set num_producers=4 --set num_consumers=4 --set producer_rate=20e6 \\
      --set consumer_rate=40e6 --set duration=0.2 --axis buffer_timeout_ms=0,1,10,100 --axis credit_based=true,false"""


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _name_value(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name.strip(), _json_or_text(value.strip())


def _axis(text: str) -> tuple[str, list[Any]]:
    name, value = _name_value(text)
    values = value if isinstance(value, list) else [_json_or_text(v.strip()) for v in str(value).split(",")]
    if not values or any(v == "" for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: an axis takes at least one value, comma-separated")
    return name, values


def run_sweep(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The ``sweep`` subcommand: the grid checked before anything runs, then run and printed."""
    from .simulation.sweep import grid, run_points, sweep, sweep_frame

    try:
        points = grid(dict(args.set), **dict(args.axis))
    except ConfigError as e:
        parser.exit(2, f"{parser.prog} sweep: error: {e}\n")
    if args.local:
        frame = sweep_frame(run_points(points))
    else:
        from .cli import job_session

        spark, created = job_session("spark_credit_shuffle sweep", args.master, [])
        try:
            frame = sweep_frame(sweep(spark, points))
        finally:
            if created:
                spark.stop()
    print(frame.drop(columns=["label"]).to_string(index=False))
    if args.png:
        from .plot import plot_sweep

        axes = [name for name, _ in args.axis]
        plot_sweep(frame, axes[0] if axes else "index", args.y, hue=axes[1] if len(axes) > 1 else None, path=args.png)
    headline = {
        "command": "sweep",
        "points": len(points),
        "units": {"throughput_mb_per_s": "MB/s", "producers_back_pressured_ms_per_s": "ms/s", "wall_s": "s"},
        "rows": json.loads(frame.to_json(orient="records")),
    }
    print(json.dumps(headline))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command on ``argv`` (default: the process's arguments); the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["simulate"]:  # its own options (spark_credit_shuffle.simulation.cli)
        from .simulation.cli import main as simulate

        return simulate(arguments[1:])
    parser = build_parser()
    args = parser.parse_args(arguments)
    if args.command == "job-path":
        print(job_path(args.job))
        return 0
    if args.command == "sweep":
        return run_sweep(args, parser)
    try:
        config = config_from_args(args)
        plan = plan_from_args(args, config)
    except (ConfigError, PartitionerError) as e:
        parser.exit(2, f"{parser.prog} {args.command}: error: {e}\n")
    print_plan(plan, args.tasks)
    print(json.dumps(plan.headline()))
    return 0 if plan.fits else 1
