"""The queue store seam (broker/store.py) and message identity, without trio.

Two hypothesis state machines check the store against a plain-list model: every message ever
appended, in append order, and which of them are ready, taken or gone. The ready messages are
then "those of the list still ready, in list order", so a requeued message must be back exactly
where it was, whatever the batches it returns in. The first drives `MemoryStore` alone (and again a
store that places every requeue run by run, the way among many ready messages); the second drives a
`Queue` over it with a subscription whose credit the test hands out, so delivery, settle, requeue and
purge go through the queue's own accounting and `statistics()`. Two more tests count what a requeue
reads of the ready messages it returns among: a few bisection probes, not all of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import FrozenInstanceError, dataclass, field
from typing import SupportsIndex, cast

import pytest
from flowbroker.broker.idempotence import scoped
from tests.broker.coreharness import Harness
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flowbroker.broker.message import Message
from flowbroker.broker.queue import Queue, QueueStatistics
from flowbroker.broker.store import MemoryStore, QueueStore, memory_store
from flowbroker.broker.subscription import Subscription
from flowbroker.policies.overflow import Thresholds
from flowbroker.protocol.frames import Ok, Transfer, TransferEntry

SIZES = st.integers(min_value=1, max_value=5000)


def message(size: int, number: int = 0) -> Message:
    return Message("", "q", b"m%d" % number, None, size, "producer-1", number)


@dataclass
class ListModel:
    """Every message appended, in append order, and the fate of each."""

    appended: list[Message] = field(default_factory=list)
    ready: set[int] = field(default_factory=set)  # ids of the messages ready now
    taken: list[Message] = field(default_factory=list)  # delivered, not settled nor requeued

    def ready_in_order(self) -> list[Message]:
        return [m for m in self.appended if id(m) in self.ready]

    def take(self) -> Message:
        msg = self.ready_in_order()[0]
        self.ready.discard(id(msg))
        self.taken.append(msg)
        return msg

    def pick_taken(self, data: st.DataObject) -> list[Message]:
        """Some of the taken messages, in any order (consumers give them back in any batches)."""
        picked = data.draw(st.lists(st.sampled_from(self.taken), unique_by=id, min_size=1))
        for msg in picked:
            self.taken.remove(msg)
        return picked


class RunByRunStore(MemoryStore):
    """A memory store that places every requeue among ready messages run by run, never by merging: a
    small model queue rarely has more ready messages between those returning than `merge_span` allows."""

    __slots__ = ()
    merge_span = 0


class StoreMachine(RuleBasedStateMachine):
    """`MemoryStore` against the list model; offsets are given here as a queue gives them."""

    store_type: type[MemoryStore] = MemoryStore

    def __init__(self) -> None:
        super().__init__()
        self.store: QueueStore = self.store_type()
        self.model = ListModel()
        self.next_offset = self.store.start_offset

    @rule(size=SIZES)
    def append(self, size: int) -> None:
        msg = message(size, len(self.model.appended))
        msg.offset = self.next_offset
        self.next_offset += 1
        self.store.append(msg)
        self.model.appended.append(msg)
        self.model.ready.add(id(msg))

    @rule(sizes=st.lists(SIZES, min_size=10, max_size=40))
    def append_many(self, sizes: list[int]) -> None:
        """A burst: long heads and spans, so a requeue lands among many ready messages (placed run by run)."""
        for size in sizes:
            self.append(size)

    @precondition(lambda self: self.model.ready)
    @rule()
    def take(self) -> None:
        assert self.store.take() is self.model.take()

    @precondition(lambda self: self.model.ready)
    @rule(n=st.integers(min_value=2, max_value=40))
    def take_many(self, n: int) -> None:
        for _ in range(min(n, len(self.model.ready))):
            self.take()

    @precondition(lambda self: self.model.taken)
    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        returning = self.model.pick_taken(data)
        self.store.requeue(returning)
        self.model.ready.update(id(m) for m in returning)

    @precondition(lambda self: len(self.model.taken) >= 3)
    @rule()
    def requeue_two_consumers(self) -> None:
        """Two consumers shared the taken messages in turn and go away one after the other: the second's
        messages land one by one between the first's."""
        taken, self.model.taken = sorted(self.model.taken, key=lambda m: m.offset), []
        for returning in (taken[::2], taken[1::2]):
            self.store.requeue(returning)
            self.model.ready.update(id(m) for m in returning)

    @precondition(lambda self: self.model.taken)
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        for msg in self.model.pick_taken(data):
            self.store.settle(msg)

    @rule()
    def purge(self) -> None:
        assert self.store.purge() == self.model.ready_in_order()
        self.model.ready.clear()

    @rule(data=st.data(), limit=st.integers(min_value=0, max_value=5))
    def page(self, data: st.DataObject, limit: int) -> None:
        after = data.draw(st.none() | st.integers(min_value=-1, max_value=self.next_offset))
        expected = [m for m in self.model.ready_in_order() if after is None or m.offset > after][:limit]
        assert self.store.page(after, limit) == expected

    @invariant()
    def ready_messages_are_the_models_in_order(self) -> None:
        assert list(self.store) == self.model.ready_in_order()
        assert len(self.store) == len(self.model.ready)
        assert bool(self.store) is bool(self.model.ready)
        if self.model.ready:  # the head, not taken: what take() returns next
            assert self.store[0] is self.model.ready_in_order()[0]


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


