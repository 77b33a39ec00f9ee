"""MurmurHash3 x86_32 of one 4-byte int, vectorised: the one implementation behind Flink's and Spark's hash.

Both systems hash an int key with the same function and differ only in what surrounds it:

- Flink's ``MathUtils.murmurHash(int)`` (key groups, :mod:`.keygroups`): seed 0, then the absolute value
  (``Integer.MIN_VALUE`` becomes 0);
- Spark's ``hash()`` of an int (``Murmur3_x86_32.hashInt`` with ``Murmur3Hash``'s seed 42), which
  ``repartition(n, col)`` places by (``pmod(hash(col), n)``): :func:`spark_int_hashes`, and
  :func:`spark_hash_partition_keys`, an int that such a repartition places on each partition.

Everything is numpy, in blocks that stay in the CPU cache.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK", "SPARK_HASH_SEED", "murmur3_ints", "spark_hash_partition_keys", "spark_int_hashes"]

_U32 = np.uint32
_C1 = _U32(0xCC9E2D51)
_C2 = _U32(0x1B873593)
_N = _U32(0xE6546B64)
_FMIX_1 = _U32(0x85EBCA6B)
_FMIX_2 = _U32(0xC2B2AE35)
#: Ints hashed per block: a few numpy passes over 256 KiB beat one pass over 40 MB.
BLOCK = 1 << 16
#: The seed of Spark's ``Murmur3Hash`` expression (``hash()``, hash partitioning).
SPARK_HASH_SEED = 42


def _block(h: np.ndarray, t: np.ndarray, seed: int) -> None:
    """MurmurHash3 x86_32 of each 4-byte int of the uint32 block ``h``, in place (``t``: scratch)."""
    np.multiply(h, _C1, out=h)
    np.right_shift(h, _U32(17), out=t)
    np.left_shift(h, _U32(15), out=h)
    np.bitwise_or(h, t, out=h)
    np.multiply(h, _C2, out=h)
    if seed:
        np.bitwise_xor(h, _U32(seed), out=h)
    np.right_shift(h, _U32(19), out=t)
    np.left_shift(h, _U32(13), out=h)
    np.bitwise_or(h, t, out=h)
    np.multiply(h, _U32(5), out=h)
    np.add(h, _N, out=h)
    np.bitwise_xor(h, _U32(4), out=h)  # the length: one 4-byte int
    np.right_shift(h, _U32(16), out=t)
    np.bitwise_xor(h, t, out=h)
    np.multiply(h, _FMIX_1, out=h)
    np.right_shift(h, _U32(13), out=t)
    np.bitwise_xor(h, t, out=h)
    np.multiply(h, _FMIX_2, out=h)
    np.right_shift(h, _U32(16), out=t)
    np.bitwise_xor(h, t, out=h)


def murmur3_ints(h: np.ndarray, seed: int = 0) -> np.ndarray:
    """MurmurHash3 x86_32 with ``seed`` of every int of the uint32 array ``h``, computed in place; returns ``h``."""
    scratch = np.empty(min(len(h), BLOCK), dtype=_U32)
    for start in range(0, len(h), BLOCK):
        block = h[start : start + BLOCK]
        _block(block, scratch[: len(block)], seed)
    return h


def spark_int_hashes(values: np.ndarray, seed: int = SPARK_HASH_SEED) -> np.ndarray:
    """Spark's ``hash()`` of int values (``Murmur3_x86_32.hashInt``, the seed of ``Murmur3Hash``), as int32."""
    h = np.asarray(values, dtype=np.int32).view(_U32).copy()
    return murmur3_ints(h, seed).view(np.int32)


def spark_hash_partition_keys(num_partitions: int) -> np.ndarray:
    """For every partition ``p`` of ``num_partitions``, an int that Spark's hash partitioning
    (``repartition(n, col)``: ``pmod(hash(col), n)``) places on ``p``: the smallest such int >= 0."""
    keys = np.full(num_partitions, -1, dtype=np.int64)
    start, chunk = 0, max(1024, 16 * num_partitions)
    while (keys < 0).any():
        candidates = np.arange(start, start + chunk, dtype=np.int64)
        partitions = np.mod(spark_int_hashes(candidates).astype(np.int64), num_partitions)
        first = np.full(num_partitions, -1, dtype=np.int64)
        order = np.argsort(partitions, kind="stable")  # within a partition, candidates stay ascending
        sorted_partitions = partitions[order]
        starts = np.flatnonzero(np.r_[True, sorted_partitions[1:] != sorted_partitions[:-1]])
        first[sorted_partitions[starts]] = candidates[order[starts]]
        keys = np.where(keys < 0, first, keys)
        start += chunk
    return keys
