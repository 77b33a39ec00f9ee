"""Typed errors. Every error names what was wrong and what would be accepted instead."""

from __future__ import annotations

from collections.abc import Iterable


class CreditShuffleError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(CreditShuffleError, ValueError):
    """An invalid setting, raised before any Spark job starts.

    ``setting`` is the option name (as a keyword argument or ``spark.creditShuffle.*`` key), ``value``
    the rejected value and ``allowed`` a human description of what is accepted.
    """

    def __init__(self, setting: str, value: object, allowed: str, detail: str = "") -> None:
        self.setting = setting
        self.value = value
        self.allowed = allowed
        message = f"invalid value {value!r} for setting '{setting}': allowed is {allowed}"
        if detail:
            message += f" ({detail})"
        super().__init__(message)


class UnknownSettingError(ConfigError):
    """A ``spark.creditShuffle.*`` key or keyword argument that names no setting."""

    def __init__(self, setting: str, known: Iterable[str]) -> None:
        known_list = ", ".join(sorted(known))
        super().__init__(setting, "<unknown setting>", f"one of: {known_list}")
        self.args = (f"unknown setting '{setting}'; the settings are: {known_list}",)


class PartitionerError(CreditShuffleError, ValueError):
    """A partitioner that cannot serve the requested exchange (Flink's UnsupportedOperationException)."""


class NullKeyError(PartitionerError):
    """A null key reached ``key_by``; Flink refuses these ("Assigned key must not be null!")."""


class UnsupportedKeyTypeError(PartitionerError, TypeError):
    """A key column whose type has no stable Java ``hashCode`` to reproduce."""


class UnsupportedColumnTypeError(CreditShuffleError, TypeError):
    """A column of a Spark type that Spark's Arrow hand-over to Python (``mapInArrow``) does not carry, so no
    exchange can move it (year-month and calendar intervals); raised before any Spark job starts."""


class InsufficientNetworkBuffersError(CreditShuffleError):
    """The buffer pools asked for more network buffers than the executor's network memory holds."""

    def __init__(
        self, required: int, available: int, total: int, segment_size: int, setting: str, detail: str = ""
    ) -> None:
        self.required = required
        self.available = available
        self.total = total
        self.segment_size = segment_size
        self.setting = setting
        self.detail = detail
        super().__init__(
            f"Insufficient number of network buffers: required {required}, but only {available} available. "
            f"The total number of network buffers is currently set to {total} of {segment_size} bytes each. "
            f"You can increase this number by raising '{setting}'." + (f" ({detail})" if detail else "")
        )


class BufferDecodeError(CreditShuffleError):
    """A network buffer that does not decode: bad header, truncated payload, fragments out of order,
    or a schema other than the channel's."""

    def __init__(self, message: str, channel: int | None = None, sequence_number: int | None = None) -> None:
        self.channel = channel
        self.sequence_number = sequence_number
        where = f"channel {channel}, sequence number {sequence_number}: "
        super().__init__(where + message)


class ProtocolError(CreditShuffleError):
    """A violation of the network protocol: bad frame from the wire, or a message out of turn."""


class ExchangeTimeoutError(CreditShuffleError, TimeoutError):
    """A wait that ran out of time; the message names what was waited for."""


class InsufficientSlotsError(CreditShuffleError):
    """A pipelined exchange needs all its tasks running at once and the cluster has fewer free slots."""


class NetworkBuffersNotFreeError(CreditShuffleError):
    """Exclusive buffers that fit the network memory but are still held by other pools: retry once they
    are recycled (a runtime waits up to ``buffers_request_timeout_ms`` for this)."""

    def __init__(self, requested: int, free: int) -> None:
        self.requested = requested
        self.free = free
        super().__init__(
            f"{requested} exclusive network buffers requested, only {free} are free right now; the rest are "
            f"still held by other buffer pools and return as they are recycled"
        )


class PartitionNotFoundError(CreditShuffleError):
    """A partition request named a result partition the producer has not registered."""

    def __init__(self, partition_id: int, subpartition: int | None = None) -> None:
        self.partition_id = partition_id
        self.subpartition = subpartition
        where = f" (subpartition {subpartition})" if subpartition is not None else ""
        super().__init__(f"PartitionNotFound: result partition {partition_id}{where} is not registered")


class BufferReorderingError(ProtocolError):
    """A channel received a buffer whose sequence number is not the next one expected."""

    def __init__(self, expected: int, received: int, channel: int | None = None) -> None:
        self.expected = expected
        self.received = received
        self.channel = channel
        where = f"channel {channel}: " if channel is not None else ""
        super().__init__(
            f"{where}Buffer re-ordering: expected buffer with sequence number {expected}, but received {received}"
        )


class SimulationStalledError(CreditShuffleError):
    """A virtual-clock simulation stopped making progress (deadlock) or exceeded its step budget."""


class PartitionStateError(CreditShuffleError, RuntimeError):
    """An operation a result partition or subpartition does not allow in its current state (for example
    writing after ``finish()``, or a second reader of a pipelined subpartition)."""


class NoBufferAvailableError(CreditShuffleError):
    """A network buffer was requested from a LocalBufferPool that can give none now: its size plus the
    overdraft is in use, or every network buffer of the executor is taken. Flink's non-blocking
    ``requestBufferBuilder`` returns null here and ``requestBufferBuilderBlocking`` waits; the sans-IO core
    never hands out memory beyond these bounds, so a caller that cannot wait gets this error (a resumable
    ``RecordWriter`` stops instead and writes on with ``resume()`` once buffers were recycled)."""

    def __init__(self, subpartition: int, pool_size: int, overdraft: int, used: int, network_total: int) -> None:
        self.subpartition = subpartition
        self.pool_size = pool_size
        self.overdraft = overdraft
        self.used = used
        self.network_total = network_total
        super().__init__(
            f"no network buffer for subpartition {subpartition}: the buffer pool holds {used} segments "
            f"(size {pool_size} + overdraft {overdraft}; the executor has {network_total} network buffers); "
            "wait until buffers are recycled (a resumable RecordWriter stops here and resume() writes on)"
        )
