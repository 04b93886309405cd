"""A consumer's subscription to a queue: the broker side of consumer credit.

Two limits pace delivery (the broker is in the DCP producer's role): `prefetch`, the number of
unsettled deliveries, and byte buffers, one per subscription (`stream_buffer_size`) and one per
connection (`connection_buffer_size`). A buffer lets one more message go while any space is left,
so a message larger than the whole buffer is still delivered. Each subscription is paced alone: a
slow one never pauses a fast one on the same connection, unless they share a full connection buffer.

A subscription without credit leaves its queue's rotation (`active` false) and comes back when credit
returns (a settle, a BUFFER_ACK, a resize), so a queue's dispatch costs what it delivers, not the number
of blocked subscriptions (20,000 of them made every enqueue walk them all).
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any

from flowbroker.broker.outbox import MAX_DELIVERIES_WAITING, MAX_DELIVERY_BYTES_WAITING
from flowbroker.protocol.credit import SenderWindow
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Error

if TYPE_CHECKING:
    from flowbroker.broker.message import Message
    from flowbroker.broker.queue import Queue
    from flowbroker.broker.session import Session
    from flowbroker.broker.store import QueueStore

__all__ = ["Subscription"]

_size = attrgetter("size")
_UNLIMITED = float("inf")  # the limit of a window that is off


class Subscription:
    __slots__ = ("session", "sub_id", "queue", "prefetch", "sender_window", "connection_window", "unsettled",
                 "delivered_total", "active", "closed", "first_tag")

    takes_runs = True
    """The queue may call `deliver_ready` when this subscription is alone in its rotation (a subclass that
    does not override it with its own pacing sets this False)."""

    def __init__(self, session: Session, sub_id: int, queue: Queue, prefetch: int, buffer_size: int):
        self.session = session
        self.sub_id = sub_id
        self.queue = queue
        self.prefetch = prefetch
        self.sender_window = SenderWindow(buffer_size)
        self.connection_window = session.deliveries.window  # the connection's buffer, shared (opaque 0)
        self.unsettled = 0
        self.delivered_total = 0
        self.active = False  # in its queue's rotation of subscriptions that may have credit
        self.closed = False  # cancelled, or its connection or queue is gone
        # No delivery of this subscription has an older tag: its CANCEL walks the connection's
        # outstanding deliveries from here (DeliveryLedger.cancel_tagged), not from the first.
        self.first_tag = session.deliveries.next_tag

    def has_credit(self) -> bool:
        """`prefetch` is always positive here: the broker caps "0 = unbounded" at its own maximum."""
        return (
            self.unsettled < self.prefetch
            and self.sender_window.may_send()
            and self.connection_window.may_send()
            and not self.session.outbox.full
        )

    def deliver(self, msg: Message) -> None:
        """Deliver `msg` now: it gets its connection's next tag and goes into its outbox's DELIVER frame
        (the ledger and the outbox are called from here, not through the session: once per message)."""
        self.unsettled += 1
        self.delivered_total += 1
        size = msg.size
        self.sender_window.on_sent(size)
        session = self.session
        tag = session.deliveries.deliver(self, msg, size)
        entry: Any = (tag, msg.exchange, msg.routing_key, msg.body, msg.headers, msg.redelivered)  # (deliver_ready)
        session.outbox.deliver(self.sub_id, entry, size)

    def deliver_ready(self, store: QueueStore) -> None:
        """Deliver ready messages from `store` while this subscription has credit (its queue's rotation
        holds only this one). The same checks and bookkeeping as `has_credit` and `deliver` once per
        message, but with the windows read into locals, the connection's ledger and outbox called once
        for the run, and one DELIVER entry tuple per message (callgrind: about a quarter of a
        delivery's instructions were method calls). A subclass that paces otherwise overrides it (a UDP
        subscription: broker/udp/egress.py) or sets `takes_runs` False (a multicast group's)."""
        session = self.session
        outbox = session.outbox
        if outbox.full:
            return
        room = min(self.prefetch - self.unsettled, MAX_DELIVERIES_WAITING - outbox.deliveries_waiting)
        sw, cw = self.sender_window, self.connection_window
        # may_send() of both windows: position below acked + window, or the window off (0): a limit
        # nothing reaches. Both positions grow by the same bytes, so one count against the nearer limit;
        # and the outbox's bytes (Outbox: MAX_DELIVERY_BYTES_WAITING), passed by one message at most.
        budget = min(sw.acked_position + sw.window - sw.position if sw.window else _UNLIMITED,
                     cw.acked_position + cw.window - cw.position if cw.window else _UNLIMITED,
                     MAX_DELIVERY_BYTES_WAITING - outbox.delivery_bytes_waiting)
        if room <= 0 or budget <= 0 or not store:
            return
        ledger = session.deliveries
        take = store.take
        tag = ledger.next_tag
        msgs: list[Message] = []
        # Plain tuples in DeliveryEntry's field order: the wire is the same, and a tuple subclass built
        # through tuple.__new__ cost five times a tuple display (as the SDK's decoded lists, `Deliver`).
        entries: list[Any] = []
        spent = 0
        while True:
            msg = take()
            msgs.append(msg)
            entries.append((tag, msg.exchange, msg.routing_key, msg.body, msg.headers, msg.redelivered))
            tag += 1
            spent += msg.size
            room -= 1
            if not room or spent >= budget or not store:
                break
        n = len(msgs)
        self.unsettled += n
        self.delivered_total += n
        sw.position += spent
        ledger.deliver_many(self, msgs, spent)  # the tags counted above, in order
        session.outbox.deliver_many(self.sub_id, entries, spent, map(_size, msgs))

    def queue_deleted(self, name: str) -> None:
        """Its queue was deleted (the queue closed it): the connection forgets it and is told."""
        session = self.session
        session.subscriptions.pop(self.sub_id, None)
        session.send(Error(ErrorCode.NOT_FOUND, f"queue {name!r} was deleted", None, None, name))
