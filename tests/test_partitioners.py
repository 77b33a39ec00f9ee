"""Channel selectors and partitioners: Flink's sequences (docs/flink.md, "Channel selectors and key groups" and
"Behaviours from Flink's test suite"), wiring and errors."""

from __future__ import annotations

import pickle
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_credit_shuffle import (
    ChannelSelector,
    ConfigError,
    NullKeyError,
    Partitioner,
    PartitionerError,
    broadcast,
    custom,
    forward,
    global_,
    key_by,
    key_group_channels,
    rebalance,
    rescale,
    shuffle,
)
from spark_credit_shuffle.partitioners import RoundRobinSelector, ShuffleSelector, pointwise_wiring


def rows(n: int) -> pa.RecordBatch:
    return pa.record_batch({"k": pa.array(np.arange(n), type=pa.int64())})


def picks(selector: ChannelSelector, counts: list[int]) -> list[int]:
    """Channels of consecutive batches of the given sizes, one sequence."""
    out: list[int] = []
    start = 0
    for n in counts:
        out += selector.select_channels(rows(n + start).slice(start)).tolist()
        start += n
    return out


ALL = [key_by("k"), rebalance(), rescale(), shuffle(), broadcast(), forward(), global_(), custom(lambda k, n: 0, "k")]


def test_names_are_flinks_to_string():
    assert [p.name for p in ALL] == [
        "HASH",
        "REBALANCE",
        "RESCALE",
        "SHUFFLE",
        "BROADCAST",
        "FORWARD",
        "GLOBAL",
        "CUSTOM",
    ]
    assert [str(p) for p in ALL] == [p.name for p in ALL]


def test_only_broadcast_is_broadcast_and_only_rescale_forward_are_pointwise():
    assert [p.is_broadcast for p in ALL] == [False, False, False, False, True, False, False, False]
    assert [p.is_pointwise for p in ALL] == [False, False, True, False, False, True, False, False]
    selectors = [p.selector(0, 2, 2) for p in ALL]
    assert [s.is_broadcast for s in selectors] == [p.is_broadcast for p in ALL]


# -- Flink's sequences (docs/flink.md, "Channel selectors and key groups") ----------------------------


def test_rebalance_first_record_goes_to_r_plus_one_then_round_robin():
    for producer in range(20):
        selector = rebalance(seed=11).selector(producer, 20, 3)
        r = selector.next_channel
        assert 0 <= r < 3
        c = selector.select_channels(rows(1)).tolist()[0]
        assert c == (r + 1) % 3
        assert selector.select_channels(rows(3)).tolist() == [(c + 1) % 3, (c + 2) % 3, (c + 3) % 3]


def test_rebalance_seed_is_reproducible_and_differs_per_producer():
    starts = [rebalance(seed=5).selector(p, 64, 16).next_channel for p in range(64)]
    assert starts == [rebalance(seed=5).selector(p, 64, 16).next_channel for p in range(64)]
    assert len(set(starts)) > 4  # random per producer, not one start for all
    assert starts != [rebalance(seed=6).selector(p, 64, 16).next_channel for p in range(64)]
    unseeded = rebalance().selector(0, 1, 7)
    assert 0 <= unseeded.next_channel < 7


def test_rescale_and_round_robin_start_at_zero():
    assert picks(rescale().selector(0, 1, 3), [4]) == [0, 1, 2, 0]
    assert picks(RoundRobinSelector(3), [2, 2]) == [0, 1, 2, 0]


@pytest.mark.parametrize("channels", [1, 2, 1024])
def test_forward_and_global_return_zero(channels):
    forward_selector = forward().selector(0, channels, channels)
    assert forward_selector.num_channels == 1
    assert forward_selector.select_channels(rows(5)).tolist() == [0] * 5
    global_selector = global_().selector(0, 1, channels)
    assert global_selector.num_channels == channels
    assert global_selector.select_channels(rows(5)).tolist() == [0] * 5
    assert global_().channels(rows(5), channels, producer=0, num_producers=3).tolist() == [0] * 5


