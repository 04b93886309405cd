"""A message held by a saturated queue after its producer's connection closed keeps nothing of that
connection (docs/architecture.md, "Bounded everything"): the held transfer kept the whole Session, and with
it the connection's handler, socket objects and buffers, about 6 KB a message charged 512 (a tester: 36,000
one-message connections grew the broker 220 MiB, linear in the count, with the memory alarm never on)."""

from __future__ import annotations

import gc

import trio

from flowbroker.broker.server import ConnectionHandler
from flowbroker.broker.session import Session
from flowbroker.protocol.frames import Transfer, TransferEntry
import flowbroker.client as fb
from tests.e2e.test_e2e_faults import RawClient, wait_until

CONNECTIONS = 50


def _alive(kind: type) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is kind)


async def test_messages_held_after_their_connections_closed_keep_no_session(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("hq", flow_stop_count=1, flow_resume_count=1)
        sessions_before, handlers_before = _alive(Session), _alive(ConnectionHandler)
        for _ in range(CONNECTIONS):
            raw = await RawClient.connect(broker.port)
            await raw.send(Transfer(1, [TransferEntry("", "hq", b"x")]))
            await raw.stream.aclose()
        queue = broker.core.queues["hq"]
        await wait_until(lambda: queue.count == CONNECTIONS and len(broker.core.sessions) == 1)
        assert len(queue.held) >= CONNECTIONS - 1  # (the first went in before the queue saturated)
        assert _alive(Session) == sessions_before
        assert _alive(ConnectionHandler) == handlers_before
        # and they are still delivered, each once
        got = []
        async with conn.consumer("hq", prefetch=100) as consumer:
            for _ in range(CONNECTIONS):
                msg = await consumer.receive(timeout=10)
                got.append(msg.body)
                await msg.ack()
        assert got == [b"x"] * CONNECTIONS
