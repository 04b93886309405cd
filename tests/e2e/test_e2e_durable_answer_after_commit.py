"""A request that changes something durable is answered once the journal has it on disk, as a transfer to a
durable queue completes: answered at once, a kill -9 just after undid what the client was told was done
(deleted durable queues came back with their messages, declared ones were gone, purged messages
returned: a tester, in 3-6 runs of 10). Here the journal's writes are held back by a gate, and the answers
(the SDK's requests and the admin API's) are seen to wait for it; a memory-only queue's are not."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import flowbroker.client as fb
from flowbroker.broker.journal import Journal

from tests.e2e.test_e2e_admin import TOKEN, api
from tests.e2e.test_e2e_faults import receive_all


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """While clear, the journal's commits wait (write_batch runs in a worker thread)."""
    opened = threading.Event()
    write_batch = Journal.write_batch

    def gated(self: Journal, batch: Any) -> None:
        opened.wait(30)
        write_batch(self, batch)

    monkeypatch.setattr(Journal, "write_batch", gated)
    return opened


async def held_until_the_gate_opens(nursery: trio.Nursery, gate: threading.Event,
                                    request: Callable[[], Awaitable[Any]]) -> Any:
    """Start `request` with the gate shut: it is not answered within 0.5 s; open the gate: it is."""
    gate.clear()
    answered = trio.Event()
    results: list[Any] = []

    async def run() -> None:
        results.append(await request())
        answered.set()

    nursery.start_soon(run)
    with trio.move_on_after(0.5):
        await answered.wait()
    assert not answered.is_set(), "answered before its change was on disk"
    gate.set()
    with trio.fail_after(10):
        await answered.wait()
    return results[0]


async def test_durable_requests_are_answered_once_on_disk_and_memory_ones_at_once(
        start_flowbroker: Any, tmp_path: Path, gate: threading.Event) -> None:
    broker = await start_flowbroker(storage={"data_dir": str(tmp_path / "data")}, admin={"token": TOKEN})
    async with await fb.connect(broker.url, timeout=10) as conn, trio.open_nursery() as nursery:
        await held_until_the_gate_opens(nursery, gate, lambda: conn.declare_queue("kept", durable=True))
        async with conn.producer(routing_key="kept") as producer:
            for i in range(5):
                await producer.send(b"%d" % i)
        await held_until_the_gate_opens(nursery, gate, lambda: conn.purge_queue("kept"))
        await held_until_the_gate_opens(nursery, gate, lambda: conn.delete_queue("kept"))
        await held_until_the_gate_opens(nursery, gate, lambda: conn.declare_queue("kept2", durable=True))
        status, _, _ = await held_until_the_gate_opens(nursery, gate, lambda: api(broker, "DELETE", "/api/queues/kept2"))
        assert status == 200
        gate.clear()  # a memory-only queue's requests journal nothing: answered with the journal held up
        with trio.fail_after(5):
            await conn.declare_queue("memory")
            await conn.purge_queue("memory")
            await conn.delete_queue("memory")
        gate.set()


async def test_while_the_journal_cannot_write_a_durable_change_is_refused_at_once_and_nothing_changes(
        start_flowbroker: Any, tmp_path: Path) -> None:
    """Its answer would wait until the disk takes writes again: the client saw a request timeout suggesting
    the broker was down (a tester, with a data directory it could not write). Refused at once, naming why.
    Under the quota or free-space alarms the journal still writes: there a purge or delete, which frees the
    space, must go through (refused, the alarm never cleared: a second tester)."""
    from flowbroker.protocol import ErrorCode
    from flowbroker.protocol.frames import FlowStopped
    from flowbroker.protocol.names import THRESHOLD_DISK

    broker = await start_flowbroker(storage={"data_dir": str(tmp_path / "data")})
    async with await fb.connect(broker.url, timeout=10) as conn:
        await conn.declare_queue("kept", durable=True)
        await conn.declare_queue("other", durable=True)
        journal = broker.server.core.journal
        assert journal is not None
        journal.set_alarm(FlowStopped("*", THRESHOLD_DISK, 0, 0, "the journal cannot write: No space left on device"))
        journal.write_failing = True  # as the committer marks it when a write fails
        requests: list[Callable[[], Awaitable[Any]]] = [
            lambda: conn.declare_queue("new", durable=True), lambda: conn.delete_queue("kept"),
            lambda: conn.purge_queue("kept"), lambda: conn.declare_exchange("ex", "fanout")]
        for request in requests:
            with trio.fail_after(5), pytest.raises(fb.RequestError) as refused:
                await request()
            assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED and "cannot write" in str(refused.value)
            assert "No space left" in str(refused.value) and "nothing was changed" in str(refused.value)
        assert "new" not in broker.server.core.queues and "kept" in broker.server.core.queues
        with trio.fail_after(5):  # what the journal does not keep goes on
            await conn.declare_queue("memory")
            await conn.delete_queue("memory")
        journal.write_failing = False
        # the quota alarm: the journal writes, so the purge and delete that free the space go through
        journal.set_alarm(FlowStopped("*", THRESHOLD_DISK, 1000, 5000, "the journal holds 5000 bytes, over its quota 1000"))
        with trio.fail_after(10):
            await conn.purge_queue("kept")
            await conn.delete_queue("other")
        journal.set_alarm(None)
        await conn.delete_queue("kept")


