"""Key groups bit-exact with Flink: Java hashCode per Arrow type, murmur, key group, operator index.

Expected values come from three independent places: a table of known values (checked against Flink's own jar),
the JDK itself (a small Java program compiled and run here), and a plain scalar Python port written below
from the rules, one value at a time.
"""

from __future__ import annotations

import math
import shutil
import struct
import subprocess

import mmh3
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spark_credit_shuffle as scs
from spark_credit_shuffle import (
    ConfigError,
    NullKeyError,
    UnsupportedKeyTypeError,
    default_max_parallelism,
    key_group_channels,
    key_group_range,
    key_groups,
)
from spark_credit_shuffle.partitioners import java_hash_codes, murmur_hash

JAVA_SOURCE = __file__.rsplit("/", 1)[0] + "/java/JavaHashCodes.java"

# -- an independent scalar port of the rules, one value at a time ------------------------------------


def to_int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def fold_long(bits: int) -> int:
    bits &= 0xFFFFFFFFFFFFFFFF
    return to_int32(bits ^ (bits >> 32))


def scalar_java_hash(value, kind: str) -> int:
    if value is None:
        return 0
    if kind in ("int8", "int16", "int32"):
        return int(value)
    if kind == "int64":
        return fold_long(int(value))
    if kind == "bool":
        return 1231 if value else 1237
    if kind == "float64":
        bits = 0x7FF8000000000000 if math.isnan(value) else struct.unpack("<Q", struct.pack("<d", value))[0]
        return fold_long(bits)
    if kind == "float32":
        bits = 0x7FC00000 if math.isnan(value) else struct.unpack("<I", struct.pack("<f", value))[0]
        return to_int32(bits)
    if kind == "string":
        units = value.encode("utf-16-le")
        h = 0
        for (unit,) in struct.iter_unpack("<H", units):
            h = (31 * h + unit) & 0xFFFFFFFF
        return to_int32(h)
    raise AssertionError(kind)


def rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF


def scalar_murmur(code: int) -> int:
    k = (code & 0xFFFFFFFF) * 0xCC9E2D51 & 0xFFFFFFFF
    k = rotl32(k, 15) * 0x1B873593 & 0xFFFFFFFF
    h = rotl32(k, 13)
    h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= 4
    h ^= h >> 16
    h = h * 0x85EBCA6B & 0xFFFFFFFF
    h ^= h >> 13
    h = h * 0xC2B2AE35 & 0xFFFFFFFF
    h ^= h >> 16
    signed = to_int32(h)
    return 0 if signed == -(1 << 31) else abs(signed)


def scalar_tuple_hash(values, kinds) -> int:
    h = 0
    for value, kind in zip(values, kinds, strict=True):
        h = to_int32(31 * h + scalar_java_hash(value, kind))
    return h


# -- random keys of every type ---------------------------------------------------------------------

