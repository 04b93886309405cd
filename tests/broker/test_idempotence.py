"""The broker's idempotent-producer state (broker/idempotence.py) against a model.

A hypothesis state machine sends random sequences (next ones, resends of old ones, jumps ahead) from a
handful of producer ids with a clock that moves, through `ProducerSequences` over a small
`MemoryProducerStates`, and checks every verdict against a model that keeps *every* id forever:

- a message is taken exactly when its sequence is the next of its id, so what is taken per id is
  0, 1, 2, ... each exactly once, in order (the model's stream);
- a sequence at or below the last taken is a duplicate while the id is tracked; above the next, a gap;
- the store never holds more than `max_ids` ids, nor more than `max_ids_per_owner` of one user's
  (scoped keys); an id is forgotten only after it has been idle for the TTL, and a new id is refused
  only when every tracked id (or every one its user holds) has been active within the TTL;
- a forgotten id is unknown: it must start again at 0 (the documented "duplicate of an evicted id");
- messages come from connections that open and close (`Holder`s): the flow timer's expiry never forgets
  an id whose last message's connection is open, and a new id refused finds every id the store holds
  (or its user holds) active within the TTL by the store's clock.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from flowbroker.broker.idempotence import (
    DUPLICATE,
    MAX_PRODUCER_ID_LENGTH,
    MemoryProducerStates,
    ProducerSequences,
    scoped,
)
from flowbroker.protocol.errors import ErrorCode

IDS = ["p0", scoped("u", "p1"), scoped("u", "p2"), scoped("u", "p3"), scoped("v", "p1")]
MAX_IDS = 3
MAX_OWNED = 2
TTL = 100


def owner(key: str) -> str:
    return key.split("\x00")[0] if "\x00" in key else ""


class Conn:
    """A connection as the store sees it (broker/message.py SessionRef): `session` None once closed."""

    def __init__(self) -> None:
        self.session: object | None = object()
        self.ids_taken = 0
        self.closed_ns = 0


class IdempotenceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.conns = [Conn(), Conn()]
        self.holder: dict[str, Conn] = {}  # model: the connection of each id's last message or duplicate
        self.store = MemoryProducerStates(MAX_IDS, TTL, MAX_OWNED)
        self.sequences = ProducerSequences(self.store)
        self.now = 0
        self.tracked: dict[str, tuple[int, int]] = {}  # model: id -> (last taken, last_ns) while tracked
        self.taken: dict[str, list[int]] = {pid: [] for pid in IDS}  # every sequence ever taken, per id
        self.epoch: dict[str, int] = {pid: 0 for pid in IDS}  # where the id's current stream starts in `taken`

    def _send(self, pid: str, sequence: int, conn: int = 0) -> None:
        before = dict(self.tracked)
        store_ages = {p: self.now - ns for p, _, ns in self.store.items()}
        via = self.conns[conn % len(self.conns)]
        verdict = self.sequences.check(pid.split("\x00")[-1], sequence, self.now, pid, via)
        known = before.get(pid)
        expected = 0 if known is None else known[0] + 1
        if verdict is None:
            assert sequence == expected, (pid, sequence, expected)
            self.taken[pid].append(sequence)
            self.tracked[pid] = (sequence, self.now)
            self.holder[pid] = via
        elif verdict is DUPLICATE:
            assert known is not None and sequence <= known[0]
            self.holder[pid] = via
        else:
            code, _ = verdict  # type: ignore[misc]
            if code is ErrorCode.SEQUENCE_GAP:
                assert sequence > expected
            else:
                assert code is ErrorCode.RESOURCE_EXHAUSTED, verdict
                assert known is None and sequence == 0
                mine = {k: v for k, v in before.items() if owner(pid) and owner(k) == owner(pid)}
                full = mine if len(mine) == MAX_OWNED else before
                assert len(full) in (MAX_IDS, MAX_OWNED), (pid, before)
                # every id it could have forgotten is younger than the TTL, or its connection closed less
                # than a TTL ago (kept a TTL after the close)
                assert all(store_ages[k] < TTL or (self.holder[k].session is None
                                                    and self.now - self.holder[k].closed_ns < TTL) for k in full), \
                    "refused with an idle id"
        # ids the store dropped to make room for a new one: only ids idle for the TTL
        for other in list(self.tracked):
            if self.store.last_accepted(other) is None:
                assert self.now - self.tracked[other][1] >= TTL
                holder = self.holder[other]  # set aside while open (the oldest make room), or closed a TTL ago
                assert holder.session is not None or self.now - holder.closed_ns >= TTL, (other, holder.closed_ns)
                del self.tracked[other]
                self.epoch[other] = len(self.taken[other])

    @rule(i=st.integers(0, len(IDS) - 1), conn=st.integers(0, 3))
    def send_next(self, i: int, conn: int) -> None:
        pid = IDS[i]
        known = self.tracked.get(pid)
        self._send(pid, 0 if known is None else known[0] + 1, conn)

    @rule(i=st.integers(0, len(IDS) - 1), back=st.integers(0, 5), conn=st.integers(0, 3))
    def resend(self, i: int, back: int, conn: int) -> None:
        pid = IDS[i]
        known = self.tracked.get(pid)
        self._send(pid, max(0, (known[0] if known else 0) - back), conn)

    @rule(i=st.integers(0, 3))
    def close_connection(self, i: int) -> None:
        conn = self.conns.pop(i % len(self.conns))
        conn.session = None
        conn.closed_ns = self.now
        self.store.closed(conn, self.now)
        self.conns.append(Conn())  # (always two open to send from)

    @rule(i=st.integers(0, len(IDS) - 1), ahead=st.integers(2, 5))
    def jump(self, i: int, ahead: int) -> None:
        pid = IDS[i]
        known = self.tracked.get(pid)
        self._send(pid, (known[0] if known else -1) + ahead)

    @rule(seconds=st.integers(1, 60))
    def tick(self, seconds: int) -> None:
        self.now += seconds

    @rule()
    def expire(self) -> None:
        before = dict(self.tracked)
        self.store.expire(self.now)
        for pid, (_, last_ns) in before.items():
            forgotten = self.store.last_accepted(pid) is None
            if forgotten:  # only idle for the TTL, its connection closed a TTL ago (docs: "a ttl after it closes")
                holder = self.holder[pid]
                assert self.now - last_ns >= TTL and holder.session is None, (pid, self.now, last_ns)
                assert self.now - holder.closed_ns >= TTL, (pid, self.now, holder.closed_ns)
                del self.tracked[pid]
                self.epoch[pid] = len(self.taken[pid])

    @invariant()
    def exactly_once_in_order(self) -> None:
        for pid in IDS:
            stream = self.taken[pid][self.epoch[pid]:]
            assert stream == list(range(len(stream))), (pid, stream)
            if pid in self.tracked:
                assert self.store.last_accepted(pid) == self.tracked[pid][0] == len(stream) - 1

    @invariant()
    def bounded(self) -> None:
        assert len(self.store) <= MAX_IDS
        assert len(self.store) == len(self.tracked)
        for user in ("u", "v"):
            held = sum(owner(k) == user for k in self.tracked)
            assert held <= MAX_OWNED and self.store.owned(user) == held


TestIdempotenceMachine = IdempotenceMachine.TestCase
TestIdempotenceMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_a_new_id_evicts_only_ids_idle_for_the_ttl() -> None:
    rules = ProducerSequences(MemoryProducerStates(2, TTL))
    assert rules.check("a", 0, 0) is None
    assert rules.check("b", 0, 10) is None
    refused = rules.check("c", 0, TTL - 1)
    assert refused is not None and refused is not DUPLICATE
    code, text = refused  # type: ignore[misc]
    assert code is ErrorCode.RESOURCE_EXHAUSTED and "max_producer_ids 2" in text and "'c'" in text
    assert rules.check("c", 0, TTL) is None  # "a" is idle for the TTL now: evicted for "c"
    assert rules.store.last_accepted("a") is None and rules.store.last_accepted("b") == 0
    # "a" is unknown again: its resend of 0 is taken anew (the documented limit), 1 would be a gap
    stats = rules.statistics()
    assert (stats.producer_ids, stats.accepted, stats.refused, stats.evicted) == (2, 3, 1, 1)


def test_one_user_holds_at_most_its_share_of_the_ids() -> None:
    """A user with write permission somewhere cannot take every place and refuse the others' new producers."""
    rules = ProducerSequences(MemoryProducerStates(4, TTL, 2))
    assert rules.check("a", 0, 0, scoped("mallory", "a")) is None
    assert rules.check("b", 0, 1, scoped("mallory", "b")) is None
    refused = rules.check("c", 0, 2, scoped("mallory", "c"))
    assert refused is not None and refused is not DUPLICATE
    code, text = refused  # type: ignore[misc]
    assert code is ErrorCode.RESOURCE_EXHAUSTED
    assert "user 'mallory' holds max_producer_ids_per_user 2" in text and "'c'" in text and "\x00" not in text
    assert rules.check("a", 0, 2, scoped("alice", "a")) is None  # alice's own place is still there
    assert rules.check("c", 0, TTL, scoped("mallory", "c")) is None  # mallory's "a" idle for the TTL: evicted
    assert rules.store.owned("mallory") == 2 and rules.store.owned("alice") == 1  # type: ignore[attr-defined]


