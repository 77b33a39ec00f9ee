"""NetworkConfig: Flink's defaults, human strings, conf precedence and a ConfigError for every bad value."""

from __future__ import annotations

import dataclasses

import pytest

from spark_credit_shuffle import ConfigError, NetworkConfig, UnknownSettingError
from spark_credit_shuffle.config import parse_duration_ms, parse_size


def test_defaults_are_flinks():
    config = NetworkConfig()
    assert config.segment_size == 32 * 1024
    assert config.buffers_per_channel == 2
    assert config.floating_buffers_per_gate == 8
    assert config.max_buffers_per_channel == 10
    assert config.max_overdraft_buffers_per_gate == 20  # Flink 2.x (1.x: 5)
    assert config.buffer_timeout_ms == 100
    assert config.max_parallelism is None
    assert config.credit_based is True
    assert config.settings()["segment_size"].metadata["flink"] == "taskmanager.memory.segment-size"


def test_immutable_and_replace_validates():
    config = NetworkConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.segment_size = 4096  # type: ignore[misc]
    assert config.replace(segment_size="64kb").segment_size == 65536
    with pytest.raises(ConfigError, match=r"segment_size"):
        config.replace(segment_size=1024)
    with pytest.raises(UnknownSettingError, match=r"segment_size"):
        config.replace(segment_sise=4096)


# -- human strings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [("32kb", 32768), ("64 KiB", 65536), ("4096", 4096), (" 1m ", 1 << 20), ("2 MB", 2 << 20), ("1g", 1 << 30)],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected
    if expected >= 4096 and expected & (expected - 1) == 0:
        assert NetworkConfig(segment_size=text, network_memory="1 gb").segment_size == expected


@pytest.mark.parametrize(
    "text, expected", [("10ms", 10), ("1 s", 1000), ("-1", -1), ("0", 0), ("250", 250), ("2min", 120_000)]
)
def test_durations(text, expected):
    assert parse_duration_ms(text) == expected
    assert NetworkConfig(buffer_timeout_ms=text).buffer_timeout_ms == expected


@pytest.mark.parametrize("text", ["32 parsecs", "kb", "1.5kb", "", True])
def test_bad_sizes_name_setting_and_value(text):
    with pytest.raises(ConfigError) as info:
        NetworkConfig(segment_size=text)
    assert info.value.setting == "segment_size" and info.value.value == text
    assert "'32kb'" in str(info.value)


@pytest.mark.parametrize("text", ["10 lightyears", "soon", "1.5s"])
def test_bad_durations_name_setting_and_value(text):
    with pytest.raises(ConfigError, match=r"buffer_timeout_ms") as info:
        NetworkConfig(buffer_timeout_ms=text)
    assert repr(text) in str(info.value)


# -- invalid values of each setting -----------------------------------------------------------------


def test_segment_size_below_flinks_minimum():
    with pytest.raises(ConfigError, match=r"'segment_size'.*at least 4096 bytes") as info:
        NetworkConfig(segment_size="2kb")
    assert info.value.value == "2kb"  # as the user wrote it
    with pytest.raises(ConfigError, match=r"power of two"):
        NetworkConfig(segment_size=5000)


@pytest.mark.parametrize("value", [2**31, 2**33, "2 GiB", "8g"])
def test_segment_size_above_flinks_maximum_names_segment_size_and_the_bound(value):
    # Flink's getPageSize casts the segment size to a Java int: 1 GiB is the largest power of two it takes,
    # however much network memory there is
    with pytest.raises(ConfigError) as info:
        NetworkConfig(segment_size=value, network_memory="64 GiB")
    assert info.value.setting == "segment_size" and info.value.value == value
    assert "at most 1073741824 bytes (1 GiB)" in str(info.value) and "network_memory" not in str(info.value)
    assert NetworkConfig(segment_size="1 GiB", network_memory="2 GiB").total_network_buffers == 2


def test_a_segment_larger_than_the_network_memory_names_the_setting_the_user_changed():
    # given a segment size beyond the default network memory (64 MiB), the segment size is at fault
    with pytest.raises(ConfigError) as info:
        NetworkConfig(segment_size="1 GiB")
    assert info.value.setting == "segment_size" and info.value.value == "1 GiB"
    assert "up to network_memory (64 MiB, the default)" in str(info.value)
    assert "raise network_memory (spark.creditShuffle.networkMemory) to at least 1 GiB" in str(info.value)
    # given a network memory below the (default) segment size, the network memory is
    with pytest.raises(ConfigError) as info:
        NetworkConfig(network_memory="16kb")
    assert info.value.setting == "network_memory" and "segment_size, 32 KiB" in str(info.value)


