"""JSON views of the broker's state for the management API (docs/management.md).

Pure functions from core objects (queues, sessions, the credit allocator) to plain dicts of str, int,
float, bool, None, lists and dicts: what `json.dumps` takes. They read and never change anything,
and take the time as an argument (`now_ns`, on the core's clock), so they are tested without HTTP
and without a clock. Durations are in seconds ("for how long"), not timestamps, because the core's
clock is trio's monotonic clock, which means nothing outside the process.

Lists of per-object state (queues, connections, exchanges) come in pages: at most `limit` objects
(DEFAULT_LIMIT unless asked, never over MAX_LIMIT) after the cursor `after`, in key order, with the
cursor of the next page. The core keeps those keys sorted (broker/paging.py), so a page costs what
is on it, however many queues or connections there are. A list inside one object (a queue's
subscriptions, a connection's flow-stopped destinations) shows its first NESTED_LIMIT entries beside
its `*_total`, so no single object is unbounded either.

A page's objects are taken at once (`Page`), and their views made one at a time, so the API can make
and encode a page of 1,000 queues (20-40 ms of CPU) in slices, the broker's connections served between
them (broker/admin.py); an object gone meanwhile is left out of the page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from itertools import islice
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from flowbroker.broker.core import BUILTIN_EXCHANGES, BrokerCore
from flowbroker.broker.exchange import Exchange
from flowbroker.broker.message import HeldTransfer
from flowbroker.broker.queue import Queue
from flowbroker.broker.session import Session
from flowbroker.broker.subscription import Subscription
from flowbroker.broker.udp.datapath import REFUSAL_REASONS
from flowbroker.policies.credit import CreditPolicyConfig
from flowbroker.protocol.credit import SenderWindow
from flowbroker.protocol.names import QUEUE_ARGUMENTS, THRESHOLD_ADMIN, THRESHOLD_MEMORY

if TYPE_CHECKING:
    from flowbroker.broker.udp.egress import UdpSubscription

__all__ = [
    "THRESHOLD_KEYS",
    "DEFAULT_LIMIT",
    "MAX_LIMIT",
    "NESTED_LIMIT",
    "Page",
    "queue_view",
    "queues_page",
    "paged_queues",
    "connection_view",
    "connections_page",
    "paged_connections",
    "exchange_view",
    "exchanges_page",
    "paged_exchanges",
    "policy_view",
    "broker_view",
    "udp_view",
    "held_by_connection",
    "connection_role",
    "stopped_destinations",
]

THRESHOLD_KEYS = QUEUE_ARGUMENTS
"""Every key of a queue's `thresholds` object, which is also what PATCH /api/queues/{name} accepts."""

PeerOf = Callable[[int], str | None]

DEFAULT_LIMIT = 100
"""Objects per page when the request does not say (`?limit=`)."""
MAX_LIMIT = 1000
"""The largest `?limit=` accepted: one page of queues is then ~0.5 MB of JSON."""
NESTED_LIMIT = 20
"""Entries shown of a list inside one object; its `*_total` counts them all."""


T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list endpoint before its views are made: `{key: [view(o) for o in objects], "next":
    cursor}`, where `view` gives None for an object gone since the page was taken (left out: a queue
    deleted, a connection closed while the page is made in slices)."""

    key: str
    objects: list[T]
    cursor: str | int | None
    view: Callable[[T], dict[str, Any] | None]

    def views(self) -> Iterator[dict[str, Any]]:
        """The objects' views, one at a time (made as they are taken)."""
        for obj in self.objects:
            shown = self.view(obj)
            if shown is not None:
                yield shown

    def as_dict(self) -> dict[str, Any]:
        return {self.key: list(self.views()), "next": self.cursor}


def _seconds(now_ns: int, since_ns: int) -> float:
    return round(max(0, now_ns - since_ns) / 1e9, 3)


def _buffer(log: SenderWindow) -> dict[str, int]:
    """A byte buffer the broker sends into (a consumer's): size 0 = no flow control, and then unacked 0
    too, as the metric counts it: a consumer without a byte buffer acknowledges nothing, so the bytes
    the window counts (kept for a buffer turned on later) would only grow."""
    return {"size": log.window, "unacked": log.outstanding if log.window else 0}


# -- queues ------------------------------------------------------------------------------------


