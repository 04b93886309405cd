"""`GET /metrics` over HTTP: the route the admin app serves, or a listener of its own (`[metrics] endpoint`).

The text is `prometheus_client.generate_latest` over the broker's collector (broker/metrics.py): the core
is read on the trio thread in steps (the endpoint is `async def`: Starlette would run a plain `def` in a
worker thread, racing the core), the text built from that copy in a worker thread. No token is needed unless
`[metrics] require_token`, as with RabbitMQ's Prometheus plugin: scrapers rarely hold credentials, the
figures change nothing, and the names they show (queues, client names) are what the admin port's
host already exposes to whoever can reach it (docs/metrics.md says where to keep it).
"""

from __future__ import annotations

import logging

import trio
from prometheus_client import generate_latest
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from flowbroker.broker.admin import BearerAuth, HttpListener
from flowbroker.broker.config import MetricsConfig
from flowbroker.broker.metrics import BrokerMetrics, Families, Scrape

__all__ = ["MetricsServer", "metrics_route", "METRICS_PATH"]

LOGGER = logging.getLogger("flowbroker.broker.metrics")
METRICS_PATH = "/metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The classic text format, which every Prometheus reads. (prometheus-client >= 0.22 labels its output
1.0.0, which differs only for names outside [a-zA-Z_:][a-zA-Z0-9_:]*; ours never are.) Not OpenMetrics:
there a gauge and a counter may not share a base name, and the contract has two pairs that do
(`flowbroker_queue_held_transfers` and `_total`)."""


def metrics_route(metrics: BrokerMetrics) -> Route:
    """`GET /metrics`: the broker's metrics in the Prometheus text format (version 0.0.4).

    The core is read on the trio thread, QUEUE_STEP queues at a time with a checkpoint between steps, so
    the broker's connections run while a scrape of many queues is read; the families and their text are
    built from that copy in a worker thread. One scrape at a time: a second waits for the first, so slow
    scrapes never pile up copies of the broker's figures."""
    one_at_a_time = trio.Lock()

    async def endpoint(request: Request) -> Response:
        try:
            async with one_at_a_time:
                scrape = metrics.collector.scrape()
                while not scrape.read_queues():
                    await trio.lowlevel.checkpoint()
                body = await trio.to_thread.run_sync(_render, scrape, metrics.process)
        except Exception as exc:  # a bug in a collector must not take the broker down: say so and log it
            LOGGER.exception("GET /metrics failed")
            return PlainTextResponse(f"internal error: {type(exc).__name__}: {exc}\n", status_code=500)
        return Response(body, media_type=CONTENT_TYPE)

    return Route(METRICS_PATH, endpoint, methods=["GET"])


def _render(scrape: Scrape, process: Collector) -> bytes:
    """The text of a scrape read in full (in a worker thread: it touches nothing of the broker's)."""
    return generate_latest(Families(scrape.families(), process))


class MetricsServer(HttpListener):
    """`/metrics` on a port of its own (`[metrics] endpoint = "host:port"`), in the broker's nursery.

    `bind()` before any nursery (an address in use is a plain error at start, as for the admin API),
    then `await nursery.start(server.serve)`; `shutdown()` stops it. With `token`, scrapes need it."""

    logger = LOGGER

    def __init__(self, config: MetricsConfig, metrics: BrokerMetrics, token: str | None = None):
        super().__init__(*config.address(), "metrics")
        self.config = config
        app: ASGIApp = Starlette(routes=[metrics_route(metrics)])
        self.app = BearerAuth(app, token) if token is not None else app

    def _serving_line(self) -> str:
        return (f"metrics on http://{self.host}:{self.port}{METRICS_PATH} "
                f"({'admin token required' if self.config.require_token else 'no token required'})")
