"""Operators chained into an exchange's tasks: the user's own function, run where Flink would run it.

Flink chains operators into the task of the network stack's producer or consumer (``OperatorChain``): a
``map`` after a ``keyBy`` runs in the consumer's task, on the records as the task reads them, so its time is
the task's busy time, and while it works the task recycles no input buffer, announces no credit, and its
producers become back-pressured. A function applied to ``ex.df`` with Spark's own ``mapInPandas`` runs in
another Python worker behind Spark's buffering instead (see docs/diagnosis.md, "What Spark holds between two
Python steps"), where the exchange sees it late or not at all.

A :class:`ChainedOperator` is a ``mapInPandas``- or ``mapInArrow``-shaped function (an iterator of pandas
DataFrames or Arrow record batches in, an iterator of them out) with its output schema:

- chained *after* the exchange (``exchange(..., after=...)``, ``Exchange.map_in_pandas``): it runs in
  consumer subtask *i*'s task, on the rows the consumer decodes, and its output is the exchange's output;
- chained *before* it (``exchange(..., before=...)``): it runs in producer subtask *i*'s task on the input
  partition, and the rows it yields are the ones the producer partitions and writes (the key columns are
  looked up in its output schema).

Its output is checked against the declared schema as Spark checks ``mapInArrow``'s: columns by name (by
position when a pandas frame's columns are not the names), types cast where the cast is safe, a
:class:`ChainedOperatorError` naming the operator and the column otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from ..errors import ChainedOperatorError, ConfigError

__all__ = ["KINDS", "ChainedOperator", "apply_chain", "as_chain"]

#: What a chained function takes and yields: pandas DataFrames or Arrow record batches.
KINDS = ("pandas", "arrow")


@dataclass(frozen=True)
class ChainedOperator:
    """``fn`` (an iterator of pandas DataFrames, ``kind="pandas"``, or of Arrow record batches, ``"arrow"``,
    in; an iterator of the same out) with its output ``schema`` (a Spark DDL string or ``StructType``, as
    ``mapInPandas`` takes it). The exchange resolves the schema on the driver, before any job:
    ``spark_schema`` and ``arrow_schema`` are set then."""

    fn: Callable[[Iterator[Any]], Iterable[Any]]
    schema: Any
    kind: str = "pandas"
    spark_schema: Any = None
    arrow_schema: pa.Schema | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError("kind", self.kind, " or ".join(repr(k) for k in KINDS))
        if not callable(self.fn):
            raise ConfigError(
                "fn", _short(self.fn), "a function of an iterator of batches, as mapInPandas/mapInArrow take"
            )
        if not isinstance(self.schema, str) and type(self.schema).__name__ != "StructType":
            raise ConfigError("schema", _short(self.schema), "a Spark DDL string or a pyspark StructType")

    @property
    def name(self) -> str:
        """How errors and the Spark UI name the operator: its function's name."""
        return getattr(self.fn, "__name__", None) or type(self.fn).__name__

    def resolved(self, spark_schema: Any, arrow_schema: pa.Schema) -> ChainedOperator:
        return replace(self, spark_schema=spark_schema, arrow_schema=arrow_schema)

    def apply(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Run the function over ``batches``; its output as record batches of :attr:`arrow_schema`."""
        target = self.arrow_schema
        if target is None:
            raise ChainedOperatorError(f"chained operator {self.name}: its schema was not resolved on the driver")
        if self.kind == "arrow":
            for out in self.fn(batches):
                yield _conform(self.name, _as_batch(self.name, out), target)
        else:
            frames = (batch.to_pandas() for batch in batches)
            for frame in self.fn(frames):
                yield _from_pandas(self.name, frame, target)


def as_chain(value: Any, argument: str) -> tuple[ChainedOperator, ...]:
    """``value`` (None, one :class:`ChainedOperator` or a sequence of them) as a tuple, or the
    :class:`ConfigError` naming ``argument``."""
    if value is None:
        return ()
    items: Sequence[Any] = value if isinstance(value, (list, tuple)) else (value,)
    for item in items:
        if not isinstance(item, ChainedOperator):
            raise ConfigError(
                argument,
                _short(item),
                "an operator made by spark_credit_shuffle.map_in_pandas(fn, schema) or map_in_arrow(fn, schema), "
                "a list of them, or None",
            )
    return tuple(items)


def apply_chain(chain: Sequence[ChainedOperator], batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``batches`` through every operator of ``chain`` in order (empty output batches dropped)."""
    out: Iterator[pa.RecordBatch] = batches
    for operator in chain:
        out = operator.apply(out)
    return (batch for batch in out if batch.num_rows)


def _as_batch(name: str, out: Any) -> pa.RecordBatch:
    if isinstance(out, pa.RecordBatch):
        return out
    if isinstance(out, pa.Table):
        return out.combine_chunks().to_batches()[0] if out.num_rows else pa.RecordBatch.from_pylist([], out.schema)
    raise ChainedOperatorError(
        f"chained operator {name} yielded a {type(out).__name__}; a map_in_arrow function yields pyarrow RecordBatches"
    )


def _conform(name: str, batch: pa.RecordBatch, target: pa.Schema) -> pa.RecordBatch:
    """``batch`` with ``target``'s columns, in its order and types (a safe cast where the types differ)."""
    if batch.schema.equals(target):
        return batch
    names = batch.schema.names
    missing = [f.name for f in target if f.name not in names]
    if missing:
        raise ChainedOperatorError(
            f"chained operator {name} yielded columns {names}, without {missing} of its declared schema {target}"
        )
    arrays = []
    for field in target:
        column = batch.column(names.index(field.name))
        if not column.type.equals(field.type):
            try:
                column = column.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise ChainedOperatorError(
                    f"chained operator {name}: column {field.name!r} is {column.type}, which does not cast safely to "
                    f"the declared {field.type} ({exc})"
                ) from None
        arrays.append(column)
    return pa.RecordBatch.from_arrays(arrays, schema=target)


def _from_pandas(name: str, frame: Any, target: pa.Schema) -> pa.RecordBatch:
    import pandas as pd

    if not isinstance(frame, pd.DataFrame):
        raise ChainedOperatorError(
            f"chained operator {name} yielded a {type(frame).__name__}; a map_in_pandas function yields pandas "
            f"DataFrames"
        )
    columns = list(frame.columns)
    if not all(f.name in columns for f in target):
        if len(columns) != len(target) or all(isinstance(c, str) for c in columns):
            missing = [f.name for f in target if f.name not in columns]
            raise ChainedOperatorError(
                f"chained operator {name} yielded columns {columns}, without {missing} of its declared schema"
            )
        frame = frame.set_axis(target.names, axis=1)  # unnamed columns: by position, as mapInPandas does
    try:
        return pa.RecordBatch.from_pandas(frame, schema=target, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise ChainedOperatorError(
            f"chained operator {name}: its output does not fit the declared schema {target} ({exc})"
        ) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
