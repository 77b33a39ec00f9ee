"""Sans-IO credit-based flow control: subpartitions, input channels, pools, messages, wire codec.

Nothing in this package opens a socket, starts a thread or reads a clock: its objects take messages,
buffers, credits and recycles as inputs and return (or queue) what to send and what to deliver. One
core serves the in-memory transport and simulation, the blocking exchange (stored buffers replayed
through the credit protocol) and the pipelined exchange over TCP.
"""

from __future__ import annotations

from .checkpointing import (
    AbortedCheckpoint,
    BarrierHandlerState,
    ChannelStatePersister,
    CheckpointStatus,
    CompletedCheckpoint,
    SingleCheckpointBarrierHandler,
)
from .codec import NEED_DATA, FrameDecoder, default_max_frame_length, encode, encode_to_bytes, encoded_size
from .debloat import BufferDebloater, BufferSizeEMA, ThroughputCalculator
from .messages import (
    AckAllUserRecordsProcessed,
    AddCredit,
    BacklogAnnouncement,
    BufferResponse,
    CancelPartitionRequest,
    CloseRequest,
    ErrorResponse,
    Hello,
    NewBufferSize,
    PartitionRequest,
    RecycleBuffers,
    ResumeConsumption,
)
from .partition import (
    BlockingResultPartition,
    BoundedBlockingSubpartitionReader,
    BufferAndBacklog,
    PipelinedResultPartition,
    PipelinedSubpartition,
    PipelinedSubpartitionView,
    ResultPartitionManager,
    ResultPartitionWriter,
    StoredBuffer,
)
from .pools import (
    GateBuffersSpec,
    LocalBufferPool,
    NetworkBufferPool,
    PartitionType,
    input_gate_buffers_spec,
    network_buffers_for_announcing,
    result_partition_pool_size,
)
from .receiver import (
    BufferManager,
    BufferOrEvent,
    ConnectionSubpartitionView,
    CreditBasedPartitionRequestClientHandler,
    InputChannelError,
    LocalInputChannel,
    RemoteInputChannel,
    SingleInputGate,
)
from .sender import (
    CreditBasedSequenceNumberingViewReader,
    LocalChannelViewReader,
    PartitionRequestQueue,
    PartitionRequestServerHandler,
    SequenceNumberingViewReader,
)

__all__ = [
    "NEED_DATA",
    "AbortedCheckpoint",
    "AckAllUserRecordsProcessed",
    "AddCredit",
    "BacklogAnnouncement",
    "BarrierHandlerState",
    "BlockingResultPartition",
    "BoundedBlockingSubpartitionReader",
    "BufferAndBacklog",
    "BufferDebloater",
    "BufferManager",
    "BufferOrEvent",
    "BufferResponse",
    "BufferSizeEMA",
    "CancelPartitionRequest",
    "ChannelStatePersister",
    "CheckpointStatus",
    "CloseRequest",
    "CompletedCheckpoint",
    "ConnectionSubpartitionView",
    "CreditBasedPartitionRequestClientHandler",
    "CreditBasedSequenceNumberingViewReader",
    "ErrorResponse",
    "FrameDecoder",
    "GateBuffersSpec",
    "Hello",
    "InputChannelError",
    "LocalBufferPool",
    "LocalChannelViewReader",
    "LocalInputChannel",
    "NetworkBufferPool",
    "NewBufferSize",
    "PartitionRequest",
    "PartitionRequestQueue",
    "PartitionRequestServerHandler",
    "PartitionType",
    "PipelinedResultPartition",
    "PipelinedSubpartition",
    "PipelinedSubpartitionView",
    "RecycleBuffers",
    "RemoteInputChannel",
    "ResultPartitionManager",
    "ResultPartitionWriter",
    "ResumeConsumption",
    "SequenceNumberingViewReader",
    "SingleCheckpointBarrierHandler",
    "SingleInputGate",
    "StoredBuffer",
    "ThroughputCalculator",
    "default_max_frame_length",
    "encode",
    "encode_to_bytes",
    "encoded_size",
    "input_gate_buffers_spec",
    "network_buffers_for_announcing",
    "result_partition_pool_size",
]
