"""The driver's web view of running exchanges (``monitor="web"``): a real headless browser sees the producers'
vertex turn HIGH and the slow consumer named before the action returns; Prometheus' own parser reads Flink's
metric names from the endpoint during a run, and their values after it equal the run's metric rows; bad requests
are refused while an exchange runs beside them, which stays exact. Real sockets on 127.0.0.1, the suite's
SparkSession; every wait names what it waited for."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F

import spark_credit_shuffle as scs
from spark_credit_shuffle import web
from spark_credit_shuffle.config import NetworkConfig
from spark_credit_shuffle.errors import ConfigError
from spark_credit_shuffle.jobs.common import slow_on  # the demos' slow step of the user's
from spark_credit_shuffle.metrics import CONSUMER, PRODUCER, MetricRow
from spark_credit_shuffle.web.board import ExchangeView
from spark_credit_shuffle.web.server import MAX_HEADER_LINES, MAX_REQUEST_LINE, MAX_UNAUTHENTICATED

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this module

ROOT = Path(__file__).resolve().parent.parent
#: Where the browser test also writes its screenshot when set (the README's picture: docs/pictures/web_view.png).
PICTURE_ENV = "WEB_VIEW_PICTURE"
FLINK = "flink_taskmanager_job_task_"
COUNTERS = {
    PRODUCER: ("numRecordsOut", "numBuffersOut", "numBytesOut"),
    CONSUMER: ("numRecordsIn", "numBuffersIn", "numBytesIn"),
}


#: What the page shows of one exchange (its name the script's argument), read at once: the page redraws its
#: sections every second, so elements found one call earlier may be gone.
SNAPSHOT = """
const section = document.querySelector(`section[data-exchange="${arguments[0]}"]`);
if (!section) return null;
const text = (selector) => { const e = section.querySelector(selector); return e ? e.textContent : null; };
const rows = (side) =>
  Array.from(section.querySelectorAll(`details[data-side="${side}"] tbody tr`), (r) => r.className);
const producers = section.querySelector('.vertex[data-side="producer"]');
return {
  state: section.dataset.state,
  producers: producers ? producers.dataset.status : null,
  consumers: text('.vertex[data-side="consumer"]'),
  origin: text(".origin"),
  diagnosis: text(".diagnosis"),
  producerRows: rows("producer"),
  consumerRows: rows("consumer"),
  lines: section.querySelectorAll("svg.chart polyline.series.producer").length,
};
"""


def wait_for(what: str, condition: Callable[[], Any], timeout_s: float, detail: Callable[[], str] = lambda: "") -> Any:
    """``condition()``'s first true value, polled; after ``timeout_s`` a failure naming ``what`` was waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout_s:.0f} s for {what}; {detail()}")
        time.sleep(0.1)


