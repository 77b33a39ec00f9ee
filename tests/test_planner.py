"""The planner: its numbers are the pools the runtime really allocates, and a topology that cannot fit
fails before any Spark job starts, naming required vs available and the setting to raise."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import functions as F

import spark_credit_shuffle as scs
from spark_credit_shuffle.buffers.pools import NetworkBufferPool
from spark_credit_shuffle.buffers.sizing import UNBOUNDED
from spark_credit_shuffle.cli import main as cli_main
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import ConfigError, InsufficientNetworkBuffersError, PartitionerError
from spark_credit_shuffle.planner import (
    ExchangeSpec,
    Executors,
    plan_network,
    plan_table,
)
from spark_credit_shuffle.runtime.blocking import consume_partition, produce_partition
from spark_credit_shuffle.runtime.exchange_plan import ExchangePlan
from spark_credit_shuffle.runtime.planner_on_spark import check_fits, plan_dataframe

SCHEMA = pa.schema([("id", pa.int64()), ("k", pa.int32()), ("s", pa.string())])


def _batches(producer: int, rows: int = 3000) -> list[pa.RecordBatch]:
    ids = pa.array(range(producer * rows, (producer + 1) * rows), pa.int64())
    keys = pc.cast(pc.divide(ids, 7), pa.int32())
    strings = pc.binary_join_element_wise("row-", pc.cast(ids, pa.string()), "")
    batch = pa.RecordBatch.from_arrays([ids, keys, strings], schema=SCHEMA)
    return [batch.slice(0, rows // 2), batch.slice(rows // 2)]


def _plan(partitioner, producers: int, consumers: int, config: NetworkConfig) -> ExchangePlan:
    return ExchangePlan(
        name="planner-test",
        mode="blocking",
        partitioner=partitioner,
        num_producers=producers,
        num_consumers=consumers,
        max_parallelism=scs.default_max_parallelism(consumers),
        config=config,
        schema=SCHEMA,
    )


def _snapshot(network: NetworkBufferPool) -> dict:
    return {
        "required": network.num_total_required_buffers,
        "unpooled": network.num_unpooled,
        "pools": [(p.min_buffers, p.max_buffers) for p in network.buffer_pools],
    }


def _inspected(batches: list[pa.RecordBatch], network: NetworkBufferPool, seen: list) -> Iterator[pa.RecordBatch]:
    """The task's input; when the task asks for its first batch, its pools are set up: look at them."""
    seen.append(_snapshot(network))
    yield from batches


TOPOLOGIES = [
    pytest.param(scs.key_by("k"), 4, 3, NetworkConfig(), id="hash-4x3"),
    pytest.param(
        scs.rescale(), 2, 5, NetworkConfig(buffers_per_channel=3, floating_buffers_per_gate=4), id="rescale-2x5"
    ),
    pytest.param(scs.broadcast(), 3, 2, NetworkConfig(credit_based=False, segment_size="8kb"), id="broadcast-3x2"),
    pytest.param(scs.key_by("k"), 2, 3, NetworkConfig(sort_shuffle_min_parallelism=1), id="hash-2x3-sort-merge"),
]


@pytest.mark.parametrize("partitioner,producers,consumers,config", TOPOLOGIES)
def test_planner_equals_the_pools_the_blocking_runtime_allocates(partitioner, producers, consumers, config):
    plan = _plan(partitioner, producers, consumers, config)
    network_plan = plan_network(ExchangeSpec(producers, consumers, partitioner, "blocking"), Executors(1, 1), config)
    produce_stage, consume_stage = network_plan.stages
    assert [t.task for t in produce_stage.tasks] == list(range(producers))
    assert [t.task for t in consume_stage.tasks] == list(range(consumers))

    stored: list[pa.RecordBatch] = []
    for p in range(producers):
        network, seen = NetworkBufferPool.from_config(config), []
        stored.extend(produce_partition(_inspected(_batches(p), network, seen), p, plan, network=network))
        planned = produce_stage.tasks[p]
        assert seen[0]["required"] == planned.required == planned.buffers.partition_min
        assert seen[0]["pools"] == [(planned.buffers.partition_min, planned.buffers.partition_max)]
        if config.sort_shuffle_min_parallelism is None:  # hash BLOCKING: min N + 1, unbounded max
            assert planned.buffers.partition_max == UNBOUNDED
        else:  # sort-merge BLOCKING: min 512, max max(512, 4 N)
            assert (planned.buffers.partition_min, planned.buffers.partition_max) == (512, 512)
        assert seen[0]["unpooled"] == 0
        assert network.num_total_required_buffers == 0 and network.num_available == network.total  # all returned

    table = pa.Table.from_batches(stored)
    received = 0
    for c in range(consumers):
        mine = table.filter(pc.equal(table["channel"], c)).to_batches()
        network, seen = NetworkBufferPool.from_config(config), []
        out = list(consume_partition(_inspected(mine, network, seen), c, plan, network=network))
        received += sum(b.num_rows for b in out[:-1])  # the last batch is the metrics row
        planned = consume_stage.tasks[c]
        b = planned.buffers
        assert seen[0]["required"] == planned.required == b.exclusive + b.floating_min
        assert seen[0]["unpooled"] == b.exclusive  # exclusive buffers: unpooled, one set per remote channel
        assert seen[0]["pools"] == [(b.floating_min, b.floating_max)]  # the gate's floating pool
        assert network.num_total_required_buffers == 0 and network.num_available == network.total
    copies = consumers if partitioner.is_broadcast else 1
    assert received == 3000 * producers * copies  # the inspected runs moved all the data


