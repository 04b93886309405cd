"""The producer half of a connection (protocol/producer.py) against a model, without I/O: ids contiguous from
1, byte credit (DCP's one-message overflow, idempotent acknowledgements, resizes), every transfer completed
exactly once whatever the order of COMPLETEs, and COMPLETEs that cannot be right refused without effect."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flowbroker.protocol import BufferAck, BufferControl, Complete, ErrorCode, RemoteProtocolError
from flowbroker.protocol.producer import ProducerLedger


class Owner:
    """A producer, compared by identity as the SDK's are."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


OWNERS = [Owner("a"), Owner("b"), Owner("c")]


def check_runs(ledger: ProducerLedger[Owner]) -> None:
    """The ledger's shape: runs sorted from the cumulative point up to the highest id sent, no two
    completed runs side by side, the tail the last run's owner."""
    runs = ledger.runs()
    if not runs:
        assert ledger.cumulative == ledger.highest_sent
        assert ledger._tail is None
        return
    assert runs[0][0] == ledger.cumulative + 1 and runs[-1][1] == ledger.highest_sent
    for (_, last, a), (first, _, b) in zip(runs, runs[1:]):
        assert first == last + 1
        assert a is not None or b is not None, "two completed runs side by side"
    assert all(first <= last for first, last, _ in runs)
    assert ledger._tail is runs[-1][2]


