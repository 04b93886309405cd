"""A TRANSFER whose messages fan out to many queues is routed in slices of at most FANOUT_BUDGET copies,
the shell letting other connections run between them (`Session.routing_rest`, `BrokerCore.route_rest`):
one frame of 50 messages to a fanout of 10,000 queues was half a second of routing in one step, during
which every other connection waited (a tester). Slicing changes nothing of what is routed: the same
messages in every queue, in order, each transfer completed once, and a credit violation found on receipt
still ends the connection, after the messages before it are routed."""

from __future__ import annotations

import pytest

from flowbroker.broker import core as core_module
from flowbroker.protocol.errors import ErrorCode
from flowbroker.broker.outbox import SessionFault
from flowbroker.protocol.frames import DeleteQueue, Transfer, TransferEntry

from tests.broker.coreharness import Harness, Producer


def fanout(h: Harness, queues: int) -> None:
    admin = h.consumer("admin")
    admin.declare_exchange("wide", "fanout")
    for i in range(queues):
        admin.declare_queue(f"q{i}")
        admin.bind(f"q{i}", "wide")


def test_a_wide_fanout_frame_is_routed_in_slices_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_module, "FANOUT_BUDGET", 250)
    h = Harness()
    fanout(h, 100)
    p = h.producer("wide-producer")
    p.register()
    entries = [TransferEntry("wide", "", b"%d" % i, None) for i in range(50)]
    first = p.next_id
    p.credit.on_sent(sum(len(e.body) + 512 for e in entries))
    p.next_id += len(entries)
    h.core.handle(p.session, Transfer(first, entries))  # the core alone: one slice
    rest = p.session.routing_rest
    assert rest is not None and rest.tid == first + 3 and len(rest.sizes) == 47  # 3 x 100 copies >= 250
    assert all(len(h.core.queues[f"q{i}"].store) == 3 for i in range(100))
    slices = 1
    while p.session.routing_rest is not None:
        h.core.route_rest(p.session)
        slices += 1
    assert slices == 17  # ceil(50 / 3)
    p.pump()
    assert all(p.is_complete(first + i) for i in range(50))
    for i in range(100):
        assert [m.body for m in h.core.queues[f"q{i}"].store] == [b"%d" % n for n in range(50)]


def test_topic_matches_over_many_bindings_count_toward_the_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A topic match's operations are over every binding's states: 1,024 long keys matched at 99,000
    bindings were routed in one step, 1.1 s every other connection waited (a tester). Each uncached match
    now counts its cost, in copies, toward the frame's slice; cached routes and a few bindings cost none."""
    h = Harness()
    admin = h.consumer("admin")
    admin.declare_exchange("topics", "topic")
    admin.declare_queue("capped")
    for i in range(20_000):
        admin.bind("capped", "topics", f"#.k{i}")
    p = h.producer("matcher")
    p.register()
    key = ".".join("abcdefghij" * 12)  # 120 words
    entries = [TransferEntry("topics", f"{key}.k{i}", b"%d" % i, None) for i in range(64)]  # each its own key
    first = p.next_id
    p.credit.on_sent(sum(len(e.body) + 512 for e in entries))
    p.next_id += len(entries)
    h.core.handle(p.session, Transfer(first, entries))  # the core alone: one slice
    rest = p.session.routing_rest
    assert rest is not None and 0 < rest.tid - first < 64  # some routed, the rest left for another slice
    slices = 1
    while p.session.routing_rest is not None:
        h.core.route_rest(p.session)
        slices += 1
    assert 2 < slices < 64
    assert [m.body for m in h.core.queues["capped"].store] == [b"%d" % i for i in range(64)]  # each once, in order
    p.pump()
    assert all(p.is_complete(first + i) for i in range(64))
    # The same keys again: cached, no cost, one slice.
    again = [TransferEntry("topics", f"{key}.k{i}", b"again", None) for i in range(64)]
    first = p.next_id
    p.credit.on_sent(sum(len(e.body) + 512 for e in again))
    p.next_id += len(again)
    h.core.handle(p.session, Transfer(first, again))
    assert p.session.routing_rest is None


def test_a_credit_violation_in_a_sliced_frame_ends_the_connection_after_its_routed_messages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_module, "FANOUT_BUDGET", 250)
    h = Harness(credit={"policy": "static", "static_size": 64 * 1024})
    fanout(h, 100)
    p = h.producer("greedy")
    p.register()
    p.pump()
    body = b"x" * 4000
    entries = [TransferEntry("wide", "", body, None) for _ in range(40)]  # 40 x 4.5 KB: past 64 KiB
    first = p.next_id
    p.next_id += len(entries)
    h.core.handle(p.session, Transfer(first, entries))
    with pytest.raises(SessionFault) as fault:
        while p.session.routing_rest is not None:
            h.core.route_rest(p.session)
    assert fault.value.code is ErrorCode.CREDIT_VIOLATION
    routed = len(h.core.queues["q0"].store)
    assert 0 < routed < 40 and all(len(h.core.queues[f"q{i}"].store) == routed for i in range(100))


