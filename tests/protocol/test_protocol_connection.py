"""The connection state machine: handshake, direction, close (per direction), EOF, ERROR."""

from __future__ import annotations

import pytest
from tests.protocol.pair import ConnectionPair
from tests.protocol.protocol_strategies import SAMPLES

from flowbroker.protocol import (
    PROTOCOL_VERSION,
    Close,
    Complete,
    Connection,
    Deliver,
    Error,
    ErrorCode,
    FrameDecoder,
    FrameTooLarge,
    FrameType,
    Hello,
    LocalProtocolError,
    Noop,
    RemoteProtocolError,
    Role,
    State,
    Welcome,
    frame_to_wire,
    encode_frame,
)

# Who may send what once the connection is OPEN (docs/protocol.md), written out independently.
CLIENT_SENDS = {
    FrameType.DECLARE_QUEUE,
    FrameType.DECLARE_EXCHANGE,
    FrameType.BIND,
    FrameType.UNBIND,
    FrameType.DELETE_QUEUE,
    FrameType.PURGE_QUEUE,
    FrameType.DELETE_EXCHANGE,
    FrameType.TRANSFER,
    FrameType.BUFFER_CONTROL,
    FrameType.BUFFER_ACK,
    FrameType.BUFFER_LIMIT,
    FrameType.SUBSCRIBE,
    FrameType.CANCEL,
    FrameType.SETTLE,
    FrameType.REGISTER_PUBLICATION,
    FrameType.CLOSE_PUBLICATION,
    FrameType.SUBSCRIBE_UDP,
    FrameType.JOIN_GROUP,
    FrameType.NOOP,
    FrameType.ERROR,
    FrameType.CLOSE,
}
BROKER_SENDS = {
    FrameType.OK,
    FrameType.COMPLETE,
    FrameType.BUFFER_CONTROL,
    FrameType.BUFFER_ACK,
    FrameType.FLOW_STOPPED,
    FrameType.FLOW_RESUMED,
    FrameType.DELIVER,
    FrameType.NOOP,
    FrameType.ERROR,
    FrameType.CLOSE,
}
OPEN_SENDS = {Role.CLIENT: CLIENT_SENDS, Role.BROKER: BROKER_SENDS}
ALL_TYPES = list(FrameType)
BYE = Close(ErrorCode.NORMAL, "bye")


def other(role: Role) -> Role:
    return Role.BROKER if role is Role.CLIENT else Role.CLIENT


def expect_remote(pair: ConnectionPair, role: Role, code: ErrorCode, seq: int) -> RemoteProtocolError:
    """Deliver what `role` sent; its peer must fail with `code` at frame `seq` and move to ERROR."""
    with pytest.raises(RemoteProtocolError) as info:
        pair.deliver(role)
    assert info.value.code is code
    assert info.value.frame_seq == seq
    assert pair.peer(role).state is State.ERROR
    return info.value


# --- handshake ----------------------------------------------------------------------------------


def test_handshake() -> None:
    pair = ConnectionPair()
    assert (pair.client.state, pair.broker.state) == (State.AWAIT_HELLO, State.AWAIT_HELLO)
    pair.exchange(Role.CLIENT, Hello(PROTOCOL_VERSION, "c", True, ["x"]))
    assert (pair.client.state, pair.broker.state) == (State.AWAIT_WELCOME, State.AWAIT_WELCOME)
    pair.exchange(Role.BROKER, SAMPLES[FrameType.WELCOME])
    assert (pair.client.state, pair.broker.state) == (State.OPEN, State.OPEN)
    assert pair.client.frames_sent == 1 and pair.client.frames_received == 1
    assert pair.broker.frames_sent == 1 and pair.broker.frames_received == 1


