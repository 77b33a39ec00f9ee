"""The exchange job from an installed wheel: built from the package's files alone, installed into a virtual
environment of its own, found with ``job-path`` and run by ``spark-submit`` from a directory outside the
checkout, as a user of the published package runs it (docs/jobs.md, "Jobs")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pyspark
import pytest
from spark_helpers import TEST_JVM_OPTIONS

import spark_credit_shuffle as scs

ROOT = Path(__file__).resolve().parent.parent
ROWS = 3000


def _run(command: list, **kwargs) -> str:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=180, **kwargs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.spark
def test_the_exchange_job_runs_with_spark_submit_from_an_installed_wheel(tmp_path):
    # the wheel, built from a copy of what it is built from (the build leaves nothing in the checkout)
    source = tmp_path / "source"
    shutil.copytree(
        ROOT / "spark_credit_shuffle", source / "spark_credit_shuffle", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", source, "--no-deps", "--no-build-isolation", "-w", tmp_path / "wheels"])
    (wheel,) = (tmp_path / "wheels").glob("spark_credit_shuffle-*.whl")

    # a fresh environment that sees the tests' pyspark, pyarrow and pandas (a .pth file, as --system-site-packages
    # would) and holds the package from the wheel only
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel])

    elsewhere = tmp_path / "elsewhere"  # not the checkout: nothing found through the current directory
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYSPARK_GATEWAY_PORT", "SPARK_HOME")}
    env.update(
        PYSPARK_PYTHON=str(python),
        PYSPARK_DRIVER_PYTHON=str(python),
        SPARK_HOME=str(Path(pyspark.__file__).parent),
        SPARK_LOCAL_IP="127.0.0.1",
    )
    where = _run(
        [python, "-c", "import spark_credit_shuffle; print(spark_credit_shuffle.__file__)"], cwd=elsewhere, env=env
    )
    assert Path(where.strip()).is_relative_to(venv), where
    job = Path(_run([python, "-m", "spark_credit_shuffle", "job-path", "exchange"], cwd=elsewhere, env=env).strip())
    assert job.is_relative_to(venv) and job.is_file(), job

    out = tmp_path / "out.parquet"
    spark_submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    stdout = _run(
        [
            spark_submit, "--master", "local[2]", "--conf", "spark.ui.enabled=false",
            "--driver-java-options", TEST_JVM_OPTIONS,
            job, "--generate", ROWS, "--partitioner", "hash:user_id", "--parallelism", 2, "--output", out,
        ],
        cwd=elsewhere,
        env=env,
    )  # fmt: skip
    headline = json.loads(stdout.strip().splitlines()[-1])
    assert (headline["rows"], headline["producers"], headline["consumers"]) == (ROWS, 2, 2), headline

    # the rows exactly, each in the output partition of the consumer Flink's key groups send its key to
    files = sorted(out.glob("part-*.parquet"))
    got = pa.concat_tables(pq.read_table(f) for f in files).sort_by("seq")
    assert got.column_names == ["user_id", "seq", "payload"]
    assert got.column("seq").to_pylist() == list(range(ROWS))
    assert got.column("user_id").to_pylist() == [i % 1000 for i in range(ROWS)]
    assert got.column("payload").to_pylist() == [f"event-{i}" for i in range(ROWS)]
    for f in files:
        consumer = int(f.name.split("-")[1])
        keys = pq.read_table(f).column("user_id").combine_chunks()
        assert set(scs.key_group_channels(keys, 2, 128).tolist()) <= {consumer}, f.name
