"""A DataFrame of every Spark SQL type that Spark's Arrow hand-over carries, and its rows made comparable:
shared by the type tests and the query property tests."""

from __future__ import annotations

import datetime
import decimal

from pyspark.sql import functions as F

#: Every type the exchange carries, nested ones at depth, as a DDL schema.
ALL_TYPES = (
    "id long, b8 byte, i16 short, i32 int, i64 long, f32 float, f64 double, bo boolean, s string, bin binary, "
    "dec decimal(10,2), dec38 decimal(38,18), d date, ts timestamp, tn timestamp_ntz, dt interval day to second, "
    "st struct<ts: timestamp, n: int, inner: struct<s: string>>, arr array<timestamp>, "
    "m map<string, timestamp>, nested array<map<int, array<decimal(5,1)>>>"
)


def all_types_df(spark, rows=12):
    """``rows`` rows of every type in :data:`ALL_TYPES` (every fourth all nulls but its id), on 3 partitions."""
    ts = datetime.datetime(2024, 3, 10, 6, 30, 15, 123456)  # a daylight saving day in New York
    data = []
    for i in range(rows):
        if i % 4 == 3:  # a row of nulls everywhere but its id
            data.append((i, *([None] * 19)))
            continue
        t = ts + datetime.timedelta(hours=i, microseconds=i)
        data.append(
            (
                i,
                i - 128 if i % 2 else 127,
                -(i * 1000),
                i * 100_000,
                -(i << 40),
                i / 3.0,
                float("inf") if i == 5 else -i / 7.0,
                i % 2 == 0,
                f"ünï {i} ✓" if i % 3 else "",
                bytes([i, 0, 255]),
                decimal.Decimal(f"{i}.{i:02d}"),
                decimal.Decimal(f"-{i}12345678901234567.{i:018d}"),
                datetime.date(1969, 12, 31) + datetime.timedelta(days=i),
                t,
                t,
                datetime.timedelta(days=i, seconds=7, microseconds=i),
                (t, None if i == 2 else i, {"s": None if i == 1 else f"x{i}"}),
                [t, None] if i % 2 else [],
                {"a": t, "b": None} if i % 2 else {},
                [{i: [decimal.Decimal("1.5"), None]}, None],
            )
        )
    return spark.createDataFrame(data, ALL_TYPES, verifySchema=False).repartition(3)


def comparable(df):
    """Maps as sorted entry arrays, so that rows can be sorted and compared (Spark cannot order maps)."""
    return df.withColumn("m", F.array_sort(F.map_entries("m"))).withColumn(
        "nested", F.transform("nested", lambda x: F.array_sort(F.map_entries(x)))
    )