async def test_subscribing_to_a_durable_queue_with_messages_is_answered_without_waiting_for_the_journal(
        start_flowbroker: Any, tmp_path: Path, gate: threading.Event) -> None:
    """A SUBSCRIBE's deliveries are journalled (delivery records), but its OK promises nothing durable:
    answered only after the commit, a new consumer of a durable queue got no answer while the disk was
    full and timed out, its subscription made and holding messages (a tester)."""
    broker = await start_flowbroker(storage={"data_dir": str(tmp_path / "data")})
    async with await fb.connect(broker.url, timeout=10) as conn:
        gate.set()
        await conn.declare_queue("kept", durable=True)
        async with conn.producer(routing_key="kept") as producer:
            for i in range(5):
                await producer.send(b"%d" % i)
            await producer.flush(timeout=10)
        gate.clear()  # the journal's commits held back from here
        with trio.fail_after(5):
            got = [body for body, _ in await receive_all(broker, "kept", 5)]
        assert got == [b"%d" % i for i in range(5)]
        gate.set()


async def _kept_and_binder(conn: Any, gate: threading.Event) -> tuple[list[Any], Callable[[str], Awaitable[None]]]:
    """Declare the durable queue "kept" (its record committed), shut the gate, and give a `bind(key)` that
    binds it to amq.topic, its answer (once the journal commits) appended to the list returned with it."""
    gate.set()
    await conn.declare_queue("kept", durable=True)
    gate.clear()
    answered: list[Any] = []

    async def bind(key: str) -> None:
        answered.append(await conn.bind("kept", "amq.topic", key, timeout=30))

    return answered, bind


async def test_answers_waiting_for_a_commit_are_bounded_per_connection(
        start_flowbroker: Any, tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unbounded, clients pipelining durable BIND/UNBIND pairs without reading took the broker to 725 MiB
    while a slow disk's commit took 3 s (a tester). Past the bound a request that would journal something
    is refused at once, nothing changed; the waiting ones are answered when the commit returns."""
    from flowbroker.broker import core as core_module
    from flowbroker.protocol import ErrorCode

    monkeypatch.setattr(core_module, "MAX_ANSWERS_WAITING_PER_CONNECTION", 3)
    broker = await start_flowbroker(storage={"data_dir": str(tmp_path / "data")})
    async with await fb.connect(broker.url, timeout=10) as conn, trio.open_nursery() as nursery:
        answered, bind = await _kept_and_binder(conn, gate)

        for i in range(3):
            nursery.start_soon(bind, f"k{i}")
        with trio.fail_after(10):
            while broker.core.answers_waiting < 3:
                await trio.sleep(0.01)
        with trio.fail_after(5), pytest.raises(fb.RequestError) as refused:
            await conn.bind("kept", "amq.topic", "k3")
        assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED and "nothing was changed" in str(refused.value)
        assert "k3" not in broker.core.exchanges["amq.topic"].bindings
        with trio.fail_after(5):  # what does not journal is not held back
            await conn.declare_queue("memory")
        gate.set()
        with trio.fail_after(10):
            while len(answered) < 3:
                await trio.sleep(0.01)
        assert broker.core.answers_waiting == 0
        await conn.bind("kept", "amq.topic", "k3")


async def test_an_sdk_connections_concurrent_durable_requests_wait_for_a_slot_not_a_refusal(
        start_flowbroker: Any, tmp_path: Path, gate: threading.Event) -> None:
    """150 concurrent `bind()`s of a durable queue on one connection had 50 refused RESOURCE_EXHAUSTED on
    a fast disk: the broker bounds the answers waiting for the journal at 100 a connection (a tester). The
    SDK keeps at most REQUESTS_IN_FLIGHT of a connection's requests unanswered; the rest wait for a slot,
    within their timeout, and every one is answered OK once the journal commits."""
    from flowbroker.client.connection import REQUESTS_IN_FLIGHT

    broker = await start_flowbroker(storage={"data_dir": str(tmp_path / "data")})
    async with await fb.connect(broker.url, timeout=10) as conn:
        answered, bind = await _kept_and_binder(conn, gate)

        async with trio.open_nursery() as nursery:
            for i in range(150):
                nursery.start_soon(bind, f"k{i}")
            with trio.fail_after(10):
                while broker.core.answers_waiting < REQUESTS_IN_FLIGHT:
                    await trio.sleep(0.01)
            await trio.sleep(0.3)
            assert broker.core.answers_waiting == REQUESTS_IN_FLIGHT < 100 and not answered
            with pytest.raises(fb.RequestTimeout, match="this one was not sent"):  # its timeout holds
                await conn.bind("kept", "amq.topic", "late", timeout=0.2)
            gate.set()
        assert len(answered) == 150
        assert set(broker.core.exchanges["amq.topic"].bindings) >= {f"k{i}" for i in range(150)}
        assert "late" not in broker.core.exchanges["amq.topic"].bindings
