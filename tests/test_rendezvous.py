"""The driver's address service on 127.0.0.1 with real sockets: bounded by silent and hostile connections
(one thread, a cap on connections waiting to send their request, a request deadline), and forgetting what
it no longer needs (a group's addresses when everyone has them, an exchange's secret when idle)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading

import pytest
from tcp_helpers import closed_by_peer, wait_until

from spark_credit_shuffle.errors import CreditShuffleError
from spark_credit_shuffle.runtime.pipelined.rendezvous import MAX_REQUEST, AddressRendezvous, all_gather_via
from spark_credit_shuffle.transport.tcp import unauthenticated_cap

pytestmark = pytest.mark.timeout(60)

SECRET = os.urandom(32)


def gather_all(service: AddressRendezvous, width: int, key: str = "ex/1", **kwargs) -> dict[int, list[str]]:
    """Every task of one stage asks at once; returns each task's answer (or its error's text)."""
    answers: dict[int, list[str]] = {}

    def task(i: int) -> None:
        gather = all_gather_via(service.address, key, SECRET, "stage 1", i, i, 10.0, **kwargs)
        try:
            answers[i] = gather(f"address of {i}")
        except CreditShuffleError as exc:
            answers[i] = [str(exc)]

    threads = [threading.Thread(target=task, args=(i,)) for i in range(width)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return answers


def test_hundreds_of_silent_connections_cost_no_thread_and_a_bounded_number_of_sockets():
    service = AddressRendezvous("127.0.0.1")
    service.register("ex/1", SECRET, 3)
    threads_before = threading.active_count()
    silent = []
    try:
        for _ in range(300):
            silent.append(socket.create_connection(service.address))
        assert service.max_pending == unauthenticated_cap(3)
        assert wait_until(lambda: service.rejected_by_cause.get("evicted unauthenticated", 0) >= 300 - 32)
        # one service thread, whatever connects (threads of other clients in this process, such as a Spark
        # Connect session's, may end meanwhile)
        assert threading.active_count() <= threads_before
        assert service.num_connections <= service.max_pending
        answers = gather_all(service, 3)  # the tasks still meet
        assert answers == {i: ["address of 0", "address of 1", "address of 2"] for i in range(3)}
        assert service.num_connections <= service.max_pending
    finally:
        for s in silent:
            s.close()
        service.close()


def test_a_connection_that_sends_no_request_in_time_or_too_long_a_request_is_closed(caplog):
    caplog.set_level(logging.WARNING, logger="spark_credit_shuffle")
    service = AddressRendezvous("127.0.0.1", request_timeout_s=0.3)
    try:
        with socket.create_connection(service.address) as silent:
            assert closed_by_peer(silent)
        with socket.create_connection(service.address) as chatty:
            with contextlib.suppress(OSError):  # closed while sending: as expected
                chatty.sendall(b"x" * (MAX_REQUEST + 65536))  # no newline
            assert closed_by_peer(chatty)
        assert service.rejected_by_cause == {"request timeout": 1, "request too long": 1}
        assert "no request within 300 ms of connecting (request_timeout_s)" in caplog.text
        assert service.num_connections == 0
    finally:
        service.close()


def test_a_group_is_forgotten_when_complete_and_an_idle_exchange_forgets_its_secret():
    service = AddressRendezvous("127.0.0.1", exchange_ttl_s=0.5)
    try:
        service.register("ex/1", SECRET, 2)
        assert gather_all(service, 2) == {i: ["address of 0", "address of 1"] for i in range(2)}
        assert not service._groups  # the addresses are not kept once every task has them
        assert wait_until(lambda: "ex/1" not in service.exchanges)
        # a later run of the forgotten exchange: every task hears "unknown exchange" and falls back
        fallback_calls = []

        def fallback(message: str) -> list[str]:
            fallback_calls.append(message)
            return ["through allGather"]

        answers = gather_all(service, 2, fallback=fallback)
        assert answers == {0: ["through allGather"], 1: ["through allGather"]}
        assert sorted(fallback_calls) == ["address of 0", "address of 1"]
        with pytest.raises(CreditShuffleError, match="unknown exchange"):
            all_gather_via(service.address, "ex/1", SECRET, "stage 1", 0, 0, 5.0)("again")
    finally:
        service.close()


def test_unregistering_an_exchange_forgets_its_secret_and_closes_its_waiting_tasks():
    service = AddressRendezvous("127.0.0.1")
    try:
        service.register("ex/1", SECRET, 2)
        result: dict[str, str] = {}

        def lone_task() -> None:
            try:
                all_gather_via(service.address, "ex/1", SECRET, "stage 1", 0, 0, 10.0)("address of 0")
            except CreditShuffleError as exc:
                result["error"] = str(exc)

        waiting = threading.Thread(target=lone_task)
        waiting.start()
        assert wait_until(lambda: service._groups)
        service.unregister("ex/1")
        waiting.join(10)
        assert "address service" in result["error"]
        assert service.exchanges == [] and not service._groups
        assert wait_until(lambda: service.num_connections == 0)
    finally:
        service.close()
