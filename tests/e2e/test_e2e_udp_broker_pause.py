"""The broker's process stops (SIGSTOP, a debugger) past a UDP consumer's image liveness timeout while it
delivers to it, then resumes: the consumer gets every message once, in order.

A tester stopped the broker 12-16 s while a queue was read by a UDP consumer: the consumer got 19,000 of
20,000 in order, 1,000 in a row missing, then ReceiveTimeout; the broker counted them delivered and
unsettled, requeued only when the consumer closed. The consumer's image timed out (10 s without data),
and its new image started at the broker's sender position: what was sent into the dead one was lost.

The broker runs in this test's trio loop, stopped whole by a `time.sleep` in it; the consumer runs in a
thread of its own with its own loop. Timeouts scaled down: the consumer's image liveness to 1 s (10 s), the
broker's receiver timeout to 0.4 s (5 s); the pause, 2 s, is past both.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Any, Awaitable, Callable

import pytest
import trio

import flowbroker.client as fc
from flowbroker.broker.udp import egress
from flowbroker.client import udpconsumer
from tests.conftest import RunningBroker
from tests.e2e.loopthread import LoopThread, scale_udp_timeouts

Start = Callable[..., Awaitable[RunningBroker]]

LIVENESS_NS = 1_000_000_000
RECEIVER_TIMEOUT_NS = 400_000_000
PAUSE_S = 2.0
COUNT = 2000


@pytest.mark.parametrize("consumer_waits", [False, True])
async def test_a_udp_consumer_gets_every_message_once_in_order_when_the_broker_stops_past_its_timeouts(
    start_flowbroker: Start, monkeypatch: Any, consumer_waits: bool
) -> None:
    """`consumer_waits`: the application does not process what it was handed out meanwhile either, so
    the broker sends again, from what was processed, deliveries the consumer has: not handed out twice."""
    scale_udp_timeouts(monkeypatch, egress, udpconsumer, receiver_timeout_ns=RECEIVER_TIMEOUT_NS, liveness_ns=LIVENESS_NS)
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("brokerpaused")
        async with conn.producer(routing_key="brokerpaused") as producer:
            for i in range(COUNT):
                await producer.send(struct.pack(">q", i) + b"b" * 92)
            await producer.flush(timeout=30)
    got: list[int] = []
    halfway = threading.Event()

    async def consume() -> None:
        async with await fc.connect(broker.url) as conn:
            async with conn.consumer("brokerpaused", transport="udp", prefetch=500,
                                     buffer_size=64 * 1024) as consumer:
                while len(got) < COUNT:
                    try:
                        msg = await consumer.receive(timeout=4)
                    except fc.ReceiveTimeout:
                        break
                    got.append(struct.unpack(">q", msg.body[:8])[0])
                    await msg.ack()
                    if len(got) == COUNT // 3:
                        halfway.set()
                        if consumer_waits:  # (its loop runs: the image times out holding what it handed out)
                            await trio.sleep(PAUSE_S + 0.5)
                    if len(got) % 20 == 0:
                        await trio.sleep(0.002)  # a paced consumer: the broker has deliveries in flight

    client = LoopThread(consume)
    client.start()
    with trio.fail_after(30):
        while not halfway.is_set():
            await trio.sleep(0.001)
    time.sleep(PAUSE_S)  # the broker (this loop) stops whole while the consumer's loop runs on
    await client.join()
    missing = sorted(set(range(COUNT)) - set(got))
    assert got == list(range(COUNT)), (len(got), missing[:3], len(missing))


async def test_a_udp_consumer_whose_stream_went_on_without_it_is_cancelled_and_nothing_stays_unsettled(
    start_flowbroker: Start,
) -> None:
    """The safety net: a new image that starts past where the old one was read to (the broker could not
    send again what went into the dead one) ended nothing: the consumer read on past the gap and those
    deliveries stayed unsettled on the broker until it closed (a tester). The consumer cancels instead,
    the broker requeues every unsettled delivery, and the next receive raises naming what happened."""
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("gap")
        async with conn.producer(routing_key="gap") as producer:
            for i in range(50):
                await producer.send(b"%d" % i)
            await producer.flush(timeout=30)
        consumer = conn.consumer("gap", transport="udp", prefetch=100)
        async with consumer:
            first = await consumer.receive(timeout=10)
            assert isinstance(consumer, udpconsumer.UdpConsumer)
            read_to = consumer._read_to
            assert read_to > 0

            class Later:  # what `_image_available` reads of a new image that joins past `read_to`
                join_position = read_to + 4096
                term_length = 1 << 21
                mtu = 1408
                window_cap = 0
                hold_partial = False

            consumer._subscription_id_in_image = lambda: 0  # type: ignore[method-assign]
            consumer._image_available(Later())  # type: ignore[arg-type]
            with pytest.raises(fc.PublishError, match="stream to this consumer went on 4096 bytes"):
                await consumer.receive(timeout=5)
            with pytest.raises(fc.AlreadySettled, match="lost part of the broker's UDP stream"):
                await first.ack()
        queue = broker.core.queues["gap"]
        with trio.fail_after(10):
            while queue.statistics().unsettled_messages or not queue.subscriptions == {}:
                await trio.sleep(0.01)
        assert queue.statistics().ready_messages == 50  # all back, none unsettled