class Action:
    """An action on a DataFrame run on a thread of its own, so that the test can look at the page meanwhile."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

        def target() -> None:
            try:
                self.result = run()
            except BaseException as exc:  # handed to the test, which raises it
                self.error = exc
            finally:
                self.done.set()

        self.thread = threading.Thread(target=target, name="web-test-action", daemon=True)
        self.thread.start()

    def join(self, timeout_s: float) -> Any:
        if not self.done.wait(timeout_s):
            pytest.fail(f"waited {timeout_s:.0f} s for the exchange's action to return")
        if self.error is not None:
            raise self.error
        return self.result


def request(raw: bytes, timeout_s: float = 10.0) -> tuple[int | None, bytes]:
    """Send ``raw`` to the page's service and read until it closes: (the answer's status or None, its bytes)."""
    host, port = web.serve().address
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            sock.sendall(raw)
        except OSError:  # closed while sending (a line over the limit): no answer
            return None, b""
        chunks = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        else:
            pytest.fail(f"waited {timeout_s:.0f} s for the service to close a connection after {raw[:60]!r}")
    data = b"".join(chunks)
    if not data.startswith(b"HTTP/1.1 "):
        return None, data
    return int(data[9:12]), data.split(b"\r\n\r\n", 1)[-1]


def get(path: str, token: str | None = None) -> tuple[int | None, bytes]:
    token = web.serve().token if token is None else token
    return request(f"GET /{token}{path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())


def state_of(name: str) -> dict[str, Any] | None:
    status, body = get("/api/state")
    assert status == 200, body[:200]
    return next((ex for ex in json.loads(body)["exchanges"] if ex["name"] == name), None)


def sampled_s(name: str) -> float:
    """Seconds from the first to the last sample the page has of exchange ``name``."""
    view = state_of(name) or {}
    first, last = view.get("first_ms"), view.get("last_ms")
    return (last - first) / 1000.0 if first and last else 0.0


def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` read by Prometheus' own parser: {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = get("/metrics")
    assert status == 200, body[:200]
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def series(scraped, name: str, **labels: str) -> dict[tuple[str, int], float]:
    """The values of metric ``name`` whose labels include ``labels``, by (side, subtask_index)."""
    out = {}
    for (metric, pairs), value in scraped.items():
        found = dict(pairs)
        if metric == name and all(found.get(k) == v for k, v in labels.items()) and "channel" not in found:
            out[(found.get("side", ""), int(found.get("subtask_index", -1)))] = value
    return out


def keyed(spark, rows: int, partitions: int):
    return spark.range(0, rows, 1, partitions).select(
        "id", (F.col("id") % 1000).alias("k"), F.lit("x" * 90).alias("pad")
    )


# -- without Spark ---------------------------------------------------------------------------------------------


def test_the_exposition_is_prometheus_text_under_flinks_names():
    from prometheus_client.parser import text_string_to_metric_families

    view = ExchangeView("hash-pipelined-x", mode="pipelined", partitioner="HASH (k)", producers=2, consumers=2)
    now = time.time() * 1000.0
    view.accept(
        [
            MetricRow(PRODUCER, 0, None, "outPoolUsage", "sample", 1.0, now),
            MetricRow(PRODUCER, 0, None, "backPressuredTimeMsPerSecond", "sample", 930.0, now),
            MetricRow(PRODUCER, 0, None, "numBuffersOut", "sample", 12.0, now),
            MetricRow(PRODUCER, 0, 1, "backlog", "sample", 4.0, now),
            MetricRow(CONSUMER, 1, 0, "credit", "sample", 0.0, now),
            MetricRow(CONSUMER, 1, None, "inPoolUsage", "sample", 0.5, now),
        ]
    )
    text = web.exposition([view])
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families[f"{FLINK}Shuffle_Netty_Output_Buffers_outPoolUsage"].type == "gauge"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    head = (("exchange", "hash-pipelined-x"), ("mode", "pipelined"))
    assert samples[(f"{FLINK}numBuffersOut", (*head, ("side", "producer"), ("subtask_index", "0")))] == 12.0
    assert (
        samples[
            (f"{FLINK}Shuffle_Netty_Input_Buffers_inPoolUsage", (*head, ("side", "consumer"), ("subtask_index", "1")))
        ]
        == 0.5
    )
    backlog = (("channel", "1"), *head, ("side", "producer"), ("subtask_index", "0"))
    assert samples[(f"{FLINK}Shuffle_Netty_Output_backlog", backlog)] == 4.0
    assert samples[("credit_shuffle_vertex_back_pressure_level", (*head, ("side", "producer")))] == 2.0  # HIGH
    assert samples[("credit_shuffle_exchange_running", head)] == 1.0
    assert web.metric_name(PRODUCER, "outPoolUsage") == f"{FLINK}Shuffle_Netty_Output_Buffers_outPoolUsage"


def test_the_grafana_dashboard_queries_only_series_the_endpoint_serves():
    dashboard = json.loads((ROOT / "docs" / "grafana" / "spark_credit_shuffle.json").read_text())
    timeline = [
        "numRecordsOut",
        "numBuffersOut",
        "numBytesOut",
        "numRecordsIn",
        "numBuffersIn",
        "numBytesIn",
        "numRecordsOutPerSecond",
        "numRecordsInPerSecond",
        "outPoolUsage",
        "inPoolUsage",
        "inputExclusiveBuffersUsage",
        "inputFloatingBuffersUsage",
        "outputQueueLength",
        "inputQueueLength",
        "isBackPressured",
        "busyTimeMsPerSecond",
        "idleTimeMsPerSecond",
        "backPressuredTimeMsPerSecond",
        "backlog",
        "credit",
        "unannouncedCredit",
    ]
    served = {web.metric_name(side, m) for side in (PRODUCER, CONSUMER) for m in timeline}
    served |= {"credit_shuffle_exchange_running", "credit_shuffle_vertex_back_pressure_level"}
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", target["expr"])
    }
    assert queried and queried <= served, queried - served
    assert {f"{FLINK}backPressuredTimeMsPerSecond", f"{FLINK}Shuffle_Netty_Output_Buffers_outPoolUsage"} <= queried


def test_the_settings_take_web_a_port_and_an_address_and_refuse_the_rest():
    config = NetworkConfig.from_conf(
        {
            "spark.creditShuffle.monitor": "web",
            "spark.creditShuffle.monitorWebPort": "8089",
            "spark.creditShuffle.monitorWebAddress": "10.0.0.7",
        }
    )
    assert (config.monitor, config.monitor_web_port, config.monitor_web_address) == ("web", 8089, "10.0.0.7")
    assert NetworkConfig().monitor is False and NetworkConfig().monitor_web_address == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"spark.creditShuffle.monitor\).*'web'"):
        NetworkConfig.from_conf({"spark.creditShuffle.monitor": "page"})
    with pytest.raises(ConfigError, match=r"monitor_web_port"):
        NetworkConfig(monitor_web_port=70_000)
    with pytest.raises(ConfigError, match=r"monitor_web_address"):
        NetworkConfig(monitor_web_address="http://example/")


# -- on the suite's session ------------------------------------------------------------------------------------


@pytest.fixture
def browser():
    """Headless Chromium from Debian's packages, driven by selenium; the test fails (never skips) without them."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        missing = " and ".join(p for p, found in (("chromium", chromium), ("chromium-driver", driver)) if not found)
        pytest.fail(
            f"the web view's browser test needs Debian's {missing}: apt-get install chromium chromium-driver "
            "(.ci/run and make test install them where apt-get is there)"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the web view's browser test needs selenium (the dev extra: pip install -e '.[dev]')")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",  # the tests may run as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1900",
        # a browser that talks to nothing but the page: no background requests, no name resolved
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--disable-domain-reliability",
        "--no-first-run",
        "--no-pings",
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    ):
        options.add_argument(flag)
    session = webdriver.Chrome(options=options, service=Service(executable_path=driver))  # no driver download
    session.set_page_load_timeout(30)
    yield session
    session.quit()


