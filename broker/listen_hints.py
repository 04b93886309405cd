"""What to do when a listening address cannot be taken, by cause.

Every listener of `flowbroker serve` (the broker's TCP port, [admin], [metrics], [tls], [udp]) fails the
same few ways, and the fix differs by cause: "another broker running?" for an address this host does not
have sent a user after the wrong fix (a tester). One table, so each listener names its own options.
"""

from __future__ import annotations

import errno
import socket


def listen_hint(exc: OSError, host: str, host_option: str, port_option: str) -> str:
    """The hint for `exc` raised binding or resolving `host`: `host_option` and `port_option` say where
    the address is set ("--host or [server] host", "--port or [server] port")."""
    if isinstance(exc, socket.gaierror):  # a host name that does not resolve
        return f"is {host} a name this host can resolve? {host_option}"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"is {host} an address of this host? {host_option}"
    if exc.errno == errno.EACCES:
        return f"a port below 1024 needs privileges: {port_option} to choose another"
    return f"another broker running? {port_option} to choose another"
