"""The strings a client may put in HELLO's `capabilities` to ask for behaviour beyond the base protocol.

Why capabilities rather than a new field or a version: a broker that does not know a string ignores it
and the connection behaves as protocol version 1 always did, so an older broker and a newer client (or
the reverse) still interoperate. The broker does not echo what it accepted (WELCOME has no field for
it); both ends come from the same flowbroker distribution.
"""

from __future__ import annotations

__all__ = ["CAPABILITY_MANDATORY", "KNOWN_CAPABILITIES"]

CAPABILITY_MANDATORY = "mandatory"
"""Report every transfer that reached no queue (an exchange with no matching binding) with ERROR
`UNROUTABLE` (ref_id = its transfer id, destination = the exchange), instead of completing it silently.
The transfer is completed as before, so window and credit keep moving. AMQP's `mandatory` flag, per
connection: the SDK always asks, counts what comes back on the producer (`stats.unroutable`), and makes
it a failure only for producers created with `mandatory=True`."""

KNOWN_CAPABILITIES = frozenset({CAPABILITY_MANDATORY})