@pytest.mark.spark
def test_the_page_shows_the_producers_high_and_names_the_slow_consumer_before_the_action_returns(
    spark, browser, tmp_path
):
    """A slow operator chained after a pipelined key_by exchange on consumer 2 (0.24 ms per row, some 12 s):
    while the action runs, the producers' vertex is HIGH and the page names consumer subtask 2."""
    ex = scs.exchange(
        keyed(spark, 200_000, 4), scs.key_by("k"), 4, mode="pipelined", monitor="web", local_channels="task"
    )
    out = ex.map_in_pandas(slow_on(2, 2.4e-4), "id long, k long, pad string")
    action = Action(out.count)
    browser.get(f"{web.page_url()}#{ex.name}")

    def seen() -> dict[str, Any]:
        """What the page shows of the exchange, read in one script (the page redraws every second)."""
        return browser.execute_script(SNAPSHOT, ex.name) or {}

    def live() -> bool:
        shown = seen()
        return shown.get("producers") == "HIGH" and "backpressure starts at consumer subtask 2" in (
            shown.get("origin") or ""
        )

    wait_for(
        "the producers' vertex HIGH and the origin at consumer subtask 2 on the page", live, 60, lambda: str(seen())
    )
    assert not action.done.is_set(), "the page named the slow consumer only after the action returned"
    shown = seen()
    assert "→ slow" in shown["consumers"] and "backpressure starts at subtask 2" in shown["consumers"], shown
    assert len(shown["producerRows"]) == 4 and all(c.startswith("status-") for c in shown["producerRows"]), shown
    assert "origin" in shown["consumerRows"][2], shown  # the slow consumer's row is marked
    wait_for("a line on the back-pressured time chart", lambda: seen().get("lines", 0) > 0, 10, lambda: str(seen()))
    wait_for(  # a few seconds of samples in the charts, or the end of the run, before the picture
        "five seconds of samples or the action's return",
        lambda: action.done.is_set() or sampled_s(ex.name) >= 5.0,
        30,
    )
    shot = tmp_path / "web_view.png"
    browser.save_screenshot(str(shot))
    if os.environ.get(PICTURE_ENV):
        shutil.copyfile(shot, os.environ[PICTURE_ENV])
    assert action.join(120) == 200_000

    def diagnosed() -> bool:
        shown = seen()
        return shown.get("state") == "finished" and "backpressure starts at consumer subtask 2" in (
            shown.get("diagnosis") or ""
        )

    wait_for("the diagnosis on the page once the action returned", diagnosed, 30, lambda: str(seen()))
    assert ex.diagnose().origin == 2