def test_channels_between_tasks_of_one_executor_need_no_exclusive_buffers():
    config = NetworkConfig()
    spec = ExchangeSpec(4, 4, "hash", "pipelined")
    # given tasks 0, 1 on one executor and 2, 3 on another: each reads its own and its neighbour's
    # subpartition through local channels and two through remote ones
    plan = plan_network(spec, Executors(2, 2, "64mb", placement=(0, 0, 1, 1)), config)
    (stage,) = plan.stages
    for task in stage.tasks:
        assert task.channels == 4 and task.remote_channels == 2
        assert task.buffers.exclusive == 2 * config.buffers_per_channel
        assert task.buffers.partition_min == 4 + 1  # N + 1
        assert task.buffers.partition_max == 4 * config.buffers_per_channel + config.floating_buffers_per_gate
        assert (task.buffers.floating_min, task.buffers.floating_max) == (1, 4 * 2 + 8 - 4 * 2)
    assert stage.required_per_executor == 2 * (5 + 4 + 1) and stage.placement == (0, 0, 1, 1)
    # local mode: one executor runs every task, so every channel is local
    (local,) = plan_network(spec, Executors(1, 4), config).stages
    assert [t.remote_channels for t in local.tasks] == [0, 0, 0, 0]
    assert local.required_per_executor == 4 * (5 + 0 + 1)
    # with local_channels="task" only a task's own channel is local, whatever the executors
    (per_task,) = plan_network(spec, Executors(1, 4), config.replace(local_channels="task")).stages
    assert [t.remote_channels for t in per_task.tasks] == [3, 3, 3, 3]
    assert per_task.required_per_executor == 4 * (5 + 6 + 1)


def test_without_a_placement_the_planner_takes_the_one_that_needs_the_most_on_one_executor():
    spec = ExchangeSpec(4, 4, "hash", "pipelined")
    # 2 executors of 4 slots: one executor may run 1 to 4 of the tasks; with k tasks together each needs
    # 5 + 2 * (4 - k) + 1, so k = 3 or 4 (or the 3 left beside a lone task) needs 24 on one executor
    plan = plan_network(spec, Executors(2, 4))
    (stage,) = plan.stages
    assert stage.required_per_executor == 24 == max(k * (5 + 2 * (4 - k) + 1) for k in range(1, 5))
    assert plan.required_per_executor == 24 and plan.fits
    busiest = [t for t, e in zip(stage.tasks, stage.placement) if stage.placement.count(e) == 3]
    assert sum(t.required for t in busiest) == 24
    # every explicit placement of the same stage needs at most that much on its busiest executor
    for placement in [(0, 1, 0, 1), (0, 0, 0, 1), (1, 1, 1, 1), (0, 0, 1, 1)]:
        assert plan_network(spec, Executors(2, 4, placement=placement)).required_per_executor <= 24
    with pytest.raises(ConfigError, match="placement"):
        Executors(2, 2, placement=(0, 0, 0, 1))  # three tasks on a 2-slot executor
    with pytest.raises(ConfigError, match="placement"):
        plan_network(spec, Executors(2, 4, placement=(0, 1)))  # not one executor per task


