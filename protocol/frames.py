"""The frames of the flowbroker wire protocol, as frozen dataclasses.

On the wire each frame is a msgpack array `[type, field1, field2, ...]` in the field order of its
dataclass (see docs/protocol.md). Arrays rather than maps keep a batch of 100 transfers small and
fast to decode. One set of field checkers serves both directions, as in h11: `decode_body` applies them
to a received frame, so that nothing malformed reaches the broker (a `RemoteProtocolError` naming the
frame and field), and `check_frame` to a frame about to be sent, so that a caller's bug is caught on its
own side (a `LocalProtocolError`) instead of closing the connection from the other end.

Credit frames follow Couchbase DCP with one change: BUFFER_ACK carries the *absolute* number of
bytes acknowledged so far (`acked_position`) beside DCP's delta, so a lost, duplicated or reordered
acknowledgement can neither stall a sender nor let it overrun (see protocol/credit.py).
"""

from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, fields
from functools import partial
from typing import Any, Callable, ClassVar, NamedTuple, Union

from flowbroker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from flowbroker.protocol.limits import (
    MAX_ENTRIES_PER_FRAME,
    MAX_ERROR_TEXT,
    MAX_HEADERS,
    MAX_MAP_ITEMS,
    MAX_RANGES_PER_FRAME,
)

__all__ = [
    "FrameType",
    "Headers",
    "Range",
    "Outcome",
    "TransferEntry",
    "DeliveryEntry",
    "Hello",
    "Welcome",
    "DeclareQueue",
    "DeclareExchange",
    "Bind",
    "Unbind",
    "DeleteQueue",
    "PurgeQueue",
    "DeleteExchange",
    "Ok",
    "Transfer",
    "Complete",
    "BufferControl",
    "BufferAck",
    "BufferLimit",
    "FlowStopped",
    "FlowResumed",
    "Subscribe",
    "Cancel",
    "Deliver",
    "Settle",
    "Noop",
    "Error",
    "Close",
    "RegisterPublication",
    "ClosePublication",
    "SubscribeUdp",
    "JoinGroup",
    "AuthChallenge",
    "AuthResponse",
    "Frame",
    "PROTOCOL_VERSION",
    "decode_body",
    "check_frame",
    "check_headers",
    "check_delivery_entries",
    "check_delivery_entry",
    "frame_to_wire",
]

PROTOCOL_VERSION = 1

HeaderValue = Union[str, int, float, bool, bytes, None]
Headers = dict[str, HeaderValue]
Range = tuple[int, int]
"""An inclusive range of ids `(first, last)`."""


class FrameType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    DECLARE_QUEUE = 3
    DECLARE_EXCHANGE = 4
    BIND = 5
    UNBIND = 6
    DELETE_QUEUE = 7
    PURGE_QUEUE = 8
    OK = 9
    TRANSFER = 10
    COMPLETE = 11
    BUFFER_CONTROL = 12
    BUFFER_ACK = 13
    FLOW_STOPPED = 14
    FLOW_RESUMED = 15
    SUBSCRIBE = 16
    CANCEL = 17
    DELIVER = 18
    SETTLE = 19
    NOOP = 20
    ERROR = 21
    CLOSE = 22
    DELETE_EXCHANGE = 23
    REGISTER_PUBLICATION = 24
    CLOSE_PUBLICATION = 25
    SUBSCRIBE_UDP = 26
    JOIN_GROUP = 27
    AUTH_CHALLENGE = 28
    AUTH_RESPONSE = 29
    BUFFER_LIMIT = 40  # numbered apart from the 2x range, which other additions take


class Outcome(enum.IntEnum):
    """How a consumer settles deliveries (SETTLE frame)."""

    ACK = 0  # processed: dequeue
    REJECT = 1  # unprocessable: dequeue and discard
    REQUEUE = 2  # give it back: ready again, marked redelivered


class TransferEntry(NamedTuple):
    """One message in a TRANSFER frame. `producer_id`/`sequence` are carried for idempotent producers."""

    exchange: str
    routing_key: str
    body: bytes
    headers: Headers | None = None
    producer_id: str | None = None
    sequence: int | None = None


class DeliveryEntry(NamedTuple):
    """One message in a DELIVER frame; `delivery_tag` is positive, per connection and strictly increasing."""

    delivery_tag: int
    exchange: str
    routing_key: str
    body: bytes
    headers: Headers | None
    redelivered: bool


