"""Network buffers: Arrow record batches cut to one segment, written and read per channel."""

from __future__ import annotations

from .buffer import Buffer, BufferConsumer, ByteBufferBuilder, DataType, FinishedBufferConsumer, SegmentLease

__all__ = ["Buffer", "BufferConsumer", "ByteBufferBuilder", "DataType", "FinishedBufferConsumer", "SegmentLease"]
