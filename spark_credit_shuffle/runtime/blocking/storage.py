"""What the blocking producer stage stores in Spark's shuffle and its consumer stage reads back.

One row per network buffer (:data:`STORAGE_SCHEMA`): the consumer subtask it is for, the producer that
wrote it, its sequence number, its data type (flagged with
:data:`~spark_credit_shuffle.buffers.compression.STORED_COMPRESSED_FLAG` where the producer compressed
it) and its payload. One more row per producer, of data type :data:`METRICS_TYPE`, carries the
producer's metric rows to a consumer of its output, encoded by
:func:`~spark_credit_shuffle.metrics.rows_to_bytes`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from ...errors import ProtocolError

__all__ = [
    "CONSUMER_INPUT_BATCH_BYTES",
    "METRICS_TYPE",
    "STORAGE_BATCH_BYTES",
    "STORAGE_DDL",
    "STORAGE_SCHEMA",
    "storage_batch",
    "stored_buffers",
]

#: One row per stored network buffer.
STORAGE_SCHEMA = pa.schema(
    [
        ("channel", pa.int32()),  # consumer subtask the buffer is for
        ("producer", pa.int32()),  # producer subtask that wrote it
        ("seq", pa.int32()),  # sequence number within (producer, channel)
        ("data_type", pa.int8()),  # DataType ordinal; METRICS_TYPE for the producer's metrics
        ("payload", pa.binary()),
    ]
)
STORAGE_DDL = "channel int, producer int, seq int, data_type tinyint, payload binary"
#: Not a Flink data type: the row that carries a producer's metrics to a consumer of its output.
METRICS_TYPE = -1
#: Stored buffers are handed to Spark in batches of about this many payload bytes (fewer, larger
#: batches than one per input batch; memory stays a few MiB).
STORAGE_BATCH_BYTES = 4 << 20
#: The consumer stage gets its stored buffers from Spark in Arrow batches of at most this many bytes
#: (see :func:`~.session.bound_arrow_batches`): a 4 MiB bound took its stage from 1.4-1.7 s to about
#: 1.1 s per 10 M rows, against 1.13-1.18 s with 16 MiB, 1.26 s with 32 MiB and 1.14-1.15 s with 1 or 2 MiB.
CONSUMER_INPUT_BATCH_BYTES = 4 << 20


def storage_batch(rows: list[tuple[int, int, int, int, int]], data: bytearray) -> pa.RecordBatch:
    """The stored buffers ``rows`` (channel, producer, seq, data type, payload length) whose payloads are
    ``data``, one after the other."""
    channel, producer, seq, data_type, lengths = zip(*rows)
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    payload = pa.Array.from_buffers(pa.binary(), len(rows), [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    return pa.RecordBatch.from_arrays(
        [
            pa.array(channel, pa.int32()),
            pa.array(producer, pa.int32()),
            pa.array(seq, pa.int32()),
            pa.array(data_type, pa.int8()),
            payload,
        ],
        schema=STORAGE_SCHEMA,
    )


def stored_buffers(batch: pa.RecordBatch) -> Iterator[tuple[int, int, pa.Buffer]]:
    """(producer, data type, payload) of every stored-buffer row of ``batch`` (STORAGE_SCHEMA).

    Payloads are zero-copy, read-only slices of the batch's binary column: Spark hands each batch
    to the task in memory of its own that nothing writes to again, so the RecordReader may decode
    straight from it (a writable buffer would be copied first). Offsets out of order or outside the
    column's data are a :class:`ProtocolError`, never a read outside it.
    """
    n = batch.num_rows
    producers = batch.column(1).to_numpy(zero_copy_only=False).tolist()
    data_types = batch.column(3).to_numpy(zero_copy_only=False).tolist()
    payload = batch.column(4)
    if payload.null_count:
        raise ProtocolError("a stored buffer without a payload (null)")
    _validity, offsets_buffer, data = payload.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int32, count=n + 1, offset=payload.offset * 4)
    size = data.size if data is not None else 0
    if n and (offsets[0] < 0 or offsets[-1] > size or bool(np.any(offsets[1:] < offsets[:-1]))):
        raise ProtocolError("stored-buffer payload offsets out of order or outside the column's data")
    if data is None:
        data = pa.py_buffer(b"")
    elif data.is_mutable:
        data = pa.foreign_buffer(data.address, data.size, base=data)  # a read-only view of the same memory
    starts = offsets.tolist()
    return zip(producers, data_types, [data.slice(a, b - a) for a, b in itertools.pairwise(starts)])
