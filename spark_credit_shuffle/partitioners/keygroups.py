"""Flink's key groups, bit-exact and vectorised over Arrow arrays.

Flink routes a keyed record in four steps (``KeyGroupRangeAssignment``, ``MathUtils``):

1. ``h = key.hashCode()``, the Java hash of the key object;
2. ``m = murmurHash(h)``: MurmurHash3 x86_32 of the single 4-byte int with seed 0, then the absolute value
   (``Integer.MIN_VALUE`` becomes 0);
3. ``keyGroup = m % maxParallelism``;
4. ``operatorIndex = keyGroup * parallelism / maxParallelism``.

The Java type of a key follows its Arrow type, as Spark hands columns to Python:

========================  =========================  ==============================================
Arrow type                Java type                  ``hashCode``
========================  =========================  ==============================================
int8, int16, int32        Byte, Short, Integer       the value
int64                     Long                       ``(int)(v ^ (v >>> 32))``
bool                      Boolean                    1231 (true), 1237 (false)
float32                   Float                      ``floatToIntBits`` (every NaN is 0x7fc00000)
float64                   Double                     ``doubleToLongBits`` folded like Long
string, large_string,     String                     ``s[0]*31^(n-1) + ... + s[n-1]`` over UTF-16
string_view                                          code units (a character outside the BMP is
                                                     a surrogate pair: two units)
several columns           Tuple2 .. Tuple25          ``31 * h + hash(next field)``, null fields 0
========================  =========================  ==============================================

Dictionary-encoded arrays of these types hash like their values. Everything is numpy over whole
arrays: strings are hashed from their UTF-8 bytes and offsets (an ASCII fast path, and a vectorised
UTF-8 to UTF-16 decoder otherwise), never one Python call per row.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Literal, SupportsIndex

import numpy as np
import pyarrow as pa

from ..config import MAX_PARALLELISM_UPPER_BOUND, default_max_parallelism
from ..errors import ConfigError, NullKeyError, UnsupportedKeyTypeError
from .murmur3 import BLOCK, murmur3_ints

__all__ = [
    "MAX_TUPLE_ARITY",
    "SUPPORTED_KEY_TYPES",
    "NullKeys",
    "check_parallelism",
    "default_max_parallelism",
    "java_hash_codes",
    "key_group_channels",
    "key_group_range",
    "key_groups",
    "murmur_hash",
]

NullKeys = Literal["error", "zero"]

#: Human list of the key types :func:`java_hash_codes` accepts, used in error messages.
SUPPORTED_KEY_TYPES = (
    "int8 (Byte), int16 (Short), int32 (Integer), int64 (Long), bool (Boolean), float32 (Float), "
    "float64 (Double), string / large_string / string_view (String), and dictionary arrays of these"
)
#: Flink's largest tuple (``Tuple25``); a key of more columns has no Flink tuple type to mirror.
MAX_TUPLE_ARITY = 25

_U32 = np.uint32
_INT_MIN = -(1 << 31)
_DOUBLE_NAN_BITS = np.uint64(0x7FF8000000000000)
_FLOAT_NAN_BITS = np.uint32(0x7FC00000)
# Strings are hashed in chunks of at most this many rows and (unless one string is longer) bytes.
_STRING_CHUNK_ROWS = 1 << 16
_STRING_CHUNK_BYTES = 1 << 20
_INV31 = pow(31, -1, 1 << 32)  # 31 is odd, so it has an inverse modulo 2**32


# -- validation -----------------------------------------------------------------------------------


def _as_int(value: object, setting: str, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise ConfigError(setting, value, allowed)
    return operator.index(value)


def _check_max_parallelism(max_parallelism: object) -> int:
    allowed = f"an integer in [1, {MAX_PARALLELISM_UPPER_BOUND}]"
    value = _as_int(max_parallelism, "max_parallelism", allowed)
    if not 1 <= value <= MAX_PARALLELISM_UPPER_BOUND:
        raise ConfigError("max_parallelism", value, allowed, "Flink's KeyGroupRangeAssignment upper bound is 2^15")
    return value


def check_parallelism(parallelism: object, max_parallelism: object) -> tuple[int, int]:
    """Check ``1 <= parallelism <= max_parallelism <= 32768`` as Flink does; returns both as ints.

    Raises :class:`ConfigError` naming the setting, the value and the allowed range.
    """
    max_p = _check_max_parallelism(max_parallelism)
    p = _as_int(parallelism, "parallelism", f"an integer in [1, max_parallelism ({max_p})]")
    if p < 1:
        raise ConfigError("parallelism", p, f"an integer in [1, max_parallelism ({max_p})]")
    if p > max_p:
        raise ConfigError(
            "parallelism",
            p,
            f"at most max_parallelism ({max_p})",
            "Flink: 'Maximum parallelism must not be smaller than parallelism.'; raise max_parallelism "
            "(spark.creditShuffle.maxParallelism) or lower the parallelism",
        )
    return p, max_p


def _check_null_keys(null_keys: object) -> str:
    if null_keys not in ("error", "zero"):
        raise ConfigError(
            "null_keys", null_keys, "'error' (refuse null keys, as Flink does) or 'zero' (hash them as 0)"
        )
    return null_keys


# -- Java hashCode per Arrow type -----------------------------------------------------------------


def _bits(buffer: pa.Buffer | None, offset: int, length: int) -> np.ndarray:
    """Booleans of an Arrow bitmap (least significant bit first), ``length`` of them from bit ``offset``."""
    if buffer is None:
        return np.ones(length, dtype=bool)
    first, skip = divmod(offset, 8)
    nbytes = (skip + length + 7) // 8
    raw = np.frombuffer(buffer, dtype=np.uint8, count=nbytes, offset=first)
    return np.unpackbits(raw, bitorder="little")[skip : skip + length].view(bool)


def _values(arr: pa.Array, dtype: type[np.generic]) -> np.ndarray:
    """The fixed-width values buffer of ``arr`` as numpy, without copying (null slots hold anything)."""
    n = len(arr)
    buffer = arr.buffers()[1]
    if n == 0 or buffer is None:
        return np.zeros(n, dtype=dtype)
    return np.frombuffer(buffer, dtype=dtype, count=arr.offset + n)[arr.offset :]


def _null_mask(arr: pa.Array) -> np.ndarray | None:
    """True where ``arr`` is null, or None when it has no nulls."""
    if arr.null_count == 0:
        return None
    if pa.types.is_null(arr.type):
        return np.ones(len(arr), dtype=bool)
    return ~_bits(arr.buffers()[0], arr.offset, len(arr))


def _fold_long(bits: np.ndarray) -> np.ndarray:
    """Java ``Long.hashCode``: ``(int)(v ^ (v >>> 32))`` on uint64 bit patterns, as uint32."""
    folded: np.ndarray = (bits ^ (bits >> np.uint64(32))).astype(_U32)
    return folded


def _power_tables(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``31**k`` and ``31**-k`` modulo 2**32 for k in [0, n), cached and grown by doubling."""
    pow31, inv = _POWER_TABLES
    if len(pow31) < n:
        size = max(n, 2 * len(pow31))
        pow31 = np.empty(size, dtype=_U32)
        inv = np.empty(size, dtype=_U32)
        pow31[0] = inv[0] = 1
        np.cumprod(np.full(size - 1, 31, dtype=_U32), dtype=_U32, out=pow31[1:])
        np.cumprod(np.full(size - 1, _INV31, dtype=_U32), dtype=_U32, out=inv[1:])
        _POWER_TABLES[:] = (pow31, inv)
    return pow31, inv


