"""The names that travel in frames, each defined once: the broker, its admin API and CLI, and the SDK use these.

Strings rather than enums because the wire carries strings and every reader compares with them as they come
off it; the enums that give them behaviour (``policies.overflow.OverflowPolicy``,
``broker.exchange.ExchangeKind``) take their values from here. The credit policy names are not in any frame
(they are broker configuration, set by the admin API and the CLI): ``policies.credit.CreditPolicy`` is their
one definition.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ALL_DESTINATIONS",
    "BUILTIN_EXCHANGES",
    "DEFAULT_EXCHANGE",
    "EXCHANGE_DIRECT",
    "EXCHANGE_FANOUT",
    "EXCHANGE_KINDS",
    "EXCHANGE_TOPIC",
    "LOGIN_THROTTLED",
    "OVERFLOW",
    "OVERFLOW_DROP_HEAD",
    "OVERFLOW_POLICIES",
    "OVERFLOW_REJECT",
    "QUEUE_ARGUMENTS",
    "STOP_THRESHOLDS",
    "THRESHOLD_ADMIN",
    "THRESHOLD_FLOW_STOP_AGE",
    "THRESHOLD_FLOW_STOP_COUNT",
    "THRESHOLD_FLOW_STOP_DRAIN_TIME",
    "THRESHOLD_FLOW_STOP_SIZE",
    "TIME_QUEUE_ARGUMENTS",
    "THRESHOLD_MEMORY",
    "THRESHOLD_DISK",
]

# -- FLOW_STOPPED / FLOW_RESUMED ------------------------------------------------------------------------

ALL_DESTINATIONS: Final = "*"
"""The destination of a broker-wide stop: not a queue, every destination of the producer (an operator's
stop-all, or the broker's memory alarm)."""

THRESHOLD_FLOW_STOP_COUNT: Final = "flow_stop_count"
"""A queue's message count passed its stop threshold."""
THRESHOLD_FLOW_STOP_SIZE: Final = "flow_stop_size"
"""A queue's bytes passed their stop threshold."""
THRESHOLD_FLOW_STOP_DRAIN_TIME: Final = "flow_stop_drain_time"
"""A queue's ready backlog would take longer than this to drain at its consumers' measured rate
(FLOW_STOPPED's ``limit`` and ``value`` in milliseconds)."""
THRESHOLD_FLOW_STOP_AGE: Final = "flow_stop_age"
"""A queue's oldest ready message has waited longer than this (``limit`` and ``value`` in milliseconds)."""
THRESHOLD_ADMIN: Final = "admin"
"""An operator stopped all producers (destination ``*``)."""
THRESHOLD_MEMORY: Final = "memory"
"""The broker's memory watermark (destination ``*``)."""
THRESHOLD_DISK: Final = "disk"
"""The journal's disk watermark (free space under ``disk_free_limit``, or the journal over its quota):
destination is the durable queue the held transfer went to."""
STOP_THRESHOLDS: Final = (
    THRESHOLD_FLOW_STOP_COUNT,
    THRESHOLD_FLOW_STOP_SIZE,
    THRESHOLD_FLOW_STOP_DRAIN_TIME,
    THRESHOLD_FLOW_STOP_AGE,
    THRESHOLD_ADMIN,
    THRESHOLD_MEMORY,
    THRESHOLD_DISK,
)
"""Every value of FLOW_STOPPED's ``threshold``."""

LOGIN_THROTTLED: Final = "too many failed logins from"
"""How an ERROR UNAUTHORIZED refusing a throttled login begins (its address failed too often lately, so the
credentials were not looked at): the SDK raises a plain HandshakeError for it, which a reconnect retries,
not the AuthenticationError of refused credentials."""

# -- DECLARE_QUEUE ----------------------------------------------------------------------------------------

OVERFLOW: Final = "overflow"
OVERFLOW_REJECT: Final = "reject"
OVERFLOW_DROP_HEAD: Final = "drop-head"
OVERFLOW_POLICIES: Final = (OVERFLOW_REJECT, OVERFLOW_DROP_HEAD)
"""What a queue at its hard limit does with one more message (the ``overflow`` argument)."""

QUEUE_ARGUMENTS: Final = (
    THRESHOLD_FLOW_STOP_COUNT,
    "flow_resume_count",
    THRESHOLD_FLOW_STOP_SIZE,
    "flow_resume_size",
    THRESHOLD_FLOW_STOP_DRAIN_TIME,
    "flow_resume_drain_time",
    THRESHOLD_FLOW_STOP_AGE,
    "flow_resume_age",
    "max_count",
    "max_size",
    OVERFLOW,
)
"""The keys of DECLARE_QUEUE's ``arguments``; also the keys of a queue's ``thresholds`` in the admin API,
and what ``PATCH /api/queues/{name}`` accepts."""
TIME_QUEUE_ARGUMENTS: Final = (THRESHOLD_FLOW_STOP_DRAIN_TIME, "flow_resume_drain_time", THRESHOLD_FLOW_STOP_AGE,
                               "flow_resume_age")
"""The queue arguments in seconds (floats; 0 = off): latency-bounded flow control (docs/policies.md)."""

# -- DECLARE_EXCHANGE and TRANSFER ------------------------------------------------------------------------

EXCHANGE_DIRECT: Final = "direct"
EXCHANGE_FANOUT: Final = "fanout"
EXCHANGE_TOPIC: Final = "topic"
EXCHANGE_KINDS: Final = (EXCHANGE_DIRECT, EXCHANGE_FANOUT, EXCHANGE_TOPIC)
"""DECLARE_EXCHANGE's ``kind``."""

DEFAULT_EXCHANGE: Final = ""
"""The exchange a TRANSFER names to go straight to the queue its routing key names (AMQP's default)."""
BUILTIN_EXCHANGES: Final = (("amq.direct", EXCHANGE_DIRECT), ("amq.fanout", EXCHANGE_FANOUT), ("amq.topic", EXCHANGE_TOPIC))
"""(name, kind) of the exchanges every broker has from the start and never deletes (AMQP's rule)."""