@pytest.mark.parametrize("ftype", [t for t in ALL_TYPES if t is not FrameType.HELLO], ids=lambda t: t.name)
def test_hello_must_come_first(ftype: FrameType) -> None:
    pair = ConnectionPair()
    with pytest.raises(LocalProtocolError) as info:
        pair.client.send(SAMPLES[ftype])
    assert info.value.code is ErrorCode.UNEXPECTED_FRAME
    assert pair.client.state is State.AWAIT_HELLO  # a refused send changes nothing
    with pytest.raises(LocalProtocolError):
        pair.broker.send(SAMPLES[ftype])  # the broker speaks only after HELLO
    pair.inject(Role.CLIENT, encode_frame(SAMPLES[ftype]))
    expect_remote(pair, Role.CLIENT, ErrorCode.UNEXPECTED_FRAME, 1)


def test_client_waits_for_welcome_before_anything_else() -> None:
    pair = ConnectionPair()
    pair.exchange(Role.CLIENT, Hello(PROTOCOL_VERSION, "c", True, []))
    for ftype in ALL_TYPES:
        if ftype not in (FrameType.CLOSE, FrameType.AUTH_RESPONSE):
            with pytest.raises(LocalProtocolError):
                pair.client.send(SAMPLES[ftype])
    # A client that pipelines anyway is refused by the broker.
    pair.inject(Role.CLIENT, encode_frame(SAMPLES[FrameType.TRANSFER]))
    expect_remote(pair, Role.CLIENT, ErrorCode.UNEXPECTED_FRAME, 2)


def test_hello_twice_and_welcome_twice_are_refused() -> None:
    pair = ConnectionPair()
    pair.handshake()
    with pytest.raises(LocalProtocolError):
        pair.client.send(SAMPLES[FrameType.HELLO])
    with pytest.raises(LocalProtocolError):
        pair.broker.send(SAMPLES[FrameType.WELCOME])
    pair.inject(Role.BROKER, encode_frame(SAMPLES[FrameType.WELCOME]))
    expect_remote(pair, Role.BROKER, ErrorCode.UNEXPECTED_FRAME, 2)


def test_authentication_exchanges_challenges_and_responses_before_welcome() -> None:
    """AUTH_CHALLENGE and AUTH_RESPONSE only between HELLO and WELCOME, each from its own side."""
    pair = ConnectionPair()
    with pytest.raises(LocalProtocolError):
        pair.client.send(SAMPLES[FrameType.AUTH_RESPONSE])  # before HELLO
    pair.exchange(Role.CLIENT, Hello(PROTOCOL_VERSION, "c", True, [], {"mechanism": "SCRAM-SHA-256"}))
    with pytest.raises(LocalProtocolError):
        pair.client.send(SAMPLES[FrameType.AUTH_CHALLENGE])  # the wrong direction
    with pytest.raises(LocalProtocolError):
        pair.broker.send(SAMPLES[FrameType.AUTH_RESPONSE])
    assert pair.exchange(Role.BROKER, SAMPLES[FrameType.AUTH_CHALLENGE]) == [SAMPLES[FrameType.AUTH_CHALLENGE]]
    assert pair.exchange(Role.CLIENT, SAMPLES[FrameType.AUTH_RESPONSE]) == [SAMPLES[FrameType.AUTH_RESPONSE]]
    welcome = Welcome(PROTOCOL_VERSION, 1, "b", 1 << 20, 1 << 19, 30_000, 0, "alice", b"v=xyz")
    assert pair.exchange(Role.BROKER, welcome) == [welcome]
    for role, ftype in ((Role.CLIENT, FrameType.AUTH_RESPONSE), (Role.BROKER, FrameType.AUTH_CHALLENGE)):
        with pytest.raises(LocalProtocolError):  # once OPEN, neither
            (pair.client if role is Role.CLIENT else pair.broker).send(SAMPLES[ftype])


def test_a_welcome_without_auth_data_has_the_eight_fields_older_clients_decode() -> None:
    wire = frame_to_wire(SAMPLES[FrameType.WELCOME])
    assert len(wire) == 9 and wire[-1] == "anonymous"


def test_client_may_give_up_before_welcome() -> None:
    pair = ConnectionPair()
    pair.exchange(Role.CLIENT, Hello(PROTOCOL_VERSION, "c", True, []), BYE)
    assert pair.client.closed_by_us and pair.broker.closed_by_peer
    assert pair.client.state is State.CLOSED and pair.broker.state is State.CLOSED


