"""The broker's publications to UDP consumers (sans-IO): one per UDP subscription; the consumer's
status-message window is its byte credit, its consumption position advances as its application processes.

TO BE BUILT (issue 11, helper "egress"); the interface DataPath and the core call is fixed:
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowbroker.broker.udp.datapath import Address, Outgoing

if TYPE_CHECKING:
    from flowbroker.broker.session import Session
    from flowbroker.broker.udp.datapath import DataPath

__all__ = ["Egress"]


class Egress:
    def __init__(self, datapath: DataPath) -> None:
        self.datapath = datapath
        self.subscriptions: dict[int, Any] = {}  # session id -> the UDP subscription

    def subscribe(self, owner: Session, subscription_id: int, queue: str, prefetch: int, buffer_size: int,
                  destination: tuple[str, int], stream_id: int, now_ns: int) -> dict[str, Any]:
        """SUBSCRIBE_UDP from `owner`: the OK's result. Raises core.RequestError when refused."""
        raise NotImplementedError

    def close_owner(self, owner_conn_id: int, now_ns: int) -> None:
        pass

    def on_datagram(self, data: bytes | bytearray | memoryview, source: Address, session_id: int, stream_id: int,
                    now_ns: int) -> str | None:
        """Hand an SM/NAK/ERR/RTTM to its publication; the refusal reason, or None if taken."""
        return "unregistered_session"

    def do_work(self, now_ns: int) -> Outgoing:
        return []

    def deadline_ns(self, now_ns: int) -> int:
        return now_ns + 1_000_000_000
