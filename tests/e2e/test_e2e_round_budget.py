"""Many connections with frames to spare at once, over real sockets on 127.0.0.1.

trio runs every ready reader once before it looks at the sockets again, so a bystander's request waits a turn
of every busy reader: at READER_TURN_SECONDS (2 ms) each, 100 connections pipelining requests held it 200-300
ms a round. The busy readers now share ROUND_BUDGET_SECONDS a round. Counted without a real clock: the
readers' turn clock (server.py's `time.perf_counter`) is a fake that advances FRAME_COST for each frame
handled, so a turn is a number of frames, and the bystander's wait is the flooders' frames handled meanwhile.
"""

from __future__ import annotations

import math
import time
from typing import Any

import trio

from flowbroker.broker import server as server_module
from flowbroker.broker.core import BrokerCore
from flowbroker.broker.server import READER_TURN_SECONDS, ROUND_BUDGET_SECONDS
from flowbroker.broker.session import Session
from flowbroker.protocol import Frame, Noop
from tests.e2e.test_e2e_faults import RawClient, wait_until

FLOODERS = 40
FLOOD_FRAMES = 2_000  # NOOP replies each, which want no answer (under 64 KiB: one read), far more than a turn takes
FRAME_COST = 50e-6  # fake seconds a frame costs: a 2 ms turn is 40 frames, 40 readers sharing 10 ms 5 each


class _FakeTurnClock:
    """Stands in for the time module in server.py: perf_counter advances only as frames are handled."""

    def __init__(self) -> None:
        self.now = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def perf_counter(self) -> float:
        return self.now


async def test_busy_readers_share_a_round_budget(start_flowbroker, monkeypatch) -> None:
    clock = _FakeTurnClock()
    monkeypatch.setattr(server_module, "time", clock)
    broker = await start_flowbroker()
    bystander = await RawClient.connect(broker.port)
    [bystander_handler] = broker.server.connections.values()
    flooders = [await RawClient.connect(broker.port) for _ in range(FLOODERS)]
    handlers = [h for h in broker.server.connections.values() if h is not bystander_handler]
    bystander_session = bystander_handler.session
    flooded = 0  # the flooders' frames handled
    handled_at: list[int] = []  # flooded when the bystander's frames were handled
    handle = BrokerCore.handle

    def costing(core: BrokerCore, s: Session, frame: Frame) -> Any:
        nonlocal flooded
        clock.now += FRAME_COST
        if s is not bystander_session:
            flooded += 1
        else:
            handled_at.append(flooded)
        return handle(core, s, frame)

    monkeypatch.setattr(BrokerCore, "handle", costing)
    for raw in flooders:
        await raw.send_raw(b"".join(raw.proto.send(Noop(k, True)) for k in range(FLOOD_FRAMES)))
    # Every flooder has far more buffered than a turn takes: wait until all of them are between turns.
    await wait_until(lambda: all(h.conn.frames_received > 10 for h in handlers))
    asked_at = flooded
    await bystander.send(Noop(7, False))
    while not isinstance(reply := await bystander.next_frame(), Noop):  # (credit frames may come first)
        assert reply is not None
    assert reply == Noop(7, True)
    [answered_at] = handled_at
    waited = answered_at - asked_at
    assert answered_at < FLOODERS * FLOOD_FRAMES, "the flood was over before the bystander was answered"
    # Its reader is woken after the round it was sent in, and has its turn in the next: two rounds of the
    # flooders' turns at most (trio may run it last), each the shared budget (and a frame more for each
    # reader: a turn ends after the frame that reaches its end).
    round_frames = math.ceil(ROUND_BUDGET_SECONDS / FRAME_COST) + FLOODERS
    assert waited <= 2 * round_frames, (waited, round_frames)
    # (At full turns one round alone is FLOODERS x 40 frames, 1,600.)
    assert FLOODERS * READER_TURN_SECONDS / FRAME_COST > 2 * round_frames
    for raw in flooders:  # every flooder's frames are handled still
        await raw.send(Noop(1, False))
    for raw in flooders:
        while not isinstance(reply := await raw.next_frame(), Noop):
            assert reply is not None
        await raw.aclose()
    assert flooded == FLOODERS * (FLOOD_FRAMES + 1)
    assert broker.server.busy_readers == 0
    await bystander.aclose()