def test_broker_refuses_hello_with_error_and_close() -> None:
    pair = ConnectionPair()
    pair.exchange(Role.CLIENT, Hello(PROTOCOL_VERSION, "c", True, []))
    refusal = Error(ErrorCode.UNAUTHORIZED, "who are you", 1)
    pair.exchange(Role.BROKER, refusal, BYE)
    assert pair.client.state is State.CLOSED and pair.client.closed_by_peer


# --- version ------------------------------------------------------------------------------------


def test_client_cannot_send_an_unsupported_version() -> None:
    pair = ConnectionPair()
    with pytest.raises(LocalProtocolError) as info:
        pair.client.send(Hello(PROTOCOL_VERSION + 1, "c", True, []))
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION
    assert pair.client.state is State.AWAIT_HELLO


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 2**64 - 1])
def test_broker_refuses_unsupported_version_and_can_say_so(version: int) -> None:
    pair = ConnectionPair()
    pair.inject(Role.CLIENT, encode_frame(Hello(version, "c", True, [])))
    err = expect_remote(pair, Role.CLIENT, ErrorCode.UNSUPPORTED_VERSION, 1)
    # The broker is in ERROR but may still tell the client why, then close. (The client here is of
    # another version, so read the answer with a bare decoder rather than our client.)
    pair.send(Role.BROKER, Error(err.code, str(err), err.frame_seq), Close(err.code, str(err)))
    decoder = FrameDecoder()
    decoder.feed(pair.take(Role.BROKER))
    received = [decoder.next_frame(), decoder.next_frame()]
    assert [type(f) for f in received] == [Error, Close]
    assert received[0].code is ErrorCode.UNSUPPORTED_VERSION  # type: ignore[union-attr]
    assert received[0].frame_seq == 1  # type: ignore[union-attr]
    assert pair.broker.state is State.ERROR and pair.broker.closed_by_us


def test_client_refuses_welcome_with_another_version() -> None:
    pair = ConnectionPair()
    pair.exchange(Role.CLIENT, Hello(PROTOCOL_VERSION, "c", True, []))
    with pytest.raises(LocalProtocolError) as info:
        pair.broker.send(Welcome(PROTOCOL_VERSION + 1, 1, "b", 1 << 20, 1 << 20, 1000, 0, "anonymous"))
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION
    pair.inject(Role.BROKER, encode_frame(Welcome(PROTOCOL_VERSION + 1, 1, "b", 1 << 20, 1 << 20, 1000, 0, "")))
    expect_remote(pair, Role.BROKER, ErrorCode.UNSUPPORTED_VERSION, 1)


# --- direction ----------------------------------------------------------------------------------


@pytest.mark.parametrize("role", [Role.CLIENT, Role.BROKER], ids=lambda r: r.value)
@pytest.mark.parametrize("ftype", ALL_TYPES, ids=lambda t: t.name)
def test_direction_when_open(role: Role, ftype: FrameType) -> None:
    pair = ConnectionPair()
    pair.handshake()
    frame = SAMPLES[ftype]
    if ftype in OPEN_SENDS[role]:
        assert pair.exchange(role, frame) == [frame]
        assert pair.conn(role).state is State.OPEN or ftype is FrameType.CLOSE
        return
    with pytest.raises(LocalProtocolError) as info:
        pair.conn(role).send(frame)
    assert info.value.code is ErrorCode.UNEXPECTED_FRAME
    assert info.value.frame_seq is None
    assert pair.conn(role).state is State.OPEN
    # The same frame from a misbehaving peer: a remote error naming its position.
    pair.send(role, Noop(1, False))
    pair.inject(role, encode_frame(frame))
    err = expect_remote(pair, role, ErrorCode.UNEXPECTED_FRAME, 3)
    assert ftype.name in str(err)


def test_client_may_not_deliver_and_broker_may_not_transfer() -> None:
    pair = ConnectionPair()
    pair.handshake()
    with pytest.raises(LocalProtocolError):
        pair.client.send(SAMPLES[FrameType.DELIVER])
    with pytest.raises(LocalProtocolError):
        pair.broker.send(SAMPLES[FrameType.TRANSFER])


