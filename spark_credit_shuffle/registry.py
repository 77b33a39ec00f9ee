"""The exchanges planned in this process, found again from a physical plan.

A DataFrame built on an exchange keeps no Python object of it: only the names of its stages' Python functions
(``credit_shuffle_produce_<label>``, ``credit_shuffle_consume_<label>``, ``credit_shuffle_<label>``, set by the
runtimes) travel in its plan, on classic sessions and Spark Connect alike. :class:`Registry` keeps the last
:data:`KEPT` exchanges planned here by that label (and any older one something still holds), and finds those a
plan names; ``exchange_of(df)`` is built on it.
"""

from __future__ import annotations

import collections
import re
import weakref
from typing import Generic, TypeVar

__all__ = ["KEPT", "STAGE_FUNCTION", "Registry", "label"]

#: How many exchanges the registry keeps alive (older ones are found while something else holds them).
KEPT = 256
#: The label of an exchange in a physical plan: the name of a stage's Python function.
STAGE_FUNCTION = re.compile(r"\bcredit_shuffle_(?:produce_|consume_)?([a-z0-9_]+?_(?:blocking|pipelined)_\d+)\(")

T = TypeVar("T")


def label(name: str) -> str:
    """The label an exchange named ``name`` carries in its stages' function names."""
    return name.replace("-", "_")


class Registry(Generic[T]):
    """Items (exchanges) by the label of their name: the last ``kept`` of them, and any older one still held."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._recent: collections.OrderedDict[str, T] = collections.OrderedDict()
        self._held: weakref.WeakValueDictionary[str, T] = weakref.WeakValueDictionary()

    def add(self, name: str, item: T) -> None:
        """Keep ``item`` under the label of ``name``."""
        key = label(name)
        self._recent[key] = self._held[key] = item
        while len(self._recent) > self.kept:
            self._recent.popitem(last=False)

    def in_plan(self, plan: str) -> list[T]:
        """The items whose labels the physical plan ``plan`` names, outermost first, each once."""
        found: list[T] = []
        for key in STAGE_FUNCTION.findall(plan):
            item = self._recent.get(key) or self._held.get(key)
            if item is not None and item not in found:
                found.append(item)
        return found
