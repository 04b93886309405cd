"""Every datagram of the broker's UDP endpoint, sorted: to an ingress image, to an egress publication, or
refused and counted (sans-IO).

A datagram is looked at only as far as its Aeron header: its type says which side it is for (DATA, PAD
and SETUP go to the images of registered publications; SM, NAK and ERR to the broker's publications to
UDP consumers and of its multicast groups; RTTM to whichever owns its session id), its session id must be one the broker handed out
over TCP for that side (one for the other side is `wrong_direction`), and its source address must be the one
registered for that session. Anything else is dropped
and counted by reason (``refused``) before it reaches an image, so it creates nothing and costs the
broker no memory, and, as the Aeron C driver does for a SETUP it refuses, it is answered with nothing.
"""

from __future__ import annotations

import random
import struct
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flowbroker.broker.config import UdpConfig
from flowbroker.transport.frames import FrameType

if TYPE_CHECKING:
    from flowbroker.broker.core import BrokerCore
    from flowbroker.broker.udp.egress import Egress
    from flowbroker.broker.udp.ingress import Ingress
    from flowbroker.broker.udp.multicast import Groups

__all__ = ["Address", "DataPath", "DataPathStatistics", "Outgoing", "REFUSAL_REASONS", "SessionIds"]

Address = Hashable
Outgoing = list[tuple[bytes, Address]]

_TYPE = struct.Struct("<H")
_IDS = struct.Struct("<ii")
_DATA_IDS_OFFSET = 12  # DATA, PAD, SETUP: session id, stream id
_CONTROL_IDS_OFFSET = 8  # SM, NAK, ERR, RTTM
_TO_INGRESS = frozenset({FrameType.DATA, FrameType.PAD, FrameType.SETUP})
_DATA_FRAMES = frozenset({FrameType.DATA, FrameType.PAD})


def is_data_frame(data: bytes | bytearray | memoryview) -> bool:
    """Does this datagram's header say DATA or PAD (a producer's stream, taken in order), rather than a
    control frame (SM, NAK, SETUP, RTTM) or something malformed? What the shell sorts its read-ahead by."""
    return len(data) >= 8 and _TYPE.unpack_from(data, 6)[0] in _DATA_FRAMES
_TO_EGRESS = frozenset({FrameType.SM, FrameType.NAK, FrameType.ERR})

REFUSAL_REASONS = (
    "malformed",  # shorter than its header, or a type no receiver or sender takes
    "unregistered_session",  # a session id the broker did not hand out (or no longer has)
    "wrong_stream",  # a registered session id with another stream id
    "wrong_source",  # a registered session from another address than the registering client's
    "wrong_direction",  # a sender's frame (DATA, PAD, SETUP) for a session the broker sends on (to a UDP
    # consumer or a group), or a receiver's (SM, NAK, ERR) for one it receives (a producer's publication)
    "unregistered_receiver",  # a multicast group's SM, ERR or RTTM with a receiver id no member registered
    # (a member's that left within LEAVE_LINGER_NS, from its host, is ignored: multicast.py `Group.departed`)
    "setup_term_length",  # a SETUP with another term length than [udp] term_length
    "setup_mtu",  # a SETUP with an mtu over the publication's ([udp] mtu, or loopback_mtu from a loopback address)
)
"""Why ``DataPath`` drops a datagram before any image or publication sees it (``refused``)."""


@dataclass(frozen=True, slots=True)
class DataPathStatistics:
    """The data path's counters, for the admin views and the metrics (broker/metrics.py). `loss_gaps`,
    `naks_sent`, `naks_received` and `retransmits_sent` are those of the images and publications live now
    (a closed one's go with it: what GET /api/broker shows); the `*_total` figures add those of every image
    and publication gone, so they never go back (what Prometheus counters need)."""

    endpoint: str
    datagrams_received: int
    refused: tuple[tuple[str, int], ...]
    publications: int
    subscriptions: int
    images: int  # of the publications: one while a producer's SETUP made it and it has not gone
    loss_gaps: int  # gaps the images found in what producers sent (each NAKed)
    naks_sent: int  # NAKs the images sent to producers
    naks_received: int  # NAKs UDP consumers sent to the broker's publications
    retransmits_sent: int  # data the broker's publications sent again for them
    groups: int = 0  # multicast groups live now
    group_members: int = 0  # their members
    loss_gaps_total: int = 0
    naks_sent_total: int = 0
    naks_received_total: int = 0
    retransmits_sent_total: int = 0
    messages_dropped: int = 0  # messages of registered publications dropped (a bad envelope, over term_length / 8), ever


