"""What an installed package promises: the pyspark it needs, checked at import, and its command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

from spark_credit_shuffle._pyspark import MIN_PYSPARK, check_pyspark

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **env},
    )


def test_the_minimum_pyspark_is_the_one_the_extras_and_the_readme_name():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    minimum = ".".join(map(str, MIN_PYSPARK))
    assert f"pyspark>={minimum},<5" in project["optional-dependencies"]["spark"]
    dev = project["optional-dependencies"]["dev"]
    assert any(r.startswith("pyspark") and r.endswith(f">={minimum},<5") for r in dev)
    assert f"pyspark {minimum} or later" in (ROOT / "README.md").read_text()
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()


def test_the_version_check():
    for fine in (None, "4.0.0", "4.0.1", "4.0.0.dev2", "4.3.0", "5.0.0"):
        check_pyspark(fine)
    for old in ("3.5.1", "3.3.0", "2.4.8"):
        with pytest.raises(ImportError, match=rf"needs pyspark >= 4\.0, but pyspark {old} is installed"):
            check_pyspark(old)


def test_importing_with_an_older_pyspark_installed_fails_with_a_clear_message(tmp_path):
    info = tmp_path / "pyspark-3.5.1.dist-info"  # what pip leaves behind for pyspark 3.5.1
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pyspark\nVersion: 3.5.1\n")
    result = run_python("import spark_credit_shuffle", PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    assert result.returncode != 0
    assert "ImportError: spark_credit_shuffle needs pyspark >= 4.0, but pyspark 3.5.1 is installed" in result.stderr


def test_the_pure_python_parts_import_without_pyspark():
    result = run_python(
        """
        import importlib.metadata as metadata
        import sys

        real_version = metadata.version

        def version(name):  # as if pyspark were not installed
            if name == "pyspark":
                raise metadata.PackageNotFoundError(name)
            return real_version(name)

        metadata.version = version
        sys.modules["pyspark"] = None
        import pyarrow as pa
        import spark_credit_shuffle as scs

        print(scs.key_group_channels(pa.array(["hello", "flink"]), 4, 128).tolist())
        spec = scs.ExchangeSpec(producers=4, consumers=4, partitioner="hash", mode="pipelined")
        print(scs.plan_network(spec, scs.Executors(count=2, slots=4, network_memory="64mb")).fits)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[1, 3]", "True"]


def test_the_installed_console_script_runs_the_planner():
    script = Path(sys.executable).parent / "spark-credit-shuffle"
    assert script.exists(), "reinstall the package (make .venv/.installed) to get its console script"
    result = subprocess.run(
        [str(script), "plan", "--producers", "4", "--consumers", "4", "--partitioner", "hash", "--mode", "pipelined",
         "--executors", "2", "--slots", "4", "--network-memory", "64mb"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    headline = json.loads(result.stdout.strip().splitlines()[-1])
    import spark_credit_shuffle as scs

    spec = scs.ExchangeSpec(producers=4, consumers=4, partitioner="hash", mode="pipelined")
    plan = scs.plan_network(spec, scs.Executors(count=2, slots=4, network_memory="64mb"))
    assert headline["fits"] is True and headline["required_buffers_per_executor"] == plan.required_per_executor


def test_the_console_script_reports_the_version():
    import spark_credit_shuffle as scs

    script = Path(sys.executable).parent / "spark-credit-shuffle"
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"spark-credit-shuffle {scs.__version__}"


def _tree(root: Path, top: str) -> set[str]:
    return {
        str(p.relative_to(root))
        for p in (root / top).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts and p.suffix != ".pyc"
    }


def test_the_sdist_carries_everything_its_tests_need_and_the_pandas_bound(tmp_path):
    import tarfile

    result = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (sdist,) = tmp_path.glob("spark_credit_shuffle-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        top = names[0].split("/")[0]
        members = {n.split("/", 1)[1] for n in names if "/" in n}
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()  # type: ignore[union-attr]
    needed = _tree(ROOT, "tests") | _tree(ROOT, "jobs") | _tree(ROOT, "notebooks") | _tree(ROOT, "docs")
    assert {"tests/conftest.py", "tests/spark_helpers.py", "tests/protocol/protocol_helpers.py"} <= needed
    assert needed - members == set()
    requires = [line for line in pkg_info.splitlines() if line.startswith("Requires-Dist: pandas") and ";" not in line]
    assert requires == ["Requires-Dist: pandas<3,>=2.0"], requires


def test_importing_the_package_changes_nothing_in_pyspark_until_asked():
    """A library's import is no place to patch another library: ``import spark_credit_shuffle`` imports neither
    pyspark nor pyarrow nor pandas, using its names leaves PySpark's DataFrame classes as they were, and only
    ``install_dataframe_method()`` adds ``creditShuffle``."""
    result = run_python(
        """
        import json, sys

        import spark_credit_shuffle as scs

        heavy = ("pyspark", "py4j", "pyarrow", "pandas", "numpy")
        loaded = sorted(name for name in sys.modules if name.split(".")[0] in heavy)
        from pyspark.sql import DataFrame
        from pyspark.sql.connect.dataframe import DataFrame as ConnectDataFrame

        before = [dict(vars(DataFrame)), dict(vars(ConnectDataFrame))]
        scs.exchange, scs.exchange_of, scs.key_by("k"), scs.NetworkConfig(), scs.plan_dataframe  # names in use
        import spark_credit_shuffle.exchange
        unchanged = [dict(vars(DataFrame)), dict(vars(ConnectDataFrame))] == before
        scs.install_dataframe_method()
        added = sorted(set(vars(DataFrame)) - set(before[0]))
        report = {"loaded": loaded, "unchanged": unchanged, "added": added, "callable": callable(scs.exchange)}
        print(json.dumps(report))
        """
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"loaded": [], "unchanged": True, "added": ["creditShuffle"], "callable": True}


def test_the_worker_daemon_imports_nothing_that_starts_a_thread():
    """PySpark forks its workers from the daemon: importing ``spark_credit_shuffle.worker.daemon`` (and so the
    package) loads no pyspark, pyarrow or pandas and leaves one thread."""
    result = run_python(
        """
        import json, os, sys

        import spark_credit_shuffle.worker.daemon

        heavy = ("pyspark", "py4j", "pyarrow", "pandas", "numpy")
        loaded = sorted(name for name in sys.modules if name.split(".")[0] in heavy)
        print(json.dumps({"loaded": loaded, "threads": len(os.listdir("/proc/self/task"))}))
        """
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"loaded": [], "threads": 1}