class LedgerMachine(RuleBasedStateMachine):
    """Random sends, COMPLETEs (cumulative and ranges, repeated and out of order), BUFFER_ACKs (duplicated
    and reordered), resizes, ERROR look-ups, and invalid COMPLETEs and acknowledgements."""

    @initialize(window=st.integers(0, 5000))
    def start(self, window: int) -> None:
        self.ledger: ProducerLedger[Owner] = ProducerLedger(window)
        self.owner: dict[int, Owner] = {}  # every id sent
        self.done: set[int] = set()  # ids completed
        self.cumulative = 0
        self.window = window
        self.position = 0
        self.acked = 0
        self.completed = Counter[Owner]()

    @property
    def highest(self) -> int:
        return len(self.owner)

    # -------------------------------------------------------------- sending

    @rule(owner=st.sampled_from(OWNERS), sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=6))
    def send(self, owner: Owner, sizes: list[int]) -> None:
        for size in sizes:
            allowed = self.window == 0 or self.position < self.acked + self.window
            assert self.ledger.may_send() is allowed
            if not allowed:
                return
            transfer_id = self.ledger.on_sent(owner, size)
            assert transfer_id == self.highest + 1
            self.owner[transfer_id] = owner
            self.position += size
            # The one-message overflow: whatever was outstanding before was under the window.
            assert self.window == 0 or self.position - self.acked < self.window + size

    # -------------------------------------------------------------- completions

    def _snapshot(self) -> tuple[object, ...]:
        ledger = self.ledger
        return (ledger.runs(), ledger.cumulative, ledger.completed, ledger.next_id, ledger._tail)

    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        cumulative = data.draw(st.integers(self.cumulative, self.highest), label="cumulative")
        above = data.draw(st.sets(st.integers(cumulative + 1, max(cumulative + 1, self.highest))), label="above")
        above = {i for i in above if i <= self.highest}
        ranges: list[tuple[int, int]] = []
        for i in sorted(above):
            if ranges and i == ranges[-1][1] + 1 and data.draw(st.booleans(), label="merge"):
                ranges[-1] = (ranges[-1][0], i)
            else:
                ranges.append((i, i))
        newly = {i for i in range(1, cumulative + 1) if i not in self.done} | (above - self.done)
        result = self.ledger.on_complete(Complete(cumulative, ranges))
        got = Counter[Owner]()
        for owner, count in result:
            assert count > 0
            got[owner] += count
        assert got == Counter(self.owner[i] for i in newly)
        self.done |= newly
        self.completed += got
        self.cumulative = cumulative

    @precondition(lambda self: len(self.done) < self.highest)
    @rule(data=st.data())
    def complete_one(self, data: st.DataObject) -> None:
        """One transfer in flight completes out of order (a queue held it): the common case, and the one that
        makes completed runs meet (they must merge)."""
        tid = data.draw(st.sampled_from(sorted(set(self.owner) - self.done)), label="one")
        ranges = [(tid, tid)] if tid > self.cumulative + 1 else []
        cumulative = self.cumulative + 1 if not ranges else self.cumulative
        newly = {i for i in range(1, cumulative + 1) if i not in self.done} | {tid}
        got = Counter[Owner]()
        for owner, count in self.ledger.on_complete(Complete(cumulative, ranges)):
            got[owner] += count
        assert got == Counter(self.owner[i] for i in newly)
        self.done |= newly
        self.completed += got
        self.cumulative = cumulative

    @rule(data=st.data())
    def complete_again(self, data: st.DataObject) -> None:
        """A COMPLETE repeating what is known (same cumulative, ranges already completed) completes nothing."""
        repeat = sorted(i for i in self.done if i > self.cumulative)
        ranges = [(i, i) for i in data.draw(st.lists(st.sampled_from(repeat), unique=True), label="repeat")] if repeat else []
        assert self.ledger.on_complete(Complete(self.cumulative, sorted(ranges))) == []

    @rule(data=st.data())
    def invalid_complete(self, data: st.DataObject) -> None:
        choices = ["beyond", "range-beyond", "unsorted", "at-cumulative"]
        if self.cumulative > 0:
            choices.append("backwards")
        kind = data.draw(st.sampled_from(choices), label="kind")
        top = self.highest
        if kind == "beyond":
            frame, code = Complete(top + data.draw(st.integers(1, 2**62)), []), ErrorCode.UNEXPECTED_FRAME
        elif kind == "range-beyond":
            frame, code = Complete(self.cumulative, [(top + 1, top + 1 + data.draw(st.integers(0, 2**62)))]), ErrorCode.UNEXPECTED_FRAME
        elif kind == "backwards":
            frame, code = Complete(data.draw(st.integers(0, self.cumulative - 1)), []), ErrorCode.UNEXPECTED_FRAME
        elif kind == "unsorted":
            frame, code = Complete(self.cumulative, [(self.cumulative + 3, self.cumulative + 3), (self.cumulative + 2, self.cumulative + 2)]), ErrorCode.MALFORMED_FRAME
        else:
            frame, code = Complete(self.cumulative + 1, [(self.cumulative + 1, self.cumulative + 1)]), ErrorCode.MALFORMED_FRAME
        before = self._snapshot()
        with pytest.raises(RemoteProtocolError) as info:
            self.ledger.on_complete(frame)
        assert info.value.code == code
        assert self._snapshot() == before

    @rule(tid=st.integers(0, 2**63))
    def error_names(self, tid: int) -> None:
        tid = tid if tid <= self.highest + 1 else tid % (self.highest + 2)
        expected = self.owner[tid] if tid in self.owner and tid not in self.done else None
        assert self.ledger.owner_of(tid) is expected

    # -------------------------------------------------------------- byte credit

    @rule(data=st.data())
    def buffer_ack(self, data: st.DataObject) -> None:
        """Any position up to what was sent: a fresh, duplicated or stale (reordered) acknowledgement."""
        acked = data.draw(st.integers(0, self.position), label="acked")
        freed = self.ledger.on_buffer_ack(BufferAck(0, 0, acked))
        assert freed == max(0, acked - self.acked)
        self.acked = max(self.acked, acked)

    @rule(beyond=st.integers(1, 10**6))
    def buffer_ack_beyond_sent(self, beyond: int) -> None:
        with pytest.raises(RemoteProtocolError) as info:
            self.ledger.on_buffer_ack(BufferAck(0, beyond, self.position + beyond))
        assert info.value.code == ErrorCode.CREDIT_VIOLATION

    @rule(window=st.integers(0, 5000), opaque=st.sampled_from([0, 0, 0, 7]))
    def resize(self, window: int, opaque: int) -> None:
        assert self.ledger.on_buffer_control(BufferControl(opaque, window)) is (opaque == 0)
        if opaque == 0:
            self.window = window

    # -------------------------------------------------------------- invariants

    @invariant()
    def counts(self) -> None:
        ledger = self.ledger
        assert ledger.highest_sent == self.highest
        assert ledger.cumulative == self.cumulative
        assert ledger.completed == len(self.done) and ledger.in_flight == self.highest - len(self.done)
        assert self.done >= set(range(1, self.cumulative + 1))
        assert (ledger.window.position, ledger.window.acked_position, ledger.window.window) == (
            self.position,
            self.acked,
            self.window,
        )
        assert self.completed == Counter(self.owner[i] for i in self.done)
        check_runs(ledger)
        stats = ledger.statistics()
        assert (stats.transfers_sent, stats.transfers_completed, stats.transfers_in_flight) == (
            self.highest,
            len(self.done),
            self.highest - len(self.done),
        )
        assert stats.limit == self.acked + self.window and stats.runs == len(ledger.runs())


LedgerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_ledger_against_a_model = LedgerMachine.TestCase


# -- examples ------------------------------------------------------------------------------------------


def _ledger(*owners: Owner) -> ProducerLedger[Owner]:
    ledger: ProducerLedger[Owner] = ProducerLedger(0)
    for owner in owners:
        ledger.on_sent(owner, 100)
    return ledger


A, B, C = OWNERS


def test_ids_are_contiguous_from_1_and_a_burst_is_one_run() -> None:
    ledger = _ledger(A, A, A, B, B, A)
    assert ledger.runs() == [(1, 3, A), (4, 5, B), (6, 6, A)]
    assert ledger.window.position == 600 and ledger.in_flight == 6


def test_cumulative_complete_retires_runs_one_count_per_run() -> None:
    ledger = _ledger(A, A, A, B, B, A)
    assert ledger.on_complete(Complete(4, [])) == [(A, 3), (B, 1)]
    assert ledger.runs() == [(5, 5, B), (6, 6, A)]
    assert ledger.on_complete(Complete(6, [])) == [(B, 1), (A, 1)]
    assert ledger.runs() == [] and ledger.in_flight == 0 and ledger.completed == 6