def test_executor_requirement_is_the_busiest_stage_with_its_heaviest_tasks_together():
    # 2 -> 5 rescale: producers have 3 and 2 subpartitions; consumers read one channel each
    spec = ExchangeSpec(2, 5, "rescale", "blocking")
    one = plan_network(spec, Executors(1, 1))
    two = plan_network(spec, Executors(1, 2))
    produce = [t.required for t in one.stages[0].tasks]
    assert sorted(produce) == [3, 4]
    assert one.required_per_executor == 4 and two.required_per_executor == 7
    # a tighter executor no longer fits, and the error says by how much
    tight = plan_network(spec, Executors(1, 2, network_memory=6 * 32 * 1024))
    assert not tight.fits
    with pytest.raises(InsufficientNetworkBuffersError, match=r"required 7, but only 6 available"):
        tight.raise_if_not_fits()


def test_blocking_partitions_are_hash_sized_unless_sort_merge_sizing_is_chosen():
    # given the default: a blocking producer with N subpartitions reserves N + 1 (a hash blocking partition)
    hash_plan = plan_network(ExchangeSpec(4, 200, "hash", "blocking"), Executors(1, 4))
    assert hash_plan.stages[0].tasks[0].buffers.partition_min == 201
    # when Flink 2.x's sort-merge sizing is chosen: min 512 (sort_shuffle_min_buffers), max max(512, 4 N)
    config = NetworkConfig(sort_shuffle_min_parallelism=1)
    sort_plan = plan_network(ExchangeSpec(4, 200, "hash", "blocking"), Executors(1, 4), config)
    b = sort_plan.stages[0].tasks[0].buffers
    assert (b.partition_min, b.partition_max) == (512, 800)
    # then 4 producers at once take 4 x 512 x 32 KiB = 64 MiB: the default network memory, exactly
    assert sort_plan.required_per_executor == 2048 == config.total_network_buffers and sort_plan.fits
    assert not plan_network(ExchangeSpec(5, 4, "hash", "blocking"), Executors(1, 5), config).fits
    # below the threshold a blocking partition stays a hash one
    small = NetworkConfig(sort_shuffle_min_parallelism=8)
    assert plan_network(ExchangeSpec(2, 4, "hash", "blocking"), config=small).stages[0].tasks[0].required == 5
    with pytest.raises(ConfigError, match="sort_shuffle_min_parallelism"):
        NetworkConfig(sort_shuffle_min_parallelism=0)


def test_chained_exchanges_share_tasks():
    specs = [ExchangeSpec(4, 4, "hash", "blocking"), ExchangeSpec(4, 4, "forward", "pipelined")]
    plan = plan_network(specs, Executors(1, 4), chain=True)
    assert [s.name for s in plan.stages] == ["0:hash-blocking produce", "0:hash-blocking consume + 1:forward-pipelined"]
    task = plan.stages[1].tasks[0]
    assert len(task.parts) == 3  # the blocking gate, the forward partition and the forward gate
    # blocking gate over 4 remote channels + forward partition (N=1) + forward gate whose channel is local
    assert task.required == (4 * 2 + 1) + (1 + 1) + (0 + 1)
    with pytest.raises(ConfigError, match="chain"):
        plan_network([ExchangeSpec(4, 3, "hash", "blocking"), ExchangeSpec(4, 4)], chain=True)


def test_pipelined_stage_needs_a_slot_per_task():
    plan = plan_network(ExchangeSpec(8, 8, "rebalance", "pipelined"), Executors(1, 4))
    assert plan.stages[0].fits_memory and not plan.stages[0].fits_slots and not plan.fits
    assert plan_network(ExchangeSpec(8, 8, "rebalance", "pipelined"), Executors(2, 4)).fits


def test_bad_topologies_are_refused_with_the_setting_named():
    with pytest.raises(PartitionerError):
        ExchangeSpec(4, 3, "forward")
    with pytest.raises(ConfigError, match="partitioner"):
        ExchangeSpec(4, 3, "zigzag")
    with pytest.raises(ConfigError, match="mode"):
        ExchangeSpec(4, 3, "hash", "streaming")
    with pytest.raises(ConfigError, match="slots"):
        Executors(1, 0)
    with pytest.raises(ConfigError, match="max_parallelism"):
        plan_network(ExchangeSpec(2, 300, "hash"), config=NetworkConfig(max_parallelism=128))


def test_table_has_a_row_per_stage_or_task():
    spec = ExchangeSpec(3, 2, "broadcast", "blocking")
    stages = plan_table(spec, Executors(1, 2))
    tasks = plan_table(spec, Executors(1, 2), level="task")
    assert list(stages["stage"]) == ["broadcast-blocking produce", "broadcast-blocking consume"]
    assert len(tasks) == 3 + 2
    assert (tasks["required_bytes"] == tasks["required_buffers"] * 32 * 1024).all()
    assert stages["fits"].all()


