"""Per-buffer compression of the blocking shuffle (Flink's ``BufferCompressor`` / ``BufferDecompressor``).

Flink compresses each data buffer of a blocking (batch) shuffle on its own
(``taskmanager.network.blocking-shuffle.compression.enabled``, codec ``taskmanager.network.compression.codec``)
and keeps a buffer as it was when compression does not make it smaller; events are never compressed, and
the pipelined mode does not compress (Flink removed that in 1.10). Here the codecs are Arrow's, the ones its
IPC body compression uses (LZ4 frame, ZSTD). A compressed payload is the uncompressed length (u32, little
endian) followed by the codec's output; whoever stores or sends it marks it compressed (a BufferResponse's
``is_compressed``, a stored row's :data:`STORED_COMPRESSED_FLAG`).

Sans IO: bytes in, bytes out. The decompressor treats its input as untrusted: a declared length above the
segment size, or bytes that do not decompress to exactly that length, raise ``BufferDecodeError``.
"""

from __future__ import annotations

import struct

import pyarrow as pa

from ..errors import BufferDecodeError, ConfigError

__all__ = ["CODECS", "STORED_COMPRESSED_FLAG", "BufferCompressor", "BufferDecompressor"]

#: Codec names (``compression_codec``) and Arrow's codec of each; ``none`` turns compression off.
CODECS = {"lz4": "lz4", "zstd": "zstd", "none": None}
#: Added to a stored row's data type when its payload is compressed (the blocking mode's is-compressed bit).
STORED_COMPRESSED_FLAG = 0x40
_LENGTH = struct.Struct("<I")


def _codec(name: str) -> pa.Codec:
    if name not in CODECS or CODECS[name] is None:
        raise ConfigError("compression_codec", name, "'lz4', 'zstd' or 'none'")
    return pa.Codec(CODECS[name])


class BufferCompressor:
    """Compresses one data buffer's payload with codec ``name`` (``lz4`` or ``zstd``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._codec = _codec(name)

    def compress(self, payload: bytes | bytearray | memoryview | pa.Buffer) -> bytes | None:
        """The compressed form of ``payload`` (length prefix and codec output), or None when it is not smaller
        (the buffer then travels as it is, as Flink's ``BufferCompressor`` does)."""
        size = len(payload) if not isinstance(payload, pa.Buffer) else payload.size
        if not size:
            return None
        compressed: bytes = self._codec.compress(payload, asbytes=True)
        if _LENGTH.size + len(compressed) >= size:
            return None
        return _LENGTH.pack(size) + compressed


class BufferDecompressor:
    """Decompresses payloads :class:`BufferCompressor` made with codec ``name``; at most ``max_size`` bytes
    (the segment size) each."""

    def __init__(self, name: str, max_size: int) -> None:
        self.name = name
        self.max_size = max_size
        self._codec = _codec(name)

    def decompress(self, payload: bytes | memoryview | pa.Buffer) -> pa.Buffer:
        """The original payload; :class:`BufferDecodeError` if ``payload`` is not a compressed buffer of at
        most ``max_size`` bytes."""
        data = payload if isinstance(payload, pa.Buffer) else pa.py_buffer(payload)
        if data.size < _LENGTH.size:
            raise BufferDecodeError(f"a compressed buffer of {data.size} bytes has no length")
        (size,) = _LENGTH.unpack_from(data)
        if size > self.max_size:
            raise BufferDecodeError(f"a compressed buffer declares {size} bytes, more than a segment ({self.max_size})")
        try:
            out = self._codec.decompress(data.slice(_LENGTH.size), decompressed_size=size)
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise BufferDecodeError(f"a {self.name} buffer does not decompress: {exc}") from None
        if out.size != size:
            raise BufferDecodeError(f"a {self.name} buffer decompressed to {out.size} bytes, it declares {size}")
        return out
