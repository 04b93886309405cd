"""A client that stops reading: its outbox limit must cut off that client only, whichever
session's frame caused the overflow, and never interrupt what the core was doing for others."""

from __future__ import annotations

import pytest
from tests.broker.coreharness import Harness

from flowbroker.broker.outbox import MAX_CONTROL_BYTES
from flowbroker.broker.session import SessionFault
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Error, FlowResumed, Noop, Subscribe


def test_overflowing_outbox_faults_its_own_session_not_the_sender_of_the_frame() -> None:
    h = Harness(credit={"policy": "static", "static_size": 1 << 20})
    h.queue("q", flow_stop_count=1)
    deaf = h.producer("deaf")
    good = h.producer("good")
    for p in (deaf, good):
        p.send("", "q", b"a")
        p.send("", "q", b"b")
    deaf.pump()
    good.pump()
    assert set(deaf.stopped) == set(good.stopped) == {"q"}
    deaf.session.outbox.max_frames = 0  # stopped reading long ago
    c = h.consumer()
    c.subscribe("q")
    c.ack()  # clears q: resumes both producers; must not raise for the deaf one
    assert c.session.conn_id in h.core.sessions
    good.pump()
    assert FlowResumed("q") in good.received(FlowResumed) and good.outstanding == {}
    q = h.core.queues["q"]
    assert (q.count, q.saturated, q.held, q.stopped_producers) == (0, False, {}, {})
    # the deaf client is cut off when it next sends anything
    with pytest.raises(SessionFault) as info:
        deaf.handle(Noop(1, False))
    assert info.value.code is ErrorCode.INTERNAL_ERROR
    h.core.close_session(deaf.session)
    good.send("", "q", b"c")
    good.pump()
    assert good.outstanding == {}


def test_timer_frames_to_a_deaf_session_do_not_raise() -> None:
    h = Harness(credit={"policy": "static", "static_size": 1000})
    p = h.producer()
    p.session.outbox.max_frames = 0
    p.session.send(Noop(1, False))  # what the shell's timer does
    h.advance(10)
    p.session.poll_credit(h.now)
    assert p.session.fault is not None


def test_unread_errors_quoting_emoji_are_bounded_by_their_bytes_not_their_characters() -> None:
    """The outbox counted an ERROR's text and destination in characters, and an emoji is 4 bytes in
    UTF-8 and in CPython's str: a client that asked for a queue named with 255 emoji 3,541 times and never
    read had 4 x MAX_CONTROL_BYTES of ERRORs waiting (a tester: 8 MiB per connection, 2.6 with ASCII)."""
    h = Harness()
    deaf = h.consumer("deaf")
    name = "\U0001F4A9" * 255
    with pytest.raises(SessionFault):
        for sub_id in range(1, 10_001):  # the count alone (max_frames) would stop it at 10,000
            deaf.handle(Subscribe(sub_id, sub_id, name, 10, 0))
    waiting = [f for f in deaf.session.outbox.control if isinstance(f, Error)]
    assert waiting and all(f.destination == name for f in waiting)
    utf8 = sum(len(f.text.encode()) + len(f.destination.encode()) for f in waiting if f.destination)
    assert utf8 <= MAX_CONTROL_BYTES, utf8
