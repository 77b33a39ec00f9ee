"""The blocking runtime's task functions without Spark: storage rows routed by hand, as the shuffle does.

Property: whatever the partitioner, parallelism, segment size, credits and data, every row comes out
exactly once (once per consumer for broadcast), on the consumer the partitioner chose, in order per
producer, and the metrics count every record once.
"""

from __future__ import annotations

import collections

import numpy as np
import pyarrow as pa
import pytest
from exchange_helpers import SCHEMA, producer_batches, run_blocking
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spark_credit_shuffle as scs
from spark_credit_shuffle.buffers import DataType
from spark_credit_shuffle.engine import GateGauges
from spark_credit_shuffle.errors import ProtocolError
from spark_credit_shuffle.metrics import CONSUMER, TaskMetrics
from spark_credit_shuffle.runtime.blocking import STORAGE_SCHEMA
from spark_credit_shuffle.runtime.blocking.storage import stored_buffers
from spark_credit_shuffle.runtime.exchange_plan import ExchangePlan
from spark_credit_shuffle.transport.in_memory import StoredBuffersExchange

PARTITIONERS = {
    "key_by": lambda: scs.key_by("k"),
    "rebalance": lambda: scs.rebalance(seed=11),
    "rescale": lambda: scs.rescale(),
    "shuffle": lambda: scs.shuffle(seed=3),
    "broadcast": lambda: scs.broadcast(),
    "global": lambda: scs.global_(),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(PARTITIONERS)),
    producers=st.integers(1, 4),
    consumers=st.integers(1, 5),
    rows=st.integers(0, 3000),
    segment=st.sampled_from([4096, 8192, 32768]),
    buffers_per_channel=st.integers(0, 3),
    floating=st.integers(1, 8),
    big_every=st.sampled_from([0, 0, 500]),
)
def test_every_row_arrives_once_on_its_channel(
    name, producers, consumers, rows, segment, buffers_per_channel, floating, big_every
):
    partitioner = PARTITIONERS[name]()
    config = scs.NetworkConfig(
        segment_size=segment, buffers_per_channel=buffers_per_channel, floating_buffers_per_gate=floating
    )
    plan = ExchangePlan(
        name="test", mode="blocking", partitioner=partitioner, num_producers=producers,
        num_consumers=consumers, max_parallelism=128, config=config, schema=SCHEMA,
    )  # fmt: skip
    inputs = {p: producer_batches(p, rows, big_every) for p in range(producers)}
    outputs = run_blocking(plan, inputs)

    expected_per_consumer: dict[int, list[int]] = collections.defaultdict(list)
    for p in range(producers):
        table = pa.Table.from_batches(inputs[p], schema=SCHEMA)
        if partitioner.is_broadcast:
            for c in range(consumers):
                expected_per_consumer[c].extend(table.column("id").to_pylist())
            continue
        targets = partitioner.consumers_of(p, producers, consumers)
        selector = partitioner.selector(p, producers, consumers, 128)
        for batch in inputs[p]:
            for row_id, sp in zip(batch.column("id").to_pylist(), selector.select_channels(batch).tolist()):
                expected_per_consumer[targets[sp]].append(row_id)

    total_in = total_out = 0
    for c in range(consumers):
        data, metric_rows = outputs[c]
        got = data.column("id").to_pylist()
        assert sorted(got) == sorted(expected_per_consumer[c])
        # in order per producer: ids of one producer arrive in the order it wrote them
        by_producer = collections.defaultdict(list)
        for row_id in got:
            by_producer[row_id // 100_000].append(row_id)
        assert all(ids == sorted(ids) for ids in by_producer.values())
        total_in += sum(r["value"] for r in metric_rows if r["metric"] == "numRecordsIn")
        total_out += sum(r["value"] for r in metric_rows if r["metric"] == "numRecordsOut")
    fan_out = consumers if partitioner.is_broadcast else 1
    assert total_in == producers * rows * fan_out
    assert total_out == producers * rows * fan_out


def test_gate_gauges_equal_the_gates_own_metrics():
    """The consumer samples its pool gauges in one pass; at every step they equal the gate's properties."""
    config = scs.NetworkConfig(segment_size=4096, buffers_per_channel=2, floating_buffers_per_gate=3)
    replay = StoredBuffersExchange(config, 3)
    gate = replay.gate
    gauges = GateGauges(gate, TaskMetrics(CONSUMER, 0))
    for channel in range(3):
        for _ in range(6):
            replay.add(channel, DataType.DATA_BUFFER, bytes(100))
        replay.add(channel, DataType.END_OF_PARTITION, b"")
    held: list = []
    seen = set()
    while not gate.is_finished or held:
        item = replay.poll()
        if item is None:
            held.pop(0).recycle()
            continue
        expected = (gate.in_pool_usage, gate.input_exclusive_buffers_usage, gate.input_floating_buffers_usage)
        assert gauges.values() == pytest.approx(expected)
        seen.add(gauges.values())
        if len(held) < 5:
            held.append(item.buffer)  # the consumer holds buffers: usage goes up
        else:
            item.buffer.recycle()
    assert len(seen) > 3
    replay.close()


def test_stored_buffers_are_read_only_slices_and_bad_offsets_are_errors():
    payloads = [b"abc", b"", b"defgh"]
    batch = pa.RecordBatch.from_pydict(
        {"channel": [0, 0, 0], "producer": [2, 1, 2], "seq": [0, 0, 1], "data_type": [1, 10, 1], "payload": payloads},
        schema=STORAGE_SCHEMA,
    )
    rows = list(stored_buffers(batch))
    assert [(p, t, bytes(b)) for p, t, b in rows] == [(2, 1, b"abc"), (1, 10, b""), (2, 1, b"defgh")]
    assert not any(b.is_mutable for _, _, b in rows)
    sliced = list(stored_buffers(batch.slice(1)))
    assert [bytes(b) for _, _, b in sliced] == [b"", b"defgh"]
    column = batch.column(4)
    for offsets in ([0, 3, 2, 8], [0, 99, 3, 8]):  # Arrow itself refuses a last offset past the data
        bad = pa.Array.from_buffers(
            pa.binary(), 3, [None, pa.py_buffer(np.array(offsets, np.int32).tobytes()), column.buffers()[2]]
        )
        with pytest.raises(ProtocolError, match="offsets"):
            list(stored_buffers(pa.RecordBatch.from_arrays([*batch.columns[:4], bad], schema=STORAGE_SCHEMA)))