#: ``_power_tables``' cache: the two tables, grown by doubling.
_POWER_TABLES: list[np.ndarray] = [np.ones(1, dtype=_U32), np.ones(1, dtype=_U32)]


def _utf16_units(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, ...]:
    """UTF-16 code units of a chunk of UTF-8 bytes; byte offsets of its strings become unit offsets.

    The whole chunk is transcoded in one codec call (a concatenation of valid UTF-8 strings is valid UTF-8).
    A lead byte starts one code unit, a 4-byte lead (a code point from U+10000) two: a surrogate pair.
    """
    try:
        units = np.frombuffer(data.tobytes().decode("utf-8").encode("utf-16-le"), dtype=np.uint16)
    except UnicodeDecodeError as exc:
        raise UnsupportedKeyTypeError(
            f"string keys must be valid UTF-8 (Arrow's rule); found an invalid byte sequence: {exc.reason}"
        ) from None
    # units before byte x = x - (continuation bytes before x) + (4-byte leads before x); both are rare in
    # mostly-ASCII text, so only their positions are summed
    delta = ((data >= 0xF0).view(np.int8) - ((data & 0xC0) == 0x80).view(np.int8)).astype(np.int8)
    where = np.flatnonzero(delta)
    running = np.zeros(len(where) + 1, dtype=np.int64)
    np.cumsum(delta[where], out=running[1:])
    starts_u = starts + running[np.searchsorted(where, starts)]
    ends_u = ends + running[np.searchsorted(where, ends)]
    return units, starts_u, ends_u


