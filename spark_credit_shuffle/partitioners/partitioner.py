"""Partitioners: immutable descriptions of how a producer's rows spread over consumer subtasks.

A :class:`Partitioner` is a value (picklable, shipped to Spark tasks). It knows the edge pattern
(all-to-all or pointwise), checks that it can serve ``num_producers -> num_consumers`` before anything runs,
and makes one stateful :class:`~.selectors.ChannelSelector` per producer subtask, as Flink clones its
``StreamPartitioner`` per subtask. The names follow Flink's ``toString``: HASH, REBALANCE, RESCALE, SHUFFLE,
BROADCAST, FORWARD, GLOBAL, CUSTOM.
"""

from __future__ import annotations

import abc
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, SupportsIndex

import numpy as np

from ..config import check_operator_parallelism, default_max_parallelism
from ..errors import ConfigError, PartitionerError, UnsupportedKeyTypeError
from .keygroups import MAX_TUPLE_ARITY, NullKeys, _check_null_keys, check_parallelism
from .selectors import (
    AdaptiveRebalanceSelector,
    Batch,
    BroadcastSelector,
    ChannelSelector,
    Column,
    ConstantSelector,
    CustomSelector,
    KeyGroupSelector,
    RoundRobinSelector,
    ShuffleSelector,
)

__all__ = [
    "BroadcastPartitioner",
    "CustomPartitionerWrapper",
    "ForwardPartitioner",
    "GlobalPartitioner",
    "KeyGroupStreamPartitioner",
    "Partitioner",
    "RebalancePartitioner",
    "RescalePartitioner",
    "ShufflePartitioner",
    "broadcast",
    "custom",
    "forward",
    "global_",
    "key_by",
    "pointwise_wiring",
    "rebalance",
    "rescale",
    "shuffle",
]


def _check_index(value: object, setting: str, count: int) -> int:
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise ConfigError(setting, value, f"an integer in [0, {count})", kind="argument")
    index = operator.index(value)
    if not 0 <= index < count:
        raise ConfigError(setting, value, f"an integer in [0, {count})", kind="argument")
    return index


