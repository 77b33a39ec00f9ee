"""The virtual clock of the simulation, and what its subtasks see of the run they are in."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import NetworkConfig
    from ..engine import Settings

__all__ = ["Context", "VirtualClock", "per_subtask"]


class VirtualClock:
    """Virtual time and a queue of timed callbacks, run in (time, insertion) order; a cancelled callback is
    dropped without moving the time (a timer of a subtask that finished does not stretch the run)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._sequence = 0
        self._cancelled: set[int] = set()

    def schedule(self, at: float, callback: Callable[[float], None]) -> int:
        """Run ``callback(time)`` at virtual time ``at`` (never before now); returns its id for :meth:`cancel`."""
        self._sequence += 1
        heapq.heappush(self._events, (max(at, self.now), self._sequence, callback))
        return self._sequence

    def cancel(self, event: int | None) -> None:
        """Drop the callback ``event`` (an id from :meth:`schedule` of a callback that has not run yet)."""
        if event is not None:
            self._cancelled.add(event)

    def _drop_cancelled(self) -> None:
        events, cancelled = self._events, self._cancelled
        while events and events[0][1] in cancelled:
            cancelled.discard(heapq.heappop(events)[1])

    def next_time(self) -> float | None:
        self._drop_cancelled()
        return self._events[0][0] if self._events else None

    def run_next(self) -> bool:
        """Advance to the next event and run it; False if there is none."""
        self._drop_cancelled()
        if not self._events:
            return False
        at, _, callback = heapq.heappop(self._events)
        self.now = at
        callback(at)
        return True

    def __len__(self) -> int:
        return sum(1 for _, event, _ in self._events if event not in self._cancelled)


class Context(Protocol):
    """What a simulated subtask uses of its simulation: the clock, the settings and the engine's rules."""

    clock: VirtualClock
    config: NetworkConfig
    settings: Settings
    #: Virtual seconds a consumer spends on a data buffer besides its records (header, Arrow metadata).
    buffer_cost: float


def per_subtask(value: float | Sequence[float] | None, count: int, name: str) -> list:
    if value is None or isinstance(value, (int, float)):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ConfigError(name, value, f"one value per subtask ({count} values) or a single value")
    return values
