"""Buffer debloating (FLIP-183): size in-flight buffers so that what is queued drains in a target time.

An input gate measures the throughput of the data it consumes (:class:`ThroughputCalculator`), and
every period asks a :class:`BufferDebloater` for the buffer size at which the buffers it has in use
hold about ``target_ms`` worth of data; a size that moved enough is announced to the senders
(``NewBufferSize``, :meth:`SingleInputGate.announce_buffer_size`) and the producer's next buffers are
cut at that size. Under backpressure this shrinks what sits in the network, so checkpoint barriers and
latency markers cross it sooner, without lowering throughput.

Like the rest of the protocol core, nothing here reads a clock: callers pass the time in milliseconds.
The defaults are Flink's (``taskmanager.network.memory.buffer-debloat.*``).
"""

from __future__ import annotations

import math

__all__ = [
    "DEFAULT_MIN_BUFFER_SIZE",
    "DEFAULT_NUMBER_OF_SAMPLES",
    "DEFAULT_TARGET_MS",
    "DEFAULT_THRESHOLD_PERCENTAGES",
    "BufferDebloater",
    "BufferSizeEMA",
    "ThroughputCalculator",
]

#: ``buffer-debloat.target``: the time the in-flight data should take to consume.
DEFAULT_TARGET_MS = 1000
#: ``memory.min-segment-size``: debloating never goes below it.
DEFAULT_MIN_BUFFER_SIZE = 256
#: ``buffer-debloat.threshold-percentages``: smaller relative changes are not announced.
DEFAULT_THRESHOLD_PERCENTAGES = 25
#: ``buffer-debloat.samples``: the EMA's window (alpha = 2 / (samples + 1)).
DEFAULT_NUMBER_OF_SAMPLES = 20


class ThroughputCalculator:
    """Bytes per second consumed over the measured time since the last calculation.

    Time while the consumer is idle (nothing to read) can be left out with :meth:`pause_measurement`
    / :meth:`resume_measurement`, so an idle gate does not look slow.
    """

    __slots__ = ("_accumulated_bytes", "_measured_ms", "_start_ms", "current_throughput")

    def __init__(self) -> None:
        self.current_throughput = 0
        self._accumulated_bytes = 0
        self._measured_ms = 0
        self._start_ms: int | None = None

    def incoming_data_size(self, size: int, now_ms: int) -> None:
        """``size`` bytes were consumed; resumes the measurement if it was paused."""
        if size < 0:
            raise ValueError(f"data size must be >= 0, got {size}")
        if self._start_ms is None:
            self._start_ms = now_ms
        self._accumulated_bytes += size

    def pause_measurement(self, now_ms: int) -> None:
        """From ``now_ms`` on, time does not count (the gate waits for data)."""
        if self._start_ms is not None:
            self._measured_ms += now_ms - self._start_ms
        self._start_ms = None

    def resume_measurement(self, now_ms: int) -> None:
        """From ``now_ms`` on, time counts again."""
        if self._start_ms is None:
            self._start_ms = now_ms

    def calculate_throughput(self, now_ms: int) -> int:
        """Bytes per second since the last call; the previous value if no measured time passed."""
        if self._start_ms is not None:
            self._measured_ms += now_ms - self._start_ms
            self._start_ms = now_ms
        throughput = self.throughput_of(self._accumulated_bytes, self._measured_ms)
        self._accumulated_bytes = self._measured_ms = 0
        return throughput

    def throughput_of(self, size: int, time_ms: int) -> int:
        """``size`` bytes over ``time_ms`` in bytes per second (and remember it); with no time, the last value."""
        if size < 0 or time_ms < 0:
            raise ValueError(f"data size and time must be >= 0, got {size} bytes over {time_ms} ms")
        if time_ms == 0:
            return self.current_throughput
        self.current_throughput = int(size / time_ms * 1000)
        return self.current_throughput


