"""A member leaving a multicast group, run by tests/e2e/test_e2e_multicast.py inside a network namespace
it made: `python multicast_leave.py <group address:port> <processed>`.

One member of group "g" (fanout exchange "fan") takes and acknowledges `processed` of the 200 messages a
producer sends, with more received and not yet taken, and leaves at once. For a member processing is
settlement, reported by term position, so what it settles is what it processed up to the end of the
last payload (a batch of deliveries, at most an mtu) it finished: never more (the rest were never
processed: a leave that reported the received ones lost them), and no less than that (a leave right after
processing everything settled nothing, and all of it came again). Then a second member joins and must
get the rest, once. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import trio

import flowbroker.client as fc
from flowbroker.broker.config import load_config
from flowbroker.broker.server import BrokerServer

COUNT = 200
BODY = 1000  # a few messages a payload: a leave settles whole payloads
WINDOW = 64 * 1024  # room for every message: received ahead of what the member takes


async def main(group_address: str, processed: int) -> dict[str, Any]:
    server = BrokerServer(load_config(None, {
        "server": {"port": 0, "memory_quota": 1 << 30},
        "admin": {"enabled": False},
        "udp": {"endpoint": "127.0.0.1:0"},
    }))
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        url = f"flowbroker://127.0.0.1:{port}"
        async with await fc.connect(url) as conn, await fc.connect(url) as producer_conn:
            await producer_conn.declare_exchange("fan", "fanout")
            await producer_conn.declare_queue("g")
            member = conn.consumer(exchange="fan", transport="udp", group="g", multicast=group_address,
                                   buffer_size=WINDOW)
            with trio.fail_after(60):
                async with member:
                    async with producer_conn.producer("fan", "") as producer:
                        for i in range(COUNT):
                            await producer.send(b"%05d" % i + b"x" * (BODY - 5))
                        await producer.flush(timeout=30)
                    taken: list[bytes] = []
                    while len(taken) < processed:
                        msg = await member.receive(timeout=10)
                        taken.append(msg.body)
                        await msg.ack()
                    while member.statistics().buffered == 0 and processed < COUNT:
                        await trio.sleep(0.01)  # more received than taken when it leaves
                    out["buffered_at_leave"] = member.statistics().buffered
                    datapath = server.core.udp
                    assert datapath is not None
                    out["mtu"] = datapath.groups.by_name["g"].publication.mtu
                queue = server.core.queues["g"]
                out["settled_by_first"] = COUNT - queue.count
                out["first_in_order"] = [int(b[:5]) for b in taken] == list(range(processed))
                second = conn.consumer(exchange="fan", transport="udp", group="g", multicast=group_address,
                                       buffer_size=WINDOW)
                rest: list[bytes] = []
                async with second:
                    while len(rest) < COUNT - out["settled_by_first"]:
                        msg = await second.receive(timeout=10)
                        rest.append(msg.body)
                        await msg.ack()
                    extra = []
                    with trio.move_on_after(0.5):  # nothing more: none of the first member's came again
                        extra.append(await second.receive())
                out["second"] = [int(b[:5]) for b in rest]
                out["second_extra"] = len(extra)
        nursery.cancel_scope.cancel()
    return out


if __name__ == "__main__":
    print(json.dumps(trio.run(main, sys.argv[1], int(sys.argv[2]))))
