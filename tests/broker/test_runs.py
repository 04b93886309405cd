"""The per-run paths of the hot path do what the per-message paths they replace do, entry for entry:
`Outbox.deliver_many` seals DELIVER frames where `deliver` would, `DeliveryLedger.deliver_many`
keeps the tags and bytes `deliver` would, and `TransferReceiver.complete_run` leaves the state
(cumulative point, ranges above it, consumed bytes, COMPLETE frames) that `complete` would."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from flowbroker.broker.message import SessionRef
from flowbroker.broker.outbox import Outbox
from tests.broker.coreharness import Harness
from flowbroker.protocol.delivery import DeliveryLedger
from flowbroker.protocol.frames import Deliver, DeliveryEntry, Frame, Ok, TransferEntry
from flowbroker.protocol.session import TransferReceiver

_sizes = st.lists(st.integers(1, 3000), max_size=60)


def _entries(n: int, start: int) -> list[DeliveryEntry]:
    return [DeliveryEntry(start + i, "", "q", b"x", None, False) for i in range(n)]


def _frames(outbox: Outbox) -> list[Frame]:
    frames: list[Frame] = []
    outbox.take_deliveries(frames)
    return frames


@given(st.lists(_sizes, max_size=6), st.integers(512, 8192))
def test_deliver_many_seals_frames_where_deliver_would(runs: list[list[int]], budget: int) -> None:
    one, many = Outbox(lambda: None, 10, budget), Outbox(lambda: None, 10, budget)
    tag = 1
    for sizes in runs:
        entries = _entries(len(sizes), tag)
        tag += len(sizes)
        for entry, size in zip(entries, sizes):
            one.deliver(7, entry, size)
        many.deliver_many(7, list(entries), sum(sizes), iter(sizes))
        assert [f for f in one.sealed] == [f for f in many.sealed]
        assert one.open_frames == many.open_frames and one._open_bytes == many._open_bytes
    assert _frames(one) == _frames(many)
    assert all(isinstance(f, Deliver) for f in _frames(many))


@given(st.lists(_sizes, max_size=5))
def test_deliver_many_tags_as_deliver_does(runs: list[list[int]]) -> None:
    one: DeliveryLedger[str, int] = DeliveryLedger(1 << 20)
    many: DeliveryLedger[str, int] = DeliveryLedger(1 << 20)
    for k, sizes in enumerate(runs):
        owner = f"sub{k % 2}"
        tags = [one.deliver(owner, i, size) for i, size in enumerate(sizes)]
        first = many.deliver_many(owner, list(range(len(sizes))), sum(sizes))
        assert tags == list(range(first, first + len(sizes)))
    assert (one.next_tag, one.unsettled, one.tags, one.window.position) == (
        many.next_tag, many.unsettled, many.tags, many.window.position)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=20), st.randoms(use_true_random=False))
def test_complete_run_leaves_what_complete_would(plan: list[tuple[bool, int]], rnd: random.Random) -> None:
    """Ids in order, as routed: each group completed at once (one run, or one by one) or kept back
    and completed afterwards in some order, as held transfers are."""
    one, many = TransferReceiver(1 << 30), TransferReceiver(1 << 30)
    total = sum(n for _, n in plan)
    for r in (one, many):
        r.receive(1, [TransferEntry("", "q", b"x" * 10, None, None, None)] * total)
    tid = 1
    kept: list[int] = []
    for now, n in plan:
        if now:
            for i in range(tid, tid + n):
                one.complete(i, 100)
            many.complete_run(tid, n, 100 * n)
        else:
            kept.extend(range(tid, tid + n))
        tid += n
        assert one.completions() == many.completions()
    rnd.shuffle(kept)
    for i in kept:
        one.complete(i, 100)
        many.complete_run(i, 1, 100)
    assert one.completions() == many.completions()
    assert (one.completed.cumulative, one.completed.ranges_above(), one.window.consumed_position) == (
        many.completed.cumulative, many.completed.ranges_above(), many.window.consumed_position)


_ENTRY_KINDS = st.sampled_from(["q", "q", "q", "q", "r", "missing", "exchange", "headers", "long"])
_STEPS = st.lists(
    st.one_of(st.just("ack"), st.lists(st.tuples(_ENTRY_KINDS, st.integers(1, 300)), min_size=1, max_size=12)),
    max_size=14,
)


def _entry(kind: str, size: int) -> tuple[str, str, bytes, dict[str, Any] | None]:
    body = bytes(size)
    if kind == "exchange":
        return ("ex", "k", body, None)
    if kind == "headers":
        return ("", "q", body, {"h": 1})
    if kind == "long":  # a routing key past the common message's length: the exact checks
        return ("", "q" * 100, body, None)
    return ("", kind, body, None)


def _run_core(steps: list[Any], stop_count: int, stop_size: int, prefetch: int, runs: bool) -> tuple[Any, ...]:
    h = Harness()
    h.core.route_runs = runs
    h.queue("q", flow_stop_count=stop_count, flow_resume_count=max(1, stop_count // 2),
            flow_stop_size=stop_size, flow_resume_size=stop_size // 2)
    h.queue("r")
    h.queue("q" * 100)
    producer, consumer = h.producer(), h.consumer()
    assert isinstance(producer.declare_exchange("ex", "direct"), Ok)
    assert isinstance(producer.bind("q", "ex", "k"), Ok)
    consumer.subscribe("q", prefetch=prefetch)
    producer.send("", "q", b"first")  # registers the producer: its share of credit follows
    producer.pump()
    for step in steps:
        if step == "ack":
            consumer.pump()
            consumer.ack()
        else:
            producer.send_many([_entry(kind, size) for kind, size in step], force=True)
        h.advance(0.001)
        producer.pump()
        consumer.pump()
    queues = [h.core.queues[name] for name in ("q", "r")]
    return (
        producer.frames,
        consumer.frames,
        [(q.count, q.size, q.next_offset, q.saturated, q.counters.held_total, len(q.held),
          [(m.offset, m.body, m.routing_key, m.exchange, m.headers, m.held is not None) for m in q.store])
         for q in queues],
        h.core.memory.held,
    )


@given(_STEPS, st.integers(1, 40), st.integers(200, 8000), st.integers(1, 30))
def test_route_run_leaves_what_the_per_message_path_would(
    steps: list[Any], stop_count: int, stop_size: int, prefetch: int
) -> None:
    """A TRANSFER's leading run of common messages to one queue (`Queue.add_run`, one completion run)
    against every message through `Queue.add`: the same frames to both clients (COMPLETE, BUFFER_ACK,
    FLOW_STOPPED/RESUMED, DELIVER, ERROR), the same queues (depth, bytes, offsets, holds, saturation)
    and memory count, whether the frame saturates its queue, mixes queues, exchanges, headers and
    unknown queues, or not."""
    assert _run_core(steps, stop_count, stop_size, prefetch, True) == _run_core(steps, stop_count, stop_size, prefetch, False)


class _Recorder:
    """A session as HeldTransfer and release_all see it, recording what completes, one id at a time."""

    def __init__(self) -> None:
        self.open = True
        self.transfers_held_now = 0
        self.completed: list[int] = []
        self.size = 0
        self.wakes = 0
        self.ref = SessionRef(self)  # type: ignore[arg-type]

    def complete_transfer(self, tid: int, size: int) -> None:
        self.complete_transfers(tid, 1, size)

    def complete_transfers(self, first: int, count: int, size: int) -> None:
        self.completed += range(first, first + count)
        self.size += size
        self.wakes += 1


@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=25), st.randoms())
def test_settle_many_settles_as_settle_does_while_the_queue_holds_transfers(
    steps: list[tuple[int, int]], rnd: random.Random
) -> None:
    """`Queue.settle_many` keeps a one-step path for settlements below the offset of the first message
    its saturation held; whatever it takes, the queue ends where per-message `settle` leaves it, and
    the same held transfers complete."""
    from flowbroker.broker.message import HeldTransfer, Message
    from flowbroker.broker.queue import Queue
    from flowbroker.policies.overflow import Thresholds

    thresholds = Thresholds(flow_stop_count=8, flow_resume_count=4)
    queues = {"many": Queue("q", thresholds), "one": Queue("q", thresholds)}
    producers = {name: _Recorder() for name in queues}
    delivered: dict[str, list[Message]] = {name: [] for name in queues}
    tid = 0
    for adds, settles in steps:
        for _ in range(adds):
            for name, queue in queues.items():
                msg = Message("", "q", b"x" * 10, None, 10)
                if queue.add(msg, None, 0):
                    msg.held = HeldTransfer(producers[name], tid, 10, 1)  # type: ignore[arg-type]
            tid += 1
        picks = None
        for name, queue in queues.items():
            while queue.store:  # delivered: taken from the store, unsettled
                delivered[name].append(queue.store.take())
            if picks is None:  # the same messages (by position) settled in both queues, in any order
                picks = rnd.sample(range(len(delivered[name])), min(settles, len(delivered[name])))
            msgs = [delivered[name][i] for i in picks]
            for i in sorted(picks, reverse=True):
                del delivered[name][i]
            if name == "many":
                queue.settle_many(msgs)
            else:
                for msg in msgs:
                    queue.settle(msg)
            queue.settled()
        many, one = queues["many"], queues["one"]
        assert (many.count, many.size, many.saturated, many.counters.dequeued, many.meter.held) == (
            one.count, one.size, one.saturated, one.counters.dequeued, one.meter.held)
        assert [m.offset for m in many.held] == [m.offset for m in one.held]
        assert producers["many"].completed == producers["one"].completed
        assert producers["many"].transfers_held_now == producers["one"].transfers_held_now


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3), st.booleans()), max_size=40), st.randoms())
def test_release_all_completes_what_releasing_one_by_one_completes(
    plan: list[tuple[int, int, bool]], rnd: random.Random
) -> None:
    """A queue clearing releases its held messages with `release_all`: the same transfers complete, in the
    same order per session, as with `Message.release` one by one, whatever the other holders (a transfer
    to several queues, a broker-wide stop) and however the sessions interleave."""
    from flowbroker.broker.message import HeldTransfer, Message, release_all

    others_first = [rnd.random() < 0.5 for _ in plan]  # the other holders let go before the queue clears
    order = list(range(len(plan)))
    tail = order[len(order) // 2:]
    rnd.shuffle(tail)  # a requeue may put some out of tid order
    order[len(order) // 2:] = tail
    results = []
    for batched in (False, True):
        sessions = [_Recorder() for _ in range(3)]
        made: list[Message] = []
        tids = [1, 1, 1]
        for (owner, holders, held), early in zip(plan, others_first):  # holders: this queue and others
            msg = Message("", "q", b"x", None, 10)
            if held:
                msg.held = HeldTransfer(sessions[owner], tids[owner], 10, holders)  # type: ignore[arg-type]
                if early:
                    for _ in range(holders - 1):
                        msg.held.release()
            tids[owner] += 1
            made.append(msg)
        msgs = [made[i] for i in order]
        if batched:
            release_all(msgs)
        else:
            for msg in msgs:
                msg.release()
        assert all(msg.held is None for msg in msgs)
        results.append([(s.completed, s.size, s.transfers_held_now) for s in sessions])
        if batched:
            assert all(s.wakes <= len(s.completed) for s in sessions)
    assert results[0] == results[1]