def _udp_buffer(sub: UdpSubscription) -> dict[str, int]:
    """A UDP subscription's buffer is its consumer's window, not a TCP byte buffer (its `sender_window` is
    off): the window of the consumer's last status message and the term bytes sent beyond the consumption
    position it reported (0 and 0 before its first)."""
    pub = sub.stream.publication
    return {"size": pub.statistics().receiver_window, "unacked": pub.position - pub.consumption_position}


def _subscription(sub: Subscription) -> dict[str, Any]:
    from flowbroker.broker.udp.egress import UdpSubscription
    from flowbroker.broker.udp.multicast import GroupSubscription

    if isinstance(sub, GroupSubscription):  # a multicast group's: no connection of its own
        return {"connection": None, "client_name": None, "subscription": 0, "queue": sub.queue.name,
                "prefetch": sub.prefetch, "unsettled": sub.unsettled, "delivered": sub.delivered_total,
                "buffer": None, "multicast_group": sub.group.view()}
    return {
        "connection": sub.session.conn_id,
        "client_name": sub.session.client_name,
        "subscription": sub.sub_id,
        "queue": sub.queue.name,
        "prefetch": sub.prefetch,
        "unsettled": sub.unsettled,
        "delivered": sub.delivered_total,
        "buffer": _udp_buffer(sub) if isinstance(sub, UdpSubscription) else _buffer(sub.sender_window),
    }


def queue_view(queue: Queue, now_ns: int) -> dict[str, Any]:
    stats = queue.statistics()
    t = stats.thresholds
    return {
        "name": stats.name,
        "durable": stats.durable,
        "depth": {"count": stats.messages, "bytes": stats.bytes, "ready": stats.ready_messages},
        "thresholds": {
            "flow_stop_count": t.flow_stop_count,
            "flow_resume_count": t.flow_resume_count,
            "flow_stop_size": t.flow_stop_size,
            "flow_resume_size": t.flow_resume_size,
            "flow_stop_drain_time": t.flow_stop_drain_time,
            "flow_resume_drain_time": t.flow_resume_drain_time,
            "flow_stop_age": t.flow_stop_age,
            "flow_resume_age": t.flow_resume_age,
            "max_count": t.max_count,
            "max_size": t.max_size,
            "overflow": stats.overflow.value,
        },
        # the flow timer's figures the time thresholds compare (policies/drain.py), as of its last tick
        "drain": {"rate": round(stats.drain_rate, 3), "oldest_ready_age": round(stats.oldest_ready_age, 3)},
        "saturated": stats.saturated,
        "saturated_for_seconds": _seconds(now_ns, stats.saturated_since_ns) if stats.saturated else None,
        "stop_reason": (
            {"threshold": stats.stop_threshold, "limit": stats.stop_limit, "value": stats.stop_value}
            if stats.saturated else None
        ),
        "held_transfers": stats.held_transfers,
        "flow_stopped_producers": [
            {"connection": s.conn_id, "client_name": s.client_name}
            for s in islice(queue.stopped_producers, NESTED_LIMIT)
        ],
        "flow_stopped_producers_total": stats.flow_stopped_producers,
        "subscriptions": [_subscription(sub) for sub in islice(queue.subscriptions, NESTED_LIMIT)],
        "subscriptions_total": stats.subscriptions,
        "counters": {
            "enqueued": stats.enqueued,
            "dequeued": stats.dequeued,
            "rejected": stats.rejected,
            "dropped": stats.dropped,
            "flow_stopped_count": stats.flow_stopped_count,
            "held_total": stats.held_total,
        },
    }


def queues_page(core: BrokerCore, now_ns: int, after: str | None = None,
                limit: int = DEFAULT_LIMIT, *, saturated: bool = False) -> dict[str, Any]:
    """`{"queues": [...], "next": name or None}`: the queues named after `after`, by name; `saturated`:
    of the saturated queues only (kept apart as they saturate and clear, `MemoryMeter.saturated_queues`)."""
    return paged_queues(core, now_ns, after, limit, saturated=saturated).as_dict()


def paged_queues(core: BrokerCore, now_ns: int, after: str | None = None,
                 limit: int = DEFAULT_LIMIT, *, saturated: bool = False) -> Page[Queue]:
    """`queues_page` with its views still to make."""
    queues, cursor = (core.memory.saturated_queues if saturated else core.queues).page(after, limit)
    live = core.queues

    def view(queue: Queue) -> dict[str, Any] | None:
        return queue_view(queue, now_ns) if live.get(queue.name) is queue else None
    return Page("queues", queues, cursor, view)


