"""What people read: the command's help and errors ("did you mean"), arguments called arguments, the summary's
narrow view, counts as integers, and one colour per subtask in the timeline's panels."""

from __future__ import annotations

import argparse

import pytest

import spark_credit_shuffle as scs
from spark_credit_shuffle.cli import PROG, build_parser, choice
from spark_credit_shuffle.cli import main as cli_main
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.diagnosis import SUMMARY_DDL, SUMMARY_VIEW_DDL
from spark_credit_shuffle.errors import ConfigError
from spark_credit_shuffle.metrics import MetricRow, is_count, readable_metrics, rows_to_pandas
from spark_credit_shuffle.planner import ExchangeSpec

# -- "did you mean" for every enumerated setting and argument ----------------------------------------------


@pytest.mark.parametrize(
    ("setting", "typo", "meant"),
    [
        ("compression_codec", "lz5", "lz4"),
        ("compression_codec", "zstdd", "zstd"),
        ("ssl", "auot", "auto"),
        ("local_channels", "exeutor", "executor"),
        ("address_exchange", "allgathr", "allgather"),
        ("unaligned_checkpoints", "ture", "true"),
        ("credit_based", "flase", "false"),
    ],
)
def test_a_misspelt_word_of_a_setting_gets_did_you_mean(setting, typo, meant):
    with pytest.raises(ConfigError) as info:
        NetworkConfig(**{setting: typo})
    assert info.value.nearest == meant and info.value.kind == "setting"
    assert str(info.value).startswith(f"invalid value {typo!r} for setting '{setting}'")
    assert str(info.value).endswith(f"; did you mean {meant!r}?")


def test_a_conf_value_names_its_key_and_the_word_meant():
    with pytest.raises(ConfigError) as info:
        NetworkConfig.from_conf({"spark.creditShuffle.compressionCodec": "zsdt"})
    message = str(info.value)
    assert "setting 'compression_codec' (spark.creditShuffle.compressionCodec)" in message
    assert message.endswith("did you mean 'zstd'?")


def test_a_word_far_from_every_choice_gets_no_guess():
    with pytest.raises(ConfigError) as info:
        NetworkConfig(compression_codec="snappy")
    assert info.value.nearest is None and "did you mean" not in str(info.value)


def test_planner_arguments_are_arguments_with_did_you_mean_and_the_api_default_mode():
    assert ExchangeSpec(2, 2).mode == "blocking"  # as exchange()'s default
    with pytest.raises(ConfigError, match=r"argument 'mode'.*did you mean 'pipelined'\?$"):
        ExchangeSpec(2, 2, mode="pipelnied")
    with pytest.raises(ConfigError, match=r"argument 'partitioner'.*did you mean 'rebalance'\?$"):
        ExchangeSpec(2, 2, partitioner="rebalanse")
    with pytest.raises(ConfigError, match=r"argument 'parallelism'"):
        NetworkConfig().resolve_max_parallelism(0)


def test_choice_takes_any_case_and_names_the_word_meant():
    mode = choice("blocking", "pipelined")
    assert mode("Pipelined") == "pipelined"
    with pytest.raises(
        argparse.ArgumentTypeError, match=r"allowed is 'blocking', 'pipelined'; did you mean 'blocking'\?"
    ):
        mode("bloking")
    with pytest.raises(argparse.ArgumentTypeError) as info:
        mode("streaming")
    assert "did you mean" not in str(info.value)


# -- the command ------------------------------------------------------------------------------------------


def test_help_is_plain_text_under_the_installed_name(capsys):
    for argv in (["--help"], ["plan", "--help"]):
        with pytest.raises(SystemExit) as info:
            cli_main(argv)
        assert info.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: {PROG}")
        assert "``" not in text and "python -m" not in text and ":func:" not in text


def test_the_command_defaults_to_the_api_mode_and_guesses_misspelt_words(capsys):
    assert build_parser().parse_args(["plan"]).mode == "blocking"
    assert cli_main(["plan", "--producers", "2"]) == 0
    assert "blocking" in capsys.readouterr().out
    for argv, meant in (
        (["plan", "--mode", "pipelind"], "pipelined"),
        (["plan", "--partitioner", "rebalanse"], "rebalance"),
        (["plan", "--conf", "compression_codec=lz5"], "lz4"),
    ):
        with pytest.raises(SystemExit) as info:
            cli_main(argv)
        error = capsys.readouterr().err
        assert info.value.code == 2 and f"{PROG} plan: error:" in error, error
        assert error.rstrip().endswith(f"did you mean '{meant}'?"), error


# -- counts as integers -----------------------------------------------------------------------------------


