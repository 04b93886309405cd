"""Latency-bounded flow control in the core: queues saturating on drain time and on age, evaluated by the
flow timer (`BrokerCore.tick`, driven here by the harness's fake clock), with FLOW_STOPPED naming the time
threshold and count/size thresholds combined with them (whichever trips stops, all must clear)."""

from __future__ import annotations

import math
from collections.abc import Callable

from tests.broker.coreharness import Consumer, Harness, Producer

from flowbroker.broker.queue import Queue
from flowbroker.policies.drain import TICK_SECONDS
from flowbroker.protocol.frames import FlowResumed, FlowStopped


def make() -> Harness:
    return Harness(credit={"policy": "static", "static_size": 1 << 20})


class Rig:
    """A producer sending `produce` messages per tick and a consumer acking `consume` per tick."""

    def __init__(self, h: Harness, queue: str, prefetch: int = 5) -> None:
        self.h, self.queue = h, queue
        self.p: Producer = h.producer()
        self.c: Consumer = h.consumer()
        self.c.subscribe(queue, prefetch=prefetch)
        self.sent = 0
        self.frames: list[object] = []

    def tick(self, produce: int, consume: int) -> None:
        for _ in range(produce):
            self.p.send("", self.queue, b"m%06d" % self.sent)
            self.sent += 1
        for _ in range(consume):
            self.c.pump()
            tags = self.c.tags()
            if not tags:
                break
            self.c.ack(tags[:1])
        self.h.advance(TICK_SECONDS)
        self.h.core.tick(self.h.now)
        self.frames += self.p.pump()

    def saturate_on_drain_time(self) -> None:
        """500 msgs/s settled, 550 then 800 offered, until the queue stops on its drain time."""
        for _ in range(10):
            self.tick(55, 50)
        while not self.stops():
            self.tick(80, 50)
            assert self.h.now < 3e9, "the backlog's drain time passed its stop long ago"

    def stops(self) -> list[FlowStopped]:
        return [f for f in self.frames if isinstance(f, FlowStopped)]

    def resumes(self) -> list[FlowResumed]:
        return [f for f in self.frames if isinstance(f, FlowResumed)]


def test_a_queue_saturates_on_drain_time_and_resumes_when_the_consumer_speeds_up() -> None:
    h = make()
    h.queue("q", flow_stop_drain_time=0.5, flow_resume_drain_time=0.25)
    r = Rig(h, "q")
    queue = h.core.queues["q"]
    for _ in range(10):  # 550 msgs/s offered, 500 taken: measured, and a backlog under MIN_BACKLOG
        r.tick(55, 50)
    assert not r.stops() and queue.drain.measured and len(r.c.bodies()) > 400
    while not r.stops():
        r.tick(80, 50)  # 800 msgs/s offered, 500 taken
        assert h.now < 3e9, "the backlog's drain time passed 0.5 s long ago"
    (stop,) = r.stops()
    assert (stop.destination, stop.threshold, stop.limit) == ("q", "flow_stop_drain_time", 500)
    assert queue.drain.measured and abs(queue.drain.rate - 500) < 1
    assert 500 < stop.value <= 500 + 80 * 1000 // 500  # crossed at the enqueue: one tick's arrivals at most
    assert queue.statistics().stop_threshold == "flow_stop_drain_time"
    held_before = len(queue.held)
    r.tick(80, 50)
    assert len(queue.held) > held_before  # transfers are held now: the producer's completions stop
    assert set(r.p.stopped) == {"q"}
    for _ in range(5):
        r.tick(0, 5)
        assert not r.resumes()  # a slower consumer: the drain time stays over the resume mark
    while not r.resumes():
        r.tick(0, 150)  # the consumer speeds up to 1,500 msgs/s: the estimate follows, the backlog drains
        assert h.now < 10e9
    assert not queue.saturated and queue.held == {}
    assert r.p.outstanding == {}  # every held transfer completed
    while r.c.tags():
        r.tick(0, 60)
    assert r.c.bodies() == [b"m%06d" % i for i in range(r.sent)]  # nothing lost, in order


