"""Property: the consumer's buffer is bounded by the prefetch the broker honours, and the guard never
fires against a broker that honours it, whatever the order of deliveries, settlements and the delay
before the broker hears of them; it fires at the first delivery past the prefetch. Every processed
byte is counted on both positions, whatever the buffer sizes.

In memory: a real `Consumer` on a stand-in for the connection that records settlements and uses the
real `Connection._processed`."""

from __future__ import annotations

from typing import Any

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from flowbroker.client.connection import Connection
from flowbroker.client.consumer import Consumer
from flowbroker.protocol import ReceiverWindow, BufferAck, DeliveryEntry, Outcome, message_size


class StandInConnection:
    """What a Consumer uses of its Connection, without sockets or tasks."""

    close_timeout = 1.0
    is_closed = False
    _run_next = -1  # no open run of settlements: every one goes through `_settle_tag`
    _run_outcome = None
    _processed = Connection._processed
    _set_buffer = Connection._set_buffer

    def __init__(self) -> None:
        self._receiver_window = ReceiverWindow(0)
        self.settled: list[int] = []
        self.violations: list[str] = []
        self.acks: list[BufferAck] = []

    def _settle_tag(self, outcome: Outcome, tag: int) -> None:
        self.settled.append(tag)

    def _queue_ack(self, ack: BufferAck) -> None:
        self.acks.append(ack)

    def _queue_control(self, frame: object) -> None:
        pass

    def _check_open(self) -> None:
        pass

    def _broker_violated_credit(self, text: str) -> None:
        self.violations.append(text)


steps = st.lists(
    st.one_of(
        st.tuples(st.just("deliver"), st.integers(1, 6)),
        st.tuples(st.just("settle"), st.integers(1, 4)),
        st.tuples(st.just("move-on"), st.just(1)),
        st.tuples(st.just("broker-hears"), st.just(0)),
        st.tuples(st.just("buffer"), st.integers(0, 3000)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(prefetch=st.integers(1, 8), steps=steps, bodies=st.lists(st.binary(max_size=40), min_size=1, max_size=5))
def test_the_buffer_is_bounded_by_the_prefetch_and_the_guard_fires_only_past_it(
    prefetch: int, steps: list[tuple[str, int]], bodies: list[bytes]
) -> None:
    async def run() -> None:
        conn: Any = StandInConnection()
        consumer = Consumer(conn, "q", 1, prefetch=prefetch)
        next_tag = 1
        broker_unsettled = 0  # the broker's count: deliveries sent, less settlements it has heard of
        heard = 0
        processed_bytes = 0
        handed_out: list[Any] = []

        def deliver(count: int) -> None:
            nonlocal next_tag
            entries = [
                DeliveryEntry(tag, "", "q", bodies[tag % len(bodies)], {"n": tag} if tag % 3 == 0 else None, False)
                for tag in range(next_tag, next_tag + count)
            ]
            next_tag += count
            consumer._on_deliver(entries)

        for kind, n in steps:
            if kind == "deliver":  # a broker that honours the prefetch
                n = min(n, prefetch - broker_unsettled)
                if n > 0:
                    deliver(n)
                    broker_unsettled += n
            elif kind == "settle":  # take up to n messages and settle them
                for _ in range(n):
                    if not consumer._buffered:
                        break
                    msg = consumer._buffered.popleft()
                    msg.settle_nowait(Outcome.ACK)
                    processed_bytes += message_size(msg.body, msg.headers)
            elif kind == "move-on":  # take one and move on without settling: processed, still unsettled
                if consumer._buffered:
                    msg = consumer._buffered.popleft()
                    msg._mark_processed()
                    processed_bytes += message_size(msg.body, msg.headers)
                    handed_out.append(msg)
            elif kind == "broker-hears":  # the SETTLE frames so far reach the broker
                broker_unsettled -= len(conn.settled) - heard
                heard = len(conn.settled)
            else:  # turn the subscription's buffer on or off (or resize it)
                await consumer.set_buffer_size(n)
            assert conn.violations == []
            assert consumer._unsettled <= broker_unsettled <= prefetch
            assert len(consumer._buffered) <= prefetch
            assert consumer._receiver_window.consumed_position == conn._receiver_window.consumed_position == processed_bytes
            if conn.acks:  # an acknowledgement never covers more than was processed
                assert max(a.acked_position for a in conn.acks) <= processed_bytes
        # Once the broker has heard every settlement, one delivery past the prefetch is caught.
        broker_unsettled -= len(conn.settled) - heard
        if prefetch - broker_unsettled > 0:
            deliver(prefetch - broker_unsettled)
        assert conn.violations == []
        deliver(1)
        assert len(conn.violations) == 1 and f"above its prefetch {prefetch}" in conn.violations[0]

    trio.run(run)