def _string_hashes(arr: pa.Array) -> np.ndarray:
    """Java ``String.hashCode`` of every value of a (large_)string array, as uint32.

    ``h = sum(u[j] * 31**(end-1-j))``; since 31 is invertible modulo 2**32 this is
    ``31**(end-1) * sum(u[j] * 31**-j)``, so one running sum over all code units of a chunk gives
    every string's hash by a difference at its offsets, without a loop over the characters.
    """
    n = len(arr)
    out = np.zeros(n, dtype=_U32)
    if n == 0:
        return out
    offset_type = np.int64 if pa.types.is_large_string(arr.type) else np.int32
    _, offsets_buffer, data_buffer = arr.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=offset_type, count=arr.offset + n + 1)[arr.offset :]
    if data_buffer is None or offsets[-1] == offsets[0]:
        return out  # only empty strings (or nulls)
    data = np.frombuffer(data_buffer, dtype=np.uint8)
    row = 0
    while row < n:  # one iteration per chunk of rows, not per row
        bounds = offsets[row : row + _STRING_CHUNK_ROWS + 1].astype(np.int64)
        byte_start = bounds[0]
        if bounds[-1] - byte_start > _STRING_CHUNK_BYTES:
            last = int(np.searchsorted(bounds, byte_start + _STRING_CHUNK_BYTES, side="right")) - 1
            bounds = bounds[: max(last, 1) + 1]
        end_row = row + len(bounds) - 1
        chunk = data[byte_start : bounds[-1]]
        starts = bounds[:-1] - byte_start
        ends = bounds[1:] - byte_start
        if len(chunk) and chunk.max() >= 0x80:
            units, starts, ends = _utf16_units(chunk, starts, ends)
        else:
            units = chunk
        pow31, inv = _power_tables(len(units) + 1)
        running = np.empty(len(units) + 1, dtype=_U32)
        running[0] = 0
        np.multiply(units, inv[: len(units)], out=running[1:], dtype=_U32)
        np.cumsum(running[1:], dtype=_U32, out=running[1:])
        sums = running[ends] - running[starts]
        out[row:end_row] = sums * pow31[np.maximum(ends - 1, 0)]
        row = end_row
    return out


def _unsupported(arr_type: pa.DataType, column: str | None) -> UnsupportedKeyTypeError:
    name = f"key column {column!r}" if column is not None else "the key"
    if pa.types.is_binary(arr_type) or pa.types.is_large_binary(arr_type) or pa.types.is_fixed_size_binary(arr_type):
        why = "Java's byte[] hashCode is the array's identity, different in every JVM"
    elif pa.types.is_nested(arr_type):
        why = "nested values have no stable Java hashCode (pass their fields as separate key columns)"
    elif pa.types.is_unsigned_integer(arr_type):
        why = "Java has no unsigned integer types; cast to a signed type first"
    else:
        why = "its Java hashCode is not reproduced here; cast it to a supported type first"
    return UnsupportedKeyTypeError(
        f"{name} has Arrow type {arr_type}, which cannot be a key: {why}. Accepted key types: {SUPPORTED_KEY_TYPES}"
    )