def test_a_drain_time_stop_clears_at_the_settlement_that_takes_the_backlog_under_resume() -> None:
    """The resume is a count too (resume x rate at the last tick), checked on every settlement: a producer
    is not kept stopped for the rest of a tick after its consumers drained the backlog (the queue would
    run dry and the consumers idle until the tick)."""
    h = make()
    h.queue("q", flow_stop_drain_time=0.5, flow_resume_drain_time=0.25)
    r = Rig(h, "q", prefetch=10)
    queue = h.core.queues["q"]
    r.saturate_on_drain_time()
    resume_count = math.ceil(0.25 * queue.drain.rate)  # 125 at the 500 msgs/s measured
    assert queue.saturated and queue.count > resume_count
    before = h.now
    while queue.count >= resume_count:  # settle one by one, the clock stopped: no tick in between
        assert queue.saturated and not r.resumes()
        r.c.pump()
        r.c.ack(r.c.tags()[:1])
        r.frames += r.p.pump()
    assert h.now == before and not queue.saturated and queue.held == {}
    assert r.resumes() == [FlowResumed("q")] and r.p.outstanding == {}
    while r.c.tags():
        r.tick(0, 60)
    assert r.c.bodies() == [b"m%06d" % i for i in range(r.sent)]  # nothing lost, in order


def test_an_age_over_its_resume_keeps_a_drained_queue_stopped_until_the_tick() -> None:
    h = make()
    h.queue("q", flow_stop_drain_time=0.5, flow_resume_drain_time=0.25, flow_stop_age=0.3, flow_resume_age=0.2)
    r = Rig(h, "q", prefetch=10)
    queue = h.core.queues["q"]
    r.saturate_on_drain_time()
    assert queue.age_hold  # the oldest ready message waited over 0.2 s: the age is not under its resume
    while queue.count:
        r.c.pump()
        r.c.ack(r.c.tags())
    assert queue.saturated and not r.resumes()  # drained, but the age is re-read on the tick only
    r.tick(0, 0)
    assert not queue.saturated and r.resumes() == [FlowResumed("q")]


def test_a_queue_without_consumers_saturates_on_age_not_on_drain_time() -> None:
    h = make()
    h.queue("idle", flow_stop_drain_time=0.5)  # no consumer: drain time is infinite and does not count
    h.queue("aged", flow_stop_age=1.0, flow_resume_age=0.5)
    p = h.producer()
    for name in ("idle", "aged"):
        p.send("", name, b"old")
    for _ in range(int(1.0 / TICK_SECONDS) + 2):
        h.advance(TICK_SECONDS)
        h.core.tick(h.now)
    frames = p.pump()
    assert not h.core.queues["idle"].saturated
    assert not [f for f in frames if isinstance(f, FlowStopped)]  # told at its next transfer to the queue
    assert h.core.queues["aged"].saturated
    p.send("", "aged", b"new")
    (stop,) = [f for f in p.pump() if isinstance(f, FlowStopped)]
    assert (stop.destination, stop.threshold, stop.limit) == ("aged", "flow_stop_age", 1000)
    assert f"over flow_stop_age ({stop.value} ms > 1000 ms)" in stop.reason
    assert 1000 < stop.value <= 1200
    c = h.consumer()
    c.subscribe("aged")
    c.pump()
    c.ack()
    assert h.core.queues["aged"].saturated  # count and size are under resume, age is re-read at the next tick
    h.advance(TICK_SECONDS)
    h.core.tick(h.now)
    assert FlowResumed("aged") in p.pump() and not h.core.queues["aged"].saturated
    assert c.bodies() == [b"old", b"new"]