@pytest.mark.spark
def test_prometheus_scrapes_flinks_metrics_during_the_run_and_the_run_s_totals_after_it(spark):
    ex = scs.exchange(keyed(spark, 60_000, 2), scs.key_by("k"), 2, mode="pipelined", monitor="web", segment_size="4kb")
    out = ex.map_in_pandas(slow_on(0, 1e-4), "id long, k long, pad string")  # about 3 s on consumer 0
    action = Action(out.count)
    mine = {"exchange": ex.name, "mode": "pipelined"}

    def live():
        scraped = scrape()
        running = series(scraped, "credit_shuffle_exchange_running", **mine)
        out_buffers = series(scraped, f"{FLINK}numBuffersOut", **mine)
        ready = running and next(iter(running.values())) == 1.0 and len(out_buffers) == 2
        return scraped if ready and any(v > 0 for v in out_buffers.values()) else None

    scraped = wait_for("the exchange's live figures on /metrics", live, 60)
    during = not action.done.is_set()
    for side, subtask in ((PRODUCER, 0), (PRODUCER, 1)):
        assert (
            0.0 <= series(scraped, f"{FLINK}Shuffle_Netty_Output_Buffers_outPoolUsage", **mine)[(side, subtask)] <= 1.0
        )
        assert 0.0 <= series(scraped, f"{FLINK}backPressuredTimeMsPerSecond", **mine)[(side, subtask)] <= 1000.0
        assert series(scraped, f"{FLINK}numBytesOut", **mine)[(side, subtask)] > 0
    in_pool = wait_for(
        "the consumers' inPoolUsage on /metrics",
        lambda: series(scrape(), f"{FLINK}Shuffle_Netty_Input_Buffers_inPoolUsage", **mine),
        30,
    )
    assert all(0.0 <= v <= 1.0 for v in in_pool.values())
    assert action.join(120) == 60_000
    assert during, "the first scrape with the exchange's figures came only after the action returned"

    def ended():
        scraped = scrape()
        return scraped if series(scraped, "credit_shuffle_exchange_running", **mine).get(("", -1)) == 0.0 else None

    scraped = wait_for("the exchange's end (credit_shuffle_exchange_running 0) on /metrics", ended, 30)
    totals: dict[tuple[str, int, str], float] = {}
    for r in ex.metric_rows():
        if r.stat == "total" and r.metric in COUNTERS[r.side]:
            totals[(r.side, r.subtask, r.metric)] = totals.get((r.side, r.subtask, r.metric), 0.0) + r.value
    assert len(totals) == 12
    for (side, subtask, metric), total in totals.items():
        assert series(scraped, FLINK + metric, **mine)[(side, subtask)] == total, (side, subtask, metric)
    assert sum(v for (side, _, m), v in totals.items() if m == "numRecordsIn") == 60_000