class RunByRunStoreMachine(StoreMachine):
    store_type = RunByRunStore


TestRunByRunStoreMachine = RunByRunStoreMachine.TestCase
TestRunByRunStoreMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


class FakeSubscription:
    """What `Queue` asks of a subscription, with credit the test hands out one message at a time."""

    takes_runs = False  # one message per `deliver`: the queue never calls deliver_ready on it
    prefetch = 1  # what the queue's pacing limit adds up (Queue.pace_limit)

    def __init__(self) -> None:
        self.closed = False
        self.active = False
        self.credit = 0
        self.inbox: list[Message] = []

    def has_credit(self) -> bool:
        return self.credit > 0

    def deliver(self, msg: Message) -> None:
        self.credit -= 1
        self.inbox.append(msg)


class QueueMachine(RuleBasedStateMachine):
    """`Queue` over `MemoryStore` against the list model: delivery takes the head, settle and purge
    forget, requeue restores the place and flags redelivered, counts and offsets agree."""

    def __init__(self) -> None:
        super().__init__()
        self.queue = Queue("q", Thresholds(max_count=0, max_size=0))  # unlimited: nothing refused
        self.fake = FakeSubscription()
        self.sub = cast(Subscription, self.fake)
        self.queue.add_subscription(self.sub)
        self.model = ListModel()
        self.requeued: set[int] = set()
        self.settled = 0

    def collect(self) -> None:
        """What the queue delivered must be the head of the model's ready messages, in order."""
        delivered, self.fake.inbox = self.fake.inbox, []
        for msg in delivered:
            assert msg is self.model.take()

    @rule(size=SIZES)
    def enqueue(self, size: int) -> None:
        msg = message(size, len(self.model.appended))
        expected_offset = self.queue.next_offset
        held = self.queue.enqueue(msg, None, 0)
        assert not held  # no stop threshold: never saturated
        assert msg.offset == expected_offset
        assert all(m.offset < msg.offset for m in self.model.appended)
        self.model.appended.append(msg)
        self.model.ready.add(id(msg))
        self.collect()

    @rule(n=st.integers(min_value=1, max_value=4))
    def grant(self, n: int) -> None:
        self.fake.credit += n
        self.queue.resume_subscription(self.sub)
        self.queue.dispatch()
        self.collect()

    @precondition(lambda self: self.model.taken)
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        for msg in self.model.pick_taken(data):
            self.queue.settle(msg)
            self.settled += 1
        self.queue.settled()
        self.collect()

    @precondition(lambda self: self.model.taken)
    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        returning = self.model.pick_taken(data)
        offsets = [m.offset for m in returning]
        self.queue.requeue_many(returning)
        assert [m.offset for m in returning] == offsets, "a requeue keeps the offsets"
        self.model.ready.update(id(m) for m in returning)
        self.requeued.update(id(m) for m in returning)
        self.collect()

    @rule()
    def purge(self) -> None:
        assert self.queue.purge() == len(self.model.ready)
        self.settled += len(self.model.ready)
        self.model.ready.clear()

    @invariant()
    def the_queue_agrees_with_the_model(self) -> None:
        ready = self.model.ready_in_order()
        owned = ready + self.model.taken
        assert list(self.queue.store) == ready
        stats = self.queue.statistics()
        assert (stats.messages, stats.bytes) == (len(owned), sum(m.size for m in owned))
        assert (stats.ready_messages, stats.unsettled_messages) == (len(ready), len(self.model.taken))
        assert (stats.enqueued, stats.dequeued) == (len(self.model.appended), self.settled)
        assert stats.next_offset == len(self.model.appended)  # offsets 0, 1, 2, ... never reused
        assert len({m.offset for m in self.model.appended}) == len(self.model.appended)
        assert all((id(m) in self.requeued) is m.redelivered for m in owned)


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_statistics_is_a_frozen_snapshot() -> None:
    queue = Queue("q", Thresholds(flow_stop_count=2, flow_resume_count=1))
    for i in range(3):
        queue.enqueue(message(10, i), None, 7)
    stats = queue.statistics()
    assert isinstance(stats, QueueStatistics)
    assert (stats.name, stats.messages, stats.bytes, stats.ready_messages) == ("q", 3, 30, 3)
    assert (stats.saturated, stats.saturated_since_ns, stats.held_transfers) == (True, 7, 1)  # the third tripped it
    assert (stats.stop_threshold, stats.stop_limit, stats.stop_value) == ("flow_stop_count", 2, 3)
    with pytest.raises(FrozenInstanceError):
        stats.messages = 0  # type: ignore[misc]
    queue.purge()
    assert stats.messages == 3 and queue.statistics().messages == 0
    assert queue.statistics().stop_threshold == ""


