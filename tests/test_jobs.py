"""The jobs users run: each ``main(argv)`` returns an exit status and ends with one JSON line."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from pyspark.sql import functions as F
from spark_helpers import assert_same_rows, no_spark_jobs

JOBS = Path(__file__).resolve().parent.parent / "jobs"
PACKAGE_JOBS = Path(__file__).resolve().parent.parent / "spark_credit_shuffle" / "jobs"
PNG = b"\x89PNG\r\n\x1a\n"


def load_job(name: str):
    spec = importlib.util.spec_from_file_location(f"job_{name}", JOBS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_plan_job_says_whether_a_topology_fits(capsys):
    plan = load_job("plan")
    argv = ["--producers", "4", "--consumers", "4", "--partitioner", "hash", "--mode", "pipelined"]
    assert plan.main([*argv, "--executors", "2", "--slots", "4", "--network-memory", "64mb"]) == 0
    headline = last_json(capsys.readouterr().out)
    assert headline == {
        "fits": True,
        "required_buffers_per_executor": 4 * (5 + 0 + 1),  # all four tasks on one executor: local channels
        "max_buffers_per_executor": 4 * (16 + 0 + 8),
        "network_buffers_per_executor": 2048,
        "required_mib_per_executor": 0.75,
        "network_mib_per_executor": 64.0,
        "stages": 1,
    }
    too_small = [*argv, "--slots", "4", "--conf", "spark.creditShuffle.networkMemory=512kb"]
    assert plan.main(too_small) == 1
    out = capsys.readouterr().out
    assert last_json(out)["fits"] is False and "spark.creditShuffle.networkMemory" in out


def test_cli_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "spark_credit_shuffle", "plan", "--exchange", "4:8:hash:blocking", "--slots", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert last_json(result.stdout)["stages"] == 2
    bad = subprocess.run(
        [sys.executable, "-m", "spark_credit_shuffle", "plan", "--mode", "streaming"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "--mode" in bad.stderr


def test_multiplexing_demo_shows_what_credits_do(tmp_path, capsys):
    demo = load_job("multiplexing_demo")
    png = tmp_path / "mux.png"
    assert demo.main(["--duration", "0.3", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert [line[:5] for line in progress] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    headline = last_json(out)
    # without credits the slow receiver's neighbour is cut to about its pace; with credits it keeps its own
    assert headline["neighbour_share_without_credits"] < 0.2
    assert headline["neighbour_share_with_credits"] > 0.9
    assert headline["connection_pauses_without_credits"] > 0 == headline["connection_pauses_with_credits"]
    assert png.read_bytes().startswith(PNG)
    with pytest.raises(SystemExit):
        demo.main(["--slow-rate", "fast"])


def test_checkpoint_alignment_demo_measures_both_models_and_both_barrier_kinds(spark, tmp_path, capsys):
    demo = load_job("checkpoint_alignment_demo")
    png = tmp_path / "alignment.png"
    # 10 virtual seconds per simulation: every comparison below holds by a wide margin from the first seconds on
    # (deterministic), and the debloated buffer size has settled by the second half
    argv = ["--rows", "3000", "--delay-ms", "0.3", "--sim-duration", "10", "--png", str(png)]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    assert [line[:5] for line in out.splitlines() if line.startswith("[")] == ["[1/2]", "[2/2]"]
    headline = last_json(out)
    # without credits the unaligned barrier waits behind data in the paused connection; with credits it
    # overtakes (virtual time: deterministic)
    assert headline["sim_unaligned_credits_ms"] < headline["sim_unaligned_no_credits_ms"]
    assert headline["sim_slow_unaligned_credits_ms"] < headline["sim_slow_unaligned_no_credits_ms"]
    # aligned: without credits the data ahead of the barriers fills the connection
    assert headline["sim_slow_aligned_credits_ms"] < headline["sim_slow_aligned_no_credits_ms"]
    # buffer debloating shrinks what queues ahead of the slow consumer's barriers, and so their start delay
    delays = headline["sim_debloat_slow_start_delay_ms"]
    assert delays["100"] < delays["1000"] < delays["None"]
    sweep = list(headline["sim_socket_sweep_slow_aligned_ms"].values())
    assert all(credit < no_credit for credit, no_credit in sweep)
    # on Spark, the slow consumer completed checkpoints (how many of each kind depends on the machine's pace),
    # and their alignment, first barrier to last, was measured: it may be 0 ms, since the barriers that queued
    # in the gate behind the slow chained step are read one after the other once the step takes more input
    checkpoints = headline["spark_slow_checkpoints"]
    assert sum(checkpoints.values()) > 0, checkpoints
    for kind in ("aligned", "unaligned"):
        assert headline[f"spark_{kind}_slow_ms"] >= 0.0 and headline[f"spark_{kind}_slow_median_ms"] >= 0.0
    assert png.read_bytes().startswith(PNG)
    with pytest.raises(SystemExit):
        demo.main(["--delay-ms", "0"])


def test_protocol_benchmark_moves_every_buffer_and_reports_both_topologies(capsys):
    bench = load_job("bench_protocol")
    for variant in ("protocol", "byte_builder"):
        delivered, seconds, cpu = bench.run_exchange(4, 4, 50, variant=variant, encode=True)
        assert delivered == 200 and seconds > 0 and cpu > 0
    assert bench.main(["--buffers", "400", "--runs", "2", "--bytecodes"]) == 0
    out = capsys.readouterr().out
    headline = last_json(out)
    for key in ("protocol_handovers_per_s", "byte_builder_handovers_per_s", "bytecodes_per_handover"):
        assert set(headline[key]) == {"1->4", "4->4"} and all(rate > 0 for rate in headline[key].values())
    assert headline["target_handovers_per_s"] == 100_000
    # a loose guard against bookkeeping that grows per buffer (about 1,300 bytecodes per hand-over on 3.11)
    assert all(5 < calls < 100 for calls in headline["calls_per_handover"].values())
    assert headline["meets_target"] == (min(headline["protocol_handovers_per_s"].values()) >= 100_000)
    with pytest.raises(SystemExit):
        bench.main(["--variants", "fast"])


@pytest.mark.spark
@pytest.mark.parametrize(("mode", "metrics_file", "timeline_file"), [
    ("blocking", "metrics.csv", "timeline.json"),
    ("pipelined", "metrics.parquet", "timeline.csv"),
])  # fmt: skip
def test_exchange_job_writes_output_metrics_and_timeline(spark, tmp_path, capsys, mode, metrics_file, timeline_file):
    job = load_job("exchange_job")
    source = spark.range(0, 2000, 1, 2).select(
        F.col("id"),
        (F.col("id") % 13).cast("int").alias("k"),
        F.concat(F.lit("v"), F.col("id").cast("string")).alias("s"),
        F.timestamp_seconds(F.col("id") * 3600).alias("at"),  # a timestamp column, in the session time zone
    )
    source.write.parquet(str(tmp_path / "in.parquet"))
    argv = [
        "--input", str(tmp_path / "in.parquet"),
        "--partitioner", "hash:k",
        "--parallelism", "3",
        "--output", str(tmp_path / "out.parquet"),
        "--metrics", str(tmp_path / "written" / metrics_file),
        "--timeline", str(tmp_path / timeline_file),
        "--timeline-png", str(tmp_path / "timeline.png"),
        "--conf", "spark.creditShuffle.metricsSampleIntervalMs=5",
        "--mode", mode,
    ]  # fmt: skip
    assert job.main(argv) == 0
    headline = last_json(capsys.readouterr().out)
    assert headline["rows"] == 2000 and headline["consumers"] == 3 and headline["partitioner"] == "HASH"
    assert headline["timeline_samples"] >= 2 + 3  # at least the last sample of every side
    out = spark.read.parquet(str(tmp_path / "out.parquet"))
    assert_same_rows(out, source, ignore_nullable=True)
    read = {"csv": pd.read_csv, "json": lambda p: pd.read_json(p, lines=True), "parquet": pd.read_parquet}
    metrics_path, timeline_path = tmp_path / "written" / metrics_file, tmp_path / timeline_file
    assert metrics_path.is_file() and timeline_path.is_file()  # one file each, as named
    metrics = read[metrics_path.suffix[1:]](metrics_path)
    assert list(metrics.columns) == ["exchange", "mode", "side", "subtask", "channel", "metric", "stat", "value"]
    assert metrics[metrics.metric == "numRecordsIn"].value.sum() == 2000
    # channel is an integer column in every format (0, not 0.0), null where a row has no channel
    for path in (metrics_path, timeline_path):
        if path.suffix == ".parquet":
            assert str(pd.read_parquet(path)["channel"].dtype) in ("Int64", "Int32"), path
            continue
        if path.suffix == ".csv":
            channels = list(pd.read_csv(path, dtype=str)["channel"].dropna())
        else:  # JSON Lines, as written: pandas would read a column of numbers and nulls back as floats
            channels = [json.loads(line)["channel"] for line in path.read_text().splitlines()]
            channels = [c for c in channels if c is not None]
            assert all(isinstance(c, int) for c in channels), channels[:5]
        assert channels and all(str(c).isdigit() for c in channels), channels[:5]
    timeline = read[timeline_path.suffix[1:]](timeline_path)
    assert "time_ms" in timeline.columns and (timeline.stat == "sample").all()
    sides = set(zip(timeline.side, timeline.subtask))
    assert sides == {("producer", 0), ("producer", 1), ("consumer", 0), ("consumer", 1), ("consumer", 2)}
    assert (tmp_path / "timeline.png").read_bytes().startswith(PNG)
    # the job leaves the session as it found it
    assert spark.conf.get("spark.creditShuffle.metricsSampleIntervalMs", None) is None
    assert not spark.sparkContext._jsc.sc().isStopped()


@pytest.mark.spark
def test_exchange_job_refuses_bad_input_before_any_job(spark, capsys):
    job = load_job("exchange_job")
    with pytest.raises(SystemExit) as info:
        job.main(["--generate", "10", "--partitioner", "zigzag"])
    assert info.value.code == 2 and "partitioner" in capsys.readouterr().err
    for bad, meant in ((["--partitioner", "rebalanse"], "rebalance"), (["--mode", "pipelind"], "pipelined")):
        with pytest.raises(SystemExit) as info:
            job.main(["--generate", "10", *bad])
        assert info.value.code == 2 and f"did you mean '{meant}'?" in capsys.readouterr().err
    for bad in (["--metrics", "metrics/"], ["--timeline", "timeline.xlsx"]):
        with pytest.raises(SystemExit) as info:
            job.main(["--generate", "10", *bad])
        assert info.value.code == 2 and "a file name ending in .csv, .json, .parquet" in capsys.readouterr().err
    assert job.main(["--generate", "10", "--partitioner", "hash:user_id", "--parallelism", "300",
                     "--conf", "spark.creditShuffle.networkMemory=1mb"]) == 2  # fmt: skip
    assert "Insufficient number of network buffers" in capsys.readouterr().err
    assert spark.conf.get("spark.creditShuffle.networkMemory", None) is None


def test_exchange_job_runs_on_spark_connect(connect_spark, capsys):
    job = load_job("exchange_job")
    argv = ["--generate", "2000", "--partitioner", "hash:user_id", "--parallelism", "3", "--mode", "pipelined"]
    assert job.main(argv) == 0
    headline = last_json(capsys.readouterr().out)
    assert headline["rows"] == 2000 and headline["consumers"] == 3 and headline["producers"] == 2


def test_jobs_have_main_and_run_as_scripts():
    for path in (PACKAGE_JOBS / "exchange_job.py", PACKAGE_JOBS / "demo.py", JOBS / "multiplexing_demo.py"):
        text = path.read_text()
        assert "def main(argv: list[str] | None = None) -> int:" in text, path
        assert 'if __name__ == "__main__":\n    sys.exit(main())' in text, path
    for name in ("exchange_job", "demo"):  # the checkout's scripts run the package's jobs
        text = (JOBS / f"{name}.py").read_text()
        assert f"from spark_credit_shuffle.jobs.{name} import main" in text
        assert 'if __name__ == "__main__":\n    sys.exit(main())' in text
    # the jobs build their session with job_session, which sets a master only under plain python
    for path in (PACKAGE_JOBS / "exchange_job.py", PACKAGE_JOBS / "demo.py", JOBS / "slow_consumer_demo.py"):
        assert "job_session(" in path.read_text(), path
    assert "job_session(" in (PACKAGE_JOBS / "common.py").read_text()  # the benchmarks' sessions too
    assert "PYSPARK_GATEWAY_PORT" in (JOBS.parent / "spark_credit_shuffle" / "cli.py").read_text()
    assert os.access(JOBS / "plan.py", os.R_OK)


def test_no_script_imports_another_or_changes_the_module_path():
    """What the scripts share is in the package (spark_credit_shuffle.jobs): a script imports no other script,
    directly or through sys.path."""
    scripts = {path.stem for path in JOBS.glob("*.py")}
    for path in sorted(JOBS.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = {node.module.split(".")[0]}
            else:
                continue
            assert not names & scripts, f"{path.name} imports the script {names & scripts}"
        assert "sys.path" not in path.read_text(), path.name


@pytest.mark.spark
def test_jobs_refuse_a_picture_without_matplotlib_before_any_job(spark, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a machine without matplotlib has: no import
    cases = [
        ("exchange_job", ["--generate", "10", "--timeline-png", "t.png"], "--timeline-png"),
        ("checkpoint_alignment_demo", ["--png", "c.png"], "--png"),
        ("bench_exchange", ["--rows", "100"], "--png"),  # its sweep draws a picture by default
    ]
    with no_spark_jobs(spark):
        for name, argv, option in cases:
            job = load_job(name)
            with pytest.raises(SystemExit) as info:
                job.main(argv)
            err = capsys.readouterr().err
            assert info.value.code == 2, err
            assert f"{option} draws a picture, which needs matplotlib" in err
            assert "pip install 'spark-credit-shuffle[plot]'" in err


@pytest.mark.spark
def test_timeline_pictures_job_draws_the_live_and_the_after_run_timelines(spark, tmp_path, capsys):
    job = load_job("timeline_pictures")
    # 40,000 rows: consumer 0's share is several times what the buffers in flight hold, so its producers wait
    assert job.main(["--rows", "40000", "--delay-us", "50", "--out", str(tmp_path)]) == 0
    headline = last_json(capsys.readouterr().out)
    for name in ("pipelined_timeline", "pipelined_local_timeline", "blocking_timeline", "live_timeline"):
        assert (tmp_path / f"{name}.png").read_bytes().startswith(PNG), name
    assert headline["pipelined_local_timeline"]["verdict"] == "backpressure"
    assert headline["pipelined_local_timeline"]["origin"] == 0
    assert headline["live_timeline"]["draws"] >= 1


def test_path_floor_job_measures_the_lean_and_the_pipelined_path_side_by_side(capsys):
    job = load_job("bench_path_floor")
    for bad in (
        ["--parallelism", "1"],
        ["--parallelism", "21"],
        ["--master", "yarn"],
        ["--repeat", "0"],
        ["--calls", "--only-spark"],
    ):
        with pytest.raises(SystemExit) as refused:  # named before anything runs
            job.parse_args(bad)
        assert refused.value.code == 2 and bad[0] in capsys.readouterr().err
    # both paths fail the job if a row is lost or duplicated, counted runs too
    assert job.main(["--rows", "60000", "--repeat", "1", "--parallelism", "2", "3", "--calls"]) == 0
    headline = last_json(capsys.readouterr().out)
    for p in (2, 3):
        assert headline[f"p{p}_lean_core_us"] > 0 and headline[f"p{p}_lean_path_us"] > 0
        assert headline[f"p{p}_pipelined_core_us"] > 0 and headline[f"p{p}_pipelined_path_us"] > 0
        assert headline[f"p{p}_pipelined_vs_lean_path_ratio"] > 0
        assert headline[f"p{p}_pipelined_vs_lean_path_ratio_paired"] == pytest.approx(
            headline[f"p{p}_pipelined_path_us"] / headline[f"p{p}_lean_path_us"], rel=0.02
        )  # one round: its own ratio is the ratio of its figures
        # per row: the CPU for the same rows, each path's figure per buffer times its own buffers
        lean, pipelined = headline[f"p{p}_lean_buffers"], headline[f"p{p}_pipelined_buffers"]
        assert lean > 0 and pipelined > 0
        assert headline[f"p{p}_pipelined_vs_lean_path_ratio_per_row"] == pytest.approx(
            headline[f"p{p}_pipelined_path_us"] * pipelined / (headline[f"p{p}_lean_path_us"] * lean), rel=0.02
        )
        # Python calls per buffer: a path makes every call its core makes and more (sockets, the protocol)
        cases = ("lean_core", "lean_path", "pipelined_core", "pipelined_path")
        calls = {case: headline[f"p{p}_{case}_calls_per_buffer"] for case in cases}
        assert 0 < calls["lean_core"] < calls["lean_path"]
        assert 0 < calls["pipelined_core"] < calls["pipelined_path"]


@pytest.mark.spark
def test_path_floor_job_runs_the_lean_and_the_pipelined_path_in_spark_barrier_stages(spark, capsys):
    job = load_job("bench_path_floor")
    cached = spark.sparkContext._jsc.getPersistentRDDs().size()
    # every form of both paths first checks that each row arrived once (the job fails otherwise)
    figures = job.spark_floor(spark, 30_000, 2, 1, job.free_port_bases())
    headline: dict = {}
    job.print_spark_floor(figures, headline)
    out = capsys.readouterr().out
    for case in job.SPARK_CASES:
        assert figures["seconds"][case] > 0 and case in out
    assert set(figures["ratios"]) == {
        "lean_streaming_vs_mapinarrow_throughput",
        "lean_retryable_vs_reference_throughput",
        "pipelined_streaming_vs_mapinarrow_throughput",
        "pipelined_retryable_vs_reference_throughput",
        "pipelined_streaming_vs_lean_throughput",
        "pipelined_retryable_vs_lean_throughput",
    }
    assert headline["spark_lean_streaming_vs_mapinarrow_throughput_ratio"] > 0
    # one round: its own ratios are the ratios of its figures
    assert figures["ratios_paired"] == pytest.approx(figures["ratios"])
    assert headline["spark_pipelined_streaming_vs_lean_throughput_ratio_paired"] > 0
    # every case's CPU of the Python workers is read (a reading is /proc's 10 ms ticks, and a worker that ended
    # between two readings takes its CPU with it, so one small case may read 0); together they did the work
    cpu = figures["cpu_python_s"]
    assert set(cpu) == set(job.SPARK_CASES) and all(0 <= s < 600 for s in cpu.values()), cpu
    assert sum(cpu.values()) > 0, cpu
    per_buffer = figures["pipelined_streaming_us_per_buffer"]
    assert per_buffer["buffers"] > 0 and per_buffer["loop thread"] > 0 and per_buffer["output thread"] > 0
    assert per_buffer["task"] >= per_buffer["loop thread"]
    assert spark.sparkContext._jsc.getPersistentRDDs().size() == cached  # its data is not left cached


def test_pipelined_path_job_measures_every_thread_and_stage_of_an_exchange_between_processes(capsys):
    job = load_job("bench_pipelined_path")
    # 3 tasks in processes of their own; the job itself fails if a row is lost or duplicated
    assert job.main(["--tasks", "3", "--rows", "30000", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    headline = last_json(out)
    assert headline["tasks"] == 3 and headline["buffers"] > 0 and headline["buffers_remote"] > 0
    for thread in ("input_thread", "loop_thread", "output_thread"):
        assert headline[f"us_per_buffer_{thread}"] > 0
    assert headline["us_per_buffer_total"] >= headline["us_per_buffer_loop_thread"]
    for stage in ("producer: slice + IPC write", "receiver: decode frames", "consumer: decode (RecordReader)"):
        assert stage in out


def test_diagnosis_matrix_runs_its_cases_and_says_how_often_each_was_right(spark, capsys):
    job = load_job("diagnosis_matrix")
    headline = job.main(["--case", "producer", "--rows", "40000", "--repeat", "1"])
    out = capsys.readouterr().out
    assert last_json(out) == headline and headline["runs"] == 1
    assert set(headline["right"]) == {"producer"} and "round 1 producer" in out
    # each run's line: its verdict, origin and every subtask's busy / idle / back-pressured time (the verdicts
    # themselves are tests/test_backpressure_origin.py's)
    line = next(text for text in out.splitlines() if text.startswith("round 1 producer"))
    assert " origin=" in line and all(f"{side}{i}:" in line for side in "pc" for i in range(4)), line


def test_job_path_prints_the_file_of_a_package_job_for_spark_submit():
    for name, module in (("exchange", "exchange_job"), ("demo", "demo")):
        result = subprocess.run(
            [sys.executable, "-m", "spark_credit_shuffle", "job-path", name],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert Path(result.stdout.strip()) == PACKAGE_JOBS / f"{module}.py"
    bad = subprocess.run(
        [sys.executable, "-m", "spark_credit_shuffle", "job-path", "exchang"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "did you mean 'exchange'?" in bad.stderr