def pointwise_wiring(num_producers: int, num_consumers: int) -> list[list[int]]:
    """Flink's pointwise edge: for every producer, the consumer reading each of its subpartitions, in order.

    As ``VertexInputInfoComputationUtils.computeVertexInputInfoForPointwise`` (S producers, T consumers):
    if S >= T, consumer i reads the one subpartition of producers ``[i*S//T, (i+1)*S//T)``; if S < T,
    producer p feeds consumers ``[ceil(p*T/S), ceil((p+1)*T/S))`` and consumer c reads subpartition
    ``c % (number of consumers of p)`` — so with 3 -> 7, producer 1 feeds consumers 3 and 4, and its
    subpartition 0 goes to consumer 4, subpartition 1 to consumer 3.
    """
    s = check_operator_parallelism(num_producers, "num_producers")
    t = check_operator_parallelism(num_consumers, "num_consumers")
    if s >= t:
        wiring: list[list[int]] = [[] for _ in range(s)]
        for consumer in range(t):
            for producer in range(consumer * s // t, (consumer + 1) * s // t):
                wiring[producer].append(consumer)
        return wiring
    wiring = []
    for producer in range(s):
        start = (producer * t + s - 1) // s
        end = ((producer + 1) * t + s - 1) // s
        consumers = [0] * (end - start)
        for consumer in range(start, end):
            consumers[consumer % (end - start)] = consumer
        wiring.append(consumers)
    return wiring


class Partitioner(abc.ABC):
    """How rows travel from ``num_producers`` producer subtasks to ``num_consumers`` consumer subtasks."""

    name: ClassVar[str]
    is_broadcast: ClassVar[bool] = False
    is_pointwise: ClassVar[bool] = False

    def validate(self, num_producers: int, num_consumers: int) -> None:
        """Raise (before anything runs) if this partitioner cannot serve the exchange."""
        check_operator_parallelism(num_producers, "num_producers")
        check_operator_parallelism(num_consumers, "num_consumers")

    def consumers_of(self, producer: int, num_producers: int, num_consumers: int) -> list[int]:
        """The consumer subtask of each subpartition of ``producer``, in subpartition order."""
        self.validate(num_producers, num_consumers)
        producer = _check_index(producer, "producer", num_producers)
        if self.is_pointwise:
            return pointwise_wiring(num_producers, num_consumers)[producer]
        return list(range(num_consumers))

    def producers_of(self, consumer: int, num_producers: int, num_consumers: int) -> list[int]:
        """The producers feeding ``consumer`` (the channels of its input gate, in channel order)."""
        self.validate(num_producers, num_consumers)
        consumer = _check_index(consumer, "consumer", num_consumers)
        if self.is_pointwise:
            wiring = pointwise_wiring(num_producers, num_consumers)
            return [p for p, consumers in enumerate(wiring) if consumer in consumers]
        return list(range(num_producers))

    def num_subpartitions(self, producer: int, num_producers: int, num_consumers: int) -> int:
        """How many subpartitions (channels) the result partition of ``producer`` has."""
        return len(self.consumers_of(producer, num_producers, num_consumers))

    def selector(
        self, producer: int, num_producers: int, num_consumers: int, max_parallelism: int | None = None
    ) -> ChannelSelector:
        """A fresh, stateful channel selector for producer subtask ``producer``."""
        channels = self.num_subpartitions(producer, num_producers, num_consumers)
        return self._make_selector(producer, channels, num_consumers, max_parallelism)

    @abc.abstractmethod
    def _make_selector(
        self, producer: int, num_channels: int, num_consumers: int, max_parallelism: int | None
    ) -> ChannelSelector: ...

    def channels(
        self,
        batch: Batch,
        num_consumers: int,
        *,
        producer: int = 0,
        num_producers: int | None = None,
        max_parallelism: int | None = None,
    ) -> np.ndarray:
        """The consumer subtask (int32) of every row of ``batch`` sent by ``producer``, from a fresh selector.

        A one-shot convenience: for a stream of batches keep one :meth:`selector` instead, so round-robin and
        random state carry over. ``num_producers`` defaults to ``num_consumers``. Not for broadcast.
        """
        producers = num_consumers if num_producers is None else num_producers
        consumers = np.asarray(self.consumers_of(producer, producers, num_consumers), dtype=np.int32)
        selector = self.selector(producer, producers, num_consumers, max_parallelism)
        channels: np.ndarray = consumers[selector.select_channels(batch)]
        return channels

    def __str__(self) -> str:
        return self.name


def _rng(seed: int | None, producer: int, stream: int) -> np.random.Generator:
    """A generator per producer: reproducible and distinct per producer when seeded, from entropy otherwise."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([seed, producer, stream])


def _check_seed(seed: object) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError("seed", seed, "None or an integer >= 0", kind="argument")
    return int(seed)


def identifier_parts(identifier: str) -> list[str]:
    r"""The name parts of a Spark SQL identifier: ``a.b`` -> ``["a", "b"]``, ``\`a.b\``` -> ``["a.b"]``
    (a doubled backtick inside backticks is one backtick)."""
    parts: list[str] = []
    current: list[str] = []
    quoted = False
    i = 0
    while i < len(identifier):
        char = identifier[i]
        if quoted:
            if char == "`" and identifier[i + 1 : i + 2] == "`":
                current.append("`")
                i += 1
            elif char == "`":
                quoted = False
            else:
                current.append(char)
        elif char == "`":
            quoted = True
        elif char == ".":
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
        i += 1
    parts.append("".join(current))
    return parts


def _is_spark_column(value: object) -> bool:
    cls = type(value)
    return cls.__name__ == "Column" and cls.__module__.startswith("pyspark.")


def column_reference_name(column: Any) -> str:
    """The name a PySpark ``Column`` refers to, if it is a plain column reference (``F.col("k")``,
    ``df["k"]``, ``df.k``; classic or Spark Connect); a :class:`PartitionerError` for any other expression.

    A reference to a nested field (``F.col("a.b")``) keeps its parts joined by dots; whether it names a
    top-level column is decided against the DataFrame's schema before launch.
    """
    parts: list[str] | None = None
    jc = getattr(column, "_jc", None)
    if jc is not None:  # classic: the column's JVM node
        try:
            node = jc.node()
            kind = node.getClass().getSimpleName()
            if kind == "UnresolvedAttribute":
                name_parts = node.nameParts()
                parts = [str(name_parts.apply(i)) for i in range(name_parts.length())]
            elif (
                kind == "ExpressionColumnNode" and node.expression().getClass().getSimpleName() == "AttributeReference"
            ):
                parts = [str(node.expression().name())]
            elif kind == "SqlExpression":
                text = str(node.expression()).strip()
                if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*|`(?:[^`]|``)+`", text):
                    parts = identifier_parts(text)
        except Exception:  # another Column implementation: its text, if that is a plain name ("Column<'k'>")
            plain = re.fullmatch(r"Column<'([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)'>", str(column))
            parts = identifier_parts(plain.group(1)) if plain else None
    else:
        expr = getattr(column, "_expr", None)  # Spark Connect: the column's expression
        if type(expr).__name__ == "ColumnReference":
            identifier = getattr(expr, "_unparsed_identifier", None)
            if isinstance(identifier, str):
                parts = identifier_parts(identifier)
    if parts is None:
        raise PartitionerError(
            f"{column} is not a plain column reference: a key is a column of the DataFrame; add the expression "
            "as a column first (df.withColumn('key', <expression>)) and key by its name"
        )
    return ".".join(parts) if len(parts) > 1 else parts[0]


def _check_columns(columns: Sequence[Any], what: str) -> tuple[Column, ...]:
    if not columns:
        raise ConfigError("columns", columns, f"at least one key column name (or position) for {what}", kind="argument")
    checked: list[Column] = []
    for column in columns:
        if _is_spark_column(column):
            column = column_reference_name(column)
        if isinstance(column, bool) or not isinstance(column, (str, int)):
            raise ConfigError(
                "columns",
                column,
                f"column names (str), positions (int) or column references (F.col) for {what}",
                kind="argument",
            )
        checked.append(column)
    return tuple(checked)


@dataclass(frozen=True)
class KeyGroupStreamPartitioner(Partitioner):
    """Flink's ``keyBy``: each key goes to the operator owning its key group (bit-exact with Flink)."""

    columns: tuple[Column, ...]
    max_parallelism: int | None = None
    null_keys: str = "error"
    name: ClassVar[str] = "HASH"

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", _check_columns(self.columns, "key_by"))
        if len(self.columns) > MAX_TUPLE_ARITY:
            raise UnsupportedKeyTypeError(
                f"a key of {len(self.columns)} columns has no Flink tuple type (Tuple1 .. Tuple{MAX_TUPLE_ARITY})"
            )
        if self.max_parallelism is not None:
            check_parallelism(1, self.max_parallelism)
        _check_null_keys(self.null_keys)

    def resolve_max_parallelism(self, num_consumers: int, max_parallelism: int | None = None) -> int:
        """Its own max parallelism if set, else ``max_parallelism``, else Flink's default for the consumers;
        checked against ``num_consumers``."""
        chosen = self.max_parallelism or max_parallelism or default_max_parallelism(num_consumers)
        return check_parallelism(num_consumers, chosen)[1]

    def validate(self, num_producers: int, num_consumers: int) -> None:
        super().validate(num_producers, num_consumers)
        self.resolve_max_parallelism(num_consumers)

    def _make_selector(
        self, producer: int, num_channels: int, num_consumers: int, max_parallelism: int | None
    ) -> ChannelSelector:
        chosen = self.resolve_max_parallelism(num_consumers, max_parallelism)
        return KeyGroupSelector(self.columns, num_channels, chosen, self.null_keys)


@dataclass(frozen=True)
class RebalancePartitioner(Partitioner):
    """Round robin from a random start per producer: the first row goes to ``(r + 1) % n``.

    ``adaptive=True`` is Flink 2.x's adaptive partitioner: rows go to the least-loaded of the next
    ``max_traverse`` channels (see :class:`~.selectors.AdaptiveRebalanceSelector`).
    """

    seed: int | None = None
    adaptive: bool = False
    max_traverse: int = 4
    name: ClassVar[str] = "REBALANCE"

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", _check_seed(self.seed))
        if not isinstance(self.adaptive, bool):
            raise ConfigError("adaptive", self.adaptive, "True or False", kind="argument")
        if isinstance(self.max_traverse, bool) or not isinstance(self.max_traverse, int) or self.max_traverse < 1:
            raise ConfigError(
                "max_traverse", self.max_traverse, "an integer >= 1 (channels looked at per choice)", kind="argument"
            )

    def _make_selector(
        self, producer: int, num_channels: int, num_consumers: int, max_parallelism: int | None
    ) -> ChannelSelector:
        start = int(_rng(self.seed, producer, 0).integers(num_channels))
        if self.adaptive:
            return AdaptiveRebalanceSelector(num_channels, start, self.max_traverse)
        return RoundRobinSelector(num_channels, start)


@dataclass(frozen=True)
class RescalePartitioner(Partitioner):
    """Round robin from 0 over the consumers this producer feeds on Flink's pointwise wiring."""

    name: ClassVar[str] = "RESCALE"
    is_pointwise: ClassVar[bool] = True

    def _make_selector(
        self, producer: int, num_channels: int, num_consumers: int, max_parallelism: int | None
    ) -> ChannelSelector:
        return RoundRobinSelector(num_channels, -1)


@dataclass(frozen=True)
class ShufflePartitioner(Partitioner):
    """A uniformly random consumer per row, from a ``java.util.Random`` per producer: producer ``p``'s is
    ``new Random(seed + p)`` (so producer 0 draws exactly ``new Random(seed).nextInt(n)``)."""

    seed: int | None = None
    name: ClassVar[str] = "SHUFFLE"

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", _check_seed(self.seed))

    def _make_selector(
        self, producer: int, num_channels: int, num_consumers: int, max_parallelism: int | None
    ) -> ChannelSelector:
        return ShuffleSelector(num_channels, None if self.seed is None else self.seed + producer)


@dataclass(frozen=True)
class BroadcastPartitioner(Partitioner):
    """Every row to every consumer (written once, read by all)."""

    name: ClassVar[str] = "BROADCAST"
    is_broadcast: ClassVar[bool] = True

    def _make_selector(
        self, producer: int, num_channels: int, num_consumers: int, max_parallelism: int | None
    ) -> ChannelSelector:
        return BroadcastSelector(num_channels)


@dataclass(frozen=True)
class ForwardPartitioner(Partitioner):
    """Producer i to consumer i; only between equal parallelisms."""

    name: ClassVar[str] = "FORWARD"
    is_pointwise: ClassVar[bool] = True

    def validate(self, num_producers: int, num_consumers: int) -> None:
        super().validate(num_producers, num_consumers)
        if num_producers != num_consumers:
            raise PartitionerError(
                "Forward partitioning does not allow change of parallelism. Upstream operation: producer "
                f"parallelism: {num_producers}, downstream operation: consumer parallelism: {num_consumers} "
                "You must use another partitioning strategy, such as broadcast, rebalance, shuffle or global."
            )

    def _make_selector(
        self, producer: int, num_channels: int, num_consumers: int, max_parallelism: int | None
    ) -> ChannelSelector:
        return ConstantSelector(num_channels, 0)


@dataclass(frozen=True)
class GlobalPartitioner(Partitioner):
    """Every row of every producer to consumer 0."""

    name: ClassVar[str] = "GLOBAL"

    def _make_selector(
        self, producer: int, num_channels: int, num_consumers: int, max_parallelism: int | None
    ) -> ChannelSelector:
        return ConstantSelector(num_channels, 0)


@dataclass(frozen=True)
class CustomPartitionerWrapper(Partitioner):
    """A user function picks the consumer from the key, like Flink's ``partitionCustom``.

    See :class:`~.selectors.CustomSelector` for how ``fn`` is called.
    """

    fn: Callable[..., Any]
    columns: tuple[Column, ...]
    vectorized: bool = True
    as_numpy: bool = False
    name: ClassVar[str] = "CUSTOM"

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigError("fn", self.fn, "a callable fn(key, num_partitions) -> channel(s)", kind="argument")
        object.__setattr__(self, "columns", _check_columns(self.columns, "custom"))

    def _make_selector(
        self, producer: int, num_channels: int, num_consumers: int, max_parallelism: int | None
    ) -> ChannelSelector:
        return CustomSelector(self.fn, self.columns, num_channels, self.vectorized, self.as_numpy)


# -- factories (the public names) ------------------------------------------------------------------


def key_by(*columns: Column, max_parallelism: int | None = None, null_keys: NullKeys = "error") -> Partitioner:
    """Flink's ``keyBy`` on one or more columns (several columns hash like Flink's ``TupleN``).

    ``max_parallelism`` (the number of key groups) defaults to the exchange's setting, else Flink's default
    for the consumer parallelism. Null keys raise :class:`NullKeyError` unless ``null_keys="zero"``.
    """
    return KeyGroupStreamPartitioner(tuple(columns), max_parallelism, null_keys)


def rebalance(seed: int | None = None, *, adaptive: bool = False, max_traverse: int = 4) -> Partitioner:
    """Flink's ``rebalance``: round robin from a random start per producer; ``seed`` makes it reproducible.

    ``adaptive=True``: Flink 2.x's adaptive partitioner; each small chunk of rows goes to the channel with
    the fewest bytes queued among the next ``max_traverse`` (in pipelined mode, where queues exist).
    """
    return RebalancePartitioner(seed, adaptive, max_traverse)


def rescale() -> Partitioner:
    """Flink's ``rescale``: round robin over the consumers of Flink's pointwise wiring."""
    return RescalePartitioner()


def shuffle(seed: int | None = None) -> Partitioner:
    """Flink's ``shuffle``: a uniformly random consumer per row; ``seed`` makes it reproducible."""
    return ShufflePartitioner(seed)


def broadcast() -> Partitioner:
    """Flink's ``broadcast``: every row to every consumer."""
    return BroadcastPartitioner()


def forward() -> Partitioner:
    """Flink's ``forward``: producer i to consumer i (equal parallelism only)."""
    return ForwardPartitioner()


def global_() -> Partitioner:
    """Flink's ``global``: everything to consumer 0."""
    return GlobalPartitioner()


def custom(fn: Callable[..., Any], *columns: Column, vectorized: bool = True, as_numpy: bool = False) -> Partitioner:
    """Flink's ``partitionCustom(partitioner, key)``: ``fn`` picks each row's consumer from its key.

    Vectorised (default): ``fn(keys, num_partitions)`` gets the whole batch's key column (a tuple of columns
    for several) as pyarrow arrays (numpy with ``as_numpy=True``) and returns a channel per row.
    ``vectorized=False``: ``fn(key, num_partitions)`` is called per row with Python values, exactly like
    Flink's ``Partitioner.partition`` — slower, one Python call per row. A function of one argument is
    called as ``fn(keys)`` / ``fn(key)``. Channels outside ``[0, num_partitions)`` raise :class:`PartitionerError`.
    """
    return CustomPartitionerWrapper(fn, tuple(columns), vectorized, as_numpy)
