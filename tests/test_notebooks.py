"""The notebooks run: each .ipynb executes top to bottom in a Jupyter kernel of this interpreter on classic
Spark, and the Databricks source-format versions run cell by cell in a kernel on the tests' local Spark
Connect server (``SPARK_REMOTE``, so ``SparkSession.builder.getOrCreate()`` returns a Connect session, as on
Databricks' shared and serverless compute). The two formats hold the same code; the Databricks form starts
with the ``%pip install`` cell the README tells users to run (skipped here, where the package is installed)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from spark_helpers import TEST_JVM_OPTIONS

pytestmark = pytest.mark.spark

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ("tour", "backpressure")
HEADER = "# Databricks notebook source"
SEPARATOR = "# COMMAND ----------"
# an empty namespace as in a new kernel, whose __main__ has __spec__ None (pyspark's Connect client reads it)
RESET = "%reset -f\n__spec__ = None"
PIP_INSTALL = '# MAGIC %pip install "spark-credit-shuffle[plot]"'
#: Databricks' dbutils where the Databricks form runs outside Databricks: a restart of Python after the
#: install is all the notebooks ask of it, and here the package is installed already (counted, not done).
DBUTILS = """
class _Library:
    restarts = 0

    def restartPython(self):
        type(self).restarts += 1


class _DbUtils:
    library = _Library()


