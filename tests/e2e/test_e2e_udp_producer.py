"""Producers over UDP end to end: the SDK's `conn.producer(..., transport="udp")` against a real
`BrokerServer`, over real UDP and TCP sockets on 127.0.0.1.

The broker's image window is the producer's credit and its consumption position the completion point:
a saturated queue closes the window (FLOW_STOPPED over TCP), draining it reopens it (FLOW_RESUMED); the
queue never passes its stop threshold by more than one window; stop-all holds UDP producers as it holds
TCP ones; refusals come back to the producer; closing the TCP connection ends the publication.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

import flowbroker.client as fc
from flowbroker.client import blocking
from flowbroker.client.udpproducer import UdpProducer
from flowbroker.protocol import Headers
from tests.conftest import RunningBroker

LIMIT = 20.0
BODY = b"u" * 1024
# One message in the image's window: 1,024 B + 1 B envelope + 32 B header, 32-aligned.
FRAME = 1088


async def wait_until(predicate: Callable[[], bool], timeout: float = LIMIT) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


Start = Callable[..., Awaitable[RunningBroker]]


async def test_a_udp_producer_ten_times_faster_than_its_consumer_is_paced(start_flowbroker: Start) -> None:
    broker = await start_flowbroker(credit={"policy": "static", "static_size": 64 * 1024})
    stop_count = 100
    window_messages = 64 * 1024 // FRAME + 1
    total = 1500
    got: list[bytes] = []
    depth_max = 0
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("paced", flow_stop_count=stop_count, flow_resume_count=50)
        queue = broker.core.queues["paced"]

        async def consume() -> None:
            async with conn.consumer("paced", prefetch=20) as consumer:
                while len(got) < total:
                    msg = await consumer.receive(timeout=LIMIT)
                    await trio.sleep(0.0005)  # a slow consumer
                    await msg.ack()
                    got.append(msg.body)

        async def watch() -> None:
            nonlocal depth_max
            while len(got) < total:
                depth_max = max(depth_max, len(queue.store))
                await trio.sleep(0)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                nursery.start_soon(watch)
                async with conn.producer("", "paced", transport="udp") as producer:
                    assert isinstance(producer, UdpProducer)
                    for i in range(total):
                        await producer.send(b"%06d" % i + BODY)
                    await producer.flush()
    assert got == [b"%06d" % i + BODY for i in range(total)]
    assert stop_count < depth_max <= stop_count + window_messages
    assert broker.core.udp is not None and broker.core.udp.refused.total() == 0


async def test_saturation_closes_the_window_and_draining_reopens_it(start_flowbroker: Start) -> None:
    broker = await start_flowbroker(credit={"policy": "static", "static_size": 64 * 1024})
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("full", flow_stop_count=50, flow_resume_count=10)
        async with conn.producer("", "full", transport="udp", send_timeout=LIMIT) as producer:
            async with producer.flow_events() as events:
                with trio.fail_after(LIMIT):
                    sent = 0
                    while True:  # until the broker's window closes and the publication's term fills
                        try:
                            await producer.send(BODY, block=False)
                        except fc.FlowControlled as exc:
                            assert "full" in exc.destinations and "flow-stopped: full" in str(exc)
                            break
                        sent += 1
                        if sent % 64 == 0:
                            await trio.sleep(0.001)
                    event = await events.get()
                    assert event is not None and (event.kind, event.destination) == ("stopped", "full")
                with pytest.raises(fc.FlowControlTimeout) as info:
                    await producer.send(BODY, timeout=0.3)
                assert "full" in info.value.destinations and "full" in str(info.value)
                received = 0
                async with conn.consumer("full", prefetch=100) as consumer:
                    with trio.fail_after(LIMIT):
                        while True:
                            event = events.get_nowait()
                            if event is not None and event.kind == "resumed":
                                assert event.destination == "full"
                                break
                            msg = await consumer.receive()
                            await msg.ack()
                            received += 1
                    await producer.send(BODY, timeout=LIMIT)  # the window is open again

                    async def drain() -> None:
                        nonlocal received
                        while received < sent + 1:
                            await (await consumer.receive()).ack()
                            received += 1

                    with trio.fail_after(LIMIT):
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(drain)
                            await producer.flush()
    assert received == sent + 1 and broker.core.queues["full"].store.__len__() == 0


async def test_stop_all_holds_udp_producers(start_flowbroker: Start) -> None:
    broker = await start_flowbroker(credit={"policy": "static", "static_size": 64 * 1024})
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("q")
        async with conn.producer("", "q", transport="udp") as producer:
            await producer.send(b"before")
            await producer.flush(timeout=LIMIT)
            broker.core.stop_all_producers()
            await producer.send(b"held")
            with pytest.raises(fc.FlowControlTimeout) as info:
                await producer.flush(timeout=0.5)
            assert "*" in info.value.destinations
            broker.core.start_all_producers()
            await producer.flush(timeout=LIMIT)
    assert [m.body for m in broker.core.queues["q"].store] == [b"before", b"held"]


async def test_refusals_come_back_to_the_producer_and_routing_keys_travel(start_flowbroker: Start) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("a")
        await conn.declare_queue("b")
        async with conn.producer("", "a", transport="udp") as producer:
            await producer.send(b"to a")
            await producer.send(b"to b", routing_key="b", headers={"k": "v"})
            await producer.send(b"to nowhere", routing_key="missing")
            with pytest.raises(fc.NotFound) as info:
                await producer.flush(timeout=LIMIT)
            assert info.value.destination == "missing"
            await producer.flush(timeout=LIMIT)  # reported once
    assert [(m.body, m.headers) for m in broker.core.queues["a"].store] == [(b"to a", None)]
    assert [(m.body, m.headers) for m in broker.core.queues["b"].store] == [(b"to b", {"k": "v"})]


async def test_a_udp_producer_counts_unroutable_messages_and_a_mandatory_one_raises_them(start_flowbroker: Start) -> None:
    """docs/client.md, "No silent losses": a message an exchange routes to no queue is counted on its
    producer, and a producer created with mandatory=True raises it as `Unroutable`, over UDP as over TCP.
    The publication's broker session never reported UNROUTABLE: the UDP producer's flush returned and
    `statistics().unroutable` stayed 0, with or without mandatory (a tester)."""
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        await conn.declare_exchange("ue", "direct")
        counted = conn.producer("ue", "nobody", transport="udp")
        await counted.send(b"x")
        await counted.send(b"y")
        await counted.flush(timeout=LIMIT)  # counted, not a refusal
        assert (counted.statistics().unroutable, counted.statistics().failed) == (2, 0)
        async with conn.producer("ue", "nobody", transport="udp", mandatory=True) as strict:
            await strict.send(b"z")
            with pytest.raises(fc.Unroutable) as info:
                await strict.flush(timeout=LIMIT)
            assert info.value.destination == "ue"
            assert (strict.statistics().unroutable, strict.statistics().failed) == (1, 1)
    assert broker.core.unroutable == 3


async def test_closing_the_connection_ends_its_publications(start_flowbroker: Start) -> None:
    broker = await start_flowbroker()
    datapath = broker.core.udp
    assert datapath is not None
    sessions_before = len(broker.core.sessions)
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("q")
        producer = conn.producer("", "q", transport="udp")
        await producer.send(b"x")
        await producer.flush(timeout=LIMIT)
        assert len(datapath.ingress.publications) == 1
        assert len(broker.core.sessions) == sessions_before + 2  # the connection and its publication
    await wait_until(lambda: not datapath.ingress.publications)
    assert len(broker.core.sessions) == sessions_before and not datapath.session_ids.live


async def test_the_blocking_api_sends_over_udp(start_flowbroker: Start) -> None:
    broker = await start_flowbroker()
    done: list[int] = []

    def produce() -> None:
        with blocking.connect(broker.url) as conn:
            conn.declare_queue("blocking")
            with conn.producer("", "blocking", transport="udp") as producer:
                producer.send_many([b"%d" % i for i in range(500)])
                producer.flush(timeout=LIMIT)
                done.append(producer.statistics().completed)

    thread = threading.Thread(target=produce)
    thread.start()
    with trio.fail_after(LIMIT * 2):
        while thread.is_alive():
            await trio.sleep(0.01)
    thread.join()
    assert done == [500]
    assert [m.body for m in broker.core.queues["blocking"].store] == [b"%d" % i for i in range(500)]


async def test_an_unknown_transport_is_refused(start_flowbroker: Start) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        with pytest.raises(ValueError, match="transport"):
            conn.producer("", "q", transport="carrier-pigeon")


async def test_an_idempotent_udp_producer_is_refused_as_client_md_says(start_flowbroker: Start) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        with pytest.raises(ValueError, match="idempotent producers are TCP producers"):
            conn.producer("", "q", transport="udp", producer_id="u-1", idempotent=True)


async def test_without_a_udp_data_path_registration_is_refused(start_flowbroker: Start) -> None:
    broker = await start_flowbroker(udp={"enabled": False})
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("q")
        producer = conn.producer("", "q", transport="udp", send_timeout=math.inf)
        with pytest.raises(fc.RequestError, match="no UDP data path"):
            await producer.send(b"x")


async def test_across_many_terms_every_message_arrives_once_in_order(start_flowbroker: Start) -> None:
    broker = await start_flowbroker(udp={"endpoint": "127.0.0.1:0", "term_length": 65536, "mtu": 4096,
                                         "min_receiver_window": 4096, "max_receiver_window": 32768})
    bodies = [b"%06d" % i + b"m" * 200 for i in range(5000)]  # 5,000 x 256 term bytes: ~20 terms
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("terms")
        with trio.fail_after(60):
            async with conn.producer("", "terms", transport="udp") as producer:
                for body in bodies:
                    await producer.send(body)
                await producer.flush()
    assert [m.body for m in broker.core.queues["terms"].store] == bodies


@pytest.mark.parametrize("publish_batch", [True, False])
async def test_concurrent_senders_of_bare_keyed_and_fragmented_messages_keep_each_ones_order(
    start_flowbroker: Start, publish_batch: bool,
) -> None:
    """Bare messages are claimed by `send` and appended a batch at a time (PUBLISH_BATCH payloads, or
    with a broker whose answer does not offer them, as an older one, one bare PUBLISH frame each);
    anything else (a key, headers, a message over one frame, the end of a term, a closed window) takes
    the general path, after the batch claimed before it. Three tasks sending all of these at once on one
    producer, across many terms: every message arrives once, each task's in the order it sent them."""
    broker = await start_flowbroker(udp={"endpoint": "127.0.0.1:0", "term_length": 65536, "mtu": 4096,
                                         "loopback_mtu": 4096, "min_receiver_window": 4096,
                                         "max_receiver_window": 32768})
    assert broker.core.udp is not None
    ingress = broker.core.udp.ingress
    if not publish_batch:
        register = ingress.register

        def without_batches(*args: Any) -> dict[str, Any]:
            answer = register(*args)
            del answer["publish_batch"]
            return answer

        setattr(ingress, "register", without_batches)

    def message(task: int, i: int) -> tuple[bytes, str | None, Headers | None]:
        body = b"%d:%05d:" % (task, i) + b"c" * ((i * 37 + task * 11) % 300)
        if i % 50 == 7:
            return body + b"F" * 5000, None, None  # over loopback_mtu (4 KiB here): fragmented
        if i % 10 == 3:
            return body, "mixed", None  # the registration's key, named: still bare
        if i % 10 == 5:
            return body, None, {"n": str(i)}
        return body, None, None

    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("mixed")
        with trio.fail_after(60):
            async with conn.producer("", "mixed", transport="udp") as producer:

                async def sender(task: int) -> None:
                    for i in range(1500):
                        body, key, headers = message(task, i)
                        await producer.send(body, headers, key)
                        if i % 97 == 0:
                            await trio.sleep(0)  # let the others and the publication's tasks run

                async with trio.open_nursery() as nursery:
                    for task in range(3):
                        nursery.start_soon(sender, task)
                await producer.flush()
                assert isinstance(producer, UdpProducer) and producer._publish_batch is publish_batch
    got = [m.body for m in broker.core.queues["mixed"].store]
    assert len(got) == 4500
    for task in range(3):
        assert [b for b in got if b.startswith(b"%d:" % task)] == [message(task, i)[0] for i in range(1500)]