ARROW_TYPES = {
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "bool": pa.bool_(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "string": pa.string(),
}


def random_unicode(rng: np.random.Generator, length: int) -> str:
    """Text mixing ASCII, Latin, CJK and characters outside the BMP (emoji, which are surrogate pairs)."""
    pools = np.array([(0x20, 0x7F), (0xA0, 0x800), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (0x10000, 0x10FFFF)])
    chosen = pools[rng.integers(len(pools), size=length)]
    codes = rng.integers(chosen[:, 0], chosen[:, 1])
    return "".join(map(chr, codes.tolist()))


def random_values(kind: str, rng: np.random.Generator, n: int) -> list:
    if kind in ("int8", "int16", "int32", "int64"):
        info = np.iinfo(kind)
        values = rng.integers(info.min, info.max, size=n, endpoint=True, dtype=kind).tolist()
        return [*values, int(info.min), int(info.max), 0, -1, 1]
    if kind == "bool":
        return [bool(b) for b in rng.integers(0, 2, n)]
    if kind == "float64":
        values = rng.integers(0, 1 << 64, size=n, dtype=np.uint64).view(np.float64).tolist()
        return [*values, 0.0, -0.0, math.nan, math.inf, -math.inf, 1.5, -2.25e300, 5e-324]
    if kind == "float32":
        values = rng.integers(0, 1 << 32, size=n, dtype=np.uint32).view(np.float32).tolist()
        return [*values, 0.0, -0.0, math.nan, math.inf, 3.5]
    if kind == "string":
        ascii_words = ["".join(chr(c) for c in rng.integers(32, 127, rng.integers(0, 13))) for _ in range(n)]
        unicode_words = [random_unicode(rng, int(rng.integers(0, 12))) for _ in range(n)]
        return [*ascii_words, *unicode_words, "", "test", "hello", "flink", "😀", "a😀b", "\u0000", "\uffff"]
    raise AssertionError(kind)


def arrow_array(values: list, kind: str) -> pa.Array:
    if kind == "float32":  # keep exact float32 bit patterns (NaN payloads included)
        return pa.array(np.array(values, dtype=np.float32))
    return pa.array(values, type=ARROW_TYPES[kind])


# -- known values (docs/flink.md, "Channel selectors and key groups"), checked against Flink 2.3's jar ---------------

REFERENCE = [
    # key, Arrow type, hashCode, murmurHash, kg P=128, op P=128 p=4, kg P=1024, op P=1024 p=3
    (0, pa.int32(), 0, 593689054, 94, 2, 478, 1),
    (1, pa.int32(), 1, 68075478, 86, 2, 982, 2),
    (2, pa.int32(), 2, 1085422463, 127, 3, 895, 2),
    (42, pa.int32(), 42, 1134849565, 29, 0, 541, 1),
    (-1, pa.int32(), -1, 1982413648, 80, 2, 848, 2),
    ("test", pa.string(), 3556498, 2001734850, 66, 2, 194, 0),
    ("hello", pa.string(), 99162322, 1715862179, 35, 1, 675, 1),
    ("flink", pa.string(), 97520992, 1330823394, 98, 3, 226, 0),
    (123456789, pa.int64(), 123456789, 1088346449, 81, 2, 337, 0),
    (True, pa.bool_(), 1231, 1090530765, 77, 2, 461, 1),
]


@pytest.mark.parametrize("key, arrow_type, hash_code, murmur, kg128, op4, kg1024, op3", REFERENCE)
def test_reference_table(key, arrow_type, hash_code, murmur, kg128, op4, kg1024, op3):
    values = pa.array([key], type=arrow_type)
    assert java_hash_codes(values).tolist() == [hash_code]
    assert murmur_hash(np.array([hash_code])).tolist() == [murmur]
    assert key_groups(values, 128).tolist() == [kg128]
    assert key_group_channels(values, 4, 128).tolist() == [op4]
    assert key_groups(values, 1024).tolist() == [kg1024]
    assert key_group_channels(values, 3, 1024).tolist() == [op3]


def test_reference_table_as_one_batch_per_type():
    for arrow_type in {row[1] for row in REFERENCE}:
        rows = [row for row in REFERENCE if row[1] == arrow_type]
        values = pa.array([row[0] for row in rows], type=arrow_type)
        assert key_group_channels(values, 4, 128).tolist() == [row[5] for row in rows]
        assert key_group_channels(values, 3, 1024).tolist() == [row[7] for row in rows]


# -- the JDK's own hashCode --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def java_hash(tmp_path_factory):
    """Runs the JDK on typed values and returns their Java hashCodes."""
    missing = [tool for tool in ("javac", "java") if shutil.which(tool) is None]
    if missing:  # the ground truth is the JDK's: a missing JDK is a failure that names it, never a silent skip
        pytest.fail(f"this check runs the JDK, and {' and '.join(missing)} is not on PATH: install a Java 17+ JDK")
    classes = tmp_path_factory.mktemp("java")
    subprocess.run(["javac", "-d", str(classes), JAVA_SOURCE], check=True, capture_output=True)

    def run(lines: list[str]) -> list[int]:
        done = subprocess.run(
            ["java", "-cp", str(classes), "JavaHashCodes"],
            input="\n".join(lines) + "\n",
            capture_output=True,
            text=True,
            check=True,
        )
        return [int(x) for x in done.stdout.split()]

    return run


def java_line(value, kind: str) -> str:
    java_type = {"int8": "byte", "int16": "short", "int32": "int", "int64": "long", "bool": "boolean"}.get(kind, kind)
    if kind == "bool":
        return f"boolean {'true' if value else 'false'}"
    if kind == "float32":
        return "float " + struct.pack(">f", value).hex()
    if kind == "float64":
        return "double " + struct.pack(">d", value).hex()
    if kind == "string":
        return "string " + value.encode("utf-8").hex()
    return f"{java_type} {value}"


def test_hash_codes_equal_the_jdk(java_hash):
    rng = np.random.default_rng(20240611)
    lines, expected_kinds, arrays = [], [], []
    for kind in ARROW_TYPES:
        values = random_values(kind, rng, 300)
        lines += [java_line(v, kind) for v in values]
        expected_kinds.append(kind)
        arrays.append(arrow_array(values, kind))
    java = java_hash(lines)
    ours = np.concatenate([java_hash_codes(a) for a in arrays]).tolist()
    assert len(java) == len(ours) == len(lines)
    mismatches = [(line, j, o) for line, j, o in zip(lines, java, ours, strict=True) if j != o]
    assert mismatches == []


def test_string_hashes_equal_the_jdk_for_surrogate_pairs_and_long_text(java_hash):
    rng = np.random.default_rng(7)
    values = [random_unicode(rng, n) for n in (1, 2, 50, 1000)] + ["😀" * 40, "x" * 5000, "\U0010ffff\U00010000"]
    java = java_hash([java_line(v, "string") for v in values])
    assert java_hash_codes(pa.array(values)).tolist() == java
    assert java_hash_codes(pa.array(values, type=pa.large_string())).tolist() == java


# -- the scalar port, over every type, parallelism and max parallelism ------------------------------


@pytest.mark.parametrize("kind", list(ARROW_TYPES))
def test_hash_codes_match_scalar_port(kind):
    values = random_values(kind, np.random.default_rng(1), 500)
    expected = [scalar_java_hash(v, kind) for v in values]
    assert java_hash_codes(arrow_array(values, kind)).tolist() == expected


@pytest.mark.parametrize("kind", list(ARROW_TYPES))
def test_key_group_channels_match_scalar_port_for_all_parallelisms(kind):
    values = random_values(kind, np.random.default_rng(2), 150)
    array = arrow_array(values, kind)
    murmurs = np.array([scalar_murmur(scalar_java_hash(v, kind)) for v in values], dtype=np.int64)
    for max_parallelism in (128, 256, 32768):
        groups = murmurs % max_parallelism
        assert key_groups(array, max_parallelism).tolist() == groups.tolist()
        for parallelism in range(1, 129):
            expected = (groups * parallelism // max_parallelism).tolist()
            assert key_group_channels(array, parallelism, max_parallelism).tolist() == expected, (
                kind,
                max_parallelism,
                parallelism,
            )


def test_non_power_of_two_max_parallelism_matches_scalar_port():
    values = random_values("int64", np.random.default_rng(3), 300)
    array = pa.array(values, type=pa.int64())
    murmurs = np.array([scalar_murmur(scalar_java_hash(v, "int64")) for v in values], dtype=np.int64)
    for max_parallelism in (1, 3, 100, 1000, 32767):
        for parallelism in sorted({1, 2, 7, max_parallelism}):
            if parallelism <= max_parallelism:
                expected = (murmurs % max_parallelism * parallelism // max_parallelism).tolist()
                assert key_group_channels(array, parallelism, max_parallelism).tolist() == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-(1 << 31), max_value=(1 << 31) - 1), min_size=1, max_size=50))