# -- connections -------------------------------------------------------------------------------


def held_by_connection(core: BrokerCore) -> dict[int, int]:
    """Transfers held now, per connection id: each held transfer once, however many queues (and an
    admin stop) hold it. Walks every queue: the views read `Session.transfers_held_now` instead,
    and the tests check that it agrees with this."""
    transfers: dict[int, HeldTransfer] = {}
    for queue in core.queues.values():
        for msg in queue.held:
            if msg.held is not None:
                transfers[id(msg.held)] = msg.held
    for transfer in core.admin_held():
        transfers[id(transfer)] = transfer
    counts: dict[int, int] = {}
    for transfer in transfers.values():
        if (session := transfer.owner.session) is not None:  # (a closed connection's: nobody's now)
            counts[session.conn_id] = counts.get(session.conn_id, 0) + 1
    return counts


def connection_role(session: Session) -> str:
    """producer (has sent transfers), consumer (has subscriptions or is a multicast group's member),
    both, or idle."""
    return _role(session.next_transfer_id > 1, bool(session.subscriptions) or session.group_memberships > 0)


def _role(produced: bool, consumes: bool) -> str:
    if produced and consumes:
        return "both"
    if produced:
        return "producer"
    if consumes:
        return "consumer"
    return "idle"


def stopped_destinations(session: Session, limit: int = NESTED_LIMIT) -> list[tuple[str, int, str, str, int, int]]:
    """The first `limit` destinations that hold `session` flow-stopped, earliest first, each as
    (destination, since_ns, reason, threshold, limit, value): reason "queue" for a queue (its stop
    reason), "disk" for a durable queue held by the disk alarm, else the broker-wide stop's ("admin" for
    stop-all, "memory" for the memory alarm). The
    connection views and the metrics (broker/metrics.py) both read them here."""
    out: list[tuple[str, int, str, str, int, int]] = []
    for name, (queue, since_ns) in islice(session.flow_stopped_on.items(), limit):
        if queue is not None:
            threshold, stop_limit, value = queue.stop_reason
            out.append((name, since_ns, "queue", threshold, stop_limit, value))
        elif session.disk_stop is not None and session.disk_stop.destination == name:  # the disk alarm
            disk = session.disk_stop  # (it showed as "admin", a stop-all nobody had made, a tester)
            out.append((name, since_ns, disk.threshold, disk.threshold, disk.limit, disk.value))
        elif session.broker_stop is not None:  # stop-all ("admin") or the memory alarm ("memory")
            stop = session.broker_stop
            out.append((name, since_ns, stop.threshold, stop.threshold, stop.limit, stop.value))
        else:
            out.append((name, since_ns, THRESHOLD_ADMIN, THRESHOLD_ADMIN, 0, 0))
    return out


def _flow(session: Session, now_ns: int) -> dict[str, Any]:
    destinations: list[dict[str, Any]] = [
        {"destination": name, "stopped_for_seconds": _seconds(now_ns, since_ns), "reason": reason,
         "threshold": threshold, "limit": limit, "value": value}
        for name, since_ns, reason, threshold, limit, value in stopped_destinations(session)
    ]
    # A destination is added when it stops the producer and removed when it resumes it, never
    # re-stamped in between, so the first is the earliest: no walk over every stopping queue.
    first = next(iter(session.flow_stopped_on.values()), None)
    return {
        "stopped": bool(destinations),
        "stopped_for_seconds": _seconds(now_ns, first[1]) if first is not None else None,
        "blocking_queues": [d["destination"] for d in destinations if d["reason"] in ("queue", "disk")],
        "admin_stopped": THRESHOLD_ADMIN in session.broker_stops,
        "memory_stopped": THRESHOLD_MEMORY in session.broker_stops,
        "destinations": destinations,
        "destinations_total": len(session.flow_stopped_on),
    }