async def test_the_admin_api_shows_the_data_path_and_its_refusals(start_flowbroker: Start) -> None:
    from tests.e2e.test_e2e_admin import TOKEN, ok

    broker = await start_flowbroker(admin={"token": TOKEN})
    async with await fc.connect(broker.url, client_name="shown") as conn:
        await conn.declare_queue("q")
        producer = conn.producer("", "q", transport="udp")
        await producer.send(b"x")
        await producer.flush(timeout=LIMIT)
        udp = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
        with udp:
            await udp.sendto(b"\x00" * 7, ("127.0.0.1", broker.udp_port))  # too short for any header
        datapath = broker.core.udp
        assert datapath is not None
        await wait_until(lambda: datapath.refused["malformed"] == 1)
        view = await ok(broker, "GET", "/api/broker")
        assert view["udp"]["endpoint"] == f"127.0.0.1:{broker.udp_port}"
        assert view["udp"]["publications"] == 1 and view["udp"]["refused"]["malformed"] == 1
        assert view["udp"]["refused"]["wrong_source"] == 0  # every reason is there, 0 until it happens
        assert view["udp"]["images"] == 1 and view["udp"]["naks_sent"] == 0 == view["udp"]["retransmits_sent"]
        names = [c["client_name"] for c in (await ok(broker, "GET", "/api/connections"))["connections"]]
        assert f"shown udp:{producer.session_id}" in names  # type: ignore[attr-defined]