def test_a_store_that_recovered_messages_starts_the_queue_past_them() -> None:
    class Recovered(MemoryStore):
        start_offset = 41

    queue = Queue("q", Thresholds(), store=Recovered())
    msg = message(1)
    queue.enqueue(msg, None, 0)
    assert msg.offset == 41 and queue.statistics().enqueued == 1


def test_the_core_asks_its_store_factory_for_each_queue_with_the_durable_flag() -> None:
    h = Harness()
    asked: list[tuple[str, bool]] = []

    def factory(name: str, durable: bool) -> QueueStore:
        asked.append((name, durable))
        return memory_store(name, durable)

    h.core.store_factory = factory
    h.core.declare_queue("plain")
    h.core.declare_queue("kept", durable=True)
    h.core.declare_queue("kept", durable=True)  # declared again: the queue exists, no new store
    assert asked == [("plain", False), ("kept", True)]
    assert h.core.queues["kept"].durable and isinstance(h.core.queues["kept"].store, MemoryStore)


def test_producer_identity_reaches_every_queue_with_an_offset_of_each_queue() -> None:
    h = Harness()
    p = h.producer()
    for name in ("a", "b"):
        h.queue(name)
        assert isinstance(p.bind(name, "amq.fanout"), Ok)
    p.send("", "b", b"first in b")  # so b's offsets are one ahead of a's
    entries = [
        TransferEntry("amq.fanout", "", b"one", None, "spark-7", 0),
        TransferEntry("amq.fanout", "", b"two", None, "spark-7", 1),
    ]
    p.handle(Transfer(p.next_id, entries))
    p.next_id += len(entries)
    a, b = (list(h.core.queues[name].store) for name in ("a", "b"))
    key = scoped(p.session.identity, "spark-7")  # the user's own id of that name (broker/idempotence.py)
    assert [(m.body, m.producer_id, m.sequence, m.offset) for m in a] == [
        (b"one", key, 0, 0), (b"two", key, 1, 1)]
    assert [(m.body, m.producer_id, m.sequence, m.offset) for m in b] == [
        (b"first in b", None, None, 0), (b"one", key, 0, 1), (b"two", key, 1, 2)]
    assert a[0] is not b[1] and a[0].body is b[1].body  # a message each, one body