# --- close --------------------------------------------------------------------------------------


@pytest.mark.parametrize("closer", [Role.CLIENT, Role.BROKER], ids=lambda r: r.value)
def test_nothing_after_close(closer: Role) -> None:
    pair = ConnectionPair()
    pair.handshake()
    pair.exchange(closer, BYE)
    assert pair.conn(closer).closed_by_us and not pair.conn(closer).closed_by_peer
    assert pair.peer(closer).closed_by_peer and not pair.peer(closer).closed_by_us
    assert pair.client.state is State.CLOSED and pair.broker.state is State.CLOSED
    for ftype in ALL_TYPES:
        with pytest.raises(LocalProtocolError):
            pair.conn(closer).send(SAMPLES[ftype])
    pair.inject(closer, encode_frame(Noop(9, False)))
    expect_remote(pair, closer, ErrorCode.UNEXPECTED_FRAME, 3)  # HELLO or WELCOME, CLOSE, NOOP


def test_close_handshake_with_frames_in_flight() -> None:
    """The client closes while the broker still has completions on the wire: they arrive, and the
    broker may flush what is due and answer with its own CLOSE."""
    pair = ConnectionPair()
    pair.handshake()
    pair.send(Role.CLIENT, SAMPLES[FrameType.TRANSFER])
    pair.deliver(Role.CLIENT)
    pair.send(Role.BROKER, Complete(1, []))  # crosses the client's CLOSE
    pair.send(Role.CLIENT, BYE)
    assert pair.deliver(Role.BROKER) == [Complete(1, [])]
    assert pair.deliver(Role.CLIENT) == [BYE]
    # The broker has seen CLOSE; it may still send what it could while open, then its own CLOSE.
    with pytest.raises(LocalProtocolError):
        pair.broker.send(SAMPLES[FrameType.TRANSFER])  # direction still applies
    pair.send(Role.BROKER, Complete(1, [(3, 3)]), BYE)
    assert pair.deliver(Role.BROKER) == [Complete(1, [(3, 3)]), BYE]
    for conn in (pair.client, pair.broker):
        assert conn.closed_by_us and conn.closed_by_peer and conn.state is State.CLOSED
    with pytest.raises(LocalProtocolError):
        pair.broker.send(Noop(1, False))


def test_simultaneous_close() -> None:
    pair = ConnectionPair()
    pair.handshake()
    pair.send(Role.CLIENT, BYE)
    pair.send(Role.BROKER, Close(ErrorCode.SHUTDOWN, "stopping"))
    assert pair.deliver(Role.CLIENT) == [BYE]
    assert pair.deliver(Role.BROKER) == [Close(ErrorCode.SHUTDOWN, "stopping")]
    for conn in (pair.client, pair.broker):
        assert conn.closed_by_us and conn.closed_by_peer and conn.state is State.CLOSED


# --- EOF ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("opened", [False, True])
def test_eof_moves_to_closed(opened: bool) -> None:
    pair = ConnectionPair()
    if opened:
        pair.handshake()
    assert pair.deliver(Role.CLIENT, eof=True) == []
    assert pair.broker.state is State.CLOSED and pair.broker.closed_by_peer
    assert not pair.broker.closed_by_us
    assert pair.broker.next_frame() is None  # and stays there


def test_frames_before_eof_are_delivered() -> None:
    pair = ConnectionPair()
    pair.handshake()
    pair.send(Role.CLIENT, Noop(1, False), BYE)
    assert pair.deliver(Role.CLIENT, eof=True) == [Noop(1, False), BYE]
    assert pair.broker.state is State.CLOSED


def test_eof_inside_a_frame_is_an_error() -> None:
    pair = ConnectionPair()
    pair.handshake()
    pair.inject(Role.CLIENT, encode_frame(Noop(1, False))[:-1])
    assert pair.deliver(Role.CLIENT) == []
    with pytest.raises(RemoteProtocolError) as info:
        pair.deliver(Role.CLIENT, eof=True)
    assert info.value.code is ErrorCode.MALFORMED_FRAME and info.value.frame_seq == 2
    assert pair.broker.state is State.ERROR


