"""Where backpressure starts, with the user's own operators: a slow operator chained after the exchange (in the
consumer's task), a slow one chained before it (in the producer's), a slow Spark step after ``ex.df`` (outside
the exchange's tasks) in ``jobs/diagnosis_matrix.py`` only (docs/diagnosis.md, "What Spark holds between two
Python steps": in the full suite it sometimes showed no wait downstream), and healthy runs that must name no
consumer. Each case runs a real exchange on the test session; the job runs the same cases several times and
prints the table."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F

import spark_credit_shuffle as scs
from spark_credit_shuffle.diagnosis import HIGH
from spark_credit_shuffle.jobs.common import slow_on  # the demos' slow step of the user's
from spark_credit_shuffle.metrics import CONSUMER, PRODUCER
from spark_credit_shuffle.runtime.monitor import Monitor

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this module

pytestmark = pytest.mark.spark


def summary(ex):
    return {(s.side, s.subtask): s for s in ex.summary_rows()}


def times(ex) -> str:
    """Each subtask's busy / idle / back-pressured ms per second, for a failure's message."""
    return " ".join(
        f"{s.side[0]}{s.subtask}:{s.busy_ms_per_second or 0:.0f}/{s.idle_ms_per_second or 0:.0f}/"
        f"{s.back_pressured_ms_per_second or 0:.0f}"
        for s in ex.summary_rows()
    )


class Lines:
    """The live monitor's line over the samples as they arrive (a callback of ``monitor=``), stamped."""

    def __init__(self, producers: int) -> None:
        self.monitor = Monitor("test", producers=producers)
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def __call__(self, rows) -> None:
        self.monitor.accept(rows)
        with self._lock:
            self.lines.append((time.monotonic(), self.monitor.line()))


@pytest.mark.parametrize("mode", ["pipelined", "blocking"])
def test_a_healthy_run_names_no_consumer(spark, mode):
    df = spark.range(0, 100_000, 1, 4).select("id", (F.col("id") % 1000).alias("user_id"))
    ex = scs.exchange(df, scs.rebalance(), 4, mode=mode)
    assert ex.df.count() == 100_000
    d = ex.diagnose()
    assert d.origin is None and d.verdict in ("ok", "spread"), d
    assert "consumer subtask" not in d.text


def test_a_slow_chained_operator_on_one_consumer_is_where_backpressure_starts(spark):
    """0.1 ms per row on consumer 2 of a 4 -> 4 round robin of 400,000 rows: its 100,000 rows take it 10 s."""
    df = spark.range(0, 400_000, 1, 4).select("id", F.lit("x" * 90).alias("pad"))  # rows of ~110 bytes
    lines = Lines(producers=4)
    ex = scs.exchange(df, scs.rebalance(), 4, mode="pipelined", monitor=lines)
    out = ex.map_in_pandas(slow_on(2, 1e-4), "id long, pad string")
    assert out.count() == 400_000
    returned = time.monotonic()
    s = summary(ex)
    producers = [s[(PRODUCER, p)] for p in range(4)]
    assert all(p.back_pressure == HIGH and p.back_pressured_ms_per_second >= 500 for p in producers), producers
    assert s[(CONSUMER, 2)].busy_ms_per_second >= 900, s[(CONSUMER, 2)]
    d = ex.diagnose()
    assert (d.verdict, d.origin, d.back_pressured) == ("backpressure", 2, (0, 1, 2, 3)), d
    assert d.figures["origin_busy_ms_per_second"] >= 900
    named = [line for at, line in lines.lines if at < returned and "backpressure from consumer 2" in line]
    assert named, lines.lines
    assert "back-pressured producers: 4 of 4" in named[-1]


def test_a_slow_chained_operator_in_blocking_mode_is_the_straggler(spark):
    df = spark.range(0, 20_000, 1, 2).select("id", (F.col("id") % 100).alias("k"))
    ex = scs.exchange(df, scs.rebalance(), 2, mode="blocking")
    assert ex.map_in_pandas(slow_on(1, 2e-4), "id long, k long").count() == 20_000
    d = ex.diagnose()
    assert (d.verdict, d.origin) == ("straggler", 1), (d.text, times(ex))


def test_a_slow_operator_chained_before_the_exchange_makes_it_source_bound(spark):
    df = spark.range(0, 100_000, 1, 4).select("id", (F.col("id") % 1000).alias("user_id"))
    ex = scs.exchange(
        df,
        scs.rebalance(),
        4,
        mode="pipelined",
        before=scs.map_in_pandas(slow_on(-1, 4e-5), "id long, user_id long"),
    )
    assert ex.df.count() == 100_000
    d = ex.diagnose()
    assert (d.verdict, d.origin, d.back_pressured) == ("source-bound", None, ()), (d, ex.summary_rows())
    assert d.figures["producers_busy_ms_per_second"] >= 850 and d.figures["consumers_idle_ms_per_second"] >= 900
