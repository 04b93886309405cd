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

Each broker has its own `CollectorRegistry` (`broker_registry`), with the process collector in it:
tests run several brokers in one process, and the global default registry would mix them up. Nothing
here does I/O; broker/metricshttp.py serves the registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flowbroker.broker.core import BrokerCore
from flowbroker.broker.queue import Queue
from flowbroker.broker.udp.datapath import REFUSAL_REASONS
from flowbroker.broker.views import connection_role, stopped_destinations
from flowbroker.protocol.errors import ErrorCode

__all__ = ["BrokerCollector", "ROLES", "broker_registry", "build_version"]

ROLES = ("producer", "consumer", "both", "idle")
"""Values of `flowbroker_connections{role}` (broker/views.py `connection_role`), each always served."""

_QUEUE = ["queue"]
_PRODUCER = ["connection", "client_name"]


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


class BrokerCollector(Collector):
    """Every `flowbroker_*` family of docs/metrics.md, read from `core` when collected."""

    def __init__(self, core: BrokerCore, max_producer_series: int = 100):
        self.core = core
        self.max_producer_series = max_producer_series
        self.version = build_version()

    def collect(self) -> Iterator[Metric]:
        now = self.core.clock_ns()
        yield from self._broker()
        yield from self._queues(now)
        yield from self._connections(now)
        yield from self._udp()

    # -- broker-wide -----------------------------------------------------------------------------

    def _broker(self) -> Iterator[Metric]:
        core = self.core
        build = _gauge("flowbroker_build_info", "The flowbroker version serving, always 1.", ["version"])
        build.add_metric([self.version], 1)
        yield build
        yield CounterMetricFamily("flowbroker_connections_opened", "Connections opened (a UDP publication's "
                                  "session counts as one).", value=core.connections_opened)
        yield CounterMetricFamily("flowbroker_connections_closed", "Connections ended, for any reason.",
                                  value=core.connections_closed)
        yield GaugeMetricFamily("flowbroker_queues", "Queues declared.", value=len(core.queues))
        memory, server = core.memory, core.config.server
        yield GaugeMetricFamily("flowbroker_memory_quota_bytes", "[server] memory_quota: what the credit pools "
                                "are carved from.", value=server.memory_quota)
        yield GaugeMetricFamily("flowbroker_memory_watermark_bytes", "Bytes of messages held that raise the "
                                "memory alarm.", value=memory.watermark)
        yield GaugeMetricFamily("flowbroker_memory_held_bytes", "Bytes of messages the queues hold "
                                "(message_size), as the watermark counts them.", value=memory.held)
        yield GaugeMetricFamily("flowbroker_memory_alarm", "1 while the memory alarm stops every producer.",
                                value=int(memory.alarm))
        yield CounterMetricFamily("flowbroker_memory_alarms", "Times the memory alarm was raised.",
                                  value=memory.alarms_total)
        credit = core.credit
        yield GaugeMetricFamily("flowbroker_credit_pool_bytes", "The credit pool producers' buffers are granted "
                                "from.", value=credit.pool)
        yield GaugeMetricFamily("flowbroker_credit_granted_bytes", "Credit granted to producers now, in total.",
                                value=credit.total_granted())
        yield GaugeMetricFamily("flowbroker_credit_waiting_producers", "Producers waiting for a share of the pool.",
                                value=credit.waiting())
        yield GaugeMetricFamily("flowbroker_producers_stopped", "1 while an operator's stop-all is in force.",
                                value=int(core.producers_stopped))
        yield CounterMetricFamily("flowbroker_unroutable_messages", "Messages no binding routed.",
                                  value=core.unroutable)
        yield CounterMetricFamily("flowbroker_credit_violations", "Connections closed for sending past their "
                                  "credit.", value=core.credit_violations)
        refused = _counter("flowbroker_frames_refused", "ERROR frames sent, by error code.", ["code"])
        sent = core.errors_sent
        for code in ErrorCode:  # every code, 0 until it happens: rate() needs the series before the first
            refused.add_metric([code.name], sent.get(code, 0))
        yield refused

    # -- queues ----------------------------------------------------------------------------------

    def _queues(self, now: int) -> Iterator[Metric]:
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
        stuck_by_queue = self._stuck_subscriptions(now)
        for queue in self.core.queues.values():
            st = queue.statistics()
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
            saturated.add_metric(label, int(st.saturated))
            saturated_for.add_metric(label, _seconds(now, st.saturated_since_ns) if st.saturated else 0.0)
            saturations.add_metric(label, st.flow_stopped_count)
            held.add_metric(label, st.held_transfers)
            held_total.add_metric(label, st.held_total)
            stopped.add_metric(label, st.flow_stopped_producers)
            consumers.add_metric(label, st.subscriptions)
            stuck.add_metric(label, stuck_by_queue.get(queue, 0))
            enqueued.add_metric(label, st.enqueued)
            dequeued.add_metric(label, st.dequeued)
            rejected.add_metric(label, st.consumer_rejected)
            dropped.add_metric([st.name, "overflow"], st.dropped)
            refused.add_metric(label, st.rejected)
        yield from (messages, ready, unsettled, size, stop_count, resume_count, stop_size, resume_size, max_count,
                    max_size, saturated, saturated_for, saturations, held, held_total, stopped, consumers, stuck,
                    enqueued, dequeued, rejected, dropped, refused)

    def _stuck_subscriptions(self, now: int) -> dict[Queue, int]:
        """Per queue, the subscriptions of connections stalled (Session.consumer_stalled) for at least
        stuck_timeout: one pass over the connections, and over the subscriptions of stalled ones only."""
        timeout_ns = int(self.core.config.server.stuck_timeout * 1e9)
        counts: dict[Queue, int] = {}
        for session in self.core.sessions.values():
            since = session.stalled_since_ns
            if since is not None and now - since >= timeout_ns:
                for sub in session.subscriptions.values():
                    counts[sub.queue] = counts.get(sub.queue, 0) + 1
        return counts

    # -- connections and producers -----------------------------------------------------------------

    def _connections(self, now: int) -> Iterator[Metric]:
        g = _gauge
        roles = dict.fromkeys(ROLES, 0)
        granted = g("flowbroker_producer_granted_bytes", "The credit buffer granted.", _PRODUCER)
        unacked = g("flowbroker_producer_unacknowledged_bytes", "Received and not yet given back as credit.",
                    _PRODUCER)
        flow_stopped = g("flowbroker_producer_flow_stopped", "1 while any destination has it flow-stopped.",
                         _PRODUCER)
        stopped_for = g("flowbroker_producer_flow_stopped_seconds", "How long it has been flow-stopped "
                        "(0 when not).", _PRODUCER)
        stops = _counter("flowbroker_producer_flow_stops", "Times it was told FLOW_STOPPED.", _PRODUCER)
        received = _counter("flowbroker_producer_received_bytes", "Bytes of transfers received.", _PRODUCER)
        info = g("flowbroker_flow_stop_info", "1 for each (producer, queue) where the queue ('*': a broker-wide "
                 "stop) holds the producer stopped, and by which threshold.", _PRODUCER + ["queue", "threshold"])
        limit = self.max_producer_series
        shown = dropped = 0
        for session in self.core.sessions.values():
            role = connection_role(session)
            roles[role] += 1
            if role not in ("producer", "both"):
                continue
            if shown >= limit:
                dropped += 1
                continue
            shown += 1
            label = [str(session.conn_id), session.client_name]
            window = session.transfers.window
            granted.add_metric(label, session.buffer_size)
            unacked.add_metric(label, window.position - window.acked_position)
            destinations = stopped_destinations(session)
            flow_stopped.add_metric(label, int(bool(destinations)))
            stopped_for.add_metric(label, _seconds(now, destinations[0][1]) if destinations else 0.0)
            stops.add_metric(label, session.flow_stops)
            received.add_metric(label, window.position)
            for destination, _since, _reason, threshold, _limit, _value in destinations:
                info.add_metric(label + [destination, threshold], 1)
        connections = g("flowbroker_connections", "Open connections by what they did.", ["role"])
        for role, count in roles.items():
            connections.add_metric([role], count)
        yield connections
        yield from (granted, unacked, flow_stopped, stopped_for, stops, received, info)
        yield GaugeMetricFamily("flowbroker_producer_series_dropped", "Producers left out by [metrics] "
                                "max_producer_series.", value=dropped)

    # -- the UDP data path -------------------------------------------------------------------------

    def _udp(self) -> Iterator[Metric]:
        datapath = self.core.udp
        if datapath is None:  # [udp] enabled = false: no UDP series at all
            return
        st = datapath.statistics()
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
        yield CounterMetricFamily("flowbroker_udp_naks_received", "NAKs received from UDP consumers.",
                                  value=st.naks_received_total)
        yield CounterMetricFamily("flowbroker_udp_retransmits", "Retransmissions sent.",
                                  value=st.retransmits_sent_total)


def broker_registry(core: BrokerCore, max_producer_series: int = 100) -> CollectorRegistry:
    """A registry of this broker's own: its collector and the process's `process_*` series."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(core, max_producer_series))
    ProcessCollector(registry=registry)
    return registry
