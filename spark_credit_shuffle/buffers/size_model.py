"""The writer's vectorised, pessimistic model of how many bytes a run of rows takes as one chunk (a chunk
header plus one Arrow IPC record-batch message), so that buffers can be cut at segment boundaries before
serialising; and the Arrow types a chunk cannot carry as they are.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .format import CHUNK_HEADER

__all__ = ["IpcSizeModel", "compact", "measure_metadata", "takes_wrong_rows", "unsupported_type"]


def unsupported_type(schema: pa.Schema) -> str | None:
    """A description of the first field whose type the buffers cannot carry, or None if all can.

    Dictionary arrays need dictionary messages, and view, union and run-end encoded arrays have no
    per-row size bound (their serialised slices may carry whole shared data buffers).
    """
    for field in schema:
        problem = _unsupported(field.type)
        if problem is not None:
            return f"field {field.name!r} of type {field.type}: {problem}"
    return None


def _unsupported(t: pa.DataType) -> str | None:
    if isinstance(t, pa.BaseExtensionType):
        return _unsupported(t.storage_type)
    if pa.types.is_dictionary(t):
        return "dictionary types are not supported (cast to the value type)"
    if pa.types.is_union(t) or pa.types.is_run_end_encoded(t):
        return f"{t} is not supported"
    if pa.types.is_binary_view(t) or pa.types.is_string_view(t) or pa.types.is_list_view(t):
        return "view types are not supported (cast to string, binary or list)"
    if pa.types.is_large_list_view(t):
        return "view types are not supported (cast to large_list)"
    if pa.types.is_map(t):
        return _unsupported(t.key_type) or _unsupported(t.item_type)
    if _is_list_like(t) or pa.types.is_fixed_size_list(t):
        return _unsupported(t.value_type)
    if pa.types.is_struct(t):
        for i in range(t.num_fields):
            problem = _unsupported(t.field(i).type)
            if problem is not None:
                return problem
    return None


def _is_list_like(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t))


def _offset_width(t: pa.DataType) -> int:
    large = pa.types.is_large_string(t) or pa.types.is_large_binary(t) or pa.types.is_large_list(t)
    return 8 if large else 4


def _is_var_width(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t)
    )


def _offsets(arr: pa.Array, n: int, width: int) -> np.ndarray:
    """The ``n + 1`` offsets of ``arr`` (a var-width or list array), honouring its slice offset."""
    dtype = np.int64 if width == 8 else np.int32
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=n + 1, offset=arr.offset * width)


class _Node:
    """Per-type piece of the size model: constant bits per row plus a per-row variable part."""

    __slots__ = ("buffers", "children", "const_bits", "kind", "offset_width", "type")

    def __init__(self, t: pa.DataType, nullable: bool) -> None:
        if isinstance(t, pa.BaseExtensionType):
            t = t.storage_type
        self.type = t
        self.children: list[_Node] = []
        self.offset_width = 0
        validity = 1 if nullable and not pa.types.is_null(t) else 0
        self.buffers = 1 if not pa.types.is_null(t) else 0  # the validity buffer, present even when empty
        if pa.types.is_null(t):
            self.kind, self.const_bits = "fixed", 0
        elif _is_var_width(t):
            self.kind, self.offset_width = "var", _offset_width(t)
            self.const_bits = validity + 8 * self.offset_width
            self.buffers += 2
        elif _is_list_like(t):
            self.kind, self.offset_width = "list", _offset_width(t)
            self.const_bits = validity + 8 * self.offset_width
            self.buffers += 1
            entries = pa.struct([t.key_field, t.item_field]) if pa.types.is_map(t) else t.value_type
            nullable_values = False if pa.types.is_map(t) else t.value_field.nullable
            self.children = [_Node(entries, nullable_values)]
        elif pa.types.is_fixed_size_list(t):
            self.kind, self.const_bits = "fixed_list", validity
            self.children = [_Node(t.value_type, t.value_field.nullable)]
        elif pa.types.is_struct(t):
            self.kind, self.const_bits = "struct", validity
            self.children = [_Node(t.field(i).type, t.field(i).nullable) for i in range(t.num_fields)]
        else:  # every remaining supported type has a fixed bit width (bool: 1 bit per row)
            self.kind, self.const_bits = "fixed", validity + t.bit_width
            self.buffers += 1

    @property
    def is_constant(self) -> bool:
        """Every row of this type costs the same number of bits."""
        if self.kind == "fixed":
            return True
        if self.kind in ("struct", "fixed_list"):
            return all(child.is_constant for child in self.children)
        return False

    def constant_bits(self) -> int:
        """Bits per row when :attr:`is_constant`."""
        if self.kind == "struct":
            return self.const_bits + sum(child.constant_bits() for child in self.children)
        if self.kind == "fixed_list":
            return self.const_bits + int(self.type.list_size) * self.children[0].constant_bits()
        return self.const_bits

    def has_offsets(self) -> bool:
        """This node or one below it has an offsets buffer."""
        return bool(self.offset_width) or any(child.has_offsets() for child in self.children)

    def has_nested_list(self) -> bool:
        """A list-like node sits at or below this one with an offsets buffer below it."""
        if self.kind in ("list", "fixed_list") and any(child.has_offsets() for child in self.children):
            return True
        return any(child.has_nested_list() for child in self.children)

    def count_buffers(self) -> tuple[int, int]:
        """(number of buffers, number of offsets buffers) in this type's IPC layout."""
        buffers, offsets = self.buffers, 1 if self.offset_width else 0
        for child in self.children:
            b, o = child.count_buffers()
            buffers, offsets = buffers + b, offsets + o
        return buffers, offsets

    def row_bits(self, arr: pa.Array) -> np.ndarray:
        """Bits each row of ``arr`` costs at most, as an int64 array (variable types only)."""
        if isinstance(arr.type, pa.BaseExtensionType):
            arr = arr.storage
        n = len(arr)
        if self.kind == "var":
            o = _offsets(arr, n, self.offset_width)
            return np.diff(o).astype(np.int64) * 8 + self.const_bits
        if self.kind == "list":
            o = _offsets(arr, n, self.offset_width).astype(np.int64)
            return self._sum_children(arr.values, o) + self.const_bits
        if self.kind == "fixed_list":
            k = self.type.list_size
            o = (
                np.arange(arr.offset * k, (arr.offset + n) * k + 1, k, dtype=np.int64)
                if k
                else np.zeros(n + 1, np.int64)
            )
            return self._sum_children(arr.values, o) + self.const_bits
        # struct (with at least one variable child)
        total = np.full(n, self.const_bits, dtype=np.int64)
        for i, child in enumerate(self.children):
            if child.is_constant:
                total += child.constant_bits()
            else:
                total += child.row_bits(arr.field(i))
        return total

    def _sum_children(self, values: pa.Array, o: np.ndarray) -> np.ndarray:
        """Per parent row, the bits of its child elements ``values[o[i]:o[i+1]]``."""
        child = self.children[0]
        if child.is_constant:
            return np.diff(o) * child.constant_bits()
        lo, hi = int(o[0]), int(o[-1])
        bits = child.row_bits(values.slice(lo, hi - lo))
        cum = np.zeros(len(bits) + 1, dtype=np.int64)
        np.cumsum(bits, out=cum[1:])
        sizes: np.ndarray = cum[o[1:] - lo] - cum[o[:-1] - lo]
        return sizes