def connection_view(session: Session, now_ns: int, *, peer: str | None = None,
                    credit_state: str | None = None) -> dict[str, Any]:
    """One connection; `peer` is its address, `credit_state` its grant's state in the credit pool
    (`_grant_state`; None when the pool does not hold it: no flow control)."""
    stats = session.statistics()
    return {
        "id": stats.conn_id,
        "client_name": stats.client_name,
        "peer": peer,
        "identity": session.identity,
        "role": _role(stats.transfers_received > 0, stats.subscriptions > 0 or session.group_memberships > 0),
        "flow_control": session.flow_control,
        "producer": {
            "buffer_size": stats.window,
            "received_bytes": stats.position,
            "acknowledged_bytes": stats.acked_position,
            # (a producer without flow control is acknowledged nothing: its count would only grow)
            "unacked_bytes": stats.position - stats.acked_position if session.flow_control else 0,
            "completed_bytes": stats.consumed_position,
            "transfers": stats.transfers_received,
            "transfers_held": stats.transfers_held_now,
            "transfers_held_total": stats.transfers_held_total,
            "transfers_parked": session.parked.messages,
            "transfers_duplicate": stats.transfers_duplicate,
            "credit_state": credit_state,
            "paced_on": session.paced_on.name if session.paced_on is not None else None,
            "paced_total": session.paced_total,
            "messages_dropped": session.messages_dropped,
        },
        "flow": _flow(session, now_ns),
        "consumer": {
            "buffer": _buffer(session.sender_window),
            "subscriptions": [_subscription(sub) for sub in islice(session.subscriptions.values(), NESTED_LIMIT)],
            "subscriptions_total": stats.subscriptions,
            "unsettled": stats.unsettled,
        },
    }