@dataclass(frozen=True, slots=True)
class Hello:
    """Client -> broker, first frame. `flow_control`: the client honours producer credit."""

    TYPE: ClassVar[FrameType] = FrameType.HELLO
    version: int
    client_name: str
    flow_control: bool
    capabilities: list[str]
    auth: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Welcome:
    """Broker -> client, answer to HELLO. `buffer_size` is the producer byte buffer (0 = not paced)."""

    TYPE: ClassVar[FrameType] = FrameType.WELCOME
    version: int
    connection_id: int
    server_name: str
    max_frame_size: int
    max_message_size: int
    idle_timeout_ms: int
    buffer_size: int
    identity: str
    auth_data: bytes | None = None  # SCRAM's server-final message (the broker's proof), else None
    run_id: str | None = None  # the broker process's run: another after a restart (a job can tell it lost memory)


@dataclass(frozen=True, slots=True)
class DeclareQueue:
    TYPE: ClassVar[FrameType] = FrameType.DECLARE_QUEUE
    request_id: int
    queue: str
    durable: bool = False
    arguments: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class DeclareExchange:
    TYPE: ClassVar[FrameType] = FrameType.DECLARE_EXCHANGE
    request_id: int
    exchange: str
    kind: str  # direct | fanout | topic


@dataclass(frozen=True, slots=True)
class Bind:
    TYPE: ClassVar[FrameType] = FrameType.BIND
    request_id: int
    queue: str
    exchange: str
    binding_key: str


@dataclass(frozen=True, slots=True)
class Unbind:
    TYPE: ClassVar[FrameType] = FrameType.UNBIND
    request_id: int
    queue: str
    exchange: str
    binding_key: str


@dataclass(frozen=True, slots=True)
class DeleteQueue:
    TYPE: ClassVar[FrameType] = FrameType.DELETE_QUEUE
    request_id: int
    queue: str


@dataclass(frozen=True, slots=True)
class PurgeQueue:
    TYPE: ClassVar[FrameType] = FrameType.PURGE_QUEUE
    request_id: int
    queue: str


@dataclass(frozen=True, slots=True)
class DeleteExchange:
    """Client -> broker: delete an exchange and its bindings (the queues stay)."""

    TYPE: ClassVar[FrameType] = FrameType.DELETE_EXCHANGE
    request_id: int
    exchange: str


@dataclass(frozen=True, slots=True)
class Ok:
    """Broker -> client: the request `request_id` succeeded; `result` holds what it returned."""

    TYPE: ClassVar[FrameType] = FrameType.OK
    request_id: int
    result: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Transfer:
    """Client -> broker: messages with transfer ids first_id, first_id + 1, ... (positive, contiguous per connection)."""

    TYPE: ClassVar[FrameType] = FrameType.TRANSFER
    first_id: int
    entries: list[TransferEntry]


@dataclass(frozen=True, slots=True)
class Complete:
    """Broker -> client: every transfer id <= `cumulative_id` is complete, and so are those in `ranges`."""

    TYPE: ClassVar[FrameType] = FrameType.COMPLETE
    cumulative_id: int
    ranges: list[Range]


@dataclass(frozen=True, slots=True)
class BufferControl:
    """Sets the byte buffer the *sender* of data may fill (DCP_CONTROL `connection_buffer_size`).

    Sent by whoever receives the data: the broker tells a producer its buffer, a consumer tells the broker.
    `opaque` 0 is the connection level; otherwise a subscription id (`stream_buffer_size`). 0 = no flow control.
    """

    TYPE: ClassVar[FrameType] = FrameType.BUFFER_CONTROL
    opaque: int
    buffer_size: int


@dataclass(frozen=True, slots=True)
class BufferAck:
    """The receiver of data frees buffer space. `acked_position` is absolute, `freed` the DCP-style delta."""

    TYPE: ClassVar[FrameType] = FrameType.BUFFER_ACK
    opaque: int
    freed: int
    acked_position: int


@dataclass(frozen=True, slots=True)
class BufferLimit:
    """Client -> broker, the answer to a connection-level BUFFER_CONTROL that shrank the producer buffer:
    "I will start no message at or beyond `limit`". `control` counts the connection-level BUFFER_CONTROLs
    received so far (this one included) and `size` is that one's buffer size, so the broker can tell a
    stale answer from the current one. It lets the broker lower its monotonic credit limit, and the
    credit pool stop charging the old, larger grant (docs/protocol.md, BUFFER_LIMIT)."""

    TYPE: ClassVar[FrameType] = FrameType.BUFFER_LIMIT
    control: int
    size: int
    limit: int