def test_a_conf_value_error_names_the_conf_key_the_user_set():
    with pytest.raises(ConfigError) as info:
        NetworkConfig.from_conf({"spark.creditShuffle.segmentSize": "8g"})
    assert info.value.setting == "segment_size" and info.value.conf_key == "spark.creditShuffle.segmentSize"
    assert "'segment_size' (spark.creditShuffle.segmentSize)" in str(info.value) and "'8g'" in str(info.value)
    # a keyword argument wins over the conf, and its error names the keyword alone
    with pytest.raises(ConfigError) as info:
        NetworkConfig.from_conf({"spark.creditShuffle.segmentSize": "64kb"}, segment_size=3000)
    assert info.value.conf_key is None and "'segment_size':" in str(info.value)


@pytest.mark.parametrize(
    "setting", ["buffers_per_channel", "floating_buffers_per_gate", "max_overdraft_buffers_per_gate"]
)
def test_negative_counts(setting):
    with pytest.raises(ConfigError, match=rf"invalid value -1 for setting '{setting}': allowed is an integer >= 0"):
        NetworkConfig(**{setting: -1})


def test_max_buffers_per_channel_at_least_one():
    with pytest.raises(ConfigError, match=r"'max_buffers_per_channel'"):
        NetworkConfig(max_buffers_per_channel=0)


def test_zero_buffers_on_both_sides():
    assert NetworkConfig(buffers_per_channel=0, floating_buffers_per_gate=1).buffers_per_channel == 0
    assert NetworkConfig(buffers_per_channel=1, floating_buffers_per_gate=0).floating_buffers_per_gate == 0
    with pytest.raises(ConfigError, match=r"floating_buffers_per_gate is 0") as info:
        NetworkConfig(buffers_per_channel=0, floating_buffers_per_gate=0)
    assert "can never receive data" in str(info.value)


def test_buffer_timeout_below_minus_one():
    with pytest.raises(ConfigError, match=r"buffer_timeout_ms.*-1 \(flush only when full\)"):
        NetworkConfig(buffer_timeout_ms=-2)


def test_parallelism_above_max_parallelism():
    config = NetworkConfig(max_parallelism=128)
    assert config.resolve_max_parallelism(128) == 128
    with pytest.raises(ConfigError, match=r"'parallelism': allowed is at most max_parallelism \(128\)") as info:
        config.resolve_max_parallelism(129)
    assert "spark.creditShuffle.maxParallelism" in str(info.value)
    assert NetworkConfig().resolve_max_parallelism(86) == 256  # Flink's default from the parallelism
    with pytest.raises(ConfigError, match=r"'parallelism'"):
        NetworkConfig().resolve_max_parallelism(0)


@pytest.mark.parametrize("value", [32769, 0, -5])
def test_max_parallelism_out_of_bounds(value):
    with pytest.raises(ConfigError, match=r"'max_parallelism': allowed is an integer in \[1, 32768\]"):
        NetworkConfig(max_parallelism=value)
    assert NetworkConfig(max_parallelism=32768).max_parallelism == 32768


def test_network_memory_holds_at_least_one_segment():
    with pytest.raises(ConfigError, match=r"network_memory"):
        NetworkConfig(network_memory="16kb")
    assert NetworkConfig(network_memory="1mb").total_network_buffers == 32


# -- conf keys and precedence -----------------------------------------------------------------------


def test_conf_keys():
    assert NetworkConfig.conf_key("segment_size") == "spark.creditShuffle.segmentSize"
    assert NetworkConfig.conf_key("floating_buffers_per_gate") == "spark.creditShuffle.floatingBuffersPerGate"


def test_a_misspelt_conf_key_names_the_nearest_key():
    with pytest.raises(UnknownSettingError) as info:
        NetworkConfig.from_conf({"spark.creditShuffle.segmentSise": "32kb"})
    assert (
        str(info.value)
        == "unknown setting 'spark.creditShuffle.segmentSise'; did you mean 'spark.creditShuffle.segmentSize'?"
    )
    assert info.value.nearest == "spark.creditShuffle.segmentSize"
    assert isinstance(info.value, ConfigError)


