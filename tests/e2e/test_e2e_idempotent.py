"""Idempotent producers end to end: SDK -> a TCP proxy the test cuts -> a real broker on 127.0.0.1.

The proxy forwards bytes both ways and, when told, cuts the current connection (both sockets closed at
once, whatever either side has in flight is lost: TRANSFER frames the broker never saw, COMPLETEs the
producer never saw). The producer reconnects through the proxy and sends again what it has not seen
completed; the queue must then hold every sequence exactly once, in order."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowbroker.client as fc
from flowbroker.broker.config import load_config
from flowbroker.broker.server import BrokerServer
from flowbroker.client import blocking

from tests.conftest import RunningBroker
from tests.e2e.test_e2e_faults import receive_all


class CuttableProxy:
    """127.0.0.1:ephemeral -> the broker. `cut()` ends every live connection through it abruptly;
    `muted = "answers"` drops what the broker sends until the next cut (its COMPLETEs are lost, as when a
    connection dies with them in flight), `muted = "both"` also what the client sends (its TRANSFERs never
    reach the broker); `refusing = True` makes it close new connections at once
    (a broker that stays unreachable), `holding = True` keep them open and silent (a broker that accepts
    and never answers)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = 0
        self.cuts = 0
        self.accepted = 0
        self.refusing = False
        self.holding = False
        self.muted = ""
        self._live: list[trio.CancelScope] = []

    async def serve(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.accepted += 1
        if self.refusing:
            await trio.aclose_forcefully(client)
            return
        if self.holding:
            with trio.move_on_after(30):
                await trio.sleep_forever()
            await trio.aclose_forcefully(client)
            return
        try:
            upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        except OSError:
            await trio.aclose_forcefully(client)
            return
        try:
            with trio.CancelScope() as scope:
                self._live.append(scope)
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._pipe, client, upstream, scope, False)
                        nursery.start_soon(self._pipe, upstream, client, scope, True)
                finally:
                    self._live.remove(scope)
        finally:
            # abrupt: no more bytes either way, whatever was read and not yet written is dropped
            await trio.aclose_forcefully(client)
            await trio.aclose_forcefully(upstream)

    async def _pipe(self, source: trio.SocketStream, sink: trio.SocketStream, scope: trio.CancelScope,
                    from_broker: bool) -> None:
        try:
            while data := await source.receive_some(65536):
                if not self.muted or (not from_broker and self.muted != "both"):
                    await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            scope.cancel()  # one side ended: end the other

    def cut(self) -> None:
        self.cuts += 1
        self.muted = ""
        for scope in list(self._live):
            scope.cancel()


async def start_proxy(nursery: trio.Nursery, broker: RunningBroker) -> tuple[CuttableProxy, str]:
    proxy = CuttableProxy(broker.port)
    port = await nursery.start(proxy.serve)
    return proxy, f"flowbroker://127.0.0.1:{port}"


async def read_queue(url: str, queue: str, count: int) -> list[bytes]:
    bodies: list[bytes] = []
    async with await fc.connect(url, timeout=5) as conn:
        async with conn.consumer(queue, prefetch=500) as consumer:
            while len(bodies) < count:
                msg = await consumer.receive(timeout=5)
                bodies.append(msg.body)
                await msg.ack()
            with pytest.raises(fc.ReceiveTimeout):
                await consumer.receive(timeout=0.3)  # and nothing more: no duplicate behind them
    return bodies


async def send_with_cuts(url: str, proxy: CuttableProxy, count: int, cuts: dict[int, tuple[str, float]], *,
                         window: int = 200, producer_id: str = "writer-1", **connect_args: Any) -> fc.Connection:
    """Send `count` messages "0", "1", ... as one idempotent producer. For each i: (mode, seconds) of
    `cuts`: after send i the proxy drops the broker's answers ("answers": what the broker takes meanwhile
    is not seen completed) or everything ("both": what the producer sends meanwhile never reaches the
    broker) for that long, then cuts the connection, while the sends go on."""

    async def cut_after(seconds: float) -> None:
        await trio.sleep(seconds)
        proxy.cut()

    async with await fc.connect(url, timeout=5, reconnect_timeout=15, **connect_args) as conn:
        producer = conn.producer(routing_key="q", producer_id=producer_id, idempotent=True, window=window)
        async with trio.open_nursery() as nursery:
            for i in range(count):
                await producer.send(b"%d" % i)
                if i in cuts:
                    proxy.muted, seconds = cuts[i]
                    nursery.start_soon(cut_after, seconds)
        await producer.flush(timeout=30)
        assert producer.statistics().completed == count and producer.outstanding == 0
    return conn


