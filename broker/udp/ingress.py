"""The images of the UDP publications producers registered over TCP (sans-IO): the status-message window
is the producer's credit, the consumption position its completion point.

TO BE BUILT (issue 11, helper "ingress"); the interface DataPath and the core call is fixed:
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowbroker.broker.udp.datapath import Address, Outgoing

if TYPE_CHECKING:
    from flowbroker.broker.session import Session
    from flowbroker.broker.udp.datapath import DataPath

__all__ = ["Ingress"]


class Ingress:
    def __init__(self, datapath: DataPath) -> None:
        self.datapath = datapath
        self.publications: dict[int, Any] = {}  # session id -> the publication's state

    def register(self, owner: Session, exchange: str, routing_key: str, stream_id: int,
                 source: tuple[str, int], now_ns: int) -> dict[str, Any]:
        """REGISTER_PUBLICATION from `owner`: the OK's result. Raises core.RequestError when refused."""
        raise NotImplementedError

    def close_publication(self, owner: Session, session_id: int, now_ns: int) -> dict[str, Any]:
        raise NotImplementedError

    def close_owner(self, owner_conn_id: int, now_ns: int) -> None:
        pass

    def on_datagram(self, data: bytes | bytearray | memoryview, source: Address, session_id: int, stream_id: int,
                    now_ns: int) -> str | None:
        """Hand a DATA/PAD/SETUP/RTTM datagram to its image; the refusal reason, or None if taken."""
        return "unregistered_session"

    def do_work(self, now_ns: int) -> Outgoing:
        return []

    def deadline_ns(self, now_ns: int) -> int:
        return now_ns + 1_000_000_000
