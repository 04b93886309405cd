"""The broker's rules for a producer's transfers (protocol/session.py): ids, credit, completions, acks.

In memory, no trio and no broker: a `TransferReceiver` is fed TRANSFER entries and asked for the
COMPLETE and BUFFER_ACK frames due, and a hypothesis state machine checks it against a plain model.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flowbroker.protocol.credit import ACK_INTERVAL_NS, MESSAGE_OVERHEAD, message_size
from flowbroker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from flowbroker.protocol.frames import BufferAck, Complete, Headers, TransferEntry
from flowbroker.protocol.limits import MAX_RANGES_PER_FRAME
from flowbroker.protocol.ranges import IdSet
from flowbroker.protocol.session import TransferReceiver

S = 1_000_000_000  # ns per second


def entries(*bodies: int, headers: Headers | None = None) -> list[TransferEntry]:
    return [TransferEntry("", "q", bytes(n), headers) for n in bodies]


def received(receiver: TransferReceiver, first_id: int, batch: list[TransferEntry]) -> list[int]:
    sizes, violation = receiver.receive(first_id, batch)
    assert violation is None
    return sizes


def test_transfer_ids_continue_the_connection_sequence() -> None:
    r = TransferReceiver(10_000)
    assert received(r, 1, entries(1, 2, 3)) == [MESSAGE_OVERHEAD + 1, MESSAGE_OVERHEAD + 2, MESSAGE_OVERHEAD + 3]
    assert r.next_transfer_id == 4
    with pytest.raises(RemoteProtocolError, match=r"^transfer id 6 received, expected 4$") as caught:
        r.receive(6, entries(1))
    assert caught.value.code is ErrorCode.TRANSFER_ID_GAP
    assert r.next_transfer_id == 4 and r.window.position == 3 * MESSAGE_OVERHEAD + 6  # nothing counted


def test_sizes_are_message_size_with_or_without_headers() -> None:
    r = TransferReceiver(0, flow_control=False)
    headers: Headers = {"a": "b", "n": 7}
    assert received(r, 1, entries(100, headers=headers)) == [message_size(bytes(100), headers)]


def test_one_message_may_overflow_the_window_and_the_next_is_a_credit_violation() -> None:
    r = TransferReceiver(1000)
    # starts at 0, below the limit 1000: it may overflow the window whatever its size
    assert received(r, 1, entries(5000)) == [5000 + MESSAGE_OVERHEAD]
    sizes, violation = r.receive(2, entries(1, 1))
    assert sizes == [] and violation is not None
    assert violation.code is ErrorCode.CREDIT_VIOLATION
    assert str(violation) == (
        f"transfer 2 starts at byte {5000 + MESSAGE_OVERHEAD}, beyond the credit limit 1000 (buffer 1000 bytes): "
        "only one message may overflow the buffer"
    )
    assert r.next_transfer_id == 2


def test_the_messages_before_a_violation_are_received() -> None:
    r = TransferReceiver(2 * MESSAGE_OVERHEAD)
    sizes, violation = r.receive(1, entries(0, 0, 0, 0))
    # starts at 0 and 512 are below the limit 1024; the third starts at 1024
    assert sizes == [MESSAGE_OVERHEAD, MESSAGE_OVERHEAD] and violation is not None
    assert str(violation).startswith(f"transfer 3 starts at byte {2 * MESSAGE_OVERHEAD}, beyond the credit limit")
    assert r.next_transfer_id == 3 and r.window.position == 2 * MESSAGE_OVERHEAD


def test_a_provisional_grant_of_one_byte_lets_exactly_one_message_through() -> None:
    r = TransferReceiver(1)  # the broker's WAIT_GRANT before a connection's first transfer
    sizes, violation = r.receive(1, entries(100_000, 1))
    assert sizes == [100_000 + MESSAGE_OVERHEAD]
    assert violation is not None and violation.code is ErrorCode.CREDIT_VIOLATION


def test_without_flow_control_nothing_is_checked_and_nothing_acknowledged() -> None:
    r = TransferReceiver(1000, flow_control=False)
    assert r.window.window == 0
    assert len(received(r, 1, entries(*[10_000] * 10))) == 10
    for tid in range(1, 11):
        r.complete(tid, 10_000 + MESSAGE_OVERHEAD)
    assert r.ack_due(0) is None and r.poll(10 * S) is None
    assert r.completions() == [Complete(10, [])]


def test_a_window_of_zero_with_flow_control_is_not_checked() -> None:
    r = TransferReceiver(0)
    assert len(received(r, 1, entries(*[10_000] * 3))) == 3


def test_completion_in_order_moves_the_cumulative_point_and_frees_bytes() -> None:
    r = TransferReceiver(10_000)
    sizes = received(r, 1, entries(10, 20))
    r.complete(1, sizes[0])
    assert r.completed.cumulative == 1 and r.window.consumed_position == sizes[0]
    assert r.completions() == [Complete(1, [])]
    assert r.completions() == []  # nothing new
    r.complete(2, sizes[1])
    assert r.completions() == [Complete(2, [])]


def test_completions_out_of_order_are_ranges_above_the_cumulative_point() -> None:
    r = TransferReceiver(0, flow_control=False)
    received(r, 1, entries(*[0] * 6))
    for tid in (2, 3, 5):
        r.complete(tid, MESSAGE_OVERHEAD)
    assert r.completions() == [Complete(0, [(2, 3), (5, 5)])]
    r.complete(1, MESSAGE_OVERHEAD)  # fills the hole: the cumulative point jumps over 2 and 3
    assert r.completions() == [Complete(3, [])]
    r.complete(6, MESSAGE_OVERHEAD)
    r.complete(4, MESSAGE_OVERHEAD)
    assert r.completions() == [Complete(6, [])]  # 6 is at or under the cumulative point: not repeated


def test_completions_are_split_at_the_ranges_a_frame_may_carry() -> None:
    r = TransferReceiver(0, flow_control=False)
    n = 2 * MAX_RANGES_PER_FRAME + 10
    received(r, 1, entries(*[0] * (2 * n)))
    for tid in range(2, 2 * n + 1, 2):  # every even id: n disjoint ranges
        r.complete(tid, MESSAGE_OVERHEAD)
    frames = r.completions()
    assert [len(f.ranges) for f in frames] == [MAX_RANGES_PER_FRAME, MAX_RANGES_PER_FRAME, 10]
    assert all(f.cumulative_id == 0 for f in frames)
    assert [lo for f in frames for lo, _ in f.ranges] == list(range(2, 2 * n + 1, 2))


@pytest.mark.parametrize("tid", [0, 3, 4])
def test_completing_a_transfer_never_received_is_refused(tid: int) -> None:
    r = TransferReceiver(10_000)
    received(r, 1, entries(0, 0))
    with pytest.raises(LocalProtocolError, match=f"^cannot complete transfer {tid}: received up to 2"):
        r.complete(tid, MESSAGE_OVERHEAD)


def test_completing_a_transfer_twice_is_refused() -> None:
    r = TransferReceiver(10_000)
    received(r, 1, entries(0, 0, 0))
    r.complete(3, MESSAGE_OVERHEAD)
    with pytest.raises(LocalProtocolError, match="^cannot complete transfer 3"):
        r.complete(3, MESSAGE_OVERHEAD)
    r.complete(1, MESSAGE_OVERHEAD)
    with pytest.raises(LocalProtocolError, match="^cannot complete transfer 1"):
        r.complete(1, MESSAGE_OVERHEAD)
    assert r.window.consumed_position == 2 * MESSAGE_OVERHEAD


def test_an_ack_is_due_at_the_threshold_and_raises_the_limit() -> None:
    r = TransferReceiver(10 * MESSAGE_OVERHEAD)  # threshold: 20 % = 2 messages
    sizes = received(r, 1, entries(*[0] * 3))
    r.complete(1, sizes[0])
    assert r.ack_due(5) is None  # one message pending: under the threshold
    r.complete(2, sizes[1])
    ack = r.ack_due(5)
    assert ack == BufferAck(0, 2 * MESSAGE_OVERHEAD, 2 * MESSAGE_OVERHEAD)
    assert r.window.acked_position == 2 * MESSAGE_OVERHEAD and r.window.limit == 12 * MESSAGE_OVERHEAD
    assert r.ack_due(6) is None  # nothing pending any more


def test_acks_are_withheld_while_the_producer_waits_for_a_pool_share() -> None:
    r = TransferReceiver(2 * MESSAGE_OVERHEAD)
    sizes = received(r, 1, entries(0, 0))
    r.complete(1, sizes[0])
    r.complete(2, sizes[1])
    r.credit_waiting = True
    assert r.ack_due(0) is None and r.poll(10 * S) is None
    assert r.window.limit == 2 * MESSAGE_OVERHEAD  # no grant, no movement
    r.credit_waiting = False
    assert r.ack_due(0) == BufferAck(0, 2 * MESSAGE_OVERHEAD, 2 * MESSAGE_OVERHEAD)


def test_poll_readvertises_the_position_once_an_interval() -> None:
    r = TransferReceiver(100_000)
    assert r.poll(ACK_INTERVAL_NS - 1) is None
    assert r.poll(ACK_INTERVAL_NS) == BufferAck(0, 0, 0)  # nothing freed: the same position again
    assert r.poll(ACK_INTERVAL_NS + 1) is None


def test_a_shrink_never_lowers_the_limit_and_a_grow_raises_it() -> None:
    r = TransferReceiver(10_000)
    r.resize(1000)
    assert r.window.window == 1000 and r.window.limit == 10_000 and r.promised == 10_000
    r.resize(20_000)
    assert r.window.limit == 20_000
    with pytest.raises(LocalProtocolError):
        r.resize(-1)


def test_statistics_read_the_counters() -> None:
    r = TransferReceiver(10_000)
    sizes = received(r, 1, entries(10, 20, 30))
    r.complete(1, sizes[0])
    r.complete(3, sizes[2])
    stats = r.statistics()
    assert (stats.position, stats.consumed_position, stats.acked_position) == (sum(sizes), sizes[0] + sizes[2], 0)
    assert (stats.window, stats.limit, stats.credit_waiting) == (10_000, 10_000, False)
    assert (stats.transfers_received, stats.transfers_completed) == (3, 2)


class TransferReceiverMachine(RuleBasedStateMachine):
    """A producer that may break the credit rule, a core that completes in any order, and a client
    that applies the COMPLETE frames: against a model of positions, limit and completed ids."""

    def __init__(self) -> None:
        super().__init__()
        self.receiver = TransferReceiver(4 * MESSAGE_OVERHEAD)
        self.now = 0
        self.next_id = 1
        self.position = 0
        self.consumed = 0
        self.sizes: dict[int, int] = {}  # received, not completed
        self.done: set[int] = set()
        self.client = IdSet()  # what the client learns from COMPLETE frames
        self.limits = [self.receiver.window.limit]
        self.broken = False  # a credit violation ends the connection: nothing more is sent

    @precondition(lambda self: not self.broken)
    @rule(bodies=st.lists(st.integers(0, 3000), max_size=6))
    def transfer(self, bodies: list[int]) -> None:
        limit, window = self.receiver.window.limit, self.receiver.window.window
        sizes, violation = self.receiver.receive(self.next_id, entries(*bodies))
        expected: list[int] = []
        position = self.position
        for body in bodies:
            if window and position >= limit:
                break
            expected.append(body + MESSAGE_OVERHEAD)
            position += body + MESSAGE_OVERHEAD
        assert sizes == expected
        assert (violation is not None) == (len(expected) < len(bodies))
        if violation is not None:
            assert violation.code is ErrorCode.CREDIT_VIOLATION
            self.broken = True
        for size in sizes:
            self.sizes[self.next_id] = size
            self.next_id += 1
        self.position = position

    @precondition(lambda self: not self.broken)
    @rule(offset=st.integers(1, 3))
    def gap(self, offset: int) -> None:
        with pytest.raises(RemoteProtocolError) as caught:
            self.receiver.receive(self.next_id + offset, entries(0))
        assert caught.value.code is ErrorCode.TRANSFER_ID_GAP

    @precondition(lambda self: bool(self.sizes))
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.sizes)))
        size = self.sizes.pop(tid)
        self.receiver.complete(tid, size)
        self.done.add(tid)
        self.consumed += size

    @rule(tid=st.integers(-1, 40))
    def complete_a_wrong_id(self, tid: int) -> None:
        if tid in self.sizes:
            return
        with pytest.raises(LocalProtocolError):
            self.receiver.complete(tid, 1)

    @rule(waiting=st.booleans())
    def wait_for_a_share(self, waiting: bool) -> None:
        self.receiver.credit_waiting = waiting

    @rule(window=st.integers(0, 8 * MESSAGE_OVERHEAD))
    def resize(self, window: int) -> None:
        if window == 0:
            return  # a flow-controlled producer's grant is never 0 in the broker (WAIT_GRANT is 1)
        self.receiver.resize(window)
        assert self.receiver.window.limit >= self.receiver.window.acked_position + window

    @rule(elapsed=st.sampled_from([0, 1, ACK_INTERVAL_NS]))
    def collect(self, elapsed: int) -> None:
        self.now += elapsed
        for frame in self.receiver.completions():
            assert len(frame.ranges) <= MAX_RANGES_PER_FRAME
            self.client.cumulative = max(self.client.cumulative, frame.cumulative_id)
            self.client.add_ranges(frame.ranges)
        assert all(tid in self.client for tid in self.done), "a completion never reached the client"
        window = self.receiver.window
        pending = window.consumed_position - window.acked_position
        due = bool(window.window) and pending > 0 and pending >= window.threshold() and not self.receiver.credit_waiting
        ack = self.receiver.ack_due(self.now) if elapsed != ACK_INTERVAL_NS else self.receiver.poll(self.now)
        if elapsed != ACK_INTERVAL_NS:
            assert (ack is not None) == due
        if ack is not None:
            assert ack.acked_position == self.consumed
            assert window.limit == max(self.limits[-1], self.consumed + window.window)

    @invariant()
    def positions_are_ordered(self) -> None:
        window = self.receiver.window
        assert window.position == self.position
        assert window.consumed_position == self.consumed
        assert 0 <= window.acked_position <= window.consumed_position <= window.position
        assert self.receiver.next_transfer_id == self.next_id

    @invariant()
    def the_limit_never_falls(self) -> None:
        assert self.receiver.window.limit >= self.limits[-1]
        self.limits.append(self.receiver.window.limit)

    @invariant()
    def completed_ids_are_those_completed(self) -> None:
        assert all(tid in self.receiver.completed for tid in self.done)
        assert not any(tid in self.receiver.completed for tid in self.sizes)
        assert self.receiver.statistics().transfers_completed == len(self.done)

    @invariant()
    def the_client_learns_only_completed_ids(self) -> None:
        assert all(tid in self.done for tid in range(1, self.client.cumulative + 1))
        assert all(tid in self.done for lo, hi in self.client.ranges_above() for tid in range(lo, hi + 1))


TestTransferReceiverMachine = TransferReceiverMachine.TestCase
TestTransferReceiverMachine.settings = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