@dataclass(frozen=True, slots=True)
class FlowStopped:
    """Broker -> producer: transfers to `destination` are held (QPID-942's "hold it").

    `threshold` names what tripped (flow_stop_count, flow_stop_size, admin), `limit` its value and
    `value` the queue's figure when it tripped.
    """

    TYPE: ClassVar[FrameType] = FrameType.FLOW_STOPPED
    destination: str
    threshold: str
    limit: int
    value: int
    reason: str


@dataclass(frozen=True, slots=True)
class FlowResumed:
    TYPE: ClassVar[FrameType] = FrameType.FLOW_RESUMED
    destination: str


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Client -> broker. `prefetch` bounds unsettled deliveries (0 = unbounded); `buffer_size` bytes
    is the subscription's stream buffer (0 = no byte flow control at this level)."""

    TYPE: ClassVar[FrameType] = FrameType.SUBSCRIBE
    request_id: int
    subscription_id: int
    queue: str
    prefetch: int
    buffer_size: int


@dataclass(frozen=True, slots=True)
class Cancel:
    TYPE: ClassVar[FrameType] = FrameType.CANCEL
    request_id: int
    subscription_id: int


@dataclass(frozen=True, slots=True)
class Deliver:
    TYPE: ClassVar[FrameType] = FrameType.DELIVER
    subscription_id: int
    entries: list[DeliveryEntry]


@dataclass(frozen=True, slots=True)
class Settle:
    """Client -> broker: settle the delivery tags in `ranges` with `outcome`."""

    TYPE: ClassVar[FrameType] = FrameType.SETTLE
    outcome: Outcome
    ranges: list[Range]


@dataclass(frozen=True, slots=True)
class Noop:
    """Liveness probe; `reply` false asks, true answers. Never counted against any credit."""

    TYPE: ClassVar[FrameType] = FrameType.NOOP
    nonce: int
    reply: bool


@dataclass(frozen=True, slots=True)
class Error:
    """An error about one frame (`frame_seq`, 1-based count of frames the sender of the bad frame sent),
    optionally one transfer or request (`ref_id`), a destination it concerns, and the UDP publication
    whose message it is about (`session_id`: a message that came over UDP has no transfer id the client
    knows, so the broker names its publication instead)."""

    TYPE: ClassVar[FrameType] = FrameType.ERROR
    code: ErrorCode
    text: str
    frame_seq: int | None = None
    ref_id: int | None = None
    destination: str | None = None
    session_id: int | None = None  # the UDP publication (REGISTER_PUBLICATION's session id) it concerns

    def __post_init__(self) -> None:
        if type(self.text) is str and len(self.text) > MAX_ERROR_TEXT:  # (a decoder checks the type after)
            object.__setattr__(self, "text", _cut(self.text))
        # The destination quotes a name the peer sent (a TRANSFER's exchange has no length of its own to
        # keep): cut as the text is, or 10,000 pending ERRORs naming a 60,000-character exchange held
        # 600 MiB for a client that never reads (a tester).
        if type(self.destination) is str and len(self.destination) > MAX_ERROR_TEXT:
            object.__setattr__(self, "destination", _cut(self.destination))


@dataclass(frozen=True, slots=True)
class Close:
    TYPE: ClassVar[FrameType] = FrameType.CLOSE
    code: ErrorCode
    reason: str

    def __post_init__(self) -> None:
        if type(self.reason) is str and len(self.reason) > MAX_ERROR_TEXT:
            object.__setattr__(self, "reason", _cut(self.reason))


def _cut(text: str) -> str:
    """An ERROR text or CLOSE reason cut to MAX_ERROR_TEXT characters (protocol/limits.py)."""
    return text[: MAX_ERROR_TEXT - 3] + "..."


@dataclass(frozen=True, slots=True)
class RegisterPublication:
    """Client -> broker: the client will publish over UDP (the Aeron data path, docs/transport.md) on
    `stream_id` from its UDP port `source_port` at the address of this TCP connection, to `exchange` with
    `routing_key` unless a message's envelope names another key (protocol/envelope.py).

    The broker answers OK with {"session_id", "stream_id", "endpoint", "term_length", "mtu"}: the Aeron
    session id the publication must use, and where to send. Only datagrams of that (session id, stream
    id) from that address are accepted; the image's receiver window is this publication's credit."""

    TYPE: ClassVar[FrameType] = FrameType.REGISTER_PUBLICATION
    request_id: int
    exchange: str
    routing_key: str
    stream_id: int
    source_port: int


