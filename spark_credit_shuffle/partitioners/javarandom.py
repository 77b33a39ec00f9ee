"""``java.util.Random``'s ``nextInt(bound)``, vectorised: the generator behind Flink's ``ShufflePartitioner``.

Java's generator is a 48-bit linear congruential generator: the seed is scrambled with the multiplier
(``(seed ^ 0x5DEECE66D) & (2^48 - 1)``), every ``next(bits)`` advances ``state = state * 0x5DEECE66D + 0xB``
modulo 2^48 and returns the top ``bits`` bits, and ``nextInt(bound)`` takes ``next(31)``: for a power of two
``bound`` it keeps the top bits (``bound * r >> 31``), otherwise ``r % bound``, rejecting (and drawing
again) an ``r`` from the incomplete last interval (``r - r % bound + bound - 1`` overflows an int).

The sequence is sequential, but step ``k`` from a state is an affine map, ``A_k * state + C_k`` modulo
2^48, with ``A_k`` and ``C_k`` computed once. A chunk of states is then one vectorised multiply-add in
numpy's wrapping uint64 arithmetic (2^48 divides 2^64, so the low 48 bits are exact). A rejection, which
happens with probability ``(2^31 mod bound) / 2^31`` per draw, ends the chunk at that row; the row is
drawn again from the next state and the next chunk starts after it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["JavaRandom"]

_MULTIPLIER = 0x5DEECE66D
_ADDEND = 0xB
_MASK = (1 << 48) - 1
_CHUNK = 4096


def _affine_steps(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``A_k`` and ``C_k`` for k = 1..n: the state k steps after ``s`` is ``(A_k * s + C_k) mod 2^48``."""
    a_steps, c_steps = [], []
    a, c = 1, 0
    for _ in range(n):
        a = (a * _MULTIPLIER) & _MASK
        c = (c * _MULTIPLIER + _ADDEND) & _MASK
        a_steps.append(a)
        c_steps.append(c)
    return np.array(a_steps, dtype=np.uint64), np.array(c_steps, dtype=np.uint64)


_A, _C = _affine_steps(_CHUNK)


class JavaRandom:
    """``new java.util.Random(seed)``; :meth:`next_ints` is ``nextInt(bound)`` called ``n`` times."""

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = (int(seed) ^ _MULTIPLIER) & _MASK

    def _next31(self) -> int:
        self._state = (self._state * _MULTIPLIER + _ADDEND) & _MASK
        return self._state >> 17

    def next_int(self, bound: int) -> int:
        """One ``nextInt(bound)`` (the scalar rule, used for a rejected draw)."""
        r = self._next31()
        m = bound - 1
        if bound & m == 0:
            return (bound * r) >> 31
        u = r
        while True:
            r = u % bound
            if u - r + m < 1 << 31:
                return r
            u = self._next31()

    def next_ints(self, bound: int, n: int) -> np.ndarray:
        """``nextInt(bound)`` ``n`` times, as int32, in chunks of vectorised states."""
        if bound <= 0:
            raise ValueError(f"bound must be positive, got {bound}")
        out = np.empty(n, dtype=np.int32)
        m = bound - 1
        power_of_two = bound & m == 0
        done = 0
        while done < n:
            k = min(_CHUNK, n - done)
            states = _A[:k] * np.uint64(self._state) + _C[:k]  # wraps modulo 2^64
            states &= np.uint64(_MASK)
            r = (states >> np.uint64(17)).astype(np.int64)
            if power_of_two:
                out[done : done + k] = (r * bound) >> 31
                self._state = int(states[k - 1])
                done += k
                continue
            values = r % bound
            rejected = np.flatnonzero(r - values + m >= 1 << 31)
            if not len(rejected):
                out[done : done + k] = values
                self._state = int(states[k - 1])
                done += k
                continue
            first = int(rejected[0])
            out[done : done + first] = values[:first]
            self._state = int(states[first])  # the rejected draw; the scalar rule draws again
            while True:
                u = self._next31()
                value = u % bound
                if u - value + m < 1 << 31:
                    break
            out[done + first] = value
            done += first + 1
        return out
