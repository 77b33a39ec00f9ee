"""Sans-IO credit-based flow control: subpartitions, input channels, pools, messages, wire codec.

One module per Flink class family: ``subpartition`` (result subpartitions and their views), ``partition``
(result partitions: a shared base and the pipelined one), ``blocking_partition``, ``channels`` (input
channels with credit), ``local_channel``, ``gate`` (the input gate), ``client`` (the client handler of a
connection), ``sender`` (the server side of a connection) and ``readers`` (its channels' readers),
``pools``, ``sizing`` (how Flink sizes the pools), ``messages``, ``codec``, ``debloat``, ``checkpointing``.

Nothing in this package opens a socket, starts a thread or reads a clock: its objects take messages,
buffers, credits and recycles as inputs and return (or queue) what to send and what to deliver. One
core serves the in-memory transport and simulation, the blocking exchange (stored buffers replayed
through the credit protocol) and the pipelined exchange over TCP.
"""

from __future__ import annotations

from ..buffers.pools import LocalBufferPool, NetworkBufferPool
from ..buffers.sizing import (
    GateBuffersSpec,
    PartitionType,
    input_gate_buffers_spec,
    network_buffers_for_announcing,
    result_partition_pool_size,
)
from .blocking_partition import BlockingResultPartition, BoundedBlockingSubpartitionReader, StoredBuffer
from .channels import (
    BufferManager,
    InputChannel,
    InputChannelError,
    InputGate,
    PartitionRequestClient,
    RemoteInputChannel,
)
from .checkpointing import (
    AbortedCheckpoint,
    BarrierHandlerState,
    ChannelStatePersister,
    CheckpointStatus,
    CompletedCheckpoint,
    SingleCheckpointBarrierHandler,
)
from .client import ConnectionSubpartitionView, CreditBasedPartitionRequestClientHandler
from .codec import NEED_DATA, FrameDecoder, default_max_frame_length, encode, encode_to_bytes, encoded_size
from .debloat import BufferDebloater, BufferSizeEMA, ThroughputCalculator
from .gate import BufferOrEvent, SingleInputGate
from .handshake import ClientHandshake, ServerHandshake
from .local_channel import LocalInputChannel, LocalPartitionRequestClient, LocalSubpartitionView
from .messages import (
    AckAllUserRecordsProcessed,
    AcknowledgeCheckpoint,
    AddCredit,
    AuthChallenge,
    AuthResponse,
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
from .partition import PipelinedResultPartition, ResultPartition, ResultPartitionManager, ResultPartitionWriter
from .readers import (
    CreditBasedSequenceNumberingViewReader,
    LocalChannelViewReader,
    SequenceNumberingViewReader,
)
from .sender import PartitionRequestQueue, PartitionRequestServerHandler
from .subpartition import (
    ADD_BUFFER_ERROR_CODE,
    DEFAULT_BUFFER_SIZE,
    AvailabilityWithBacklog,
    BufferAndBacklog,
    BufferAvailabilityListener,
    PipelinedSubpartition,
    PipelinedSubpartitionView,
    ResultSubpartitionView,
    SubpartitionParent,
)

__all__ = [
    "ADD_BUFFER_ERROR_CODE",
    "DEFAULT_BUFFER_SIZE",
    "NEED_DATA",
    "AbortedCheckpoint",
    "AckAllUserRecordsProcessed",
    "AcknowledgeCheckpoint",
    "AddCredit",
    "AuthChallenge",
    "AuthResponse",
    "AvailabilityWithBacklog",
    "BacklogAnnouncement",
    "BarrierHandlerState",
    "BlockingResultPartition",
    "BoundedBlockingSubpartitionReader",
    "BufferAndBacklog",
    "BufferAvailabilityListener",
    "BufferDebloater",
    "BufferManager",
    "BufferOrEvent",
    "BufferResponse",
    "BufferSizeEMA",
    "CancelPartitionRequest",
    "ChannelStatePersister",
    "CheckpointStatus",
    "ClientHandshake",
    "CloseRequest",
    "CompletedCheckpoint",
    "ConnectionSubpartitionView",
    "CreditBasedPartitionRequestClientHandler",
    "CreditBasedSequenceNumberingViewReader",
    "ErrorResponse",
    "FrameDecoder",
    "GateBuffersSpec",
    "Hello",
    "InputChannel",
    "InputChannelError",
    "InputGate",
    "LocalBufferPool",
    "LocalChannelViewReader",
    "LocalInputChannel",
    "LocalPartitionRequestClient",
    "LocalSubpartitionView",
    "NetworkBufferPool",
    "NewBufferSize",
    "PartitionRequest",
    "PartitionRequestClient",
    "PartitionRequestQueue",
    "PartitionRequestServerHandler",
    "PartitionType",
    "PipelinedResultPartition",
    "PipelinedSubpartition",
    "PipelinedSubpartitionView",
    "RecycleBuffers",
    "RemoteInputChannel",
    "ResultPartition",
    "ResultPartitionManager",
    "ResultPartitionWriter",
    "ResultSubpartitionView",
    "ResumeConsumption",
    "SequenceNumberingViewReader",
    "ServerHandshake",
    "SingleCheckpointBarrierHandler",
    "SingleInputGate",
    "StoredBuffer",
    "SubpartitionParent",
    "ThroughputCalculator",
    "default_max_frame_length",
    "encode",
    "encode_to_bytes",
    "encoded_size",
    "input_gate_buffers_spec",
    "network_buffers_for_announcing",
    "result_partition_pool_size",
]
