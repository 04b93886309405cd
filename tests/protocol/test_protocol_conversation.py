"""Whole conversations through a ConnectionPair: the frames, state machine and credit halves together.

The broker's side here is played by the test with the same sans-IO pieces the broker uses
(SenderWindow, ReceiverWindow, message_size), so these check that the protocol carries the credit model
end to end, byte for byte, not the broker's queueing.
"""

from __future__ import annotations

from pair import ConnectionPair

from flowbroker.protocol import (
    ReceiverWindow,
    BufferAck,
    BufferControl,
    SenderWindow,
    Complete,
    Deliver,
    DeliveryEntry,
    Error,
    ErrorCode,
    FlowResumed,
    FlowStopped,
    Noop,
    Outcome,
    Role,
    Settle,
    Subscribe,
    Transfer,
    TransferEntry,
    message_size,
)

S = 1_000_000_000


def test_producer_paced_by_broker_credit() -> None:
    pair = ConnectionPair()
    welcome = pair.handshake(flow_control=True, buffer_size=1000)
    credit = SenderWindow(welcome.buffer_size)  # client side
    grants = ReceiverWindow(welcome.buffer_size)  # broker side: the DCP consumer toward the producer
    next_id = 1
    received = 0
    now = 0
    bodies = [bytes([i]) * (50 + 17 * i) for i in range(40)]
    pending = list(bodies)
    completed_up_to = 0
    rounds = 0
    while pending or credit.outstanding:
        rounds += 1
        assert rounds < 200
        # Client: one TRANSFER frame with every message the credit allows (one may overflow).
        entries = []
        while pending and credit.may_send():
            body = pending.pop(0)
            entries.append(TransferEntry("", "q", body))
            credit.on_sent(message_size(body))
        if entries:
            pair.send(Role.CLIENT, Transfer(next_id, entries))
            next_id += len(entries)
        # Broker: every transfer completes at once; credit comes back as absolute positions.
        for frame in pair.deliver(Role.CLIENT):
            assert isinstance(frame, Transfer)
            for offset, entry in enumerate(frame.entries):
                size = message_size(entry.body, entry.headers)
                assert received < grants.acked_position + welcome.buffer_size  # never beyond credit
                received += size
                now += 1000
                ack = grants.on_consumed(size, now)
                pair.send(Role.BROKER, Complete(frame.first_id + offset, []))
                if ack is not None:
                    pair.send(Role.BROKER, ack)
        if not pending or not credit.may_send():
            now += 5 * S
            ack = grants.poll(now)  # the timer acknowledges the tail under the threshold
            if ack is not None:
                pair.send(Role.BROKER, ack)
        # Client: completions and acks.
        for frame in pair.deliver(Role.BROKER):
            if isinstance(frame, Complete):
                assert frame.cumulative_id == completed_up_to + 1
                completed_up_to = frame.cumulative_id
            else:
                assert isinstance(frame, BufferAck) and frame.opaque == 0
                credit.on_ack(frame.acked_position)
    assert completed_up_to == len(bodies)
    assert credit.position == received == credit.acked_position == grants.consumed_position


def test_held_transfer_flow_stopped_then_completed_out_of_order() -> None:
    pair = ConnectionPair()
    pair.handshake(buffer_size=1 << 20)
    pair.exchange(Role.CLIENT, Transfer(1, [TransferEntry("", name, b"m") for name in ("a", "a", "full", "a")]))
    # Transfer 3 went to a saturated queue: held, and the producer is told why.
    stopped = FlowStopped("full", "flow_stop_count", 2, 3, "queue 'full' is over flow_stop_count")
    pair.exchange(Role.BROKER, stopped, Complete(2, [(4, 4)]))
    pair.exchange(Role.BROKER, FlowResumed("full"), Complete(4, []))


def test_refused_transfer_gets_error_with_ref_id_and_is_still_completed() -> None:
    pair = ConnectionPair()
    pair.handshake(buffer_size=1 << 20)
    pair.exchange(Role.CLIENT, Transfer(1, [TransferEntry("", "missing", b"m"), TransferEntry("", "q", b"m")]))
    error = Error(ErrorCode.NOT_FOUND, "no queue named 'missing'", None, 1, "missing")
    received = pair.exchange(Role.BROKER, error, Complete(2, []))
    assert received[0].ref_id == 1 and received[0].destination == "missing"  # type: ignore[union-attr]
    assert pair.client.state is pair.broker.state  # an ERROR about a transfer does not end anything


def test_consumer_buffer_paces_deliveries() -> None:
    """The consumer sets a subscription buffer; the broker (DCP producer toward consumers) delivers
    while there is space; the consumer acknowledges processed bytes after 20 % of it."""
    pair = ConnectionPair()
    pair.handshake()
    pair.exchange(Role.CLIENT, Subscribe(1, 7, "q", 0, 0), BufferControl(7, 400))
    sub_buffer = SenderWindow(400)  # broker side
    acks = ReceiverWindow(400, opaque=7)  # client side
    bodies = [b"x" * n for n in (10, 100, 300, 5, 1000, 20, 20, 20)]
    backlog = list(bodies)
    tag = 0
    seen: list[bytes] = []
    now = 0
    while backlog or sub_buffer.outstanding:
        entries = []
        while backlog and sub_buffer.may_send():
            body = backlog.pop(0)
            tag += 1
            entries.append(DeliveryEntry(tag, "", "q", body, None, False))
            sub_buffer.on_sent(message_size(body))
        if entries:
            pair.exchange(Role.BROKER, Deliver(7, entries))
            for entry in entries:
                seen.append(entry.body)
                now += 1
                pair.send(Role.CLIENT, Settle(Outcome.ACK, [(entry.delivery_tag, entry.delivery_tag)]))
                ack = acks.on_consumed(message_size(entry.body), now)
                if ack is not None:
                    pair.send(Role.CLIENT, ack)
        else:
            now += 5 * S
            ack = acks.poll(now)
            assert ack is not None
            pair.send(Role.CLIENT, ack)
        for frame in pair.deliver(Role.CLIENT):
            if isinstance(frame, BufferAck):
                assert frame.opaque == 7
                sub_buffer.on_ack(frame.acked_position)
    assert seen == bodies


def test_noop_liveness_both_ways() -> None:
    pair = ConnectionPair()
    pair.handshake()
    pair.exchange(Role.BROKER, Noop(1, False))
    pair.exchange(Role.CLIENT, Noop(1, True))
    pair.exchange(Role.CLIENT, Noop(2, False))
    pair.exchange(Role.BROKER, Noop(2, True))
