"""The task engine: the rules of a producer and a consumer subtask, with no clock, thread or socket inside.

Between the sans-IO protocol core (:mod:`spark_credit_shuffle.protocol`) and the runtimes sits what a
subtask does with it over time: when partly filled buffers are flushed, when a producer says it is alive,
how long it may wait for a buffer, when a consumer gives up on a silent channel, how long decoded rows wait
for more before they go to Spark, what its gauges and timeline say. Every method that depends on time takes
``now`` (seconds on any monotonic clock) and returns what to do next: a time to be woken at
(:class:`Wait`), a typed error to fail with (:class:`Fail`), or the rows to hand on. The pipelined runtime
drives it with threads, sockets and ``time.monotonic()``; the blocking runtime with its own loop; the
simulation (:mod:`spark_credit_shuffle.simulation`) and tests with a virtual clock, which makes the engine's
decisions reproducible. The checkpoint records the consumer half hands barriers to
(:mod:`~spark_credit_shuffle.engine.checkpoints`) stamp alignment with the clock they are given: the wall
clock in the runtimes, the virtual one in the simulation.

- :class:`Settings`: the one place where the network settings and task knobs become the engine's rules
  (``buffer_timeout_ms`` among them: 0 flushes after every record, > 0 is the flusher's interval and
  bounds the output linger, -1 flushes only full buffers, events and the end; blocking partitions are not
  read before their producer ends, so the timeout does not apply to them).
- :class:`ProducerEngine`: the RecordWriter and its result partition, the flush / keep-alive / latency
  marker schedule, the backpressure wait (Flink's ``requestBufferBuilderBlocking`` with its timeout), the
  producer's gauges and metric rows.
- :class:`ConsumerEngine`: the input gate and one RecordReader per channel, the silence rule (a channel that
  delivers nothing within ``partition_request_timeout_ms`` fails the task), the output linger
  (:class:`OutputBatcher`), latency markers, checkpoint events, the consumer's gauges and metric rows.
- :class:`TimeAccount`: busy, idle and back-pressured time of one side (Flink's time metrics).

The caller holds whatever lock guards the protocol objects while it calls the engine.
"""

from .consumer import ConsumerEngine, GateGauges, OutputBatcher, channel_gauges, combine
from .producer import Flusher, ProducerEngine, subpartition_gauges
from .rules import LINGER_OVER, Fail, LingerOver, Settings, TimeAccount, Wait, check_end

__all__ = [
    "LINGER_OVER",
    "ConsumerEngine",
    "Fail",
    "Flusher",
    "GateGauges",
    "LingerOver",
    "OutputBatcher",
    "ProducerEngine",
    "Settings",
    "TimeAccount",
    "Wait",
    "channel_gauges",
    "check_end",
    "combine",
    "subpartition_gauges",
]
