"""The metrics collector (broker/metrics.py) over a real BrokerCore driven in memory: what a scrape says
as queues fill, saturate and resume, producers are flow-stopped, consumers stall, connections come and go,
and UDP images close. Every scrape goes through the text format and prometheus-client's parser, as
Prometheus would read it."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flowbroker.broker import core as core_module
from flowbroker.broker.metrics import broker_metrics, broker_registry
from flowbroker.broker.session import SessionFault
from flowbroker.broker.udp.datapath import DataPath
from flowbroker.protocol.credit import message_size
from flowbroker.protocol.frames import ClosePublication, RegisterPublication
from flowbroker.transport.publication import Publication, PublicationConfig
from flowbroker.protocol.envelope import encode_publish
from tests.broker.coreharness import Harness, MiB

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(h: Harness, max_producer_series: int = 100) -> Samples:
    """One scrape, parsed: {(sample name, labels): value}."""
    text = generate_latest(broker_registry(h.core, max_producer_series)).decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: Any) -> float:
    return samples[(name, frozenset((k, str(v)) for k, v in labels.items()))]


def series(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(labels) for (sample, labels) in samples if sample == name]


def make(**sections: Any) -> Harness:
    return Harness(credit={"policy": "static", "static_size": MiB}, **sections)


def test_a_queue_filling_saturating_and_resuming_shows_in_every_queue_and_producer_series() -> None:
    h = make()
    h.queue("orders", flow_stop_count=3, flow_resume_count=1)
    p = h.producer("feeder")
    producer = {"connection": p.session.conn_id, "client_name": "feeder", "identity": "anonymous"}
    m = scrape(h)
    assert value(m, "flowbroker_queue_messages", queue="orders") == 0
    assert value(m, "flowbroker_queue_saturated", queue="orders") == 0
    assert value(m, "flowbroker_queue_flow_stop_messages", queue="orders") == 3
    assert value(m, "flowbroker_queue_flow_resume_messages", queue="orders") == 1
    assert value(m, "flowbroker_queue_flow_stop_bytes", queue="orders") == 80 * MiB
    assert value(m, "flowbroker_queue_max_bytes", queue="orders") == 100 * MiB
    assert series(m, "flowbroker_producer_granted_bytes") == []  # connected, not a producer yet

    for i in range(5):  # the 4th and 5th are over the stop count: held
        p.send("", "orders", b"m%d" % i)
    p.pump()
    h.advance(2.5)
    m = scrape(h)
    size = message_size(b"m0")
    assert value(m, "flowbroker_queue_messages", queue="orders") == 5
    assert value(m, "flowbroker_queue_ready_messages", queue="orders") == 5
    assert value(m, "flowbroker_queue_unsettled_messages", queue="orders") == 0
    assert value(m, "flowbroker_queue_bytes", queue="orders") == 5 * size
    assert value(m, "flowbroker_memory_held_bytes") == 5 * size
    assert value(m, "flowbroker_queue_saturated", queue="orders") == 1
    assert value(m, "flowbroker_queue_saturated_seconds", queue="orders") == 2.5
    assert value(m, "flowbroker_queue_saturations_total", queue="orders") == 1
    assert value(m, "flowbroker_queue_held_transfers", queue="orders") == 2
    assert value(m, "flowbroker_queue_held_transfers_total", queue="orders") == 2
    assert value(m, "flowbroker_queue_flow_stopped_producers", queue="orders") == 1
    assert value(m, "flowbroker_queue_enqueued_messages_total", queue="orders") == 5
    assert value(m, "flowbroker_producer_flow_stopped", **producer) == 1
    assert value(m, "flowbroker_producer_flow_stopped_seconds", **producer) == 2.5
    assert value(m, "flowbroker_producer_flow_stops_total", **producer) == 1
    assert value(m, "flowbroker_producer_received_bytes_total", **producer) == 5 * size
    assert value(m, "flowbroker_producer_granted_bytes", **producer) == MiB
    assert value(m, "flowbroker_producer_unacknowledged_bytes", **producer) == 5 * size  # none acked yet
    assert series(m, "flowbroker_flow_stop_info") == [{**{k: str(v) for k, v in producer.items()},
                                                       "queue": "orders", "threshold": "flow_stop_count"}]
    assert value(m, "flowbroker_connections", role="producer") == 1

    c = h.consumer("reader")
    c.subscribe("orders")
    c.pump()
    m = scrape(h)
    assert value(m, "flowbroker_queue_consumers", queue="orders") == 1
    assert value(m, "flowbroker_queue_ready_messages", queue="orders") == 0
    assert value(m, "flowbroker_queue_unsettled_messages", queue="orders") == 5
    assert value(m, "flowbroker_queue_messages", queue="orders") == 5  # unsettled still count
    assert value(m, "flowbroker_queue_saturated", queue="orders") == 1
    assert value(m, "flowbroker_connections", role="consumer") == 1

    c.reject(c.tags()[:1])
    c.ack()
    p.pump()
    m = scrape(h)
    assert value(m, "flowbroker_queue_saturated", queue="orders") == 0
    assert value(m, "flowbroker_queue_saturated_seconds", queue="orders") == 0
    assert value(m, "flowbroker_queue_held_transfers", queue="orders") == 0
    assert value(m, "flowbroker_queue_held_transfers_total", queue="orders") == 2  # a counter: stays
    assert value(m, "flowbroker_queue_flow_stopped_producers", queue="orders") == 0
    assert value(m, "flowbroker_queue_dequeued_messages_total", queue="orders") == 5
    assert value(m, "flowbroker_queue_rejected_messages_total", queue="orders") == 1
    assert value(m, "flowbroker_producer_flow_stopped", **producer) == 0
    assert value(m, "flowbroker_producer_flow_stopped_seconds", **producer) == 0
    assert value(m, "flowbroker_producer_flow_stops_total", **producer) == 1
    assert series(m, "flowbroker_flow_stop_info") == []


def test_hard_limits_count_refused_and_dropped_transfers() -> None:
    h = make()
    h.queue("capped", max_count=2)
    h.queue("rolling", max_count=2, overflow="drop-head")
    legacy = h.producer("legacy", flow_control=False)  # only producers without flow control meet the limit
    for _ in range(3):
        legacy.send("", "capped", force=True)
        legacy.send("", "rolling", force=True)
    m = scrape(h)
    assert value(m, "flowbroker_queue_refused_transfers_total", queue="capped") == 1
    assert value(m, "flowbroker_queue_dropped_messages_total", queue="rolling", reason="overflow") == 1
    assert value(m, "flowbroker_queue_max_messages", queue="capped") == 2
    assert value(m, "flowbroker_frames_refused_total", code="QUEUE_FULL") == 1


def test_max_producer_series_bounds_the_per_connection_series_and_counts_the_rest() -> None:
    h = make()
    producers = [h.producer(f"p{i}") for i in range(3)]
    for p in producers:
        p.register()
    h.queue("q")
    h.consumer("only-consumes").subscribe("q")
    m = scrape(h, max_producer_series=2)
    shown = {labels["connection"] for labels in series(m, "flowbroker_producer_granted_bytes")}
    assert shown == {str(producers[0].session.conn_id), str(producers[1].session.conn_id)}  # by connection id
    assert value(m, "flowbroker_producer_series_dropped") == 1
    assert value(m, "flowbroker_connections", role="producer") == 3  # counted, whatever the bound
    assert value(m, "flowbroker_connections", role="consumer") == 1
    m = scrape(h, max_producer_series=0)
    assert series(m, "flowbroker_producer_unacknowledged_bytes") == []
    assert value(m, "flowbroker_producer_series_dropped") == 3
    producers[0].close()
    m = scrape(h, max_producer_series=2)
    assert value(m, "flowbroker_producer_series_dropped") == 0
    assert len(series(m, "flowbroker_producer_flow_stops_total")) == 2


def test_broker_wide_stops_credit_and_connection_counters() -> None:
    h = make()
    p = h.producer("feeder")
    p.register()
    m = scrape(h)
    assert value(m, "flowbroker_credit_granted_bytes") == MiB
    assert value(m, "flowbroker_credit_granted_bytes") <= value(m, "flowbroker_credit_pool_bytes")
    assert value(m, "flowbroker_credit_waiting_producers") == 0
    assert value(m, "flowbroker_unroutable_messages_total") == 1  # register() sends one to amq.fanout
    assert value(m, "flowbroker_producers_stopped") == 0
    h.core.stop_all_producers()
    m = scrape(h)
    assert value(m, "flowbroker_producers_stopped") == 1
    assert series(m, "flowbroker_flow_stop_info") == [{"connection": str(p.session.conn_id), "client_name": "feeder",
                                                       "identity": "anonymous", "queue": "*", "threshold": "admin"}]
    assert value(m, "flowbroker_producer_flow_stops_total", connection=p.session.conn_id, client_name="feeder",
                 identity="anonymous") == 1
    h.core.start_all_producers()

    p.send("", "no-such-queue")  # refused with ERROR NOT_FOUND
    with pytest.raises(SessionFault):
        big = ("amq.fanout", "k", b"y" * (2 * MiB), None)
        p.send_many([big, big], force=True)  # the second starts past its credit
    m = scrape(h)
    assert value(m, "flowbroker_frames_refused_total", code="NOT_FOUND") == 1
    assert value(m, "flowbroker_frames_refused_total", code="UNROUTABLE") == 0  # every code is served
    assert value(m, "flowbroker_credit_violations_total") == 1
    assert value(m, "flowbroker_connections_opened_total") == 1
    p.close()
    m = scrape(h)
    assert value(m, "flowbroker_connections_closed_total") == 1
    assert sum(value(m, "flowbroker_connections", role=r) for r in ("producer", "consumer", "both", "idle")) == 0


def test_the_memory_alarm_and_its_watermark() -> None:
    h = make(server={"memory_watermark": 8 * 1024})
    h.queue("q", flow_stop_count=0, flow_resume_count=0)
    p = h.producer("feeder")
    for _ in range(20):
        p.send("", "q", b"x" * 512)
    m = scrape(h)
    assert value(m, "flowbroker_memory_watermark_bytes") == 8 * 1024
    assert value(m, "flowbroker_memory_alarm") == 1 and value(m, "flowbroker_memory_alarms_total") == 1
    assert {"queue": "*", "threshold": "memory"}.items() <= series(m, "flowbroker_flow_stop_info")[0].items()


def test_a_consumer_whose_buffer_stays_full_is_counted_stuck_on_its_queues_after_stuck_timeout() -> None:
    h = make(server={"stuck_timeout": 10.0})
    h.queue("q")
    p = h.producer("feeder")
    c = h.consumer("slow")
    c.set_buffer(0, 2 * message_size(b"x"))  # room for two messages
    c.subscribe("q")
    for _ in range(4):
        p.send("", "q")
    c.pump()
    session = c.session
    assert session.consumer_stalled(h.now) is None  # the first look: full, but acknowledgements may move
    h.advance(1)
    assert session.consumer_stalled(h.now) == h.now
    h.advance(5)
    assert value(scrape(h), "flowbroker_queue_stuck_consumers", queue="q") == 0  # stalled, not yet for long
    h.advance(5)
    session.consumer_stalled(h.now)
    assert value(scrape(h), "flowbroker_queue_stuck_consumers", queue="q") == 1
    c.ack()
    c.buffer_ack()
    assert session.consumer_stalled(h.now) is None
    assert value(scrape(h), "flowbroker_queue_stuck_consumers", queue="q") == 0


def test_a_consumer_at_its_prefetch_that_settles_nothing_is_stuck_too() -> None:
    """No byte buffer: a subscription whose prefetch is full and whose oldest delivery stays unsettled is
    stalled as a full buffer is (it used to be never reported, however long it held its queue's producers
    flow-stopped); settling the oldest one moves it, and a consumer below its prefetch is not stuck."""
    h = make(server={"stuck_timeout": 10.0})
    h.queue("q")
    p = h.producer("feeder")
    c = h.consumer("holder")
    c.subscribe("q", prefetch=3)
    for _ in range(5):
        p.send("", "q")
    c.pump()
    session = c.session
    assert session.consumer_stalled(h.now) is None  # the first look
    h.advance(1)
    assert session.consumer_stalled(h.now) == h.now
    h.advance(10)
    session.consumer_stalled(h.now)
    assert value(scrape(h), "flowbroker_queue_stuck_consumers", queue="q") == 1
    c.ack(c.tags()[:1])  # the oldest settled: progress (and the next message comes in)
    assert session.consumer_stalled(h.now) is None
    c.pump()
    c.ack(c.tags()[:2])
    h.advance(1)
    assert session.consumer_stalled(h.now) is None  # below its prefetch: waiting for messages, not stuck
    h.advance(1)
    assert session.consumer_stalled(h.now) is None


def test_a_consumer_whose_subscription_buffer_stays_full_is_stuck_too() -> None:
    """The recommended per-subscription buffer (docs/client.md) was never looked at: a consumer with
    buffer_size=4096 that never processed was never reported, nor disconnected with disconnect_when_stuck
    (a tester). Full, with the oldest delivery not moving, it is stalled as a connection buffer is."""
    h = make(server={"stuck_timeout": 10.0})
    h.queue("q")
    p = h.producer("feeder")
    c = h.consumer("slow")
    c.subscribe("q", buffer_size=2 * message_size(b"x"))
    for _ in range(4):
        p.send("", "q")
    c.pump()
    session = c.session
    assert session.consumer_stalled(h.now) is None  # the first look
    h.advance(11)
    assert session.consumer_stalled(h.now) == h.now
    h.advance(11)
    session.consumer_stalled(h.now)
    assert value(scrape(h), "flowbroker_queue_stuck_consumers", queue="q") == 1
    c.ack(c.tags()[:1])
    assert session.consumer_stalled(h.now) is None


def test_label_values_are_escaped_and_each_broker_has_its_own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = make(), make()
    odd = 'a "quoted" \\ queue\nwith a newline'
    # (a name with a control character cannot be declared, but a durable queue recovered from an older
    # journal may have one: declared here as recovery does, unchecked)
    monkeypatch.setattr(core_module, "_check_declared_name", lambda name, kind: None)
    a.queue(odd)
    b.queue("plain")
    ma, mb = scrape(a), scrape(b)
    assert value(ma, "flowbroker_queue_messages", queue=odd) == 0  # the parser gives the name back whole
    assert [labels["queue"] for labels in series(ma, "flowbroker_queue_messages")] == [odd]
    assert [labels["queue"] for labels in series(mb, "flowbroker_queue_messages")] == ["plain"]
    assert value(ma, "flowbroker_build_info", version=next(iter(series(ma, "flowbroker_build_info")))["version"]) == 1
    assert ("process_resident_memory_bytes", frozenset()) in ma


def test_udp_totals_never_go_back_when_an_image_closes() -> None:
    h = make()
    h.queue("q")
    datapath = DataPath(h.config.udp, h.core, ("127.0.0.1", 5682), lambda: None, seed=3)
    h.core.udp = datapath
    owner = h.producer("owner")
    owner.session.peer_host = "127.0.0.1"
    source = ("127.0.0.1", 40001)
    session_id = owner.ok(lambda rid: RegisterPublication(rid, "", "q", 1001, source[1]))["session_id"]
    udp = h.config.udp
    pub = Publication(PublicationConfig(session_id, 1001, term_length=udp.term_length, mtu=udp.mtu), h.now,
                      destination=("127.0.0.1", 5682))
    data_seen = 0

    def cycle(drop_second_data: bool) -> None:
        nonlocal data_seen
        for _ in range(30):
            h.advance(0.005)
            for datagram, _ in pub.do_work(h.now):
                if datagram[6] == 1 and len(datagram) > 32:  # a DATA frame with a payload
                    data_seen += 1
                    if drop_second_data and data_seen == 2:
                        continue  # lost on the way: the image finds the gap and NAKs it
                datapath.on_datagram(datagram, source, h.now)
            for datagram, _ in datapath.do_work(h.now):
                pub.on_datagram(datagram, ("127.0.0.1", 5682), h.now)

    cycle(False)  # SETUP, the image
    for i in range(3):
        assert pub.offer(encode_publish(b"m%d" % i)) >= 0
        cycle(True)
    datapath.on_datagram(b"\x00" * 4, ("10.0.0.1", 1), h.now)  # malformed
    before = scrape(h)
    assert value(before, "flowbroker_udp_publications") == 1 and value(before, "flowbroker_udp_images") == 1
    assert value(before, "flowbroker_udp_loss_gaps_total") >= 1 and value(before, "flowbroker_udp_naks_sent_total") >= 1
    assert value(before, "flowbroker_udp_datagrams_refused_total", reason="malformed") == 1
    assert value(before, "flowbroker_udp_datagrams_refused_total", reason="wrong_source") == 0  # served at 0
    assert [m.body for m in h.core.queues["q"].store] == [b"m0", b"m1", b"m2"]  # recovered
    owner.ok(lambda rid: ClosePublication(rid, session_id))
    after = scrape(h)
    assert value(after, "flowbroker_udp_publications") == 0 and value(after, "flowbroker_udp_images") == 0
    assert datapath.statistics().loss_gaps == 0  # the admin view's live figure went with the image...
    for name in ("flowbroker_udp_loss_gaps_total", "flowbroker_udp_naks_sent_total",
                 "flowbroker_udp_datagrams_received_total"):
        assert value(after, name) >= value(before, name) > 0, name  # ...the counters did not


def test_a_scrape_read_in_steps_reads_each_queue_once_and_is_a_copy() -> None:
    """What the HTTP shell does: read QUEUE_STEP queues at a time, letting connections run between steps
    (here: queues declared and deleted between them), then build the families from the copy."""
    h = make()
    for name in ("a", "b", "c", "d", "e"):
        h.queue(name)
    collector = broker_metrics(h.core).collector
    scrape = collector.scrape()
    assert not scrape.read_queues(2)  # a, b
    h.core.delete_queue("a")  # already read: stays in this scrape
    h.core.delete_queue("c")  # not read yet: not in it
    h.queue("bb")  # after the cursor: read
    h.queue("0")  # before it: not read
    while not scrape.read_queues(2):
        pass
    assert [st.name for st in scrape.queues] == ["a", "b", "bb", "d", "e"]
    p = h.producer("feeder")
    p.send("", "d")  # after the read: not in the families built from it
    families = {f.name: f for f in scrape.families()}
    depth = {s.labels["queue"]: s.value for s in families["flowbroker_queue_messages"].samples}
    assert depth == {"a": 0, "b": 0, "bb": 0, "d": 0, "e": 0}
    assert families["flowbroker_queues"].samples[0].value == 5  # counted when the scrape began


def test_a_queues_consumer_buffers_and_an_idempotent_producers_duplicates() -> None:
    h = make()
    h.queue("orders")
    c = h.consumer("reader")
    sub = c.subscribe("orders", buffer_size=64 * 1024)
    p = h.producer("feeder")
    for i in range(3):
        p.send("", "orders", b"m%d" % i)
    p.pump()
    c.pump()
    m = scrape(h)
    assert value(m, "flowbroker_queue_consumer_buffer_bytes", queue="orders") == 64 * 1024
    unacked = value(m, "flowbroker_queue_consumer_unacknowledged_bytes", queue="orders")
    assert unacked == 3 * message_size(b"m0")  # delivered, not yet acknowledged
    c.buffer_ack(sub)
    assert value(scrape(h), "flowbroker_queue_consumer_unacknowledged_bytes", queue="orders") == 0

    assert value(m, "flowbroker_idempotent_producer_ids") == 0
    assert value(m, "flowbroker_idempotent_duplicates_total") == 0
    h.core.producer_sequences.check("writer-1", 0, h.core.clock_ns())
    h.core.producer_sequences.check("writer-1", 0, h.core.clock_ns())  # the same sequence again: a duplicate
    m = scrape(h)
    assert value(m, "flowbroker_idempotent_producer_ids") == 1
    assert value(m, "flowbroker_idempotent_duplicates_total") == 1


def test_a_paced_producer_is_counted() -> None:
    """[queues] pace_producers: each time a producer's completions wait for its queue's consumers, its
    `flowbroker_producer_paced_total` goes up (docs/metrics.md)."""
    h = Harness(credit={"policy": "static", "static_size": MiB}, queues={"pace_producers": True})
    h.queue("q")
    c = h.consumer("reader")
    c.subscribe("q", prefetch=1)
    p = h.producer("feeder")
    p.register()
    labels = {"connection": p.session.conn_id, "client_name": "feeder", "identity": "anonymous"}
    assert value(scrape(h), "flowbroker_producer_paced_total", **labels) == 0
    p.send_many([("", "q", b"x", None)] * 4)  # 1 delivered, 3 ready: over twice the prefetch
    assert value(scrape(h), "flowbroker_producer_paced_total", **labels) == 1
