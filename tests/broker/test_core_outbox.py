"""A client that stops reading: its outbox limit must cut off that client only, whichever
session's frame caused the overflow, and never interrupt what the core was doing for others."""

from __future__ import annotations

import pytest
from tests.broker.coreharness import Harness

from flowbroker.broker.session import SessionFault
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import FlowResumed, Noop


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
