"""How many network buffers Flink gives a result partition's and an input gate's pools (Flink's
``NettyShuffleUtils`` and ``ResultPartitionType``; docs/flink.md, "Buffer pools and their sizes"): pure
functions of the settings, used by the pools (:mod:`spark_credit_shuffle.buffers.pools`), the runtimes and
the planner alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import NetworkConfig

__all__ = [
    "UNBOUNDED",
    "GateBuffersSpec",
    "PartitionType",
    "input_gate_buffers_spec",
    "network_buffers_for_announcing",
    "result_partition_pool_size",
]

#: The maximum of an unbounded pool (Flink's Integer.MAX_VALUE).
UNBOUNDED = (1 << 31) - 1


class PartitionType:
    """Flink's ``ResultPartitionType`` names used for sizing."""

    PIPELINED = "PIPELINED"
    PIPELINED_BOUNDED = "PIPELINED_BOUNDED"
    BLOCKING = "BLOCKING"

    ALL = (PIPELINED, PIPELINED_BOUNDED, BLOCKING)


# -- sizing (pure functions) --------------------------------------------------------------------------


def result_partition_pool_size(
    num_subpartitions: int,
    config: NetworkConfig,
    partition_type: str = PartitionType.PIPELINED_BOUNDED,
    *,
    sort_shuffle_min_parallelism: int | None = None,
    sort_shuffle_min_buffers: int | None = None,
) -> tuple[int, int]:
    """(min, max) buffers of a result partition's LocalBufferPool (``NettyShuffleUtils``; docs/flink.md, "Pool sizes").

    Pipelined and hash-blocking partitions: min = N + 1; max = N * buffers_per_channel +
    floating_buffers_per_gate for PIPELINED_BOUNDED, unbounded otherwise. A BLOCKING partition whose
    subpartition count reaches ``sort_shuffle_min_parallelism`` is sized as Flink's sort-merge partition:
    min = ``sort_shuffle_min_buffers``, max = max(min, 4 N). Both default to the config's settings of those
    names (unset min parallelism: every blocking partition is a hash one).
    """
    if sort_shuffle_min_parallelism is None:
        sort_shuffle_min_parallelism = getattr(config, "sort_shuffle_min_parallelism", None)
    if sort_shuffle_min_buffers is None:
        sort_shuffle_min_buffers = getattr(config, "sort_shuffle_min_buffers", 512)
    if num_subpartitions < 1:
        raise ValueError(f"num_subpartitions must be >= 1, got {num_subpartitions}")
    if partition_type not in PartitionType.ALL:
        raise ValueError(f"partition_type must be one of {PartitionType.ALL}, got {partition_type!r}")
    n = num_subpartitions
    if (
        partition_type == PartitionType.BLOCKING
        and sort_shuffle_min_parallelism is not None
        and n >= sort_shuffle_min_parallelism
    ):
        return sort_shuffle_min_buffers, max(sort_shuffle_min_buffers, 4 * n)
    minimum = n + 1
    if partition_type == PartitionType.PIPELINED_BOUNDED:
        maximum = n * config.buffers_per_channel + config.floating_buffers_per_gate
    else:
        maximum = UNBOUNDED
    return minimum, max(minimum, maximum)


@dataclass(frozen=True)
class GateBuffersSpec:
    """Buffers of one input gate (``InputGateSpecUtils.createGateBuffersSpec``).

    ``exclusive_per_channel`` buffers go to each *remote* channel (local channels get none); the gate's
    floating LocalBufferPool has ``floating_min`` .. ``floating_max`` buffers. ``target_required`` and
    ``target_total`` are Flink's C * bpc + 1 and C * bpc + fpg.
    """

    num_channels: int
    num_remote_channels: int
    exclusive_per_channel: int
    floating_min: int
    floating_max: int
    target_required: int
    target_total: int

    @property
    def exclusive_total(self) -> int:
        """Exclusive buffers the remote channels request from the global pool."""
        return self.exclusive_per_channel * self.num_remote_channels

    @property
    def required(self) -> int:
        """Buffers the gate reserves in the global pool at setup (exclusive + floating minimum)."""
        return self.exclusive_total + self.floating_min

    @property
    def maximum(self) -> int:
        """Buffers the gate can hold at most (exclusive + floating maximum)."""
        return self.exclusive_total + self.floating_max


def input_gate_buffers_spec(
    num_channels: int,
    config: NetworkConfig,
    *,
    num_remote_channels: int | None = None,
    blocking: bool = False,
    max_required_buffers_per_gate: int | None = None,
) -> GateBuffersSpec:
    """The buffers of a gate with ``num_channels`` channels, ``num_remote_channels`` of them remote.

    Flink's rule: required = min(maxRequired, C * bpc + 1), where maxRequired is unbounded for pipelined
    gates and 1000 for blocking ones unless set; exclusive per channel = min(bpc, (required - 1) // C);
    floating min = required - C * exclusive, floating max = C * bpc + fpg - C * exclusive.
    In the model without credits (``credit_based=False``) there are no exclusive buffers: the gate pool
    has min = C and max = C * bpc + fpg, shared by all channels.
    """
    if num_channels < 1:
        raise ValueError(f"num_channels must be >= 1, got {num_channels}")
    remote = num_channels if num_remote_channels is None else num_remote_channels
    if not 0 <= remote <= num_channels:
        raise ValueError(f"num_remote_channels must be in [0, {num_channels}], got {remote}")
    c, bpc, fpg = num_channels, config.buffers_per_channel, config.floating_buffers_per_gate
    target_required = c * bpc + 1
    target_total = c * bpc + fpg
    if not config.credit_based:
        return GateBuffersSpec(c, remote, 0, c, max(c, target_total), target_required, target_total)
    if max_required_buffers_per_gate is None:
        max_required = 1000 if blocking else UNBOUNDED
    else:
        max_required = max_required_buffers_per_gate
    required = min(max_required, target_required)
    exclusive = min(bpc, (required - 1) // c)
    floating_min = max(1, required - c * exclusive)
    floating_max = max(floating_min, target_total - c * exclusive)
    return GateBuffersSpec(c, remote, exclusive, floating_min, floating_max, target_required, target_total)


def network_buffers_for_announcing(
    gates: list[tuple[int, bool]],
    partitions: list[tuple[int, str]],
    config: NetworkConfig,
    *,
    sort_shuffle_min_parallelism: int | None = None,
    sort_shuffle_min_buffers: int | None = None,
) -> int:
    """Network buffers a task announces for its gates and partitions (``computeNetworkBuffersForAnnouncing``).

    ``gates`` are (channels, blocking) pairs and count C * bpc + fpg each; ``partitions`` are
    (subpartitions, partition type) pairs and count their pool's max when pipelined, min when blocking.
    """
    total = 0
    for channels, _blocking in gates:
        total += channels * config.buffers_per_channel + config.floating_buffers_per_gate
    for subpartitions, partition_type in partitions:
        lo, hi = result_partition_pool_size(
            subpartitions,
            config,
            partition_type,
            sort_shuffle_min_parallelism=sort_shuffle_min_parallelism,
            sort_shuffle_min_buffers=sort_shuffle_min_buffers,
        )
        total += lo if partition_type == PartitionType.BLOCKING else hi
    return total
