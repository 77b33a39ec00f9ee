"""Flink's channel selectors (partitioners), vectorised over Arrow batches, and Flink's key groups.

- :mod:`.keygroups`: Java ``hashCode`` per Arrow type, Flink's murmur, key groups and operator indexes.
- :mod:`.murmur3`: MurmurHash3 of an int, vectorised: Flink's murmurHash and Spark's ``hash()`` both use it.
- :mod:`.selectors`: :class:`ChannelSelector`, the stateful per-producer half that picks channels per batch.
- :mod:`.partitioner`: :class:`Partitioner` values and the factories ``key_by``, ``rebalance``, ...
"""

from __future__ import annotations

from .keygroups import (
    SUPPORTED_KEY_TYPES,
    check_parallelism,
    default_max_parallelism,
    java_hash_codes,
    key_group_channels,
    key_group_range,
    key_groups,
    murmur_hash,
)
from .partitioner import (
    BroadcastPartitioner,
    CustomPartitionerWrapper,
    ForwardPartitioner,
    GlobalPartitioner,
    KeyGroupStreamPartitioner,
    Partitioner,
    RebalancePartitioner,
    RescalePartitioner,
    ShufflePartitioner,
    broadcast,
    custom,
    forward,
    global_,
    key_by,
    pointwise_wiring,
    rebalance,
    rescale,
    shuffle,
)
from .selectors import (
    AdaptiveRebalanceSelector,
    BroadcastSelector,
    ChannelSelector,
    ConstantSelector,
    CustomSelector,
    KeyGroupSelector,
    RoundRobinSelector,
    ShuffleSelector,
    key_columns,
)

__all__ = [
    "SUPPORTED_KEY_TYPES",
    "AdaptiveRebalanceSelector",
    "BroadcastPartitioner",
    "BroadcastSelector",
    "ChannelSelector",
    "ConstantSelector",
    "CustomPartitionerWrapper",
    "CustomSelector",
    "ForwardPartitioner",
    "GlobalPartitioner",
    "KeyGroupSelector",
    "KeyGroupStreamPartitioner",
    "Partitioner",
    "RebalancePartitioner",
    "RescalePartitioner",
    "RoundRobinSelector",
    "ShufflePartitioner",
    "ShuffleSelector",
    "broadcast",
    "check_parallelism",
    "custom",
    "default_max_parallelism",
    "forward",
    "global_",
    "java_hash_codes",
    "key_by",
    "key_columns",
    "key_group_channels",
    "key_group_range",
    "key_groups",
    "murmur_hash",
    "pointwise_wiring",
    "rebalance",
    "rescale",
    "shuffle",
]