def connections_page(core: BrokerCore, now_ns: int, peer_of: PeerOf | None = None, after: int | None = None,
                     limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
    """`{"connections": [...], "next": id or None}`: the connections with an id above `after`, by id."""
    return paged_connections(core, now_ns, peer_of, after, limit).as_dict()


def paged_connections(core: BrokerCore, now_ns: int, peer_of: PeerOf | None = None, after: int | None = None,
                      limit: int = DEFAULT_LIMIT) -> Page[Session]:
    """`connections_page` with its views still to make."""
    sessions, cursor = core.sessions.page(after, limit)
    credit, live = core.credit, core.sessions

    def view(s: Session) -> dict[str, Any] | None:
        if live.get(s.conn_id) is not s:
            return None
        return connection_view(s, now_ns, peer=peer_of(s.conn_id) if peer_of else None,
                               credit_state=_grant_state(core, s.conn_id) if s.conn_id in credit else None)
    return Page("connections", sessions, cursor, view)


# -- exchanges ---------------------------------------------------------------------------------


def exchange_view(exchange: Exchange) -> dict[str, Any]:
    """An exchange: `binding_keys` counts its distinct binding keys (O(1), unlike counting bindings)."""
    return {
        "name": exchange.name,
        "kind": exchange.kind.value,
        "builtin": exchange.name in BUILTIN_EXCHANGES,
        "binding_keys": len(exchange.bindings),
    }


def exchanges_page(core: BrokerCore, after: str | None = None, limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
    """`{"exchanges": [...], "next": name or None}`; the default exchange "" is not an object and not listed."""
    return paged_exchanges(core, after, limit).as_dict()


def paged_exchanges(core: BrokerCore, after: str | None = None, limit: int = DEFAULT_LIMIT) -> Page[Exchange]:
    """`exchanges_page` with its views still to make."""
    exchanges, cursor = core.exchanges.page(after, limit)
    live = core.exchanges

    def view(exchange: Exchange) -> dict[str, Any] | None:
        return exchange_view(exchange) if live.get(exchange.name) is exchange else None
    return Page("exchanges", exchanges, cursor, view)


# -- credit policy -----------------------------------------------------------------------------


def _policy_settings(config: CreditPolicyConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(config):
        if f.init:
            value = getattr(config, f.name)
            out[f.name] = value.value if f.name == "policy" else value
    return out


def _grant_state(core: BrokerCore, conn_id: int) -> str:
    credit = core.credit
    if not credit.is_producer(conn_id):
        return "provisional"
    return "waiting" if credit.is_waiting(conn_id) else "producer"


def policy_view(core: BrokerCore, sessions: Iterable[Session] | None = None) -> dict[str, Any]:
    """The credit policy in force, its pool, and every grant it has made now (provisional and waiting
    ones included), with what the broker has promised beyond them (docs/policies.md)."""
    allocator = core.credit
    sizes = allocator.sizes()
    live = {s.conn_id: s for s in (core.sessions.values() if sessions is None else sessions)}
    promised = 0
    for s in live.values():
        if s.flow_control and s.buffer_size:  # not paced under `none`: nothing promised
            promised += max(0, s.receiver_window.limit - s.receiver_window.position)
    states = {cid: _grant_state(core, cid) for cid in sizes}
    return {
        "policy": _policy_settings(allocator.config),
        "producers_stopped": core.producers_stopped,
        "pool": {
            "bytes": allocator.pool,
            "reserve": allocator.reserve,
            "shareable": allocator.shareable,
            "share": allocator.target(),
            "floor": allocator.need() if allocator.pool else 0,
        },
        "granted": {
            "total": allocator.total_granted(),
            "producers": sum(1 for st in states.values() if st != "provisional"),
            "provisional": sum(1 for st in states.values() if st == "provisional"),
            "waiting": sum(1 for st in states.values() if st == "waiting"),
            "connections": [
                {
                    "connection": cid,
                    "client_name": live[cid].client_name if cid in live else None,
                    "buffer_size": size,
                    "state": states[cid],
                    "window": allocator.window_of(cid),
                }
                for cid, size in sizes.items()
            ],
        },
        "committed": allocator.total_committed(),
        "promised_outstanding": promised,
        "users": [
            {"user": owner, "credit_share_percent": share, "cap": cap, "used": used, "connections": conns}
            for owner, share, cap, used, conns in allocator.owners()
        ],
    }


def broker_view(core: BrokerCore, *, admin_port: int | None = None, port: int | None = None) -> dict[str, Any]:
    return {
        "name": core.config.server.name,
        "port": port,
        "admin_port": admin_port,
        "connections": len(core.sessions),
        "queues": len(core.queues),
        "saturated_queues": len(core.memory.saturated_queues),
        "exchanges": len(core.exchanges),
        "subscriptions": core.memory.subscriptions,
        "producers_stopped": core.producers_stopped,
        "credit_policy": core.credit.config.policy.value,
        "unroutable": core.unroutable,
        "idempotence": idempotence_view(core),
        "udp": udp_view(core),
        "journal": journal_view(core),
    }


def journal_view(core: BrokerCore) -> dict[str, Any] | None:
    """The journal of durable queues (docs/storage.md): where it is, what it wrote, the disk alarm; None
    when the broker keeps none ([storage] enabled = false, or a core without a server)."""
    journal = core.journal
    if journal is None:
        return None
    alarm = journal.alarm
    return {
        "directory": str(journal.dir),
        "awake": not journal.dormant,
        "segments": len(journal.sizes),
        "bytes": journal.bytes_on_disk,
        "free_bytes": journal.free_bytes,
        "commits": journal.commits,
        "fsyncs": journal.fsyncs,
        "records_written": journal.records_written,
        "bytes_written": journal.bytes_written,
        "segments_deleted": journal.segments_deleted,
        "messages_moved": journal.messages_moved,
        "write_errors": journal.write_errors,
        "disk_alarm": alarm.reason if alarm is not None else None,
    }


def idempotence_view(core: BrokerCore) -> dict[str, Any]:
    """Idempotent producers (broker/idempotence.py): the producer ids tracked against their bound, and
    what their messages met: taken, completed as duplicates, refused for a gap or an untrackable id."""
    stats = core.producer_sequences.statistics()
    server = core.config.server
    return {
        "producer_ids": stats.producer_ids,
        "max_producer_ids": server.max_producer_ids,
        "max_producer_ids_per_user": server.max_producer_ids_per_user,
        "producer_id_ttl": server.producer_id_ttl,
        "accepted": stats.accepted,
        "duplicates": stats.duplicates,
        "gaps": stats.gaps,
        "refused": stats.refused,
        "evicted": stats.evicted,
    }


def udp_view(core: BrokerCore) -> dict[str, Any] | None:
    """The UDP data path (broker/udp/): where it listens, what it carries, what it refused and why; None
    when the broker runs without it."""
    if core.udp is None:
        return None
    stats = core.udp.statistics()
    return {
        "endpoint": stats.endpoint,
        "publications": stats.publications,
        "subscriptions": stats.subscriptions,
        "datagrams_received": stats.datagrams_received,
        "refused": {**dict.fromkeys(REFUSAL_REASONS, 0), **dict(stats.refused)},  # every reason, 0 too
        "images": stats.images,
        "loss_gaps": stats.loss_gaps,
        "naks_sent": stats.naks_sent,
        "naks_received": stats.naks_received,
        "retransmits_sent": stats.retransmits_sent,
        "messages_dropped": stats.messages_dropped,
        "groups": stats.groups,
        "group_members": stats.group_members,
    }