@pytest.mark.parametrize("channels", [1, 2, 1024])
def test_shuffle_stays_in_range(channels):
    got = shuffle().selector(0, 1, channels).select_channels(rows(500))
    assert got.dtype == np.int32 and got.min() >= 0 and got.max() < channels


def test_shuffle_is_uniform_reproducible_and_differs_per_producer():
    first = shuffle(seed=3).selector(0, 2, 3).select_channels(rows(30_000))
    counts = Counter(first.tolist())
    assert set(counts) == {0, 1, 2} and all(9_000 < c < 11_000 for c in counts.values())
    assert picks(shuffle(seed=3).selector(0, 2, 3), [10_000, 20_000]) == first.tolist()
    other = shuffle(seed=3).selector(1, 2, 3).select_channels(rows(30_000))
    assert other.tolist() != first.tolist()


def test_broadcast_select_channels_raises():
    selector = broadcast().selector(0, 1, 4)
    assert selector.is_broadcast and selector.num_channels == 4
    with pytest.raises(PartitionerError, match=r"Broadcast partitioner does not support select channels"):
        selector.select_channels(rows(3))


def test_same_string_key_same_channel_whatever_else_the_record_holds():
    # KeyGroupStreamPartitionerTest: ("test", 0) and ("test", 42) keyed on the string, max parallelism 1024
    batch = pa.record_batch({"name": ["test", "test"], "value": pa.array([0, 42], type=pa.int32())})
    for channels in (1, 2, 1024):
        got = key_by("name", max_parallelism=1024).selector(0, 1, channels).select_channels(batch).tolist()
        assert got[0] == got[1]
        assert got == key_group_channels(pa.array(["test"] * 2), channels, 1024).tolist()


def test_key_by_integer_42_goes_to_operator_0_of_4():
    batch = pa.record_batch({"k": pa.array([42], type=pa.int32())})
    assert key_by("k", max_parallelism=128).channels(batch, 4).tolist() == [0]


# -- key_by on batches ------------------------------------------------------------------------------


def test_key_by_uses_its_own_then_the_exchange_then_flinks_default_max_parallelism():
    batch = pa.record_batch({"k": pa.array(np.arange(-500, 500), type=pa.int64())})
    values = batch.column(0)
    assert key_by("k").selector(0, 1, 5).select_channels(batch).tolist() == key_group_channels(values, 5, 128).tolist()
    assert (
        key_by("k").selector(0, 1, 100).select_channels(batch).tolist() == key_group_channels(values, 100, 256).tolist()
    )
    assert (
        key_by("k").selector(0, 1, 5, max_parallelism=1000).select_channels(batch).tolist()
        == key_group_channels(values, 5, 1000).tolist()
    )
    assert (
        key_by("k", max_parallelism=4096).selector(0, 1, 5, max_parallelism=1000).select_channels(batch).tolist()
        == key_group_channels(values, 5, 4096).tolist()
    )


def test_key_by_several_columns_hashes_the_tuple_and_accepts_positions():
    batch = pa.record_batch({"a": pa.array([1, 2, 3], type=pa.int32()), "b": ["x", "y", "z"]})
    expected = key_group_channels([batch.column(0), batch.column(1)], 4, 128).tolist()
    assert key_by("a", "b").channels(batch, 4).tolist() == expected
    assert key_by(0, 1).channels(batch, 4).tolist() == expected
    assert (
        key_by("b", "a").channels(batch, 4).tolist()
        == key_group_channels([batch.column(1), batch.column(0)], 4, 128).tolist()
    )


def test_key_by_on_a_table_with_chunks():
    table = pa.Table.from_batches([rows(10), rows(7)])
    expected = key_group_channels(pa.array(list(range(10)) + list(range(7))), 3, 128).tolist()
    assert key_by("k").channels(table, 3).tolist() == expected


