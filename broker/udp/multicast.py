"""Multicast groups (sans-IO): a fanout exchange's UDP consumers sharing one broker publication to a
multicast channel, paced by their slowest member (docs/transport.md, "Multicast groups").

A group is a consumer-side view of a fanout exchange. The broker keeps one queue for it, named as the
group and bound to the exchange, so routing, the queue's watermarks and hard limits and the broker's memory
bound apply to the group exactly as to any queue. The queue has one subscription, the group's
(`GroupSubscription`), which takes a message only while the group's publication may send (its flow
control's sender limit: `min`, or `tagged` with the group's tag), and appends it once, as a DELIVER
envelope, to that publication: one copy on the wire for every member.

The publication's flow control is the group's credit: each member's status messages carry its window and
its consumption position, which its SDK advances only as its application processes messages. A message
leaves the queue (is settled) once the lowest consumption position among the live members has passed its
end: every member processed it. So the slowest member paces the group's queue, and the queue's watermarks
pace the producers (FLOW_STOPPED names the group's queue).

Members join over TCP (JOIN_GROUP, with the receiver id their status messages carry); only registered
members' SMs, ERRs and RTTMs, from their members' hosts (the TCP peer address), reach the publication, so
nobody else on the multicast group can pace it or stall it; NAKs (which carry no receiver id) only from a
member's host, so that another host on the group cannot make it retransmit whole terms (a tester: 0.64
MB/s of NAKs took the group from 42 KB/s to 18.5 MB/s). After a JOIN the group offers nothing new until the new member's first status message (its image
then starts before the next message, so a member gets every message the group sends after it joined), or
until `group_receiver_timeout` has passed since it joined (a member that never reports cannot stall it),
and not at all for an identity whose last join went silent within SILENT_JOIN_MEMORY_NS (rejoining cannot
stall it either). A member leaves with CANCEL or when its connection ends (the publication forgets its receiver at
once); a member whose status messages stop for `[udp] group_receiver_timeout` stops counting (the flow
control's receiver timeout), so a silent member cannot stall its group. When the last member leaves, the
group closes: its publication ends (end of stream), and what it had sent but not seen processed by every
member goes back to the queue, flagged redelivered.
"""

from __future__ import annotations

import ipaddress
import random
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowbroker.broker.subscription import Subscription
from flowbroker.broker.udp.datapath import Address, Outgoing
from flowbroker.protocol.envelope import encode_delivery
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import DeliveryEntry, Error
from flowbroker.transport.channel import ChannelUri, parse_channel
from flowbroker.transport.flow_control import MinFlowControl, TaggedFlowControl
from flowbroker.transport.frames import ErrorFrame, Nak, RttMeasurement, StatusMessage, decode_datagram
from flowbroker.transport.publication import OfferResult, Publication, PublicationConfig, PublicationStatistics

if TYPE_CHECKING:
    from flowbroker.broker.message import Message
    from flowbroker.broker.queue import Queue
    from flowbroker.broker.session import Session
    from flowbroker.broker.udp.datapath import DataPath

__all__ = ["Group", "GroupSubscription", "Groups", "Member", "FLOW_CONTROLS"]

FLOW_CONTROLS = ("min", "tagged")
"""The `fc` a group may ask for ("" means "min")."""

_LINGER_NS = 200_000_000
LEAVE_LINGER_NS = 200_000_000
"""How long the group waits, after its last member left with messages in flight, for that member's last
status message (sent just before its CANCEL, on another socket: it can arrive after it) before what is
unconfirmed goes back to the queue. Any member's receiver id is known this long after it left too
(`Group.departed`): its status messages then are ignored, not refused as `unregistered_receiver`."""
SILENT_JOIN_MEMORY_NS = 60_000_000_000
"""How long a group remembers that an identity's join was never heard from (Group.waits_for_join): its joins
meanwhile do not hold the group for their first status message."""
MAX_SILENT_JOINS = 1024  # identities a group remembers that for, the oldest forgotten first
_MAX_CLOSING = 8  # closed group publications lingering with their logs (configuration.md counts them)