class SessionIds:
    """Aeron session ids handed out by the broker: random (as the driver's), non-zero, never two live at once,
    in one space for both sides so a datagram's session id alone says whose it is."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self.live: set[int] = set()

    def take(self) -> int:
        while True:
            session_id = self._rng.randrange(-(2**31), 2**31)
            if session_id and session_id not in self.live:
                self.live.add(session_id)
                return session_id

    def give_back(self, session_id: int) -> None:
        self.live.discard(session_id)


class DataPath:
    """The broker's UDP endpoint, sans-IO: datagrams in (``on_datagram``), datagrams out (``do_work``).

    ``wake`` is the shell's: called when something outside a datagram (a completion, a settle, a grant)
    means ``do_work`` has SMs or data to send now rather than at the next timer.
    """

    def __init__(self, config: UdpConfig, core: BrokerCore, endpoint: tuple[str, int], wake: Callable[[], None],
                 seed: int | None = None) -> None:
        from flowbroker.broker.udp.egress import Egress
        from flowbroker.broker.udp.ingress import Ingress
        from flowbroker.broker.udp.multicast import Groups

        self.config = config
        self.core = core
        self.endpoint = endpoint
        self.wake = wake
        self.session_ids = SessionIds(seed)
        self.ingress: Ingress = Ingress(self)
        self.egress: Egress = Egress(self)
        self.groups: Groups = Groups(self)
        self.datagrams_received = 0
        self.refused: Counter[str] = Counter()
        self.in_cycle = False
        """Set by the shell when a pass begins, cleared here once the ingress's duty cycle has run: until
        then a `wake` (an SM that let a subscription deliver, a completion, a grant) is served by this
        pass's own `do_work`, so the shell does not run another for it, unless the ingress is left
        `pending`."""
        self.more_waiting = False
        """Set by the shell: DATA frames are left for later passes (read ahead, `UdpShell._take`). A
        producer that is still sending is not waiting for a status message, so the one a caught-up image
        would send at once (for a producer's flush) waits for the pass that leaves none (`Ingress`); sent
        after every pass, it was one SM for every two datagrams."""

    @property
    def endpoint_text(self) -> str:
        host, port = self.endpoint
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def statistics(self) -> DataPathStatistics:
        ingress, egress = self.ingress, self.egress
        images = [p.image.statistics() for p in ingress.publications.values() if p.image is not None]
        streams = [s.publication.statistics() for s in egress.subscriptions.values()]
        lingering = [s.publication.statistics() for s in egress.closing()]
        loss_gaps, naks_sent = sum(i.loss_gaps for i in images), sum(i.naks_sent for i in images)
        groups, closing_groups = self.groups.publication_statistics()  # multicast groups' publications too
        streams += groups
        lingering += closing_groups
        naks_received = sum(p.naks_received for p in streams)
        retransmits_sent = sum(p.retransmits_sent for p in streams)
        return DataPathStatistics(
            self.endpoint_text, self.datagrams_received, tuple(sorted(self.refused.items())),
            len(ingress.publications), len(egress.subscriptions), len(images),
            loss_gaps, naks_sent, naks_received, retransmits_sent,
            len(self.groups.by_name), sum(len(g.members) for g in self.groups.by_name.values()),
            loss_gaps_total=loss_gaps + ingress.retired_loss_gaps,
            naks_sent_total=naks_sent + ingress.retired_naks_sent,
            naks_received_total=(naks_received + sum(p.naks_received for p in lingering) + egress.retired_naks_received
                                 + self.groups.retired_naks_received),
            retransmits_sent_total=(retransmits_sent + sum(p.retransmits_sent for p in lingering)
                                    + egress.retired_retransmits_sent + self.groups.retired_retransmits_sent),
            messages_dropped=ingress.messages_dropped,
        )

    def on_datagram(self, data: bytes | bytearray | memoryview, source: Address, now_ns: int) -> None:
        """Sort one datagram; never raises for any content."""
        self.datagrams_received += 1
        if len(data) < 8:
            self.refused["malformed"] += 1
            return
        ftype = _TYPE.unpack_from(data, 6)[0]
        if ftype in _TO_INGRESS:
            if len(data) < _DATA_IDS_OFFSET + 8:
                self.refused["malformed"] += 1
                return
            session_id, stream_id = _IDS.unpack_from(data, _DATA_IDS_OFFSET)
            reason = self.ingress.on_datagram(data, source, session_id, stream_id, now_ns)
        elif ftype in _TO_EGRESS or ftype == FrameType.RTTM:
            if len(data) < _CONTROL_IDS_OFFSET + 8:
                self.refused["malformed"] += 1
                return
            session_id, stream_id = _IDS.unpack_from(data, _CONTROL_IDS_OFFSET)
            if ftype == FrameType.RTTM and session_id in self.ingress.publications:
                reason = self.ingress.on_datagram(data, source, session_id, stream_id, now_ns)
            elif session_id in self.groups.by_session:
                reason = self.groups.on_datagram(data, source, session_id, stream_id, now_ns)
            else:
                reason = self.egress.on_datagram(data, source, session_id, stream_id, now_ns)
        else:
            reason = "malformed"
        if reason is not None:
            if reason == "unregistered_session" and session_id in self.session_ids.live:
                # Live, but not on the side its frame type is for: session ids are one space for both
                # sides, so it is the other side's (a sender's frame for a session the broker sends, or a
                # receiver's for one it receives). Asked only of a datagram refused anyway.
                reason = "wrong_direction"
            self.refused[reason] += 1

    def do_work(self, now_ns: int) -> Outgoing:
        """Both sides' duty cycles: SMs, NAKs and RTTMs for the images, data and SETUPs for the publications."""
        out = self.ingress.do_work(now_ns)
        self.in_cycle = False  # what wakes from here on needs a cycle of its own
        out += self.egress.do_work(now_ns)
        out += self.groups.do_work(now_ns)
        return out

    def deadline_ns(self, now_ns: int) -> int:
        """When ``do_work`` must run again if nothing arrives."""
        return min(self.ingress.deadline_ns(now_ns), self.egress.deadline_ns(now_ns), self.groups.deadline_ns(now_ns))

    def close_owner(self, owner_conn_id: int, now_ns: int) -> None:
        """The TCP connection ``owner_conn_id`` ended: its publications and UDP subscriptions end with it."""
        self.ingress.close_owner(owner_conn_id, now_ns)
        self.egress.close_owner(owner_conn_id, now_ns)
        self.groups.close_owner(owner_conn_id, now_ns)