class CountingStore(MemoryStore):
    """A memory store that counts, for each requeue, the ready messages it reads or pops one at a time
    (what the deque's C `rotate`, `extend` and `extendleft` move in bulk is not counted)."""

    __slots__ = ("reads", "requeues")

    def __init__(self, msgs: Iterable[Message] = ()) -> None:
        super().__init__(msgs)
        self.reads = -1  # not in a requeue
        self.requeues: list[int] = []  # the reads of each requeue, in order

    def __getitem__(self, index: SupportsIndex) -> Message:  # type: ignore[override]  # (as deque: no slices)
        if self.reads >= 0:
            self.reads += 1
        return super().__getitem__(index)

    def popleft(self) -> Message:
        if self.reads >= 0:
            self.reads += 1
        return super().popleft()

    def requeue(self, msgs: Iterable[Message]) -> None:
        self.reads = 0
        super().requeue(msgs)
        self.requeues.append(self.reads)
        self.reads = -1


def test_requeueing_one_delivery_above_a_long_ready_head_reads_a_few_of_it() -> None:
    """A tester's stall: X took 290,000 messages and Y the next 1,000; X closed, its 290,000 back at the head,
    and each SETTLE(REQUEUE) of one of Y's tags popped all 290,000 to merge past them (35-117 ms a frame,
    every connection waiting). It is bisected into place: 20,000 ahead of it cost some 30 reads."""
    h = Harness()
    store = CountingStore()
    h.core.store_factory = lambda name, durable: store
    h.queue("rq", max_size=0)  # no limits
    p = h.producer(flow_control=False)
    for _ in range(21):
        p.send_many([("", "rq", b"x", None)] * 1000)
    x, y = h.consumer("x"), h.consumer("y")
    for _ in range(2):
        x.subscribe("rq", prefetch=10_000)
    for _ in range(20):  # (a collect takes at most MAX_DELIVERIES_WAITING, 2,048)
        x.pump()
    y.subscribe("rq", prefetch=1_000)
    y.pump()
    assert (len(x.unsettled), len(y.unsettled)) == (20_000, 1_000)
    x.close()  # its 20,000 deliveries go back to the head
    assert len(store) == 20_000 and store[0].offset == 0 and store[-1].offset == 19_999

    y.requeue([min(y.unsettled)])
    assert store.requeues[-1] <= 4 * len(store).bit_length()  # 2 x 15 probes; popping the head: 40,000 reads
    assert [m.offset for m in store] == list(range(1, 20_001))  # at its place (Y's credit took the head)


def test_two_deliveries_returning_far_apart_among_ready_ones_read_a_few_of_them() -> None:
    """What returns is placed run by run where it lands, not merged with every ready message between."""
    msgs = [message(1, i) for i in range(10_002)]
    for offset, msg in enumerate(msgs):
        msg.offset = offset
    store = CountingStore(msgs[1:-1])  # the messages between were requeued before
    store.requeue([msgs[-1], msgs[0]])
    [reads] = store.requeues
    assert reads <= 6 * len(store).bit_length()  # 3 x 14 probes; merging them: 10,000 pops and reads
    assert list(store) == msgs