@dataclass(eq=False, slots=True)
class Member:
    """One member: its TCP session and subscription id, and the receiver id its status messages carry."""

    session: Session
    subscription_id: int
    receiver_id: int
    joined_ns: int


class GroupSubscription(Subscription):
    """The group queue's one subscription: no session of its own; its deliveries go into the group's
    publication (see the module docstring). The `Subscription` fields about a connection's byte buffers
    (`session`, `sender_window`, `connection_window`) are not set: nothing reads them for a group."""

    __slots__ = ("group",)

    takes_runs = False  # one message at a time: the group's publication paces it (Group.may_send)
    group: Group

    def __init__(self, group: Group, queue: Queue, prefetch: int) -> None:  # noqa: D107 - no session
        self.group = group
        self.sub_id = 0
        self.queue = queue
        self.prefetch = prefetch
        self.unsettled = 0
        self.delivered_total = 0
        self.active = False
        self.closed = False
        self.first_tag = 1  # (no connection's ledger: a group's deliveries are its members')

    def has_credit(self) -> bool:
        return self.unsettled < self.prefetch and self.group.may_send()

    def deliver(self, msg: Message) -> None:
        self.unsettled += 1
        self.delivered_total += 1
        self.group.deliver(msg)

    def queue_deleted(self, name: str) -> None:
        self.group.queue_deleted(name)


