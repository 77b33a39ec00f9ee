"""Rows placed on the partition a column names: the identity shuffle both runtimes place by.

The blocking exchange places its stored buffers on their consumers' partitions, the pipelined one its
input on its producers (when the input's last stage cannot run in a barrier stage) and its retryable
output on its consumers. Spark's ``repartitionById`` (pyspark 4.1+) does exactly that; on pyspark 4.0 a
hash repartition on an int that Spark's hash places on each partition
(:func:`~spark_credit_shuffle.partitioners.murmur3.spark_hash_partition_keys`) does the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..partitioners.murmur3 import spark_hash_partition_keys

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["has_repartition_by_id", "place_by", "unused_name"]


def has_repartition_by_id(df: DataFrame) -> bool:
    """True if ``df``'s DataFrame class has ``repartitionById`` (pyspark 4.1 and later)."""
    return hasattr(type(df), "repartitionById")


def place_by(df: DataFrame, num_partitions: int, column: str, *, by_id: bool | None = None) -> DataFrame:
    """``df`` on ``num_partitions`` partitions, each row on the partition its int ``column`` names (in
    ``[0, num_partitions)``): Spark's ``repartitionById`` (pyspark 4.1+) where it exists (``by_id=None``),
    else a hash repartition on a value per partition that Spark's hash places there (a lookup in a small
    array of ints computed here), which places every row exactly the same way on any Spark 4."""
    if by_id is None:
        by_id = has_repartition_by_id(df)
    if by_id:
        return df.repartitionById(num_partitions, column)
    from pyspark.sql import functions as F

    lookup = F.array(*[F.lit(int(k)) for k in spark_hash_partition_keys(num_partitions)])
    key = unused_name(f"{column}_placement", df.columns)
    placed = df.withColumn(key, F.element_at(lookup, F.col(column) + 1).cast("int"))
    return placed.repartition(num_partitions, key).drop(key)


def unused_name(base: str, columns: Iterable[str]) -> str:
    """``base``, or ``base_1``, ``base_2``, ... : the first that is not one of ``columns`` (an internal
    column never takes the place of a user's column of the same name)."""
    taken = set(columns)
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    return name
