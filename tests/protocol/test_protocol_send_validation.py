"""`Connection.send()` checks a locally built frame with the checks a received one goes through
(`frames.check_frame`, the checkers of `decode_body`), as h11 validates what is sent as well as what is
received: an invalid frame raises LocalProtocolError with the code the peer would answer, nothing is
sent or counted, and the connection goes on. Every valid frame is accepted and arrives unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from tests.protocol.pair import ConnectionPair
from tests.protocol.protocol_strategies import FRAME_STRATEGIES

from flowbroker.protocol import (
    PROTOCOL_VERSION,
    BufferAck,
    DeclareQueue,
    Deliver,
    ErrorCode,
    Frame,
    FrameType,
    Hello,
    LocalProtocolError,
    Noop,
    Outcome,
    RemoteProtocolError,
    Role,
    Settle,
    Subscribe,
    Transfer,
    TransferEntry,
    Welcome,
    check_frame,
    decode_body,
    frame_to_wire,
)
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME, MAX_HEADERS, MAX_RANGES_PER_FRAME

ENTRY = ("", "q", b"body", None, None, None)  # what the SDK queues
MALFORMED, LIMIT = ErrorCode.MALFORMED_FRAME, ErrorCode.LIMIT_EXCEEDED


def open_pair() -> ConnectionPair:
    pair = ConnectionPair()
    pair.exchange(Role.CLIENT, Hello(PROTOCOL_VERSION, "t", True, [], None))
    pair.exchange(Role.BROKER, Welcome(PROTOCOL_VERSION, 1, "b", 1 << 20, 1 << 19, 0, 0, "b"))
    return pair


INVALID_CLIENT_FRAMES: list[tuple[str, Any, ErrorCode, str]] = [
    ("transfer id 0", Transfer(0, [ENTRY]), MALFORMED, "first_id: expected a positive integer"),  # type: ignore[list-item]
    ("Transfer(0, [])", Transfer(0, []), MALFORMED, "first_id"),
    ("no entries", Transfer(1, []), MALFORMED, "entries must be a non-empty list"),
    ("too many entries", Transfer(1, [ENTRY] * (MAX_ENTRIES_PER_FRAME + 1)), LIMIT, "MAX_ENTRIES_PER_FRAME"),  # type: ignore[list-item]
    ("body not bytes", Transfer(1, [("", "q", "text", None, None, None)]), MALFORMED, "body must be bytes"),  # type: ignore[list-item]
    ("routing key not a string", Transfer(1, [("", 7, b"x", None, None, None)]), MALFORMED, "routing_key must be strings"),  # type: ignore[list-item]
    ("entry too short", Transfer(1, [("", "q")]), MALFORMED, "each entry must be"),  # type: ignore[list-item]
    ("entry not a sequence", Transfer(1, [42]), MALFORMED, "each entry must be"),  # type: ignore[list-item]
    (
        "too many headers",
        Transfer(1, [TransferEntry("", "q", b"x", {f"h{i}": i for i in range(MAX_HEADERS + 1)})]),
        LIMIT,
        "MAX_HEADERS",
    ),
    ("header value a list", Transfer(1, [TransferEntry("", "q", b"x", {"h": [1]})]), MALFORMED, "headers must map strings to scalars"),  # type: ignore[dict-item]
    ("header key not a string", Transfer(1, [TransferEntry("", "q", b"x", {1: "v"})]), MALFORMED, "headers must map"),  # type: ignore[dict-item]
    ("producer id not a string", Transfer(1, [("", "q", b"x", None, 5, None)]), MALFORMED, "producer_id"),  # type: ignore[list-item]
    ("negative sequence", Transfer(1, [("", "q", b"x", None, "p", -1)]), MALFORMED, "sequence"),  # type: ignore[list-item]
    ("queue name too long", DeclareQueue(1, "q" * 256), MALFORMED, "field queue: expected a name of at most 255"),
    ("settle range reversed", Settle(Outcome.ACK, [(3, 2)]), MALFORMED, "bad range"),
    ("settle range from 0", Settle(Outcome.ACK, [(0, 2)]), MALFORMED, "bad range"),
    ("too many ranges", Settle(Outcome.ACK, [(i, i) for i in range(1, MAX_RANGES_PER_FRAME + 2)]), LIMIT, "MAX_RANGES_PER_FRAME"),
    ("outcome not an Outcome", Settle(7, [(1, 1)]), MALFORMED, "not a valid Outcome"),  # type: ignore[arg-type]
    ("negative prefetch", Subscribe(1, 1, "q", -1, 0), MALFORMED, "field prefetch"),
    ("acked position a float", BufferAck(0, 0, 1.5), MALFORMED, "field acked_position"),  # type: ignore[arg-type]
    ("nonce negative", Noop(-1, False), MALFORMED, "field nonce"),
    ("reply not a boolean", Noop(1, 1), MALFORMED, "field reply"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("frame", "code", "text"), [c[1:] for c in INVALID_CLIENT_FRAMES], ids=[c[0] for c in INVALID_CLIENT_FRAMES])
def test_an_invalid_frame_is_refused_locally_and_the_connection_goes_on(frame: Frame, code: ErrorCode, text: str) -> None:
    pair = open_pair()
    client = pair.client
    sent = client.frames_sent
    with pytest.raises(LocalProtocolError, match=text) as info:
        client.send(frame)
    assert info.value.code == code
    assert f"{frame.TYPE.name} frame" in str(info.value)
    assert client.frames_sent == sent
    # What send refuses, the peer's decoder refuses too, with the same code: one set of checks.
    with pytest.raises(RemoteProtocolError) as remote:
        decode_body([int(frame.TYPE), *frame_to_wire(frame)[1:]], 1)
    assert remote.value.code == code
    # The connection is still usable.
    assert pair.exchange(Role.CLIENT, Transfer(1, [ENTRY])) == [Transfer(1, [TransferEntry("", "q", b"body")])]  # type: ignore[list-item]


def test_the_broker_side_is_checked_too() -> None:
    pair = open_pair()
    with pytest.raises(LocalProtocolError, match="delivery_tag must be a positive integer"):
        pair.broker.send(Deliver(1, [(0, "", "q", b"x", None, False)]))  # type: ignore[list-item]
    with pytest.raises(LocalProtocolError, match="each entry must be"):
        pair.broker.send(Deliver(1, [(1, "", "q", b"x", None)]))  # type: ignore[list-item]


def test_an_object_that_is_not_a_frame_is_refused() -> None:
    with pytest.raises(LocalProtocolError, match="is not a frame"):
        check_frame("HELLO")  # type: ignore[arg-type]


CLIENT_TYPES = {
    FrameType.DECLARE_QUEUE, FrameType.DECLARE_EXCHANGE, FrameType.BIND, FrameType.UNBIND, FrameType.DELETE_QUEUE,
    FrameType.PURGE_QUEUE, FrameType.DELETE_EXCHANGE, FrameType.TRANSFER, FrameType.BUFFER_CONTROL,
    FrameType.BUFFER_ACK, FrameType.BUFFER_LIMIT, FrameType.SUBSCRIBE, FrameType.CANCEL, FrameType.SETTLE, FrameType.NOOP, FrameType.ERROR,
    FrameType.REGISTER_PUBLICATION, FrameType.CLOSE_PUBLICATION, FrameType.SUBSCRIBE_UDP,
    FrameType.JOIN_GROUP,
}


@pytest.mark.parametrize("ftype", sorted(CLIENT_TYPES), ids=lambda t: t.name)
@settings(max_examples=30, deadline=None)
@given(data=__import__("hypothesis").strategies.data())
def test_every_valid_frame_is_sent_and_arrives_unchanged(ftype: FrameType, data: Any) -> None:
    frame = data.draw(FRAME_STRATEGIES[ftype])
    pair = open_pair()
    assert pair.exchange(Role.CLIENT, frame) == [frame]
