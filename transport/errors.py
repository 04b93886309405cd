"""Exceptions of the transport. Only caller mistakes raise; wire problems are counted, never raised."""

from __future__ import annotations

__all__ = ["ChannelUriError", "EndpointClosedError", "TransportError"]


class TransportError(Exception):
    """Base of everything the transport raises."""


class ChannelUriError(TransportError, ValueError):
    """A channel URI that cannot be used; ``part`` is the parameter (or piece) that is wrong."""

    def __init__(self, uri: str, part: str, problem: str) -> None:
        self.uri = uri
        self.part = part
        self.problem = problem
        super().__init__(f"bad channel {uri!r}: {part}: {problem}")


class EndpointClosedError(TransportError):
    """A UDP endpoint was used after ``close()``."""