def test_murmur_equals_mmh3_with_flinks_abs_rule(codes):
    expected = []
    for code in codes:
        m = mmh3.hash(struct.pack("<i", code), 0, signed=True)
        expected.append(0 if m == -(1 << 31) else abs(m))
    assert murmur_hash(np.array(codes, dtype=np.int64)).tolist() == expected
    assert key_groups(pa.array(codes, type=pa.int32()), 32768).tolist() == [m % 32768 for m in expected]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=20), max_size=30))
def test_string_hash_property(words):
    assert java_hash_codes(pa.array(words, type=pa.string())).tolist() == [scalar_java_hash(w, "string") for w in words]


# -- array layouts: slices, dictionaries, chunks, large and view strings, long chunks -------------


def test_sliced_dictionary_chunked_and_view_arrays_hash_like_plain_ones():
    rng = np.random.default_rng(4)
    words = random_values("string", rng, 200)
    plain = java_hash_codes(pa.array(words))
    assert java_hash_codes(pa.array(words).slice(37, 100)).tolist() == plain[37:137].tolist()
    assert java_hash_codes(pa.array(words).dictionary_encode()).tolist() == plain.tolist()
    assert java_hash_codes(pa.array(words).dictionary_encode().slice(9, 50)).tolist() == plain[9:59].tolist()
    null_in_dictionary = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0], pa.int8()), pa.array(["x", None]))
    assert java_hash_codes(null_in_dictionary, null_keys="zero").tolist() == [120, 0, 120]
    with pytest.raises(NullKeyError, match=r"1 null value\(s\), the first at row 1"):
        java_hash_codes(null_in_dictionary)
    assert java_hash_codes(pa.array(words, type=pa.large_string()).slice(5)).tolist() == plain[5:].tolist()
    assert java_hash_codes(pa.array(words, type=pa.string_view())).tolist() == plain.tolist()
    chunked = pa.chunked_array([pa.array(words[:50]), pa.array(words[50:])])
    assert java_hash_codes(chunked).tolist() == plain.tolist()
    ints = pa.array(random_values("int16", rng, 100), type=pa.int16())
    assert java_hash_codes(ints.slice(3, 50)).tolist() == java_hash_codes(ints).tolist()[3:53]
    bools = pa.array(random_values("bool", rng, 100))
    assert java_hash_codes(bools.slice(13, 40)).tolist() == java_hash_codes(bools).tolist()[13:53]
    assert java_hash_codes(np.array([5, -7], dtype=np.int32)).tolist() == [5, -7]