@dataclass(frozen=True, slots=True)
class ClosePublication:
    """Client -> broker: the UDP publication `session_id` registered by this connection is done; the
    broker forgets it once the messages it received are routed (its image drains)."""

    TYPE: ClassVar[FrameType] = FrameType.CLOSE_PUBLICATION
    request_id: int
    session_id: int


@dataclass(frozen=True, slots=True)
class SubscribeUdp:
    """Client -> broker: SUBSCRIBE, with deliveries sent over UDP (an Aeron publication of the broker's) to
    `port` at the address of this TCP connection on `stream_id`. `buffer_size` is the consumer's byte
    credit: the receiver window its status messages advertise. Settlement stays on TCP (SETTLE by
    delivery tag, as for a TCP subscription). The broker answers OK as for SUBSCRIBE, plus {"session_id",
    "stream_id", "endpoint"}: the session its datagrams carry and the endpoint they come from."""

    TYPE: ClassVar[FrameType] = FrameType.SUBSCRIBE_UDP
    request_id: int
    subscription_id: int
    queue: str
    prefetch: int
    buffer_size: int
    port: int
    stream_id: int


@dataclass(frozen=True, slots=True)
class JoinGroup:
    """Client -> broker: join multicast group `group`, the consumer-side view of fanout exchange `exchange`.
    The broker keeps one queue named `group` bound to the exchange and delivers its messages once, on one
    Aeron publication of its own to multicast `endpoint` ("group-address:port", an odd IPv4 group; the
    group's first member sets it, later ones must name the same or "") on `stream_id`, with flow control
    `fc` ("min" or "tagged"; "" = "min"): the slowest member paces the group. `receiver_id` is the receiver
    id of the member's status messages (only registered members' status messages count); `buffer_size` the
    window they advertise. A message is settled once every live member's consumption position passed it.
    OK: {"queue", "session_id", "stream_id", "channel", "endpoint", "group_tag"} (the Aeron channel URI the
    member subscribes to; group_tag its SMs carry with fc=tagged, else None). CANCEL `subscription_id`
    leaves the group, as does closing the connection."""

    TYPE: ClassVar[FrameType] = FrameType.JOIN_GROUP
    request_id: int
    subscription_id: int
    exchange: str
    group: str
    endpoint: str
    fc: str
    buffer_size: int
    receiver_id: int
    stream_id: int


@dataclass(frozen=True, slots=True)
class AuthChallenge:
    """Broker -> client, between HELLO and WELCOME: the next message of the SASL exchange HELLO's `auth`
    began (SCRAM's server-first). The client answers AUTH_RESPONSE."""

    TYPE: ClassVar[FrameType] = FrameType.AUTH_CHALLENGE
    data: bytes


@dataclass(frozen=True, slots=True)
class AuthResponse:
    """Client -> broker, the answer to AUTH_CHALLENGE (SCRAM's client-final). The broker answers WELCOME
    (carrying its own proof in `auth_data`) or ERROR UNAUTHORIZED + CLOSE."""

    TYPE: ClassVar[FrameType] = FrameType.AUTH_RESPONSE
    data: bytes


Frame = Union[
    Hello,
    Welcome,
    DeclareQueue,
    DeclareExchange,
    Bind,
    Unbind,
    DeleteQueue,
    PurgeQueue,
    DeleteExchange,
    Ok,
    Transfer,
    Complete,
    BufferControl,
    BufferAck,
    BufferLimit,
    FlowStopped,
    FlowResumed,
    Subscribe,
    Cancel,
    Deliver,
    Settle,
    Noop,
    Error,
    Close,
    RegisterPublication,
    ClosePublication,
    SubscribeUdp,
    JoinGroup,
    AuthChallenge,
    AuthResponse,
]

_U64 = 2**64 - 1
_I64_MIN = -(2**63)


def frame_to_wire(frame: Frame) -> list[Any]:
    """The msgpack array for `frame`. Slots dataclasses have no __dict__, so read fields in order.

    A WELCOME without `auth_data` and `run_id` is sent with its eight fields of old, so that SDKs from
    before authentication, which refuse a ninth field, still connect to a broker that lets them in."""
    wire = [frame.TYPE, *(getattr(frame, name) for name in _FIELD_NAMES[frame.TYPE])]
    if frame.TYPE is FrameType.WELCOME:
        while len(wire) > 9 and wire[-1] is None:  # (the type and the eight required fields stay)
            wire.pop()
    return wire