async def test_over_real_sockets_another_connection_is_served_while_a_wide_frame_is_routed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the reader handed the whole frame to the core in one step: nothing else ran until every copy
    was made. Now the connection that asks something in the middle is answered before the frame is done."""
    import trio

    import flowbroker.client as fb
    from tests.serving import serving, url

    monkeypatch.setattr(core_module, "FANOUT_BUDGET", 100)
    async with serving() as server:
        async with await fb.connect(url(server), timeout=10) as wide, await fb.connect(url(server), timeout=10) as other:
            await wide.declare_exchange("wide", "fanout")
            for i in range(200):
                await wide.declare_queue(f"q{i}")
                await wide.bind(f"q{i}", "wide")
            producer = wide.producer("wide", window=2000)  # exchange "wide"
            for n in range(1000):
                await producer.send(b"%d" % n)  # one TRANSFER frame of them: nothing yields before the loop ends
            session = server.core.sessions[wide.connection_id]
            with trio.fail_after(10):
                while session.routing_rest is None:
                    await trio.sleep(0)
            await other.declare_queue("probe")  # answered in the middle of the frame's routing
            assert session.routing_rest is not None
            await producer.flush(timeout=30)
            assert [len(server.core.queues[f"q{i}"].store) for i in range(200)] == [1000] * 200


async def test_a_connection_whose_frame_is_being_routed_in_slices_is_not_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its socket is not read while its frame's slices are routed, so its NOOP answers wait there: the timer
    took it for silent, and a frame routed for longer than idle_timeout would have closed its own
    connection IDLE_TIMEOUT (a tester, from reading the code)."""
    import trio

    import flowbroker.client as fb
    from tests.serving import serving, url

    monkeypatch.setattr(core_module, "FANOUT_BUDGET", 300)  # one message's 300 copies a slice
    async with serving(server={"idle_timeout": 0.3}) as server:
        async with await fb.connect(url(server), timeout=10) as conn:
            await conn.declare_exchange("wide", "fanout")
            for i in range(300):
                await conn.declare_queue(f"q{i}")
                await conn.bind(f"q{i}", "wide")
            producer = conn.producer("wide", window=4000)
            began = trio.current_time()
            for n in range(3000):  # 900,000 copies, one message a slice: longer than idle_timeout
                await producer.send(b"%d" % n)
            await producer.flush(timeout=120)
            assert trio.current_time() - began > 0.3  # (else this proves nothing)
            assert not conn.is_closed
            assert [len(server.core.queues[f"q{i}"].store) for i in (0, 299)] == [3000, 3000]


def send_raw(h: Harness, p: Producer, entries: list[TransferEntry]) -> int:
    """One TRANSFER to the core alone (its first slice): the harness's `send` routes every slice."""
    first = p.next_id
    p.credit.on_sent(sum(len(e.body) + 512 for e in entries))
    p.next_id += len(entries)
    h.core.handle(p.session, Transfer(first, entries))
    return first


def test_one_message_whose_own_fan_out_passes_the_slice_is_copied_a_slice_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Made in one step, one message to 10,000 bound queues held every connection 26-120 ms (a tester), to
    max_bindings' 100,000 ten times that. Its copies are made a slice at a time (`Session.fanning`); it
    completes once, after the last; a message after it in the frame comes after it in every queue."""
    monkeypatch.setattr(core_module, "FANOUT_BUDGET", 10)
    h = Harness()
    fanout(h, 95)
    admin = h.consumer("admin2")
    p = h.producer("wide-producer")
    p.register()
    first = send_raw(h, p, [TransferEntry("wide", "", b"big", None), TransferEntry("", "q7", b"after", None)])
    copies = [sum(len(h.core.queues[f"q{i}"].store) for i in range(95))]
    slices = 1
    while p.session.routing_rest is not None:  # as the shell does, yielding between calls
        assert not p.is_complete(first)
        h.core.route_rest(p.session)
        copies.append(sum(len(h.core.queues[f"q{i}"].store) for i in range(95)))
        slices += 1
        p.pump()
    assert copies[0] == 0 and slices == 11  # (the first call saw it pass the slice and left it whole)
    assert all(b - a <= 10 for a, b in zip(copies, copies[1:]))
    assert p.is_complete(first) and p.is_complete(first + 1) and p.errors == []
    assert all([m.body for m in h.core.queues[f"q{i}"].store] == [b"big"] for i in range(95) if i != 7)
    assert [m.body for m in h.core.queues["q7"].store] == [b"big", b"after"]
    assert p.session.fanning is None and admin.session.fanning is None


def test_a_connection_closed_while_a_message_is_copied_in_slices_leaves_it_in_every_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A message is in all its queues or in none: its last copies are made when its connection closes."""
    monkeypatch.setattr(core_module, "FANOUT_BUDGET", 10)
    h = Harness()
    fanout(h, 95)
    p = h.producer("wide-producer")
    p.register()
    send_raw(h, p, [TransferEntry("wide", "", b"big", None)])
    h.core.route_rest(p.session)
    h.core.route_rest(p.session)
    assert p.session.fanning is not None and 0 < p.session.fanning.next < 95
    p.close()
    assert all([m.body for m in h.core.queues[f"q{i}"].store] == [b"big"] for i in range(95))


def test_a_queue_deleted_between_slices_gets_no_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_module, "FANOUT_BUDGET", 10)
    h = Harness()
    fanout(h, 30)
    admin = h.consumer("deleter")
    p = h.producer("wide-producer")
    p.register()
    tid = send_raw(h, p, [TransferEntry("wide", "", b"big", None)])
    h.core.route_rest(p.session)  # q0-q9 have it
    assert admin.ok(lambda rid: DeleteQueue(rid, "q25")) == {"deleted": 0}
    while p.session.routing_rest is not None:
        h.core.route_rest(p.session)
    p.pump()
    assert p.is_complete(tid) and p.errors == []
    assert "q25" not in h.core.queues and h.core.memory.held == 29 * (3 + 512)
