"""One metric row, one definition: the Arrow struct, the Spark DDLs and types and the pandas frame all follow
MetricRow's fields, and a row survives each form unchanged."""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from spark_credit_shuffle.metrics import (
    METRIC_ROW_FIELDS,
    METRIC_ROW_TYPE,
    METRICS_DDL,
    TIMELINE_DDL,
    MetricRow,
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
