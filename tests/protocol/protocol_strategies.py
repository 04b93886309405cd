"""Hypothesis strategies and fixed samples for every flowbroker frame type (test helper, not a test)."""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import assume
from hypothesis import strategies as st

from flowbroker.protocol import (
    AuthChallenge,
    AuthResponse,
    Bind,
    BufferAck,
    BufferControl,
    BufferLimit,
    Cancel,
    Close,
    ClosePublication,
    Complete,
    DeclareExchange,
    DeclareQueue,
    DeleteExchange,
    DeleteQueue,
    Deliver,
    DeliveryEntry,
    Error,
    ErrorCode,
    FlowResumed,
    FlowStopped,
    Frame,
    FrameDecoder,
    FrameType,
    Hello,
    JoinGroup,
    Noop,
    Ok,
    Outcome,
    PurgeQueue,
    RegisterPublication,
    RemoteProtocolError,
    Settle,
    Subscribe,
    SubscribeUdp,
    Transfer,
    TransferEntry,
    Unbind,
    Welcome,
    frame_to_wire,
)
from flowbroker.protocol.codec import LENGTH_PREFIX

U64 = 2**64 - 1
I64_MIN = -(2**63)

u64 = st.integers(0, U64)
int32 = st.integers(-(2**31), 2**31 - 1)  # Aeron stream and session ids
ports = st.integers(1, 65535)
pos64 = st.integers(1, U64)
# msgpack cannot carry surrogates; hypothesis' default text alphabet has none.
text = st.text(max_size=40)
names = st.text(max_size=255)
long_names = st.text(min_size=200, max_size=255)
msgpack_ints = st.integers(I64_MIN, U64)
floats = st.floats(allow_nan=False)  # NaN != NaN would spoil the round-trip comparison
scalars = st.one_of(st.none(), st.booleans(), msgpack_ints, floats, text, st.binary(max_size=40))
headers = st.one_of(st.none(), st.dictionaries(text, scalars, max_size=5))
plain_values = st.recursive(
    scalars, lambda children: st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4), max_leaves=20
)
plain_maps = st.dictionaries(text, plain_values, max_size=5)
ranges = st.lists(
    st.tuples(pos64, st.integers(0, 1000)).map(lambda t: (t[0], min(U64, t[0] + t[1]))), max_size=5
)
error_codes = st.sampled_from(list(ErrorCode))

transfer_entries = st.builds(
    TransferEntry,
    exchange=names,
    routing_key=names,
    body=st.binary(max_size=200),
    headers=headers,
    producer_id=st.one_of(st.none(), text),
    sequence=st.one_of(st.none(), u64),
)
delivery_entries = st.builds(
    DeliveryEntry,
    delivery_tag=pos64,
    exchange=names,
    routing_key=names,
    body=st.binary(max_size=200),
    headers=headers,
    redelivered=st.booleans(),
)