class IpcSizeModel:
    """A pessimistic, vectorised model of the bytes a run of rows takes as one chunk.

    For rows ``a..b`` of a batch ``src``::

        header + len(serialize(rows)) <= overhead(src) + ceil((cum[b] - cum[a]) / 8)

    with ``cum = cumulative_bits(src)`` and ``overhead = overhead(src)``. Per row it counts each
    column's fixed width, the bytes of variable-width values and their offsets, one validity bit
    per nullable field, and nested types recursively. Per chunk it counts the header, the
    record-batch metadata (measured once for the schema) and, per buffer, the 8-byte padding and
    bitmap rounding and the one extra offset. Arrow's IPC writer truncates a sliced buffer only
    when it is larger than the slice needs rounded up to 64 bytes, so a buffer of ``src`` smaller
    than ``small_buffer`` bytes may be written whole: 56 more bytes each. The writer cuts buffers
    on these numbers; the builder checks the real size.
    """

    def __init__(self, schema: pa.Schema, segment_size: int = 1 << 16) -> None:
        problem = unsupported_type(schema)
        if problem is not None:
            raise TypeError(
                f"cannot write {problem}; supported are null, boolean, numeric, decimal, temporal, "
                "(large) string and binary, fixed-size binary, (large/fixed-size) list, map and struct types"
            )
        self.schema = schema
        self._nodes = [_Node(field.type, field.nullable) for field in schema]
        self._const_bits = sum(node.constant_bits() for node in self._nodes if node.is_constant)
        self._variable = [(i, node) for i, node in enumerate(self._nodes) if not node.is_constant]
        slack = 0
        for node in self._nodes:
            buffers, offsets = node.count_buffers()
            # per buffer: up to 7 bytes of padding plus under 1 byte of bitmap rounding;
            # per offsets buffer: the one offset more than there are rows (8 bytes at most)
            slack += 8 * buffers + 8 * offsets
        if not self._variable and self._const_bits == 0:
            self._const_bits = 1  # rows without bytes: still bound the rows per buffer
        self.metadata_bytes = measure_metadata(schema) + 8  # 8 bytes of margin
        #: Bytes every chunk costs beyond its rows: header, metadata and per-buffer slack.
        self.chunk_overhead = CHUNK_HEADER.size + self.metadata_bytes + slack
        #: Source buffers up to this size may be written whole into a chunk of a segment.
        self.small_buffer = segment_size + 128
        #: Rows of this schema may hold empty nested arrays, which Arrow serialises with their
        #: whole unsliced offsets buffer; such rows are compacted before serialising (see :meth:`serialize`).
        self.has_nested_lists = any(node.has_nested_list() for node in self._nodes)

    def overhead(self, src: pa.RecordBatch) -> int:
        """Bytes a chunk of rows sliced from ``src`` costs beyond its rows (see the class doc)."""
        limit = self.small_buffer
        small = 0
        for column in src.columns:
            for buffer in column.buffers():
                if buffer is not None and buffer.size <= limit:
                    small += 1
        return self.chunk_overhead + 56 * small

    def cumulative_bits(self, batch: pa.RecordBatch) -> np.ndarray:
        """``cum[j]``: bits rows ``0..j-1`` of ``batch`` cost at most (length ``num_rows + 1``)."""
        n = batch.num_rows
        cum = np.arange(0, (n + 1) * self._const_bits, self._const_bits, dtype=np.int64) if self._const_bits else None
        if cum is None:
            cum = np.zeros(n + 1, dtype=np.int64)
        for i, node in self._variable:
            column = batch.column(i)
            if isinstance(column.type, pa.BaseExtensionType):
                column = column.storage
            if node.kind == "var":  # the common case: the offsets give the cumulative bytes directly
                o = _offsets(column, n, node.offset_width)
                cum += (o - o[0]).astype(np.int64) * 8
                cum += np.arange(0, (n + 1) * node.const_bits, node.const_bits, dtype=np.int64)
            else:
                bits = node.row_bits(column)
                cum[1:] += np.cumsum(bits)
        return cum

    def serialize(self, rows: pa.RecordBatch, bound: int | None = None) -> pa.Buffer:
        """The Arrow IPC message of ``rows``; ``bound``: the chunk bytes the model allowed them.

        Arrow's IPC writer writes the whole offsets buffer of an array sliced to zero length (a
        nested list whose rows are all empty); when the chunk comes out larger than ``bound``
        (default: the model's bound for ``rows``), the rows are compacted (copied with ``take``)
        and serialised again.
        """
        message = rows.serialize()
        if self.has_nested_lists:
            if bound is None:
                bound = self.overhead(rows) + -(-int(self.cumulative_bits(rows)[-1]) // 8)
            if CHUNK_HEADER.size + message.size > bound:
                message = compact(rows).serialize()
        return message


def takes_wrong_rows(data_type: pa.DataType) -> bool:
    """``data_type`` holds a fixed-size list of fixed-size lists, whose rows pyarrow 26's ``take`` and
    ``filter`` read from the wrong place when the inner list array starts at an offset (a slice)."""
    if pa.types.is_fixed_size_list(data_type) and pa.types.is_fixed_size_list(data_type.value_type):
        return True
    return any(takes_wrong_rows(data_type.field(i).type) for i in range(data_type.num_fields))


def compact(rows: pa.RecordBatch) -> pa.RecordBatch:
    """A copy of ``rows`` whose arrays hold exactly their rows' data (no shared or sliced buffers).

    Each column is concatenated on its own, which copies it from its offset. Not ``take``: pyarrow 26
    takes the wrong elements from a sliced fixed-size list of fixed-size lists (the next row's).
    """
    return pa.RecordBatch.from_arrays([pa.concat_arrays([column]) for column in rows.columns], schema=rows.schema)


def measure_metadata(schema: pa.Schema) -> int:
    """Bytes of a record-batch message of ``schema`` before its body.

    Continuation marker, metadata length and the padded flatbuffer; the flatbuffer has the same
    size for every non-empty record batch of a schema (a scalar field at 0, such as the body
    length of a batch without buffers, is left out and makes it smaller).
    """
    arrays = [pa.nulls(1, field.type) for field in schema]
    message = pa.RecordBatch.from_arrays(arrays, schema=schema).serialize()
    body = pa.ipc.read_message(message).body
    return int(message.size - (body.size if body is not None else 0))
