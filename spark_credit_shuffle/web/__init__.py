"""Flink's web view of a running exchange, on the driver, and its figures for Prometheus.

``exchange(..., monitor="web")`` (or ``spark.creditShuffle.monitor=web``) sends the tasks' timeline samples to
the driver as the live monitor does (:mod:`spark_credit_shuffle.runtime.monitor`) and shows them on a page the
driver serves (:mod:`.server`): the session's exchanges, each as Flink's UI draws a job graph (the producers'
vertex, the partitioner on the edge, the consumers' vertex, subtasks folded into their vertex and listed when
it is opened), each vertex coloured by Flink's back-pressure status while it runs; per subtask its records,
buffers and bytes, busy / idle / back-pressured ms per second, pool usage and the credit and backlog of its
channels where sampled; live charts; where backpressure starts while it runs and the diagnosis once it ended.
``/metrics`` serves the same figures to Prometheus under Flink's names (:mod:`.prometheus`); docs/web.md has a
Grafana dashboard for them.

The service starts only when an exchange asks for it, listens on 127.0.0.1 unless ``monitor_web_address`` says
otherwise, and answers only requests whose URL holds its random token (printed when an exchange asks for the
page; :func:`page_url`). Where the page cannot run, the exchange says so once and runs without it:

- Spark Connect: this package runs in the client, not in the driver, and the executors cannot reach the client
  (the metrics come after the action: ``ex.summary()``, ``ex.diagnose()``, ``plot.plot_timeline(ex)``);
- a driver the browser cannot reach (a Databricks cluster without its driver proxy): the page still serves
  the driver's own processes; ``monitor=plot.LiveTimeline()`` draws the live timeline in the notebook instead,
  ``monitor=callable`` hands the samples to code.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from ..runtime.monitor import MonitorAddress, driver_monitor
from .board import Board, ExchangeView, WatchedExchange
from .prometheus import exposition, metric_name
from .server import BOARD, WebService, running_service, serve

__all__ = [
    "BOARD",
    "Board",
    "ExchangeView",
    "WebService",
    "attach",
    "exposition",
    "metric_name",
    "page_url",
    "register",
    "serve",
    "unavailable",
]

log = logging.getLogger("spark_credit_shuffle")

_said: set[str] = set()


def _say_once(key: str, text: str) -> None:
    """Print ``text`` to stderr once per process (and log it): the user asked for a page and reads there."""
    if key in _said:
        return
    _said.add(key)
    log.info("%s", text)
    print(text, file=sys.stderr, flush=True)


def page_url() -> str | None:
    """The page's address on this driver, token included (None until an exchange asked for it)."""
    service = running_service()
    return service.url if service is not None else None


def unavailable(spark: Any) -> str | None:
    """Why the page cannot serve this session (and what to use instead), or None when it can."""
    from ..runtime.session import is_connect

    if is_connect(spark):
        return (
            "credit shuffle web view: not on Spark Connect (this package runs in the client, and the executors "
            "cannot reach it); the metrics come after the action: ex.summary(), ex.diagnose(), "
            "plot.plot_timeline(ex). On a classic session monitor=plot.LiveTimeline() draws the live timeline "
            "in a notebook, monitor=callable hands the samples to your code"
        )
    return None


def _proxied(spark: Any, port: int, token: str) -> str | None:
    """The page's address through a Databricks driver proxy, where the session's conf names one."""
    if "DATABRICKS_RUNTIME_VERSION" not in os.environ:
        return None
    conf = spark.conf
    try:
        workspace = conf.get("spark.databricks.workspaceUrl", None)
        org = conf.get("spark.databricks.clusterUsageTags.clusterOwnerOrgId", None)
        cluster = conf.get("spark.databricks.clusterUsageTags.clusterId", None)
    except Exception:  # a conf that refuses to answer: no proxy to name
        return None
    if not (workspace and org and cluster):
        return None
    return f"https://{workspace}/driver-proxy/o/{org}/{cluster}/{port}/{token}/"


def register(spark: Any, plan: Any) -> MonitorAddress | None:
    """Show exchange ``plan`` on the page (starting the service on first use) and make its tasks send their
    samples to it; None where the page cannot run (said once, see :func:`unavailable`) or cannot start."""
    reason = unavailable(spark)
    if reason is not None:
        _say_once("connect", reason)
        return None
    config = plan.config
    try:
        service = serve(config.monitor_web_address, config.monitor_web_port)
    except OSError as exc:
        _say_once(
            "bind",
            f"credit shuffle web view: cannot listen on {config.monitor_web_address}:{config.monitor_web_port} "
            f"({exc}); the exchanges run without it (set monitor_web_port, spark.creditShuffle.monitorWebPort, to "
            "a free port, or 0 for any)",
        )
        return None
    host, port = service.address
    if (config.monitor_web_port not in (0, port)) or config.monitor_web_address != host:
        log.info("credit shuffle web view: already serving at %s:%d (one page per driver process)", host, port)
    view = ExchangeView(
        plan.name,
        mode=plan.mode,
        partitioner=_partitioner_text(plan.partitioner),
        producers=plan.num_producers,
        consumers=plan.num_consumers,
        before=tuple(op.name for op in plan.before),
        after=tuple(op.name for op in plan.after),
    )
    try:
        monitors = driver_monitor(spark.conf.get("spark.driver.host", None) or "127.0.0.1")
    except OSError as exc:
        log.warning("credit shuffle web view: the driver's monitor service cannot start (%s); running without", exc)
        return None
    BOARD.add(view)
    where = _proxied(spark, port, service.token)
    if where is None and "DATABRICKS_RUNTIME_VERSION" in os.environ:
        _say_once(
            "databricks",
            "credit shuffle web view: this Databricks driver names no driver proxy, so a browser may not reach "
            f"{service.url}; monitor=plot.LiveTimeline() draws the live timeline in the notebook instead, "
            "monitor=callable hands the samples to your code, and the metrics come after the action",
        )
    print(f"credit shuffle web view of {plan.name}: {where or service.url}#{plan.name}", file=sys.stderr, flush=True)
    _say_once("prometheus", f"credit shuffle metrics for Prometheus: {where or service.url}metrics")
    return monitors.register(plan.name, view)


def attach(exchange: WatchedExchange, after: tuple[str, ...] | None = None) -> None:
    """Let the page read ``exchange``'s metrics and diagnosis once its run ended (the exchange asked for the
    page); ``after``: the operators chained after it now."""
    view = BOARD.get(exchange.name)
    if view is not None:
        view.attach(exchange, after)


def _partitioner_text(partitioner: Any) -> str:
    """The edge's label, as Flink's UI names a ship strategy (``HASH``, ``REBALANCE``, ...), with key columns."""
    columns = getattr(partitioner, "columns", None)
    name = str(getattr(partitioner, "name", type(partitioner).__name__))
    return f"{name} ({', '.join(map(str, columns))})" if columns else name
