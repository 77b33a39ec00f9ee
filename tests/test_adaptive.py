"""Adaptive rebalance (Flink 2.x's adaptive partitioner): rows go to the least-loaded of the next
max_traverse channels, so a slow consumer no longer holds back the others."""

from __future__ import annotations

import collections
import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import functions as F
from spark_helpers import assert_same_rows

import spark_credit_shuffle as scs
from spark_credit_shuffle.buffers.pools import NetworkBufferPool
from spark_credit_shuffle.buffers.writer import RecordWriter
from spark_credit_shuffle.errors import ConfigError, PartitionerError
from spark_credit_shuffle.partitioners import AdaptiveRebalanceSelector, RoundRobinSelector
from spark_credit_shuffle.protocol.partition import PipelinedResultPartition
from spark_credit_shuffle.runtime.exchange_plan import ExchangePlan, Injection

SCHEMA = pa.schema([("id", pa.int64()), ("s", pa.string())])


def batches(producer: int, rows: int, per_batch: int = 100, payload: int = 100) -> list[pa.RecordBatch]:
    ids = pa.array(range(producer * rows, (producer + 1) * rows), pa.int64())
    strings = pc.binary_join_element_wise("x" * payload, pc.cast(ids, pa.string()), "")
    batch = pa.RecordBatch.from_arrays([ids, strings], schema=SCHEMA)
    return [batch.slice(i, per_batch) for i in range(0, rows, per_batch)]


def test_choice_is_the_least_loaded_of_the_next_channels():
    selector = AdaptiveRebalanceSelector(5, start=0, max_traverse=3)
    assert selector.choose_channel([0, 9, 4, 7, 0]) == 2  # looks at 1, 2, 3 (not 4, beyond max_traverse)
    assert selector.choose_channel([0, 9, 4, 7, 0]) == 4  # from 2: 3, 4, 0 -> first of the two empty ones
    assert selector.choose_channel([1, 1, 1, 1, 1]) == 0  # a tie goes to the next channel: round robin
    assert selector.choose_channel([1, 1, 1, 1, 1]) == 1
    one = AdaptiveRebalanceSelector(3, start=-1, max_traverse=1)
    assert [one.choose_channel([0, 5, 9]) for _ in range(4)] == [0, 1, 2, 0]  # max_traverse 1: round robin
    # without queue information it is Flink's rebalance
    plain = AdaptiveRebalanceSelector(3, start=1)
    rows = pa.RecordBatch.from_arrays([pa.array(range(7))], names=["x"])
    assert plain.select_channels(rows).tolist() == RoundRobinSelector(3, start=1).select_channels(rows).tolist()
    assert selector.is_load_based and not getattr(RoundRobinSelector(3), "is_load_based", False)
    with pytest.raises(PartitionerError, match="max_traverse"):
        AdaptiveRebalanceSelector(3, max_traverse=0)
    with pytest.raises(ConfigError, match="max_traverse"):
        scs.rebalance(adaptive=True, max_traverse=0)
    assert isinstance(scs.rebalance(seed=1, adaptive=True).selector(0, 2, 4), AdaptiveRebalanceSelector)
    assert scs.rebalance(seed=1, adaptive=True) == scs.rebalance(seed=1, adaptive=True)


def _drain(view) -> int:
    """Poll every buffer the view has and recycle it, as a reader that keeps up; return the bytes read."""
    read = 0
    while (polled := view.get_next_buffer()) is not None:
        read += polled.buffer.size
        polled.buffer.recycle()
    return read


class _Listener:
    def notify_data_available(self) -> None:
        pass

    def notify_priority_event(self, sequence_number: int) -> None:
        pass


