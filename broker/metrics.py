"""The broker's state as Prometheus metrics (docs/metrics.md): one collector over `BrokerCore`.

`BrokerCollector.collect()` runs at scrape time and reads what the broker keeps anyway: queue, session
and data-path `statistics()`, the credit allocator, the memory meter, and the few counters kept on
transition paths (connections opened and closed, ERROR frames by code, credit violations, flow stops,
the loss figures of closed UDP images). So a message's way through the broker costs nothing more
with metrics on, and a scrape costs what it reads: one pass over the queues and one over the
connections, nothing quadratic.

Cardinality is bounded by what the broker bounds: queues by `max_queues`; per-connection series exist
for producers only (consumers are counted per queue), for the first `[metrics] max_producer_series`
by connection id, and `flowbroker_flow_stop_info` lists at most `views.NESTED_LIMIT` destinations of
each. Label values are escaped by prometheus-client.

A scrape's CPU still grows with the queues (~130 us each: `benchmarks/metrics_scrape_cost.py`), and the
broker has one thread. So a scrape is a `Scrape` read in steps: the HTTP shell (broker/metricshttp.py)
reads a few queues at a time (`next_queues`), builds and renders their families at once, and lets every
connection run between steps, all on the broker's thread (a worker thread rendering held the interpreter's
lock and the broker's thread waited for it). A big scrape then delays messages by milliseconds, not by
seconds. `families()` builds every family in one go (the collector's `collect`, for `generate_latest`).

Each broker has its own `CollectorRegistry` (`broker_metrics`), with the process collector in it: tests
run several brokers in one process, and the global default registry would mix them up. Nothing here
does I/O; broker/metricshttp.py serves it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flowbroker.broker.core import BrokerCore
from flowbroker.broker.queue import QueueStatistics
from flowbroker.broker.udp.datapath import REFUSAL_REASONS
from flowbroker.broker.views import connection_role, stopped_destinations
from flowbroker.protocol.errors import ErrorCode

__all__ = ["BrokerCollector", "BrokerMetrics", "Families", "QUEUE_STEP", "ROLES", "Scrape", "broker_metrics",
           "broker_registry", "build_version"]

ROLES = ("producer", "consumer", "both", "idle")
"""Values of `flowbroker_connections{role}` (broker/views.py `connection_role`), each always served."""

QUEUE_STEP = 200
"""Queues a scrape reads per step: ~2-3 ms of the event loop on a 2-core machine, like a reader's turn."""

_QUEUE = ["queue"]
_Family = GaugeMetricFamily | CounterMetricFamily
_PRODUCER = ["connection", "client_name", "identity"]
MAX_LABEL_CHARS = 128
"""A client's own name (up to a control frame long) in a label: cut, so 100 producers with 65,000-character
names cannot make every scrape 46 MB (a tester), nor Prometheus store them."""


def build_version() -> str:
    """The installed flowbroker's version ("unknown" when it runs from a tree that is not installed)."""
    try:
        return version("flowbroker")
    except PackageNotFoundError:
        return "unknown"


def _seconds(now_ns: int, since_ns: int) -> float:
    return max(0, now_ns - since_ns) / 1e9


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


@dataclass(frozen=True, slots=True)
class _ProducerRow:
    label: list[str]  # connection id, client name, identity (the authenticated user)
    granted: int
    unacknowledged: int
    stopped_seconds: float | None  # None while not flow-stopped
    flow_stops: int
    paced_total: int
    received: int
    stops: list[tuple[str, str]]  # (destination, threshold) holding it stopped