FRAME_STRATEGIES: dict[FrameType, st.SearchStrategy[Any]] = {
    FrameType.HELLO: st.builds(
        Hello,
        version=u64,
        client_name=text,
        flow_control=st.booleans(),
        capabilities=st.lists(text, max_size=4),
        auth=st.one_of(st.none(), plain_maps),
    ),
    FrameType.WELCOME: st.builds(
        Welcome,
        version=u64,
        connection_id=u64,
        server_name=text,
        max_frame_size=u64,
        max_message_size=u64,
        idle_timeout_ms=u64,
        buffer_size=u64,
        identity=text,
        auth_data=st.one_of(st.none(), st.binary(max_size=200)),
    ),
    FrameType.DECLARE_QUEUE: st.builds(
        DeclareQueue,
        request_id=u64,
        queue=names,
        durable=st.booleans(),
        arguments=st.one_of(st.none(), plain_maps),
    ),
    FrameType.DECLARE_EXCHANGE: st.builds(
        DeclareExchange, request_id=u64, exchange=names, kind=st.sampled_from(["direct", "fanout", "topic"])
    ),
    FrameType.BIND: st.builds(Bind, request_id=u64, queue=names, exchange=names, binding_key=names),
    FrameType.UNBIND: st.builds(Unbind, request_id=u64, queue=names, exchange=names, binding_key=names),
    FrameType.DELETE_QUEUE: st.builds(DeleteQueue, request_id=u64, queue=names),
    FrameType.PURGE_QUEUE: st.builds(PurgeQueue, request_id=u64, queue=names),
    FrameType.DELETE_EXCHANGE: st.builds(DeleteExchange, request_id=u64, exchange=names),
    FrameType.OK: st.builds(Ok, request_id=u64, result=plain_maps),
    FrameType.TRANSFER: st.builds(
        Transfer, first_id=pos64, entries=st.lists(transfer_entries, min_size=1, max_size=5)
    ),
    FrameType.COMPLETE: st.builds(Complete, cumulative_id=u64, ranges=ranges),
    FrameType.BUFFER_CONTROL: st.builds(BufferControl, opaque=u64, buffer_size=u64),
    FrameType.BUFFER_ACK: st.builds(BufferAck, opaque=u64, freed=u64, acked_position=u64),
    FrameType.BUFFER_LIMIT: st.builds(BufferLimit, control=pos64, size=pos64, limit=u64),
    FrameType.FLOW_STOPPED: st.builds(
        FlowStopped, destination=names, threshold=text, limit=u64, value=u64, reason=text
    ),
    FrameType.FLOW_RESUMED: st.builds(FlowResumed, destination=names),
    FrameType.SUBSCRIBE: st.builds(
        Subscribe, request_id=u64, subscription_id=u64, queue=names, prefetch=u64, buffer_size=u64
    ),
    FrameType.CANCEL: st.builds(Cancel, request_id=u64, subscription_id=u64),
    FrameType.DELIVER: st.builds(
        Deliver, subscription_id=u64, entries=st.lists(delivery_entries, min_size=1, max_size=5)
    ),
    FrameType.SETTLE: st.builds(Settle, outcome=st.sampled_from(list(Outcome)), ranges=ranges),
    FrameType.NOOP: st.builds(Noop, nonce=u64, reply=st.booleans()),
    FrameType.ERROR: st.builds(
        Error,
        code=error_codes,
        text=text,
        frame_seq=st.one_of(st.none(), u64),
        ref_id=st.one_of(st.none(), u64),
        destination=st.one_of(st.none(), text),
        session_id=st.one_of(st.none(), int32),
    ),
    FrameType.CLOSE: st.builds(Close, code=error_codes, reason=text),
    FrameType.REGISTER_PUBLICATION: st.builds(
        RegisterPublication, request_id=u64, exchange=names, routing_key=text, stream_id=int32, source_port=ports
    ),
    FrameType.CLOSE_PUBLICATION: st.builds(ClosePublication, request_id=u64, session_id=int32),
    FrameType.SUBSCRIBE_UDP: st.builds(
        SubscribeUdp, request_id=u64, subscription_id=u64, queue=names, prefetch=u64, buffer_size=u64, port=ports,
        stream_id=int32,
    ),
    FrameType.JOIN_GROUP: st.builds(
        JoinGroup, request_id=u64, subscription_id=u64, exchange=names, group=names, endpoint=text, fc=text,
        buffer_size=u64, receiver_id=int32, stream_id=int32,
    ),
    FrameType.AUTH_CHALLENGE: st.builds(AuthChallenge, data=st.binary(max_size=1024)),
    FrameType.AUTH_RESPONSE: st.builds(AuthResponse, data=st.binary(max_size=1024)),
}

any_frame: st.SearchStrategy[Frame] = st.one_of(*FRAME_STRATEGIES.values())

# One valid frame of each type, for tests that enumerate types rather than sample values.
SAMPLES: dict[FrameType, Frame] = {
    FrameType.HELLO: Hello(1, "test-client", True, ["flow-control"], {"user": "u"}),
    FrameType.WELCOME: Welcome(1, 7, "test-broker", 1 << 20, 1 << 19, 30_000, 10 << 20, "anonymous"),
    FrameType.DECLARE_QUEUE: DeclareQueue(1, "q", False, {"flow_stop_count": 10}),
    FrameType.DECLARE_EXCHANGE: DeclareExchange(2, "x", "topic"),
    FrameType.BIND: Bind(3, "q", "x", "a.*"),
    FrameType.UNBIND: Unbind(4, "q", "x", "a.*"),
    FrameType.DELETE_QUEUE: DeleteQueue(5, "q"),
    FrameType.PURGE_QUEUE: PurgeQueue(6, "q"),
    FrameType.DELETE_EXCHANGE: DeleteExchange(23, "ex"),
    FrameType.OK: Ok(1, {"depth": 0}),
    FrameType.TRANSFER: Transfer(1, [TransferEntry("", "q", b"hello", {"k": "v"}, "p1", 0)]),
    FrameType.COMPLETE: Complete(1, [(3, 4)]),
    FrameType.BUFFER_CONTROL: BufferControl(0, 1 << 20),
    FrameType.BUFFER_ACK: BufferAck(0, 100, 100),
    FrameType.BUFFER_LIMIT: BufferLimit(2, 1 << 19, 1 << 20),
    FrameType.FLOW_STOPPED: FlowStopped("q", "flow_stop_count", 10, 11, "queue over its stop threshold"),
    FrameType.FLOW_RESUMED: FlowResumed("q"),
    FrameType.SUBSCRIBE: Subscribe(7, 1, "q", 100, 1 << 20),
    FrameType.CANCEL: Cancel(8, 1),
    FrameType.DELIVER: Deliver(1, [DeliveryEntry(1, "", "q", b"hello", None, False)]),
    FrameType.SETTLE: Settle(Outcome.ACK, [(1, 1)]),
    FrameType.NOOP: Noop(1, False),
    FrameType.ERROR: Error(ErrorCode.QUEUE_FULL, "queue q is full", 2, 1, "q"),
    FrameType.CLOSE: Close(ErrorCode.NORMAL, "bye"),
    FrameType.REGISTER_PUBLICATION: RegisterPublication(9, "", "q", 1001, 40123),
    FrameType.CLOSE_PUBLICATION: ClosePublication(10, -12345),
    FrameType.SUBSCRIBE_UDP: SubscribeUdp(11, 2, "q", 100, 1 << 20, 40124, 1002),
    FrameType.JOIN_GROUP: JoinGroup(12, 3, "fan", "fan.group", "239.1.2.3:40456", "min", 1 << 20, 77, 1003),
    FrameType.AUTH_CHALLENGE: AuthChallenge(b"r=abc,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"),
    FrameType.AUTH_RESPONSE: AuthResponse(b"c=biws,r=abc,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="),
}