class Group:
    """One multicast group: its queue's subscription, its publication and its members."""

    def __init__(self, groups: Groups, name: str, exchange: str, queue: Queue, channel: ChannelUri,
                 channel_text: str, data: tuple[str, int], session_id: int, stream_id: int, fc: str,
                 group_tag: int | None, prefetch: int, now_ns: int) -> None:
        config = groups.datapath.config
        self.groups = groups
        self.name = name
        self.exchange = exchange
        self.queue = queue
        self.channel = channel
        self.channel_text = channel_text
        self.data = data  # the multicast data address (host, port)
        self.session_id = session_id
        self.stream_id = stream_id
        self.fc = fc
        self.group_tag = group_tag
        timeout_ns = int(config.group_receiver_timeout * 1_000_000_000)
        self.flow_control: MinFlowControl = (
            TaggedFlowControl(group_tag=group_tag, receiver_timeout_ns=timeout_ns) if group_tag is not None
            else MinFlowControl(receiver_timeout_ns=timeout_ns)
        )
        self.flow_control.overflow_room = config.term_length // 2  # (what a member's image takes)
        self.publication = Publication(
            PublicationConfig(session_id, stream_id, term_length=config.term_length, mtu=config.mtu,
                              initial_term_id=groups.rng.randrange(-(2**31), 2**31), max_messages_per_send=64,
                              linger_ns=_LINGER_NS, connection_timeout_ns=timeout_ns),
            now_ns, destination=data, flow_control=self.flow_control,
        )
        self.members: dict[tuple[int, int], Member] = {}  # (conn id, subscription id) -> member
        self.receivers: dict[int, Member] = {}  # receiver id -> member
        self.member_hosts: frozenset[str] = frozenset()  # the receivers' hosts: where a NAK may come from
        self.timeout_ns = timeout_ns
        # Members that joined and have not been heard from yet: the group offers nothing new until each has
        # (its image then starts before the next message) or its receiver timeout passed since it joined.
        self.awaited: dict[int, int] = {}  # receiver id -> join time
        # Identities whose last join here was never heard from (it left, or its timeout passed, before its
        # first status message) -> when: their next join within SILENT_JOIN_MEMORY_NS is not waited for.
        self.silent_joins: dict[str, int] = {}
        self.in_flight: deque[tuple[int, Message]] = deque()  # (end position, message), in position order
        self.slot: tuple[bytes, Message] | None = None  # a delivery the publication could not take yet
        self.next_tag = 1
        self.settled_position = self.publication.start_position
        self.settled_total = 0
        self.oversized_dropped = 0  # messages over the publication's maximum length, dropped (_drop_oversized)
        self.closed = False
        self.leaving: Member | None = None  # the last member, gone, whose last status message may still come
        self.leaving_until = 0
        self.departed: dict[int, tuple[int, str | None]] = {}
        """Receiver id -> (until when, its host) of members that left within LEAVE_LINGER_NS: the status
        messages a member sent before its CANCEL, or while its answer was on the way, arrive after its
        receiver went. Refused as `unregistered_receiver` (someone sending with an id no member registered),
        they made well-behaved members leaving look like that (a tester: 7 of 12 runs of two members
        leaving together)."""
        self.subscription = GroupSubscription(self, queue, prefetch)

    # ------------------------------------------------------------------ sending

    def may_send(self) -> bool:
        pub = self.publication
        return (not self.closed and self.slot is None and not self.awaited and self.leaving is None
                and pub.is_connected and pub.position < pub.sender_limit)

    def _check_awaited(self, now_ns: int) -> bool:
        """Forget awaited members that have reported or timed out; True if none is awaited any more."""
        fc = self.flow_control
        for rid in [r for r, t in self.awaited.items() if fc.counts(r) or now_ns - t >= self.timeout_ns]:
            del self.awaited[rid]
            member = self.receivers.get(rid)
            if member is not None and not fc.counts(rid):
                self._silent_join(member, now_ns)
        return not self.awaited

    def _silent_join(self, member: Member, now_ns: int) -> None:
        """`member` joined and was never heard from: its identity's next join does not hold the group."""
        joins = self.silent_joins
        joins.pop(member.session.identity, None)
        joins[member.session.identity] = now_ns
        while len(joins) > MAX_SILENT_JOINS:
            del joins[next(iter(joins))]

    def waits_for_join(self, session: Session, now_ns: int) -> bool:
        """Does a JOIN of `session` hold the group until its first status message? Not when its identity's
        last join here went silent within SILENT_JOIN_MEMORY_NS: a member that joined with its status
        messages suppressed, left before group_receiver_timeout and joined again froze the group 97 % of
        the time (a tester: 4.9 s holds back to back)."""
        at = self.silent_joins.get(session.identity)
        return at is None or now_ns - at >= SILENT_JOIN_MEMORY_NS

    def deliver(self, msg: Message) -> None:
        tag = self.next_tag
        self.next_tag = tag + 1
        payload = encode_delivery(DeliveryEntry(tag, msg.exchange, msg.routing_key, msg.body, msg.headers,
                                                msg.redelivered))
        if len(payload) > self.publication.max_message_length:
            self._drop_oversized(msg, len(payload))
            return
        if not self._offer(payload, msg):
            self.slot = (payload, msg)
        self.groups.datapath.wake()

    def _drop_oversized(self, msg: Message, size: int) -> None:
        """A message over what multicast carries (term_length / 8 with its envelope): offered, it raised and
        took the broker down (a tester). The group's queue is the group's alone, so no other consumer could
        take it: it leaves the queue, counted (`oversized_dropped`), and every member is told."""
        self.queue.settle(msg)
        self.subscription.unsettled -= 1
        self.oversized_dropped += 1
        text = (f"a message of {size} bytes with its envelope, routed to multicast group {self.name!r} of exchange "
                f"{self.exchange!r}, is over what the UDP data path carries (term_length / 8: "
                f"{self.publication.max_message_length} bytes): dropped for the group; raise [udp] term_length")
        for member in self.members.values():
            member.session.send(Error(ErrorCode.MESSAGE_TOO_LARGE, text, None, None, self.exchange))

    def _offer(self, payload: bytes, msg: Message) -> bool:
        pub = self.publication
        result = pub.offer(payload)
        if result == OfferResult.ADMIN_ACTION:  # the term rotated: Aeron's callers retry at once
            result = pub.offer(payload)
        if result < 0:
            return False
        self.in_flight.append((result, msg))
        return True

    def _may_resume(self, now_ns: int) -> None:
        """After a datagram or a duty cycle (the limit, the receivers or the awaited members may have
        changed): if the group was not taking messages, see whether it may now."""
        if self.awaited:
            self._check_awaited(now_ns)
        if self.slot is not None or not self.subscription.active:
            self._window_moved()

    def _window_moved(self) -> None:
        """Status messages or an expiry moved the limit: the waiting delivery first, then the queue."""
        slot = self.slot
        if slot is not None:
            if not self._offer(*slot):
                return
            self.slot = None
        sub = self.subscription
        if not sub.closed:
            self.queue.resume_subscription(sub)
            self.queue.dispatch()

    # ------------------------------------------------------------------ settling

    def settle(self) -> int:
        """Settle every in-flight message the slowest live member has passed; returns how many."""
        position = self.flow_control.min_position()
        if position is None:
            return 0
        if position > self.settled_position:
            self.settled_position = position
        in_flight, queue, sub = self.in_flight, self.queue, self.subscription
        count = 0
        while in_flight and in_flight[0][0] <= self.settled_position:
            _, msg = in_flight.popleft()
            queue.settle(msg)
            count += 1
        if count:
            sub.unsettled -= count
            self.settled_total += count
            queue.resume_subscription(sub)
            queue.settled()
        return count

    # ------------------------------------------------------------------ control datagrams, duty cycle

    def on_datagram(self, data: bytes | bytearray | memoryview, source: Address, now_ns: int) -> str | None:
        """An SM, NAK, ERR or RTTM for the group's publication; the refusal reason, or None if taken. SMs,
        ERRs and RTTMs must carry a registered member's receiver id."""
        frames, reason = decode_datagram(data, self.publication.term_length)
        if reason is not None or not frames:
            return "malformed"
        frame = frames[0]
        if isinstance(frame, (StatusMessage, ErrorFrame, RttMeasurement)):
            member = self.receivers.get(frame.receiver_id)
            if member is None:
                gone = self.departed.get(frame.receiver_id)
                if gone is not None and now_ns < gone[0] and isinstance(source, tuple) and source[0] == gone[1]:
                    return None  # a member's that just left, from its host: ignored (not for the publication)
                return "unregistered_receiver"
            if not isinstance(source, tuple) or source[0] != member.session.peer_host:
                return "wrong_source"  # a registered receiver id from another host than its member's
        elif isinstance(frame, Nak) and (not isinstance(source, tuple) or source[0] not in self.member_hosts):
            return "wrong_source"
        pub = self.publication
        pub.on_datagram(data, source, now_ns)
        self.settle()
        if self.leaving is not None and not self.in_flight:  # the last member's last word came: all settled
            self.finish_leave(now_ns)
        if not self.closed:
            self._may_resume(now_ns)
        return None

    def do_work(self, now_ns: int) -> Outgoing:
        if self.leaving is not None and now_ns >= self.leaving_until:
            self.finish_leave(now_ns)
        # A message over the smallest member's window is sent whole, as to a unicast UDP consumer
        # (Egress.do_work): a member's image reports only whole messages, so cut at the window's end it
        # held the group for good (a tester: 20 KB messages beside a member of window 8192, 5 of 5).
        self.flow_control.overflow_to = self.publication.position
        out = self.publication.do_work(now_ns)  # expires silent members: the min may jump
        if not self.closed:
            self.settle()
            self._may_resume(now_ns)
        return out

    def deadline_ns(self, now_ns: int) -> int:
        deadline = self.publication.next_deadline_ns()
        if self.leaving is not None:
            deadline = min(deadline, self.leaving_until)
        for joined in self.awaited.values():
            deadline = min(deadline, joined + self.timeout_ns)
        return deadline

    # ------------------------------------------------------------------ members

    def leave(self, key: tuple[int, int], now_ns: int) -> None:
        member = self.members.pop(key, None)
        if member is None:
            return
        member.session.group_memberships -= 1
        if not self.members and self.in_flight and not self.closed and self.flow_control.counts(member.receiver_id):
            # The last member: its receiver stays a while (LEAVE_LINGER_NS) for the status message it sent
            # before leaving, so what it processed is settled, not requeued as if nobody had; nothing new is
            # offered meanwhile (`may_send`).
            self.leaving, self.leaving_until = member, now_ns + LEAVE_LINGER_NS
            return
        self._remove(member, now_ns)

    def finish_leave(self, now_ns: int) -> None:
        """The last member's linger is over: its status message came, the time is up, or a new member
        joins (then the group closes as it would have, and the new member gets a group of its own)."""
        member, self.leaving = self.leaving, None
        if member is not None:
            self._remove(member, now_ns)

    def _remove(self, member: Member, now_ns: int) -> None:
        self._depart(member, now_ns)
        self.receivers.pop(member.receiver_id, None)
        self.receivers_changed()
        if self.awaited.pop(member.receiver_id, None) is not None:
            self._silent_join(member, now_ns)
        self.publication.remove_receiver(member.receiver_id, now_ns)
        if not self.members:
            self.close(now_ns)
            return
        self.settle()
        self._window_moved()

    def _depart(self, member: Member, now_ns: int) -> None:
        """Keep `member`'s receiver id for LEAVE_LINGER_NS (`departed`), forgetting those whose time is up."""
        departed = self.departed
        for rid in [r for r, (until, _) in departed.items() if until <= now_ns]:
            del departed[rid]
        departed[member.receiver_id] = (now_ns + LEAVE_LINGER_NS, member.session.peer_host)

    def receivers_changed(self) -> None:
        """A member joined or its receiver went: the hosts NAKs are taken from (O(members), at a join or leave)."""
        self.member_hosts = frozenset(h for m in self.receivers.values() if (h := m.session.peer_host) is not None)

    def close(self, now_ns: int) -> None:
        """No member left (or the queue is gone): end of stream; unseen deliveries back to the queue."""
        if self.closed:
            return
        self.closed = True
        self.queue.remove_subscription(self.subscription)
        self.requeue_in_flight()
        self.publication.close(now_ns)
        self.groups.closed(self)

    def requeue_in_flight(self) -> int:
        """Give what was offered and not settled back to the queue (flagged redelivered, in order): the group
        closed, or no member that could have processed it is live any more. Returns how many."""
        msgs = [msg for _, msg in self.in_flight]
        if self.slot is not None:
            msgs.append(self.slot[1])
        self.in_flight.clear()
        self.slot = None
        self.subscription.unsettled = 0
        self.queue.requeue_many(msgs)
        return len(msgs)

    def queue_deleted(self, name: str) -> None:
        """The group's queue was deleted: tell the members, close."""
        self.in_flight.clear()
        self.slot = None
        now_ns = self.groups.datapath.core.clock_ns()
        for member in list(self.members.values()):
            member.session.send(Error(ErrorCode.NOT_FOUND, f"queue {name!r} was deleted", None, None, name))
            member.session.group_memberships -= 1
            self._depart(member, now_ns)
        self.members.clear()
        self.receivers.clear()
        self.receivers_changed()
        self.close(now_ns)

    def view(self) -> dict[str, Any]:
        stats = self.publication.statistics()
        return {"group": self.name, "exchange": self.exchange, "channel": self.channel_text,
                "members": len(self.members), "receivers": self.flow_control.receiver_count,
                "in_flight": len(self.in_flight), "settled": self.settled_total,
                "position": stats.position, "sender_limit": stats.sender_limit,
                "settled_position": self.settled_position}


