"""A multicast group end to end, run by tests/e2e/test_e2e_multicast.py inside a network namespace it made
(where 224.0.0.0/4 routes over lo): `python multicast_scenario.py <fc> <group address:port>`.

A real BrokerServer (TCP and its UDP data path), a fast and a slow member of one group of fanout exchange
"fan", each on its own TCP connection and its own multicast socket, and a flow-controlled producer on a
third. Prints one JSON object with what it saw; the test asserts on it. The group's queue and publication
are read from the broker's core (same process) only to measure, never to steer.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import trio

import flowbroker.client as fc
from flowbroker.broker.config import load_config
from flowbroker.broker.server import BrokerServer
from flowbroker.client.groupconsumer import GroupConsumer

COUNT = 600
BODY = 400
WINDOW = 16 * 1024  # each member's window (>= the broker's mtu, 8 KiB)
STOP, RESUME = 60, 20  # the group queue's watermarks
CREDIT = 16 * 1024  # the producer's byte credit (static policy): what it may have in flight past a stop


async def main(fc_mode: str, group_address: str) -> dict[str, Any]:
    server = BrokerServer(load_config(None, {
        "server": {"port": 0, "memory_quota": 1 << 30},
        "admin": {"enabled": False},
        "credit": {"policy": "static", "static_size": CREDIT},
        "udp": {"endpoint": "127.0.0.1:0", "group_receiver_timeout": 5.0},
    }))
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        url = f"flowbroker://127.0.0.1:{port}"
        datapath = server.core.udp
        assert datapath is not None
        async with await fc.connect(url) as fast_conn, await fc.connect(url) as slow_conn, \
                await fc.connect(url) as producer_conn:
            await producer_conn.declare_exchange("fan", "fanout")
            await producer_conn.declare_queue("g", flow_stop_count=STOP, flow_resume_count=RESUME)
            fast = fast_conn.consumer(exchange="fan", transport="udp", group="g", multicast=group_address,
                                      fc=fc_mode, buffer_size=WINDOW)
            slow = slow_conn.consumer(exchange="fan", transport="udp", group="g", multicast=group_address,
                                      fc=fc_mode, buffer_size=WINDOW)
            assert isinstance(fast, GroupConsumer) and isinstance(slow, GroupConsumer)
            async with fast, slow:
                # No waiting for the members' images: after a JOIN the group offers nothing new until that
                # member has reported, so both get every message produced from here on.
                group = datapath.groups.by_name["g"]
                out["channel"] = fast.channel_uri
                out["group_tag"] = fast.group_tag
                fast_bodies: list[bytes] = []
                slow_bodies: list[bytes] = []
                worst_lead = 0  # how far (term bytes) the fast member got ahead of the slow one's processing
                max_depth = 0
                events: list[tuple[str, str]] = []
                done = trio.Event()

                def slow_processed_position() -> int:
                    image, sub = slow._image, slow._subscription
                    assert image is not None and sub is not None
                    return int(image.subscriber_position(sub.subscription_id)
                               - image.subscriber_hold(sub.subscription_id))

                async def run_fast() -> None:
                    nonlocal worst_lead
                    async for msg in fast:
                        image, sub = fast._image, fast._subscription
                        assert image is not None and sub is not None
                        lead = image.subscriber_position(sub.subscription_id) - slow_processed_position()
                        worst_lead = max(worst_lead, lead)
                        fast_bodies.append(msg.body)
                        await msg.ack()
                        if len(fast_bodies) == COUNT:
                            return

                async def run_slow() -> None:
                    async for msg in slow:  # never settles: for a member, taking the next is processing
                        await trio.sleep(0.003)  # a slow handler
                        slow_bodies.append(msg.body)
                        if len(slow_bodies) == COUNT:
                            out["slow_unsettled_in_hand"] = slow.statistics().unsettled
                            await msg.ack()
                            out["slow_unsettled_after"] = slow.statistics().unsettled
                            return

                async def sample() -> None:
                    nonlocal max_depth
                    queue = server.core.queues["g"]
                    while not done.is_set():
                        max_depth = max(max_depth, queue.count)
                        await trio.sleep(0.002)

                async def watch() -> None:
                    async for event in producer_conn.flow_events():
                        events.append((event.kind, event.destination))

                async def produce() -> None:
                    async with producer_conn.producer("fan", "", window=1000) as producer:
                        for i in range(COUNT):
                            await producer.send(b"%05d" % i + b"b" * (BODY - 5))

                with trio.fail_after(120):
                    async with trio.open_nursery() as inner:
                        inner.start_soon(sample)
                        inner.start_soon(watch)
                        async with trio.open_nursery() as work:
                            work.start_soon(run_fast)
                            work.start_soon(run_slow)
                            work.start_soon(produce)
                        done.set()
                        with trio.fail_after(10):  # the last status messages settle the rest
                            while server.core.queues["g"].count:
                                await trio.sleep(0.01)
                        inner.cancel_scope.cancel()
                expected = [b"%05d" % i + b"b" * (BODY - 5) for i in range(COUNT)]
                out["fast_in_order"] = fast_bodies == expected
                out["slow_in_order"] = slow_bodies == expected
                out["fast_count"] = len(fast_bodies)
                out["slow_count"] = len(slow_bodies)
                out["worst_lead"] = worst_lead
                out["max_depth"] = max_depth
                out["events"] = events
                out["settled"] = group.settled_total
                out["queue_left"] = server.core.queues["g"].count
                out["refused"] = dict(datapath.refused)
                out["term_bytes_per_message"] = group.publication.position // COUNT
                out["producer_credit"] = CREDIT
        nursery.cancel_scope.cancel()
    return out


if __name__ == "__main__":
    result = trio.run(main, sys.argv[1], sys.argv[2])
    print(json.dumps(result))