async def test_bad_envelopes_from_a_registered_publication_are_dropped_and_counted(start_flowbroker: Start) -> None:
    """docs/protocol.md, "The envelope": a message of a registered publication (its own session, stream and
    socket) whose envelope fails the checks is dropped, never routed, and its bytes released so the window
    moves on. Each one is counted where an operator looks: `flowbroker_udp_messages_dropped_total`, the
    admin view's `udp.messages_dropped` and the publication's connection's `producer.messages_dropped`;
    the good messages sent beside them all arrive, in order. (Before, only a rate-limited log line said so.)"""
    from tests.e2e.test_e2e_admin import TOKEN, ok
    from tests.e2e.test_e2e_metrics import one, scrape

    broker = await start_flowbroker(admin={"token": TOKEN})
    bad = [b"\x7fjunk", b"\x01\xff\xffshort", b"\x04\xc1", b"\x04\x90", b"\x02\x00\x01\x90body", b""]
    rounds = 20
    async with await fc.connect(broker.url, client_name="mixed") as conn:
        await conn.declare_queue("q")
        producer = conn.producer("", "q", transport="udp")
        assert isinstance(producer, UdpProducer)
        await producer.open()
        pub = producer.publication
        assert pub is not None
        good: list[bytes] = []
        for i in range(rounds):
            for payload in bad:
                body = b"good %d" % len(good)
                # a bare body, or one with headers of its own (the per-message envelope), between bad ones
                await producer.send(body, {"n": str(len(good))} if len(good) % 2 else None, timeout=LIMIT)
                good.append(body)
                producer._send_now()  # what send claimed goes first, then the bad one from the same socket
                while pub.offer(payload) < 0:
                    producer._send_now()
                    await trio.sleep(0.001)
            producer._send_now()
            await trio.sleep(0)
        await producer.flush(timeout=LIMIT)  # the window moved past every bad one
        dropped = rounds * len(bad)
        assert [m.body for m in broker.core.queues["q"].store] == good
        assert one(await scrape(broker), "flowbroker_udp_messages_dropped_total") == dropped
        assert (await ok(broker, "GET", "/api/broker"))["udp"]["messages_dropped"] == dropped
        connections = (await ok(broker, "GET", "/api/connections"))["connections"]
        mine = {c["client_name"]: c["producer"]["messages_dropped"] for c in connections}
        assert mine == {f"mixed udp:{producer.session_id}": dropped, "mixed": 0}
        await producer.aclose()
        await wait_until(lambda: not broker.core.udp.ingress.publications)  # type: ignore[union-attr]
        # a counter: the closed publication's drops stay counted
        assert one(await scrape(broker), "flowbroker_udp_messages_dropped_total") == dropped
        assert (await ok(broker, "GET", "/api/broker"))["udp"]["messages_dropped"] == dropped


