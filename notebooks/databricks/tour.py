# Databricks notebook source
# MAGIC %pip install "spark-credit-shuffle[plot]"

# COMMAND ----------

dbutils.library.restartPython()  # Databricks: the installed package is seen after a restart

# COMMAND ----------

# MAGIC %md
# MAGIC # A tour of spark_credit_shuffle
# MAGIC
# MAGIC Apache Flink's network stack, run as a data exchange between Spark tasks: rows go to the consumer
# MAGIC subtask Flink would pick, travel as network buffers under credit-based flow control, and leave
# MAGIC Flink-named metrics behind. This tour shows Flink's key groups, an exchange, its metrics, the
# MAGIC network-memory planner and the pictures. Small data, local Spark: it runs in a minute.

# COMMAND ----------

import pandas as pd
import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import spark_credit_shuffle as scs
from spark_credit_shuffle import plot

spark = SparkSession.builder.appName("spark_credit_shuffle tour").getOrCreate()
print("Spark", spark.version, "| spark_credit_shuffle", scs.__version__)

# COMMAND ----------

# MAGIC %md
# MAGIC ## Key groups
# MAGIC
# MAGIC `key_by` hashes a key the way Flink does (Java `hashCode`, then murmur) into one of
# MAGIC `max_parallelism` key groups; each consumer subtask owns a contiguous range of key groups.
# MAGIC The numbers below are bit-exact with Flink's `KeyGroupRangeAssignment`.

# COMMAND ----------

keys = pa.array([0, 1, 2, 42, -1, 1_000_000], pa.int32())
pd.DataFrame(
    {
        "key": keys.to_pylist(),
        "key group (of 128)": scs.key_groups(keys, 128),
        "subtask (parallelism 4)": scs.key_group_channels(keys, 4, 128),
    }
)

# COMMAND ----------

[scs.key_group_range(operator_index=i, parallelism=4, max_parallelism=128) for i in range(4)]

# COMMAND ----------

# MAGIC %md
# MAGIC ## The channel of each row
# MAGIC
# MAGIC The input's partitions are the producer subtasks. `with_channel` adds the consumer subtask each
# MAGIC row goes to, without moving anything.

# COMMAND ----------

events = spark.range(0, 20_000, 1, 4).select(
    (F.col("id") % 500).cast("long").alias("user_id"),
    F.col("id").cast("int").alias("seq"),
    F.concat(F.lit("event-"), F.col("id").cast("string")).alias("payload"),
)
scs.with_channel(events, scs.key_by("user_id"), parallelism=4).groupBy("channel").count().orderBy("channel").show()

# COMMAND ----------

# MAGIC %md
# MAGIC ## An exchange
# MAGIC
# MAGIC `exchange` moves the rows: producers write them through Flink's RecordWriter into network
# MAGIC buffers (Arrow record batches of at most one segment, 32 KiB by default), and consumers read them
# MAGIC through input channels with exclusive and floating buffers, credits and backlog. Partition *i*
# MAGIC of `ex.df` holds exactly what consumer subtask *i* received. Blocking mode (Flink's batch
# MAGIC exchange) runs producers and consumers in two Spark stages.

# COMMAND ----------

ex = scs.exchange(events, scs.key_by("user_id"), parallelism=4, mode="blocking", metrics_sample_interval_ms=5)
with ex.labelled():  # the Spark jobs carry the exchange's name in the Spark UI
    per_subtask = ex.df.groupBy(F.spark_partition_id().alias("subtask")).count().orderBy("subtask").toPandas()
per_subtask.set_index("subtask")

# COMMAND ----------

# MAGIC %md
# MAGIC ## Its metrics
# MAGIC
# MAGIC One long table, Flink's names: per producer subtask and subpartition `numRecordsOut`,
# MAGIC `numBytesOut`, `numBuffersOut`; per consumer subtask and channel `numRecordsIn`, `numBytesIn`,
# MAGIC `numBuffersIn`; gauges such as `outPoolUsage` and `inPoolUsage` as max and mean.

# COMMAND ----------

metrics = ex.metrics()
(
    metrics.where(F.col("stat") == "total")
    .groupBy("side", "subtask")
    .pivot("metric")
    .agg(F.sum("value"))
    .orderBy("side", "subtask")
    .toPandas()
)

# COMMAND ----------

metrics.where(F.col("stat") == "max").groupBy("side", "metric").agg(F.max("value").alias("max")).toPandas()

# COMMAND ----------

# MAGIC %md
# MAGIC ## Pictures
# MAGIC
# MAGIC Rows per consumer subtask, stacked by the producer they came from; then the timeline: every
# MAGIC `metrics_sample_interval_ms` each task sampled its pool usage, backlog and credits.

# COMMAND ----------

plot.plot_metrics(ex, "numRecordsIn", side="consumer")

# COMMAND ----------

plot.plot_timeline(ex, ["backlog", "inPoolUsage", "credit", "numRecordsInPerSecond"])

# COMMAND ----------

# MAGIC %md
# MAGIC ## How much network memory?
# MAGIC
# MAGIC The planner applies Flink's pool sizing to a topology before anything runs. Every `exchange`
# MAGIC runs the same check and fails before launch when the executors' network memory is too small.

# COMMAND ----------

spec = scs.ExchangeSpec(producers=4, consumers=4, partitioner="hash", mode="pipelined")
network_plan = scs.plan_network(spec, scs.Executors(count=2, slots=4, network_memory="64mb"))
print(network_plan.summary())
network_plan.tasks()[["task", "channels", "remote_channels", "partition_min", "exclusive", "required_buffers"]]

# COMMAND ----------

try:
    scs.exchange(events, scs.key_by("user_id"), parallelism=300, network_memory="2mb")
except scs.InsufficientNetworkBuffersError as error:
    print(error)
