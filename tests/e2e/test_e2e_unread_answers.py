"""A client that pipelines requests and does not read their answers, over real sockets on 127.0.0.1.

Its reader took a full turn (READER_TURN_SECONDS, 2 ms of frames) however its answers piled up: 100 such
connections, 3,000 refused DECLAREs each, held a bystander producer and consumer for 100 turns at each of
theirs (p50 9.9-10.3 s, a tester). Once its answers wait past UNREAD_ANSWERS_BYTES for a socket that takes
nothing more, it hands UNREAD_TURN_FRAMES frames a turn to the core; it is still read, and every request is
answered once it reads. Counted in frames handled per scheduler step, never in time.
"""

from __future__ import annotations

from typing import Any

import trio

from flowbroker.broker.core import BrokerCore
from flowbroker.broker.server import UNREAD_ANSWERS_BYTES, UNREAD_TURN_FRAMES, ConnectionHandler
from flowbroker.broker.session import Session
from flowbroker.protocol import Error, ErrorCode, Frame, Noop
from tests.e2e.test_e2e_closing_backlog import _requests, _unread
from tests.e2e.test_e2e_faults import RawClient, wait_until

REQUESTS = 2_000  # refused SUBSCRIBEs, 500-600 bytes of ERROR each: about 1 MiB, under the outbox's bounds


class _Steps(trio.abc.Instrument):
    """Numbers the scheduler's task steps: frames handled in one step were handled in one reader's turn."""

    def __init__(self) -> None:
        self.step = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.step += 1


def _answers_unread(handler: ConnectionHandler, session: Session) -> bool:
    """What the reader checks: its socket takes nothing more, and its answers wait past the bound."""
    return bool(handler._writing or handler._unsent) and session.outbox.control_bytes >= UNREAD_ANSWERS_BYTES


async def test_a_client_that_does_not_read_its_answers_gets_a_few_frames_a_turn(start_flowbroker,
                                                                               monkeypatch) -> None:
    broker = await start_flowbroker()
    raw, handler = await _unread(broker)
    session = handler.session
    assert session is not None
    steps = _Steps()
    per_step: dict[int, int] = {}  # step -> the unread client's frames handled in it while its answers waited
    handled = 0
    handle = BrokerCore.handle

    def counting(core: BrokerCore, s: Session, frame: Frame) -> Any:
        nonlocal handled
        if s is session:
            handled += 1
            if _answers_unread(handler, session):
                per_step[steps.step] = per_step.get(steps.step, 0) + 1
        return handle(core, s, frame)

    monkeypatch.setattr(BrokerCore, "handle", counting)
    trio.lowlevel.add_instrument(steps)
    try:
        await raw.send_raw(_requests(raw, REQUESTS))  # none of their answers read
        # A bystander is answered while the unread client's frames are still being handled.
        bystander = await RawClient.connect(broker.port)
        await wait_until(lambda: _answers_unread(handler, session) or handled == REQUESTS)
        await bystander.send(Noop(7, False))
        while not isinstance(reply := await bystander.next_frame(), Noop):  # (credit frames may come first)
            assert reply is not None
        assert reply == Noop(7, True)
        handled_when_answered = handled
        await bystander.aclose()
        await wait_until(lambda: handled == REQUESTS)
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert per_step, "its answers never waited past the bound"
    assert max(per_step.values()) <= UNREAD_TURN_FRAMES, sorted(per_step.values())[-5:]
    assert handled_when_answered < REQUESTS  # (2 ms turns: all of them were handled within a few)
    # Never stopped reading: every request is answered, in order, once the client reads.
    answers: list[int] = []
    while len(answers) < REQUESTS:
        frame = await raw.next_frame()
        assert isinstance(frame, Error) and frame.code is ErrorCode.NOT_FOUND, frame
        answers.append(frame.ref_id or 0)
    assert answers == list(range(1, REQUESTS + 1))
    await raw.aclose()