def test_strings_across_internal_chunks_and_longer_than_a_chunk():
    rng = np.random.default_rng(5)
    many = [str(i) for i in range(70_000)]  # more rows than one internal chunk
    long_text = random_unicode(rng, 400_000)
    assert len(long_text.encode("utf-8")) > 1 << 20  # longer than one internal chunk of bytes
    values = [*many[:10], long_text, *many, "é", long_text[:3]]
    got = java_hash_codes(pa.array(values)).tolist()
    assert got[10] == scalar_java_hash(long_text, "string")
    assert got[:10] == [scalar_java_hash(v, "string") for v in many[:10]]
    assert got[11:] == [scalar_java_hash(v, "string") for v in [*many, "é", long_text[:3]]]


def test_several_columns_hash_like_flink_tuples():
    rng = np.random.default_rng(6)
    a = random_values("int32", rng, 100)
    b = random_values("string", rng, 100)[: len(a)]
    c = random_values("float64", rng, 100)[: len(a)]
    arrays = [pa.array(a, type=pa.int32()), pa.array(b), pa.array(c)]
    expected = [scalar_tuple_hash(row, ("int32", "string", "float64")) for row in zip(a, b, c, strict=True)]
    assert java_hash_codes(arrays).tolist() == expected
    murmurs = np.array([scalar_murmur(h) for h in expected])
    assert key_group_channels(arrays, 5, 256).tolist() == (murmurs % 256 * 5 // 256).tolist()
    assert java_hash_codes([arrays[0]]).tolist() == java_hash_codes(arrays[0]).tolist()  # Tuple1 == the value


def test_tuple_with_null_fields_counts_them_as_zero_when_allowed():
    a = pa.array([1, None, 3], type=pa.int32())
    b = pa.array(["x", "y", None])
    expected = [scalar_tuple_hash(row, ("int32", "string")) for row in [(1, "x"), (None, "y"), (3, None)]]
    assert java_hash_codes([a, b], null_keys="zero").tolist() == expected
    with pytest.raises(NullKeyError, match=r"'f1'"):
        java_hash_codes([pa.array([1, 2, 3], type=pa.int32()), b])


# -- key group ranges and default max parallelism -------------------------------------------------


def test_key_group_range_examples():
    assert [key_group_range(i, 3, 128) for i in range(3)] == [(0, 42), (43, 85), (86, 127)]
    assert key_group_range(0, 1, 32768) == (0, 32767)
    assert [key_group_range(i, 4, 4) for i in range(4)] == [(0, 0), (1, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize("parallelism, max_parallelism", [(3, 128), (4, 128), (7, 1000), (128, 128), (100, 32768)])
def test_keys_in_the_range_of_operator_i_go_to_operator_i(parallelism, max_parallelism):
    values = pa.array(random_values("int64", np.random.default_rng(8), 2000), type=pa.int64())
    groups = key_groups(values, max_parallelism)
    channels = key_group_channels(values, parallelism, max_parallelism)
    ranges = [key_group_range(i, parallelism, max_parallelism) for i in range(parallelism)]
    assert ranges[0][0] == 0 and ranges[-1][1] == max_parallelism - 1
    assert all(ranges[i][1] + 1 == ranges[i + 1][0] for i in range(parallelism - 1))  # a partition of the groups
    for group, channel in zip(groups.tolist(), channels.tolist(), strict=True):
        start, end = ranges[channel]
        assert start <= group <= end


@pytest.mark.parametrize(
    "parallelism, expected",
    [
        (1, 128),
        (85, 128),
        (86, 256),
        (171, 256),
        (172, 512),
        (341, 512),
        (342, 1024),
        (683, 1024),
        (684, 2048),
        (1365, 2048),
        (10923, 16384),
        (10924, 32768),
        (32768, 32768),
    ],
)
def test_default_max_parallelism_table(parallelism, expected):
    assert default_max_parallelism(parallelism) == expected


def test_parallelism_above_32768_is_refused_as_flink_refuses_it():
    # given a parallelism above Flink's upper bound of key groups
    # when its default max parallelism, a config's or a partitioner's check asks for it
    # then each refuses it with a typed error naming the setting and the bound
    for check in (
        lambda: default_max_parallelism(40000),
        lambda: scs.NetworkConfig().resolve_max_parallelism(40000),
        lambda: scs.rebalance().validate(1, 40000),
        lambda: scs.rescale().consumers_of(0, 40000, 2),
    ):
        with pytest.raises(ConfigError, match=r"Operator parallelism not within bounds") as info:
            check()
        assert "40000" in str(info.value) and "32768" in str(info.value)
    assert default_max_parallelism(32768) == 32768


# -- errors ----------------------------------------------------------------------------------------


def test_null_keys_are_refused_naming_the_column():
    values = pa.array([3, None, 5, None], type=pa.int32())
    with pytest.raises(NullKeyError, match=r"'user_id' has 2 null value\(s\), the first at row 1") as info:
        key_group_channels(values, 2, 128, column="user_id")
    assert "null_keys='zero'" in str(info.value)
    with pytest.raises(NullKeyError):
        key_groups(pa.array(["a", None]).dictionary_encode(), 128)
    with pytest.raises(NullKeyError):
        key_groups(pa.chunked_array([pa.array([1]), pa.array([None], type=pa.int64())]), 128)


def test_null_keys_zero_routes_them_as_hash_code_zero():
    values = pa.array([None, 0, None], type=pa.int64())
    assert java_hash_codes(values, null_keys="zero").tolist() == [0, 0, 0]
    channels = key_group_channels(values, 4, 128, null_keys="zero")
    assert channels.tolist() == [2, 2, 2]  # Integer/Long 0 -> key group 94 -> operator 2 of 4
    assert key_groups(pa.nulls(2), 128, null_keys="zero").tolist() == [94, 94]


@pytest.mark.parametrize(
    "values",
    [
        pa.array([b"ab"], type=pa.binary()),
        pa.array([[1, 2]], type=pa.list_(pa.int32())),
        pa.array([{"a": 1}], type=pa.struct([("a", pa.int32())])),
        pa.array([1], type=pa.decimal128(10, 2)),
        pa.array([1], type=pa.timestamp("us")),
        pa.array([1], type=pa.date32()),
        pa.array([1], type=pa.uint32()),
    ],
    ids=lambda v: str(v.type),
)
def test_unsupported_key_types_say_what_is_accepted(values):
    with pytest.raises(UnsupportedKeyTypeError, match=r"int32 \(Integer\).*string") as info:
        key_groups(values, 128, column="k")
    assert "'k'" in str(info.value) and str(values.type) in str(info.value)


def test_non_arrow_values_are_refused():
    with pytest.raises(UnsupportedKeyTypeError, match=r"pyarrow Array"):
        key_groups([1, 2, 3], 128)


@pytest.mark.parametrize(
    "parallelism, max_parallelism, setting",
    [(0, 128, "parallelism"), (129, 128, "parallelism"), (4, 0, "max_parallelism"), (4, 32769, "max_parallelism"),
     (1.5, 128, "parallelism"), (True, 128, "parallelism")],
)  # fmt: skip
def test_parallelism_bounds_raise_config_error(parallelism, max_parallelism, setting):
    # max_parallelism is a setting as well as an argument; the message calls the parallelism an argument
    kind = "setting" if setting == "max_parallelism" else "argument"
    with pytest.raises(ConfigError, match=f"{kind} '{setting}'") as info:
        key_group_channels(pa.array([1]), parallelism, max_parallelism)
    assert info.value.setting == setting and info.value.kind == kind


def test_key_group_range_checks_its_arguments():
    with pytest.raises(ConfigError, match=r"operator_index"):
        key_group_range(3, 3, 128)
    with pytest.raises(ConfigError, match=r"at most max_parallelism"):
        key_group_range(0, 200, 128)


def test_null_keys_option_is_checked():
    with pytest.raises(ConfigError, match=r"null_keys"):
        key_groups(pa.array([1]), 128, null_keys="skip")