def test_readable_metrics_show_counts_as_integers_and_channels_as_integers():
    rows = [
        MetricRow("producer", 0, 1, "numRecordsOut", "total", 56.0),
        MetricRow("producer", 0, None, "numBytesOut", "total", 123456.0),
        MetricRow("producer", 0, None, "outPoolUsage", "max", 0.123456),
        MetricRow("consumer", 1, None, "accumulateBusyTimeMs", "total", 12.3456),
    ]
    frame = rows_to_pandas(rows)
    assert frame["value"].dtype == "float64"  # the metrics' own column: a double, for code
    readable = readable_metrics(frame)
    assert readable["value"].tolist() == [56, 123456, 0.123, 12.346]
    assert [type(v) for v in readable["value"]] == [int, int, float, float]
    assert str(readable["channel"].dtype) == "Int64" and readable["channel"].tolist()[:1] == [1]
    assert readable["channel"].isna().tolist() == [False, True, True, True]
    assert "56.0" not in readable.to_string() and " 56" in readable.to_string()
    assert is_count("numberOfCompletedCheckpoints", "total") and not is_count("numRecordsOutPerSecond", "mean")


# -- the summary ------------------------------------------------------------------------------------------


def _columns(ddl: str) -> list[str]:
    return [part.strip().split(" ")[0] for part in ddl.split(",")]


@pytest.mark.spark
def test_summary_is_narrow_and_rounded_and_full_keeps_every_column(spark):
    ex = scs.exchange(spark.range(0, 3000, 1, 2), scs.rebalance(), 2, mode="pipelined")
    assert ex.df.count() == 3000
    view = ex.summary()
    assert view.columns == _columns(SUMMARY_VIEW_DDL)
    assert "executor" not in view.columns and len(view.columns) <= 11
    types = dict(view.dtypes)
    for name in ("subtask", "records", "buffers", "records_per_s", "busy_ms_per_s", "idle_ms_per_s"):
        assert types[name] == "bigint", (name, types[name])
    rows = view.collect()
    assert sum(r.records for r in rows if r.side == "consumer") == 3000
    for r in rows:
        assert r.pool_usage_max is None or round(r.pool_usage_max, 2) == r.pool_usage_max
        assert round(r.MB, 2) == r.MB
        assert r.busy_ms_per_s + r.idle_ms_per_s + r.back_pressured_ms_per_s in range(998, 1003)
    shown = view._jdf.showString(20, 0, False)  # what show() prints, without truncation
    assert max(len(line) for line in shown.splitlines()) <= 140, shown
    full = ex.summary(full=True)
    assert full.columns == _columns(SUMMARY_DDL) and len(full.columns) == 16
    by_key = {(r.side, r.subtask): r for r in full.collect()}
    for r in rows:
        exact = by_key[(r.side, r.subtask)]
        assert (exact.records, exact.buffers) == (r.records, r.buffers)
        assert r.records_per_s == round(exact.records_per_second)
        assert round(exact.bytes / 1e6, 2) == r.MB


@pytest.mark.spark
def test_an_rdd_given_to_exchange_is_an_argument_and_points_to_exchange_rdd(spark):
    rdd = spark.range(0, 10, 1, 2).rdd
    with pytest.raises(ConfigError) as info:
        scs.exchange(rdd, scs.rebalance(), 2)
    message = str(info.value)
    assert info.value.setting == "df" and info.value.kind == "argument"
    assert "for argument 'df'" in message and "setting" not in message and "exchange_rdd(rdd" in message
    with pytest.raises(ConfigError, match=r"argument 'mode'.*did you mean 'pipelined'\?$"):
        scs.exchange(spark.range(0, 10, 1, 2), scs.rebalance(), 2, mode="Pipelined ")


# -- the timeline's colours -------------------------------------------------------------------------------


def test_a_subtask_has_one_colour_in_every_panel():
    from matplotlib.colors import to_hex

    from spark_credit_shuffle.plot import plot_timeline

    rows = []
    for t in range(4):
        time_ms = 1000.0 + 100 * t
        for p in range(3):
            rows.append(MetricRow("producer", p, None, "outPoolUsage", "sample", 0.1 * p + 0.01 * t, time_ms))
            for c in range(2):
                rows.append(MetricRow("producer", p, c, "backlog", "sample", float(p + c + t), time_ms))
        for c in (1, 0):  # another order, and panels with consumers only: the cycle would colour them alike
            rows.append(MetricRow("consumer", c, None, "inPoolUsage", "sample", 0.2 * c + 0.01 * t, time_ms))
            rows.append(MetricRow("consumer", c, None, "numRecordsInPerSecond", "sample", 100.0 * (c + t), time_ms))
    for per_channel in (False, True):
        fig = plot_timeline(rows, per_channel=per_channel)
        colour_of: dict[str, set[str]] = {}
        for ax in fig.axes:
            for line in ax.get_lines():
                label = str(line.get_label())
                subtask = label.split(" -> ")[0].split(" <- ")[0]  # a channel's line has its subtask's colour
                colour_of.setdefault(subtask, set()).add(to_hex(line.get_color()))
        assert set(colour_of) == {"producer 0", "producer 1", "producer 2", "consumer 0", "consumer 1"}
        assert all(len(colours) == 1 for colours in colour_of.values()), colour_of
        assert len({next(iter(c)) for c in colour_of.values()}) == 5  # and no two subtasks share one