def _parse_group_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("must be group-address:port, e.g. 239.1.2.3:40457")
    try:
        ip = ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IPv4 address") from None
    if not ip.is_multicast:
        raise ValueError(f"{host} is not a multicast address (224.0.0.0/4)")
    if int(ip) % 2 == 0:
        raise ValueError(f"{host}: a multicast data address must be odd (control uses the next address up)")
    return str(ip), int(port)


class Groups:
    """Every multicast group of the data path. `open_socket(channel, data)`, `close_socket(data)` and
    `read_pending(data, now_ns)` are the shell's (sockets are I/O): bind the group's control socket (OSError
    if it cannot) / close it / hand what it holds to the data path now."""

    def __init__(self, datapath: DataPath) -> None:
        self.datapath = datapath
        self.rng = random.Random()
        self.by_name: dict[str, Group] = {}
        self.by_session: dict[int, Group] = {}  # live and closing
        self._closing: dict[int, Group] = {}
        self.retired_naks_received = 0  # of the groups forgotten: the data path's totals keep counting them
        self.retired_retransmits_sent = 0
        self.open_socket: Callable[[ChannelUri, tuple[str, int]], None] = lambda channel, data: None
        self.close_socket: Callable[[tuple[str, int]], None] = lambda data: None
        # Before a member leaves, its last status message (sent just before its CANCEL, or before its TCP
        # connection closed) is read from the group's socket, so what it processed is settled, not
        # offered again to the members that stay or, if it was the last, requeued as never processed.
        self.read_pending: Callable[[tuple[str, int], int], None] = lambda data, now_ns: None

    def find_member(self, conn_id: int, subscription_id: int) -> Group | None:
        for group in self.by_name.values():
            if (conn_id, subscription_id) in group.members:
                return group
        return None

    def join(self, owner: Session, subscription_id: int, exchange_name: str, name: str, endpoint: str, fc: str,
             buffer_size: int, receiver_id: int, stream_id: int, now_ns: int) -> dict[str, Any]:
        """JOIN_GROUP from `owner`: the OK's result. Raises core.RequestError when refused."""
        from flowbroker.broker.core import RequestError
        from flowbroker.broker.exchange import ExchangeKind

        datapath = self.datapath
        config, core = datapath.config, datapath.core
        fc = fc or "min"
        if fc not in FLOW_CONTROLS:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"fc {fc!r}: a group's flow control is min or tagged")
        if subscription_id == 0:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "subscription id 0 is reserved; use 1 or more")
        if subscription_id in owner.subscriptions or self.find_member(owner.conn_id, subscription_id) is not None:
            raise RequestError(ErrorCode.ALREADY_EXISTS, f"subscription id {subscription_id} is in use")
        if 0 < buffer_size < config.mtu:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"buffer_size {buffer_size} is below the group's mtu ([udp] mtu {config.mtu})")
        if receiver_id == 0:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "receiver id 0 is not a receiver's")
        group = self.by_name.get(name)
        if group is not None and group.leaving is not None:
            # its last member lingers: the group closes now (what was in flight goes back to the queue) and
            # this member gets a new one, whose image starts with nothing offered before it
            group.finish_leave(now_ns)
            group = self.by_name.get(name)
        if group is None:
            exchange = core.exchanges.get(exchange_name)
            if exchange is None:
                raise RequestError(ErrorCode.NOT_FOUND, f"no exchange named {exchange_name!r}", exchange_name)
            if exchange.kind is not ExchangeKind.FANOUT:
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"exchange {exchange_name!r} is {exchange.kind.value}: a multicast group is a "
                                   "fanout exchange's", exchange_name)
            if len(self.by_name) >= config.max_groups:
                raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                                   f"too many multicast groups ([udp] max_groups {config.max_groups})")
            if not endpoint:
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"group {name!r} does not exist: its first member names its multicast endpoint")
            try:
                data = _parse_group_endpoint(endpoint)
            except ValueError as exc:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"multicast endpoint {endpoint!r}: {exc}") from None
            if any(g.data == data for g in self.by_name.values()):
                raise RequestError(ErrorCode.ALREADY_EXISTS, f"multicast endpoint {endpoint} is another group's")
            group = self._open(name, exchange_name, data, fc, stream_id, now_ns)
        else:
            if exchange_name != group.exchange:
                raise RequestError(ErrorCode.ALREADY_EXISTS,
                                   f"group {name!r} is exchange {group.exchange!r}'s, not {exchange_name!r}'s", name)
            self._rebind(group)
            if endpoint and endpoint != f"{group.data[0]}:{group.data[1]}":
                raise RequestError(ErrorCode.ALREADY_EXISTS,
                                   f"group {name!r} is on {group.data[0]}:{group.data[1]}, not {endpoint}", name)
            if fc != group.fc or stream_id != group.stream_id:
                raise RequestError(ErrorCode.ALREADY_EXISTS,
                                   f"group {name!r} has fc={group.fc} stream {group.stream_id}", name)
        if len(group.members) >= config.max_group_members:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                               f"group {name!r} is full ([udp] max_group_members {config.max_group_members})", name)
        if receiver_id in group.receivers:
            raise RequestError(ErrorCode.ALREADY_EXISTS, f"receiver id {receiver_id} is another member's", name)
        if group.flow_control.receiver_count == 0 and (group.in_flight or group.slot is not None):
            # Every earlier member is gone or silent: what they had not confirmed would otherwise be settled
            # by this member's first status message (its image starts past it) without anyone processing it.
            # It goes back to the queue and out again after this member reported (at least once, redelivered).
            group.requeue_in_flight()
        member = Member(owner, subscription_id, receiver_id, now_ns)
        group.members[(owner.conn_id, subscription_id)] = member
        owner.group_memberships += 1
        group.receivers[receiver_id] = member
        group.departed.pop(receiver_id, None)
        group.receivers_changed()
        if group.waits_for_join(owner, now_ns):
            group.awaited[receiver_id] = now_ns
        return {"queue": group.queue.name, "session_id": group.session_id, "stream_id": group.stream_id,
                "channel": group.channel_text, "endpoint": f"{group.data[0]}:{group.data[1]}",
                "group_tag": group.group_tag}

    def _rebind(self, group: Group) -> None:
        """A JOIN of an existing group: its exchange must still be a fanout one, and the group's queue bound
        to it. An exchange deleted and declared again since the group opened had lost the binding, and a
        member joining then got OK and nothing, ever (a tester): the binding is made again."""
        from flowbroker.broker.core import RequestError
        from flowbroker.broker.exchange import ExchangeKind

        core = self.datapath.core
        exchange = core.exchanges.get(group.exchange)
        if exchange is None:
            raise RequestError(ErrorCode.NOT_FOUND, f"no exchange named {group.exchange!r} (group {group.name!r} "
                               "was made for it: declare it again, as fanout)", group.exchange)
        if exchange.kind is not ExchangeKind.FANOUT:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"exchange {group.exchange!r} is {exchange.kind.value} now: a multicast group is a "
                               "fanout exchange's", group.exchange)
        if group.queue not in exchange.bindings.get("", {}):
            if core.routes.bindings >= core.config.server.max_bindings:
                raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                                   f"too many bindings (max_bindings {core.config.server.max_bindings})", group.exchange)
            exchange.bind(group.queue, "")

    def _open(self, name: str, exchange_name: str, data: tuple[str, int], fc: str, stream_id: int,
              now_ns: int) -> Group:
        from flowbroker.broker.core import RequestError

        datapath = self.datapath
        config, core = datapath.config, datapath.core
        queue = core.declare_queue(name)
        if queue.subscriptions:
            raise RequestError(ErrorCode.ALREADY_EXISTS,
                               f"queue {name!r} has consumers: a group's queue is the group's alone", name)
        core.check_subscriptions_total(name)  # the group's subscription to its queue counts as any other
        exchange = core.exchanges[exchange_name]
        if queue not in exchange.bindings.get("", {}) and core.routes.bindings >= core.config.server.max_bindings:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                               f"too many bindings (max_bindings {core.config.server.max_bindings})", exchange_name)
        timeout_ms = max(1, int(config.group_receiver_timeout * 1000))
        group_tag = (zlib.crc32(name.encode()) & 0x7FFFFFFF) or 1 if fc == "tagged" else None
        fc_param = f"tagged,g:{group_tag},t:{timeout_ms}ms" if group_tag is not None else f"min,t:{timeout_ms}ms"
        text = f"aeron:udp?endpoint={data[0]}:{data[1]}"
        interface = config.multicast_interface or _loopback_or_none(datapath.endpoint[0])
        if interface:
            text += f"|interface={interface}"
        text += f"|ttl=1|fc={fc_param}|term-length={config.term_length}|mtu={config.mtu}"
        channel = parse_channel(text)
        try:
            self.open_socket(channel, data)
        except OSError as exc:
            hint = (f" ([udp] multicast_interface = {config.multicast_interface!r} must be an IPv4 address of this host)"
                    if config.multicast_interface else "")
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"cannot open multicast {data[0]}:{data[1]}: {exc}{hint}") from None
        exchange.bind(queue, "")
        session_id = datapath.session_ids.take()
        group = Group(self, name, exchange_name, queue, channel, text, data, session_id, stream_id, fc, group_tag,
                      core.config.queues.max_prefetch, now_ns)
        self.by_name[name] = group
        self.by_session[session_id] = group
        queue.add_subscription(group.subscription)
        datapath.wake()  # SETUP goes out now
        return group

    def closed(self, group: Group) -> None:
        """`group` closed: it lingers (end of stream) among the closing until its publication is done."""
        if self.by_name.get(group.name) is group:
            del self.by_name[group.name]
        if len(self._closing) >= _MAX_CLOSING:
            self._forget(next(iter(self._closing.values())))
        self._closing[group.session_id] = group

    def publication_statistics(self) -> tuple[list[PublicationStatistics], list[PublicationStatistics]]:
        """The live groups' publications' statistics, and the closing ones'."""
        return ([g.publication.statistics() for g in self.by_name.values()],
                [g.publication.statistics() for g in self._closing.values()])

    def _forget(self, group: Group) -> None:
        stats = group.publication.statistics()
        self.retired_naks_received += stats.naks_received
        self.retired_retransmits_sent += stats.retransmits_sent
        self._closing.pop(group.session_id, None)
        self.by_session.pop(group.session_id, None)
        self.datapath.session_ids.give_back(group.session_id)
        # A group, its subscription and its members refer to each other: without this its log (3 x
        # term_length) waited for the garbage collector, which a quiet broker runs seldom (egress._forget).
        del group.publication
        if not any(g.data == group.data for g in self.by_name.values()):
            self.close_socket(group.data)

    def leave(self, conn_id: int, subscription_id: int, now_ns: int) -> bool:
        group = self.find_member(conn_id, subscription_id)
        if group is None:
            return False
        self.read_pending(group.data, now_ns)
        group.leave((conn_id, subscription_id), now_ns)
        return True

    def close_owner(self, conn_id: int, now_ns: int) -> None:
        for group in list(self.by_name.values()):
            keys = [k for k in group.members if k[0] == conn_id]
            if keys:
                self.read_pending(group.data, now_ns)
            for key in keys:
                group.leave(key, now_ns)

    def on_datagram(self, data: bytes | bytearray | memoryview, source: Address, session_id: int, stream_id: int,
                    now_ns: int) -> str | None:
        group = self.by_session.get(session_id)
        if group is None:
            return "unregistered_session"
        if stream_id != group.stream_id:
            return "wrong_stream"
        return group.on_datagram(data, source, now_ns)

    def do_work(self, now_ns: int) -> Outgoing:
        out: Outgoing = []
        for group in list(self.by_name.values()):
            out += group.do_work(now_ns)
        done: list[Group] = []
        for group in self._closing.values():
            out += group.publication.do_work(now_ns)
            if group.publication.is_done:
                done.append(group)
        for group in done:
            self._forget(group)
        return out

    def deadline_ns(self, now_ns: int) -> int:
        deadline = now_ns + 1_000_000_000
        for group in self.by_session.values():
            deadline = min(deadline, group.deadline_ns(now_ns))
        return deadline


def _loopback_or_none(host: str) -> str | None:
    """The interface groups use when `[udp] multicast_interface` is empty: the UDP endpoint's own address
    when it is an IPv4 loopback one (the default, 127.0.0.1), whose members can only be on this host, so
    the group is sent where they listen. The kernel's route for 224.0.0.0/4 is rarely loopback: there the
    client.md example got nothing, and nothing said why (a tester, 4 of 4)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return host if isinstance(address, ipaddress.IPv4Address) and address.is_loopback else None
