"""Per-buffer compression of the blocking shuffle (Flink's BufferCompressor / BufferDecompressor): data buffers
compressed with LZ4 or ZSTD before Spark's shuffle stores them, decompressed by their consumer; every row
arrives once; the metrics tell the stored bytes from the raw ones; bad compressed payloads are typed errors."""

from __future__ import annotations

import random

import pytest
from exchange_helpers import SCHEMA as BLOCKING_SCHEMA
from exchange_helpers import producer_batches, run_blocking
from pyspark.sql import functions as F
from spark_helpers import assert_same_rows

import spark_credit_shuffle as scs
from spark_credit_shuffle.buffers.compression import BufferCompressor, BufferDecompressor
from spark_credit_shuffle.errors import BufferDecodeError, ConfigError
from spark_credit_shuffle.metrics import PRODUCER
from spark_credit_shuffle.runtime.exchange_plan import ExchangePlan


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_a_buffer_round_trips_and_an_incompressible_one_stays_as_it_is(codec):
    payload = b"".join(i.to_bytes(8, "little") for i in range(4000))  # 32,000 bytes of small integers
    compressed = BufferCompressor(codec).compress(payload)
    assert compressed is not None and len(compressed) < 0.6 * len(payload)
    assert BufferDecompressor(codec, 32768).decompress(compressed).to_pybytes() == payload
    noise = random.Random(1).randbytes(4096)
    assert BufferCompressor(codec).compress(noise) is None  # not smaller: stored as it is


def test_compressed_payloads_from_the_wire_are_checked():
    decompressor = BufferDecompressor("lz4", 4096)
    good = BufferCompressor("lz4").compress(b"a" * 4000)
    assert good is not None
    with pytest.raises(BufferDecodeError, match="more than a segment"):
        BufferDecompressor("lz4", 1024).decompress(good)
    with pytest.raises(BufferDecodeError, match=r"does not decompress|declares"):
        decompressor.decompress(good[:4] + b"\x00" * 20)
    with pytest.raises(BufferDecodeError, match="no length"):
        decompressor.decompress(b"\x01")
    with pytest.raises(ConfigError, match="compression_codec"):
        scs.NetworkConfig(compression_codec="gzip")


@pytest.mark.parametrize("codec", ["lz4", "zstd", "none"])
def test_blocking_exchange_compresses_each_data_buffer_and_its_consumers_decompress_it(codec):
    config = scs.NetworkConfig(segment_size=4096, blocking_shuffle_compression=True, compression_codec=codec)
    plan = ExchangePlan("test", "blocking", scs.rebalance(seed=2), 3, 2, 128, config, BLOCKING_SCHEMA)
    batches = {p: producer_batches(p, 3000, 0) for p in range(3)}
    outputs = run_blocking(plan, batches)
    ids = sorted(i for data, _ in outputs.values() for i in data.column("id").to_pylist())
    assert ids == sorted(i for p in range(3) for b in batches[p] for i in b.column("id").to_pylist())
    producer_rows = [r for _, rows in outputs.values() for r in rows if r["side"] == PRODUCER]
    bytes_out = sum(r["value"] for r in producer_rows if r["metric"] == "numBytesOut")
    stored = sum(r["value"] for r in producer_rows if r["metric"] == "numBytesStored")
    if codec == "none":
        assert stored >= bytes_out  # raw buffers, and the events besides
    else:
        assert 0 < stored < 0.8 * bytes_out  # numBytesOut counts raw buffers, numBytesStored what Spark got


def test_compressed_blocking_exchange_on_spark(spark):
    df = spark.range(0, 20_000, 1, 3).select(F.col("id"), (F.col("id") % 13).cast("int").alias("k"))
    ex = scs.exchange(
        df, scs.key_by("k"), parallelism=3, mode="blocking", blocking_shuffle_compression=True, compression_codec="zstd"
    )
    assert_same_rows(ex.df, df)
    stored = ex.metrics().where("metric = 'numBytesStored'").agg(F.sum("value")).first()[0]
    raw = ex.metrics().where("metric = 'numBytesOut'").agg(F.sum("value")).first()[0]
    assert 0 < stored < raw
