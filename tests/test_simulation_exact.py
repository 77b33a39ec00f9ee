"""The simulation's results at small scale are exactly those of the code before it was made to scale
(docs/benchmarks.md, "Simulation at scale").

``tests/simulation_exact.json`` was captured from the simulation as it was before any change made for scale
(run this module as a script with that code first on ``PYTHONPATH`` to capture it again): per case, the report's
figures, the digest of its full summary rows and of its timeline (each row's fields, floats by ``repr``), and
the full rows of the first case, so a difference shows which row moved. A change made for speed or memory
must leave every case identical.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.engine.producer import SEGMENT_HOLD_TIME
from spark_credit_shuffle.metrics import METRIC_ROW_FIELDS
from spark_credit_shuffle.simulation import simulate
from spark_credit_shuffle.simulation.report import RECORDS_IN_PER_SECOND

FIXTURE = Path(__file__).with_name("simulation_exact.json")
HOSTS = [i // 4 for i in range(8)]  # 2 hosts x 4 slots, producer and consumer i on host i // 4
BASE: dict[str, Any] = {
    "num_producers": 8,
    "num_consumers": 8,
    "producer_rate": 20e6,
    "consumer_rate": 40e6,
    "producer_hosts": HOSTS,
    "consumer_hosts": HOSTS,
    "latency": 100e-6,
    "duration": 0.05,
}
UNTIMED = {k: v for k, v in BASE.items() if k != "duration"}
CASES: dict[str, tuple[NetworkConfig, dict[str, Any]]] = {
    "all_to_all": (NetworkConfig(), BASE),
    "sampled_slow_consumer": (
        NetworkConfig(),
        {**BASE, "consumer_rate": [2e6] + [40e6] * 7, "sample_interval": 0.005, "check_invariants": True},
    ),
    "subtask_processes_checkpoints": (
        NetworkConfig(checkpoint_interval_ms=10),
        {**BASE, "processes": "subtask", "check_invariants": True},
    ),
    "task_pair_no_credits": (
        NetworkConfig(credit_based=False, checkpoint_interval_ms=10),
        {**BASE, "connections": "task_pair"},
    ),
    "finite_bytes": (NetworkConfig(), {**UNTIMED, "bytes_per_producer": 2e6}),
}
#: The case whose rows the fixture holds in full.
FULL = "all_to_all"


def _rows(rows: list, later: tuple[str, ...] = (SEGMENT_HOLD_TIME,)) -> list[list]:
    # segmentHoldTimeMs and the summary's numRecordsInPerSecond came after the fixture was captured: the rows it
    # was captured with stay as they were (the timeline's sampled numRecordsInPerSecond was there already)
    return [[getattr(r, f) for f in METRIC_ROW_FIELDS] for r in rows if r.metric not in later]


def _digest(rows: list[list]) -> str:
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def capture(name: str) -> dict[str, Any]:
    config, kwargs = CASES[name]
    report = simulate(config, **kwargs)
    rows, timeline = _rows(report.rows, (SEGMENT_HOLD_TIME, RECORDS_IN_PER_SECOND)), _rows(report.timeline)
    figures: dict[str, Any] = {
        "end_time": report.end_time,
        "window": report.window,
        "steps": report.steps,
        "finished": report.finished,
        "data_intact": report.data_intact,
        "buffers_returned": report.buffers_returned,
        "connection_pauses": report.connection_pauses,
        "messages": report.messages,
        "hosts": report.hosts,
        "origins": sorted([c, p, o.subpartition, o.local] for (c, p), o in report.channel_origins.items()),
        "num_rows": len(rows),
        "rows_sha256": _digest(rows),
        "num_timeline": len(timeline),
        "timeline_sha256": _digest(timeline),
    }
    if name == FULL:
        figures["rows"] = rows
    return figures


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_simulation_matches_the_figures_captured_before_the_scale_work(name, expected):
    got, want = capture(name), expected[name]
    if "rows" in want:  # first, row by row: a difference names the row
        assert len(got["rows"]) == len(want["rows"])
        for g, w in zip(got["rows"], want["rows"]):
            assert g == w
    assert got == want


def test_scale_benchmark_reports_one_size():
    sys.path.insert(0, str(Path(__file__).parents[1] / "jobs"))
    try:
        import bench_simulation_scale as bench
    finally:
        sys.path.pop(0)
    figures = bench.run_one(16, 0.01)  # 2 hosts x 8 slots, in this process
    assert figures["tasks"] == 16 and figures["channels"] == 256 and figures["network"] == "default"
    assert figures["buffers"] > 0 and figures["wall_us_per_buffer"] > 0 and figures["peak_rss_mb"] > 0


if __name__ == "__main__":  # capture the fixture (with the code to compare against on PYTHONPATH)
    data = {name: capture(name) for name in CASES}
    FIXTURE.write_text(json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"wrote {FIXTURE} from {sys.modules['spark_credit_shuffle'].__file__}")
