"""Deliveries and their settlement (protocol/delivery.py): tags, SETTLE ranges, CANCEL, close, the buffer.

In memory, no trio and no broker: owners are `Owner`s standing in for subscriptions (compared by
identity, as subscriptions are), items are ints standing in for messages, and a hypothesis state
machine checks the ledger against a dict.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flowbroker.protocol.delivery import DeliveryLedger


class Owner:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


A, B, C = Owner("a"), Owner("b"), Owner("c")


def ledger(window: int = 0) -> DeliveryLedger[Owner, int]:
    return DeliveryLedger(window)


def test_tags_are_positive_and_strictly_increasing() -> None:
    d = ledger()
    assert [d.deliver(A, i, 10) for i in range(5)] == [1, 2, 3, 4, 5]
    d.settle([(1, 5)])
    assert d.deliver(A, 5, 10) == 6  # settling never reuses a tag


def test_settle_returns_what_it_settled_in_tag_order_and_counts_the_unknown() -> None:
    d = ledger()
    for i in range(1, 11):
        d.deliver(A if i % 2 else B, i * 100, 10)
    settled, unknown = d.settle([(3, 5), (9, 20)])
    assert settled == [(A, 300), (B, 400), (A, 500), (A, 900), (B, 1000)]
    assert unknown == 12 - 2  # 11..20 were never delivered
    assert sorted(d.unsettled) == d.tags == [1, 2, 6, 7, 8]
    settled, unknown = d.settle([(3, 5)])  # already settled
    assert settled == [] and unknown == 3


def test_a_settle_of_wide_ranges_over_nothing_settles_nothing() -> None:
    d = ledger()
    d.deliver(A, 1, 10)
    settled, unknown = d.settle([(10**9 * k + 2, 10**9 * (k + 1)) for k in range(1000)])
    assert settled == [] and unknown == sum(10**9 - 1 for _ in range(1000))
    assert d.tags == [1]


def test_cancel_gives_back_one_owners_deliveries_in_tag_order() -> None:
    d = ledger()
    for i, owner in enumerate([A, B, A, B, None, A]):
        if owner is not None:
            d.deliver(owner, i, 10)
    assert d.cancel(Owner("a")) == []  # another subscription of the same name: not its deliveries
    assert d.cancel(A) == [0, 2, 5]
    assert d.cancel(A) == []
    assert list(d.unsettled.values()) == [(B, 1), (B, 3)] and d.tags == [2, 4]


def test_cancel_walks_from_the_subscriptions_first_tag() -> None:
    d = ledger()
    for i in range(1, 6):
        d.deliver(A, i, 10)
    since = d.next_tag  # B subscribes now
    d.deliver(B, 6, 10)
    d.deliver(A, 7, 10)
    d.deliver(B, 8, 10)
    assert d.cancel(B, since) == [6, 8]
    assert d.tags == [1, 2, 3, 4, 5, 7] and list(d.unsettled) == d.tags
    assert d.cancel(A, since) == [7]  # a wrong `since` misses what is older: the caller's promise
    assert d.cancel(A) == [1, 2, 3, 4, 5] and d.tags == []


def test_close_gives_back_everything_in_tag_order() -> None:
    d = ledger()
    for i in range(4):
        d.deliver([A, B][i % 2], i, 10)
    d.settle([(2, 2)])
    assert d.close() == [(A, 0), (A, 2), (B, 3)]
    assert len(d) == 0 and d.tags == []


def test_the_connection_buffer_counts_delivered_bytes_and_lets_one_overflow() -> None:
    d = ledger(window=100)
    assert d.may_send()
    d.deliver(A, 1, 99)
    assert d.may_send()  # one byte left: the next delivery may be any size
    d.deliver(A, 2, 500)
    assert not d.may_send() and d.window.position == 599
    d.window.on_ack(599)
    assert d.may_send()
    stats = d.statistics()
    assert (stats.delivered, stats.unsettled, stats.position, stats.acked_position, stats.window) == (2, 2, 599, 599, 100)


def test_without_a_connection_buffer_delivery_is_not_paced_by_bytes() -> None:
    d = ledger()
    for i in range(100):
        d.deliver(A, i, 1 << 20)
    assert d.may_send()


class DeliveryLedgerMachine(RuleBasedStateMachine):
    """Deliveries to three owners, settled by random ranges, cancelled and closed, against a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = ledger(window=1000)
        self.model: dict[int, tuple[Owner, int]] = {}
        # Three subscriptions at a time, each with the connection's next tag when it began (its CANCEL's
        # `since`); a cancelled one is replaced by a new one, as a client subscribes again.
        self.owners = {name: (Owner(name), 1) for name in "abc"}
        self.last_tag = 0
        self.sent = 0
        self.items = 0

    @rule(name=st.sampled_from("abc"), size=st.integers(1, 400))
    def deliver(self, name: str, size: int) -> None:
        owner = self.owners[name][0]
        self.items += 1
        tag = self.ledger.deliver(owner, self.items, size)
        assert tag == self.last_tag + 1
        self.last_tag = tag
        self.model[tag] = (owner, self.items)
        self.sent += size

    @rule(ranges=st.lists(st.tuples(st.integers(-2, 40), st.integers(0, 10)), max_size=5))
    def settle(self, ranges: list[tuple[int, int]]) -> None:
        wire = [(lo, lo + width) for lo, width in ranges]
        settled, unknown = self.ledger.settle(wire)
        expected: list[tuple[int, tuple[Owner, int]]] = []
        named = 0
        for lo, hi in wire:
            named += hi - lo + 1
            for tag in range(lo, hi + 1):
                if tag in self.model:
                    expected.append((tag, self.model.pop(tag)))
        assert settled == [pair for _, pair in sorted(expected, key=lambda e: e[0])]  # in tag order
        assert unknown == named - len(expected)

    @rule(name=st.sampled_from("abc"), walk_all=st.booleans())
    def cancel(self, name: str, walk_all: bool) -> None:
        owner, since = self.owners[name]
        expected = [item for tag, (holder, item) in sorted(self.model.items()) if holder is owner]
        assert self.ledger.cancel(owner, 1 if walk_all else since) == expected
        self.model = {tag: pair for tag, pair in self.model.items() if pair[0] is not owner}
        self.owners[name] = (Owner(name), self.last_tag + 1)

    @precondition(lambda self: self.sent > 0)
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        self.ledger.window.on_ack(data.draw(st.integers(0, self.sent)))

    @rule()
    def close(self) -> None:
        assert self.ledger.close() == [pair for _, pair in sorted(self.model.items())]
        self.model = {}
        self.owners = {name: (Owner(name), self.last_tag + 1) for name in "abc"}

    @invariant()
    def unsettled_matches_the_model_in_tag_order(self) -> None:
        assert self.ledger.unsettled == self.model
        assert self.ledger.tags == sorted(self.model) == list(self.ledger.unsettled)
        assert all(tag > 0 for tag in self.ledger.tags)

    @invariant()
    def the_buffer_counts_every_delivered_byte(self) -> None:
        window = self.ledger.window
        assert window.position == self.sent
        assert window.may_send() == (window.position < window.acked_position + window.window)


