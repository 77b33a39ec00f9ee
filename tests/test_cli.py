"""Argument types of the command line and the jobs: bad values name what is allowed."""

from __future__ import annotations

import argparse

import pytest

from spark_credit_shuffle.cli import conf_pair, positive_int


def test_positive_int():
    assert positive_int("3") == 3
    for bad in ("0", "-2", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="allowed is an integer >= 1"):
            positive_int(bad)


def test_conf_pair():
    assert conf_pair(" spark.creditShuffle.buffersPerChannel = 4 ") == ("spark.creditShuffle.buffersPerChannel", "4")
    assert conf_pair("buffer_timeout_ms=10ms") == ("buffer_timeout_ms", "10ms")
    for bad in ("no-equals", "=4", " =4"):
        with pytest.raises(argparse.ArgumentTypeError, match="allowed is KEY=VALUE"):
            conf_pair(bad)
