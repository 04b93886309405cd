"""A producer that leaves a shrink of its buffer unanswered (no BUFFER_LIMIT) and sends nothing to drain
it keeps its old window charged to the pool: 6 idle raw clients held the default pool and every other
producer waited for as long as they stayed connected (a tester). While producers wait, one that has left
a shrink unanswered for SHRINK_ANSWER_NS is closed CREDIT_VIOLATION; a producer that answers (the SDK
does at once) or whose pool has room for everyone is never bothered."""

from __future__ import annotations

from flowbroker.broker.core import SHRINK_ANSWER_NS
from flowbroker.policies.drain import TICK_SECONDS
from flowbroker.protocol.errors import ErrorCode

from tests.broker.coreharness import Harness

MiB = 1 << 20


def small_pool() -> Harness:
    return Harness(server={"memory_quota": 64 * MiB, "max_message_size": 65536},
                   credit={"policy": "static", "static_size": 3 * MiB})  # pool 64 MiB: 21 shares


def tick_for(h: Harness, seconds: float) -> None:
    for _ in range(int(seconds / TICK_SECONDS)):
        h.advance(TICK_SECONDS)
        h.core.tick(h.now)


def test_a_producer_that_ignores_a_shrink_while_others_wait_is_closed_and_they_get_its_share() -> None:
    h = Harness(server={"memory_quota": 64 * MiB, "max_message_size": 65536},
                credit={"policy": "aggressive", "min_size": 64 * 1024})  # pool 3.2 MiB
    hog = h.producer("hog")  # never answers BUFFER_CONTROL (no `fences`), and goes idle
    hog.register()
    assert hog.session.buffer_size > 3 * MiB
    late = h.producer("late", fences=True)
    late.register()
    assert h.core.credit.waiting() == 1  # the hog's old window is still charged: the newcomer waits
    tick_for(h, SHRINK_ANSWER_NS / 1e9 - 1)
    assert hog.session.fault is None  # not yet
    tick_for(h, 2)
    fault = hog.session.fault
    assert fault is not None and fault.code is ErrorCode.CREDIT_VIOLATION and "no BUFFER_LIMIT" in str(fault)
    hog.close()  # as the connection's timer does with the fault
    late.pump()
    assert h.core.credit.waiting() == 0 and late.session.buffer_size > 1


def test_a_producer_that_answers_its_shrink_or_whose_pool_has_room_is_never_closed() -> None:
    h = Harness(server={"memory_quota": 64 * MiB, "max_message_size": 65536},
                credit={"policy": "aggressive", "min_size": 64 * 1024})
    polite = h.producer("polite", fences=True)
    polite.register()
    late = h.producer("late", fences=True)
    late.register()
    polite.pump()
    late.pump()
    tick_for(h, 2 * SHRINK_ANSWER_NS / 1e9)
    assert polite.session.fault is None and late.session.fault is None
    assert h.core.credit.waiting() == 0

    roomy = small_pool()  # static shares with room for all: a shrink is never made, nobody waits
    a, b = roomy.producer("a"), roomy.producer("b")
    a.register()
    b.register()
    tick_for(roomy, 2 * SHRINK_ANSWER_NS / 1e9)
    assert a.session.fault is None and b.session.fault is None


def test_a_producer_that_has_answered_before_and_is_paused_now_is_left_to_its_idle_timeout() -> None:
    """An SDK producer answers every BUFFER_CONTROL at once; one whose process is stopped (a GC pause, a
    debugger) for longer than SHRINK_ANSWER_NS leaves the latest shrink unanswered, and was closed."""
    h = Harness(server={"memory_quota": 64 * MiB, "max_message_size": 65536},
                credit={"policy": "aggressive", "min_size": 64 * 1024})
    paused = h.producer("paused", fences=True)
    paused.register()
    paused.pump()  # it answered its grant
    assert paused.session.transfers.answered > 0
    late = h.producer("late", fences=True)
    late.register()  # shrinks the paused one, which reads nothing more
    tick_for(h, 2 * SHRINK_ANSWER_NS / 1e9)
    assert paused.session.fault is None
    paused.pump()  # it resumes and answers: the newcomer gets its share
    late.pump()
    assert h.core.credit.waiting() == 0 and late.session.buffer_size > 1


