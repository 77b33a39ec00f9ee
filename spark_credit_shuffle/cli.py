"""Argument types shared by the command line (``python -m spark_credit_shuffle``) and the jobs in ``jobs/``.

Each turns a bad value into ``argparse.ArgumentTypeError`` saying what is allowed, so argparse reports it
with the option's name and exits with status 2.
"""

from __future__ import annotations

import argparse

from .config import CONF_PREFIX

__all__ = ["conf_pair", "positive_int"]


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of rows, tasks, rounds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}: allowed is an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {value}: allowed is an integer >= 1")
    return value


def conf_pair(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` of ``--conf``: a Spark setting or an exchange setting (conf key or keyword name)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"invalid --conf {text!r}: allowed is KEY=VALUE, e.g. {CONF_PREFIX}buffersPerChannel=4 or "
            f"buffers_per_channel=4"
        )
    return key.strip(), value.strip()
