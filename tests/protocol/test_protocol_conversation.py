"""Whole conversations through a ConnectionPair: the frames, state machine and credit halves together.

In the credit and liveness conversations the broker's side is played by the test with the same
sans-IO pieces the broker uses (SenderWindow, ReceiverWindow, message_size): they check that the protocol
carries the credit model end to end, byte for byte, not the broker's queueing. The held and refused
transfer conversations put the real `BrokerCore` behind the broker's `Connection` (`CoreBehindPair`),
so what the client decodes is what the broker decides.
"""

from __future__ import annotations

from typing import Any

from tests.protocol.pair import ConnectionPair

from flowbroker.broker.config import load_config
from flowbroker.broker.core import BrokerCore
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
    Frame,
    Noop,
    Ok,
    Outcome,
    Role,
    Settle,
    State,
    Subscribe,
    Transfer,
    TransferEntry,
    message_size,
)

S = 1_000_000_000


class CoreBehindPair:
    """A `BrokerCore` on the broker end of a ConnectionPair: frames the client's Connection sends are
    decoded by the broker's Connection and handed to the core; what the core has for the client
    (`session.collect`) is encoded by the broker's Connection and decoded by the client's."""

    def __init__(self, *, flow_control: bool = True, **sections: dict[str, Any]) -> None:
        overrides: dict[str, dict[str, Any]] = {"server": {"memory_quota": 1 << 30}}
        for name, values in sections.items():
            overrides.setdefault(name, {}).update(values)
        self.now = 0
        self.core = BrokerCore(load_config(None, overrides), lambda: self.now)
        self.session = self.core.open_session("pair-client", "anonymous", flow_control, lambda: None)
        self.pair = ConnectionPair()
        self.welcome = self.pair.handshake(flow_control=flow_control, buffer_size=self.session.buffer_size)

    def client_sends(self, *frames: Frame) -> list[Frame]:
        """The client sends `frames`; the core handles them; returns what the client receives back."""
        self.pair.send(Role.CLIENT, *frames)
        for frame in self.pair.deliver(Role.CLIENT):
            self.core.handle(self.session, frame)
        return self.client_receives()

    def client_receives(self) -> list[Frame]:
        frames = self.session.collect(self.now)
        self.pair.send(Role.BROKER, *frames)
        received = self.pair.deliver(Role.BROKER)
        assert received == frames
        return received


def test_producer_credit_model_carried_over_the_wire() -> None:
    """The test plays the broker's credit side (ReceiverWindow): BUFFER_ACKs it sends move the client's
    SenderWindow through both Connections; the client never sends beyond it and everything is acked."""
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
    """The broker holds the transfer that takes a queue over its stop threshold: the client decodes
    FLOW_STOPPED naming the queue and a COMPLETE that skips the held id; once a consumer drains the
    queue, FLOW_RESUMED and then the cumulative COMPLETE."""
    broker = CoreBehindPair(credit={"policy": "static", "static_size": 1 << 20})
    broker.core.declare_queue("a")
    broker.core.declare_queue("full", {"flow_stop_count": 1, "flow_resume_count": 0})
    # The first transfer registers the connection as a producer (its provisional grant is one message).
    first = broker.client_sends(Transfer(1, [TransferEntry("", "a", b"m")]))
    assert Complete(1, []) in first and BufferControl(0, 1 << 20) in first
    received = broker.client_sends(Transfer(2, [TransferEntry("", name, b"m") for name in ("full", "full", "a")]))
    stopped = [f for f in received if isinstance(f, FlowStopped)]
    assert [(f.destination, f.threshold) for f in stopped] == [("full", "flow_stop_count")]
    assert [f for f in received if isinstance(f, Complete)] == [Complete(2, [(4, 4)])]  # 3 is held
    # A consumer on another connection takes the message and settles it: the queue clears.
    consumer = broker.core.open_session("consumer", "anonymous", False, lambda: None)
    broker.core.handle(consumer, Subscribe(1, 1, "full", 0, 0))
    (deliver,) = [f for f in consumer.collect(broker.now) if isinstance(f, Deliver)]
    assert len(deliver.entries) == 2
    assert not [f for f in broker.client_receives() if isinstance(f, (Complete, FlowResumed))]  # unsettled: held
    broker.core.handle(consumer, Settle(Outcome.ACK, [(deliver.entries[0][0], deliver.entries[1][0])]))
    received = broker.client_receives()
    assert FlowResumed("full") in received and Complete(4, []) in received
    assert received.index(FlowResumed("full")) < received.index(Complete(4, []))


def test_refused_transfer_gets_error_with_ref_id_and_is_still_completed() -> None:
    """A transfer to a queue that does not exist: the broker answers ERROR NOT_FOUND whose ref_id is the
    transfer id, completes it all the same (so window and credit flow), and the connection stays open."""
    broker = CoreBehindPair(flow_control=False)
    broker.core.declare_queue("q")
    received = broker.client_sends(Transfer(1, [TransferEntry("", "missing", b"m"), TransferEntry("", "q", b"m")]))
    error, complete = received
    assert isinstance(error, Error) and (error.code, error.ref_id, error.destination) == (ErrorCode.NOT_FOUND, 1, "missing")
    assert complete == Complete(2, [])
    assert broker.pair.client.state is broker.pair.broker.state is State.OPEN  # a transfer's ERROR ends nothing
    assert broker.core.queues["q"].count == 1
    ok = broker.client_sends(Transfer(3, [TransferEntry("", "q", b"m")]))  # still open, ids go on
    assert ok == [Complete(3, [])]
    assert not any(isinstance(f, Ok) for f in ok)


def test_consumer_buffer_credit_model_carried_over_the_wire() -> None:
    """The consumer sets a subscription buffer; the test, playing the broker with a SenderWindow, delivers
    while there is space; the consumer acknowledges processed bytes after 20 % of it. (The real
    broker's pacing is tested in tests/broker/test_core_consumer_credit.py.)"""
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


def test_noop_and_its_reply_pass_both_ways() -> None:
    pair = ConnectionPair()
    pair.handshake()
    pair.exchange(Role.BROKER, Noop(1, False))
    pair.exchange(Role.CLIENT, Noop(1, True))
    pair.exchange(Role.CLIENT, Noop(2, False))
    pair.exchange(Role.BROKER, Noop(2, True))
