"""Idempotent producers in the core: duplicates completed and not enqueued, gaps refused with the
connection kept, held originals, untrackable ids; and a hypothesis state machine of one idempotent
stream through random reconnects (the broker noticing the old connection or not), frames lost with a
connection, duplicate resends and a queue that saturates and drains, after which the queue has held
every sequence exactly once, in order."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.broker.coreharness import Consumer, Harness, Producer

from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Complete, FlowStopped


def make(**server: object) -> Harness:
    return Harness(credit={"policy": "static", "static_size": 1 << 20}, server=dict(server))


def producer(h: Harness, name: str) -> Producer:
    """A producer connection past its provisional one-message grant (registered with the credit pool)."""
    p = h.producer(name)
    p.register()
    return p


def send(p: Producer, pid: str, sequences: list[int], queue: str = "q") -> list[int]:
    return p.send_many([("", queue, b"%d" % s, None) for s in sequences], producer_id=pid, sequences=sequences)


def later(h: Harness, seconds: float) -> None:
    """`seconds` pass, and the flow timer looks (it forgets or sets aside idle producer ids)."""
    h.advance(seconds)
    h.core.tick(h.core.clock_ns())


def evicted(h: Harness) -> int:
    """Producer ids the store has forgotten so far."""
    return h.core.producer_sequences.statistics().evicted


def queued(h: Harness, queue: str = "q") -> list[bytes]:
    c = h.consumer("reader")
    c.subscribe(queue)
    c.pump()
    bodies = c.bodies()
    c.close()  # unsettled: back to the queue
    return bodies


def test_a_resent_batch_lands_once_and_its_duplicates_complete_at_once() -> None:
    h = make()
    h.queue("q")
    first = producer(h, "first")
    send(first, "writer", [0, 1, 2, 3])
    first.close()  # lost before it read its completions
    second = producer(h, "second")
    ids = send(second, "writer", [0, 1, 2, 3, 4, 5])
    second.pump()
    assert all(second.is_complete(tid) for tid in ids) and second.errors == []
    assert second.session.statistics().transfers_duplicate == 4
    assert queued(h) == [b"%d" % s for s in range(6)]
    stats = h.core.producer_sequences.statistics()
    assert (stats.producer_ids, stats.accepted, stats.duplicates) == (1, 6, 4)


def test_plain_messages_beside_an_idempotent_stream_are_untouched() -> None:
    h = make()
    h.queue("q")
    p = producer(h, "producer")
    send(p, "writer", [0])
    p.send("", "q", b"plain")
    p.send("", "q", b"plain")  # the same body twice without a producer id: two messages
    send(p, "writer", [0])
    p.pump()
    assert queued(h) == [b"0", b"plain", b"plain"]


def test_a_gap_is_refused_naming_the_expected_sequence_and_the_connection_stays() -> None:
    h = make()
    h.queue("q")
    p = producer(h, "producer")
    send(p, "writer", [0, 1])
    (gap,) = send(p, "writer", [5])
    p.pump()
    (error,) = p.errors_for(gap)
    assert error.code is ErrorCode.SEQUENCE_GAP
    assert "'writer'" in error.text and "expected sequence 2" in error.text
    assert p.is_complete(gap) and p.session.open
    send(p, "writer", [2, 3])  # the stream goes on from where the broker is
    p.pump()
    assert queued(h) == [b"0", b"1", b"2", b"3"]


def test_a_duplicate_of_a_held_original_completes_at_once_and_is_not_enqueued_again() -> None:
    """The decision the docs record: the original is in the queue, its completion paces the connection
    that sent it; the duplicate, on a new connection, is completed at once."""
    h = make()
    h.queue("q", flow_stop_count=2, flow_resume_count=1)
    old = producer(h, "old")
    held = send(old, "writer", [0, 1, 2])
    old.pump()
    assert any(isinstance(f, FlowStopped) for f in old.frames)
    assert not old.is_complete(held[2])  # the third is held by the saturated queue
    new = producer(h, "new")  # the broker has not noticed the old connection is gone
    again = send(new, "writer", [0, 1, 2])
    new.pump()
    assert all(new.is_complete(tid) for tid in again) and new.errors == []
    c = h.consumer()
    c.subscribe("q")
    c.pump()
    c.ack()
    old.pump()
    assert old.is_complete(held[2])  # the original's completion came when the queue cleared
    assert c.bodies() == [b"0", b"1", b"2"]


def test_two_live_connections_sending_one_stream_interleaved_land_it_once_in_order() -> None:
    """The decision the docs record: no fencing. A retried batch racing its first attempt (or a reconnect
    the broker has not noticed) puts each sequence in the queue once; the later sender gets duplicates."""
    h = make()
    h.queue("q")
    first, retry = producer(h, "first"), producer(h, "retry")
    send(first, "batch-7", [0, 1, 2, 3, 4])
    send(retry, "batch-7", [0, 1, 2, 3, 4, 5, 6, 7])
    send(first, "batch-7", [5, 6, 7, 8, 9])
    send(retry, "batch-7", [8, 9])
    for p in (first, retry):
        p.pump()
        assert p.errors == [] and not p.outstanding
    assert queued(h) == [b"%d" % s for s in range(10)]
    assert first.session.statistics().transfers_duplicate == 3
    assert retry.session.statistics().transfers_duplicate == 7


def test_a_new_producer_id_beyond_the_bound_is_refused_until_one_is_idle_for_the_ttl() -> None:
    h = make(max_producer_ids=2, producer_id_ttl=10.0)
    h.queue("q")
    first = producer(h, "first")
    send(first, "a", [0])
    send(first, "b", [0])
    first.pump()
    first.close()  # (an open connection's ids are kept past the ttl: below)
    p = producer(h, "producer")
    h.advance(5)
    (refused,) = send(p, "c", [0])
    p.pump()
    (error,) = p.errors_for(refused)
    assert error.code is ErrorCode.RESOURCE_EXHAUSTED and "max_producer_ids 2" in error.text
    assert p.is_complete(refused) and p.session.open
    send(p, "a", [1])  # "a" active again at 5 s
    h.advance(6)  # "b" idle 11 s, "a" 6 s
    send(p, "c", [0])
    p.pump()
    assert queued(h) == [b"0", b"0", b"1", b"0"]  # a0, b0, a1, c0: "b" was evicted, not "a"
    assert evicted(h) == 1


def test_a_producer_id_idle_for_the_ttl_is_forgotten_by_the_flow_timer_and_its_stream_starts_anew() -> None:
    """Forgotten only when the bound needed its place, an id reused for a new stream the next day (a Spark
    job's fixed jobId) had every message taken for a duplicate of the last run's, and nothing enqueued
    while the job reported success (a tester)."""
    h = make(producer_id_ttl=10.0)
    h.queue("q")
    run = producer(h, "run")
    send(run, "nightly", [0, 1, 2])
    later(h, 5)
    send(run, "nightly", [0, 1, 2])  # within the ttl: duplicates
    run.pump()
    run.close()
    assert queued(h) == [b"0", b"1", b"2"]
    later(h, 11)
    assert evicted(h) == 1
    p = producer(h, "next run")
    send(p, "nightly", [0, 1, 2])  # the next run, past the ttl: a new stream, taken
    p.pump()
    assert p.errors == [] and queued(h) == [b"0", b"1", b"2", b"0", b"1", b"2"]


def test_an_idle_producer_id_of_an_open_connection_is_kept_past_the_ttl() -> None:
    """Forgotten while its connection was open, an idempotent producer idle for the ttl had everything it
    sent after refused SEQUENCE_GAP, for good (a tester: 10 of 10 after 3.5 s idle, ttl 2 s). Kept while
    the connection is open; forgotten a ttl after it closed."""
    h = make(producer_id_ttl=10.0)
    h.queue("q")
    p = producer(h, "producer")
    send(p, "quiet", [0, 1])
    for _ in range(5):
        later(h, 11)
    (tid,) = send(p, "quiet", [2])
    p.pump()
    assert p.errors_for(tid) == [] and queued(h) == [b"0", b"1", b"2"]
    later(h, 11)  # idle past the ttl again: its last holder is open, the id is kept
    p.close()
    later(h, 9.5)  # kept a ttl from the close
    assert evicted(h) == 0
    later(h, 1)
    assert evicted(h) == 1


def test_ids_kept_for_open_connections_make_room_for_a_new_id_when_the_bound_is_reached() -> None:
    """Kept past the ttl for their open connections, 100 quiet ids refused every new id of their user
    for as long as those connections stayed open (a tester). A new id beyond a bound forgets the oldest
    of them, as it would have before they were kept."""
    h = make(producer_id_ttl=10.0, max_producer_ids=4)
    h.queue("q")
    a, b = producer(h, "a"), producer(h, "b")
    for n in range(2):
        send(a, f"a{n}", [0])
        send(b, f"b{n}", [0])
    later(h, 11)  # all four idle past the ttl, their connections open: kept
    assert evicted(h) == 0
    c = producer(h, "c")
    (tid,) = send(c, "new", [0])
    c.pump()
    assert c.errors_for(tid) == [] and evicted(h) == 1
    (tid,) = send(a, "a1", [1])  # a1 is still known: its next sequence is taken
    a.pump()
    assert a.errors_for(tid) == []


def test_a_duplicate_from_a_new_connection_makes_the_id_that_connections() -> None:
    """After a reconnect the SDK resends what was not seen completed: a duplicate binds the id to the
    new connection, which then keeps it past the ttl while open (a tester: the old one's close let it go)."""
    h = make(producer_id_ttl=10.0)
    h.queue("q")
    old = producer(h, "old")
    send(old, "writer", [0, 1])
    old.pump()
    old.close()
    new = producer(h, "new")
    send(new, "writer", [1])  # the resend of what it had not seen completed: a duplicate
    new.pump()
    for _ in range(4):
        later(h, 11)
    (tid,) = send(new, "writer", [2])
    new.pump()
    assert new.errors_for(tid) == [] and queued(h) == [b"0", b"1", b"2"]


def test_an_open_connection_keeps_only_the_ids_it_took_up_last() -> None:
    """A connection making a new producer, with a new random id, per request would otherwise hold
    every id it ever used, up to the bound: only its last PROTECTED_IDS_PER_CONNECTION are kept."""
    from flowbroker.broker.idempotence import PROTECTED_IDS_PER_CONNECTION as KEPT
    h = make(producer_id_ttl=10.0)
    h.queue("q")
    p = producer(h, "producer")
    for n in range(KEPT + 3):
        send(p, f"request-{n}", [0])
    send(p, "request-0", [1])  # used again: it is among the last again
    p.pump()
    later(h, 11)
    left = {pid.split("\x00")[-1] for pid, _seq, _ns in h.core.producer_sequences.store.items()}  # type: ignore[attr-defined]
    assert left == {"request-0"} | {f"request-{n}" for n in range(4, KEPT + 3)}


def test_a_producer_id_without_a_sequence_is_refused() -> None:
    h = make()
    h.queue("q")
    p = producer(h, "producer")
    (tid,) = p.send_many([("", "q", b"x", None)], producer_id="writer", sequences=[])
    p.pump()
    (error,) = p.errors_for(tid)
    assert error.code is ErrorCode.INVALID_ARGUMENT and p.is_complete(tid)
    assert queued(h) == []


class ResendMachine(RuleBasedStateMachine):
    """One idempotent stream (producer id "p", sequences 0, 1, ...) as the SDK sends it: on each
    connection its messages in order; on a reconnect, every sequence not yet completed, in order,
    before anything new. The broker may or may not notice the old connection; frames may be lost with
    it; the client may resend what the broker already has (a buggy or retrying client); a consumer
    takes messages slowly so that the queue saturates and holds completions."""

    def __init__(self) -> None:
        super().__init__()
        self.h = make()
        self.h.queue("q", flow_stop_count=3, flow_resume_count=2)
        self.consumer: Consumer = self.h.consumer()
        self.consumer.subscribe("q", prefetch=4)
        self.conn = producer(self.h, "p0")
        self.connections = [self.conn]
        self.sent: dict[int, int] = {}  # transfer id on the current connection -> sequence
        self.next_seq = 0
        self.completed: set[int] = set()

    def _send(self, sequences: list[int]) -> None:
        if sequences:
            for tid, seq in zip(send(self.conn, "p", sequences), sequences):
                self.sent[tid] = seq

    def _read(self) -> None:
        self.conn.pump()
        for tid, seq in list(self.sent.items()):
            if self.conn.is_complete(tid):
                self.completed.add(seq)
                del self.sent[tid]
        assert self.conn.errors == [], self.conn.errors

    @rule(count=st.integers(1, 5))
    def send_new(self, count: int) -> None:
        self._send(list(range(self.next_seq, self.next_seq + count)))
        self.next_seq += count

    @rule(count=st.integers(1, 5), close_old=st.booleans(), lost=st.booleans())
    def reconnect(self, count: int, close_old: bool, lost: bool) -> None:
        if lost:  # `count` messages were written to the old connection and never reached the broker
            self.next_seq += count
        if close_old:
            self.conn.close()
        self.conn = producer(self.h, f"p{len(self.connections)}")
        self.connections.append(self.conn)
        self.sent = {}
        self._send([s for s in range(self.next_seq) if s not in self.completed])

    @precondition(lambda self: self.next_seq > 0)
    @rule(data=st.data())
    def resend_old(self, data: st.DataObject) -> None:
        first = data.draw(st.integers(0, self.next_seq - 1))
        last = data.draw(st.integers(first, self.next_seq - 1))
        self._send(list(range(first, last + 1)))  # sent before on this connection or an earlier one

    @rule()
    def read_completions(self) -> None:
        self._read()

    @rule(n=st.integers(1, 4))
    def consume(self, n: int) -> None:
        self.consumer.pump()
        self.consumer.ack(self.consumer.tags()[:n])
        self.consumer.pump()

    @invariant()
    def queue_is_the_stream_so_far_in_order(self) -> None:
        self.consumer.pump()
        bodies = self.consumer.bodies()
        assert bodies == [b"%d" % s for s in range(len(bodies))], bodies

    def teardown(self) -> None:
        # The end of the stream: reconnect once more, resend what is not completed, drain the queue.
        self.reconnect(1, True, False)
        for _ in range(self.next_seq + 2):
            self.consume(4)
            self._read()
        self.consumer.pump()
        assert self.consumer.bodies() == [b"%d" % s for s in range(self.next_seq)]
        assert self.completed == set(range(self.next_seq)), sorted(set(range(self.next_seq)) - self.completed)


TestResendMachine = ResendMachine.TestCase
TestResendMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_one_user_cannot_take_the_places_of_another_users_new_producers() -> None:
    """An attacker with write permission somewhere fills only its own share of the producer ids."""
    h = make(max_producer_ids=10, max_producer_ids_per_user=2)
    h.queue("q")
    mallory = producer(h, "mallory")
    mallory.session.identity = "mallory"
    send(mallory, "m0", [0])
    send(mallory, "m1", [0])
    (refused,) = send(mallory, "m2", [0])
    mallory.pump()
    (error,) = mallory.errors_for(refused)
    assert error.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "user 'mallory' holds max_producer_ids_per_user 2" in error.text and "'m2'" in error.text
    alice = producer(h, "alice")
    alice.session.identity = "alice"
    ids = send(alice, "a0", [0, 1])
    alice.pump()
    assert alice.errors == [] and all(alice.is_complete(tid) for tid in ids)
    assert queued(h) == [b"0", b"0", b"0", b"1"]


def test_the_resend_of_a_refused_message_is_refused_again_not_completed_as_a_duplicate() -> None:
    """The refusal's ERROR was lost with the connection: the resend, on a new one, must not be told its
    message landed (a duplicate's completion), since the broker never enqueued it."""
    h = make()
    h.queue("q")
    h.queue("full", max_count=1)
    h.consumer("admin").declare_exchange("fan", "fanout")
    h.consumer("admin").bind("q", "fan")
    h.consumer("admin").bind("full", "fan")
    first = h.producer("first", flow_control=False)  # so the full queue refuses it rather than hold it
    send(first, "writer", [0])
    first.send_many([("", "no-such-queue", b"1", None)], producer_id="writer", sequences=[1])
    first.send_many([("fan", "", b"2", None), ("fan", "", b"3", None)], producer_id="writer", sequences=[2, 3])
    first.close()  # lost before it read its ERRORs and completions
    second = h.producer("second", flow_control=False)
    again = send(second, "writer", [0])
    again += second.send_many([("", "no-such-queue", b"1", None)], producer_id="writer", sequences=[1])
    again += second.send_many([("fan", "", b"2", None), ("fan", "", b"3", None)], producer_id="writer", sequences=[2, 3])
    second.pump()
    assert all(second.is_complete(tid) for tid in again)
    assert second.errors_for(again[0]) == []  # a plain duplicate: its original landed
    (not_found,) = second.errors_for(again[1])
    assert not_found.code is ErrorCode.NOT_FOUND and not_found.destination == "no-such-queue"
    assert second.errors_for(again[2]) == []  # "2" filled "full" and went to "q" too
    (full,) = second.errors_for(again[3])  # "3": "full" refused it, "q" took it; told again, enqueued once
    assert full.code is ErrorCode.QUEUE_FULL and full.destination == "full"
    assert queued(h) == [b"0", b"2", b"3"] and queued(h, "full") == [b"2"]


def test_a_refusal_is_not_repeated_to_a_later_life_of_its_producer_id() -> None:
    """An id forgotten after its TTL starts again at 0: its new sequence 0 is a new message, taken, even
    though the old 0 was refused."""
    h = make(producer_id_ttl=10.0, max_producer_ids=1)
    h.queue("q")
    old = producer(h, "old")
    old.send_many([("", "absent", b"old", None)], producer_id="writer", sequences=[0])
    old.pump()
    old.close()
    h.advance(11)
    mid = producer(h, "mid")
    send(mid, "other", [0])  # takes the only place: "writer" is forgotten
    mid.pump()
    mid.close()
    h.advance(11)
    p = producer(h, "producer")
    (tid,) = send(p, "writer", [0])
    p.pump()
    assert p.errors_for(tid) == [] and queued(h) == [b"0", b"0"]
    (dup,) = send(p, "writer", [0])
    p.pump()
    assert p.errors_for(dup) == [] and queued(h) == [b"0", b"0"]


def test_the_resend_of_a_message_its_closed_connection_left_held_completes_when_the_original_leaves() -> None:
    """Completed at once, the resends gave the reconnected producer its credit back for messages the
    saturated queue still held: it sent as much again, and past what live producers' credit bounds the
    queue refused most of the rest QUEUE_FULL (366 of 600, a tester). The resend takes over the held
    completion instead: the new connection is paced by it, and nothing is refused."""
    h = make()
    h.queue("q", flow_stop_count=2, flow_resume_count=1)
    old = producer(h, "old")
    held = send(old, "writer", [0, 1, 2, 3])
    old.pump()
    assert not old.is_complete(held[3]) and not old.is_complete(held[2])  # held by the saturated queue
    old.close()  # lost with the held completions
    new = producer(h, "new")
    again = send(new, "writer", [0, 1, 2, 3])
    new.pump()
    assert [new.is_complete(t) for t in again] == [True, True, False, False]  # 0 and 1 had completed
    assert new.errors == [] and new.session.transfers_held_now == 2 and not old.session.transfers_held_now
    assert len(h.core.queues["q"].store) == 4  # nothing enqueued twice
    c = h.consumer()
    c.subscribe("q")
    c.pump()
    c.ack()
    new.pump()
    assert all(new.is_complete(t) for t in again) and new.session.transfers_held_now == 0
    assert c.bodies() == [b"0", b"1", b"2", b"3"]
    assert not h.core._orphans and not new.session.held_sequences  # nothing kept once released


def test_orphans_nobody_resends_leave_no_trace_once_the_queue_lets_them_go() -> None:
    h = make()
    h.queue("q", flow_stop_count=1, flow_resume_count=1)
    old = producer(h, "old")
    send(old, "writer", [0, 1, 2])
    old.close()
    assert len(h.core._orphans) == 2
    h.core.delete_queue("q")
    assert not h.core._orphans


def test_an_id_whose_connection_closes_is_kept_a_ttl_from_the_close_however_long_it_was_quiet() -> None:
    """Quiet for most of the ttl, then its connection closed: the id was forgotten a ttl after its last
    message, 2 s after the close, and the resend of its messages on a new connection was taken again
    (a tester, ttl 3 s: closed at 2 s, resent at 4 s, the queue held every message twice)."""
    h = make(producer_id_ttl=3.0)
    h.queue("q")
    p = producer(h, "producer")
    send(p, "retry", [0, 1, 2])
    later(h, 2)
    p.close()
    later(h, 2)  # 4 s after its last message, 2 s after the close
    again = producer(h, "again")
    tids = send(again, "retry", [0, 1, 2])
    again.pump()
    assert all(again.errors_for(tid) == [] for tid in tids) and queued(h) == [b"0", b"1", b"2"]