async def test_the_url_names_the_udp_endpoint(start_flowbroker: Start) -> None:
    """A broker behind NAT announces an endpoint its clients cannot reach: `?udp=` overrides it."""
    broker = await start_flowbroker(udp={"endpoint": "0.0.0.0:0"})  # announces 0.0.0.0:<port>
    async with await fc.connect(f"{broker.url}?udp=localhost:{broker.udp_port}") as conn:
        assert conn.udp_endpoint == f"localhost:{broker.udp_port}"
        await conn.declare_queue("q")
        async with conn.producer("", "q", transport="udp") as producer:
            await producer.send(b"via the URL's endpoint")
            assert isinstance(producer, UdpProducer) and producer._broker == ("127.0.0.1", broker.udp_port)  # resolved once
            await producer.flush(timeout=LIMIT)
    assert [m.body for m in broker.core.queues["q"].store] == [b"via the URL's endpoint"]


@pytest.mark.parametrize("endpoint", ["nonsense", "127.0.0.1", ":5682", "127.0.0.1:0", "127.0.0.1:70000", "h:x"])
async def test_a_bad_udp_endpoint_is_refused_when_the_producer_is_made(start_flowbroker: Start,
                                                                         endpoint: str) -> None:
    """Regression: `udp_endpoint` was parsed only after each send had registered a publication, so every
    send left one more registration behind until max_publications_per_connection refused them all. It
    is checked when the producer is made, as the URL's `?udp=` is, with the same error."""
    broker = await start_flowbroker()
    with pytest.raises(ValueError, match=r"must be HOST:PORT with a port in \[1, 65535\]") as in_url:
        fc.parse_url(f"{broker.url}?udp={endpoint}")
    async with await fc.connect(broker.url) as conn:
        with pytest.raises(ValueError) as made:
            conn.producer("", "q", transport="udp", udp_endpoint=endpoint)
    assert str(made.value) == f"udp_endpoint={endpoint!r} must be HOST:PORT with a port in [1, 65535]"
    assert str(in_url.value).endswith(str(made.value)[len("udp_endpoint"):])
    assert broker.core.udp is not None and not broker.core.udp.ingress.publications