def test_duplicates_and_gaps_name_what_the_broker_expects() -> None:
    rules = ProducerSequences(MemoryProducerStates(10, TTL))
    for seq in range(3):
        assert rules.check("writer-7", seq, seq) is None
    assert rules.check("writer-7", 1, 5) is DUPLICATE
    gap = rules.check("writer-7", 5, 6)
    assert gap is not None and gap is not DUPLICATE
    code, text = gap  # type: ignore[misc]
    assert code is ErrorCode.SEQUENCE_GAP and "'writer-7'" in text and "expected sequence 3" in text
    unknown = rules.check("fresh", 4, 7)
    assert unknown is not None and "expected sequence 0" in unknown[1]  # type: ignore[index]
    assert rules.check("writer-7", 3, 8) is None  # the gap took nothing: 3 is still the next
    stats = rules.statistics()
    assert (stats.accepted, stats.duplicates, stats.gaps) == (4, 1, 2)


@pytest.mark.parametrize("producer_id, sequence", [("p", None), ("", 0), ("x" * (MAX_PRODUCER_ID_LENGTH + 1), 0)])
def test_an_id_without_a_sequence_or_out_of_bounds_is_refused(producer_id: str, sequence: int | None) -> None:
    rules = ProducerSequences(MemoryProducerStates(10, TTL))
    verdict = rules.check(producer_id, sequence, 0)
    assert verdict is not None and verdict is not DUPLICATE
    assert verdict[0] is ErrorCode.INVALID_ARGUMENT  # type: ignore[index]
    assert len(rules.store) == 0