# ---------------------------------------------------------------------------------------------
# Validation, both directions. Each field has a checker that returns the (possibly converted) value
# or raises _Bad with a short description; decode_body turns that into a RemoteProtocolError,
# check_frame into a LocalProtocolError. A checker is given what msgpack decoded (lists, ints) or
# what a caller built (tuples, NamedTuples, enum members) and accepts both alike. The checkers of
# the fields that hold many items (entries, ranges) take `build`: False on send, where the frame's
# own value is kept and only checked, at one pass over its items.


class _Bad(Exception):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.MALFORMED_FRAME):
        super().__init__(message)
        self.code = code


def _over(what: str, count: int, limit: int, name: str) -> _Bad:
    return _Bad(f"{count} {what} exceed the limit of {limit} ({name}, protocol/limits.py)", ErrorCode.LIMIT_EXCEEDED)


Checker = Callable[[Any], Any]


def _int(v: Any) -> int:
    if type(v) is not int:
        raise _Bad(f"expected an integer, got {type(v).__name__}")
    return v


def _uint(v: Any) -> int:
    if type(v) is not int or v < 0:
        raise _Bad(f"expected a non-negative integer, got {v!r}")
    return v


def _pos(v: Any) -> int:
    if type(v) is not int or v < 1:
        raise _Bad(f"expected a positive integer, got {v!r}")
    return v


def _within(low: int, high: int) -> Checker:
    """An integer in [low, high]: a UDP port, an Aeron stream or session id (a signed 32-bit integer)."""

    def check(v: Any) -> int:
        if type(v) is not int or not low <= v <= high:
            raise _Bad(f"expected an integer in [{low}, {high}], got {v!r}")
        return v

    return check


_PORT = _within(1, 65535)
_STREAM_ID = _within(-(2**31), 2**31 - 1)


def _str(v: Any) -> str:
    if type(v) is not str:
        raise _Bad(f"expected a string, got {type(v).__name__}")
    return v


def _name(v: Any) -> str:
    if type(v) is not str or len(v) > 255:
        raise _Bad("expected a name of at most 255 characters")
    return v


MAX_AUTH_DATA = 1024
"""Bytes of one SASL message: SCRAM's are about 100-200; a bound keeps a pre-authentication peer cheap."""


def _auth_data(v: Any) -> bytes:
    if type(v) is not bytes or len(v) > MAX_AUTH_DATA:
        raise _Bad(f"expected binary of at most {MAX_AUTH_DATA} bytes")
    return v


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise _Bad(f"expected a boolean, got {type(v).__name__}")
    return v


def _opt(check: Checker) -> Checker:
    def checker(v: Any) -> Any:
        return None if v is None else check(v)

    return checker


def _str_list(v: Any) -> list[str]:
    if not isinstance(v, (list, tuple)) or any(type(s) is not str for s in v):
        raise _Bad("expected a list of strings")
    if len(v) > MAX_MAP_ITEMS:
        raise _over("strings", len(v), MAX_MAP_ITEMS, "MAX_MAP_ITEMS")
    return list(v)


_PLAIN = (str, int, float, bool, bytes, type(None), list, dict)


def _map(v: Any) -> dict[str, Any]:
    """A map with string keys whose values, at any depth, are plain msgpack values.

    The walk is iterative (msgpack allows deeper nesting than Python's recursion limit) and rejects
    msgpack.Timestamp, which msgpack decodes from ext type -1 without calling the ext hook.
    """
    if type(v) is not dict:
        raise _Bad("expected a map with string keys")
    stack: list[Any] = [v]
    items = -1  # the map itself is not one of its items: 256 keys are within MAX_MAP_ITEMS
    while stack:
        item = stack.pop()
        items += 1
        if items > MAX_MAP_ITEMS:
            raise _over("items in a map argument", items, MAX_MAP_ITEMS, "MAX_MAP_ITEMS")
        if type(item) is dict:
            for key, value in item.items():
                if type(key) is not str:
                    raise _Bad("expected a map with string keys")
                stack.append(value)
        elif type(item) is list:
            stack.extend(item)
        elif type(item) not in _PLAIN:
            raise _Bad(f"{type(item).__name__} values are not allowed")
    return v


_SCALARS = (str, int, float, bool, bytes, type(None))


def _headers(v: Any) -> Headers | None:
    if v is None:
        return None
    if type(v) is not dict:
        raise _Bad("headers must be a map")
    if len(v) > MAX_HEADERS:
        raise _over("headers on one message", len(v), MAX_HEADERS, "MAX_HEADERS")
    for k, val in v.items():
        if type(k) is not str or type(val) not in _SCALARS:
            raise _Bad("headers must map strings to scalars")
    return v


