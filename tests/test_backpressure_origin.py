"""Where backpressure starts, with the user's own operators: a slow operator chained after the exchange (in the
consumer's task), a slow one chained before it (in the producer's), a slow Spark step after ``ex.df`` (outside
the exchange's tasks), and healthy runs that must name no consumer. Each case runs a real exchange on the test
session; ``jobs/diagnosis_matrix.py`` runs the same cases several times and prints the table."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F
from spark_helpers import session_conf

import spark_credit_shuffle as scs
from spark_credit_shuffle.diagnosis import HIGH, LOW
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


def test_a_slow_step_after_the_exchanges_output_back_pressures_its_consumer(spark):
    """``ex.df.mapInPandas(slow)`` with ``retryable=False`` (the output streams into the step; the retryable
    form's goes through a shuffle first, which nothing after it back-pressures): the slow step runs in another
    Python worker, behind what Spark holds between the two Python steps and the consumer's own hand-over
    (docs/diagnosis.md, "What Spark holds between two Python steps": about 10 MB together over the test
    session's Unix domain sockets, 14-39 MB over TCP, whose kernel buffers grow with use). 30 MB per partition
    here, which the step takes 15 s for (2 MB/s, far slower than the exchange on a loaded machine), so the
    consumer's output fills and it waits, back-pressured on its output, and its producers with it."""
    df = spark.range(0, 60_000, 1, 2).select("id", F.lit("x" * 1000).alias("pad"))
    ex = scs.exchange(
        df, scs.rebalance(), 2, mode="pipelined", retryable=False, segment_size="64kb", max_buffers_per_channel=40
    )
    with session_conf(spark, "spark.sql.execution.arrow.maxRecordsPerBatch", "1000"):
        out = ex.df.mapInPandas(slow_on(1, 5e-4), "id long, pad string")
        assert sorted(r.id for r in out.select("id").collect()) == list(range(60_000))
    s = summary(ex)
    c1 = s[(CONSUMER, 1)]
    assert c1.back_pressured_ms_per_second > c1.busy_ms_per_second and c1.back_pressure in (LOW, HIGH), times(ex)
    # producer 0 (the other task) waits for buffers; producer 1 shares its task's JVM thread with the slow
    # step, which feeds it no input while it waits on the step: it waits for buffers or for its input
    assert s[(PRODUCER, 0)].back_pressure in (LOW, HIGH), times(ex)
    p1 = s[(PRODUCER, 1)]
    assert p1.back_pressure in (LOW, HIGH) or p1.idle_ms_per_second >= 500, times(ex)
    d = ex.diagnose()
    assert (d.verdict, d.origin) == ("downstream", 1), (d.text, times(ex))
    assert "the step that follows the exchange on partition 1 is slow" in d.text