def test_key_by_errors_name_the_column():
    batch = pa.record_batch({"user": pa.array([1, None], type=pa.int64())})
    with pytest.raises(NullKeyError, match=r"'user'"):
        key_by("user").channels(batch, 2)
    assert (
        key_by("user", null_keys="zero").channels(batch, 2).tolist()
        == key_group_channels(pa.array([0, 0], type=pa.int64()), 2, 128).tolist()
    )
    with pytest.raises(PartitionerError, match=r"'missing' is not in the batch; its columns are: user"):
        key_by("missing").channels(batch, 2)


def test_key_by_arguments_are_checked_up_front():
    with pytest.raises(ConfigError, match=r"max_parallelism"):
        key_by("k", max_parallelism=40_000)
    with pytest.raises(ConfigError, match=r"columns"):
        key_by()
    with pytest.raises(ConfigError, match=r"null_keys"):
        key_by("k", null_keys="drop")
    with pytest.raises(ConfigError, match=r"at most max_parallelism"):
        key_by("k", max_parallelism=128).validate(2, 200)
    with pytest.raises(ConfigError, match=r"at most max_parallelism"):
        key_by("k").selector(0, 1, 200, max_parallelism=128)


# -- pointwise wiring (rescale, forward) ------------------------------------------------------------


def test_pointwise_wiring_examples():
    assert pointwise_wiring(2, 4) == [[0, 1], [2, 3]]
    assert pointwise_wiring(4, 2) == [[0], [0], [1], [1]]
    # 3 -> 7: producer p feeds [ceil(p*7/3), ceil((p+1)*7/3)); consumer c reads subpartition c % count
    assert pointwise_wiring(3, 7) == [[0, 1, 2], [4, 3], [6, 5]]
    assert pointwise_wiring(5, 5) == [[0], [1], [2], [3], [4]]


@pytest.mark.parametrize("s, t", [(2, 4), (4, 2), (3, 7), (7, 3), (5, 5), (1, 6), (6, 1), (4, 10)])
def test_pointwise_wiring_feeds_every_consumer_and_inverts(s, t):
    p = rescale()
    fed = sorted(c for producer in range(s) for c in p.consumers_of(producer, s, t))
    if s >= t:
        assert all(p.num_subpartitions(producer, s, t) == 1 for producer in range(s))
        assert sorted(set(fed)) == list(range(t))
    else:
        assert fed == list(range(t))  # each consumer reads exactly one subpartition
    for consumer in range(t):
        for producer in p.producers_of(consumer, s, t):
            assert consumer in p.consumers_of(producer, s, t)
    assert sum(len(p.producers_of(c, s, t)) for c in range(t)) == max(s, t)


def test_rescale_source_2_map_4_sink_2():
    # RescalePartitionerTest: source p=2 -> rescale -> map p=4 -> rescale -> sink p=2
    p = rescale()
    assert [p.producers_of(m, 2, 4) for m in range(4)] == [[0], [0], [1], [1]]
    assert [len(p.consumers_of(s, 2, 4)) for s in range(2)] == [2, 2]
    sinks = [p.producers_of(s, 4, 2) for s in range(2)]
    assert all(len(set(inputs)) == 2 for inputs in sinks)
    assert sorted(m for inputs in sinks for m in inputs) == [0, 1, 2, 3]


def test_rescale_channels_follow_the_wiring():
    # producer 1 of 3 -> 7 feeds consumers 4 (subpartition 0) and 3 (subpartition 1), round robin from 0
    assert rescale().channels(rows(5), 7, producer=1, num_producers=3).tolist() == [4, 3, 4, 3, 4]
    assert rescale().channels(rows(3), 2, producer=3, num_producers=4).tolist() == [1, 1, 1]


def test_forward_between_unequal_parallelisms_fails_like_flink():
    with pytest.raises(PartitionerError) as info:
        forward().validate(2, 4)
    message = str(info.value)
    assert message.startswith("Forward partitioning does not allow change of parallelism.")
    assert "parallelism: 2" in message and "parallelism: 4" in message
    assert "You must use another partitioning strategy, such as broadcast, rebalance, shuffle or global." in message
    with pytest.raises(PartitionerError, match=r"Forward partitioning"):
        forward().selector(0, 3, 1)
    assert forward().consumers_of(2, 3, 3) == [2]
    assert forward().producers_of(1, 3, 3) == [1]


