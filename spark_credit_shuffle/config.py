"""NetworkConfig: the network stack's settings, with Flink's meanings and defaults.

Settings come from three places, strongest first: keyword arguments, a Spark conf
(``spark.creditShuffle.<name>``), then the defaults below, which are Flink's
(Flink 1.x option names, as 2.0 hard-codes several of them). Every value is checked once,
here, so that a bad one fails before any Spark job starts, with a :class:`ConfigError`
naming the setting, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, SupportsIndex

from ._pyspark import session_conf
from .errors import ConfigError, UnknownSettingError, register_settings

__all__ = [
    "CONF_PREFIX",
    "DEFAULT_SEGMENT_SIZE",
    "MAX_PARALLELISM_UPPER_BOUND",
    "MAX_SEGMENT_SIZE",
    "MIN_SEGMENT_SIZE",
    "AlignmentType",
    "CheckpointOptions",
    "NetworkConfig",
    "check_operator_parallelism",
    "default_max_parallelism",
    "parse_duration_ms",
    "parse_size",
]

CONF_PREFIX = "spark.creditShuffle."


def has_conf_prefix(key: str) -> bool:
    """True if ``key`` is under :data:`CONF_PREFIX`, in any case (a key in another case is a mistake to report)."""
    return key[: len(CONF_PREFIX)].lower() == CONF_PREFIX.lower()


#: Flink's default memory segment size (``taskmanager.memory.segment-size``: 32 KiB), the size of a network
#: buffer unless ``segment_size`` says otherwise.
DEFAULT_SEGMENT_SIZE = 32 * 1024
#: Flink's smallest memory segment (``MemoryManager.MIN_PAGE_SIZE``).
MIN_SEGMENT_SIZE = 4096
#: The largest memory segment Flink accepts: ``ConfigurationParserUtils.getPageSize`` casts the size to a Java
#: int (``checkedDownCast``: at most 2^31 - 1 bytes) and wants a power of two, so 2^30 bytes (1 GiB).
MAX_SEGMENT_SIZE = 1 << 30
#: Flink's ``KeyGroupRangeAssignment.UPPER_BOUND_MAX_PARALLELISM``.
MAX_PARALLELISM_UPPER_BOUND = 1 << 15
#: Flink's ``DEFAULT_LOWER_BOUND_MAX_PARALLELISM``.
_MAX_PARALLELISM_LOWER_BOUND = 1 << 7

_SIZE_UNITS = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "kibibytes": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20, "mebibytes": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "gibibytes": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40, "tebibytes": 1 << 40,
}  # fmt: skip
_DURATION_UNITS_MS = {
    "": 1, "ms": 1, "milli": 1, "millis": 1, "millisecond": 1, "milliseconds": 1,
    "s": 1000, "sec": 1000, "secs": 1000, "second": 1000, "seconds": 1000,
    "m": 60_000, "min": 60_000, "mins": 60_000, "minute": 60_000, "minutes": 60_000,
    "h": 3_600_000, "hour": 3_600_000, "hours": 3_600_000,
}  # fmt: skip
_QUANTITY = re.compile(r"^\s*(-?\d+)\s*([a-zA-Zµ]*)\s*$")


def parse_size(value: int | str, setting: str = "size") -> int:
    """Bytes in ``value``: an int, or a string such as ``"32kb"``, ``"64 KiB"`` or ``"1m"`` (powers of 1024)."""
    if isinstance(value, bool):
        raise ConfigError(setting, value, "a size such as 32768, '32kb' or '64 KiB'")
    if isinstance(value, int):
        return value
    match = _QUANTITY.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(setting, value, "a size such as 32768, '32kb' or '64 KiB' (units b, kb, mb, gb, tb)")
    return int(match.group(1)) * _SIZE_UNITS[unit]


def parse_duration_ms(value: int | str, setting: str = "duration") -> int:
    """Milliseconds in ``value``: an int (ms), or a string such as ``"10ms"``, ``"1 s"`` or ``"-1"``."""
    if isinstance(value, bool):
        raise ConfigError(setting, value, "a duration such as 100, '10ms' or '1 s'")
    if isinstance(value, int):
        return value
    match = _QUANTITY.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _DURATION_UNITS_MS:
        raise ConfigError(setting, value, "a duration such as 100, '10ms' or '1 s' (units ms, s, min, h)")
    return int(match.group(1)) * _DURATION_UNITS_MS[unit]


def check_count(value: object, setting: str, kind: str = "argument") -> int:
    """``value`` as an int >= 1 (a parallelism, a number of tasks), or a ConfigError naming ``setting`` (an
    argument unless ``kind`` says otherwise: counts are passed to functions, not set in a conf)."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise ConfigError(setting, value, "an integer >= 1", kind=kind)
    count = operator.index(value)
    if count < 1:
        raise ConfigError(setting, value, "an integer >= 1", kind=kind)
    return count