def test_a_producer_that_answered_once_and_keeps_talking_without_answering_the_shrink_is_closed() -> None:
    """A raw client that answered its first grant, then ignored the shrinks and answered only NOOPs, held
    its old window for as long as it stayed connected: four SDK producers sent one message each in 20 s
    (a tester). Heard from past SHRINK_ANSWER_NS and still not answering SHRINK_HEARD_GRACE_NS after, it
    is ignoring the shrink, not paused; a paused one that wakes and answers is not closed."""
    from flowbroker.broker.core import SHRINK_HEARD_GRACE_NS

    h = Harness(server={"memory_quota": 64 * MiB, "max_message_size": 65536},
                credit={"policy": "aggressive", "min_size": 64 * 1024})
    liar = h.producer("liar", fences=True)
    liar.register()
    liar.pump()  # it answered its grant...
    assert liar.session.transfers.answered > 0
    liar.fences = False  # ...and answers nothing from now on
    woken = h.producer("woken", fences=True)
    woken.register()
    woken.pump()
    late = h.producer("late", fences=True)
    late.register()  # shrinks both; the liar reads its frames and ignores the shrink
    liar.pump()
    tick_for(h, SHRINK_ANSWER_NS / 1e9 + 1)
    assert liar.session.fault is None  # silent so far: taken to be paused
    liar.session.heard_ns = woken.session.heard_ns = h.now  # both heard from (a NOOP, a heartbeat)
    tick_for(h, SHRINK_HEARD_GRACE_NS / 1e9 / 2)
    woken.pump()  # the woken one answers within the grace
    tick_for(h, SHRINK_HEARD_GRACE_NS / 1e9)
    fault = liar.session.fault
    assert fault is not None and fault.code is ErrorCode.CREDIT_VIOLATION and "no BUFFER_LIMIT" in str(fault)
    assert woken.session.fault is None


def test_a_producer_that_answered_the_shrink_is_not_closed_while_its_sent_bytes_wait_in_a_saturated_queue() -> None:
    """The SDK producer answers the shrink at once, but its bytes already sent are held by a saturated queue
    (no consumer): its window stays above the new grant until they complete, and it keeps answering NOOPs.
    It was closed CREDIT_VIOLATION "no BUFFER_LIMIT answered it" 20 s later (a tester, trio and blocking
    SDK alike, and a process paused with SIGSTOP once it resumed): the rule looked at whether it had ever
    answered, not at whether its promise above the grant is more than what it has sent."""
    h = Harness(server={"memory_quota": 64 * MiB, "max_message_size": 65536},
                credit={"policy": "aggressive", "min_size": 64 * 1024})
    h.queue("q", flow_stop_count=1, flow_resume_count=1)
    filler = h.producer("filler", fences=True)
    filler.register()
    while filler.can_send():  # its whole grant into the saturated queue: held, nothing completes
        filler.send("", "q", b"x" * 60_000)
    filler.pump()
    late = h.producer("late", fences=True)
    late.register()  # shrinks the filler's grant
    filler.pump()  # which answers at once
    transfers = filler.session.transfers
    assert transfers.controls and transfers.answered == transfers.controls
    assert filler.session in h.core.over_grant and h.core.credit.waiting() == 1  # the rule's case
    for _ in range(3):  # heard from throughout (NOOPs answered), well past SHRINK_ANSWER_NS
        filler.session.heard_ns = h.now
        tick_for(h, SHRINK_ANSWER_NS / 1e9)
    assert filler.session.fault is None
    h.core.delete_queue("q")  # its messages go: the window drains and the newcomer gets its share
    filler.pump()
    late.pump()
    assert h.core.credit.waiting() == 0


def test_a_producer_that_answers_with_a_limit_beyond_what_it_sends_and_keeps_talking_is_closed() -> None:
    """The exemption above is for bytes sent: a client that answers the shrink with the old limit (it claims
    bytes in flight) and never sends them holds its old window as one that never answers did."""
    from flowbroker.broker.core import SHRINK_HEARD_GRACE_NS
    from flowbroker.protocol import BufferLimit

    h = Harness(server={"memory_quota": 64 * MiB, "max_message_size": 65536},
                credit={"policy": "aggressive", "min_size": 64 * 1024})
    claimer = h.producer("claimer", fences=True)
    claimer.register()
    claimer.pump()
    claimer.fences = False  # answers by hand below
    late = h.producer("late", fences=True)
    late.register()
    claimer.pump()
    transfers = claimer.session.transfers
    claimer.handle(BufferLimit(transfers.controls, claimer.session.buffer_size, transfers.window.limit))
    assert transfers.answered == transfers.controls and claimer.session in h.core.over_grant
    tick_for(h, SHRINK_ANSWER_NS / 1e9 + 1)
    claimer.session.heard_ns = h.now
    tick_for(h, SHRINK_HEARD_GRACE_NS / 1e9 + 1)
    fault = claimer.session.fault
    assert fault is not None and fault.code is ErrorCode.CREDIT_VIOLATION
    assert "its BUFFER_LIMIT answer kept a limit" in str(fault) and "no BUFFER_LIMIT" not in str(fault)
