"""Property: however an application settles (any order of tags, any mix of outcomes, the writer taking
them at any point), the SETTLE frames settle each tag once with its outcome, and each frame's ranges are
what `to_ranges` makes of its tags: sorted, disjoint and not touching. The SDK keeps settlements as runs
of consecutive tags (`Connection._settle_tag`) instead of a list of every tag; this checks that the runs
say the same.

In memory: a real `Connection` over a trio memory stream pair, a broker-role protocol state machine
decoding what its writer sends."""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from flowbroker.client.connection import Connection, merge_ranges
from flowbroker.protocol import PROTOCOL_VERSION, Hello, Outcome, Role, Settle, Welcome
from flowbroker.protocol import Connection as ProtocolConnection
from flowbroker.protocol.ranges import to_ranges

OUTCOMES = [Outcome.ACK, Outcome.REJECT, Outcome.REQUEUE]


def _connected() -> tuple[
    Connection, ProtocolConnection, trio.StapledStream[trio.testing.MemorySendStream, trio.testing.MemoryReceiveStream]
]:
    """A real SDK connection past its handshake on one end of a memory stream pair, and the broker-role
    state machine and stream end that play the broker."""
    client_end, broker_end = trio.testing.memory_stream_pair()
    client, broker = ProtocolConnection(Role.CLIENT), ProtocolConnection(Role.BROKER)
    broker.receive_data(client.send(Hello(PROTOCOL_VERSION, "test", True, [], None)))
    broker.next_frame()
    welcome = Welcome(1, 1, "test", 8 << 20, 1 << 20, 0, 0, "test")
    client.receive_data(broker.send(welcome))
    client.next_frame()
    return Connection(client_end, client, welcome), broker, broker_end


async def _settles_sent(broker: ProtocolConnection, broker_end: trio.abc.ReceiveStream) -> list[Settle]:
    """The SETTLE frames among what the SDK has written so far (one read: all of it, in these tests)."""
    broker.receive_data(bytes(await broker_end.receive_some(1 << 20)))
    frames = []
    while (frame := broker.next_frame()) is not None:
        frames.append(frame)
    return [f for f in frames if isinstance(f, Settle)]


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    count=st.integers(1, 60),
)
def test_settle_frames_settle_every_tag_once_in_to_ranges_form(data: st.DataObject, count: int) -> None:
    order = data.draw(st.permutations(list(range(1, count + 1))), label="order")
    if data.draw(st.booleans(), label="mostly in order"):
        order = sorted(order)
    outcomes = data.draw(st.lists(st.sampled_from(OUTCOMES), min_size=count, max_size=count), label="outcomes")
    yields = data.draw(st.sets(st.integers(0, count - 1), max_size=5), label="writer runs after")

    async def run() -> list[Settle]:
        conn, broker, broker_end = _connected()
        async with conn:
            for i, tag in enumerate(order):
                conn._settle_tag(outcomes[tag - 1], tag)
                if i in yields:
                    await trio.testing.wait_all_tasks_blocked()
            await trio.testing.wait_all_tasks_blocked()
            return await _settles_sent(broker, broker_end)

    settles = trio.run(run)
    seen: dict[int, Outcome] = {}
    for frame in settles:
        tags = [t for lo, hi in frame.ranges for t in range(lo, hi + 1)]
        assert frame.ranges == to_ranges(tags)
        for tag in tags:
            assert tag not in seen
            seen[tag] = frame.outcome
    assert seen == {tag: outcomes[tag - 1] for tag in range(1, count + 1)}


@given(st.lists(st.integers(1, 200), unique=True))
def test_merge_ranges_of_runs_is_to_ranges_of_their_tags(tags: list[int]) -> None:
    runs: list[tuple[int, int]] = []
    for tag in tags:  # the runs `_settle_tag` keeps for tags settled in this order
        if runs and tag == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], tag)
        else:
            runs.append((tag, tag))
    assert merge_ranges(runs) == to_ranges(tags)


def test_a_consumer_settling_a_full_buffer_sends_a_settle_frame_per_several_yields() -> None:
    """The writer lets settlements wait while the application keeps settling (up to a quarter of the
    prefetch): iterating and acking 2,000 buffered messages, which yields once per
    YIELD_EVERY, sends a SETTLE frame per several yields instead of one per yield, and the last ones go out
    once the application stops (here: it waits for a message that does not come)."""
    from flowbroker.client.consumer import YIELD_EVERY
    from flowbroker.protocol import Deliver, DeliveryEntry, Ok, Subscribe

    count, prefetch = 2000, 2000

    async def run() -> list[Settle]:
        conn, broker, broker_end = _connected()
        settles: list[Settle] = []

        async def scripted_broker() -> None:
            while True:
                broker.receive_data(bytes(await broker_end.receive_some(1 << 20)))
                while (frame := broker.next_frame()) is not None:
                    if isinstance(frame, Subscribe):
                        await broker_end.send_all(broker.send(Ok(frame.request_id, {"queue": "q", "prefetch": prefetch})))
                        for first in range(1, count + 1, 500):
                            entries = [DeliveryEntry(tag, "", "q", b"x", None, False) for tag in range(first, first + 500)]
                            await broker_end.send_all(broker.send(Deliver(frame.subscription_id, entries)))
                    elif isinstance(frame, Settle):
                        settles.append(frame)

        async with conn, trio.open_nursery() as nursery:
            nursery.start_soon(scripted_broker)
            async with conn.consumer("q", prefetch=prefetch) as consumer:
                while consumer.buffered < count:
                    await trio.sleep(0)
                received = 0
                async for msg in consumer:
                    await msg.ack()
                    received += 1
                    if received == count:
                        break
                with trio.move_on_after(0.5):  # the application waits: what it settled goes out
                    await consumer.receive()
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        return settles

    settles = trio.run(run)
    tags = sorted(t for frame in settles for lo, hi in frame.ranges for t in range(lo, hi + 1))
    assert tags == list(range(1, count + 1))
    assert {frame.outcome for frame in settles} == {Outcome.ACK}
    # one frame per yield would be count / YIELD_EVERY (16); at most a quarter of the prefetch is held
    assert len(settles) <= count // (prefetch // 4) + 1
    assert len(settles) < count // YIELD_EVERY


def test_settlements_of_an_open_run_go_out_when_the_connection_closes_at_once() -> None:
    """An ack and then `conn.aclose()` with no yield between: closing used to end the open run by setting
    only its end (`_run_next = -1`), so the writer sent SETTLE [(4, -2)], which the SDK's own state machine
    refused ("cannot send: SETTLE frame ... bad range"), and the acked messages came back redelivered."""

    async def run() -> list[Settle]:
        conn, broker, broker_end = _connected()
        async with conn:
            conn._settle_tag(Outcome.ACK, 4)
            conn._settle_tag(Outcome.ACK, 5)
            conn._settle_tag(Outcome.REJECT, 7)
            await conn.aclose()
        return await _settles_sent(broker, broker_end)

    settles = trio.run(run)
    assert sorted((f.outcome, f.ranges) for f in settles) == sorted([(Outcome.ACK, [(4, 5)]), (Outcome.REJECT, [(7, 7)])])