def test_an_unknown_conf_key_near_no_setting_lists_the_existing_keys():
    with pytest.raises(UnknownSettingError) as info:
        NetworkConfig.from_conf({"spark.creditShuffle.colour": "blue"})
    message = str(info.value)
    assert "spark.creditShuffle.colour" in message and info.value.nearest is None
    for name in NetworkConfig.settings():
        assert NetworkConfig.conf_key(name) in message


def test_a_key_under_the_prefix_in_another_case_is_refused_not_ignored():
    with pytest.raises(UnknownSettingError, match=r"did you mean 'spark.creditShuffle.bufferTimeoutMs'"):
        NetworkConfig.from_conf({"Spark.CreditShuffle.bufferTimeoutMs": "5"})


def test_unknown_keyword_names_the_settings():
    with pytest.raises(UnknownSettingError, match=r"segment_sise.*segment_size"):
        NetworkConfig.from_conf({}, segment_sise=4096)


def test_precedence_keyword_over_conf_over_default():
    conf = {
        "spark.creditShuffle.segmentSize": "64 KiB",
        "spark.creditShuffle.bufferTimeoutMs": "10ms",
        "spark.sql.shuffle.partitions": "7",  # other keys are none of our business
    }
    config = NetworkConfig.from_conf(conf, buffer_timeout_ms="1 s")
    assert config.segment_size == 65536  # conf over default
    assert config.buffer_timeout_ms == 1000  # keyword over conf
    assert config.buffers_per_channel == 2  # default
    assert NetworkConfig.from_conf({"spark.creditShuffle.creditBased": "false"}).credit_based is False


def test_bad_conf_value_names_the_setting():
    with pytest.raises(ConfigError, match=r"'buffers_per_channel'"):
        NetworkConfig.from_conf({"spark.creditShuffle.buffersPerChannel": "-3"})
    with pytest.raises(ConfigError, match=r"'credit_based'.*true or false"):
        NetworkConfig.from_conf({"spark.creditShuffle.creditBased": "maybe"})


@pytest.mark.spark
def test_precedence_through_a_spark_session(any_spark):
    spark = any_spark
    keys = ["spark.creditShuffle.segmentSize", "spark.creditShuffle.floatingBuffersPerGate"]
    try:
        spark.conf.set(keys[0], "64kb")
        spark.conf.set(keys[1], "3")
        config = NetworkConfig.from_spark(spark, floating_buffers_per_gate=5)
        assert config.segment_size == 65536
        assert config.floating_buffers_per_gate == 5
        assert config.buffers_per_channel == 2
        assert NetworkConfig.from_spark(spark).floating_buffers_per_gate == 3
    finally:
        for key in keys:
            spark.conf.unset(key)
    assert NetworkConfig.from_spark(spark) == NetworkConfig()


@pytest.mark.spark
def test_unknown_key_set_on_a_spark_session_is_refused(any_spark):
    spark = any_spark
    try:
        spark.conf.set("spark.creditShuffle.bufferTimeout", "10ms")
        with pytest.raises(UnknownSettingError, match=r"spark.creditShuffle.bufferTimeout'.*bufferTimeoutMs"):
            NetworkConfig.from_spark(spark)
    finally:
        spark.conf.unset("spark.creditShuffle.bufferTimeout")


def test_address_exchange_setting():
    assert NetworkConfig().address_exchange == "auto"
    assert NetworkConfig.from_conf({"spark.creditShuffle.addressExchange": "AllGather"}).address_exchange == "allgather"
    with pytest.raises(ConfigError, match=r"address_exchange.*'auto'.*'allgather'"):
        NetworkConfig(address_exchange="gossip")


def test_freeze_worker_heap_setting():
    assert NetworkConfig().freeze_worker_heap is False  # a library leaves the worker's collection alone unless asked
    assert NetworkConfig.from_conf({"spark.creditShuffle.freezeWorkerHeap": "true"}).freeze_worker_heap is True
    assert NetworkConfig.from_conf({"spark.creditShuffle.freezeWorkerHeap": "false"}).freeze_worker_heap is False
    with pytest.raises(ConfigError, match=r"freeze_worker_heap.*true or false"):
        NetworkConfig(freeze_worker_heap="sometimes")


def test_local_channels_setting():
    assert NetworkConfig().local_channels == "executor"
    assert NetworkConfig.from_conf({"spark.creditShuffle.localChannels": "Task"}).local_channels == "task"
    with pytest.raises(ConfigError, match=r"local_channels.*'executor'.*'task'"):
        NetworkConfig(local_channels="host")
