"""A UDP producer whose process stops (SIGSTOP, a debugger) past its publication's receiver timeout and the
broker's image liveness timeout, then resumes: every message routed exactly once, in order, no error.

A tester's producer (10,000 messages at 1,500/s) stopped 7-14 s died on resume 4 runs of 5 with
`ConnectionClosed(INTERNAL_ERROR): ... the batch claimed up to position 418816 could not be appended
(offer_many 0)`, 1,000 messages unconfirmed and the rest never sent: its first duty cycle counted the stop
as the broker's silence (5 s), found nobody connected and dropped the publication limit under the batch it
had claimed. Past 10 s, the broker's image of it timed out too, and the new image started at the
producer's sender position: the 1,000 messages sent into the dead one were lost, and counted complete.

The producer runs in a thread of its own with its own trio loop, stopped whole by a `time.sleep` run in
that loop (as tests/e2e/test_e2e_udp_pause.py stops a consumer), while the broker (this test's loop) goes
on. Timeouts scaled down: the producer's receiver timeout to 0.4 s (5 s), the broker's image liveness to
1 s (10 s); the pause, 2 s, is past both.
"""

from __future__ import annotations

import struct
from typing import Any, Awaitable, Callable

import pytest
import trio

import flowbroker.client as fc
from flowbroker.broker.udp import ingress
from flowbroker.client import udpproducer
from tests.conftest import RunningBroker
from tests.e2e.loopthread import LoopThread, scale_udp_timeouts

Start = Callable[..., Awaitable[RunningBroker]]

LIVENESS_NS = 1_000_000_000
RECEIVER_TIMEOUT_NS = 400_000_000
PAUSE_S = 2.0
COUNT = 3000


async def test_a_udp_producer_paused_past_the_timeouts_resumes_and_every_message_is_routed_once_in_order(
    start_flowbroker: Start, monkeypatch: Any
) -> None:
    scale_udp_timeouts(monkeypatch, udpproducer, ingress, receiver_timeout_ns=RECEIVER_TIMEOUT_NS, liveness_ns=LIVENESS_NS)
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("prodpaused")

    async def produce() -> None:
        async with await fc.connect(broker.url) as conn:
            async with conn.producer(routing_key="prodpaused", transport="udp") as producer:
                for i in range(COUNT):
                    await producer.send(struct.pack(">q", i) + b"p" * 92, timeout=30)
                    if i == COUNT // 3:
                        client.mark()
                    if i % 20 == 0:
                        await trio.sleep(0.005)  # a paced producer: its loop runs its other tasks
                    if i == COUNT // 3 + 10:
                        while not client.resumed.is_set():  # the stop comes while sending
                            await trio.sleep(0.001)
                await producer.flush(timeout=30)

    client = LoopThread(produce)
    client.start()
    await client.marked()
    client.pause_soon(PAUSE_S)  # the producer's loop stops whole
    await client.join()
    got: list[int] = []
    async with await fc.connect(broker.url) as conn:
        async with conn.consumer("prodpaused", prefetch=1000) as consumer:
            while len(got) < COUNT:
                try:
                    msg = await consumer.receive(timeout=2)
                except fc.ReceiveTimeout:
                    break
                got.append(struct.unpack(">q", msg.body[:8])[0])
                await msg.ack()
    assert got == list(range(COUNT))


HELD_COUNT = 600


async def test_messages_a_saturated_queue_held_when_the_producer_paused_are_routed_once_after_it_resumes(
    start_flowbroker: Start, monkeypatch: Any
) -> None:
    """The producer's new image starts at the position the broker last reported consumed, its completion
    point: the messages a saturated queue holds (routed, enqueued, not completed) are sent again, and the
    broker routes from where it had polled, not twice. Without it the queue got them twice (the held ones
    again after the last, out of order)."""
    scale_udp_timeouts(monkeypatch, udpproducer, ingress, receiver_timeout_ns=RECEIVER_TIMEOUT_NS, liveness_ns=LIVENESS_NS)
    broker = await start_flowbroker(credit={"policy": "static", "static_size": 64 * 1024})
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("held", flow_stop_count=50, flow_resume_count=10)

    async def produce() -> None:
        async with await fc.connect(broker.url) as conn:
            async with conn.producer(routing_key="held", transport="udp") as producer:
                client.mark()
                for i in range(HELD_COUNT):
                    await producer.send(struct.pack(">q", i) + b"h" * 92, timeout=30)
                    if i % 20 == 0:
                        await trio.sleep(0.001)
                await producer.flush(timeout=30)

    client = LoopThread(produce)
    client.start()
    queue = None
    with trio.fail_after(20):
        while queue is None or len(queue.store) < 50 or broker.core.udp is None:
            await trio.sleep(0.01)
            queue = broker.core.queues.get("held")
        await trio.sleep(0.3)  # the window closes: the producer waits, the queue holds what it routed
    ingress_ = broker.core.udp.ingress
    (pub,) = ingress_.publications.values()
    assert pub.pending, "the saturated queue holds none of the producer's messages"
    await client.pause(PAUSE_S)  # the producer's loop stops whole
    got: list[int] = []
    async with await fc.connect(broker.url) as conn:
        async with conn.consumer("held", prefetch=100) as consumer:
            # Until all are in (a gap of 3 s, the producer's rejoin on a busy machine, ended the loop
            # early and left the rest held with nobody to drain them); then any duplicate would follow.
            with trio.fail_after(60):
                while len(got) < HELD_COUNT:
                    msg = await consumer.receive(timeout=30)
                    got.append(struct.unpack(">q", msg.body[:8])[0])
                    await msg.ack()
            await client.join(30)
            with pytest.raises(fc.ReceiveTimeout):
                msg = await consumer.receive(timeout=1)
                got.append(struct.unpack(">q", msg.body[:8])[0])
    assert got == list(range(HELD_COUNT))
    assert pub.resent_skipped > 0  # the producer did send again what the queue held