async def test_a_producer_cut_mid_stream_resends_and_the_queue_holds_each_sequence_once_in_order(
    start_flowbroker, nursery: trio.Nursery
) -> None:
    broker = await start_flowbroker()
    proxy, url = await start_proxy(nursery, broker)
    async with await fc.connect(broker.url) as admin:
        await admin.declare_queue("q")
    count = 3000
    conn = await send_with_cuts(url, proxy, count, {100: ("", 0), 1200: ("answers", 0.05), 1500: ("both", 0.02),
                                                    2500: ("answers", 0.02)})
    assert conn.reconnects >= 2 and proxy.cuts == 4
    assert await read_queue(broker.url, "q", count) == [b"%d" % i for i in range(count)]
    stats = broker.core.producer_sequences.statistics()
    assert stats.accepted == count and stats.gaps == 0 and stats.refused == 0  # each sequence taken once
    assert stats.duplicates > 0  # what was taken while the answers were dropped came back as duplicates


async def test_send_waits_while_reconnecting_and_flush_goes_through_it(start_flowbroker, nursery: trio.Nursery) -> None:
    broker = await start_flowbroker()
    proxy, url = await start_proxy(nursery, broker)
    async with await fc.connect(broker.url) as admin:
        await admin.declare_queue("q")
    async with await fc.connect(url, timeout=1, reconnect_timeout=15) as conn:
        producer = conn.producer(routing_key="q", idempotent=True)
        for i in range(50):
            await producer.send(b"%d" % i)
        proxy.refusing = True
        proxy.cut()
        with trio.fail_after(5):
            while not conn.reconnecting:
                await trio.sleep(0.01)
        with pytest.raises(fc.FlowControlled):
            await producer.send(b"50", block=False)  # nothing may overtake the messages to send again
        with pytest.raises(fc.FlowControlTimeout, match="the connection is reconnecting"):
            await producer.send(b"50", timeout=0.2)
        assert not conn.is_closed
        proxy.refusing = False
        await producer.send(b"50", timeout=10)  # waits until the resend is queued
        await producer.flush(timeout=10)
        assert conn.reconnects == 1
    assert await read_queue(broker.url, "q", 51) == [b"%d" % i for i in range(51)]


async def test_a_refusal_whose_error_was_lost_with_the_connection_is_reported_on_the_resend(
    start_flowbroker, nursery: trio.Nursery
) -> None:
    """The broker refused messages (no such queue) and the ERRORs were lost with the connection: the
    resends are duplicates, and flush() must still raise their refusals, not count them completed."""
    broker = await start_flowbroker()
    proxy, url = await start_proxy(nursery, broker)
    async with await fc.connect(broker.url) as admin:
        await admin.declare_queue("q")
    async with await fc.connect(url, timeout=5, reconnect_timeout=15) as conn:
        producer = conn.producer(idempotent=True)
        await producer.send(b"in", routing_key="q")
        await producer.flush(timeout=5)
        proxy.muted = "answers"  # the broker's ERRORs and COMPLETEs are dropped from here
        for i in range(5):
            await producer.send(b"lost %d" % i, routing_key="absent")
        await producer.send(b"kept", routing_key="q")
        with trio.fail_after(5):
            while broker.core.producer_sequences.statistics().accepted < 7:
                await trio.sleep(0.01)  # the broker took (refused) them all
        proxy.cut()
        with pytest.raises(fc.NotFound) as refused:  # flush raises the first refusal, counting them all
            await producer.flush(timeout=10)
        assert conn.reconnects == 1 and refused.value.destination == "absent"
        stats = producer.statistics()
        assert stats.failed == 5 and stats.completed == 7 and producer.outstanding == 0
    assert await read_queue(broker.url, "q", 2) == [b"in", b"kept"]
    assert broker.core.producer_sequences.statistics().duplicates == 6


async def test_a_broker_unreachable_for_reconnect_timeout_closes_the_connection_saying_so(
    start_flowbroker, nursery: trio.Nursery
) -> None:
    broker = await start_flowbroker()
    proxy, url = await start_proxy(nursery, broker)
    async with await fc.connect(broker.url) as admin:
        await admin.declare_queue("q", flow_stop_count=1, flow_resume_count=0)  # holds their completions
    with pytest.raises(fc.PublishFailures) as failures:
        async with await fc.connect(url, timeout=1, reconnect_timeout=1) as conn:
            producer = conn.producer(routing_key="q", idempotent=True)
            for i in range(5):
                await producer.send(b"%d" % i)
            with trio.fail_after(5):
                while not producer.flow_state.is_stopped:
                    await trio.sleep(0.01)
            proxy.refusing = True
            proxy.cut()
            with pytest.raises(fc.ConnectionClosed) as closed:
                await producer.flush(timeout=10)
            assert "not reconnected within reconnect_timeout 1 s" in str(closed.value)
            assert proxy.accepted >= 3  # it tried again, with backoff, until the deadline
    assert failures.value.unconfirmed >= 1


