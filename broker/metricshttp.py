"""`GET /metrics` over HTTP: the route the admin app serves, or a listener of its own (`[metrics] endpoint`).

The text is what `prometheus_client.generate_latest` makes of the broker's collector (broker/metrics.py),
all of it built on the trio thread in slices of about a millisecond with a checkpoint between them, each in the
turn heavy HTTP answers share (broker/httpturns.py), so the broker's connections run while a scrape of many
queues is read and rendered (the endpoint is `async def`:
Starlette would run a plain `def` in a worker thread, racing the core). No token is needed unless
`[metrics] require_token`, as with RabbitMQ's Prometheus plugin: scrapers rarely hold credentials, the
figures change nothing, and the names they show (queues, client names) are what the admin port's
host already exposes to whoever can reach it (docs/metrics.md says where to keep it).
"""

from __future__ import annotations

import collections
import copy
import logging
from collections.abc import Iterator

import trio
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from flowbroker.broker.admin import HTTP_LOGGER, BearerAuth, HttpListener, url_host
from flowbroker.broker.adminusers import AdminUsers
from flowbroker.broker.config import MetricsConfig
from flowbroker.broker.httpturns import SLICE_SECONDS, HttpTurns
from flowbroker.broker.metrics import BrokerMetrics, Families, Scrape

__all__ = ["MetricsServer", "metrics_route", "METRICS_PATH"]

