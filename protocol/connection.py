"""The connection state machine, without I/O (in the manner of h11).

The shell feeds received bytes in with `receive_data()`, takes validated frames out with
`next_frame()`, and turns frames it wants to send into bytes with `send()`. The state machine
checks direction (a client never sends DELIVER, a broker never sends TRANSFER) and phase (HELLO
first, nothing after CLOSE) for both sides, and `send()` checks a frame's fields with the checks
a received frame goes through (`frames.check_frame`, the checkers of `decode_body`): a misbehaving
peer and a buggy caller fail the same way, with a typed error that names the frame and field.

Theory of operation: states move only through the table `_TRANSITIONS`, keyed by
(state, frame type). A frame that is not in `_ALLOWED[sender role][state]` is an UNEXPECTED_FRAME
error.

Closing is per direction, as in any full-duplex protocol: CLOSE (sent or received) or the end of
the byte stream moves `state` to CLOSED, but only the side that sent CLOSE falls silent. The other
side may still send what it had in flight, checked against the phase the connection was in, and
answer with its own CLOSE; `closed_by_us` / `closed_by_peer` say which ends have finished.

After a RemoteProtocolError the state is ERROR: `next_frame()` raises LocalProtocolError, but
only the peer's direction is broken, so `send()` still accepts what this end could send before,
plus ERROR and CLOSE: the shell can flush what is due and tell the peer why before it closes the
transport.
"""

from __future__ import annotations

import enum

from flowbroker.protocol.codec import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, encode_frame
from flowbroker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from flowbroker.protocol.frames import PROTOCOL_VERSION, Frame, FrameType, check_frame
from flowbroker.protocol.limits import MAX_CONTROL_FRAME

__all__ = ["Role", "State", "Connection"]


class Role(enum.Enum):
    CLIENT = "client"
    BROKER = "broker"

    # Hashed by identity, in C, like their equality: Enum's own __hash__ is a Python call, and every
    # frame sent or received looks up its role and state in the tables below (four calls a frame).
    __hash__ = object.__hash__


class State(enum.Enum):
    AWAIT_HELLO = "await-hello"  # nothing exchanged yet
    AWAIT_WELCOME = "await-welcome"  # HELLO sent, WELCOME not yet
    OPEN = "open"
    CLOSED = "closed"  # CLOSE sent or received, or the byte stream ended
    ERROR = "error"  # a protocol error: the shell must close the transport

    __hash__ = object.__hash__  # (as Role's)


_SESSION = frozenset({FrameType.NOOP, FrameType.ERROR, FrameType.CLOSE})
_CLIENT_OPEN = _SESSION | {
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
}
_BROKER_OPEN = _SESSION | {
    FrameType.OK,
    FrameType.COMPLETE,
    FrameType.BUFFER_CONTROL,
    FrameType.BUFFER_ACK,
    FrameType.FLOW_STOPPED,
    FrameType.FLOW_RESUMED,
    FrameType.DELIVER,
}

_ALLOWED: dict[Role, dict[State, frozenset[FrameType]]] = {
    Role.CLIENT: {
        State.AWAIT_HELLO: frozenset({FrameType.HELLO}),
        # AUTH_RESPONSE answers the broker's AUTH_CHALLENGE (the shell checks it follows one).
        State.AWAIT_WELCOME: frozenset({FrameType.CLOSE, FrameType.AUTH_RESPONSE}),
        State.OPEN: frozenset(_CLIENT_OPEN),
    },
    Role.BROKER: {
        # The broker may refuse a HELLO with ERROR + CLOSE, or continue its authentication.
        State.AWAIT_WELCOME: frozenset({FrameType.WELCOME, FrameType.ERROR, FrameType.CLOSE, FrameType.AUTH_CHALLENGE}),
        State.OPEN: frozenset(_BROKER_OPEN),
    },
}

_ERROR_REPLY = frozenset({FrameType.ERROR, FrameType.CLOSE})

# CLOSE moves any state but ERROR to CLOSED (see Connection._close).
_TRANSITIONS: dict[tuple[State, FrameType], State] = {
    (State.AWAIT_HELLO, FrameType.HELLO): State.AWAIT_WELCOME,
    (State.AWAIT_WELCOME, FrameType.WELCOME): State.OPEN,
}


