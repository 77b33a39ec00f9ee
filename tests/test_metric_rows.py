"""One metric row, one definition: the Arrow struct, the Spark DDLs and types and the pandas frame all follow
MetricRow's fields, and a row survives each form unchanged; per-channel counters handed to ``TaskMetrics.rows``
as series give the rows that counting them would."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from spark_credit_shuffle.metrics import (
    METRIC_ROW_FIELDS,
    METRIC_ROW_TYPE,
    METRICS_DDL,
    TIMELINE_DDL,
    MetricRow,
    TaskMetrics,
    metric_row_spark_type,
    rows_to_arrow,
    rows_to_pandas,
)

ROWS = [
    MetricRow("producer", 0, 1, "numBuffersOut", "total", 12.0),
    MetricRow("consumer", 1, None, "inPoolUsage", "sample", 0.25, 1_700_000_000_000.5),
]


def test_every_form_has_the_fields_of_metric_row_in_order():
    names = [f.name for f in dataclasses.fields(MetricRow)]
    assert list(METRIC_ROW_FIELDS) == names
    assert [f.name for f in METRIC_ROW_TYPE] == names
    assert [f.name for f in metric_row_spark_type().fields] == names
    assert [c.split()[0] for c in TIMELINE_DDL.split(", ")] == ["exchange", "mode", *names]
    assert [c.split()[0] for c in METRICS_DDL.split(", ")] == ["exchange", "mode", *names[:-1]]
    assert list(rows_to_pandas(ROWS).columns) == names


def test_a_row_survives_the_arrow_and_pandas_forms():
    cell = rows_to_arrow([ROWS, None])
    assert cell.type == pa.list_(METRIC_ROW_TYPE)
    assert cell[1].as_py() is None
    assert [MetricRow(**r) for r in cell[0].as_py()] == ROWS
    frame = rows_to_pandas(ROWS)
    assert frame["subtask"].tolist() == [0, 1]
    assert frame["channel"].isna().tolist() == [False, True]
    assert frame["time_ms"].iloc[1] == ROWS[1].time_ms


def _counted(metrics: TaskMetrics, series: dict[str, list[float]], channels: list[int]) -> list[MetricRow]:
    """The rows of ``metrics`` with ``series`` counted channel by channel first (on a copy)."""
    counted = TaskMetrics(metrics.side, metrics.subtask, dict(metrics.counters), dict(metrics.gauges))
    for metric, values in series.items():
        for channel, value in zip(channels, values):
            counted.count(metric, value, channel)
    return counted.rows()


@pytest.mark.parametrize(
    "channels, overlap",
    [
        ([0, 1, 2, 3], False),  # the fast path, channels in order
        ([3, 0, 2, 1], False),  # the fast path, channels out of order
        ([0, 1, 1, 2], False),  # a channel twice: the counters' path sums it
        ([0, 1, 2, 3], True),  # a series shares its metric with a counter: the counters' path
    ],
)
def test_series_give_the_rows_counting_gives(channels, overlap):
    metrics = TaskMetrics("producer", 5)
    metrics.count("numBytesOutLocal", 7.0)
    metrics.count("aMetricBefore", 1.0, 2)
    metrics.count("aMetricBefore", 2.0)
    if overlap:
        metrics.count("numRecordsOut", 100.0, 1)
        metrics.count("numRecordsOut", 9.0)
    metrics.sample("outPoolUsage", 0.5)
    series = {"numRecordsOut": [1.0, 2.0, 3.0, 4.0], "numBuffersOut": [5.0, 6.0, 7.0, 8.0]}
    expected = _counted(metrics, series, channels)
    assert metrics.rows(series, channels) == expected
    assert metrics.rows(series, channels) == expected  # a second call counts nothing twice