async def test_a_registration_the_producer_cannot_use_is_given_back(start_flowbroker: Start) -> None:
    """A failure after REGISTER_PUBLICATION was answered (here the broker endpoint to send to cannot be
    parsed) closes the publication at the broker: sending again and again never fills the connection's
    max_publications_per_connection, and a good producer works afterwards."""
    broker = await start_flowbroker()
    datapath = broker.core.udp
    assert datapath is not None
    per_connection = broker.core.config.udp.max_publications_per_connection
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("q")
        conn.udp_endpoint = "garbage"  # as if the URL's check had been passed by
        producer = conn.producer("", "q", transport="udp")
        for _ in range(per_connection + 2):
            with pytest.raises(ValueError):
                await producer.send(b"never sent", timeout=LIMIT)
            assert not datapath.ingress.publications
        conn.udp_endpoint = None
        async with conn.producer("", "q", transport="udp") as good:
            await good.send(b"sent")
            await good.flush(timeout=LIMIT)
    assert [m.body for m in broker.core.queues["q"].store] == [b"sent"]


async def test_a_send_cancelled_while_its_registration_is_answered_leaves_none_behind(start_flowbroker: Start) -> None:
    """The first send registers the publication; cancelled while REGISTER_PUBLICATION's answer was on its
    way, it used to leave the broker a registration nobody knew the session id of, until the connection
    closed. Now the answer is waited for and the registration given back, then the cancel goes on."""
    broker = await start_flowbroker()
    datapath = broker.core.udp
    assert datapath is not None
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("q")
        for _ in range(broker.core.config.udp.max_publications_per_connection + 2):
            producer = conn.producer("", "q", transport="udp")
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:

                    async def cancel_once_asked() -> None:
                        while not conn._requests:  # REGISTER_PUBLICATION is out, its answer not yet in
                            await trio.sleep(0)
                        scope.cancel()

                    nursery.start_soon(cancel_once_asked)
                    await producer.send(b"never sent", timeout=LIMIT)
            assert scope.cancelled_caught
            with trio.fail_after(LIMIT):
                while datapath.ingress.publications:  # given back (CLOSE_PUBLICATION)
                    await trio.sleep(0.01)
        async with conn.producer("", "q", transport="udp") as good:
            await good.send(b"sent")
            await good.flush(timeout=LIMIT)
    assert [m.body for m in broker.core.queues["q"].store] == [b"sent"]