# --- ERROR --------------------------------------------------------------------------------------


def test_error_state_refuses_further_receiving_but_lets_us_say_why() -> None:
    pair = ConnectionPair()
    pair.handshake()
    pair.inject(Role.CLIENT, b"\x00\x00\x00\x01\xc1")  # a one-byte frame that is not msgpack
    err = expect_remote(pair, Role.CLIENT, ErrorCode.MALFORMED_FRAME, 2)
    broker = pair.broker
    with pytest.raises(LocalProtocolError):
        broker.next_frame()
    broker.receive_data(encode_frame(Noop(1, False)))
    with pytest.raises(LocalProtocolError):
        broker.next_frame()
    with pytest.raises(LocalProtocolError):
        broker.send(SAMPLES[FrameType.TRANSFER])  # direction still applies
    # What was due may still go out, then the reason and CLOSE; then nothing.
    pair.send(Role.BROKER, Complete(0, []), Error(err.code, str(err), err.frame_seq), Close(err.code, "bye"))
    assert [f.TYPE for f in pair.deliver(Role.BROKER)] == [FrameType.COMPLETE, FrameType.ERROR, FrameType.CLOSE]
    assert broker.state is State.ERROR and broker.closed_by_us
    with pytest.raises(LocalProtocolError):
        broker.send(Error(err.code, "again"))


def test_error_frame_seq_counts_the_peers_frames() -> None:
    pair = ConnectionPair()
    pair.handshake()
    pair.send(Role.CLIENT, *[Noop(i, False) for i in range(5)])
    pair.inject(Role.CLIENT, encode_frame(SAMPLES[FrameType.DELIVER]))
    expect_remote(pair, Role.CLIENT, ErrorCode.UNEXPECTED_FRAME, 7)  # HELLO + 5 NOOPs + DELIVER
    assert pair.broker.frames_received == 7


# --- max frame size -----------------------------------------------------------------------------


def test_negotiated_max_frame_size_applies_to_received_frames() -> None:
    pair = ConnectionPair()
    pair.handshake(max_frame_size=128)
    assert pair.client.max_frame_size == 128 and pair.broker.max_frame_size == 128
    sample = SAMPLES[FrameType.DELIVER]
    assert isinstance(sample, Deliver)
    big = Deliver(1, [sample.entries[0]._replace(body=b"x" * 200)])
    pair.send(Role.BROKER, big)
    with pytest.raises(FrameTooLarge) as info:
        pair.deliver(Role.BROKER)
    assert info.value.frame_seq == 2 and info.value.limit == 128
    assert pair.client.state is State.ERROR
    with pytest.raises(ValueError):
        Connection(Role.CLIENT).set_max_frame_size(10)


def test_a_frame_over_the_control_limit_before_welcome_is_refused_from_its_prefix() -> None:
    """Only control frames come before WELCOME: a larger one is UNEXPECTED_FRAME from its 4-byte length
    prefix, and the broker may then say so (ERROR, CLOSE): raised in the shell instead, the state machine
    refused the ERROR and the socket just closed (a tester)."""
    import struct

    pair = ConnectionPair()
    pair.inject(Role.CLIENT, struct.pack(">I", 64 * 1024 + 1) + b"\x93\x0a\x01")
    expect_remote(pair, Role.CLIENT, ErrorCode.UNEXPECTED_FRAME, 1)
    assert pair.broker.state is State.ERROR
    pair.broker.send(Error(ErrorCode.UNEXPECTED_FRAME, "refused", 1))  # allowed after the error
    pair.broker.send(Close(ErrorCode.UNEXPECTED_FRAME, "refused"))
    # after HELLO, before WELCOME: the same
    pair = ConnectionPair()
    pair.exchange(Role.CLIENT, Hello(PROTOCOL_VERSION, "c", True, []))
    pair.inject(Role.CLIENT, struct.pack(">I", 8 * 1024 * 1024) + b"\x96\x0a")
    expect_remote(pair, Role.CLIENT, ErrorCode.UNEXPECTED_FRAME, 2)