def test_ranges_complete_out_of_order_and_repeats_count_nothing() -> None:
    ledger = _ledger(A, A, A, B, B, B)
    assert ledger.on_complete(Complete(0, [(2, 2), (4, 5)])) == [(A, 1), (B, 2)]
    assert ledger.runs() == [(1, 1, A), (2, 2, None), (3, 3, A), (4, 5, None), (6, 6, B)]
    assert ledger.on_complete(Complete(0, [(2, 2), (4, 5)])) == []  # the broker repeating itself
    assert ledger.owner_of(2) is None and ledger.owner_of(3) is A and ledger.owner_of(6) is B
    assert ledger.on_complete(Complete(3, [(4, 4)])) == [(A, 1), (A, 1)]
    assert ledger.runs() == [(4, 5, None), (6, 6, B)]
    assert ledger.on_complete(Complete(5, [])) == [] and ledger.runs() == [(6, 6, B)]


@pytest.mark.parametrize(
    ("frame", "code", "text"),
    [
        (Complete(4, []), ErrorCode.UNEXPECTED_FRAME, "up to 4 but only 3 were sent"),
        (Complete(1, [(2, 4)]), ErrorCode.UNEXPECTED_FRAME, "up to 4 but only 3 were sent"),
        (Complete(0, [(1, 1), (4, 2**63)]), ErrorCode.UNEXPECTED_FRAME, "only 3 were sent"),
        (Complete(2, [(2, 3)]), ErrorCode.MALFORMED_FRAME, "not above the cumulative id 2"),
        (Complete(0, [(3, 3), (1, 1)]), ErrorCode.MALFORMED_FRAME, "ascending"),
        (Complete(0, [(1, 2), (2, 3)]), ErrorCode.MALFORMED_FRAME, "disjoint"),
    ],
)
def test_a_complete_that_cannot_be_right_is_refused_and_changes_nothing(frame: Complete, code: ErrorCode, text: str) -> None:
    ledger = _ledger(A, A, B)
    with pytest.raises(RemoteProtocolError, match=text) as info:
        ledger.on_complete(frame)
    assert info.value.code == code
    assert ledger.runs() == [(1, 2, A), (3, 3, B)] and ledger.cumulative == 0 and ledger.completed == 0


def test_completed_runs_that_meet_merge() -> None:
    ledger = _ledger(A, A, B, A)
    assert ledger.on_complete(Complete(0, [(4, 4)])) == [(A, 1)]
    assert ledger.on_complete(Complete(0, [(3, 3)])) == [(B, 1)]  # ends where the completed run 4 begins
    assert ledger.runs() == [(1, 2, A), (3, 4, None)]
    assert ledger.on_complete(Complete(0, [(2, 2)])) == [(A, 1)]  # and one that begins where it ends
    assert ledger.runs() == [(1, 1, A), (2, 4, None)]


def test_the_cumulative_id_cannot_go_back() -> None:
    ledger = _ledger(A, A, B)
    ledger.on_complete(Complete(2, []))
    with pytest.raises(RemoteProtocolError, match="back from 2 to 1") as info:
        ledger.on_complete(Complete(1, []))
    assert info.value.code == ErrorCode.UNEXPECTED_FRAME
    assert ledger.on_complete(Complete(2, [])) == []  # the same point again is harmless


def test_byte_credit_one_message_overflow_acks_idempotent_and_resize() -> None:
    ledger: ProducerLedger[Owner] = ProducerLedger(1000)
    assert ledger.may_send()
    ledger.on_sent(A, 5000)  # larger than the whole window: goes while nothing is outstanding
    assert not ledger.may_send()
    assert ledger.on_buffer_ack(BufferAck(0, 4500, 4500)) == 4500
    assert ledger.on_buffer_ack(BufferAck(0, 4500, 4500)) == 0  # duplicate
    assert ledger.on_buffer_ack(BufferAck(0, 100, 4000)) == 0  # reordered, stale
    assert ledger.may_send()  # 500 outstanding < 1000
    assert ledger.on_buffer_control(BufferControl(0, 400))
    assert not ledger.may_send() and ledger.window.limit == 4900
    assert not ledger.on_buffer_control(BufferControl(3, 0))  # a subscription's: not ours
    with pytest.raises(RemoteProtocolError, match="per connection") as info:
        ledger.on_buffer_ack(BufferAck(3, 0, 0))
    assert info.value.code == ErrorCode.UNEXPECTED_FRAME
    with pytest.raises(RemoteProtocolError, match="beyond the 5000 bytes sent") as info:
        ledger.on_buffer_ack(BufferAck(0, 1, 5001))
    assert info.value.code == ErrorCode.CREDIT_VIOLATION  # as the broker answers a consumer's over-acknowledgement
    assert ledger.window.acked_position == 4500