class Connection:
    """One end of a flowbroker connection. `role` is the side this object speaks for."""

    def __init__(self, role: Role, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE):
        self.role = role
        self.peer_role = Role.BROKER if role is Role.CLIENT else Role.CLIENT
        self.state = State.AWAIT_HELLO
        self._decoder = FrameDecoder(max_frame_size)
        self.frames_sent = 0
        self._closed: set[Role] = set()  # roles that sent CLOSE or ended their byte stream
        self._phase = State.AWAIT_HELLO  # the state CLOSED or ERROR was entered from

    @property
    def frames_received(self) -> int:
        return self._decoder.frames_decoded

    @property
    def closed_by_us(self) -> bool:
        """We sent CLOSE: we may send nothing more."""
        return self.role in self._closed

    @property
    def closed_by_peer(self) -> bool:
        """The peer sent CLOSE or ended its byte stream: nothing more will be accepted from it."""
        return self.peer_role in self._closed

    @property
    def max_frame_size(self) -> int:
        return self._decoder.max_frame_size

    @property
    def buffered(self) -> int:
        """Bytes received and not decoded yet: once next_frame() has returned None, the part of a
        frame still incomplete (the shell bounds these across connections)."""
        return self._decoder.buffered

    @property
    def next_frame_size(self) -> int | None:
        """Size of the frame being received, length prefix included; None before its prefix is in."""
        return self._decoder.next_frame_size

    @property
    def build_deliveries(self) -> bool:
        """True (the default): a received DELIVER's entries are `DeliveryEntry`s. False: the validated
        lists msgpack decoded, in the same field order, for a receiver that only unpacks them (the SDK's
        reader): a NamedTuple per message costs several times a list."""
        return self._decoder.build_deliveries

    @build_deliveries.setter
    def build_deliveries(self, value: bool) -> None:
        self._decoder.build_deliveries = value

    @property
    def build_transfers(self) -> bool:
        """True (the default): a received TRANSFER's entries are `TransferEntry`s. False: the validated
        lists msgpack decoded, each with its six fields in the same order, for a receiver that unpacks
        or indexes them (the broker's reader): a NamedTuple per message costs several times a list."""
        return self._decoder.build_transfers

    @build_transfers.setter
    def build_transfers(self, value: bool) -> None:
        self._decoder.build_transfers = value

    def set_max_frame_size(self, size: int) -> None:
        """Adopt the size negotiated in WELCOME (the largest frame this end will accept)."""
        if size < 64:
            raise ValueError(f"max_frame_size must be at least 64 bytes, got {size}")
        self._decoder.max_frame_size = size

    def receive_data(self, data: bytes) -> None:
        """Bytes from the transport; b"" means the peer closed its end."""
        self._decoder.feed(data)

    def discard_input(self) -> None:
        """The transport is gone: drop the bytes received and not decoded (`FrameDecoder.discard`)."""
        self._decoder.discard()

    def next_frame(self) -> Frame | None:
        """The next validated frame from the peer, or None when more data is needed.

        Raises RemoteProtocolError (and moves to ERROR) for malformed, oversize, truncated or
        unexpected frames. A clean end of stream moves to CLOSED and returns None.
        """
        if self.state is State.ERROR:
            raise LocalProtocolError("connection is in ERROR state; close the transport")
        try:
            if self.state is State.AWAIT_HELLO or self.state is State.AWAIT_WELCOME:
                self._check_handshake_frame_size()
            frame = self._decoder.next_frame()
            if frame is None:
                if self._decoder._eof and not self.closed_by_peer:
                    self._close(self.peer_role)
                return None
            self._advance(self.peer_role, frame, RemoteProtocolError)
        except RemoteProtocolError:
            if self.state is not State.CLOSED:
                self._phase = self.state
            self.state = State.ERROR
            raise
        return frame

    def _check_handshake_frame_size(self) -> None:
        """Before WELCOME only HELLO, AUTH_CHALLENGE / AUTH_RESPONSE and WELCOME come, control frames: a larger
        frame is refused from its length prefix, so an end that never logs in holds no more than one read
        (nine sockets that never logged in sent 8 MiB TRANSFER-typed frames, read into the broker's shared
        partial-frame budget, and a logged-in producer waited 10 s at a time, a tester)."""
        size = self._decoder.next_frame_size
        if size is not None and size > 4 + MAX_CONTROL_FRAME:
            seq = self._decoder.frames_decoded + 1
            raise RemoteProtocolError(
                f"frame {seq} of {size - 4} bytes before the handshake is over: only HELLO and AUTH_RESPONSE "
                f"(at most {MAX_CONTROL_FRAME} bytes) come before WELCOME", ErrorCode.UNEXPECTED_FRAME, seq)

    def send(self, frame: Frame, *, fields_checked: bool = False) -> bytes:
        """Bytes for `frame`, checked against our role, the state and the protocol's field types and
        limits (what the peer's `next_frame()` would refuse); raises LocalProtocolError, and then nothing
        changes (the frame is not counted as sent).

        `fields_checked=True` skips the field checks (not the state machine's) for a frame whose fields
        the caller has checked as it built them: the SDK's TRANSFER frames, whose entries `Producer.send`
        checked one by one (re-checking every entry in the writer was a pass over each message again)."""
        if not fields_checked:
            check_frame(frame)
        self._advance(self.role, frame, LocalProtocolError)
        self.frames_sent += 1
        return encode_frame(frame)

    def _close(self, sender: Role) -> None:
        self._closed.add(sender)
        if self.state is State.ERROR:
            return
        if self.state is not State.CLOSED:
            self._phase = self.state
            self.state = State.CLOSED

    def _advance(
        self, sender: Role, frame: Frame, error: type[LocalProtocolError] | type[RemoteProtocolError]
    ) -> None:
        ftype = frame.TYPE
        state = self.state
        seq = self._decoder.frames_decoded if sender is self.peer_role else None
        if sender in self._closed:
            raise error(
                f"{ftype.name} frame from the {sender.value} after its CLOSE", ErrorCode.UNEXPECTED_FRAME, seq
            )
        # Before WELCOME the client side of the table applies to both ends: the client says HELLO,
        # the broker answers WELCOME. After a CLOSE, the end that has not closed may still send
        # what it could send before; after an error, so may we, and we may say why.
        phase = self._phase if state in (State.CLOSED, State.ERROR) else state
        allowed = _ALLOWED[sender].get(phase, frozenset())
        if state is State.ERROR:
            allowed = allowed | _ERROR_REPLY if sender is self.role else frozenset()
        if ftype not in allowed:
            raise error(
                f"{ftype.name} frame from the {sender.value} is not allowed in state {state.value}",
                ErrorCode.UNEXPECTED_FRAME,
                seq,
            )
        if ftype in (FrameType.HELLO, FrameType.WELCOME) and frame.version != PROTOCOL_VERSION:  # type: ignore[union-attr]
            raise error(
                f"protocol version {frame.version} is not supported (this end speaks {PROTOCOL_VERSION})",  # type: ignore[union-attr]
                ErrorCode.UNSUPPORTED_VERSION,
                seq,
            )
        if ftype is FrameType.CLOSE:
            self._close(sender)
        else:
            self.state = _TRANSITIONS.get((state, ftype), state)