async def test_a_message_with_its_envelope_is_at_most_an_eighth_of_a_term(start_flowbroker: Start) -> None:
    """docs/client.md's limit: the 1-byte envelope of a body alone counts, so a body of term_length / 8 - 1
    bytes goes and one of term_length / 8 is refused before anything is sent."""
    broker = await start_flowbroker(udp={"term_length": 65536, "max_receiver_window": 32768})
    largest = 65536 // 8 - 1
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("q")
        async with conn.producer("", "q", transport="udp") as producer:
            await producer.send(b"l" * largest)
            with pytest.raises(ValueError, match=f"a message of {largest + 1} bytes"):
                await producer.send(b"l" * (largest + 1))
            await producer.flush(timeout=LIMIT)
    assert [len(m.body) for m in broker.core.queues["q"].store] == [largest]


async def test_leaving_a_udp_producer_block_with_the_broker_stopped_takes_close_timeout_not_request_timeout(
        tmp_path: Any) -> None:
    """The flush and the CLOSE_PUBLICATION share the block's close_timeout; the close waited the
    connection's request_timeout on its own (a tester: 31 s with close_timeout 1, request_timeout 30)."""
    import os
    import signal
    import subprocess

    from tests.e2e.daemon import FLOWBROKER, free_port, stop, wait_listening

    port = free_port()
    proc = subprocess.Popen([FLOWBROKER, "serve", "--port", str(port), "--admin-port", "0", "--udp-endpoint",
                             "127.0.0.1:0", "--data-dir", str(tmp_path)], stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(port, proc)
        async with await fc.connect(f"flowbroker://127.0.0.1:{port}", timeout=LIMIT, close_timeout=0.5,
                                    request_timeout=10) as conn:
            await conn.declare_queue("frozen")
            with pytest.raises(fc.PublishFailures) as failures:
                async with conn.producer("", "frozen", transport="udp") as producer:
                    await producer.send(b"kept", timeout=LIMIT)
                    await producer.flush(timeout=LIMIT)
                    os.kill(proc.pid, signal.SIGSTOP)
                    await producer.send(b"unconfirmed", timeout=LIMIT)
                    began = trio.current_time()
            left_after = trio.current_time() - began
            assert failures.value.unconfirmed == 1
            assert left_after < 2, left_after  # close_timeout 0.5 (+ slack), not request_timeout 10
            os.kill(proc.pid, signal.SIGCONT)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        stop(proc)


@pytest.mark.parametrize("producer_block", [False, True])
async def test_messages_a_saturated_queue_holds_when_a_udp_producer_is_closed_are_unconfirmed_at_once(
        start_flowbroker: Start, producer_block: bool) -> None:
    """docs/protocol.md, CLOSE_PUBLICATION: what a saturated queue holds of a closed publication is delivered,
    its completion never told. Leaving the connection's block (or the producer's, closed inside it) after
    `aclose()` waited the whole close_timeout for those completions anyway, then called them "not
    completed within close_timeout". Now they are unconfirmed at once: still reported (no silent losses),
    naming the queue that held them when the publication closed, though it was purged since."""
    close_timeout = 5.0
    broker = await start_flowbroker()
    with pytest.raises(fc.PublishFailures) as info:
        async with await fc.connect(broker.url, close_timeout=close_timeout) as conn:
            await conn.declare_queue("held", flow_stop_size=1 << 20, flow_resume_size=512 << 10)
            producer = conn.producer("", "held", transport="udp")
            assert isinstance(producer, UdpProducer)
            async with (producer if producer_block else contextlib.nullcontext()):
                with trio.fail_after(LIMIT):
                    while True:  # 8 KiB messages until the broker's window closes and the term fills
                        try:
                            await producer.send(b"y" * 8192, block=False)
                        except fc.FlowControlled as exc:
                            assert "held" in exc.destinations
                            break
                        await trio.sleep(0)
                in_flight = producer.statistics().in_flight
                assert in_flight > 0
                started = trio.current_time()
                session_id = producer.session_id
                await producer.aclose()
                with pytest.raises(fc.ConnectionClosed, match="is closed: .* not completed when"):
                    await producer.flush()  # nor does a flush wait (send_timeout) for what cannot come
                await conn.purge_queue("held")
                assert not conn.flow_state.destinations  # the purge resumed it: the failures must remember
    took = trio.current_time() - started
    assert took < close_timeout / 5, took
    failures = info.value
    assert (failures.unconfirmed, failures.failed, failures.destinations) == (in_flight, 0, ("held",))
    assert f"when UDP publication {session_id} was closed" in str(failures)
    assert "within close_timeout" not in str(failures)
    assert producer.statistics().in_flight == in_flight  # unconfirmed, not counted complete


async def test_an_idle_udp_producer_gives_up_the_credit_a_shrink_takes_so_a_later_producer_gets_a_share(
        start_flowbroker: Start) -> None:
    """A UDP publication never answers BUFFER_CONTROL (its window is the broker's own status messages),
    so a shrink left its first grant charged: an idle one held the whole pool and a TCP producer on
    another connection waited for as long as it stayed registered (a tester). The broker fences it
    itself now: nothing beyond what it sent stays promised."""
    broker = await start_flowbroker(server={"memory_quota": 512 * 1024 * 1024})
    async with await fc.connect(broker.url) as a, await fc.connect(broker.url) as b:
        await a.declare_queue("sm")
        idle = a.producer(routing_key="sm", transport="udp")
        assert isinstance(idle, UdpProducer)
        await idle.open()  # registered and idle: the whole (aggressive) pool is its share
        later = b.producer(routing_key="sm")
        with trio.fail_after(LIMIT):
            for i in range(20):
                await later.send(b"m%d" % i, timeout=5)
            await later.flush(timeout=5)
        assert broker.core.credit.waiting() == 0
        await idle.aclose()


async def test_a_closed_udp_publication_frees_its_image_without_the_garbage_collector(start_flowbroker: Any) -> None:
    """A closed publication's image (its 3 x term_length log) stayed in its channel, in a reference cycle,
    until a full garbage collection, which the broker process runs seldom: one connection opening and
    closing a UDP producer 100 times held 650 MiB (a tester). With the collector off, none is left."""
    import gc

    from flowbroker.transport.image import Image

    broker = await start_flowbroker()
    datapath = broker.core.udp
    assert datapath is not None
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("freed")
        gc.collect()
        gc.disable()
        try:
            for round in range(5):
                async with conn.producer(routing_key="freed", transport="udp") as producer:
                    for i in range(3):
                        await producer.send(b"%d-%d" % (round, i), timeout=LIMIT)
                    await producer.flush(timeout=LIMIT)
            with trio.fail_after(LIMIT):
                while datapath.ingress.publications:
                    await trio.sleep(0.05)
            assert [o for o in gc.get_objects() if isinstance(o, Image)] == []  # (the SDK's producer has none)
        finally:
            gc.enable()
        assert broker.core.queues["freed"].count == 15


async def test_a_registration_key_over_the_limit_is_refused_and_the_connection_kept(start_flowbroker: Start) -> None:
    """The broker answers KEY_TOO_LONG for a UDP producer's key over 256 bytes; the SDK sent any key, and one
    over 64 KiB was over the control frames' limit: the broker closed the connection (a tester). The SDK now
    refuses it before the request, as the broker would, whatever its length."""
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("k")
        for length in (257, 70_000):
            producer = conn.producer(routing_key="k" * length, transport="udp")
            with pytest.raises(fc.RequestError, match="KEY_TOO_LONG") as refused:
                await producer.send(b"x")
            assert refused.value.code is fc.ErrorCode.KEY_TOO_LONG and f"{length} bytes" in str(refused.value)
        async with conn.producer(routing_key="k", transport="udp") as fine:  # the connection goes on
            await fine.send(b"x")
            await fine.flush(timeout=10)


async def test_a_fault_in_the_data_path_loses_a_datagram_not_the_broker(start_flowbroker: Start,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception out of the UDP data path's task ended the broker's nursery and every connection with it (a
    tester's oversized message; refused before the offer now). A fault is logged and counted, the datagram is
    lost as UDP may lose one, and the transport's retransmission makes up for it."""
    broker = await start_flowbroker()
    shell = broker.server.udp
    assert shell is not None
    datapath = shell.datapath
    real = datapath.on_datagram
    faults = iter([True])

    def on_datagram(data: Any, source: Any, now: int) -> None:
        if len(data) > 200 and next(faults, False):  # the first data datagram
            raise RuntimeError("a bug in the data path")
        real(data, source, now)

    monkeypatch.setattr(datapath, "on_datagram", on_datagram)
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("faulty")
        async with conn.producer(routing_key="faulty", transport="udp") as producer:
            for i in range(100):
                await producer.send(b"%03d" % i + b"." * 300)
            await producer.flush(timeout=LIMIT)
        assert [m.body[:3] for m in broker.core.queues["faulty"].store] == [b"%03d" % i for i in range(100)]
    assert shell.faults == 1
