"""A UDP consumer whose process stops (SIGSTOP, a debugger, a long GC pause) past the broker's receiver
timeout and its own image liveness timeout, then resumes: every message exactly once and in order.

A tester's consumer (buffer_size 256 KiB, prefetch 10,000, 20,000 messages) stopped for 12-16 s after 5
messages lost 369 of them in 4 runs of 10 (received 0..2591 then 2961..19999; the 369 stayed unsettled
on the broker until the consumer closed), or stalled. On resume its image judged the publication silent
for longer than the liveness timeout (10 s) *before* reading the datagrams that had waited in its socket
all along, drained, and was made again at the broker's later position: what lay between was skipped.

The consumer runs in a thread of its own with its own trio loop, and a `time.sleep` run in that loop (from
another thread, wherever the consumer's tasks then are) stops it whole, as SIGSTOP stops a process, while
the broker (this test's loop) goes on. The timeouts are scaled
down so the test takes seconds: the consumer's image liveness timeout to 1 s (10 s) and the broker's
receiver timeout to 0.4 s (5 s); the pause, 2 s, is past both, as 12-16 s was past 10 s and 5 s.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import replace
from typing import Any, Awaitable, Callable

import pytest
import trio

import flowbroker.client as fc
from flowbroker.broker import views
from flowbroker.broker.udp import egress
from flowbroker.client.udpconsumer import UdpConsumer
from flowbroker.transport.image import ImageTimers
from flowbroker.transport.publication import PublicationConfig
from tests.conftest import RunningBroker
from tests.e2e.loopthread import LoopThread

Start = Callable[..., Awaitable[RunningBroker]]

LIVENESS_NS = 1_000_000_000
RECEIVER_TIMEOUT_NS = 400_000_000
PAUSE_S = 2.0
COUNT = 3000


def _scaled_timeouts(monkeypatch: Any) -> None:
    original = UdpConsumer._receiver_config

    def receiver_config(self: UdpConsumer, session_id: int, result: dict[str, Any]) -> Any:
        config = original(self, session_id, result)
        return replace(config, timers=replace(config.timers, image_liveness_timeout_ns=LIVENESS_NS))

    monkeypatch.setattr(UdpConsumer, "_receiver_config", receiver_config)
    monkeypatch.setattr(egress, "PublicationConfig",
                        functools.partial(PublicationConfig, connection_timeout_ns=RECEIVER_TIMEOUT_NS))
    assert ImageTimers().image_liveness_timeout_ns > LIVENESS_NS  # (scaled down, as the broker's below)


@pytest.mark.parametrize("pause_after", [0.0, 0.01, 0.03])
async def test_a_udp_consumer_paused_past_the_timeouts_resumes_with_every_message_once_in_order(
    start_flowbroker: Start, monkeypatch: Any, pause_after: float
) -> None:
    """Stopped `pause_after` seconds after its fifth message, wherever its tasks are then (all its messages
    processed and reported, or a window's worth waiting in its socket): without the fixes, a stall
    (ReceiveTimeout with the queue full: the subscription never went back into the rotation), a gap (an
    image made again further on), or the view's unacked bytes jumping to the whole stream."""
    _scaled_timeouts(monkeypatch)
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("paused")
        async with conn.producer(routing_key="paused") as producer:
            for i in range(COUNT):
                await producer.send(struct.pack(">q", i) + b"z" * 300, timeout=30)
    got: list[int] = []
    setups: list[int] = []
    unacked_while_paused: list[int] = []
    connected_while_paused: list[bool] = []

    async def consume() -> None:
        async with await fc.connect(broker.url) as conn:
            async with conn.consumer("paused", transport="udp", prefetch=10_000,
                                     buffer_size=256 * 1024) as consumer:
                while len(got) < COUNT:
                    msg = await consumer.receive(timeout=10)
                    got.append(struct.unpack(">q", msg.body[:8])[0])
                    await msg.ack()
                    if len(got) == 5:
                        client.mark()
                assert isinstance(consumer, UdpConsumer) and consumer._channel is not None
                setups.append(consumer._channel.dispositions["setup"])

    datapath = broker.core.udp
    assert datapath is not None
    client = LoopThread(consume)
    client.start()
    await client.marked()
    await trio.sleep(pause_after)
    client.pause_soon(PAUSE_S)  # the consumer's loop stops whole
    with trio.fail_after(60):
        while client.alive:
            if not client.resumed.is_set() and len(got) >= 5:
                subscriptions = views.queue_view(broker.core.queues["paused"], broker.core.clock_ns())["subscriptions"]
                if subscriptions:
                    unacked_while_paused.append(subscriptions[0]["buffer"]["unacked"])
                streams = list(datapath.egress.subscriptions.values())
                if streams:
                    connected_while_paused.append(streams[0].publication.is_connected)
            await trio.sleep(0.05)
    await client.join()
    assert False in connected_while_paused  # the broker's receiver timeout passed
    assert got == list(range(COUNT))
    assert setups == [1]  # one image throughout: not drained on resume and made again further on
    queue = broker.core.queues["paused"]
    assert len(queue.store) == 0
    # The view's unacked bytes stayed within what the consumer's window allowed (the window and one batch
    # over it), also once the broker had stopped hearing from it (they read the whole stream so).
    assert unacked_while_paused and max(unacked_while_paused) <= 256 * 1024 + 65536, unacked_while_paused