@pytest.mark.parametrize("partitioner", ALL, ids=str)
def test_counts_and_indexes_are_checked(partitioner):
    with pytest.raises(ConfigError, match=r"num_producers"):
        partitioner.validate(0, 2)
    with pytest.raises(ConfigError, match=r"num_consumers"):
        partitioner.validate(2, -1)
    with pytest.raises(ConfigError, match=r"producer"):
        partitioner.consumers_of(2, 2, 2)
    with pytest.raises(ConfigError, match=r"consumer"):
        partitioner.producers_of(5, 2, 2)


def test_all_to_all_edges_connect_everyone():
    for p in (key_by("k"), rebalance(), shuffle(), broadcast(), global_()):
        assert p.consumers_of(1, 3, 5) == [0, 1, 2, 3, 4]
        assert p.producers_of(4, 3, 5) == [0, 1, 2]


# -- custom ----------------------------------------------------------------------------------------


def modulo(keys, n):
    return pc.abs(keys).to_numpy() % n


def test_custom_vectorised_scalar_and_numpy_forms_agree():
    batch = pa.record_batch({"k": pa.array([5, -3, 8, 0], type=pa.int64()), "s": ["a", "bb", "ccc", ""]})
    assert custom(modulo, "k").channels(batch, 3).tolist() == [2, 0, 2, 0]
    assert custom(lambda k, n: np.abs(k) % n, "k", as_numpy=True).channels(batch, 3).tolist() == [2, 0, 2, 0]
    assert custom(lambda k, n: abs(k) % n, "k", vectorized=False).channels(batch, 3).tolist() == [2, 0, 2, 0]
    both = custom(lambda key, n: (key[0] + len(key[1])) % n, "k", "s", vectorized=False)
    assert both.channels(batch, 4).tolist() == [2, 3, 3, 0]
    arrays = custom(lambda keys, n: (keys[0].to_numpy() + 1) % n, "k", "s")
    assert arrays.channels(batch, 4).tolist() == [2, 2, 1, 1]
    # a function of the key alone (key -> int) is accepted too
    assert custom(lambda k: abs(k) % 2, "k", vectorized=False).channels(batch, 3).tolist() == [1, 1, 0, 0]
    assert custom(lambda k: np.abs(k) % 2, "k", as_numpy=True).channels(batch, 3).tolist() == [1, 1, 0, 0]


def test_custom_channels_out_of_range_or_malformed_are_refused():
    batch = rows(4)
    with pytest.raises(PartitionerError, match=r"returned channel 3 for row 3; channels must be in \[0, 3\)"):
        custom(lambda k, n: k.to_numpy(), "k").channels(batch, 3)
    with pytest.raises(PartitionerError, match=r"returned channel -1"):
        custom(lambda k, n: -1, "k", vectorized=False).channels(batch, 3)
    with pytest.raises(PartitionerError, match=r"one channel per row"):
        custom(lambda k, n: np.zeros(2, dtype=np.int64), "k").channels(batch, 3)
    with pytest.raises(PartitionerError, match=r"integers"):
        custom(lambda k, n: np.zeros(4), "k").channels(batch, 3)
    with pytest.raises(PartitionerError, match=r"must return an int"):
        custom(lambda k, n: "zero", "k", vectorized=False).channels(batch, 3)
    with pytest.raises(ConfigError, match=r"fn"):
        custom("not callable", "k")
    with pytest.raises(ConfigError, match=r"columns"):
        custom(modulo)


# -- values, state and splitting ---------------------------------------------------------------------