LOGGER = logging.getLogger("flowbroker.broker.metrics")
METRICS_PATH = "/metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The classic text format, which every Prometheus reads. (prometheus-client >= 0.22 labels its output
1.0.0, which differs only for names outside [a-zA-Z_:][a-zA-Z0-9_:]*; ours never are.) Not OpenMetrics:
there a gauge and a counter may not share a base name, and the contract has two pairs that do
(`flowbroker_queue_held_transfers` and `_total`)."""


QUEUE_TEXT_STEP = 5
"""Queues a step reads, and whose series it builds and renders (31 series each, about 0.15-0.2 ms a queue
with 250-character names: a step of 5 is about 0.9 ms; steps of 20 were about 3 ms, past the slice, for
about 15% less CPU in all)."""
SAMPLE_STEP = 200
"""Series of another family a step renders."""
_OPENMETRICS_SUFFIXES = ("_created", "_gsum", "_gcount")  # generate_latest moves these to the family's end


def metrics_route(metrics: BrokerMetrics, turns: HttpTurns | None = None) -> Route:
    """`GET /metrics`: the broker's metrics in the Prometheus text format (version 0.0.4).

    The core is read, and its families and their text built, in steps (`_scrape_in_steps`), all on the
    trio thread, with a checkpoint every SLICE_SECONDS of work, so the broker's connections run between
    the slices, each slice in `turns` (the broker's, shared with the admin API's pages: one slice of all
    their heavy answers a pass of the scheduler, broker/httpturns.py). Not in a worker thread: the render
    held the interpreter's lock, and the trio thread waited for it at every wake-up; scrapes of 11,000 queues (1.8-3.2 s each) stalled a tester's data
    connections by 134-765 ms. One scrape built at a time; requests that came while it was built share
    the next one (each gets a text read after it asked). At most SCRAPES_HELD built texts are held while
    their clients take them: clients that asked and never read kept a whole text each, twelve of them 220
    MiB over a 128 MiB quota (a tester). Past that, the oldest is let go and its clients cut off, rather than
    the new request refused: four slow readers reconnecting kept every scrape at 503 (a tester)."""
    one_at_a_time = trio.Lock()
    held = _Held()
    turns = turns if turns is not None else HttpTurns()

    async def endpoint(request: Request) -> Response:
        asked = held.started
        try:
            async with one_at_a_time:
                text = held.latest
                if text is None or text.started <= asked or text.gone:
                    held.started += 1
                    text = _Text(held.started)
                    await turns.build(_scrape_in_steps(metrics), text.pieces, SLICE_SECONDS)
                    held.keep(text)
        except Exception as exc:  # a bug in a collector must not take the broker down: say so and log it
            LOGGER.exception("GET /metrics failed")
            return PlainTextResponse(f"internal error: {type(exc).__name__}: {exc}\n", status_code=500)
        # Sent piece by piece, not joined into a second copy of the whole text: 20,000 queues of
        # 255-character names are 190 MB of text, and the scrape took RSS up by 474 MiB (a tester).
        # Chunked, as Prometheus takes it.
        return StreamingResponse(_Pieces(text, held), media_type=CONTENT_TYPE)

    return Route(METRICS_PATH, endpoint, methods=["GET"])


SCRAPES_HELD = 4
"""Built scrapes whose text is not yet all taken by its clients, at most (GET /metrics)."""


class ScrapeLetGo(Exception):
    """A scrape's text was let go before its client took it all (SCRAPES_HELD newer ones were asked for):
    the response ends unfinished, so the client sees an error, never a text cut short."""


class _LetGoInOneLine(logging.Filter):
    """hypercorn logs an answer that ended with an exception as an ERROR with its traceback (some 40
    lines); a scrape let go is expected under load, so it is one WARNING line saying why."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ScrapeLetGo):
            record.msg, record.args, record.exc_info, record.exc_text = str(exc), (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


HTTP_LOGGER.addFilter(_LetGoInOneLine())


class _Text:
    """One built scrape: its pieces, and how many responses are sending them."""

    def __init__(self, started: int):
        self.started = started  # scrapes started so far, this one included: a request that saw fewer asked
        # before it began
        self.pieces: list[bytes] = []
        self.readers = 0
        self.gone = False  # let go: its readers took it all, or it was the oldest past SCRAPES_HELD

    def let_go(self) -> None:
        self.gone = True
        self.pieces = []


class _Held:
    """The built scrapes being sent, oldest first, and the latest one built (requests that waited while
    it was built share it)."""

    def __init__(self) -> None:
        self.started = 0
        self.latest: _Text | None = None
        self.texts: collections.OrderedDict[int, _Text] = collections.OrderedDict()

    def keep(self, text: _Text) -> None:
        """A text was built: held until its readers are done; the oldest is let go past SCRAPES_HELD."""
        while len(self.texts) >= SCRAPES_HELD:
            _, oldest = self.texts.popitem(last=False)
            oldest.let_go()
        self.texts[text.started] = text
        self.latest = text

    def release(self, text: _Text) -> None:
        """A response is done with `text` (taken to its end, or dropped with its client)."""
        text.readers -= 1
        if not text.readers and self.texts.pop(text.started, None) is not None:
            text.let_go()


class _Pieces:
    """A response's pieces of its scrape's text; counted as a reader of the text until the last is taken
    or the response is dropped (its client cut off: the writes' TCP_USER_TIMEOUT ends one that never
    reads). An iterator object, not an async generator: one that a client never reads to the end is
    dropped with no finaliser to run but this one's count."""

    def __init__(self, text: _Text, held: _Held):
        self._text = text
        self._next = 0
        self._held: _Held | None = held
        text.readers += 1

    def __aiter__(self) -> _Pieces:
        return self

    async def __anext__(self) -> bytes:
        text = self._text
        if text.gone:
            self._done()
            raise ScrapeLetGo(f"GET /metrics: the answer was let go before its client took it all ({SCRAPES_HELD} "
                              "newer scrapes were asked for meanwhile)")
        if self._next >= len(text.pieces):
            self._done()
            raise StopAsyncIteration
        self._next += 1
        return text.pieces[self._next - 1]

    def _done(self) -> None:
        if self._held is not None:
            self._held.release(self._text)
            self._held = None

    def __del__(self) -> None:
        self._done()


def _render(scrape: Scrape, process: Collector) -> bytes:
    """The text of a scrape read in full, in one go: `generate_latest` over its families."""
    return generate_latest(Families(scrape.families(), process))


def _scrape_in_steps(metrics: BrokerMetrics) -> Iterator[bytes]:
    """A whole scrape in small steps (b"" for those that make no text): joined, the very bytes of `_render`
    for the same state. The queues are read QUEUE_TEXT_STEP at a time and their series built and rendered
    at once; each per-queue family's text is kept (bytes) until every queue's is made, then given family by
    family, and the other families' series are rendered SAMPLE_STEP at a time. A part of a family is
    rendered by `generate_latest` alone, its "# HELP" and "# TYPE" lines kept for the family's first part
    only. So a scrape holds the figures of a few queues at a time, never a copy of every queue's nor a
    series object per queue and figure: at 10,000 queues those 320,000 long-lived objects set off the
    garbage collector's full passes over the broker's heap, 110-170 ms each, on whichever thread."""
    scrape = metrics.collector.scrape()
    for metric in scrape.head_families():
        yield from _metric_text(metric)
    texts: list[list[bytes]] = [[generate_latest(Families([family]))] for family in scrape.queue_families([])]
    while (page := scrape.next_queues(QUEUE_TEXT_STEP)) is not None:  # (no queues: HELP and TYPE alone)
        for text, family in zip(texts, scrape.queue_families(page), strict=True):
            text.append(_without_header(generate_latest(Families([family]))))
        yield b""
    for text in texts:
        yield b"".join(text)
    for metric in [*scrape.tail_families(), *metrics.process.collect()]:
        yield from _metric_text(metric)


def _without_header(text: bytes) -> bytes:
    """A family's text without its first two lines ("# HELP", "# TYPE": one line each, newlines escaped)."""
    return text.split(b"\n", 2)[2]


def _metric_text(metric: Metric) -> Iterator[bytes]:
    """One family's text, SAMPLE_STEP series at a time."""
    samples = metric.samples
    moved = {metric.name + suffix for suffix in _OPENMETRICS_SUFFIXES}
    if len(samples) <= SAMPLE_STEP or any(sample.name in moved for sample in samples):
        yield generate_latest(Families([metric]))
        return
    for start in range(0, len(samples), SAMPLE_STEP):
        part = copy.copy(metric)
        part.samples = samples[start:start + SAMPLE_STEP]
        text = generate_latest(Families([part]))
        yield _without_header(text) if start else text


class MetricsServer(HttpListener):
    """`/metrics` on a port of its own (`[metrics] endpoint = "host:port"`), in the broker's nursery.

    `bind()` before any nursery (an address in use is a plain error at start, as for the admin API),
    then `await nursery.start(server.serve)`; `shutdown()` stops it. With `token`, scrapes need it."""

    logger = LOGGER

    def __init__(self, config: MetricsConfig, metrics: BrokerMetrics, token: str | None = None,
                 users: AdminUsers | None = None, turns: HttpTurns | None = None):
        """`users`: admin users, whose HTTP Basic credentials a scrape may give instead of the token, as on
        the admin port (a monitoring user's scrape was 200 there and 401 here, a tester). `turns`: the
        broker's turn for heavy HTTP answers, shared with the admin API's pages."""
        super().__init__(*config.address(), "metrics", config.max_connections)
        self.config = config
        app: ASGIApp = Starlette(routes=[metrics_route(metrics, turns)])
        self.app = BearerAuth(app, token, users=users) if token is not None else app

    def _serving_line(self) -> str:
        return (f"metrics on http://{url_host(self.host)}:{self.port}{METRICS_PATH} "
                f"({'admin token required' if self.config.require_token else 'no token required'})")