def test_count_and_time_whichever_trips_stops_and_all_must_clear() -> None:
    h = make()
    h.queue("q", flow_stop_count=1000, flow_resume_count=900, flow_stop_age=0.5)
    p = h.producer()
    for i in range(3):
        p.send("", "q", b"%d" % i)
    for _ in range(7):
        h.advance(TICK_SECONDS)
        h.core.tick(h.now)
    queue = h.core.queues["q"]
    assert queue.saturated and queue.stop_reason[0] == "flow_stop_age"
    h.core.set_queue_thresholds("q", {"flow_stop_count": 2, "flow_resume_count": 1})  # now count is over too
    c = h.consumer()
    sub = c.subscribe("q", prefetch=1)
    c.pump()
    c.ack()  # count 2: not under resume 1
    assert queue.saturated
    h.core.set_queue_thresholds("q", {"flow_stop_age": 0})  # age off: still over count
    assert queue.saturated
    c.pump()
    c.ack()
    c.pump()
    c.ack()  # count 0 < 1 and no time threshold: clear at once
    assert not queue.saturated
    assert c.bodies(sub) == [b"0", b"1", b"2"]


def test_raising_a_time_threshold_releases_at_once_and_the_ratio_is_kept() -> None:
    h = make()
    h.queue("q", flow_stop_age=0.5, flow_resume_age=0.25)
    p = h.producer()
    p.send("", "q", b"a")
    for _ in range(7):
        h.advance(TICK_SECONDS)
        h.core.tick(h.now)
    p.send("", "q", b"b")
    assert [f.threshold for f in p.pump() if isinstance(f, FlowStopped)] == ["flow_stop_age"]
    queue = h.core.set_queue_thresholds("q", {"flow_stop_age": 10})
    assert (queue.thresholds.flow_stop_age, queue.thresholds.flow_resume_age) == (10.0, 5.0)
    assert not queue.saturated and FlowResumed("q") in p.pump() and p.outstanding == {}


def test_the_flow_timer_ticks_only_the_queues_with_a_time_threshold() -> None:
    h = make()
    h.queue("plain")
    h.queue("timed", flow_stop_age=1.0)
    assert set(h.core.timed_queues) == {"timed"}
    h.core.set_queue_thresholds("plain", {"flow_stop_drain_time": 0.5})
    assert set(h.core.timed_queues) == {"plain", "timed"}
    h.core.set_queue_thresholds("timed", {"flow_stop_age": 0})
    assert set(h.core.timed_queues) == {"plain"}
    p = h.producer()
    p.send("", "timed", b"x")
    h.advance(TICK_SECONDS)
    h.core.tick(h.now)
    assert h.core.queues["timed"].drain.last_ns < h.now  # not ticked
    h.core.delete_queue("plain")
    assert h.core.timed_queues == {}


def test_a_new_consumer_brings_the_slow_start_limit_at_once_not_at_the_next_tick() -> None:
    """A producer that starts right after the first SUBSCRIBE, before the flow timer has ticked, is held
    at MIN_BACKLOG (docs/policies.md "Slow start"): the drain-time limit used to stay off (no consumer at
    the last tick) until the tick, and 3,000 messages went in where the 0.5 s bound allowed about 200. The
    same when the last consumer left and another came."""
    from flowbroker.policies.drain import MIN_BACKLOG

    h = make()
    h.queue("cold", flow_stop_drain_time=0.5)
    h.advance(TICK_SECONDS)
    h.core.tick(h.now)  # ticked with no consumer: the drain-time limit is off
    for round_ in range(2):
        c = h.consumer()
        c.subscribe("cold", prefetch=1)  # no tick between this and the sends
        p = h.producer()
        frames = []
        for i in range(MIN_BACKLOG + 50):
            p.send("", "cold", b"m%d" % i)
            frames += p.pump()
        q = h.core.queues["cold"]
        assert q.saturated and q.stop_reason[0] == "flow_stop_drain_time", round_
        stops = [f for f in frames if isinstance(f, FlowStopped)]
        assert [(f.destination, f.threshold) for f in stops] == [("cold", "flow_stop_drain_time")]
        assert len(p.outstanding) >= 49  # held from the first message over the limit (its window goes in, held)
        c.close()  # the last consumer leaves: the limit is off again, so purging clears the queue
        h.core.queues["cold"].purge()
        p.close()
        h.advance(TICK_SECONDS)
        h.core.tick(h.now)
        assert not h.core.queues["cold"].saturated


