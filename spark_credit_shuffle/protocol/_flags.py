"""Per-``DataType`` flags as tuples indexed by the type's ordinal: the hot paths test them per buffer, and a
tuple lookup is several times cheaper than the enum's properties."""

from __future__ import annotations

from ..buffers.buffer import DataType

_TYPES = sorted(DataType, key=int)
if [int(t) for t in _TYPES] != list(range(len(_TYPES))):  # pragma: no cover - guards the indexing below
    raise RuntimeError("DataType ordinals must be 0..n-1")

IS_BUFFER: tuple[bool, ...] = tuple(t.is_buffer for t in _TYPES)
IS_EVENT: tuple[bool, ...] = tuple(t.is_event for t in _TYPES)
HAS_PRIORITY: tuple[bool, ...] = tuple(t.has_priority for t in _TYPES)
IS_BLOCKING_UPSTREAM: tuple[bool, ...] = tuple(t.is_blocking_upstream for t in _TYPES)