def _ranges(v: Any, build: bool = True) -> list[Range]:
    if not isinstance(v, (list, tuple)):
        raise _Bad("expected a list of [first, last] ranges")
    if len(v) > MAX_RANGES_PER_FRAME:
        raise _over("ranges in one frame", len(v), MAX_RANGES_PER_FRAME, "MAX_RANGES_PER_FRAME")
    out: list[Range] = []
    for r in v:
        if (
            not isinstance(r, (list, tuple))
            or len(r) != 2
            or type(r[0]) is not int
            or type(r[1]) is not int
            or not 0 < r[0] <= r[1]
        ):
            raise _Bad(f"bad range {r!r}: expected [first, last] with 0 < first <= last")
        if build:
            out.append((r[0], r[1]))
    return out if build else v  # type: ignore[return-value]


def _enum(enum_type: type[enum.IntEnum]) -> Checker:
    def checker(v: Any) -> Any:
        if type(v) is enum_type:  # a frame built locally
            return v
        if type(v) is not int:  # IntEnum would accept True and 1.0 as 1
            raise _Bad(f"{v!r} is not a valid {enum_type.__name__}")
        try:
            return enum_type(v)
        except (ValueError, TypeError):
            raise _Bad(f"{v!r} is not a valid {enum_type.__name__}") from None

    return checker


def _entries(v: Any) -> None:
    if not isinstance(v, (list, tuple)) or not v:
        raise _Bad("entries must be a non-empty list")
    if len(v) > MAX_ENTRIES_PER_FRAME:
        raise _over("messages in one frame", len(v), MAX_ENTRIES_PER_FRAME, "MAX_ENTRIES_PER_FRAME")


def _transfer_entries(v: Any, build: bool = True, pad: bool = False) -> list[TransferEntry]:
    """TRANSFER entries. The hot path of both directions: the common entry has all six fields (the SDK
    always sends six), and a loop that unpacks them costs half of one that indexes each (callgrind);
    anything else falls to the field-by-field loop, which also names what is wrong. An entry is any
    sequence of its fields (msgpack gives lists, the SDK builds tuples): one that unpacks to six
    well-typed fields is taken as such, without a check of its own type, which would cost a quarter more.

    `build=False` checks only; with `pad=True` too, the entries are kept as received (msgpack's lists)
    but every one has its six fields (absent optional ones None), for a receiver that unpacks them."""
    _entries(v)
    try:
        for exchange, key, body, headers, producer_id, sequence in v:
            if type(exchange) is not str or type(key) is not str or type(body) is not bytes:
                break
            if headers is not None or producer_id is not None or sequence is not None:
                if headers is not None:
                    _headers(headers)
                if producer_id is not None and type(producer_id) is not str:
                    break
                if sequence is not None and (type(sequence) is not int or sequence < 0):
                    break
        else:
            # _make_transfer is tuple.__new__ (C), several times cheaper than the NamedTuple's Python __new__.
            return list(map(_make_transfer, v)) if build else v
    except (TypeError, ValueError):  # an entry that is not a sequence of six fields
        pass
    out: list[Any] = []
    for e in v:
        if not isinstance(e, (list, tuple)) or not 3 <= len(e) <= 6:
            raise _Bad("each entry must be [exchange, routing_key, body, headers?, producer_id?, sequence?]")
        if type(e[0]) is not str or type(e[1]) is not str or type(e[2]) is not bytes:
            raise _Bad("entry fields exchange and routing_key must be strings, body must be bytes")
        n = len(e)
        if n > 3:
            if e[3] is not None:
                _headers(e[3])
            if n > 4 and e[4] is not None and type(e[4]) is not str:
                raise _Bad("producer_id must be a string")
            if n > 5 and e[5] is not None and (type(e[5]) is not int or e[5] < 0):
                raise _Bad("sequence must be a non-negative integer")
        # Absent optional fields are filled with their default, None.
        if build:
            out.append(_make_transfer(e if n == 6 else (*e, *_NONES[n])))
        elif pad:
            out.append(e if n == 6 else [*e, *_NONES[n]])
    return out if build or pad else v


# tuple.__new__ through partial: all in C. NamedTuple._make is a Python function (a frame and a len()
# per entry); the entries built here always have their six fields, which is all it checks.
_make_transfer: Callable[[Any], TransferEntry] = partial(tuple.__new__, TransferEntry)
_make_delivery: Callable[[Any], DeliveryEntry] = partial(tuple.__new__, DeliveryEntry)
_NONES = {3: (None, None, None), 4: (None, None), 5: (None,)}