class Scrape:
    """One scrape, in two halves. Reading (`Scrape(core, ...)`, then `read_queues` until it says done)
    touches the core and must run on its thread; it only copies figures (immutable `statistics()`
    snapshots, numbers, strings), in steps of a few hundred queues so that the HTTP shell can let the
    broker's connections run between them. Building the metric families from the copy (`families`)
    touches nothing live, so the shell does it, and the text, in a worker thread. The queues are read
    in name order by pages (broker/paging.py): a queue declared or deleted during a scrape may be in it
    or not, as with the admin API's pages; none is read twice."""

    def __init__(self, core: BrokerCore, max_producer_series: int, version: str):
        self.core = core
        self.now = now = core.clock_ns()
        self.version = version
        memory, credit, server = core.memory, core.credit, core.config.server
        self.scalars = {
            "opened": core.connections_opened, "closed": core.connections_closed, "queues": len(core.queues),
            "quota": server.memory_quota, "watermark": memory.watermark, "held": memory.held,
            "alarm": int(memory.alarm), "alarms": memory.alarms_total, "pool": credit.pool,
            "granted": credit.total_granted(), "waiting": credit.waiting(),
            "stopped": int(core.producers_stopped), "unroutable": core.unroutable,
            "violations": core.credit_violations,
        }
        self.errors = dict(core.errors_sent)
        throttle = core.login_throttle
        self.throttle = (throttle.delayed, throttle.refused, len(throttle)) if throttle is not None else (0, 0, 0)
        self.idempotence = core.producer_sequences.statistics()
        self.udp = core.udp.statistics() if core.udp is not None else None
        # One pass over the connections: roles, producer rows (bounded), stalled consumers' queues.
        self.roles = dict.fromkeys(ROLES, 0)
        self.producers: list[_ProducerRow] = []
        self.producers_dropped = 0
        self.stuck: dict[str, int] = {}
        self.consumer_buffers: dict[str, list[int]] = {}  # queue -> [buffer bytes, unacknowledged bytes]
        stuck_ns = int(server.stuck_timeout * 1e9)
        for session in core.sessions.values():
            role = connection_role(session)
            self.roles[role] += 1
            since = session.stalled_since_ns
            if since is not None and now - since >= stuck_ns:
                for sub in session.subscriptions.values():
                    self.stuck[sub.queue.name] = self.stuck.get(sub.queue.name, 0) + 1
            for sub in session.subscriptions.values():
                sums = self.consumer_buffers.setdefault(sub.queue.name, [0, 0])
                sender = sub.sender_window
                if sender.window:  # a consumer without a byte buffer acknowledges nothing: its count only grows
                    sums[0] += sender.window
                    sums[1] += sender.outstanding
            if role not in ("producer", "both"):
                continue
            if len(self.producers) >= max_producer_series:
                self.producers_dropped += 1
                continue
            window = session.transfers.window
            stops = stopped_destinations(session)
            self.producers.append(_ProducerRow(
                [str(session.conn_id), session.client_name[:MAX_LABEL_CHARS], session.identity[:MAX_LABEL_CHARS]],
                session.buffer_size,
                window.position - window.acked_position, _seconds(now, stops[0][1]) if stops else None,
                session.flow_stops, session.paced_total, window.position, [(stop[0], stop[3]) for stop in stops],
            ))
        self.queues: list[QueueStatistics] = []
        self._after: str | None = None
        self._done = False

    def read_queues(self, limit: int = QUEUE_STEP) -> bool:
        """Copy the next `limit` queues' statistics; True once every queue is read."""
        if not self._done:
            page, self._after = self.core.queues.page(self._after, limit)
            self.queues.extend(queue.statistics() for queue in page)
            self._done = self._after is None
        return self._done

    def next_queues(self, limit: int = QUEUE_STEP) -> list[QueueStatistics] | None:
        """The next `limit` queues' statistics, not kept (`read_queues` keeps them); None once every queue
        is read. The HTTP shell renders each page at once, so a scrape never holds a copy of every queue's."""
        if self._done:
            return None
        page, self._after = self.core.queues.page(self._after, limit)
        self._done = self._after is None
        return [queue.statistics() for queue in page]

    def read_all(self) -> Scrape:
        while not self.read_queues():
            pass
        return self

    def families(self) -> list[Metric]:
        """Every `flowbroker_*` family, built from the copy alone (safe in another thread)."""
        return [*self.head_families(), *self.queue_families(self.queues), *self.tail_families()]

    def head_families(self) -> list[Metric]:
        """The broker-wide families, which `families()` gives first."""
        return list(self._broker())

    def queue_families(self, queues: list[QueueStatistics]) -> list[_Family]:
        """The per-queue families, in their order in `families()`, holding the series of `queues` alone:
        the HTTP shell reads, builds and renders them a few queues at a time (broker/metricshttp.py)."""
        families = self._queue_families()
        self._add_queues(families, queues)
        return families

    def tail_families(self) -> list[Metric]:
        """The connections' and the UDP data path's families, which `families()` gives last."""
        return [*self._connections(), *self._udp()]

    # -- broker-wide -----------------------------------------------------------------------------

    def _broker(self) -> Iterator[Metric]:
        v = self.scalars
        build = _gauge("flowbroker_build_info", "The flowbroker version serving, always 1.", ["version"])
        build.add_metric([self.version], 1)
        yield build
        yield CounterMetricFamily("flowbroker_connections_opened", "Connections opened (a UDP publication's "
                                  "session counts as one).", value=v["opened"])
        yield CounterMetricFamily("flowbroker_connections_closed", "Connections ended, for any reason.",
                                  value=v["closed"])
        yield GaugeMetricFamily("flowbroker_queues", "Queues declared.", value=v["queues"])
        yield GaugeMetricFamily("flowbroker_memory_quota_bytes", "[server] memory_quota: what the credit pools "
                                "are carved from.", value=v["quota"])
        yield GaugeMetricFamily("flowbroker_memory_watermark_bytes", "Bytes of messages held that raise the "
                                "memory alarm.", value=v["watermark"])
        yield GaugeMetricFamily("flowbroker_memory_held_bytes", "Bytes of messages the queues hold "
                                "(message_size), as the watermark counts them.", value=v["held"])
        yield GaugeMetricFamily("flowbroker_memory_alarm", "1 while the memory alarm stops every producer.",
                                value=v["alarm"])
        yield CounterMetricFamily("flowbroker_memory_alarms", "Times the memory alarm was raised.",
                                  value=v["alarms"])
        yield GaugeMetricFamily("flowbroker_credit_pool_bytes", "The credit pool producers' buffers are granted "
                                "from.", value=v["pool"])
        yield GaugeMetricFamily("flowbroker_credit_granted_bytes", "Credit granted to producers now, in total.",
                                value=v["granted"])
        yield GaugeMetricFamily("flowbroker_credit_waiting_producers", "Producers waiting for a share of the pool.",
                                value=v["waiting"])
        yield GaugeMetricFamily("flowbroker_producers_stopped", "1 while an operator's stop-all is in force.",
                                value=v["stopped"])
        yield CounterMetricFamily("flowbroker_unroutable_messages", "Messages no binding routed.",
                                  value=v["unroutable"])
        yield CounterMetricFamily("flowbroker_credit_violations", "Connections closed for sending past their "
                                  "credit.", value=v["violations"])
        refused = _counter("flowbroker_frames_refused", "ERROR frames sent, by error code.", ["code"])
        for code in ErrorCode:  # every code, 0 until it happens: rate() needs the series before the first
            refused.add_metric([code.name], self.errors.get(code, 0))
        yield refused
        delayed, throttled, sources = self.throttle
        yield CounterMetricFamily("flowbroker_logins_delayed", "Login attempts made to wait their turn because "
                                  "their address failed logins recently.", value=delayed)
        yield CounterMetricFamily("flowbroker_logins_throttled", "Login attempts refused unlooked: their "
                                  "address had failed_login_max_delay of attempts queued.", value=throttled)
        yield GaugeMetricFamily("flowbroker_login_throttle_sources", "Source addresses with recent failed logins "
                                "the throttle remembers (at most 10,000).", value=sources)
        ids = self.idempotence
        yield GaugeMetricFamily("flowbroker_idempotent_producer_ids", "Producer ids whose sequences the broker "
                                "tracks.", value=ids.producer_ids)
        yield CounterMetricFamily("flowbroker_idempotent_duplicates", "Idempotent producers' messages completed "
                                  "at once as duplicates, not enqueued.", value=ids.duplicates)
        yield CounterMetricFamily("flowbroker_idempotent_sequence_gaps", "Messages refused with SEQUENCE_GAP.",
                                  value=ids.gaps)

    # -- queues ----------------------------------------------------------------------------------

    def _queue_families(self) -> list[_Family]:
        """The per-queue families, empty, in the order they are served (`_add_queues` fills them)."""
        g, c = _gauge, _counter
        messages = g("flowbroker_queue_messages", "Depth the watermarks compare: ready + unsettled.", _QUEUE)
        ready = g("flowbroker_queue_ready_messages", "Messages waiting for a consumer.", _QUEUE)
        unsettled = g("flowbroker_queue_unsettled_messages", "Messages delivered, waiting for ack/reject.", _QUEUE)
        size = g("flowbroker_queue_bytes", "Bytes of the depth (message_size).", _QUEUE)
        stop_count = g("flowbroker_queue_flow_stop_messages", "Stop watermark in messages (0 = off).", _QUEUE)
        resume_count = g("flowbroker_queue_flow_resume_messages", "Resume watermark in messages.", _QUEUE)
        stop_size = g("flowbroker_queue_flow_stop_bytes", "Stop watermark in bytes (0 = off).", _QUEUE)
        resume_size = g("flowbroker_queue_flow_resume_bytes", "Resume watermark in bytes.", _QUEUE)
        max_count = g("flowbroker_queue_max_messages", "Hard limit in messages (0 = none).", _QUEUE)
        max_size = g("flowbroker_queue_max_bytes", "Hard limit in bytes (0 = none).", _QUEUE)
        stop_drain = g("flowbroker_queue_flow_stop_drain_seconds", "Stop when the ready backlog's estimated "
                       "drain time exceeds this (0 = off).", _QUEUE)
        resume_drain = g("flowbroker_queue_flow_resume_drain_seconds", "Resume under this drain time.", _QUEUE)
        stop_age = g("flowbroker_queue_flow_stop_age_seconds", "Stop when the oldest ready message is older "
                     "(0 = off).", _QUEUE)
        resume_age = g("flowbroker_queue_flow_resume_age_seconds", "Resume under this age.", _QUEUE)
        drain_rate = g("flowbroker_queue_drain_rate", "Messages settled per second, the flow timer's smoothed "
                       "estimate (policies/drain.py).", _QUEUE)
        oldest_age = g("flowbroker_queue_oldest_ready_age_seconds", "Age of the oldest ready message at the last "
                       "flow tick (0.1 s resolution).", _QUEUE)
        saturated = g("flowbroker_queue_saturated", "1 while over a stop watermark.", _QUEUE)
        saturated_for = g("flowbroker_queue_saturated_seconds", "How long the current saturation has lasted "
                          "(0 when not saturated).", _QUEUE)
        saturations = c("flowbroker_queue_saturations", "Times the queue became saturated.", _QUEUE)
        held = g("flowbroker_queue_held_transfers", "Producer transfers the queue holds uncompleted now.", _QUEUE)
        held_total = c("flowbroker_queue_held_transfers", "Transfers ever held.", _QUEUE)
        stopped = g("flowbroker_queue_flow_stopped_producers", "Producers this queue has told FLOW_STOPPED.", _QUEUE)
        consumers = g("flowbroker_queue_consumers", "Subscriptions.", _QUEUE)
        stuck = g("flowbroker_queue_stuck_consumers", "Subscriptions whose connection's consumer buffer has been "
                  "full with no acknowledgement for [server] stuck_timeout.", _QUEUE)
        enqueued = c("flowbroker_queue_enqueued_messages", "Messages ever enqueued.", _QUEUE)
        dequeued = c("flowbroker_queue_dequeued_messages", "Messages gone for good (settled, dropped, purged).",
                     _QUEUE)
        rejected = c("flowbroker_queue_rejected_messages", "Messages consumers rejected.", _QUEUE)
        dropped = c("flowbroker_queue_dropped_messages", "Messages the broker dropped, by reason.",
                    ["queue", "reason"])
        refused = c("flowbroker_queue_refused_transfers", "Transfers refused by a hard limit (overflow reject).",
                    _QUEUE)
        buffer = g("flowbroker_queue_consumer_buffer_bytes", "Byte buffers its subscriptions' consumers granted "
                   "(0: not flow-controlled), summed.", _QUEUE)
        buffer_unacked = g("flowbroker_queue_consumer_unacknowledged_bytes", "Bytes delivered to its consumers "
                           "and not yet acknowledged (BUFFER_ACK), summed.", _QUEUE)
        return [messages, ready, unsettled, size, stop_count, resume_count, stop_size, resume_size, max_count,
                max_size, stop_drain, resume_drain, stop_age, resume_age, drain_rate, oldest_age, saturated,
                saturated_for, saturations, held, held_total, stopped, consumers, stuck,
                buffer, buffer_unacked,
                enqueued, dequeued, rejected, dropped, refused]

    def _add_queues(self, families: list[_Family], queues: list[QueueStatistics]) -> None:
        """Each of `queues`' series, to the families of `_queue_families`."""
        (messages, ready, unsettled, size, stop_count, resume_count, stop_size, resume_size, max_count,
         max_size, stop_drain, resume_drain, stop_age, resume_age, drain_rate, oldest_age, saturated,
         saturated_for, saturations, held, held_total, stopped, consumers, stuck,
         buffer, buffer_unacked,
         enqueued, dequeued, rejected, dropped, refused) = families
        stuck_by_queue, buffers, now = self.stuck, self.consumer_buffers, self.now
        for st in queues:
            t = st.thresholds
            label = [st.name]
            messages.add_metric(label, st.messages)
            ready.add_metric(label, st.ready_messages)
            unsettled.add_metric(label, st.unsettled_messages)
            size.add_metric(label, st.bytes)
            stop_count.add_metric(label, t.flow_stop_count)
            resume_count.add_metric(label, t.flow_resume_count)
            stop_size.add_metric(label, t.flow_stop_size)
            resume_size.add_metric(label, t.flow_resume_size)
            max_count.add_metric(label, t.max_count)
            max_size.add_metric(label, t.max_size)
            stop_drain.add_metric(label, t.flow_stop_drain_time)
            resume_drain.add_metric(label, t.flow_resume_drain_time)
            stop_age.add_metric(label, t.flow_stop_age)
            resume_age.add_metric(label, t.flow_resume_age)
            drain_rate.add_metric(label, st.drain_rate)
            oldest_age.add_metric(label, st.oldest_ready_age)
            saturated.add_metric(label, int(st.saturated))
            saturated_for.add_metric(label, _seconds(now, st.saturated_since_ns) if st.saturated else 0.0)
            saturations.add_metric(label, st.flow_stopped_count)
            held.add_metric(label, st.held_transfers)
            held_total.add_metric(label, st.held_total)
            stopped.add_metric(label, st.flow_stopped_producers)
            consumers.add_metric(label, st.subscriptions)
            stuck.add_metric(label, stuck_by_queue.get(st.name, 0))
            sizes = buffers.get(st.name, (0, 0))
            buffer.add_metric(label, sizes[0])
            buffer_unacked.add_metric(label, sizes[1])
            enqueued.add_metric(label, st.enqueued)
            dequeued.add_metric(label, st.dequeued)
            rejected.add_metric(label, st.consumer_rejected)
            dropped.add_metric([st.name, "overflow"], st.dropped)
            refused.add_metric(label, st.rejected)

    # -- connections and producers -----------------------------------------------------------------

    def _connections(self) -> Iterator[Metric]:
        g = _gauge
        connections = g("flowbroker_connections", "Open connections by what they did.", ["role"])
        for role, count in self.roles.items():
            connections.add_metric([role], count)
        yield connections
        granted = g("flowbroker_producer_granted_bytes", "The credit buffer granted.", _PRODUCER)
        unacked = g("flowbroker_producer_unacknowledged_bytes", "Received and not yet given back as credit.",
                    _PRODUCER)
        flow_stopped = g("flowbroker_producer_flow_stopped", "1 while any destination has it flow-stopped.",
                         _PRODUCER)
        stopped_for = g("flowbroker_producer_flow_stopped_seconds", "How long it has been flow-stopped "
                        "(0 when not).", _PRODUCER)
        stops = _counter("flowbroker_producer_flow_stops", "Times it was told FLOW_STOPPED.", _PRODUCER)
        received = _counter("flowbroker_producer_received_bytes", "Bytes of transfers received.", _PRODUCER)
        paced = _counter("flowbroker_producer_paced", "Times its completions and credit waited for a queue it "
                         "routed to to catch up with its consumers ([queues] pace_producers).", _PRODUCER)
        info = g("flowbroker_flow_stop_info", "1 for each (producer, queue) where the queue ('*': a broker-wide "
                 "stop) holds the producer stopped, and by which threshold.", _PRODUCER + ["queue", "threshold"])
        for row in self.producers:
            label = row.label
            granted.add_metric(label, row.granted)
            unacked.add_metric(label, row.unacknowledged)
            flow_stopped.add_metric(label, int(row.stopped_seconds is not None))
            stopped_for.add_metric(label, row.stopped_seconds or 0.0)
            stops.add_metric(label, row.flow_stops)
            received.add_metric(label, row.received)
            paced.add_metric(label, row.paced_total)
            for destination, threshold in row.stops:
                info.add_metric(label + [destination, threshold], 1)
        yield from (granted, unacked, flow_stopped, stopped_for, stops, received, paced, info)
        yield GaugeMetricFamily("flowbroker_producer_series_dropped", "Producers left out by [metrics] "
                                "max_producer_series.", value=self.producers_dropped)

    # -- the UDP data path -------------------------------------------------------------------------

    def _udp(self) -> Iterator[Metric]:
        st = self.udp
        if st is None:  # [udp] enabled = false: no UDP series at all
            return
        yield GaugeMetricFamily("flowbroker_udp_publications", "Registered UDP producers.", value=st.publications)
        yield GaugeMetricFamily("flowbroker_udp_subscriptions", "UDP consumers.", value=st.subscriptions)
        yield GaugeMetricFamily("flowbroker_udp_images", "Live images.", value=st.images)
        yield CounterMetricFamily("flowbroker_udp_datagrams_received", "Datagrams read.",
                                  value=st.datagrams_received)
        refused = _counter("flowbroker_udp_datagrams_refused", "Datagrams dropped, by reason.", ["reason"])
        counts = dict(st.refused)
        for reason in dict.fromkeys(REFUSAL_REASONS + tuple(counts)):
            refused.add_metric([reason], counts.get(reason, 0))
        yield refused
        yield CounterMetricFamily("flowbroker_udp_loss_gaps", "Gaps the images found.", value=st.loss_gaps_total)
        yield CounterMetricFamily("flowbroker_udp_naks_sent", "NAKs sent.", value=st.naks_sent_total)
        yield CounterMetricFamily("flowbroker_udp_naks_received", "NAKs received from UDP consumers and multicast group members.",
                                  value=st.naks_received_total)
        yield CounterMetricFamily("flowbroker_udp_retransmits", "Retransmissions sent.",
                                  value=st.retransmits_sent_total)
        yield CounterMetricFamily("flowbroker_udp_messages_dropped", "Messages of registered UDP producers "
                                  "dropped: their envelope failed the checks or they were over term_length / 8.",
                                  value=st.messages_dropped)