def check_operator_parallelism(value: object, setting: str, kind: str = "argument") -> int:
    """``value`` as a parallelism in [1, 32768], or a ConfigError naming ``setting`` (an argument unless
    ``kind`` says otherwise).

    Flink refuses an operator parallelism above its key group upper bound (2^15) with "Operator parallelism
    not within bounds" (``KeyGroupRangeAssignment.checkParallelismPreconditions``); so does every entry
    point here, before launch.
    """
    count = check_count(value, setting, kind)
    if count > MAX_PARALLELISM_UPPER_BOUND:
        raise ConfigError(
            setting,
            value,
            f"an integer in [1, {MAX_PARALLELISM_UPPER_BOUND}]",
            "Flink: 'Operator parallelism not within bounds' (the upper bound of key groups is 2^15)",
            kind=kind,
        )
    return count


def _parse_int(value: int | str, setting: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(setting, value, "an integer")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(setting, value, "an integer") from None


def _parse_optional_int(value: int | str | None, setting: str) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "default")):
        return None
    return _parse_int(value, setting)


#: The words a boolean setting takes (any case), for "did you mean".
_BOOL_WORDS = ("true", "false", "yes", "no", "on", "off")


def _parse_bool(value: bool | str, setting: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(setting, value, "true or false", choices=_BOOL_WORDS)


def _choice(allowed: tuple[str, ...], meaning: str) -> Callable[[Any, str], str]:
    """A parser for a setting that takes one of ``allowed`` (any case); ``meaning`` says what each does."""

    def parse(value: Any, setting: str) -> str:
        text = str(value).strip().lower()
        if text not in allowed:
            raise ConfigError(setting, value, meaning, choices=allowed)
        return text

    return parse


#: How the tasks of a pipelined exchange learn each other's listening addresses.
ADDRESS_EXCHANGES = ("auto", "allgather")
_parse_address_exchange = _choice(
    ADDRESS_EXCHANGES,
    "'auto' (the driver's address service on a classic session, Spark's allGather on Spark Connect) "
    "or 'allgather' (always allGather, about a second per exchange)",
)

#: Which channels of a pipelined exchange are local (no credit, no exclusive buffers).
LOCAL_CHANNELS = ("executor", "task")
_parse_local_channels = _choice(
    LOCAL_CHANNELS,
    "'executor' (every channel between two tasks of one executor is local, as between two tasks of one "
    "Flink TaskManager) or 'task' (only a task's own channel is local; every other one is remote, with "
    "credits and exclusive buffers)",
)


#: Whether the connections of a pipelined exchange run TLS (see :mod:`spark_credit_shuffle.runtime.security`).
SSL_MODES = ("auto", "on", "off")
_SSL_ALLOWED = (
    "'auto' (TLS when the session encrypts its own traffic: spark.network.crypto.enabled or spark.ssl.enabled), "
    "'on' (true) or 'off' (false)"
)


def _parse_ssl(value: Any, setting: str) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return "on"
    if text in ("false", "0", "no", "off"):
        return "off"
    if text == "auto":
        return text
    raise ConfigError(setting, value, _SSL_ALLOWED, choices=(*SSL_MODES, "true", "false"))


def _parse_monitor(value: Any, setting: str) -> bool | str:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == "web":
        return text
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(
        setting,
        value,
        "true (a line per exchange on stderr), false or 'web' (a live page and Prometheus metrics on the driver)",
        choices=(*_BOOL_WORDS, "web"),
    )


def _parse_address(value: Any, setting: str) -> str:
    text = str(value).strip()
    if not text or any(c.isspace() for c in text) or "/" in text:
        raise ConfigError(setting, value, "a host name or IP address to listen on, such as 127.0.0.1")
    return text


#: The codecs of the blocking shuffle's per-buffer compression.
COMPRESSION_CODECS = ("lz4", "zstd", "none")
_parse_codec = _choice(COMPRESSION_CODECS, "'lz4' (Flink's default), 'zstd' or 'none' (no compression)")


def _bytes(n: int) -> str:
    """``n`` bytes for people: ``64 MiB``, ``32 KiB``, ``1536 bytes``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def default_max_parallelism(parallelism: int) -> int:
    """Flink's default max parallelism (number of key groups) for an operator of ``parallelism``.

    ``min(max(roundUpToPowerOfTwo(p + p / 2), 128), 32768)``, as ``computeDefaultMaxParallelism``.
    """
    check_operator_parallelism(parallelism, "parallelism")
    wanted = parallelism + parallelism // 2
    rounded = 1 << (wanted - 1).bit_length()
    return min(max(rounded, _MAX_PARALLELISM_LOWER_BOUND), MAX_PARALLELISM_UPPER_BOUND)


# -- checkpoint options --------------------------------------------------------------------------------
# Flink builds CheckpointOptions from its checkpoint config; here they follow from NetworkConfig's
# checkpoint settings (:attr:`NetworkConfig.checkpoint_options`), and the buffer format encodes them.


class AlignmentType(enum.IntEnum):
    """Flink's ``CheckpointOptions.AlignmentType``: how consumers align a checkpoint's barriers."""

    AT_LEAST_ONCE = 0
    ALIGNED = 1
    UNALIGNED = 2


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointOptions:
    """Flink's ``CheckpointOptions`` as far as the network sees them: the alignment, and for an aligned
    barrier the ``aligned_checkpoint_timeout_ms`` after which alignment switches to unaligned (-1: never;
    Flink's ``execution.checkpointing.aligned-checkpoint-timeout``)."""

    alignment: AlignmentType = AlignmentType.ALIGNED
    aligned_checkpoint_timeout_ms: int = -1

    @property
    def is_timeoutable(self) -> bool:
        """An aligned barrier that may time out to unaligned (Flink's ``isTimeoutable``)."""
        return self.alignment is AlignmentType.ALIGNED and self.aligned_checkpoint_timeout_ms >= 0

    @property
    def is_unaligned(self) -> bool:
        return self.alignment is AlignmentType.UNALIGNED

    def to_unaligned(self) -> CheckpointOptions:
        """The options of an aligned barrier whose alignment timed out (Flink's ``toUnaligned``)."""
        return CheckpointOptions(AlignmentType.UNALIGNED, -1)


def _setting(default: Any, flink: str, parse: Callable[[Any, str], Any], doc: str) -> Any:
    return field(default=default, metadata={"flink": flink, "parse": parse, "doc": doc})


@dataclass(frozen=True)
class NetworkConfig:
    """The settings of one exchange's network stack.

    Immutable; build a changed copy with :meth:`replace`. Sizes are bytes and durations
    milliseconds; the constructor, :meth:`from_conf` and :meth:`from_spark` also take human
    strings ("32kb", "64 KiB", "10ms", "1 s").
    """

    segment_size: int = _setting(
        DEFAULT_SEGMENT_SIZE, "taskmanager.memory.segment-size", parse_size,
        "bytes in one network buffer; a power of two from 4 KiB to 1 GiB (Flink's bounds), at most network_memory",
    )  # fmt: skip
    buffers_per_channel: int = _setting(
        2, "taskmanager.network.memory.buffers-per-channel", _parse_int,
        "exclusive buffers of each remote input channel, which are also its initial credit",
    )  # fmt: skip
    floating_buffers_per_gate: int = _setting(
        8, "taskmanager.network.memory.floating-buffers-per-gate", _parse_int,
        "floating buffers an input gate shares among its channels, handed out by announced backlog",
    )  # fmt: skip
    max_buffers_per_channel: int = _setting(
        10, "taskmanager.network.memory.max-buffers-per-channel", _parse_int,
        "buffers one subpartition may hold before its producer counts as back-pressured",
    )  # fmt: skip
    max_overdraft_buffers_per_gate: int = _setting(
        20, "taskmanager.network.memory.max-overdraft-buffers-per-gate", _parse_int,
        "extra buffers a producer may take beyond its pool size to finish the record it is writing",
    )  # fmt: skip
    buffer_timeout_ms: int = _setting(
        100, "execution.buffer-timeout.interval", parse_duration_ms,
        "how long a partly filled buffer may wait before it is flushed: 0 flushes after every input batch, "
        "-1 flushes only full buffers and events",
    )  # fmt: skip
    max_parallelism: int | None = _setting(
        None, "pipeline.max-parallelism", _parse_optional_int,
        "number of key groups; unset means Flink's default from the consumer parallelism",
    )  # fmt: skip
    credit_based: bool = _setting(
        True, "taskmanager.network.credit-model", _parse_bool,
        "credit-based flow control; false is the pre-1.5 model in which a full receiver stops its connection",
    )  # fmt: skip
    network_memory: int = _setting(
        64 * 1024 * 1024, "taskmanager.memory.network.min", parse_size,
        "network memory of one executor, from which all its buffers are taken",
    )  # fmt: skip
    buffers_request_timeout_ms: int = _setting(
        30_000, "taskmanager.network.memory.buffers-request-timeout", parse_duration_ms,
        "how long a task waits for network buffers before it fails",
    )  # fmt: skip
    partition_request_timeout_ms: int = _setting(
        10_000, "taskmanager.network.partition-request-timeout", parse_duration_ms,
        "how long a consumer waits for its producers to connect, answer or send",
    )  # fmt: skip

    checkpoint_interval_ms: int = _setting(
        0, "execution.checkpointing.interval", parse_duration_ms,
        "how often each pipelined producer injects a checkpoint barrier into every subpartition (blocking "
        "mode: one barrier at the end of each producer); 0 turns checkpoint barriers off",
    )  # fmt: skip
    unaligned_checkpoints: bool = _setting(
        False, "execution.checkpointing.unaligned.enabled", _parse_bool,
        "barriers are unaligned: priority events that overtake the queued buffers, which consumers capture as "
        "channel state, instead of aligned barriers that block each channel until every channel delivered one",
    )  # fmt: skip
    checkpoint_timeout_ms: int = _setting(
        600_000, "execution.checkpointing.timeout", parse_duration_ms,
        "how long a pipelined producer waits for every consumer to acknowledge a checkpoint before it injects "
        "the next one anyway (which makes the consumers still aligning the late one abort it)",
    )  # fmt: skip
    aligned_checkpoint_timeout_ms: int = _setting(
        0, "execution.checkpointing.aligned-checkpoint-timeout", parse_duration_ms,
        "with unaligned checkpoints: barriers start aligned and switch to unaligned once alignment took longer "
        "than this; 0 means unaligned from the start",
    )  # fmt: skip

    metrics_sample_interval_ms: int = _setting(
        100, "metrics.reporter.<name>.interval", parse_duration_ms,
        "how often each task samples its pool usage, backlog, credits and backpressure for the metrics "
        "timeline (wall time); 0 turns the timeline off",
    )  # fmt: skip

    address_exchange: str = _setting(
        "auto", "none (Flink's JobManager deploys consumers with their producers' addresses)",
        _parse_address_exchange,
        "how the tasks of a pipelined exchange learn each other's addresses: 'auto' through a small "
        "authenticated service on the driver (Spark's allGather on Spark Connect), 'allgather' always through "
        "Spark's allGather, for clusters whose executors cannot open connections to the driver",
    )  # fmt: skip

    sort_shuffle_min_parallelism: int | None = _setting(
        None, "taskmanager.network.sort-shuffle.min-parallelism", _parse_optional_int,
        "blocking partitions with at least this many subpartitions are sized as Flink's sort-merge partitions "
        "(min sort_shuffle_min_buffers, max max(min, 4 N)); unset: as hash blocking partitions (min N + 1), "
        "which is what the blocking exchange's partition is (Flink 2.x: 1, every blocking partition sort-merge)",
    )  # fmt: skip
    sort_shuffle_min_buffers: int = _setting(
        512, "taskmanager.network.sort-shuffle.min-buffers", _parse_int,
        "buffers a sort-merge blocking partition reserves (see sort_shuffle_min_parallelism)",
    )  # fmt: skip
    buffer_debloat_enabled: bool = _setting(
        False, "taskmanager.network.memory.buffer-debloat.enabled", _parse_bool,
        "pipelined mode: each consumer measures its throughput and announces the buffer size that holds "
        "buffer_debloat_target_ms of in-flight data (NewBufferSize); its producers cut new buffers at that size",
    )  # fmt: skip
    buffer_debloat_target_ms: int = _setting(
        1000, "taskmanager.network.memory.buffer-debloat.target", parse_duration_ms,
        "the time the in-flight data of a consumer should take to consume",
    )  # fmt: skip
    buffer_debloat_period_ms: int = _setting(
        200, "taskmanager.network.memory.buffer-debloat.period", parse_duration_ms,
        "how often a consumer recalculates its buffer size",
    )  # fmt: skip
    buffer_debloat_samples: int = _setting(
        20, "taskmanager.network.memory.buffer-debloat.samples", _parse_int,
        "the samples the buffer size's moving average spans (alpha = 2 / (samples + 1))",
    )  # fmt: skip
    buffer_debloat_threshold_percentages: int = _setting(
        25, "taskmanager.network.memory.buffer-debloat.threshold-percentages", _parse_int,
        "a new buffer size is announced only when it differs from the last by at least this many percent",
    )  # fmt: skip
    blocking_shuffle_compression: bool = _setting(
        True, "taskmanager.network.blocking-shuffle.compression.enabled", _parse_bool,
        "blocking mode: each data buffer is compressed on its own (with compression_codec) before Spark's shuffle "
        "stores it, and decompressed by its consumer (Flink's default, on; measured here to store less and run "
        "faster although Spark's shuffle compresses what it stores too, see docs/configuration.md)",
    )  # fmt: skip
    compression_codec: str = _setting(
        "lz4", "taskmanager.network.compression.codec", _parse_codec,
        "the codec of blocking_shuffle_compression: 'lz4' (Flink's default) or 'zstd' (Arrow's codecs, as in its "
        "IPC compression), or 'none'",
    )  # fmt: skip
    local_channels: str = _setting(
        "executor", "none (Flink: every channel within one TaskManager is a LocalInputChannel)",
        _parse_local_channels,
        "which channels of a pipelined exchange are local, without credit or exclusive buffers: 'executor' "
        "every channel between two tasks of one executor (Flink's rule, with the executor as the TaskManager), "
        "'task' only a task's own channel (every other one remote, with credits, as if each task had an "
        "executor of its own)",
    )  # fmt: skip

    monitor: bool | str = _setting(
        False, "none (Flink's web UI shows back pressure while a job runs)", _parse_monitor,
        "print one line per exchange to stderr every few seconds while it runs (rows moved, back-pressured "
        "producers, the consumer where backpressure starts, pool usage), from samples the tasks send to the "
        "driver; 'web' serves them as a live page and Prometheus metrics on the driver instead "
        "(monitor_web_port, monitor_web_address); classic sessions only (on Spark Connect the executors cannot "
        "reach the client)",
    )  # fmt: skip
    monitor_web_port: int = _setting(
        0, "rest.port", _parse_int,
        "monitor='web': the port of the driver's page and Prometheus endpoint; 0 takes a free one (the URL is "
        "printed); one page per driver process, started by the first exchange that asks for it",
    )  # fmt: skip
    monitor_web_address: str = _setting(
        "127.0.0.1", "rest.bind-address", _parse_address,
        "monitor='web': the address the page listens on; the loopback unless set (anyone who reaches it still "
        "needs the token in its URL)",
    )  # fmt: skip
    freeze_worker_heap: bool = _setting(
        False, "none (a JVM's garbage collector does not walk a Python heap)", _parse_bool,
        "true: an exchange's task makes the collection PySpark runs after each task of its reused Python worker walk "
        "only what that task left, as the workers of spark_credit_shuffle.worker.daemon do (each collection freezes "
        "its survivors, every 64th walks everything); the worker's later tasks, the user's own included, keep it, "
        "so it is off unless asked for (its saving: docs/configuration.md)",
    )  # fmt: skip
    ssl: str = _setting(
        "auto", "security.ssl.internal.enabled", _parse_ssl,
        "pipelined mode: mutual TLS on every connection of the exchange (task to task and task to the driver's "
        "address service), pinned to a key pair made on the driver for the exchange; 'auto' turns it on when "
        "the session encrypts its own traffic (spark.network.crypto.enabled or spark.ssl.enabled), 'on' always, "
        "'off' never. Blocking mode stores its buffers in Spark's shuffle, which Spark's own settings protect",
    )  # fmt: skip

    def __post_init__(self) -> None:
        given: dict[str, Any] = {}
        for f in fields(self):
            given[f.name] = raw = getattr(self, f.name)
            object.__setattr__(self, f.name, f.metadata["parse"](raw, f.name))
        try:
            self._validate()
        except ConfigError as exc:  # the value as the user wrote it ("1 GiB"), not as parsed (1073741824)
            raw = given.get(exc.setting)
            if type(exc) is ConfigError and isinstance(raw, str):
                raise exc.replaced(value=raw) from None
            raise

    def _validate(self) -> None:
        if not MIN_SEGMENT_SIZE <= self.segment_size <= MAX_SEGMENT_SIZE or not _is_power_of_two(self.segment_size):
            raise ConfigError(
                "segment_size",
                self.segment_size,
                f"a power of two of at least {MIN_SEGMENT_SIZE} bytes (4 KiB) and at most {MAX_SEGMENT_SIZE} bytes "
                "(1 GiB)",
                "Flink's taskmanager.memory.segment-size: at least MemoryManager.MIN_PAGE_SIZE, a power of 2, and a "
                "Java int",
            )
        for name in ("buffers_per_channel", "floating_buffers_per_gate", "max_overdraft_buffers_per_gate"):
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), "an integer >= 0")
        if self.buffers_per_channel == 0 and self.floating_buffers_per_gate == 0:
            raise ConfigError(
                "buffers_per_channel",
                0,
                "at least 1 when floating_buffers_per_gate is 0",
                "an input gate with neither exclusive nor floating buffers can never receive data",
            )
        if self.sort_shuffle_min_parallelism is not None and self.sort_shuffle_min_parallelism < 1:
            raise ConfigError(
                "sort_shuffle_min_parallelism", self.sort_shuffle_min_parallelism, "unset or an integer >= 1"
            )
        if self.sort_shuffle_min_buffers < 1:
            raise ConfigError("sort_shuffle_min_buffers", self.sort_shuffle_min_buffers, "an integer >= 1")
        if self.max_buffers_per_channel < 1:
            raise ConfigError("max_buffers_per_channel", self.max_buffers_per_channel, "an integer >= 1")
        if self.buffer_timeout_ms < -1:
            raise ConfigError(
                "buffer_timeout_ms", self.buffer_timeout_ms, "-1 (flush only when full), 0 (always) or > 0 ms"
            )
        if self.max_parallelism is not None and not 1 <= self.max_parallelism <= MAX_PARALLELISM_UPPER_BOUND:
            raise ConfigError(
                "max_parallelism", self.max_parallelism, f"an integer in [1, {MAX_PARALLELISM_UPPER_BOUND}]"
            )
        if self.network_memory < self.segment_size:
            self._segment_over_network_memory()
        if self.metrics_sample_interval_ms < 0:
            raise ConfigError(
                "metrics_sample_interval_ms", self.metrics_sample_interval_ms, "0 (no timeline) or a duration > 0 ms"
            )
        for name in ("checkpoint_interval_ms", "aligned_checkpoint_timeout_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), "0 (off) or a duration > 0 ms")
        if self.checkpoint_timeout_ms <= 0:
            raise ConfigError("checkpoint_timeout_ms", self.checkpoint_timeout_ms, "a duration > 0 ms")
        if self.buffer_debloat_period_ms <= 0:
            raise ConfigError("buffer_debloat_period_ms", self.buffer_debloat_period_ms, "a duration > 0 ms")
        if self.buffer_debloat_samples < 1:
            raise ConfigError("buffer_debloat_samples", self.buffer_debloat_samples, "an integer >= 1")
        if not 0 <= self.buffer_debloat_threshold_percentages <= 100:
            raise ConfigError(
                "buffer_debloat_threshold_percentages", self.buffer_debloat_threshold_percentages, "0 to 100"
            )
        for name in ("buffers_request_timeout_ms", "partition_request_timeout_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "a duration > 0 ms")
        if not 0 <= self.monitor_web_port <= 65535:
            raise ConfigError("monitor_web_port", self.monitor_web_port, "0 (a free port) or a port up to 65535")

    def _segment_over_network_memory(self) -> None:
        """One executor's network memory holds less than one segment: the error names the setting the user
        changed. With ``network_memory`` at its default, the segment size is what went too far; otherwise the
        network memory is what is too small for the segment."""
        default_memory = NetworkConfig.settings()["network_memory"].default
        if self.network_memory == default_memory:
            raise ConfigError(
                "segment_size",
                self.segment_size,
                f"a power of two from {MIN_SEGMENT_SIZE} bytes (4 KiB) up to network_memory "
                f"({_bytes(self.network_memory)}, the default)",
                "one executor's network memory must hold at least one segment; raise network_memory "
                f"({CONF_PREFIX}networkMemory) to at least {_bytes(self.segment_size)} for segments this large",
            )
        raise ConfigError(
            "network_memory",
            self.network_memory,
            f"at least one segment: segment_size, {_bytes(self.segment_size)}",
            "or lower segment_size",
        )

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def settings(cls) -> dict[str, dataclasses.Field[Any]]:
        """Every setting by its Python name, with ``flink`` (option name) and ``doc`` in its metadata."""
        return {f.name: f for f in fields(cls)}

    @staticmethod
    def conf_key(name: str) -> str:
        """The Spark conf key of setting ``name``: ``segment_size`` -> ``spark.creditShuffle.segmentSize``."""
        head, *rest = name.split("_")
        return CONF_PREFIX + head + "".join(part.capitalize() for part in rest)

    @classmethod
    def from_conf(cls, conf: Mapping[str, str], **overrides: Any) -> NetworkConfig:
        """Settings from the ``spark.creditShuffle.*`` entries of ``conf``; keyword arguments win.

        Entries without the prefix are ignored; an unknown key with the prefix, in any case (Spark's keys
        are case-sensitive, so ``spark.creditshuffle.bufferTimeoutMs`` would otherwise be ignored without a
        word), is an :class:`UnknownSettingError` naming the nearest key.
        """
        by_key = {cls.conf_key(name): name for name in cls.settings()}
        values: dict[str, Any] = {}
        for key, value in conf.items():
            if not has_conf_prefix(key):
                continue
            if key not in by_key:
                raise UnknownSettingError(key, by_key)
            values[by_key[key]] = value
        unknown = set(overrides) - set(by_key.values())
        if unknown:
            raise UnknownSettingError(sorted(unknown)[0], by_key.values())
        from_conf = {name: key for key, name in by_key.items() if name in values and name not in overrides}
        values.update(overrides)
        try:
            return cls(**values)
        except ConfigError as exc:  # a value of the conf: the message names the key the user set
            conf_key = from_conf.get(exc.setting)
            if type(exc) is ConfigError and conf_key is not None:
                raise exc.replaced(conf_key=conf_key) from None
            raise

    @classmethod
    def from_spark(cls, spark: Any, **overrides: Any) -> NetworkConfig:
        """Settings from a SparkSession's conf (``spark.creditShuffle.*``), then keyword arguments.

        Reads the session's conf on the driver only (:func:`~._pyspark.session_conf`), so it works on Spark
        Connect too.
        """
        conf = {key: value for key, value in session_conf(spark).items() if has_conf_prefix(key)}
        return cls.from_conf(conf, **overrides)

    def replace(self, **changes: Any) -> NetworkConfig:
        """A copy with ``changes`` applied (and validated)."""
        unknown = set(changes) - set(self.settings())
        if unknown:
            raise UnknownSettingError(sorted(unknown)[0], self.settings())
        return dataclasses.replace(self, **changes)

    # -- derived values -----------------------------------------------------------------------------

    @property
    def checkpoint_options(self) -> CheckpointOptions:
        """The options of the barriers producers inject: aligned, unaligned, or aligned with a timeout."""
        if not self.unaligned_checkpoints:
            return CheckpointOptions(AlignmentType.ALIGNED)
        if self.aligned_checkpoint_timeout_ms > 0:
            return CheckpointOptions(AlignmentType.ALIGNED, self.aligned_checkpoint_timeout_ms)
        return CheckpointOptions(AlignmentType.UNALIGNED)

    @property
    def total_network_buffers(self) -> int:
        """Buffers one executor's network memory holds: ``floor(network_memory / segment_size)``."""
        return self.network_memory // self.segment_size

    def resolve_max_parallelism(self, parallelism: int) -> int:
        """The max parallelism an exchange with ``parallelism`` consumers uses, checked against it."""
        check_operator_parallelism(parallelism, "parallelism")
        max_parallelism = self.max_parallelism or default_max_parallelism(parallelism)
        if parallelism > max_parallelism:
            raise ConfigError(
                "parallelism",
                parallelism,
                f"at most max_parallelism ({max_parallelism})",
                "raise max_parallelism (spark.creditShuffle.maxParallelism) or lower the parallelism",
                kind="argument",
            )
        return max_parallelism

    def describe(self) -> str:
        """One line per setting: conf key, value, Flink option."""
        lines = []
        for name, f in self.settings().items():
            lines.append(f"{self.conf_key(name)} = {getattr(self, name)!r}  ({f.metadata['flink']})")
        return "\n".join(lines)


register_settings(NetworkConfig.settings())  # ConfigError calls these names settings, any other an argument
