"""The strings a client may put in HELLO's `capabilities` to ask for behaviour beyond the base protocol.

Why capabilities rather than a new field or a version: a broker that does not know a string ignores it
and the connection behaves as protocol version 1 always did, so an older broker and a newer client (or
the reverse) still interoperate. The broker does not echo what it accepted (WELCOME has no field for
it); both ends come from the same flowbroker distribution.
"""

from __future__ import annotations

__all__ = ["CAPABILITY_DELIVER_BATCH", "CAPABILITY_MANDATORY", "KNOWN_CAPABILITIES"]

CAPABILITY_MANDATORY = "mandatory"
"""Report every transfer that reached no queue (an exchange with no matching binding) with ERROR
`UNROUTABLE` (ref_id = its transfer id, destination = the exchange), instead of completing it silently.
The transfer is completed as before, so window and credit keep moving. AMQP's `mandatory` flag, per
connection: the SDK always asks, counts what comes back on the producer (`stats.unroutable`), and makes
it a failure only for producers created with `mandatory=True`."""

CAPABILITY_DELIVER_BATCH = "deliver-batch"
"""The connection's UDP consumers take DELIVER_BATCH payloads (protocol/envelope.py): the broker packs a
run of deliveries into one Aeron message of up to a datagram, as a DELIVER frame packs them into one
frame, instead of one DELIVER payload per message. Over UDP a message costs both ends per payload (the
term walk, a decode, the per-fragment checks), so one payload per message made the UDP consumer about
twice as costly as a TCP one. A consumer without it (an older SDK) still gets one DELIVER per message."""

KNOWN_CAPABILITIES = frozenset({CAPABILITY_MANDATORY, CAPABILITY_DELIVER_BATCH})
