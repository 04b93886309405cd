"""A client and a broker `Connection` joined by an in-memory link (h11's ConnectionPair idea).

Each direction is a byte buffer: `send()` encodes frames through the sender's state machine and
appends them to the link without delivering them, so tests can keep frames in flight while the
other side acts; `deliver()` hands everything in flight to the receiver and returns the frames it
decoded. `exchange()` does both at once for conversations where nothing crosses.
"""

from __future__ import annotations

from flowbroker.protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    PROTOCOL_VERSION,
    Connection,
    Frame,
    Hello,
    Role,
    State,
    Welcome,
)


class ConnectionPair:
    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.client = Connection(Role.CLIENT, max_frame_size)
        self.broker = Connection(Role.BROKER, max_frame_size)
        self._in_flight: dict[Role, bytearray] = {Role.CLIENT: bytearray(), Role.BROKER: bytearray()}

    def conn(self, role: Role) -> Connection:
        return self.client if role is Role.CLIENT else self.broker

    def peer(self, role: Role) -> Connection:
        return self.broker if role is Role.CLIENT else self.client

    def send(self, role: Role, *frames: Frame) -> None:
        """`role` sends `frames`; they stay on the link until `deliver(role)`."""
        conn = self.conn(role)
        for frame in frames:
            self._in_flight[role] += conn.send(frame)

    def inject(self, role: Role, data: bytes) -> None:
        """Put raw bytes on the link as if `role` had sent them, bypassing its state machine."""
        self._in_flight[role] += data

    def take(self, role: Role) -> bytes:
        """Remove and return the raw bytes `role` has in flight, without delivering them."""
        data = bytes(self._in_flight[role])
        self._in_flight[role].clear()
        return data

    def in_flight(self, role: Role) -> int:
        return len(self._in_flight[role])

    def deliver(self, role: Role, *, eof: bool = False) -> list[Frame]:
        """Deliver what `role` sent to its peer; returns every frame the peer decodes from it."""
        receiver = self.peer(role)
        data = self.take(role)
        if data:
            receiver.receive_data(data)
        if eof:
            receiver.receive_data(b"")
        frames = []
        while (frame := receiver.next_frame()) is not None:
            frames.append(frame)
        return frames

    def exchange(self, role: Role, *frames: Frame) -> list[Frame]:
        """Send and deliver at once; asserts the peer received exactly what was sent."""
        self.send(role, *frames)
        received = self.deliver(role)
        assert received == list(frames)
        return received

    def handshake(
        self, *, flow_control: bool = True, buffer_size: int = 0, max_frame_size: int | None = None
    ) -> Welcome:
        """HELLO / WELCOME; both ends OPEN. Both adopt `max_frame_size` when given."""
        self.exchange(Role.CLIENT, Hello(PROTOCOL_VERSION, "pair-client", flow_control, []))
        limit = self.broker.max_frame_size if max_frame_size is None else max_frame_size
        welcome = Welcome(PROTOCOL_VERSION, 1, "pair-broker", limit, limit, 30_000, buffer_size, "anonymous")
        self.exchange(Role.BROKER, welcome)
        self.client.set_max_frame_size(limit)
        self.broker.set_max_frame_size(limit)
        assert self.client.state is State.OPEN and self.broker.state is State.OPEN
        return welcome
