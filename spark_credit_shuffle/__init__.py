"""spark_credit_shuffle: Apache Flink's network stack as a data exchange between Spark tasks.

Public API only; see README.md for a tour.
"""

from __future__ import annotations

import contextlib

from ._pyspark import MIN_PYSPARK  # first: refuses a pyspark older than MIN_PYSPARK
from .buffers import CheckpointBarrier, EndOfPartition, LatencyMarker, RecordReader, RecordWriter
from .config import NetworkConfig, default_max_parallelism
from .dataframe import rdd_with_channel, with_channel
from .diagnosis import Diagnosis, SubtaskSummary
from .errors import (
    BarrierStageError,
    BufferDecodeError,
    ChainedOperatorError,
    ConfigError,
    CreditShuffleError,
    ExchangeTimeoutError,
    InsufficientNetworkBuffersError,
    InsufficientSlotsError,
    NullKeyError,
    PartitionerError,
    ProtocolError,
    SchemaMismatchError,
    UnknownSettingError,
    UnsupportedColumnTypeError,
    UnsupportedInputError,
    UnsupportedKeyTypeError,
    WorkerPythonError,
    install_error_hook,
    task_error,
    typed_errors,
    uninstall_error_hook,
)
from .exchange import (
    ChainedOperator,
    Exchange,
    ExchangePlan,
    Injection,
    exchange,
    exchange_of,
    exchange_rdd,
    exchanged,
    exchanges_of,
    install_dataframe_method,
    map_in_arrow,
    map_in_pandas,
)
from .partitioners import (
    ChannelSelector,
    Partitioner,
    broadcast,
    custom,
    forward,
    global_,
    key_by,
    key_group_channels,
    key_group_range,
    key_groups,
    rebalance,
    rescale,
    shuffle,
)
from .planner import ExchangeSpec, Executors, NetworkPlan, plan_network, plan_table
from .runtime.planning import plan_dataframe
from .simulation import Simulation, SimulationReport, simulate

__version__ = "0.1.0"

# df.creditShuffle(...) on every PySpark DataFrame, classic and Spark Connect; without pyspark, the pure-Python
# parts only
with contextlib.suppress(ImportError):
    install_dataframe_method()

__all__ = [
    "MIN_PYSPARK",
    "BarrierStageError",
    "BufferDecodeError",
    "ChainedOperator",
    "ChainedOperatorError",
    "ChannelSelector",
    "CheckpointBarrier",
    "ConfigError",
    "CreditShuffleError",
    "Diagnosis",
    "EndOfPartition",
    "Exchange",
    "ExchangePlan",
    "ExchangeSpec",
    "ExchangeTimeoutError",
    "Executors",
    "Injection",
    "InsufficientNetworkBuffersError",
    "InsufficientSlotsError",
    "LatencyMarker",
    "NetworkConfig",
    "NetworkPlan",
    "NullKeyError",
    "Partitioner",
    "PartitionerError",
    "ProtocolError",
    "RecordReader",
    "RecordWriter",
    "SchemaMismatchError",
    "Simulation",
    "SimulationReport",
    "SubtaskSummary",
    "UnknownSettingError",
    "UnsupportedColumnTypeError",
    "UnsupportedInputError",
    "UnsupportedKeyTypeError",
    "WorkerPythonError",
    "__version__",
    "broadcast",
    "custom",
    "default_max_parallelism",
    "exchange",
    "exchange_of",
    "exchange_rdd",
    "exchanged",
    "exchanges_of",
    "forward",
    "global_",
    "install_dataframe_method",
    "install_error_hook",
    "key_by",
    "key_group_channels",
    "key_group_range",
    "key_groups",
    "map_in_arrow",
    "map_in_pandas",
    "plan_dataframe",
    "plan_network",
    "plan_table",
    "rdd_with_channel",
    "rebalance",
    "rescale",
    "shuffle",
    "simulate",
    "task_error",
    "typed_errors",
    "uninstall_error_hook",
    "with_channel",
]