def test_the_deduplication_state_is_sans_io() -> None:
    """No trio, socket or clock: time arrives as now_ns, so a durable store and these tests drive it alike."""
    import flowbroker.broker.idempotence as module
    from pathlib import Path

    from tests.transport.test_sans_io import IO_MODULES, imported

    assert imported(Path(module.__file__)) & IO_MODULES == set()


def test_one_users_refusals_cannot_push_out_anothers() -> None:
    """Kept broker-wide, another user's 5,000 refused messages pushed out a refusal, and its resend then
    completed as a plain duplicate (a tester). Each user keeps its own newest REFUSALS_KEPT."""
    from flowbroker.broker.idempotence import REFUSALS_KEPT, Refused

    rules = ProducerSequences(MemoryProducerStates(10, TTL))
    alice = scoped("alice", "p")
    assert rules.check("p", 0, 0, alice) is None
    rules.was_refused(alice, 0, ((ErrorCode.NOT_FOUND, "no queue named 'x'", "x"),))
    mallory = scoped("mallory", "m")
    for seq in range(REFUSALS_KEPT + 100):
        assert rules.check("m", seq, 1, mallory) is None
        rules.was_refused(mallory, seq, ((ErrorCode.NOT_FOUND, "no queue named 'y'", "y"),))
    verdict = rules.check("p", 0, 2, alice)
    assert isinstance(verdict, Refused) and verdict.errors[0][2] == "x"
    assert len(rules.refusals["mallory"]) == REFUSALS_KEPT


def test_a_refusal_keeps_one_error_however_many_queues_refused_it() -> None:
    """Every ERROR of a refusal was kept, one per queue: 600 messages to a fanout over 2,000 full queues held
    232 MiB for one user (a tester). The first is kept, saying how many more there were."""
    from flowbroker.broker.idempotence import Refused

    rules = ProducerSequences(MemoryProducerStates(10, TTL))
    alice = scoped("alice", "p")
    assert rules.check("p", 0, 0, alice) is None
    errors = tuple((ErrorCode.QUEUE_FULL, f"queue 'q{i}' is full", f"q{i}") for i in range(2000))
    rules.was_refused(alice, 0, errors)
    verdict = rules.check("p", 0, 1, alice)
    assert isinstance(verdict, Refused)
    assert verdict.errors == ((ErrorCode.QUEUE_FULL, "queue 'q0' is full (and 1999 more ERROR(s) about this message)",
                               "q0"),)