def test_a_consumer_that_never_settles_does_not_keep_a_drain_time_queue_stopped() -> None:
    """What a stalled consumer holds leaves the depth drain time is computed over after STALL_SECONDS:
    slowing the producers cannot drain it, and counting it kept the queue stopped for everyone (a tester:
    a consumer with prefetch 2,000 that never acked stopped the good producer for as long as it stayed)."""
    from flowbroker.policies.drain import STALL_SECONDS

    h = make()
    h.queue("q", flow_stop_drain_time=0.5, flow_resume_drain_time=0.25)
    r = Rig(h, "q")
    queue = h.core.queues["q"]
    for _ in range(10):
        r.tick(50, 50)  # 500 msgs/s, measured
    hoarder = h.consumer("hoarder")
    hoarder.subscribe("q", prefetch=300)  # takes 300 and never settles them
    while len(hoarder.tags()) < 300:
        r.tick(60, 50)
        hoarder.pump()
    assert r.stops() and queue.saturated  # 300 held: over 0.5 s x 500/s while they count
    for _ in range(int(STALL_SECONDS / TICK_SECONDS) + 3):
        r.tick(50, 50)
        hoarder.pump()
    assert queue.stalled_held == 300
    assert not queue.saturated and r.resumes()  # the good consumer's pace is what the producer gets
    for _ in range(20):
        r.tick(50, 50)
        assert not queue.saturated
    hoarder.close()  # its 300 go back, flagged redelivered, to the good consumer
    while r.c.tags() or queue.count:
        r.tick(0, 100)
        assert h.now < 60e9
    assert sorted(r.c.bodies()) == [b"m%06d" % i for i in range(r.sent)]  # nothing lost, nothing twice


def test_taking_the_drain_time_threshold_away_forgets_what_stalled_consumers_held() -> None:
    from flowbroker.policies.drain import STALL_SECONDS
    from flowbroker.policies.overflow import Thresholds

    h = make()
    h.queue("q", flow_stop_drain_time=0.5, flow_resume_drain_time=0.25)
    r = Rig(h, "q")
    queue = h.core.queues["q"]
    hoarder = h.consumer("hoarder")
    hoarder.subscribe("q", prefetch=50)
    for _ in range(int(STALL_SECONDS / TICK_SECONDS) + 3):
        r.tick(20, 10)
        hoarder.pump()
    assert queue.stalled_held == 50
    queue.set_thresholds(Thresholds(), h.now)
    assert queue.stalled_held == 0


def test_the_flow_timer_ticks_timed_queues_in_steps_each_once_a_round() -> None:
    """99,000 timed queues (any client may declare them, empty) were ticked in one step every 0.1 s: 0.5 s
    in which every connection waited (a tester). The shell now ticks them a step at a time; a round visits
    each once, passes over one deleted meanwhile, and a queue declared meanwhile joins the next round."""
    h = make()
    for i in range(5):
        h.queue(f"t{i}", flow_stop_age=10.0)
    seen: list[str] = []

    def counting(queue: Queue) -> Callable[[int], None]:
        real = queue.tick

        def tick(now_ns: int) -> None:
            seen.append(queue.name)
            real(now_ns)
        return tick

    for queue in h.core.timed_queues.values():
        queue.tick = counting(queue)  # type: ignore[method-assign, assignment]
    now = h.core.clock_ns()
    assert h.core.tick(now, 2) is True and seen == ["t0", "t1"]
    h.core.delete_queue("t2")
    h.queue("t5", flow_stop_age=10.0)
    assert h.core.tick_timed_queues(now, 2) is True and seen == ["t0", "t1", "t3"]
    assert h.core.tick_timed_queues(now, 2) is False and seen == ["t0", "t1", "t3", "t4"]
    assert h.core.tick(now, 100) is False  # the next round: the five there are now
    assert seen[4:] == ["t0", "t1", "t3", "t4"] and "t5" in h.core.timed_queues