def _delivery_entries(v: Any, build: bool = True) -> list[DeliveryEntry]:
    """DELIVER entries, six fields each: unpacked, as TRANSFER's (see `_transfer_entries`)."""
    _entries(v)
    try:
        for tag, exchange, key, body, headers, redelivered in v:
            if (
                type(tag) is not int
                or tag < 1
                or type(exchange) is not str
                or type(key) is not str
                or type(body) is not bytes
                or type(redelivered) is not bool
            ):
                raise _Bad("delivery entry has a field of the wrong type (delivery_tag must be a positive integer)")
            if headers is not None:
                _headers(headers)
    except (TypeError, ValueError):  # an entry that is not a sequence of six fields
        raise _Bad("each entry must be [tag, exchange, routing_key, body, headers, redelivered]") from None
    return list(map(_make_delivery, v)) if build else v


_SCHEMA: dict[FrameType, tuple[type[Any], tuple[Checker, ...], int]] = {}
"""type -> (class, field checkers, number of required fields)."""

_FIELD_NAMES: dict[FrameType, tuple[str, ...]] = {}

_SEND_CHECKS: dict[type[Any], tuple[tuple[str, Checker], ...]] = {}
"""class -> (field name, checker) pairs for check_frame: the same checkers, those of many-item fields
without building a copy."""

_CHECK_ONLY: dict[Checker, Checker] = {
    _transfer_entries: lambda v: _transfer_entries(v, False),
    _delivery_entries: lambda v: _delivery_entries(v, False),
    _ranges: lambda v: _ranges(v, False),
}


def _register(cls: type[Any], *checkers: Checker) -> None:
    names = tuple(f.name for f in fields(cls))
    assert len(names) == len(checkers), cls
    required = sum(1 for f in fields(cls) if f.default is MISSING)
    _SCHEMA[cls.TYPE] = (cls, checkers, required)
    _FIELD_NAMES[cls.TYPE] = names
    _SEND_CHECKS[cls] = tuple((name, _CHECK_ONLY.get(check, check)) for name, check in zip(names, checkers))


_register(Hello, _uint, _str, _bool, _str_list, _opt(_map))
_register(Welcome, _uint, _uint, _str, _uint, _uint, _uint, _uint, _str, _opt(_auth_data), _opt(_str))
_register(DeclareQueue, _uint, _name, _bool, _opt(_map))
_register(DeclareExchange, _uint, _name, _name)
# Binding keys are bounded in bytes by the broker (KEY_TOO_LONG, MAX_KEY_BYTES), not here.
_register(Bind, _uint, _name, _name, _str)
_register(Unbind, _uint, _name, _name, _str)
_register(DeleteQueue, _uint, _name)
_register(PurgeQueue, _uint, _name)
_register(DeleteExchange, _uint, _name)
_register(Ok, _uint, _map)
_register(Transfer, _pos, _transfer_entries)
_register(Complete, _uint, _ranges)
_register(BufferControl, _uint, _uint)
_register(BufferAck, _uint, _uint, _uint)
_register(BufferLimit, _pos, _pos, _uint)
_register(FlowStopped, _name, _str, _uint, _uint, _str)
_register(FlowResumed, _name)
_register(Subscribe, _uint, _uint, _name, _uint, _uint)
_register(Cancel, _uint, _uint)
_register(Deliver, _uint, _delivery_entries)
_register(Settle, _enum(Outcome), _ranges)
_register(Noop, _uint, _bool)
_register(Error, _enum(ErrorCode), _str, _opt(_uint), _opt(_uint), _opt(_str), _opt(_STREAM_ID))
_register(Close, _enum(ErrorCode), _str)
_register(RegisterPublication, _uint, _name, _str, _STREAM_ID, _PORT)
_register(ClosePublication, _uint, _STREAM_ID)
_register(SubscribeUdp, _uint, _uint, _name, _uint, _uint, _PORT, _STREAM_ID)
_register(JoinGroup, _uint, _uint, _name, _name, _str, _str, _uint, _STREAM_ID, _STREAM_ID)
_register(AuthChallenge, _auth_data)
_register(AuthResponse, _auth_data)


