"""The driver's address service remembers a failure every retry repeats and fails the exchange's tasks at once."""

from __future__ import annotations

import os
import threading
import time

from spark_credit_shuffle.errors import CreditShuffleError, NullKeyError
from spark_credit_shuffle.runtime.pipelined.rendezvous import AddressRendezvous, all_gather_via, report_failure


def test_a_reported_failure_answers_the_waiting_tasks_and_every_later_attempt():
    service = AddressRendezvous("127.0.0.1", timeout_s=30)
    cancelled: list[tuple[int, str]] = []
    try:
        secret = os.urandom(32)
        service.register("ex/1", secret, 3, on_failure=lambda stage, reason: cancelled.append((stage, reason)))
        service.register("ex/2", secret, 1)
        raised: dict[int, BaseException] = {}

        def task(i: int, attempt: int, group: str = "stage 7") -> None:
            try:
                all_gather_via(service.address, "ex/1", secret, group, i, attempt, 10.0)(f"address of {i}")
            except CreditShuffleError as exc:
                raised[i] = exc

        waiting = threading.Thread(target=task, args=(0, 10))
        waiting.start()
        deadline = time.monotonic() + 10
        while not service._groups and time.monotonic() < deadline:
            time.sleep(0.01)
        error = NullKeyError("producer subtask 1: key column 'k' has 1 null value(s)")
        assert report_failure(service.address, "ex/1", secret, 7, 1, 11, error)
        waiting.join(10)
        assert type(raised[0]) is NullKeyError and str(raised[0]) == str(error)  # the waiting task fails at once
        task(2, 30, group="stage 7 again")  # a later attempt fails at its address request
        assert type(raised[2]) is NullKeyError
        assert report_failure(service.address, "ex/1", secret, 7, 2, 31, error)  # reported again: no new cancel
        deadline = time.monotonic() + 10
        while not cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert cancelled == [(7, f"spark_credit_shuffle.errors.NullKeyError: {error}")]
        assert service.failure("ex/2") is None
        assert all_gather_via(service.address, "ex/2", secret, "stage 8", 0, 1, 10.0)("mine") == ["mine"]
        assert not report_failure(service.address, "ex/2", os.urandom(32), 8, 0, 2, error)  # a wrong secret
        assert service.failure("ex/2") is None
        assert all_gather_via(service.address, "ex/2", secret, "stage 9", 0, 3, 10.0)("mine") == ["mine"]
    finally:
        service.close()