def raw_frame(obj: Any) -> bytes:
    """A length-prefixed frame whose body is `obj` packed as msgpack, whatever it is (no validation)."""
    return raw_body(msgpack.packb(obj, use_bin_type=True, datetime=False))


def raw_body(body: bytes) -> bytes:
    """A length-prefixed frame around arbitrary body bytes."""
    return LENGTH_PREFIX.pack(len(body)) + body


bad_values = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**64 - 1), st.floats(allow_nan=False),
                       st.text(max_size=4), st.binary(max_size=4), st.just([]), st.just({}), st.just({"h": [1]}))
"""Values no entry field may hold in some place: what `mutated_entries_body` puts into an entry."""


def mutated_entries_body(wire: Any, data: st.DataObject) -> bytes:
    """The msgpack body of `wire` (a TRANSFER or DELIVER as plain lists) with one of its entries spoiled: a
    field replaced by a `bad_values` value, a field dropped, one added, or the entry replaced whole. A wire
    msgpack cannot pack is not an example (`assume`)."""
    which = data.draw(st.integers(0, len(wire[2]) - 1))
    entry = wire[2][which]
    how = data.draw(st.sampled_from(["field", "drop", "add", "replace"]))
    if how == "field":
        entry[data.draw(st.integers(0, 5))] = data.draw(bad_values)
    elif how == "drop":
        del entry[data.draw(st.integers(0, 5))]
    elif how == "add":
        entry.append(data.draw(bad_values))
    else:
        wire[2][which] = data.draw(bad_values)
    try:
        body: bytes = msgpack.packb(wire, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        assume(False)
        raise
    return body


def decode_frames(data: bytes, build_transfers: bool = True, build_deliveries: bool = True
                  ) -> tuple[list[Frame], tuple[str, int | None] | None]:
    """Every frame in `data` decoded with the decoder's switches as given (whether TRANSFER and DELIVER
    entries become NamedTuples or stay msgpack's lists), and the error that stopped decoding (its code name
    and frame_seq)."""
    decoder = FrameDecoder(max_frame_size=1 << 16)
    decoder.build_transfers = build_transfers
    decoder.build_deliveries = build_deliveries
    decoder.feed(data)
    frames: list[Frame] = []
    try:
        while (frame := decoder.next_frame()) is not None:
            frames.append(frame)
    except RemoteProtocolError as err:
        return frames, (err.code.name, err.frame_seq)
    return frames, None


def plain(frame: Frame) -> Any:
    """A frame's wire value with its entries as lists, whatever they were built as."""
    return msgpack.unpackb(msgpack.packb(frame_to_wire(frame), use_bin_type=True), raw=False)


def assert_spoiled_entries_refused_alike(frame: Frame, data: st.DataObject, switch: str) -> None:
    """`frame` (a TRANSFER or DELIVER) with one entry spoiled (`mutated_entries_body`) decodes to the same
    error and the same frames whether the decoder's `switch` ("build_transfers" or "build_deliveries")
    builds its entries or keeps msgpack's lists."""
    body = raw_body(mutated_entries_body(plain(frame), data))
    built = decode_frames(body, **{switch: True})
    kept = decode_frames(body, **{switch: False})
    assert built[1] == kept[1]
    assert [plain(f) for f in built[0]] == [plain(f) for f in kept[0]]
