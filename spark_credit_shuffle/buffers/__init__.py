"""Network buffers: Arrow record batches cut to one segment, written and read per channel."""

from __future__ import annotations

from .buffer import Buffer, BufferConsumer, ByteBufferBuilder, DataType, SegmentLease
from .builder import BufferBuilder
from .format import (
    AlignmentType,
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointOptions,
    EndOfPartition,
    Event,
    KeepAlive,
    LatencyMarker,
    SchemaEvent,
    decode_event,
    encode_event,
)
from .reader import RecordReader
from .size_model import IpcSizeModel
from .writer import RecordWriter

__all__ = [
    "AlignmentType",
    "Buffer",
    "BufferBuilder",
    "BufferConsumer",
    "ByteBufferBuilder",
    "CancelCheckpointMarker",
    "CheckpointBarrier",
    "CheckpointOptions",
    "DataType",
    "EndOfPartition",
    "Event",
    "IpcSizeModel",
    "KeepAlive",
    "LatencyMarker",
    "RecordReader",
    "RecordWriter",
    "SchemaEvent",
    "SegmentLease",
    "decode_event",
    "encode_event",
]