@pytest.mark.parametrize("partitioner", [*ALL[:4], ALL[5], ALL[6], custom(modulo, "k")], ids=str)
def test_partitioners_pickle_as_values(partitioner):
    copy = pickle.loads(pickle.dumps(partitioner))
    assert isinstance(copy, Partitioner) and copy.name == partitioner.name
    if partitioner.name not in ("REBALANCE", "SHUFFLE"):  # unseeded ones are random by design
        batch = rows(50)
        assert copy.channels(batch, 3).tolist() == partitioner.channels(batch, 3).tolist()


def test_seed_is_checked():
    with pytest.raises(ConfigError, match=r"seed"):
        rebalance(seed=-1)
    with pytest.raises(ConfigError, match=r"seed"):
        shuffle(seed="x")


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=6),
    consumers=st.integers(min_value=1, max_value=9),
    producer=st.integers(min_value=0, max_value=3),
    which=st.sampled_from(["rebalance", "rescale", "shuffle", "key_by", "global"]),
)
def test_batch_boundaries_do_not_change_the_sequence(sizes, consumers, producer, which):
    make = {
        "rebalance": lambda: rebalance(seed=9),
        "rescale": rescale,
        "shuffle": lambda: shuffle(seed=9),
        "key_by": lambda: key_by("k"),
        "global": global_,
    }[which]
    whole = make().selector(producer, 4, consumers).select_channels(rows(sum(sizes))).tolist()
    split = picks(make().selector(producer, 4, consumers), sizes)
    assert split == whole
    assert all(0 <= c < make().num_subpartitions(producer, 4, consumers) for c in whole)


# -- java.util.Random, as Flink's ShufflePartitioner draws ----------------------------------------------


def java_random_ints(tmp_path, cases: list[tuple[int, int, int]]) -> list[list[int]]:
    """``new Random(seed).nextInt(bound)`` ``count`` times per case, computed by the JDK."""
    missing = [tool for tool in ("javac", "java") if shutil.which(tool) is None]
    if missing:  # the ground truth is the JDK's: a missing JDK is a failure that names it, never a silent skip
        pytest.fail(f"this check runs the JDK, and {' and '.join(missing)} is not on PATH: install a Java 17+ JDK")
    source = Path(__file__).parent / "java" / "JavaRandomInts.java"
    subprocess.run(["javac", "-d", str(tmp_path), str(source)], check=True, capture_output=True)
    done = subprocess.run(
        ["java", "-cp", str(tmp_path), "JavaRandomInts"],
        input="".join(f"{s} {b} {c}\n" for s, b, c in cases),
        capture_output=True,
        text=True,
        check=True,
    )
    return [[int(x) for x in line.split()] for line in done.stdout.splitlines()]


@pytest.mark.spark  # javac and java
def test_seeded_shuffle_draws_what_java_util_random_next_int_draws(tmp_path):
    # given seeds and channel counts: powers of two (the fast path), others, and 2^30 + 1, whose rejection
    # loop rejects about half of all draws
    cases = [(0, 3, 9000), (42, 4, 5000), (-7, 7, 5000), (2**40 + 3, 1, 10), (123, 1000, 9000), (9, 2**30 + 1, 300)]
    expected = java_random_ints(tmp_path, cases)
    for (seed, bound, count), want in zip(cases, expected, strict=True):
        # when a selector seeded with it picks channels for batches of uneven sizes
        selector = ShuffleSelector(bound, seed)
        got = picks(selector, [1, count // 3, count - count // 3 - 1])
        # then the sequence is the JDK's, row for row, across batches
        assert got == want, (seed, bound)


@pytest.mark.spark  # javac and java
def test_shuffle_producer_p_draws_from_random_seed_plus_p(tmp_path):
    # given shuffle(seed=5) over 3 producers and 6 consumers
    want = java_random_ints(tmp_path, [(5 + p, 6, 2000) for p in range(3)])
    # then producer p's channels are new Random(5 + p).nextInt(6)
    for p in range(3):
        assert shuffle(seed=5).selector(p, 3, 6).select_channels(rows(2000)).tolist() == want[p]