async def test_a_broker_that_accepts_and_never_answers_is_named_in_the_give_up(
    start_flowbroker, nursery: trio.Nursery
) -> None:
    broker = await start_flowbroker()
    proxy, url = await start_proxy(nursery, broker)
    with pytest.raises(fc.PublishFailures):
        async with await fc.connect(url, timeout=5, reconnect_timeout=1) as conn:
            await conn.declare_queue("q", flow_stop_count=1, flow_resume_count=0)  # holds their completions
            producer = conn.producer(routing_key="q", idempotent=True)
            for i in range(3):
                await producer.send(b"%d" % i)
            proxy.holding = True
            proxy.cut()
            with pytest.raises(fc.ConnectionClosed) as closed:
                await producer.flush(timeout=10)
    assert "last: no WELCOME before reconnect_timeout ran out" in str(closed.value), closed.value


async def test_a_connection_without_idempotent_producers_is_not_reconnected(start_flowbroker, nursery: trio.Nursery) -> None:
    broker = await start_flowbroker()
    proxy, url = await start_proxy(nursery, broker)
    async with await fc.connect(broker.url) as admin:
        await admin.declare_queue("q")
    with pytest.raises(fc.ConnectionClosed):
        async with await fc.connect(url, timeout=5) as conn:
            producer = conn.producer(routing_key="q")
            await producer.send(b"0")
            await producer.flush(timeout=5)
            proxy.cut()
            with trio.fail_after(5):
                while not conn.is_closed:
                    await trio.sleep(0.01)
            assert conn.reconnects == 0 and proxy.accepted == 1
            await producer.send(b"1")


async def test_the_blocking_api_reconnects_an_idempotent_producer_too(start_flowbroker, nursery: trio.Nursery) -> None:
    broker = await start_flowbroker()
    proxy, url = await start_proxy(nursery, broker)
    async with await fc.connect(broker.url) as admin:
        await admin.declare_queue("q")

    def work() -> int:
        with blocking.connect(url, timeout=5, reconnect_timeout=15) as conn:
            with conn.producer(routing_key="q", producer_id="blocking-writer", idempotent=True) as producer:
                for i in range(500):
                    producer.send(b"%d" % i)
                    if i == 250:
                        trio.from_thread.run_sync(proxy.cut)
                producer.flush(timeout=20)
            return conn.connection.reconnects

    assert await trio.to_thread.run_sync(work) == 1
    assert await read_queue(broker.url, "q", 500) == [b"%d" % i for i in range(500)]


cut_plans = st.dictionaries(
    st.integers(0, 799), st.tuples(st.sampled_from(["", "answers", "both"]), st.sampled_from([0.0, 0.002, 0.02])),
    max_size=4,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=cut_plans, window=st.sampled_from([1, 7, 200]))
def test_random_cuts_and_resends_leave_every_sequence_once_in_order(cuts: dict[int, tuple[str, float]], window: int) -> None:
    """Hypothesis over where the connection is cut and what is lost with it (the broker's answers, or
    the producer's messages too), with windows from one message to many: the queue always ends with
    800 messages, each sequence once, in order, and the broker took each sequence exactly once."""
    count = 800

    async def run() -> None:
        config = load_config(None, {"server": {"port": 0, "memory_quota": 1 << 30}, "admin": {"enabled": False},
                                    "udp": {"enabled": False}})
        server = BrokerServer(config)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            broker = RunningBroker(server, port)
            proxy, url = await start_proxy(nursery, broker)
            async with await fc.connect(broker.url) as admin:
                await admin.declare_queue("q")
            await send_with_cuts(url, proxy, count, cuts, window=window)
            assert await read_queue(broker.url, "q", count) == [b"%d" % i for i in range(count)]
            stats = server.core.producer_sequences.statistics()
            assert (stats.accepted, stats.gaps, stats.refused) == (count, 0, 0)
            nursery.cancel_scope.cancel()

    trio.run(run)


async def test_an_idempotent_producer_idle_past_the_ttl_on_its_open_connection_goes_on(start_flowbroker) -> None:
    """The flow timer forgot the id of a producer whose connection was open and quiet for the ttl: all it
    sent after was refused SequenceGap, for good (a tester: ttl 2 s, idle 3.5 s, 10 of 10 refused)."""
    broker = await start_flowbroker(server={"producer_id_ttl": 0.5})
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("quiet")
        producer = conn.producer("", "quiet", producer_id="nightly", idempotent=True)
        for n in range(5):
            await producer.send(b"%d" % n)
        await producer.flush(timeout=10)
        await trio.sleep(2.0)  # several of the flow timer's once-a-second looks past the ttl
        for n in range(5, 15):
            await producer.send(b"%d" % n)
        await producer.flush(timeout=10)
        assert producer.statistics().failed == 0
        got = [body for body, _ in await receive_all(broker, "quiet", 15)]
        assert got == [b"%d" % n for n in range(15)]
