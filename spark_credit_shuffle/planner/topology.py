"""What the planner plans for: the exchanges of a topology (:class:`ExchangeSpec`, with the partitioner
names it accepts) and the executors they run on (:class:`Executors`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..config import NetworkConfig, check_count, check_operator_parallelism, parse_size
from ..errors import ConfigError
from ..partitioners import (
    Partitioner,
    broadcast,
    custom,
    forward,
    global_,
    key_by,
    rebalance,
    rescale,
    shuffle,
)

__all__ = ["PATTERNS", "ExchangeSpec", "Executors", "PlannedExchange"]


class PlannedExchange(Protocol):
    """What the planner reads of an exchange the runtime is about to launch (its ``ExchangePlan``)."""

    @property
    def num_producers(self) -> int: ...
    @property
    def num_consumers(self) -> int: ...
    @property
    def partitioner(self) -> Partitioner: ...
    @property
    def mode(self) -> str: ...
    @property
    def name(self) -> str | None: ...
    @property
    def config(self) -> NetworkConfig: ...


_MODES = ("blocking", "pipelined")

#: Partitioner names the planner accepts, by Flink's name (lower case) and by edge pattern.
PATTERNS: dict[str, str] = {
    "hash": "all-to-all",
    "rebalance": "all-to-all",
    "shuffle": "all-to-all",
    "global": "all-to-all",
    "custom": "all-to-all",
    "broadcast": "all-to-all (every row to every consumer)",
    "rescale": "pointwise",
    "forward": "pointwise 1:1",
    "all-to-all": "all-to-all",
    "pointwise": "pointwise",
}


def _partitioner_of(name: str | Partitioner) -> Partitioner:
    if isinstance(name, Partitioner):
        return name
    key = str(name).strip().lower().replace("_", "-")
    factories = {
        "hash": lambda: key_by("key"),
        "key-by": lambda: key_by("key"),
        "rebalance": rebalance,
        "shuffle": shuffle,
        "global": global_,
        "custom": lambda: custom(lambda k, n: k, "key"),
        "broadcast": broadcast,
        "rescale": rescale,
        "forward": forward,
        "all-to-all": rebalance,
        "pointwise": rescale,
    }
    factory = factories.get(key)
    if factory is None:
        raise ConfigError(
            "partitioner",
            name,
            "one of " + ", ".join(PATTERNS) + " (or a Partitioner)",
            kind="argument",
            choices=(*PATTERNS, "key-by"),
        )
    return factory()


@dataclass(frozen=True)
class ExchangeSpec:
    """One exchange of a topology: producer and consumer parallelism, partitioner (pattern) and mode.

    ``partitioner`` is a :class:`Partitioner` or a name: ``hash``, ``rebalance``, ``shuffle``, ``global``,
    ``custom``, ``broadcast`` (all-to-all), ``rescale``, ``forward`` (pointwise), or the bare patterns
    ``all-to-all`` and ``pointwise``. ``mode`` defaults to ``blocking``, as ``exchange()``'s does.
    """

    producers: int
    consumers: int
    partitioner: str | Partitioner = "hash"
    mode: str = "blocking"
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "producers", check_operator_parallelism(self.producers, "producers"))
        object.__setattr__(self, "consumers", check_operator_parallelism(self.consumers, "consumers"))
        if self.mode not in _MODES:
            raise ConfigError("mode", self.mode, " or ".join(repr(m) for m in _MODES), kind="argument", choices=_MODES)
        _partitioner_of(self.partitioner).validate(self.producers, self.consumers)

    @property
    def resolved(self) -> Partitioner:
        return _partitioner_of(self.partitioner)

    @property
    def label(self) -> str:
        return self.name or f"{self.resolved.name.lower()}-{self.mode}"

    @classmethod
    def from_plan(cls, plan: PlannedExchange) -> ExchangeSpec:
        return cls(plan.num_producers, plan.num_consumers, plan.partitioner, plan.mode, plan.name)

    @classmethod
    def parse(cls, text: str) -> ExchangeSpec:
        """``"4:4:hash:pipelined"`` (producers:consumers[:partitioner[:mode]])."""
        parts = [p.strip() for p in str(text).split(":")]
        if not 2 <= len(parts) <= 4:
            raise ConfigError(
                "exchange", text, "producers:consumers[:partitioner[:mode]], e.g. 4:4:hash:pipelined", kind="argument"
            )
        try:
            producers, consumers = int(parts[0]), int(parts[1])
        except ValueError:
            raise ConfigError(
                "exchange", text, "integer producer and consumer counts, e.g. 4:4:hash", kind="argument"
            ) from None
        return cls(producers, consumers, *(parts[2:]))


@dataclass(frozen=True)
class Executors:
    """The executors a topology runs on: how many, task slots each, network memory each (bytes or "64mb").

    ``network_memory=None`` takes the config's ``network_memory``. ``placement``, if given, is the executor
    (0 .. count - 1) of every task of the pipelined stages, as Spark placed them; without it the planner
    assumes the placement that needs the most buffers on one executor.
    """

    count: int = 1
    slots: int = 1
    network_memory: int | str | None = None
    placement: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "count", check_count(self.count, "executors"))
        object.__setattr__(self, "slots", check_count(self.slots, "slots"))
        if self.network_memory is not None:
            object.__setattr__(self, "network_memory", parse_size(self.network_memory, "network_memory"))
        if self.placement is not None:
            placement = tuple(self.placement)
            if any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < self.count for e in placement):
                raise ConfigError("placement", self.placement, f"an executor index in [0, {self.count}) per task")
            busiest = max((placement.count(e) for e in set(placement)), default=0)
            if busiest > self.slots:
                raise ConfigError(
                    "placement", self.placement, f"at most slots={self.slots} tasks per executor", f"one has {busiest}"
                )
            object.__setattr__(self, "placement", placement)

    @property
    def total_slots(self) -> int:
        return self.count * self.slots