dbutils = _DbUtils()
"""


def databricks_cells(text: str) -> list[tuple[str, str]]:
    """(cell type, source) of a Databricks source-format notebook; a ``%pip`` cell is of type "pip"."""
    lines = text.splitlines()
    assert lines[0] == HEADER, "a Databricks notebook starts with its header line"
    chunks: list[list[str]] = [[]]
    for line in lines[1:]:
        if line == SEPARATOR:
            chunks.append([])
        else:
            chunks[-1].append(line)
    cells = []
    for chunk in chunks:
        text = "\n".join(chunk).strip("\n")
        if not text:
            continue
        if text.startswith("# MAGIC %md"):
            body = [line.removeprefix("# MAGIC").removeprefix(" ") for line in text.splitlines()[1:]]
            cells.append(("markdown", "\n".join(body)))
        elif text.startswith("# MAGIC %pip"):
            cells.append(("pip", text))
        else:
            cells.append(("code", text))
    return cells


#: Lines of the Jupyter form that a Databricks notebook must not have: settings for a local Spark (on a
#: cluster the workers' Python and addresses are the platform's) and IPython's display, which would hide
#: Databricks' own.
JUPYTER_ONLY = (
    re.compile(r"^import (os|sys)$"),
    re.compile(r"^os\.environ\.setdefault\("),
    re.compile(r"^from IPython\.display import display$"),
)
RESTART = "dbutils.library.restartPython()  # Databricks: the installed package is seen after a restart"


def without_jupyter_only(source: str) -> str:
    lines = [line for line in source.splitlines() if not any(p.search(line) for p in JUPYTER_ONLY)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


@pytest.mark.parametrize("name", NAMES)
def test_both_formats_hold_the_same_notebook(name):
    import nbformat  # here, not at the top: the quick loop collects this module without running it

    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata["kernelspec"]["name"] == "python3"
    ipynb = [(c.cell_type, without_jupyter_only(c.source)) for c in notebook.cells]
    cells = databricks_cells((NOTEBOOKS / "databricks" / f"{name}.py").read_text())
    assert cells[0] == ("pip", PIP_INSTALL)  # installs the package on the cluster first
    assert cells[1] == ("code", RESTART)  # then restarts Python, as Databricks asks after a %pip install
    local_only = [
        line for _, source in cells for line in source.splitlines() if any(p.search(line) for p in JUPYTER_ONLY)
    ]
    assert local_only == [], "a Databricks notebook sets nothing for a local Spark and keeps Databricks' display"
    assert ipynb == [(kind, without_jupyter_only(source)) for kind, source in cells[2:]]
    assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code")  # stored without outputs


def run_notebooks(session: str, connect_url: str | None = None) -> list[tuple[str, list[dict]]]:
    """Run both notebooks in one kernel of this interpreter, each from an empty namespace: the Jupyter form
    on a local classic session of the kernel's own (``session="classic"``), or the Databricks form cell by
    cell on the Spark Connect server at ``connect_url``. Returns each cell's notebook (or "reset", "check")
    and outputs."""
    import nbformat
    from nbclient import NotebookClient

    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "MPLBACKEND": "Agg",
    }
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    if session == "classic":
        env.pop("SPARK_REMOTE", None)
        env["PYSPARK_SUBMIT_ARGS"] = (
            f"--master local[2] --driver-java-options '{TEST_JVM_OPTIONS}' "
            "--conf spark.ui.enabled=false --conf spark.ui.showConsoleProgress=false pyspark-shell"
        )
    else:  # the kernel's SparkSession.builder.getOrCreate() connects to the tests' Spark Connect server
        assert connect_url is not None
        env["SPARK_REMOTE"] = connect_url
        env.pop("PYSPARK_SUBMIT_ARGS", None)
    combined = nbformat.v4.new_notebook()
    combined.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    owner: list[str] = []  # the notebook of each combined cell
    for name in NAMES:
        combined.cells.append(nbformat.v4.new_code_cell(RESET))
        owner.append("reset")
        if session == "classic":
            for cell in nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4).cells:
                combined.cells.append(cell)
                owner.append(name)
            continue
        # the Databricks form cell by cell, as Databricks runs it (a cell's last expression is displayed), with
        # the one object of Databricks' runtime it uses: dbutils; its %pip cell is what the package install did
        combined.cells.append(nbformat.v4.new_code_cell(DBUTILS))
        owner.append("reset")
        for kind, source in databricks_cells((NOTEBOOKS / "databricks" / f"{name}.py").read_text()):
            if kind == "code":
                combined.cells.append(nbformat.v4.new_code_cell(source))
                owner.append(name)
        combined.cells.append(nbformat.v4.new_code_cell("assert dbutils.library.restarts == 1"))
        owner.append(name)
    combined.cells.append(
        nbformat.v4.new_code_cell("from pyspark.sql import SparkSession\nSparkSession.builder.getOrCreate()")
    )
    owner.append("check")
    client = NotebookClient(
        combined,
        kernel_name="python3",
        timeout=240,
        allow_errors=False,
        coalesce_streams=True,  # one print can reach the kernel's stdout as several stream messages
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute(env=env)
    return [(n, list(cell.get("outputs", []))) for cell, n in zip(combined.cells, owner)]


@pytest.mark.parametrize("session", ["classic", "connect"])
def test_notebooks_run_jupyter_on_classic_and_databricks_on_connect(request, session):
    """The Jupyter form on a local classic session; the Databricks form, whose code is the same
    (``test_both_formats_hold_the_same_notebook``), on Spark Connect, as Databricks' shared and serverless
    compute run it. One kernel (one JVM, or one Connect session) for each; every notebook starts from an
    empty namespace."""
    connect_url = request.getfixturevalue("connect_server") if session == "connect" else None
    cells = run_notebooks(session, connect_url)

    def outputs(name: str) -> list:
        return [o for n, cell_outputs in cells if n == name for o in cell_outputs]

    def pictures(name: str) -> int:
        return sum(1 for o in outputs(name) if "image/png" in o.get("data", {}))

    def text(name: str) -> str:
        parts = []
        for o in outputs(name):
            parts.append(o.get("text", ""))
            parts.append(o.get("data", {}).get("text/plain", ""))
        return "\n".join(parts)

    assert ("pyspark.sql.connect.session" in text("check")) == (session == "connect")  # the session they ran on
    assert not [o for name in NAMES for o in outputs(name) if o.get("ename")]
    assert pictures("tour") == 2
    tour = text("tour")
    assert "fits: 24 of 2048 buffers per executor" in tour
    assert "Insufficient number of network buffers" in tour and "spark.creditShuffle.networkMemory" in tour
    backpressure = text("backpressure")
    assert "runs the exchange in pipelined mode" in backpressure  # two task slots or more
    assert "consumer 0 slowed: 4000 rows" in backpressure
    assert "adaptive,    consumer 0 slowed: {0: (" in backpressure
    assert "virtual clock, aligned, no credits" in backpressure
    assert "backpressure starts at consumer subtask 0" in backpressure  # summary() and diagnose() of the slow run
    assert "remote channels: backpressure starts at consumer subtask 0" in backpressure
    # the checkpoint cell completed checkpoints on Spark, aligned and unaligned
    for label in ("aligned", "unaligned"):
        counts = re.findall(rf"^{label}: consumer 0 completed (\d+) checkpoints", backpressure, re.M)
        assert counts and all(int(n) > 0 for n in counts), (label, counts)
    # buffer debloating on the virtual clock: the slow consumer's checkpoints start far sooner, the fast
    # consumers keep their throughput
    delays = {
        label: float(ms)
        for label, ms in re.findall(
            r"^debloating (off|100 ms): consumer 0's median checkpoint start delay (\d+)", backpressure, re.M
        )
    }
    ratios = re.findall(r"^debloating 100 ms: .* \(([\d.]+)x of off\)$", backpressure, re.M)
    assert delays["100 ms"] < delays["off"] / 5 and ratios and float(ratios[0]) >= 0.95, (delays, ratios)
    # the pool usage bars, the exchange's timeline and its producers' queues per consumer (pipelined mode),
    # the virtual-clock timeline
    assert pictures("backpressure") >= 4
