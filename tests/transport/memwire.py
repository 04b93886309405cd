"""A publication and a receive channel joined by in-memory lists, driven through the sans-IO duties.

No trio, no socket, no clock: ``step(now_ns)`` carries what each side sent to the other and runs both duty
cycles, as the trio tasks in ``transport.udp`` do between two socket waits. ``drop_data`` drops the next
data datagrams (not SETUP or heartbeats) to make a gap the receiver must NAK.
"""

from __future__ import annotations

import struct

from flowbroker.transport.drivers import Outgoing, ReceiverDuty, SenderDuty
from flowbroker.transport.frames import FrameType
from flowbroker.transport.publication import Publication, PublicationConfig
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig, Subscription

PUB = ("10.0.0.1", 40001)
SUB = ("10.0.0.2", 40002)
SESSION, STREAM, TERM = 1234, 10, 64 * 1024
_HEADER = struct.Struct("<iBBH")


def is_data(datagram: bytes) -> bool:
    frame_length, _version, _flags, frame_type = _HEADER.unpack_from(datagram, 0)
    return bool(frame_type == FrameType.DATA and frame_length > 0)


class MemWire:
    def __init__(self, **config: int) -> None:
        self.publication = Publication(
            PublicationConfig(session_id=SESSION, stream_id=STREAM, term_length=TERM, **config), 0, destination=SUB
        )
        self.channel = ReceiveChannel(STREAM, ReceiverConfig(receiver_id=7))
        self.subscription: Subscription = self.channel.add_subscription(0)
        self.sender = SenderDuty(self.publication)
        self.receiver = ReceiverDuty(self.channel)
        self.to_receiver: list[tuple[bytes, tuple[str, int]]] = []
        self.to_sender: list[tuple[bytes, tuple[str, int]]] = []
        self.drop_data = 0
        self.received: list[bytes] = []

    def from_publication(self, out: Outgoing) -> None:
        for datagram, address in out:
            assert address == SUB
            if self.drop_data and is_data(datagram):
                self.drop_data -= 1
                continue
            self.to_receiver.append((datagram, PUB))

    def from_receiver(self, out: Outgoing) -> None:
        for datagram, address in out:
            assert address == PUB
            self.to_sender.append((datagram, SUB))

    def offer(self, payload: bytes, now_ns: int) -> int:
        result, out = self.sender.offer(payload, now_ns)
        self.from_publication(out)
        return result

    def poll(self, now_ns: int, fragment_limit: int = 1000) -> int:
        count, out = self.receiver.poll(self.subscription, lambda m: self.received.append(bytes(m)),
                                        fragment_limit, now_ns)
        self.from_receiver(out)
        return count

    def step(self, now_ns: int) -> bool:
        """Deliver both ways and run both duty cycles; returns the sender's progress flag."""
        batch, self.to_receiver = self.to_receiver, []
        self.from_receiver(self.receiver.cycle(batch, now_ns))
        batch, self.to_sender = self.to_sender, []
        out, progressed = self.sender.cycle(batch, now_ns)
        self.from_publication(out)
        return progressed