def test_the_writer_steers_chunks_away_from_a_channel_nobody_reads():
    config = scs.NetworkConfig(segment_size="4kb")
    partition = PipelinedResultPartition.create(NetworkBufferPool(1000, 4096), 2, config)
    views = [partition.create_subpartition_view(sp, _Listener()) for sp in range(2)]
    writer = RecordWriter(partition, scs.rebalance(seed=3, adaptive=True).selector(0, 1, 2), 4096, schema=SCHEMA)
    written = [0, 0]
    for batch in batches(0, 6000):
        before = writer.num_records_out
        writer.emit(batch)
        writer.flush_all()
        _drain(views[1])  # consumer 1 keeps up, consumer 0 reads nothing
        after = writer.num_records_out
        written = [written[i] + after[i] - before[i] for i in range(2)]
        queued = writer.queued_bytes()
        assert queued[1] <= 4096  # what consumer 1 has not read: at most the open buffer
    assert sum(written) == 6000 == sum(writer.num_records_out)
    # channel 0 got rows only until its queue was longer than channel 1's: one chunk at a time
    assert written[0] < 6000 * 0.05 and written[1] > 6000 * 0.95
    assert writer.queued_bytes()[0] > 0
    writer.finish()
    # channel 0's queue arrives whole; consumer 1 read everything as it was flushed: only its end (no bytes) is left
    assert _drain(views[0]) > 0 and _drain(views[1]) == 0


def test_with_equal_queues_it_is_round_robin_over_chunks():
    config = scs.NetworkConfig(segment_size="4kb")
    partition = PipelinedResultPartition.create(NetworkBufferPool(1000, 4096), 3, config)
    views = [partition.create_subpartition_view(sp, _Listener()) for sp in range(3)]
    writer = RecordWriter(partition, scs.rebalance(seed=1, adaptive=True).selector(0, 1, 3), 4096, schema=SCHEMA)
    for batch in batches(0, 3000):
        writer.emit(batch)
        writer.flush_all()
        for view in views:  # everyone keeps up
            _drain(view)
    counts = writer.num_records_out
    assert sum(counts) == 3000
    assert max(counts) - min(counts) <= 3000 * 0.1  # spread evenly, a chunk (about 9 rows) at a time
    assert np.all(writer.queued_bytes() <= 4096)


def test_pipelined_exchange_with_a_slow_consumer_sends_it_few_rows():
    from spark_credit_shuffle.runtime.pipelined import run_in_threads

    config = scs.NetworkConfig(segment_size="4kb", buffer_timeout_ms=1)
    slow = Injection(consumer_delay_s=((0, 0.001),))
    inputs = [batches(p, 4000) for p in range(2)]
    plan = ExchangePlan("adaptive", "pipelined", scs.rebalance(seed=1, adaptive=True), 2, 2, 128, config, SCHEMA, slow)
    received, _ = run_in_threads(plan, inputs, timeout_s=60)
    ids = sorted(i for c in received for b in c for i in b.column("id").to_pylist())
    assert ids == list(range(8000))  # every row once
    per_consumer = [sum(b.num_rows for b in c) for c in received]
    # round robin would send it 4000 rows (4 s of sleep); adaptive sends it about what its buffers hold
    assert per_consumer[0] < 8000 * 0.3 < per_consumer[1]


@pytest.mark.spark
def test_adaptive_rebalance_on_spark_keeps_every_row(spark):
    df = spark.range(0, 3000, 1, 2).select(F.col("id"), F.concat(F.lit("v"), F.col("id").cast("string")).alias("s"))
    ex = scs.exchange(df, scs.rebalance(adaptive=True), parallelism=2, mode="pipelined", segment_size="4kb")
    assert_same_rows(ex.df, df)
    rows = collections.Counter()
    for r in ex.metric_rows():
        if r.metric == "numRecordsIn":
            rows[r.subtask] += r.value
    assert sum(rows.values()) == 3000 and set(rows) == {0, 1}


@pytest.mark.spark
def test_slow_consumer_demo_job(spark, capsys):
    spec = importlib.util.spec_from_file_location(
        "slow_consumer_demo", Path(__file__).resolve().parent.parent / "jobs" / "slow_consumer_demo.py"
    )
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)  # type: ignore[union-attr]
    assert demo.main(["--rows", "3000", "--round-robin-rows", "400", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert [line[:5] for line in out.splitlines() if line.startswith("[")] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    headline = json.loads(out.strip().splitlines()[-1])
    assert headline["rows"] == 6000 and headline["round_robin_rows"] == 800 and headline["repeat"] == 1
    assert len(headline["adaptive_shares"]) == 1 and headline["fast_unthrottled_rows_s"] > 0
    assert headline["rows_to_slow_consumer_adaptive"] < 6000 * 0.45, out  # round robin gives it half
    assert spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch") == "10000"  # the session as it was