def test_a_consumer_that_takes_every_message_and_never_settles_stops_the_queue_a_second_at_most() -> None:
    """A hoarder whose prefetch is above the queue's depth takes every message: the consumers that do
    settle have none, the first second's sample of the rate is 0 (before the hoarder counts as stalled),
    and a rate of 0 made the drain-time stop and resume 0 past what the hoarder held: the queue stayed
    stopped for as long as the hoarder stayed (a tester: 5 s gaps, 4 of 4). Once it is stalled the rate
    is measured afresh, as when the consumers change, and the producer runs at the good consumer's pace."""
    from flowbroker.policies.drain import STALL_SECONDS

    h = make()
    h.queue("q", flow_stop_drain_time=0.5, flow_resume_drain_time=0.25)
    r = Rig(h, "q", prefetch=10)
    queue = h.core.queues["q"]
    r.saturate_on_drain_time()  # the producer held, about 0.5 s of the good consumer's pace in the queue
    hoarder = h.consumer("hoarder")
    hoarder.subscribe("q", prefetch=5000)  # above anything the queue holds: it takes them all
    hoarder.pump()
    assert hoarder.tags() and queue.saturated
    stopped_ticks = longest = 0
    for _ in range(int(5 * STALL_SECONDS / TICK_SECONDS)):
        r.tick(max(0, min(60, 50 - len(queue.held))), 50)  # a window of 50 transfers, as the SDK's
        hoarder.pump()
        stopped_ticks = stopped_ticks + 1 if queue.saturated else 0
        longest = max(longest, stopped_ticks)
    assert queue.stalled_held > 0
    assert longest * TICK_SECONDS <= STALL_SECONDS + 0.5, f"stopped {longest * TICK_SECONDS:.1f} s on end"
    received = len(r.c.bodies())
    for _ in range(10):
        r.tick(max(0, min(50, 50 - len(queue.held))), 50)
        hoarder.pump()
    assert len(r.c.bodies()) > received  # the good consumer is given messages again
    hoarder.close()
    while r.c.tags() or queue.count:
        r.tick(0, 100)
        assert h.now < 120e9
    assert sorted(r.c.bodies()) == [b"m%06d" % i for i in range(r.sent)]  # nothing lost, nothing twice


def test_a_time_stop_changed_alone_keeps_a_resume_equal_to_it_whatever_the_rounding() -> None:
    """The kept ratio resume/stop was computed in floats: 0.1 x 0.3 / 0.3 is 0.10000000000000002, refused
    as a resume over its stop, naming a key the user never gave (a tester: 14 of 144 ordinary pairs)."""
    h = make()
    for old, new in ((3.0, 0.1), (0.1, 0.2), (3.0, 0.4), (0.3, 0.1), (7.0, 0.7), (0.05, 0.15)):
        h.queue(f"q{old}-{new}", flow_stop_age=old, flow_stop_drain_time=old)
        t = h.core.set_queue_thresholds(f"q{old}-{new}", {"flow_stop_age": new, "flow_stop_drain_time": new})
        assert t.thresholds.time.flow_resume_age == new and t.thresholds.time.flow_resume_drain_time == new


def test_a_purge_is_not_a_settlement_the_drain_rate_stays_the_consumers_pace() -> None:
    """A purge of a big backlog once read as thousands of settlements a second: the stop count (stop x
    rate) jumped, and a 0.5 s drain-time stop let in minutes of the consumer's backlog (a tester)."""
    h = make()
    h.queue("q", flow_stop_drain_time=0.5, flow_resume_drain_time=0.25)
    r = Rig(h, "q")
    queue = h.core.queues["q"]
    for _ in range(10):
        r.tick(80, 50)  # 800 offered, 500 settled: a backlog builds
    assert queue.drain.measured and abs(queue.drain.rate - 500) < 1
    assert queue.purge() > 100
    for _ in range(5):
        r.tick(80, 50)
    assert abs(queue.drain.rate - 500) < 1, queue.drain.rate


def test_drop_head_drops_are_not_settlements() -> None:
    h = make()
    h.queue("q", flow_stop_drain_time=5.0, max_count=300, overflow="drop-head")
    r = Rig(h, "q")
    r.p = h.producer("unpaced", flow_control=False)  # (the overflow policy is for producers without flow control)
    queue = h.core.queues["q"]
    for _ in range(10):
        r.tick(200, 50)  # 2,000 offered, 500 settled, the rest dropped at the head
    assert queue.statistics().dropped > 1000
    assert queue.drain.measured and abs(queue.drain.rate - 500) < 1, queue.drain.rate
