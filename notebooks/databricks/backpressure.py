# Databricks notebook source
# MAGIC %pip install "spark-credit-shuffle[plot]"

# COMMAND ----------

dbutils.library.restartPython()  # Databricks: the installed package is seen after a restart

# COMMAND ----------

# MAGIC %md
# MAGIC # Where backpressure starts: one slow consumer
# MAGIC
# MAGIC A consumer subtask that reads slower than its producers write fills, in this order, its own
# MAGIC buffers (exclusive and floating), then the queue of the subpartition that feeds it at every
# MAGIC producer, until the producer's buffer pool runs dry: the producer is back-pressured and stops
# MAGIC taking input. With credit-based flow control only the slow channel stalls; the other channels of
# MAGIC the same connections keep flowing. This notebook makes consumer subtask 0 sleep 0.5 ms per row
# MAGIC and looks at the metrics, then lets adaptive rebalance route around it, then tells the same story
# MAGIC on a virtual clock.

# COMMAND ----------

import time

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import spark_credit_shuffle as scs
from spark_credit_shuffle import plot
from spark_credit_shuffle.simulation import simulate

spark = SparkSession.builder.appName("spark_credit_shuffle backpressure").getOrCreate()

# Pipelined mode (Flink's streaming exchange: every subtask at once in one barrier stage, real
# backpressure over TCP) needs a task slot per subtask. An exchange checks that when it is planned, before
# any Spark job (num_producers=2 states the producer count, so not even a count runs): with fewer than 2
# slots this notebook falls back to blocking mode.
try:
    scs.exchange(spark.range(2), scs.rebalance(), parallelism=2, mode="pipelined", num_producers=2)
    MODE = "pipelined"
except scs.InsufficientSlotsError as error:
    print(error)
    MODE = "blocking"
print(f"this notebook runs the exchange in {MODE} mode")

# COMMAND ----------

# MAGIC %md
# MAGIC ## The data and the two runs
# MAGIC
# MAGIC 4,000 rows of about 200 bytes from 2 producer subtasks, round robin (`rebalance`) to 2 consumer
# MAGIC subtasks, with small (4 KiB) network buffers so that the buffers fill quickly. The second run
# MAGIC chains a step into consumer subtask 0's task that sleeps 0.5 ms per row it receives
# MAGIC (`after=scs.map_in_pandas(...)`, as Flink chains an operator after an exchange):
# MAGIC its 2,000 rows take at least 1 s.

# COMMAND ----------

# Backpressure acts between input batches (a producer takes its next batch only when its pool has a
# buffer free), so feed the exchange small Arrow batches.
spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
rows = spark.range(0, 4000, 1, 2).select(
    F.col("id"), F.concat(F.lit("payload-"), F.repeat(F.lit("x"), 190), F.col("id").cast("string")).alias("payload")
)
settings = {"segment_size": "4kb", "metrics_sample_interval_ms": 10}


def slowed(seconds_per_row, schema):
    """A step chained into the consumer tasks (Flink's operator chaining): it sleeps per row on consumer 0. Its time
    is the consumer's busy time, and while it sleeps the consumer returns no credit: its producers wait."""

    def slow_step(frames):
        from pyspark import TaskContext

        mine = TaskContext.get().partitionId() == 0
        for frame in frames:
            if mine:
                time.sleep(seconds_per_row * len(frame))
            yield frame

    return scs.map_in_pandas(slow_step, schema)


def run(after=None):
    ex = scs.exchange(rows, scs.rebalance(seed=7), parallelism=2, mode=MODE, after=after, **settings)
    started = time.perf_counter()
    with ex.labelled():
        count = ex.df.count()
    return ex, count, time.perf_counter() - started


run()  # the first exchange starts Spark's Python workers: leave it out of the comparison
fast, fast_count, fast_seconds = run()
slow, slow_count, slow_seconds = run(slowed(0.0005, rows.schema))
print(f"no delay:          {fast_count} rows in {fast_seconds:.2f} s")
print(f"consumer 0 slowed: {slow_count} rows in {slow_seconds:.2f} s")

# COMMAND ----------

# MAGIC %md
# MAGIC ## What the metrics say
# MAGIC
# MAGIC Rows per consumer are the same in both runs (round robin does not look at who is slow). Flink's
# MAGIC signals of backpressure are on the producer side: `outPoolUsage` (share of the producer's buffer
# MAGIC pool in use) and, in pipelined mode, `backPressuredTimeMsPerSecond` (time spent waiting for a
# MAGIC buffer); on the consumer side `inPoolUsage`.

# COMMAND ----------