class BrokerCollector(Collector):
    """Every `flowbroker_*` family of docs/metrics.md, read from `core` when collected (in one go: the
    HTTP shell uses `scrape()` and reads in steps instead)."""

    def __init__(self, core: BrokerCore, max_producer_series: int = 100):
        self.core = core
        self.max_producer_series = max_producer_series
        self.version = build_version()

    def scrape(self) -> Scrape:
        """A scrape begun: broker-wide figures and connections read, queues to read (`read_queues`)."""
        return Scrape(self.core, self.max_producer_series, self.version)

    def collect(self) -> Iterator[Metric]:
        yield from self.scrape().read_all().families()


class Families(Collector):
    """Families already built, and the process collector's, as one collector for `generate_latest`."""

    def __init__(self, families: list[Metric], process: Collector | None = None):
        self._families = families
        self._process = process

    def collect(self) -> Iterator[Metric]:
        yield from self._families
        if self._process is not None:
            yield from self._process.collect()


@dataclass
class BrokerMetrics:
    """A broker's collector, its process collector, and a registry of its own holding both (for
    `generate_latest(metrics.registry)` in one go)."""

    collector: BrokerCollector
    process: ProcessCollector
    registry: CollectorRegistry


def broker_metrics(core: BrokerCore, max_producer_series: int = 100) -> BrokerMetrics:
    """This broker's metrics: its collector and the process's `process_*` series, in a registry of its own
    (never the global default one: tests run several brokers in one process)."""
    registry = CollectorRegistry(auto_describe=False)
    collector = BrokerCollector(core, max_producer_series)
    process = ProcessCollector(registry=None)
    registry.register(collector)
    registry.register(process)
    return BrokerMetrics(collector, process, registry)


def broker_registry(core: BrokerCore, max_producer_series: int = 100) -> CollectorRegistry:
    """`broker_metrics(...).registry`: what `generate_latest` takes."""
    return broker_metrics(core, max_producer_series).registry
