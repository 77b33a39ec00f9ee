"""The Arrow schema in which Spark hands a DataFrame's rows to Python (``mapInArrow``), read on the driver: the
exchange plans its buffers and its output on it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa

from .errors import UnsupportedColumnTypeError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["arrow_schema", "in_time_zone", "sql_conf"]


def arrow_schema(df: DataFrame) -> pa.Schema:
    """The Arrow schema of the batches ``mapInArrow`` hands ``df``'s rows over in, exactly: timestamps in the
    session time zone (``spark.sql.session.timeZone``, read once here, on the driver), strings and binaries
    large if ``spark.sql.execution.arrow.useLargeVarTypes`` says so. A column of a type that ``mapInArrow``
    cannot carry (a year-month or calendar interval) raises :class:`UnsupportedColumnTypeError` naming it."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    spark = df.sparkSession
    time_zone = sql_conf(spark, "spark.sql.session.timeZone")  # with a default, get() returns that one
    large = str(sql_conf(spark, "spark.sql.execution.arrow.useLargeVarTypes")).strip().lower() == "true"
    fields = []
    for field in df.schema.fields:
        try:
            try:
                one = to_arrow_schema(StructType([field]), timezone=time_zone, prefers_large_types=large)
            except TypeError:  # pyspark 4.0 names timestamps' zone UTC here; Spark sends the session's
                one = to_arrow_schema(StructType([field]), prefers_large_types=large)
                one = pa.schema([in_time_zone(one.field(0), time_zone)])
        except Exception as e:
            raise UnsupportedColumnTypeError(
                f"column {field.name!r} has Spark type {field.dataType.simpleString()}, which cannot travel through "
                f"an exchange: Spark's Arrow hand-over (mapInArrow) does not carry it ({type(e).__name__}). Cast it "
                f"to a type that travels (a year-month interval to its months as int, for example) or drop it"
            ) from None
        fields.append(one.field(0))
    return pa.schema(fields)


def in_time_zone(field: pa.Field, time_zone: str | None) -> pa.Field:
    """``field`` with every zoned timestamp in it (at any depth) in ``time_zone``."""

    def convert(t: pa.DataType) -> pa.DataType:
        if pa.types.is_timestamp(t):
            return pa.timestamp(t.unit, tz=time_zone) if t.tz is not None else t
        if pa.types.is_map(t):
            return pa.map_(convert_field(t.key_field), convert_field(t.item_field), t.keys_sorted)
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            make = pa.list_ if pa.types.is_list(t) else pa.large_list
            return make(convert_field(t.value_field))
        if pa.types.is_struct(t):
            return pa.struct([convert_field(t.field(i)) for i in range(t.num_fields)])
        return t

    def convert_field(f: pa.Field) -> pa.Field:
        return pa.field(f.name, convert(f.type), nullable=f.nullable, metadata=f.metadata)

    return convert_field(field)


def sql_conf(spark: Any, key: str) -> str | None:
    """The value Spark uses for SQL setting ``key`` (its default if nobody set it); None if it has none."""
    try:
        return spark.conf.get(key)
    except Exception:  # a setting this Spark does not know
        return None