def signals(ex, label):
    m = ex.metrics()
    picked = m.where(
        F.col("metric").isin(
            "numRecordsIn", "outPoolUsage", "inPoolUsage", "backPressuredTimeMsPerSecond", "busyTimeMsPerSecond"
        )
        & F.col("stat").isin("total", "max", "mean")
        & ~((F.col("metric").isin("outPoolUsage", "inPoolUsage")) & (F.col("stat") == "mean"))
    )
    table = picked.groupBy("side", "subtask").pivot("metric").agg(F.sum("value")).orderBy("side", "subtask")
    return table.toPandas().assign(run=label).set_index(["run", "side", "subtask"])


signals(fast, "no delay").combine_first(signals(slow, "consumer 0 slowed"))

# COMMAND ----------

plot.plot_metrics(slow, "outPoolUsage", stat="max", side="producer", title="producers' buffer pool in use (max)")

# COMMAND ----------

# MAGIC %md
# MAGIC How to read it: with consumer 0 slowed, consumer 0 is busy all the time while consumer 1 idles
# MAGIC (low `busyTimeMsPerSecond`) although it has nothing to do with the delay: every producer sends
# MAGIC half its rows to consumer 0, fills that subpartition and waits (`backPressuredTimeMsPerSecond`
# MAGIC near 1000), so consumer 1 starves. Producers wait in the run without delay as well when the
# MAGIC consumers, which turn Arrow batches back into Spark rows, are the slower side of the exchange.

# COMMAND ----------

# MAGIC %md
# MAGIC ## Over time
# MAGIC
# MAGIC Every `metrics_sample_interval_ms` (10 ms here) each task samples its gauges; in pipelined mode the
# MAGIC task's timer thread does it on time, whether data moves or not. Producers: pool usage, whether they
# MAGIC are back-pressured and for how many ms per second, and per subpartition its queue and the credit its
# MAGIC consumer granted; consumers: their buffer usage and, per channel, the credit they announced. Credit
# MAGIC exists only on channels between executors: in local mode every task runs on one executor, so every
# MAGIC channel is local, as between the tasks of one Flink TaskManager, and the producers' pools alone hold
# MAGIC the slow consumer back (its buffers are theirs until it recycles them). With
# MAGIC consumer 0 slowed, every producer's queue towards consumer 0 fills up to its limit and stays there,
# MAGIC its pool runs dry and it waits (`backPressuredTimeMsPerSecond` near 1000) while the queues towards
# MAGIC consumer 1 stay short.

# COMMAND ----------

timeline = slow.timeline_rows()
present = {r.metric for r in timeline}
wanted = ["outPoolUsage", "backPressuredTimeMsPerSecond", "inPoolUsage", "credit", "numRecordsInPerSecond"]
display(plot.plot_timeline(timeline, [m for m in wanted if m in present], title=f"consumer 0 slowed ({MODE} mode)"))
if "outputQueueLength" in present:  # pipelined mode: each producer's queue per consumer
    display(
        plot.plot_timeline(
            timeline,
            ["outputQueueLength"],
            side="producer",
            per_channel=True,
            title="buffers queued at each producer, per consumer",
        )
    )

# COMMAND ----------

# MAGIC %md
# MAGIC ## Where it starts, and credits on remote channels
# MAGIC
# MAGIC `summary()` gives each subtask Flink's back-pressure status (`OK` up to 10% of its time back-pressured, `LOW`
# MAGIC up to 50%, `HIGH` above) and `diagnose()` says where the backpressure starts: the busy consumer that the
# MAGIC back-pressured producers send to. The run above had local channels only; with `local_channels="task"` every
# MAGIC channel between two tasks is remote, as between two executors: the slow consumer stops granting credit on its
# MAGIC channels (each producer's `credit` towards consumer 0 drops to 0) while the channels towards consumer 1 keep
# MAGIC theirs.

# COMMAND ----------

display(slow.summary().toPandas())
print(slow.diagnose())
if MODE == "pipelined":
    remote = scs.exchange(
        rows,
        scs.rebalance(seed=7),
        parallelism=2,
        mode=MODE,
        after=slowed(0.0005, rows.schema),
        local_channels="task",
        **settings,
    )
    remote.df.count()
    print("remote channels:", remote.diagnose())
    display(
        plot.plot_timeline(
            remote, ["credit"], side="producer", per_channel=True, title="credit per channel, remote channels"
        )
    )

# COMMAND ----------

# MAGIC %md
# MAGIC ## Adaptive rebalance
# MAGIC
# MAGIC `rebalance(adaptive=True)` is Flink 2.x's adaptive partitioner: each small chunk of rows (a quarter
# MAGIC of a segment) goes to the channel with the fewest bytes queued among the next `max_traverse` (4)
# MAGIC channels. The slow consumer now gets only what its buffers hold; the other one takes the rest at
# MAGIC its own pace. (In pipelined mode; a blocking exchange has no queues to look at and stays round robin.)

# COMMAND ----------