class BufferSizeEMA:
    """Exponential moving average of the desired buffer size, clamped to [min, max].

    The instant value is capped at twice the current size, so the size grows at most as fast as it can
    shrink (without the cap one large sample would jump from the minimum to the maximum).
    """

    __slots__ = ("_alpha", "_size", "max_buffer_size", "min_buffer_size")

    def __init__(
        self,
        max_buffer_size: int,
        min_buffer_size: int,
        number_of_samples: int = DEFAULT_NUMBER_OF_SAMPLES,
        *,
        starting_buffer_size: int | None = None,
    ) -> None:
        if not 0 < min_buffer_size <= max_buffer_size:
            raise ValueError(f"need 0 < min_buffer_size <= max_buffer_size, got {min_buffer_size}, {max_buffer_size}")
        if number_of_samples < 1:
            raise ValueError(f"number_of_samples must be >= 1, got {number_of_samples}")
        self.max_buffer_size = max_buffer_size
        self.min_buffer_size = min_buffer_size
        self._alpha = 2.0 / (number_of_samples + 1)
        self._size = float(max_buffer_size if starting_buffer_size is None else starting_buffer_size)

    def calculate_buffer_size(self, total_buffer_size: int, total_buffers: int) -> int:
        """The next size, from the bytes that should be in flight and the number of buffers holding them."""
        if total_buffer_size < 0:
            raise ValueError(f"total buffer size must be >= 0, got {total_buffer_size}")
        if total_buffers <= 0:
            raise ValueError(f"number of buffers must be > 0, got {total_buffers}")
        desirable = min(total_buffer_size / total_buffers, 2.0 * self._size)
        size = self._size + self._alpha * (desirable - self._size)
        self._size = max(self.min_buffer_size, min(size, self.max_buffer_size))
        return _round_half_up(self._size)


class BufferDebloater:
    """Decides the buffer size a gate announces, from its throughput and the buffers it has in use."""

    __slots__ = (
        "_ema",
        "_threshold",
        "last_buffer_size",
        "last_estimated_time_ms",
        "max_buffer_size",
        "min_buffer_size",
        "target_ms",
    )

    def __init__(
        self,
        max_buffer_size: int,
        *,
        target_ms: int = DEFAULT_TARGET_MS,
        min_buffer_size: int = DEFAULT_MIN_BUFFER_SIZE,
        threshold_percentages: int = DEFAULT_THRESHOLD_PERCENTAGES,
        number_of_samples: int = DEFAULT_NUMBER_OF_SAMPLES,
    ) -> None:
        if target_ms < 0:
            raise ValueError(f"target_ms must be >= 0, got {target_ms}")
        if not 0 <= threshold_percentages <= 100:
            raise ValueError(f"threshold_percentages must be in [0, 100], got {threshold_percentages}")
        self.target_ms = target_ms
        self.max_buffer_size = max_buffer_size
        self.min_buffer_size = min_buffer_size
        self._threshold = threshold_percentages / 100.0
        self._ema = BufferSizeEMA(max_buffer_size, min_buffer_size, number_of_samples)
        self.last_buffer_size = max_buffer_size
        self.last_estimated_time_ms = 0

    def recalculate_buffer_size(self, throughput: int, buffers_in_use: int) -> int | None:
        """The size to announce now, or None when it did not move enough to be worth announcing.

        ``throughput`` in bytes per second; ``buffers_in_use`` counts the gate's buffers holding data
        (at least one is assumed)."""
        buffers = max(1, buffers_in_use)
        desired_total = throughput * self.target_ms // 1000
        size = self._ema.calculate_buffer_size(desired_total, buffers)
        self.last_estimated_time_ms = size * buffers * 1000 // max(1, throughput)
        if self.skip_update(size):
            return None
        self.last_buffer_size = size
        return size

    def skip_update(self, size: int) -> bool:
        """Not worth announcing: unchanged, or within the threshold (reaching min or max always counts)."""
        if size == self.last_buffer_size:
            return True
        if size <= self.min_buffer_size or size >= self.max_buffer_size:
            return False
        return abs(size - self.last_buffer_size) < int(self.last_buffer_size * self._threshold)


def _round_half_up(value: float) -> int:
    """Java's ``Math.round`` (half up), not Python's banker's rounding."""
    return math.floor(value + 0.5)