def decode_body(obj: Any, frame_seq: int, build_deliveries: bool = True, build_transfers: bool = True) -> Frame:
    """Validate an unpacked msgpack value and build its frame.

    `build_deliveries=False` checks a DELIVER's entries as thoroughly but leaves them the lists msgpack
    decoded (six fields each, in `DeliveryEntry`'s order) instead of building a NamedTuple per message:
    creating and freeing a tuple subclass costs several times a plain list (about a tenth of the SDK
    consumer's instructions per message went to `DeliveryEntry._make`). For a receiver that only unpacks
    them (the SDK's reader, `Consumer._on_deliver`); attribute access (`entry.body`) then fails.
    `build_transfers=False` does the same for a TRANSFER's entries (the broker's reader, which unpacks or
    indexes them), each padded to its six fields.

    Raises RemoteProtocolError(MALFORMED_FRAME) naming the frame type and field at fault.
    """
    if not isinstance(obj, (list, tuple)) or not obj:
        raise RemoteProtocolError("frame is not a non-empty msgpack array", ErrorCode.MALFORMED_FRAME, frame_seq)
    type_code = obj[0]
    if type(type_code) is not int or type_code not in _SCHEMA_BY_INT:
        raise RemoteProtocolError(f"unknown frame type {type_code!r}", ErrorCode.MALFORMED_FRAME, frame_seq)
    ftype = _SCHEMA_BY_INT[type_code]
    cls, checkers, required = _SCHEMAS[build_deliveries][build_transfers][ftype]
    values = obj[1:]
    if not required <= len(values) <= len(checkers):
        raise RemoteProtocolError(
            f"{ftype.name} frame has {len(values)} fields, expected {required}..{len(checkers)}",
            ErrorCode.MALFORMED_FRAME,
            frame_seq,
        )
    args = []
    for name, check, value in zip(_FIELD_NAMES[ftype], checkers, values):
        try:
            args.append(check(value))
        except _Bad as exc:
            raise RemoteProtocolError(f"{ftype.name} frame, field {name}: {exc}", exc.code, frame_seq) from None
    frame: Frame = cls(*args)
    return frame


def check_frame(frame: Frame) -> None:
    """Check a frame built locally with the checks `decode_body` applies to a received one, so that this
    end never sends what the peer must refuse. Raises LocalProtocolError (with the code the peer would
    answer, e.g. MALFORMED_FRAME or LIMIT_EXCEEDED) naming the frame type and field at fault.

    Costs one pass over a frame's items (entries, ranges) and builds nothing.
    """
    checks = _SEND_CHECKS.get(type(frame))
    if checks is None:
        raise LocalProtocolError(f"{frame!r} is not a frame", ErrorCode.MALFORMED_FRAME)
    for name, check in checks:
        try:
            check(getattr(frame, name))
        except _Bad as exc:
            raise LocalProtocolError(f"{frame.TYPE.name} frame, field {name}: {exc}", exc.code) from None


def check_headers(value: Any) -> Headers | None:
    """The checks a TRANSFER entry's headers get, for payloads that carry them outside a frame (the UDP
    envelope, protocol/envelope.py). Raises ValueError naming what is wrong."""
    try:
        return _headers(value)
    except _Bad as exc:
        raise ValueError(str(exc)) from None


def check_delivery_entries(entries: Any) -> list[Any]:
    """The checks a DELIVER frame's entries get, for entries carried outside a frame (a UDP DELIVER_BATCH,
    protocol/envelope.py): the entries as given (lists or tuples of six fields), checked. Raises ValueError
    naming what is wrong."""
    try:
        return _delivery_entries(entries, False)
    except _Bad as exc:
        raise ValueError(str(exc)) from None


def check_delivery_entry(entry: Any) -> None:
    """The checks a DELIVER entry gets (tag, field types, headers). Raises ValueError naming what is wrong."""
    try:
        _delivery_entries([entry], False)
    except _Bad as exc:
        raise ValueError(str(exc)) from None


_SCHEMA_BY_INT: dict[int, FrameType] = {int(t): t for t in _SCHEMA}
_PLAIN_ENTRIES: dict[Checker, Checker] = {
    _delivery_entries: _CHECK_ONLY[_delivery_entries],
    _transfer_entries: lambda v: _transfer_entries(v, False, True),
}


def _plain(kinds: tuple[Checker, ...]) -> dict[FrameType, tuple[type[Any], tuple[Checker, ...], int]]:
    return {
        ftype: (cls, tuple(_PLAIN_ENTRIES[c] if c in kinds else c for c in checkers), required)
        for ftype, (cls, checkers, required) in _SCHEMA.items()
    }


_SCHEMAS = (
    (_plain((_delivery_entries, _transfer_entries)), _plain((_delivery_entries,))),  # build_deliveries False
    (_plain((_transfer_entries,)), _SCHEMA),  # build_deliveries True
)
"""`_SCHEMA` by [build_deliveries][build_transfers] (`decode_body`): with the entry checkers of DELIVER
and/or TRANSFER that check without building."""