@pytest.mark.spark
def test_bad_requests_are_refused_while_an_exchange_runs_beside_them_exactly(spark):
    ex = scs.exchange(keyed(spark, 60_000, 2), scs.rebalance(), 2, mode="pipelined", monitor="web", segment_size="4kb")
    out = ex.map_in_pandas(slow_on(1, 1e-4), "id long, k long, pad string")  # about 3 s on consumer 1
    action = Action(lambda: out.agg(F.count("*"), F.sum("id")).collect()[0])
    service = web.serve()
    token = service.token
    wait_for(
        "the exchange's first samples on the page", lambda: (state_of(ex.name) or {}).get("state") == "running", 60
    )
    before = dict(service.rejected_by_cause)

    wrong = "A" * len(token) if token[0] != "A" else "B" * len(token)
    assert get("/api/state", token=wrong)[0] == 403
    assert get("/metrics", token="")[0] == 403
    assert get("/", token=token[:-1])[0] == 403  # one character short
    assert request(f"POST /{token}/api/state HTTP/1.1\r\n\r\n".encode())[0] == 403  # GET only
    assert request(b"\x16\x03\x01\x00\xff garbage\r\n\r\n")[0] == 403
    for status, body in (get("/nope"), get("/api/state/../../metrics"), get("/%2e%2e/metrics")):
        assert status == 404 and ex.name.encode() not in body
    many_headers = "".join(f"X-Filler-{i}: {'y' * 100}\r\n" for i in range(MAX_HEADER_LINES + 1))
    assert request(f"GET /{token}/api/state HTTP/1.1\r\n{many_headers}\r\n".encode())[0] == 431
    huge_header = f"GET /{token}/api/state HTTP/1.1\r\nX-Huge: {'z' * 100_000}\r\n\r\n".encode()
    assert request(huge_header)[0] is None  # a header line over its limit: closed unanswered
    assert request(b"GET /" + b"a" * (MAX_REQUEST_LINE * 4))[0] is None  # a request line over its limit
    # more idle connections than may wait for their request line: the oldest are closed, the page still answers
    host, port = service.address
    idle = [socket.create_connection((host, port), timeout=10) for _ in range(4 * MAX_UNAUTHENTICATED)]
    try:
        status, body = get("/api/state")
        assert status == 200 and any(e["name"] == ex.name for e in json.loads(body)["exchanges"])
        closed = 0
        for sock in idle[:MAX_UNAUTHENTICATED]:  # the oldest: evicted
            sock.settimeout(10)
            try:
                closed += sock.recv(1) == b""
            except ConnectionResetError:
                closed += 1
        assert closed == MAX_UNAUTHENTICATED
    finally:
        for sock in idle:
            sock.close()
    after = service.rejected_by_cause
    for cause in ("wrong token", "headers too large", "request too long", "evicted unauthenticated"):
        assert after.get(cause, 0) > before.get(cause, 0), (cause, before, after)

    count, total = action.join(120)
    assert (count, total) == (60_000, 60_000 * 59_999 // 2)  # the exchange beside the attacks: exact

    def finished() -> dict[str, Any] | None:
        view = state_of(ex.name)
        return view if view is not None and view["state"] == "finished" else None

    view = wait_for("the exchange's end on the page", finished, 30)
    received = sum(s["records"] for s in view["vertices"]["consumer"]["subtasks"])
    assert received == 60_000 and view["diagnosis"] is not None
    assert urllib.parse.urlparse(web.page_url()).hostname == "127.0.0.1"  # the loopback unless configured


@pytest.mark.spark
def test_on_spark_connect_the_exchange_says_why_there_is_no_page_and_runs_without(spark, connect_spark):
    reason = web.unavailable(connect_spark)
    assert reason is not None and "not on Spark Connect" in reason
    assert "ex.summary()" in reason and "LiveTimeline" in reason and "monitor=callable" in reason
    assert web.unavailable(spark) is None
    ex = scs.exchange(connect_spark.range(0, 100, 1, 2), scs.rebalance(), 2, monitor="web")
    assert ex.plan.monitor is None and ex.df.count() == 100
