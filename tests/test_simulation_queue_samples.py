"""A producer's ``outputQueueLength`` samples, read only where a queue changed
(:class:`~spark_credit_shuffle.engine.producer.QueueLengthSamples`), equal reading every queue at every sample."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.engine.producer import QueueLengthSamples
from spark_credit_shuffle.simulation import simulate

HOSTS = [i // 4 for i in range(8)]
BASE: dict[str, Any] = {
    "num_producers": 8,
    "num_consumers": 8,
    "producer_rate": 20e6,
    "consumer_rate": [2e6] + [40e6] * 7,  # one slow consumer: queues that grow and shrink
    "producer_hosts": HOSTS,
    "consumer_hosts": HOSTS,
    "latency": 100e-6,
    "duration": 0.03,
}


@pytest.mark.parametrize(
    "config, extra",
    [
        (NetworkConfig(), {}),
        (NetworkConfig(checkpoint_interval_ms=5), {"processes": "subtask"}),
        (NetworkConfig(credit_based=False, buffer_timeout_ms=1), {"connections": "task_pair"}),
    ],
)
def test_incremental_samples_equal_every_queue_read(
    monkeypatch: pytest.MonkeyPatch, config: NetworkConfig, extra: dict[str, Any]
) -> None:
    samplers: list[tuple[QueueLengthSamples, Any, np.ndarray, np.ndarray]] = []
    init, sample = QueueLengthSamples.__init__, QueueLengthSamples.sample

    def tracked_init(self: QueueLengthSamples, partition: Any, n: int) -> None:
        init(self, partition, n)
        samplers.append((self, partition, np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)))

    def both_sample(self: QueueLengthSamples) -> None:
        sample(self)
        for sampler, partition, sums, maxima in samplers:
            if sampler is self:
                lengths = np.array(partition.queue_lengths(), dtype=np.int64)
                sums += lengths
                np.maximum(maxima, lengths, out=maxima)

    monkeypatch.setattr(QueueLengthSamples, "__init__", tracked_init)
    monkeypatch.setattr(QueueLengthSamples, "sample", both_sample)
    simulate(config, **{**BASE, **extra})
    assert samplers
    assert any(s.samples for s, *_ in samplers)
    assert any(s._changed is not None for s, *_ in samplers)
    nonzero = False
    for sampler, _, sums, maxima in samplers:
        got_max, got_sum, _ = sampler.totals()
        assert got_sum == sums.tolist()
        assert got_max == maxima.tolist()
        nonzero = nonzero or bool(sums.any())
    assert nonzero  # the queues did hold something at some samples
