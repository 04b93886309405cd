"""BUFFER_LIMIT: the SDK's ledger answering the broker's BUFFER_CONTROLs, and the broker's TransferReceiver
lowering its credit limit on the answer.

The state machine puts the two sans-IO halves on two FIFO byte streams, one per TCP direction, and
lets hypothesis interleave everything the two ends do: the SDK admits messages against its window
(`on_sent`, at `send()`), its writer puts the queued control frames before the queued TRANSFERs (as
client/connection.py does), the broker reads, completes, acknowledges and resizes the grant at random
(shrinks and grows), and each end reads the other's frames whenever it likes. Whatever the order:
the broker never finds a CREDIT_VIOLATION (also when the grant goes to 0, the `none` policy, and back:
what the client sent unlimited before it saw the new grant is not one), never refuses a BUFFER_LIMIT, its limit is never below
what the client may start a message under, and once everything is delivered, consumed and answered
the broker promises exactly the grant (the old, larger one no longer stays charged).
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from flowbroker.protocol import (
    BufferAck,
    BufferControl,
    BufferLimit,
    ErrorCode,
    Frame,
    ProducerLedger,
    RemoteProtocolError,
    Transfer,
    TransferEntry,
    TransferReceiver,
    message_size,
)

S = 1_000_000_000
FIRST_GRANT = 2000


class FenceOverTwoStreams(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger: ProducerLedger[str] = ProducerLedger(FIRST_GRANT)  # WELCOME's buffer_size
        self.receiver = TransferReceiver(FIRST_GRANT)
        self.queued: list[TransferEntry] = []  # admitted, not yet written (the SDK's _transfers)
        self.control: list[Frame] = []  # the SDK's control queue
        self.to_broker: deque[Frame] = deque()
        self.to_client: deque[Frame] = deque()
        self.unconsumed: list[tuple[int, int]] = []  # (transfer id, size) received, not completed
        self.now = 0
        self.fences_lowered = 0

    # -- the client ----------------------------------------------------------------------------

    @rule(n=st.integers(0, 1500))
    def admit(self, n: int) -> None:
        """Producer.send(): admitted against the window now, written later."""
        if self.ledger.may_send():
            entry = TransferEntry("", "q", b"x" * n)
            self.ledger.on_sent("p", message_size(entry.body))
            self.queued.append(entry)

    @rule(k=st.integers(0, 4))
    def client_writes(self, k: int) -> None:
        """The writer: every queued control frame, then up to k of the oldest queued transfers."""
        self.to_broker.extend(self.control)
        self.control.clear()
        k = min(k, len(self.queued))
        if k:
            first_id = self.ledger.next_id - len(self.queued)
            self.to_broker.append(Transfer(first_id, self.queued[:k]))
            del self.queued[:k]

    @rule()
    def client_reads(self) -> None:
        if not self.to_client:
            return
        frame = self.to_client.popleft()
        if isinstance(frame, BufferControl):
            assert self.ledger.on_buffer_control(frame)
            fence = self.ledger.buffer_limit()
            assert (fence is None) == (frame.buffer_size == 0)  # size 0 (flow control off) needs no answer
            if fence is not None:
                self.control.append(fence)
        else:
            assert isinstance(frame, BufferAck)
            self.ledger.on_buffer_ack(frame)

    # -- the broker ----------------------------------------------------------------------------

    @rule()
    def broker_reads(self) -> None:
        if not self.to_broker:
            return
        frame = self.to_broker.popleft()
        if isinstance(frame, Transfer):
            sizes, violation = self.receiver.receive(frame.first_id, frame.entries)
            assert violation is None, violation
            self.unconsumed += [(frame.first_id + i, size) for i, size in enumerate(sizes)]
        else:
            assert isinstance(frame, BufferLimit)
            self.fences_lowered += self.receiver.fence(frame.control, frame.size, frame.limit)

    @rule(k=st.integers(1, 5))
    def broker_completes(self, k: int) -> None:
        for transfer_id, size in self.unconsumed[:k]:
            self.receiver.complete(transfer_id, size)
        del self.unconsumed[:k]
        ack = self.receiver.ack_due(self.now)
        if ack is not None:
            self.to_client.append(ack)

    @rule()
    def broker_timer(self) -> None:
        self.now += 5 * S
        ack = self.receiver.poll(self.now)
        if ack is not None:
            self.to_client.append(ack)

    @rule(size=st.one_of(st.just(0), st.integers(1, 6000)))
    def broker_resizes(self, size: int) -> None:
        """The credit policy moves the grant (the core announces only a change); 0 is the `none` policy,
        under which the client sends unlimited until it sees a grant again (size 0 -> n mid-stream)."""
        if size != self.receiver.window.window:
            self.receiver.announced(size)
            self.to_client.append(BufferControl(0, size))

    @rule()
    def everything_settles(self) -> None:
        """Both ends go on until nothing is queued, in flight or unconsumed: then the promise is the grant."""
        if self.receiver.window.window == 0:  # paced again: under size 0 nothing is acknowledged
            self.broker_resizes(FIRST_GRANT)
        for _ in range(1000):
            if not (self.queued or self.control or self.to_broker or self.to_client or self.unconsumed):
                break
            self.client_writes(len(self.queued))
            while self.to_broker:
                self.broker_reads()
            self.broker_completes(len(self.unconsumed))
            self.broker_timer()
            while self.to_client:
                self.client_reads()
        window = self.receiver.window
        assert window.position == window.consumed_position == window.acked_position == self.ledger.window.acked_position
        assert self.receiver.promised == window.window == self.ledger.window.window

    # -- always --------------------------------------------------------------------------------

    @invariant()
    def the_broker_allows_whatever_the_client_may_start(self) -> None:
        credit = self.ledger.window
        assert credit.acked_position + credit.window <= self.receiver.window.limit

    @invariant()
    def the_promise_covers_what_is_in_flight(self) -> None:
        # received and admitted bytes are never beyond the limit but for the one overflowing message
        assert self.receiver.window.position <= self.ledger.window.position


TestFenceOverTwoStreams = FenceOverTwoStreams.TestCase
TestFenceOverTwoStreams.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_a_shrink_of_an_idle_producer_drains_its_promise_at_once() -> None:
    ledger: ProducerLedger[str] = ProducerLedger(10_000)
    receiver = TransferReceiver(10_000)
    ledger.on_sent("p", 600)
    receiver.receive(1, [TransferEntry("", "q", b"x" * 88)])
    receiver.complete(1, 600)
    ack = receiver.window.flush(0)
    assert ack is not None
    receiver._granted(ack)
    ledger.on_buffer_ack(ack)
    receiver.announced(1000)
    assert receiver.promised == 10_000  # the old grant stays promised: the client may not have seen it
    assert ledger.on_buffer_control(BufferControl(0, 1000))
    fence = ledger.buffer_limit()
    assert fence == BufferLimit(1, 1000, 600 + 1000)
    assert ledger.buffer_limit() is None  # answered once
    assert receiver.fence(fence.control, fence.size, fence.limit)
    assert receiver.promised == 1000


def test_the_limit_stays_above_the_bytes_admitted_under_the_old_grant() -> None:
    """Bytes admitted before the shrink but still queued behind the answer are below its limit."""
    ledger: ProducerLedger[str] = ProducerLedger(10_000)
    receiver = TransferReceiver(10_000)
    for _ in range(8):
        ledger.on_sent("p", 1000)  # 8000 bytes admitted, none written
    receiver.announced(1000)
    ledger.on_buffer_control(BufferControl(0, 1000))
    fence = ledger.buffer_limit()
    assert fence is not None and fence.limit == 8000
    assert not ledger.may_send()
    receiver.fence(fence.control, fence.size, fence.limit)
    assert receiver.window.limit == 8000
    sizes, violation = receiver.receive(1, [TransferEntry("", "q", b"x" * 488)] * 8)  # written after the answer
    assert violation is None and len(sizes) == 8


def test_an_answer_never_raises_the_limit() -> None:
    """The one message that may overflow takes the client's position above the limit: its answer is
    above the limit too, and the broker keeps the lower."""
    receiver = TransferReceiver(1000)
    receiver.receive(1, [TransferEntry("", "q", b"x" * 2000)])  # starts at 0, below 1000: overflows
    receiver.announced(500)
    assert not receiver.fence(1, 500, 2512)
    assert receiver.window.limit == 1000


def test_a_stale_answer_is_ignored() -> None:
    """Shrink, grow, shrink back to the same size: the first answer names the first BUFFER_CONTROL, and
    transfers admitted under the grow may follow it, so it must not lower the limit."""
    receiver = TransferReceiver(5000)
    receiver.announced(1000)
    receiver.announced(5000)
    receiver.announced(1000)
    assert not receiver.fence(1, 1000, 1000)
    assert receiver.window.limit == 5000
    assert receiver.fence(3, 1000, 1000)
    assert receiver.window.limit == 1000


@pytest.mark.parametrize(
    ("control", "size", "limit", "match"),
    [
        (2, 500, 500, "only 1 were sent"),
        (1, 400, 500, "size 400 but BUFFER_CONTROL 1 granted 500"),
        (1, 500, 99, "below the 600 bytes already received"),
    ],
)
def test_an_answer_that_cannot_be_right_is_a_credit_violation(control: int, size: int, limit: int, match: str) -> None:
    receiver = TransferReceiver(1000)
    receiver.receive(1, [TransferEntry("", "q", b"x" * 88)])
    receiver.announced(500)
    with pytest.raises(RemoteProtocolError, match=match) as raised:
        receiver.fence(control, size, limit)
    assert raised.value.code is ErrorCode.CREDIT_VIOLATION
    assert receiver.window.limit == 1000


def test_flow_control_turned_off_is_not_answered() -> None:
    ledger: ProducerLedger[str] = ProducerLedger(1000)
    assert ledger.on_buffer_control(BufferControl(0, 0))
    assert ledger.buffer_limit() is None
    assert not ledger.on_buffer_control(BufferControl(3, 100))  # a subscription's: not ours
    assert ledger.buffer_limit() is None
    assert ledger.controls == 1


def test_the_first_answer_after_flow_control_came_on_cannot_claim_more_than_the_sockets_hold() -> None:
    """After `none` -> a paced policy, the first BUFFER_LIMIT's limit is taken even above the grant (what
    the client sent unlimited is still arriving); a raw client's 2**50 was charged to the pool whole and
    every other producer waited while it stayed (a tester). Beyond what arrived, the new buffer and
    UNFENCED_IN_FLIGHT, it is a credit violation; within, it is taken."""
    from flowbroker.protocol.session import UNFENCED_IN_FLIGHT

    receiver = TransferReceiver(0)
    receiver.receive(1, [TransferEntry("", "q", b"x" * 88)])  # 600 bytes received under no limit
    receiver.announced(500)
    with pytest.raises(RemoteProtocolError, match="no client can have admitted that much") as raised:
        receiver.fence(1, 500, 2**50)
    assert raised.value.code is ErrorCode.CREDIT_VIOLATION
    again = TransferReceiver(0)
    again.receive(1, [TransferEntry("", "q", b"x" * 88)])
    again.announced(500)
    assert again.fence(1, 500, 600 + 500 + UNFENCED_IN_FLIGHT)
    assert again.window.limit == 600 + 500 + UNFENCED_IN_FLIGHT


def test_a_client_that_never_answers_a_buffer_turned_on_may_send_only_what_was_on_its_way_beyond_it() -> None:
    """After `none` -> a paced policy the check waited for the client's first BUFFER_LIMIT: a raw client
    that never answered sent 160 MiB past a 3 MiB grant, unchecked (a tester; the broker closed it 10 s
    later for the unanswered grant). Until the answer it may send 2 x UNFENCED_IN_FLIGHT beyond what had
    arrived when the buffer was announced (not beyond the credit limit: under size 0 nothing is
    acknowledged, and measured so it closed a well-behaved SDK producer, a later tester)."""
    from flowbroker.protocol.session import UNFENCED_IN_FLIGHT

    receiver = TransferReceiver(0)
    body = b"x" * (1 << 20)
    tid, arrived = 1, 0
    for _ in range(200):  # 200 MiB under size 0: unchecked, unacknowledged
        sizes, violation = receiver.receive(tid, [TransferEntry("", "q", body)])
        assert violation is None
        tid, arrived = tid + 1, arrived + sizes[0]
    receiver.announced(500)  # the limit: 0 acknowledged + 500, far below what arrived
    sent = arrived
    while sent + len(body) + 512 < arrived + 2 * UNFENCED_IN_FLIGHT:  # what may have been on its way: taken
        sizes, violation = receiver.receive(tid, [TransferEntry("", "q", body)])
        assert violation is None and sizes == [len(body) + 512]
        tid, sent = tid + 1, sent + sizes[0]
    sizes, violation = receiver.receive(tid, [TransferEntry("", "q", body), TransferEntry("", "q", body)])
    assert len(sizes) == 1  # the one that starts within is taken, the next one starts past it
    assert violation is not None and violation.code is ErrorCode.CREDIT_VIOLATION
    assert "not yet answered with BUFFER_LIMIT" in str(violation)


def test_an_answer_after_a_buffer_turned_on_may_claim_what_a_window_of_maximum_messages_admitted() -> None:
    """A well-behaved SDK producer streaming 1 MiB messages under `none` had about 1,000 of them admitted
    and not yet sent when the policy became paced; its answer named them, and a cap of 64 MiB beyond what
    had arrived closed it (a tester, 2 of 5 runs). The cap is UNFENCED_MESSAGES maximum messages."""
    from flowbroker.protocol.session import UNFENCED_MESSAGES

    receiver = TransferReceiver(0)
    receiver.max_message = 4 << 20
    receiver.receive(1, [TransferEntry("", "q", b"x" * 88)])  # 600 bytes under no limit
    receiver.announced(1 << 20)
    admitted = 600 + 1000 * ((1 << 20) + 512)  # 1,000 messages of 1 MiB queued in the client
    assert receiver.fence(1, 1 << 20, admitted + (1 << 20))
    again = TransferReceiver(0)
    again.max_message = 4 << 20
    again.receive(1, [TransferEntry("", "q", b"x" * 88)])
    again.announced(1 << 20)
    with pytest.raises(RemoteProtocolError, match="no client can have admitted that much"):
        again.fence(1, 1 << 20, 600 + (1 << 20) + UNFENCED_MESSAGES * (4 << 20) + 1)


def test_an_answer_may_claim_what_several_producers_windows_admitted_with_small_maximum_messages() -> None:
    """Three SDK producers on one connection, each with a window of 1,000 messages of 60 KB, under a
    max_message_size of 64 KiB: 180 MB admitted, over 1,024 maximum messages (64 MiB), and the switch from
    `none` closed the connection (a tester, 3 of 4). The claim is at least UNFENCED_CLAIM (1 GiB)."""
    receiver = TransferReceiver(0)
    receiver.max_message = 64 * 1024
    receiver.receive(1, [TransferEntry("", "q", b"x" * 88)])
    receiver.announced(10 << 20)
    assert receiver.fence(1, 10 << 20, 600 + 3 * 1000 * (60_000 + 512) + (10 << 20))


def test_acknowledgements_do_not_add_to_the_allowance_of_a_buffer_turned_on() -> None:
    """The allowance until the answer is 2 x UNFENCED_IN_FLIGHT beyond what had arrived at the announce
    (protocol.md), or the credit limit when that is further: it was added to the credit limit, which
    grows with every acknowledgement, and a raw client that never answered sent 248 MiB past what had
    arrived (a tester, quota 1 GiB: 20 MiB under none, then aggressive)."""
    from flowbroker.protocol.session import UNFENCED_IN_FLIGHT

    receiver = TransferReceiver(0)
    body = b"x" * (1 << 20)
    tid, arrived = 1, 0
    for _ in range(20):
        sizes, violation = receiver.receive(tid, [TransferEntry("", "q", body)])
        tid, arrived = tid + 1, arrived + sizes[0]
    grant = 50 << 20
    receiver.announced(grant)
    for _ in range(60):  # consumed and acknowledged as they arrive: the credit limit climbs
        sizes, violation = receiver.receive(tid, [TransferEntry("", "q", body)])
        assert violation is None
        receiver.complete(tid, sizes[0])
        receiver.ack_due(0)
        tid += 1
    bound = max(receiver.window.limit, arrived + 2 * UNFENCED_IN_FLIGHT)
    while True:  # the queue stopped: nothing completes, nothing more is acknowledged
        sizes, violation = receiver.receive(tid, [TransferEntry("", "q", body)])
        if violation is not None:
            break
        tid += 1
    assert receiver.window.position <= bound + len(body) + 512
    assert violation.code is ErrorCode.CREDIT_VIOLATION