TestDeliveryLedgerMachine = DeliveryLedgerMachine.TestCase
TestDeliveryLedgerMachine.settings = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@given(st.lists(st.integers(1, 400), min_size=0, max_size=200, unique=True),
       st.lists(st.tuples(st.integers(1, 450), st.integers(0, 5)), min_size=0, max_size=40),
       st.booleans())
def test_ranges_settle_as_one_at_a_time_would(delivered: list[int], picks: list[tuple[int, int]], ordered: bool) -> None:
    """Ranges cut the outstanding tags once per frame (a tester: 1,024 ranges over 1,000,000 tags were
    1,024 shifts, 100 ms), in any order and overlapping: they settle exactly what one range at a time
    would, in tag order, a tag named twice counted once not outstanding."""
    ledger: DeliveryLedger[str, int] = DeliveryLedger()
    for tag in range(1, 401):
        ledger.deliver("a", tag, 1)
    ledger.settle([(tag, tag) for tag in range(1, 401) if tag not in set(delivered)])  # what stays: `delivered`
    ranges = sorted({(lo, lo + width) for lo, width in picks})
    if ordered:  # ascending and disjoint
        kept, last = [], 0
        for lo, hi in ranges:
            if lo > last:
                kept.append((lo, hi))
                last = hi
        ranges = kept
    expected_unsettled = set(delivered)
    expected: list[int] = []
    unknown = 0
    for lo, hi in ranges:
        hit = sorted(t for t in expected_unsettled if lo <= t <= hi)
        expected += hit
        expected_unsettled -= set(hit)
        unknown += hi - lo + 1 - len(hit)
    settled, got_unknown = ledger.settle(ranges if ordered else list(reversed(ranges)))  # (any order)
    assert [item for _, item in settled] == sorted(expected) and got_unknown == unknown
    assert ledger.tags == sorted(expected_unsettled) == list(ledger.unsettled)