def test_cli_plan_prints_a_table_and_a_json_headline(capsys):
    argv = ["plan", "--producers", "4", "--consumers", "4", "--partitioner", "hash", "--mode", "pipelined"]
    argv += ["--executors", "2", "--slots", "4", "--network-memory", "64mb"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    headline = json.loads(out[-1])
    assert headline["fits"] is True
    assert headline["required_buffers_per_executor"] == 24
    assert headline["network_buffers_per_executor"] == 2048
    assert any("hash-pipelined" in line for line in out)

    argv = ["plan", "--producers", "64", "--mode", "pipelined", "--slots", "64", "--network-memory", "4mb"]
    assert cli_main(argv) == 1
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert headline["fits"] is False and headline["required_buffers_per_executor"] > 128

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", "--partitioner", "zigzag"])
    assert exit_info.value.code == 2
    assert "partitioner" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", "--conf", "spark.creditShuffle.nope=1"])
    assert exit_info.value.code == 2
    assert "unknown setting" in capsys.readouterr().err


@pytest.mark.spark
def test_exchange_that_cannot_fit_fails_before_any_spark_job(spark):
    df = spark.range(0, 100, 1, 4).select(F.col("id"), (F.col("id") % 7).cast("int").alias("k"))
    sc = spark.sparkContext
    group = "planner-fails-before-launch"
    sc.setJobGroup(group, "must stay empty")
    try:
        with pytest.raises(InsufficientNetworkBuffersError) as error:
            scs.exchange(df, scs.key_by("k"), parallelism=200, network_memory="2mb")
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
    assert sc.statusTracker().getJobIdsForGroup(group) == []
    e = error.value
    message = str(e)
    assert f"required {e.required}, but only {e.available} available" in message
    assert "spark.creditShuffle.networkMemory" in message and "network_memory" in message
    # the numbers are the planner's: 4 slots of local[4] run the 4 producers of 201 buffers each at once
    assert e.required == 4 * (200 + 1) and e.available == 64
    plan = ExchangePlan("x", "blocking", scs.key_by("k"), 4, 200, 256, NetworkConfig(network_memory="2mb"), SCHEMA)
    with pytest.raises(InsufficientNetworkBuffersError):
        check_fits(plan, spark)


@pytest.mark.spark
def test_sort_merge_sizing_fits_four_slots_in_the_default_network_memory_and_no_less(spark):
    df = spark.range(0, 100, 1, 4).select(F.col("id"), (F.col("id") % 7).cast("int").alias("k"))
    # local[4]: four blocking producers of 512 buffers each are exactly the 2048 buffers of 64 MiB
    ex = scs.exchange(df, scs.key_by("k"), parallelism=4, mode="blocking", sort_shuffle_min_parallelism=1)
    assert ex.plan.config.sort_shuffle_min_buffers == 512
    with pytest.raises(InsufficientNetworkBuffersError) as error:
        scs.exchange(df, scs.key_by("k"), parallelism=4, mode="blocking", sort_shuffle_min_parallelism=1,
                     network_memory="32mb")  # fmt: skip
    assert (error.value.required, error.value.available) == (4 * 512, 1024)


@pytest.mark.spark
def test_plan_as_a_spark_dataframe(any_spark):
    spark = any_spark
    spec = ExchangeSpec(4, 4, "hash", "pipelined")
    frame = plan_dataframe(spark, spec, Executors(2, 4), NetworkConfig())
    rows = frame.collect()
    assert len(rows) == 1 and rows[0]["required_per_executor"] == 24 and rows[0]["fits"] is True
    tasks = plan_dataframe(spark, spec, Executors(2, 4), NetworkConfig(), level="task")
    assert tasks.count() == 4
    (stage,) = plan_network(spec, Executors(2, 4), NetworkConfig()).stages
    assert tasks.agg(F.sum("required_buffers")).first()[0] == sum(t.required for t in stage.tasks)
    assert plan_dataframe(spark, spec).first()["fits"] is True  # the session's executors (local[4, 2]) and conf


PLACEMENTS = [
    pytest.param(scs.key_by("k"), 4, 4, (0, 1, 0, 1), id="hash-4x4-two-executors-round-robin"),
    pytest.param(scs.rescale(), 2, 4, (0, 0, 1, 1), id="rescale-2x4-two-executors"),
    pytest.param(scs.broadcast(), 3, 3, (0, 0, 0), id="broadcast-3x3-one-executor"),
    pytest.param(scs.key_by("k"), 3, 5, (0, 1, 2, 0, 1), id="hash-3x5-three-executors"),
]


@pytest.mark.parametrize("partitioner,producers,consumers,placement", PLACEMENTS)
def test_planner_equals_what_running_pipelined_tasks_reserve_on_shared_executors(
    partitioner, producers, consumers, placement
):
    """Given tasks placed on executors, when the pipelined tasks run (real sockets, one thread each) and have
    connected every channel, then each task's reservation is the planner's for that placement, and so is
    the busiest executor's sum."""
    import threading

    from spark_credit_shuffle.runtime.pipelined import PipelinedTask, _ThreadAllGather

    config = NetworkConfig()
    plan = ExchangePlan("planner-placed", "pipelined", partitioner, producers, consumers, 128, config, SCHEMA, None)
    width = max(producers, consumers)
    count = max(placement) + 1
    slots = max(placement.count(e) for e in set(placement))
    (stage,) = plan_network(
        ExchangeSpec(producers, consumers, partitioner, "pipelined"), Executors(count, slots, placement=placement)
    ).stages
    release = threading.Event()
    seen: dict[int, dict] = {}
    errors: list[BaseException] = []

    def data(p: int) -> Iterator[pa.RecordBatch]:
        first, second = _batches(p, 2000)
        yield first
        release.wait(30)  # producers hold back their last rows until every consumer looked at its pools
        yield second

    gather = _ThreadAllGather(width, 30)

    def run(i: int) -> None:
        task = PipelinedTask(plan, i, b"s" * 32, "127.0.0.1", attempt_id=i, executors=placement)
        try:
            for _ in task.run(data(i) if i < producers else iter([]), gather.all_gather):
                if i not in seen:  # connected: every channel set up, none finished yet
                    seen[i] = _snapshot(task.wiring.network)
                    if len(seen) == width:
                        release.set()
        except BaseException as exc:
            errors.append(exc)
            gather.abort()
            release.set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(width)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(seen) == width
    for planned in stage.tasks:
        b, got = planned.buffers, seen[planned.task]
        assert got["required"] == planned.required
        assert got["unpooled"] == b.exclusive  # one set of exclusive buffers per remote channel only
        pools = [(b.partition_min, b.partition_max)] if planned.task < producers else []
        pools += [(b.floating_min, b.floating_max)] if planned.task < consumers else []
        assert got["pools"] == pools
    per_executor = [sum(seen[i]["required"] for i in range(width) if placement[i] == e) for e in range(count)]
    assert stage.required_per_executor == max(per_executor)


@pytest.mark.parametrize(
    "partitioner,producers,consumers",
    [(scs.key_by("k"), 4, 4), (scs.rescale(), 3, 5), (scs.broadcast(), 2, 3)],
    ids=["hash-4x4", "rescale-3x5", "broadcast-2x3"],
)
def test_planner_equals_the_pools_a_pipelined_task_sets_up(partitioner, producers, consumers):
    from spark_credit_shuffle.runtime.pipelined import PipelinedTask

    config = NetworkConfig()
    plan = ExchangePlan("planner-pipelined", "pipelined", partitioner, producers, consumers, 128, config, SCHEMA, None)
    width = max(producers, consumers)  # every task on an executor of its own: only its own channel is local
    spec = ExchangeSpec(producers, consumers, partitioner, "pipelined")
    (stage,) = plan_network(spec, Executors(width, 1), config=config).stages
    assert len(stage.tasks) == width and len(set(stage.placement)) == width
    for planned in stage.tasks:
        task = PipelinedTask(plan, planned.task, b"s" * 32, "127.0.0.1").wiring  # its pools, partition and gate
        try:
            b = planned.buffers
            pools = [(p.min_buffers, p.max_buffers) for p in task.network.buffer_pools]
            expected = []
            if task.partition is not None:
                expected.append((b.partition_min, b.partition_max))
            if task.gate is not None:
                expected.append((b.floating_min, b.floating_max))
                # exclusive buffers are requested when the channels connect: one set per remote channel
                assert task.gate.spec.exclusive_total == b.exclusive
                assert task.gate.spec.num_remote_channels == planned.remote_channels
            assert pools == expected
            assert task.network.num_total_required_buffers + b.exclusive == planned.required
        finally:
            task.close()


def test_planner_refuses_a_parallelism_above_32768():
    # given an exchange of 40,000 consumers; when it is planned; then a ConfigError names it
    with pytest.raises(ConfigError, match=r"40000.*'consumers'.*Operator parallelism not within bounds"):
        plan_network(ExchangeSpec(2, 40000, "rebalance"), Executors(1, 1), NetworkConfig())