def rows_and_rate(ex):
    """Rows each consumer received and its rate over its life (busy + idle + back-pressured time)."""
    rows, life = {}, {}
    for r in ex.metric_rows():
        if r.side == "consumer" and r.metric == "numRecordsIn":
            rows[r.subtask] = rows.get(r.subtask, 0) + int(r.value)
        if r.side == "consumer" and r.metric.startswith("accumulate") and r.metric.endswith("TimeMs"):
            life[r.subtask] = life.get(r.subtask, 0.0) + r.value / 1000
    return {c: (rows[c], round(rows[c] / life[c]) if life.get(c) else None) for c in sorted(rows)}


adaptive = scs.exchange(
    rows,
    scs.rebalance(seed=7, adaptive=True),
    parallelism=2,
    mode=MODE,
    after=slowed(0.0005, rows.schema),
    **settings,
)
with adaptive.labelled():
    adaptive.df.count()
print("consumer: (rows, rows per second)")
print("round robin, consumer 0 slowed:", rows_and_rate(slow))
print("adaptive,    consumer 0 slowed:", rows_and_rate(adaptive))

# COMMAND ----------

# MAGIC %md
# MAGIC ## The same on a virtual clock
# MAGIC
# MAGIC The protocol core also runs on virtual time (deterministic, no Spark): for one virtual second,
# MAGIC one producer writes up to 20 MB/s round robin to two consumers, consumer 0 reading 1 MB/s. Its
# MAGIC subpartition fills up to `max_buffers_per_channel` (10), the pool turns unavailable, and the
# MAGIC producer is back-pressured: consumer 1, which could read 20 MB/s, gets little more than
# MAGIC consumer 0. Round robin is blind to who is slow.

# COMMAND ----------

MB = 1_000_000
report = simulate(
    scs.NetworkConfig(),
    num_producers=1,
    num_consumers=2,
    producer_rate=20 * MB,
    consumer_rate=[1 * MB, 20 * MB],
    duration=1.0,
    sample_interval=0.02,
    bandwidth=100 * MB,
)
throughput = [report.value("consumer", c, "numBytesInPerSecond", stat="mean") / MB for c in (0, 1)]
back_pressured = report.value("producer", 0, "accumulateBackPressuredTimeMs") / 1000 / report.window
print(
    f"consumer 0: {throughput[0]:.2f} MB/s, consumer 1: {throughput[1]:.2f}"
    f" MB/s, producer back-pressured {back_pressured:.0%} of the time"
)
plot.plot_timeline(
    plot.timeline_from_simulation(report),
    ["outPoolUsage", "isBackPressured", "backlog", "inPoolUsage"],
    title="one slow consumer behind round robin (virtual clock)",
    xlabel="virtual seconds",
)

# COMMAND ----------

# MAGIC %md
# MAGIC ## Checkpoint barriers: alignment behind the slow consumer
# MAGIC
# MAGIC With `checkpoint_interval_ms` set, every producer injects a checkpoint barrier into each of its
# MAGIC subpartitions (Flink's `execution.checkpointing.interval`). **Aligned** barriers queue behind the data, and
# MAGIC a consumer blocks each channel that delivered one until every channel did; **unaligned** barriers
# MAGIC (`unaligned_checkpoints=True`) overtake the queued buffers as priority events, and the consumer counts
# MAGIC the buffers they overtook as channel state. `ex.checkpoints()` lists what each consumer subtask aligned;
# MAGIC the alignment time is Flink's `checkpointAlignmentTime` (first barrier to last). On the virtual clock the
# MAGIC same aligned checkpoints run with and without credits, on a 10 Gbit/s link with 1 MiB of socket buffers:
# MAGIC without credits the sender writes whatever it has into the shared connection, the slow receiver's
# MAGIC floating buffers run out, it stops reading the whole connection, and the barriers queue behind what the
# MAGIC socket buffers hold; with credits only what the receiver has buffers for is on the wire.

# COMMAND ----------

# a hot key: every row of producer 0 goes to consumer 0, which sleeps 30 us per row; 40,000 rows, many
# times what the buffers in flight hold, keep the producers back-pressured through many checkpoint intervals
hot = scs.key_group_channels(pa.array(range(100), pa.int32()), 2, scs.default_max_parallelism(2)).tolist().index(0)
keyed = spark.range(0, 40000, 1, 2).select(
    F.col("id"), F.when(F.col("id") < 20000, F.lit(hot)).otherwise(F.col("id") % 31).cast("int").alias("k")
)
alignment = {}
for label, unaligned in (("aligned", False), ("unaligned", True)):
    ex = scs.exchange(
        keyed,
        scs.key_by("k"),
        parallelism=2,
        mode=MODE,
        after=slowed(0.00003, keyed.schema),
        segment_size="4kb",
        checkpoint_interval_ms=50,
        unaligned_checkpoints=unaligned,
    )
    ex.df.count()
    times = [c.alignment_time_ms for c in ex.checkpoint_records() if c.subtask == 0]
    mean = alignment[f"spark {label}"] = sum(times) / len(times) if times else 0.0
    print(f"{label}: consumer 0 completed {len(times)} checkpoints, mean alignment {mean:.2f} ms")
