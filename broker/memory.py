"""The broker-wide memory watermark: the bytes of every message the broker holds, against one bound.

Each queue bounds itself with its own watermarks, but a broker with many queues, or with a queue whose
limits are off, could still grow without bound (a producer without flow control on a queue with
`max_size = 0` took the broker from 39 MB to 1.7 GB). So every queue adds the `message_size` of what
it takes to one `MemoryMeter` and subtracts what leaves. When the total crosses the watermark the
core raises the *memory alarm*: every transfer from a flow-controlled producer is held (its completion
and credit wait) and every such producer is told FLOW_STOPPED on destination `*` with threshold
`memory`; producers without flow control are refused with RESOURCE_EXHAUSTED. The alarm clears when
the total falls under the resume level, and everything held is released (RabbitMQ's memory alarm
blocks publishing connections the same way, but by not reading their sockets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from flowbroker.broker.paging import SortedKeyDict

if TYPE_CHECKING:
    from flowbroker.broker.queue import Queue

__all__ = ["MemoryMeter"]


class MemoryMeter:
    """Bytes held (`held`, in message_size bytes) against `watermark`; queues update `held` inline."""

    __slots__ = ("held", "watermark", "resume", "alarm", "alarms_total", "_on_clear", "held_room", "newest_conn",
                 "alarm_newest_conn", "subscriptions", "saturated_queues")

    def __init__(self, watermark: int, resume: int, on_clear: Callable[[], None] | None = None):
        self.held = 0
        self.held_room = 1 << 62
        """What the live flow-controlled producers can have in flight at most: the credit pool plus one
        message over per connection (the core keeps it). Held messages past a stop by more than this are
        those of producers that sent and left: refused, or queues and the alarm would grow with every
        reconnect (Queue.add's HeldPastCredit, BrokerCore.route under a broker-wide stop). Only connections
        opened after the queue saturated (or the alarm came on) meet it: producers connected before are
        never refused by it, whoever else comes and goes (a tester's live producer was refused while short
        jobs came and went beside it). What fans out under the alarm is parked, one copy (broker/parking.py)."""
        self.newest_conn = 0  # the newest connection id (the core keeps it): connections are numbered in order
        self.alarm_newest_conn = 0  # the newest when the alarm came on: newer ones meet the room check
        self.watermark = watermark
        self.resume = resume
        self.alarm = False
        self.alarms_total = 0  # times the alarm was raised (metrics)
        self._on_clear = on_clear
        self.subscriptions = 0
        """Subscriptions to queues, broker-wide (queues keep it): each costs memory (~0.4 KiB, more with
        what it has delivered), so the core refuses one past `[server] max_subscriptions_total`."""
        self.saturated_queues: SortedKeyDict[str, Queue] = SortedKeyDict()
        """The saturated queues by name, broker-wide (queues keep it as they saturate and clear), in order:
        the admin API pages them (`GET /api/queues?saturated=true`) as it pages every queue, at the cost of
        what is on the page, so a queue past the first page of 1,000 names is not hidden from the console
        by queues named before it."""

    def over(self) -> bool:
        """The alarm should be raised now."""
        return not self.alarm and self.held >= self.watermark

    def released(self) -> None:
        """Bytes left a queue: clear the alarm once under the resume level. Queues call this after
        lowering `held` only while `alarm` is set, so the common path costs one attribute test."""
        if self.alarm and self.held < self.resume:
            self.alarm = False
            if self._on_clear is not None:
                self._on_clear()
