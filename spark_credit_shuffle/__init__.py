"""spark_credit_shuffle: Apache Flink's network stack as a data exchange between Spark tasks.

Public API only; see README.md for a tour.
"""

from __future__ import annotations

from .config import NetworkConfig, default_max_parallelism
from .errors import (
    BufferDecodeError,
    ConfigError,
    CreditShuffleError,
    ExchangeTimeoutError,
    InsufficientNetworkBuffersError,
    InsufficientSlotsError,
    NullKeyError,
    PartitionerError,
    ProtocolError,
    UnknownSettingError,
    UnsupportedKeyTypeError,
)

__version__ = "0.1.0"

__all__ = [
    "BufferDecodeError",
    "ConfigError",
    "CreditShuffleError",
    "ExchangeTimeoutError",
    "InsufficientNetworkBuffersError",
    "InsufficientSlotsError",
    "NetworkConfig",
    "NullKeyError",
    "PartitionerError",
    "ProtocolError",
    "UnknownSettingError",
    "UnsupportedKeyTypeError",
    "__version__",
    "default_max_parallelism",
]