def _hash_array(arr: pa.Array, column: str | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Java hashCodes (uint32, 0 at nulls) and the null mask (or None) of one array."""
    t = arr.type
    nulls = _null_mask(arr)
    if pa.types.is_dictionary(t):
        dict_hashes, dict_nulls = _hash_array(arr.dictionary, column)
        indices = _values(arr.indices, arr.indices.type.to_pandas_dtype()).astype(np.int64)
        if nulls is not None:
            indices = np.where(nulls, 0, indices)
        if len(dict_hashes) == 0:  # every value is null
            return np.zeros(len(arr), dtype=_U32), np.ones(len(arr), dtype=bool)
        hashes = dict_hashes[indices]
        if dict_nulls is not None:
            nulls = dict_nulls[indices] if nulls is None else nulls | dict_nulls[indices]
    elif pa.types.is_int32(t):
        hashes = _values(arr, np.int32).view(_U32).copy()
    elif pa.types.is_int8(t) or pa.types.is_int16(t):
        hashes = _values(arr, t.to_pandas_dtype()).astype(np.int32).view(_U32)
    elif pa.types.is_int64(t):
        hashes = _fold_long(_values(arr, np.int64).view(np.uint64))
    elif pa.types.is_float64(t):
        values = _values(arr, np.float64)
        hashes = _fold_long(np.where(np.isnan(values), _DOUBLE_NAN_BITS, values.view(np.uint64)))
    elif pa.types.is_float32(t):
        values = _values(arr, np.float32)
        hashes = np.where(np.isnan(values), _FLOAT_NAN_BITS, values.view(_U32))
    elif pa.types.is_boolean(t):
        hashes = np.where(_bits(arr.buffers()[1], arr.offset, len(arr)), _U32(1231), _U32(1237))
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        hashes = _string_hashes(arr)
    elif pa.types.is_string_view(t):
        hashes = _string_hashes(arr.cast(pa.large_string()))
    elif pa.types.is_null(t):
        hashes = np.zeros(len(arr), dtype=_U32)
    else:
        raise _unsupported(t, column)
    if nulls is not None:
        hashes[nulls] = 0
    return hashes, nulls


def _null_error(nulls: np.ndarray, column: str | None) -> NullKeyError:
    name = f"key column {column!r}" if column is not None else "the key"
    first = int(np.argmax(nulls))
    return NullKeyError(
        f"{name} has {int(nulls.sum())} null value(s), the first at row {first}: Flink refuses null keys "
        "('Assigned key must not be null!'); filter them out, or pass null_keys='zero' to route them as hashCode 0"
    )


def _column_hashes(values: object, column: str | None, null_keys: str) -> np.ndarray:
    try:
        return _column_hashes_of(values, column, null_keys)
    except UnsupportedKeyTypeError as exc:  # a value no hashCode exists for (invalid UTF-8): name its column
        if column is None or str(exc).startswith("key column"):
            raise
        raise UnsupportedKeyTypeError(f"key column {column!r}: {exc}") from None


def _column_hashes_of(values: object, column: str | None, null_keys: str) -> np.ndarray:
    if isinstance(values, np.ndarray):
        values = pa.array(values)
    if isinstance(values, pa.ChunkedArray):
        parts = [_hash_array(chunk, column) for chunk in values.chunks]
        hashes = np.concatenate([h for h, _ in parts]) if parts else np.zeros(0, dtype=_U32)
        if any(n is not None for _, n in parts):
            nulls = np.concatenate([np.zeros(len(h), dtype=bool) if n is None else n for h, n in parts])
        else:
            nulls = None
    elif isinstance(values, pa.Array):
        hashes, nulls = _hash_array(values, column)
    else:
        raise UnsupportedKeyTypeError(
            f"key values must be a pyarrow Array or ChunkedArray (or a numpy array), not {type(values).__name__}"
        )
    if nulls is not None and null_keys == "error" and nulls.any():
        raise _null_error(nulls, column)
    return hashes


def _hash_codes_u32(
    values: object, columns: Sequence[str] | None = None, null_keys: str = "error", column: str | None = None
) -> np.ndarray:
    null_keys = _check_null_keys(null_keys)
    if isinstance(values, (list, tuple)):
        if not values:
            raise UnsupportedKeyTypeError("a tuple key needs at least one column")
        if len(values) > MAX_TUPLE_ARITY:
            raise UnsupportedKeyTypeError(
                f"a key of {len(values)} columns has no Flink tuple type (Tuple1 .. Tuple{MAX_TUPLE_ARITY})"
            )
        names = list(columns) if columns is not None else [f"f{i}" for i in range(len(values))]
        if len(values) == 1:
            return _column_hashes(values[0], names[0], null_keys)
        result: np.ndarray | None = None
        for field_values, name in zip(values, names, strict=True):
            field_hashes = _column_hashes(field_values, name, null_keys)
            if result is None:
                result = field_hashes.copy()
            elif len(field_hashes) != len(result):
                raise UnsupportedKeyTypeError(
                    f"key column {name!r} has {len(field_hashes)} values, the first key column {len(result)}"
                )
            else:
                np.multiply(result, _U32(31), out=result)
                np.add(result, field_hashes, out=result)
        assert result is not None  # values has at least one column
        return result
    return _column_hashes(values, column, null_keys)


def java_hash_codes(
    values: pa.Array | pa.ChunkedArray | Sequence[pa.Array], *, null_keys: NullKeys = "error", column: str | None = None
) -> np.ndarray:
    """Java ``hashCode()`` of every key, as int32: what ``key.hashCode()`` returns in Flink.

    ``values`` is one Arrow array (or chunked array, or numpy array), or a list/tuple of arrays for a key of
    several columns, hashed like Flink's ``TupleN``. Null keys raise :class:`NullKeyError` naming ``column``
    unless ``null_keys="zero"``, which hashes them as 0.
    """
    return _hash_codes_u32(values, null_keys=null_keys, column=column).view(np.int32)


# -- murmur, key groups, operator indexes ---------------------------------------------------------


def _murmur_u32_inplace(h: np.ndarray) -> np.ndarray:
    """Flink's ``MathUtils.murmurHash`` of every uint32 of ``h``, in place: seed 0, then the absolute value."""
    for start in range(0, len(h), BLOCK):  # block by block, while each is in the CPU cache
        block = murmur3_ints(h[start : start + BLOCK], 0)
        signed = block.view(np.int32)
        np.abs(signed, out=signed)  # wraps Integer.MIN_VALUE to itself ...
        np.maximum(signed, 0, out=signed)  # ... which Flink maps to 0
    return h


def murmur_hash(codes: np.ndarray) -> np.ndarray:
    """Flink's ``MathUtils.murmurHash(int)`` of every int32 hash code: a non-negative int32 per value."""
    h = (np.asarray(codes).astype(np.int64) & 0xFFFFFFFF).astype(_U32)
    return _murmur_u32_inplace(h).view(np.int32)


def _key_groups_u32(hashes: np.ndarray, max_parallelism: int) -> np.ndarray:
    groups = _murmur_u32_inplace(hashes)
    if max_parallelism & (max_parallelism - 1) == 0:
        np.bitwise_and(groups, _U32(max_parallelism - 1), out=groups)
    else:
        np.remainder(groups, _U32(max_parallelism), out=groups)
    return groups


def key_groups(
    values: pa.Array, max_parallelism: int, *, null_keys: NullKeys = "error", column: str | None = None
) -> np.ndarray:
    """Flink's key group (in ``[0, max_parallelism)``) of every key, as int32.

    ``values`` is an Arrow array of a supported type (see the module docs), or a list of arrays for a key of
    several columns (Flink's ``TupleN``). ``max_parallelism`` is the number of key groups, in [1, 32768].
    """
    max_p = _check_max_parallelism(max_parallelism)
    hashes = _hash_codes_u32(values, null_keys=null_keys, column=column)
    return _key_groups_u32(hashes, max_p).view(np.int32)


def key_group_channels(
    values: pa.Array,
    parallelism: int,
    max_parallelism: int,
    *,
    null_keys: NullKeys = "error",
    column: str | None = None,
) -> np.ndarray:
    """The operator index (consumer subtask, in ``[0, parallelism)``) Flink sends every key to, as int32.

    ``keyGroup * parallelism // max_parallelism`` of each key's group, exactly as
    ``KeyGroupRangeAssignment.assignKeyToParallelOperator``. Needs ``1 <= parallelism <= max_parallelism <= 32768``.
    """
    p, max_p = check_parallelism(parallelism, max_parallelism)
    hashes = _hash_codes_u32(values, null_keys=null_keys, column=column)
    return _channels_of_hashes(hashes, p, max_p)


def _channels_of_hashes(hashes: np.ndarray, parallelism: int, max_parallelism: int) -> np.ndarray:
    """Operator index of each uint32 hash code (consumed in place); int32."""
    groups = _key_groups_u32(hashes, max_parallelism)
    np.multiply(groups, _U32(parallelism), out=groups)  # < 2**15 * 2**15, fits
    if max_parallelism & (max_parallelism - 1) == 0:
        np.right_shift(groups, _U32(max_parallelism.bit_length() - 1), out=groups)
    else:
        np.floor_divide(groups, _U32(max_parallelism), out=groups)
    return groups.view(np.int32)


def key_group_range(operator_index: int, parallelism: int, max_parallelism: int) -> tuple[int, int]:
    """The key groups ``(start, end)``, both inclusive, that operator ``operator_index`` owns.

    As ``computeKeyGroupRangeForOperatorIndex``: ``start = ceil(i * P / p)``, ``end = ((i + 1) * P - 1) // p``.
    With P=128 and p=3 the ranges are (0, 42), (43, 85) and (86, 127).
    """
    p, max_p = check_parallelism(parallelism, max_parallelism)
    index = _as_int(operator_index, "operator_index", f"an integer in [0, {p})")
    if not 0 <= index < p:
        raise ConfigError("operator_index", index, f"an integer in [0, parallelism) = [0, {p})")
    return (index * max_p + p - 1) // p, ((index + 1) * max_p - 1) // p
