"""spark_credit_shuffle: Apache Flink's network stack as a data exchange between Spark tasks.

Public API only; see README.md for a tour.

Importing the package imports none of its parts and changes nothing outside it: each public name is
imported on first use (so a Python worker, or the worker daemon of :mod:`.worker.daemon`, that needs one
module does not load pyarrow, pandas and pyspark for it), and PySpark's ``DataFrame`` gets its
``creditShuffle`` method only when :func:`install_dataframe_method` is called. Only the installed pyspark's
version is checked here, from its package metadata, without importing it.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from ._pyspark import MIN_PYSPARK  # refuses a pyspark older than MIN_PYSPARK, without importing pyspark

if TYPE_CHECKING:
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
    from .runtime.planner_on_spark import plan_dataframe
    from .simulation import Simulation, SimulationReport, simulate

__version__ = "0.1.0"

#: The module (relative to the package) that defines each public name, imported on the name's first use.
_EXPORTS_BY_MODULE: dict[str, tuple[str, ...]] = {
    "buffers": ("CheckpointBarrier", "EndOfPartition", "LatencyMarker", "RecordReader", "RecordWriter"),
    "config": ("NetworkConfig", "default_max_parallelism"),
    "dataframe": ("rdd_with_channel", "with_channel"),
    "diagnosis": ("Diagnosis", "SubtaskSummary"),
    "errors": (
        "BarrierStageError",
        "BufferDecodeError",
        "ChainedOperatorError",
        "ConfigError",
        "CreditShuffleError",
        "ExchangeTimeoutError",
        "InsufficientNetworkBuffersError",
        "InsufficientSlotsError",
        "NullKeyError",
        "PartitionerError",
        "ProtocolError",
        "SchemaMismatchError",
        "UnknownSettingError",
        "UnsupportedColumnTypeError",
        "UnsupportedInputError",
        "UnsupportedKeyTypeError",
        "WorkerPythonError",
        "install_error_hook",
        "task_error",
        "typed_errors",
        "uninstall_error_hook",
    ),
    "exchange": (
        "ChainedOperator",
        "Exchange",
        "ExchangePlan",
        "Injection",
        "exchange",
        "exchange_of",
        "exchange_rdd",
        "exchanged",
        "exchanges_of",
        "install_dataframe_method",
        "map_in_arrow",
        "map_in_pandas",
    ),
    "partitioners": (
        "ChannelSelector",
        "Partitioner",
        "broadcast",
        "custom",
        "forward",
        "global_",
        "key_by",
        "key_group_channels",
        "key_group_range",
        "key_groups",
        "rebalance",
        "rescale",
        "shuffle",
    ),
    "planner": ("ExchangeSpec", "Executors", "NetworkPlan", "plan_network", "plan_table"),
    "runtime.planner_on_spark": ("plan_dataframe",),
    "simulation": ("Simulation", "SimulationReport", "simulate"),
}
_EXPORTS = {name: module for module, names in _EXPORTS_BY_MODULE.items() for name in names}
#: Subpackages and modules reachable as attributes of the package (``spark_credit_shuffle.runtime``) without
#: importing them first, as they were when the package imported them all.
_SUBMODULES = frozenset(
    {
        "buffers",
        "config",
        "dataframe",
        "diagnosis",
        "engine",
        "errors",
        "exchange",
        "metrics",
        "partitioners",
        "planner",
        "protocol",
        "runtime",
        "simulation",
        "transport",
    }
)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    """The package's module object: importing its submodule ``exchange`` binds the package's attribute of that
    name to the function :func:`exchange`, not to the submodule, whichever of the two is imported first."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

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