display(ex.checkpoints().limit(5).toPandas())

for credit in (True, False):
    report = simulate(
        scs.NetworkConfig(credit_based=credit, checkpoint_interval_ms=100),
        num_producers=4,
        num_consumers=4,
        producer_rate=[2 * MB, 3 * MB, 4 * MB, 5 * MB],
        consumer_rate=[0.5 * MB, 8 * MB, 8 * MB, 8 * MB],
        duration=20.0,
        producer_hosts=[0, 1, 2, 3],
        consumer_hosts=[4, 4, 5, 5],
        latency=50e-6,
        bandwidth=1.25e9,
        socket_buffer_bytes=1 << 20,
    )
    times = [c.alignment_time_ms for c in report.checkpoint_records(0)]
    label = "credits" if credit else "no credits"
    alignment[f"virtual, {label}"] = sum(times) / len(times) if times else 0.0
    print(f"virtual clock, aligned, {label}: consumer 0's mean alignment {alignment[f'virtual, {label}']:.2f} ms")
plot.bar_chart(
    list(alignment),
    {"mean checkpointAlignmentTime": list(alignment.values())},
    ylabel="ms per checkpoint",
    title="alignment behind one slow consumer",
)

# COMMAND ----------

# MAGIC %md
# MAGIC ## Buffer debloating: less in flight behind the slow consumer
# MAGIC
# MAGIC An aligned barrier waits behind every buffer queued for the slow consumer, at the producers and at the
# MAGIC consumer. With `buffer_debloat_enabled=True` (Flink's `taskmanager.network.memory.buffer-debloat.enabled`,
# MAGIC off by default) each consumer measures its throughput and every `buffer_debloat_period_ms` asks its
# MAGIC producers for buffers of the size at which the buffers it has in use hold `buffer_debloat_target_ms` of
# MAGIC data (`NewBufferSize`); they cut their next buffers at that size. On the virtual clock, the exchange above
# MAGIC with aligned checkpoints every 100 ms, debloating off and to 100 ms: the slow consumer's checkpoint start
# MAGIC delay (trigger to its first barrier) and the fast consumers' throughput, both over the run's second half,
# MAGIC once the size settled. Round robin binds the fast consumers to the slow one's pace either way; debloating
# MAGIC shrinks what waits ahead of the barrier. (The README's Buffer debloating section has longer runs and both
# MAGIC targets, 1 s and 100 ms.)

# COMMAND ----------


def debloat_run(target_ms, duration=16.0):
    """Consumer 0's median start delay (ms) and the fast consumers' mean throughput (bytes/s), second half."""
    report = simulate(
        scs.NetworkConfig(
            checkpoint_interval_ms=100,
            buffer_debloat_enabled=target_ms is not None,
            buffer_debloat_target_ms=target_ms or 1000,
        ),
        num_producers=4,
        num_consumers=4,
        producer_rate=[2 * MB, 3 * MB, 4 * MB, 5 * MB],
        consumer_rate=[0.5 * MB, 8 * MB, 8 * MB, 8 * MB],
        duration=duration,
        producer_hosts=[0, 1, 2, 3],
        consumer_hosts=[4, 4, 5, 5],
        latency=50e-6,
        bandwidth=1.25e9,
        socket_buffer_bytes=1 << 20,
        sample_interval=duration / 2,
    )
    late = sorted(c.start_delay_ms for c in report.checkpoint_records(0) if c.end_ms > duration / 2 * 1e3)
    half = {c: report.value_at("consumer", c, "numBytesIn", duration / 2) for c in (1, 2, 3)}
    fast = sum(report.value("consumer", c, "numBytesIn") - half[c] for c in (1, 2, 3)) / 3 / (duration / 2)
    return late[len(late) // 2], fast


debloat = {label: debloat_run(target) for label, target in (("off", None), ("100 ms", 100))}
for label, (delay, fast) in debloat.items():
    print(
        f"debloating {label}: consumer 0's median checkpoint start delay {delay:.0f} ms, fast consumers "
        f"{fast / MB:.2f} MB/s ({fast / debloat['off'][1]:.3f}x of off)"
    )
plot.bar_chart(
    [f"debloating {label}" for label in debloat],
    {"median checkpointStartDelay": [delay for delay, _ in debloat.values()]},
    ylabel="ms",
    title="start delay of the slow consumer's aligned checkpoints (virtual clock)",
)
