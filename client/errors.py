"""The SDK's one error hierarchy, rooted at `FlowbrokerError`.

Why typed errors: the user complaints this project answers (publishers that hang with no error,
rejections nobody can attribute to a queue) come down to errors that carry no facts. Every error here
carries the protocol's `code` and, where there is one, the `destination` (queue) it concerns, as
attributes a program can match on, not only text.

    FlowbrokerError
    ├── BrokerConnectionError          the connection is unusable
    │   ├── HandshakeError             TCP connect or HELLO/WELCOME failed or timed out
    │   └── ConnectionClosed           closed by either side; `code`, `reason`
    ├── ProtocolViolation              the broker sent something we cannot accept
    ├── FlowControlled                 no credit and the caller chose not to wait (block=False)
    │   └── FlowControlTimeout         no credit before the deadline (also a TimeoutError)
    ├── PublishError                   a message was refused; `destination`, `transfer_id`
    │   ├── QueueFull                  hard limit reached with overflow "reject"
    │   ├── MessageTooLarge            above the broker's max_message_size (`limit`)
    │   ├── KeyTooLong                 a routing key above MAX_KEY_BYTES (`limit`)
    │   ├── TooManyHeaders             more headers than MAX_HEADERS (`limit`)
    │   ├── NotFound                   no such queue/exchange
    │   └── Unroutable                 the exchange routed it to no queue (a `mandatory` producer)
    ├── PublishFailures                leaving a producer's or connection's block: what failed (`errors`,
    │                                  `failed`) and what was not completed in time (`unconfirmed`)
    ├── RequestError                   a declare/bind/... request failed; `request_id`
    │   └── RequestTimeout             no answer before the deadline (also a TimeoutError)
    ├── ReceiveTimeout                 no message before the deadline (also a TimeoutError)
    ├── ConsumerClosed                 receive() on a consumer the application closed, or whose
    │                                  connection it closed (also a trio.EndOfChannel)
    └── AlreadySettled                 a message was acked/rejected/requeued twice, or after its consumer
                                       closed (the broker requeued it)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import trio

from flowbroker.protocol import ErrorCode
from flowbroker.protocol.limits import MAX_KEY_BYTES, utf8_len
from flowbroker.protocol.names import ALL_DESTINATIONS

__all__ = [
    "FlowbrokerError",
    "BrokerConnectionError",
    "HandshakeError",
    "InvalidCredentials",
    "ConnectionClosed",
    "ProtocolViolation",
    "FlowControlled",
    "FlowControlTimeout",
    "PublishError",
    "QueueFull",
    "MessageTooLarge",
    "KeyTooLong",
    "TooManyHeaders",
    "NotFound",
    "Unroutable",
    "SequenceGap",
    "PublishFailures",
    "RequestError",
    "RequestTimeout",
    "ReceiveTimeout",
    "ConsumerClosed",
    "AlreadySettled",
    "publish_error",
    "block_error_name",
    "describe_stopped",
    "stopped_suffix",
]


class FlowbrokerError(Exception):
    """Base of every error the SDK raises on purpose."""


class BrokerConnectionError(FlowbrokerError):
    """The connection cannot be used (any more)."""


class HandshakeError(BrokerConnectionError):
    """Connecting or the HELLO/WELCOME handshake failed. `code` is the broker's, if it sent one."""

    def __init__(self, message: str, code: ErrorCode | None = None):
        super().__init__(message)
        self.code = code


class AuthenticationError(HandshakeError):
    """The broker refused this connection's credentials (ERROR UNAUTHORIZED at the handshake: a wrong
    password, an unknown user, a mechanism not allowed), or
    could not prove it holds them (SCRAM's server signature). Connecting again with the same credentials
    cannot succeed, so a reconnecting connection stops at the first one and closes with it."""


class InvalidCredentials(HandshakeError, ValueError):
    """Credentials the SDK cannot send: SASLprep (RFC 4013) refuses the user name or password (a control
    character, a prohibited or unassigned code point); nothing was sent. Also a ValueError, which it was
    alone (`except FlowbrokerError` missed it, a tester)."""


class ConnectionClosed(BrokerConnectionError):
    """The connection is closed. `code`/`reason` come from the CLOSE (or ERROR) frame that ended it,
    or describe why this side ended it (IDLE_TIMEOUT, NORMAL for a close the application asked for)."""

    def __init__(self, code: ErrorCode, reason: str):
        super().__init__(f"connection closed ({code.name}): {reason}")
        self.code = code
        self.reason = reason


class ProtocolViolation(FlowbrokerError):
    """The broker broke the protocol (a malformed or unexpected frame, an acknowledgement of bytes never
    sent). The SDK answered with ERROR + CLOSE; the connection is gone."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.MALFORMED_FRAME):
        super().__init__(message)
        self.code = code


class FlowControlled(FlowbrokerError):
    """No producer credit right now. `destinations` are the queues currently flow-stopped (may be empty
    when only the byte buffer or the window is exhausted); `limit` says which credit ran out:
    "window" (outstanding transfers), "buffer" (unacknowledged bytes) or "closed"; a `flush()` that timed
    out says "completions" (what it waits for)."""

    def __init__(self, message: str, destinations: Iterable[str] = (), limit: str = "buffer"):
        super().__init__(message)
        self.destinations: tuple[str, ...] = tuple(destinations)
        self.limit = limit

    @property
    def destination(self) -> str | None:
        """The first blocking queue, or None if no queue is flow-stopped."""
        return self.destinations[0] if self.destinations else None


class FlowControlTimeout(FlowControlled, TimeoutError):
    """The deadline passed while waiting for producer credit (or, from `flush`, for completions)."""

    def __init__(self, message: str, destinations: Iterable[str] = (), limit: str = "buffer", timeout: float = 0.0):
        super().__init__(message, destinations, limit)
        self.timeout = timeout


class PublishError(FlowbrokerError):
    """The broker refused a message (it still completed the transfer, so credit kept flowing), or `send()`
    refused it before sending anything because it is over a limit (then `transfer_id` is None)."""

    limit: str | None = None
    """The name of the limit the message is over (`MessageTooLarge`, `KeyTooLong`, `TooManyHeaders`)."""

    def __init__(self, code: ErrorCode, text: str, destination: str | None = None, transfer_id: int | None = None):
        where = f" (destination {destination!r})" if destination else ""  # a queue, or an exchange
        super().__init__(f"{code.name}{where}: {text}")
        self.code = code
        self.text = text
        self.destination = destination
        self.transfer_id = transfer_id


class QueueFull(PublishError):
    """The queue is at its hard limit and its overflow policy is `reject`."""


class MessageTooLarge(PublishError):
    """The whole message (body, routing key, exchange, header keys and values) is larger than the
    broker's `max_message_size` from WELCOME."""

    limit = "max_message_size"


class KeyTooLong(PublishError):
    """The routing key is longer than `MAX_KEY_BYTES` (256) bytes in UTF-8."""

    limit = "MAX_KEY_BYTES"


class TooManyHeaders(PublishError):
    """The message has more than `MAX_HEADERS` (64) headers. A frame carrying it would be refused by the
    broker with LIMIT_EXCEEDED, closing the connection, so `send()` never sends one."""

    limit = "MAX_HEADERS"


class NotFound(PublishError):
    """The destination does not exist (e.g. the default exchange's routing key names no queue)."""


class Unroutable(PublishError):
    """The exchange (`destination`) routed the message to no queue: no binding matched its routing key.
    Raised only for producers created with `mandatory=True`; others count it in `statistics().unroutable`."""

    def __init__(self, code: ErrorCode, text: str, destination: str | None = None, transfer_id: int | None = None):
        super().__init__(code, text, destination, transfer_id)
        self.args = (f"{code.name}: {text}",)  # `destination` is the exchange, which the text names


class SequenceGap(PublishError):
    """The broker expected another sequence from this idempotent producer's id (the text names it): it
    forgot the id (restarted, or the id was idle past `producer_id_ttl`) or another writer uses it. The
    message was not enqueued (docs/protocol.md, "Idempotent producers")."""


class PublishFailures(FlowbrokerError):
    """Raised when a producer's or a connection's `async with` (or `with`) block ends while messages sent
    in it were refused, or were still not completed when the close timeout ran out: what `flush()` would
    have raised, for everything not yet reported by a `flush()`. Never raised over an exception of the
    block itself (that one passes through; these are logged).

    `errors`: the refusals, typed (`NotFound`, `QueueFull`, `Unroutable`, ...), oldest first, at most
    `producer.MAX_KEPT_ERRORS` (100) per producer; `failed`: how many messages were refused in all;
    `unconfirmed`: how many were sent and not completed when the wait ended (held by a flow-stopped
    queue, or the connection closed, or their UDP producer was closed: not waited for): they may still be
    enqueued and delivered, so resending them may duplicate them;
    `destinations`: the flow-stopped queues at that moment ("*": all producers stopped by an operator or
    the broker's memory alarm; see FlowControlled)."""

    def __init__(
        self,
        errors: Iterable[PublishError],
        failed: int,
        unconfirmed: int = 0,
        destinations: Iterable[str] = (),
        why_unconfirmed: str = "",
    ):
        self.errors: tuple[PublishError, ...] = tuple(errors)
        self.failed = failed
        self.unconfirmed = unconfirmed
        self.destinations: tuple[str, ...] = tuple(destinations)
        parts = []
        if failed:
            first = f" (first: {self.errors[0]})" if self.errors else ""
            parts.append(f"{failed} message{'s' * (failed != 1)} refused{first}")
        if unconfirmed:
            stopped = stopped_suffix(self.destinations)
            parts.append(
                f"{unconfirmed} message{'s' * (unconfirmed != 1)} sent and not completed {why_unconfirmed}".rstrip()
                + f" (they may still be enqueued and delivered: resending may duplicate them){stopped}"
            )
        super().__init__("; ".join(parts) or "no failures")

    @property
    def first(self) -> PublishError | None:
        """The oldest refusal kept (what `flush()` would have raised), or None."""
        return self.errors[0] if self.errors else None


_PUBLISH_ERRORS: dict[ErrorCode, type[PublishError]] = {
    ErrorCode.QUEUE_FULL: QueueFull,
    ErrorCode.MESSAGE_TOO_LARGE: MessageTooLarge,
    ErrorCode.KEY_TOO_LONG: KeyTooLong,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.UNROUTABLE: Unroutable,
    ErrorCode.SEQUENCE_GAP: SequenceGap,
}


def publish_error(
    code: ErrorCode, text: str, destination: str | None = None, transfer_id: int | None = None
) -> PublishError:
    """The most specific PublishError for `code`."""
    return _PUBLISH_ERRORS.get(code, PublishError)(code, text, destination, transfer_id)


class RequestError(FlowbrokerError):
    """A request (declare, bind, subscribe, ...) failed with ERROR."""

    def __init__(self, code: ErrorCode, text: str, request_id: int | None = None, destination: str | None = None):
        super().__init__(f"{code.name}: {text}")
        self.code = code
        self.text = text
        self.request_id = request_id
        self.destination = destination


class RequestTimeout(RequestError, TimeoutError):
    """The broker did not answer a request before the deadline. Its `code` is IDLE_TIMEOUT (the broker
    said nothing about it: no fault of its own is known), and the request may still take effect."""

    def __init__(self, code: ErrorCode, text: str, request_id: int | None = None, destination: str | None = None):
        super().__init__(code, text, request_id, destination)
        self.args = (text,)  # str(): the text alone, not a broker error code it never sent

    def __str__(self) -> str:
        return self.text


class ReceiveTimeout(FlowbrokerError, TimeoutError):
    """No message arrived before the deadline."""


class ConsumerClosed(FlowbrokerError, trio.EndOfChannel):
    """`receive()` on a consumer that has no more messages because the application closed it, or closed
    its connection (a connection that failed raises its own error instead). A trio.EndOfChannel, as a
    closed channel's receive raises, and a FlowbrokerError, so that a plain-Python caller catching the
    SDK's errors sees it: it was a bare EndOfChannel with no text (a tester)."""


class AlreadySettled(FlowbrokerError):
    """A message can be acked, rejected or requeued once, and only while its consumer is open: closing it
    (or the broker ending it, a revoked read permission) has the broker requeue what was handed out and
    not settled, so a later ack would settle nothing while another consumer gets the message again."""


def block_error_name(exc: BaseException) -> str:
    """The name of the exception that ended a block, for the log (the blocking API's stand-in carries
    the name of the exception its `with` block raised)."""
    name = getattr(exc, "block_error_name", None)
    return name if isinstance(name, str) else type(exc).__name__


def check_key(key: str, what: str = "binding key") -> None:
    """A key the broker would refuse KEY_TOO_LONG, refused here as it would be, before anything is sent."""
    size = utf8_len(key)
    if size > MAX_KEY_BYTES:
        raise RequestError(
            ErrorCode.KEY_TOO_LONG, f"{what} of {size} bytes exceeds the limit of {MAX_KEY_BYTES} bytes (MAX_KEY_BYTES)"
        )


def check_timeout(what: str, timeout: float | None, default: str = "") -> None:
    """A timeout the SDK takes: seconds (a negative one is a deadline already passed, as 0), None for
    `default` (if the wait has one); NaN, which no comparison can place, is a ValueError naming the wait."""
    if timeout is not None and timeout != timeout:
        alternative = f", or None for {default}" if default else ""
        raise ValueError(f"{what} timeout must be a number of seconds{alternative}, got nan")


def check_timeout_option(name: str, value: float) -> None:
    """A default timeout given as an option (`close_timeout`, `send_timeout`, ...): NaN is a ValueError
    naming the option, when it is given, not at the first wait that uses it."""
    if value != value:
        raise ValueError(f"{name} must be a number of seconds, got nan")


def stopped_suffix(destinations: Sequence[str]) -> str:
    """"; flow-stopped: ..." for a flow-control error's text, or "" when nothing is flow-stopped."""
    return f"; flow-stopped: {describe_stopped(destinations)}" if destinations else ""


STOPPED_NAMED = 10
"""Flow-stopped destinations an error's text names; the rest are counted (the exception's
`destinations` holds them all). With 200 stopped queues a FlowControlTimeout's text ran to 9,000
characters (a tester)."""


def describe_stopped(destinations: Iterable[str]) -> str:
    """Flow-stopped destinations for a message, "*" explained: it is not a queue but every producer,
    stopped by an operator's stop-all or by the broker's memory alarm. At most STOPPED_NAMED named."""
    shown = list(destinations)
    text = ", ".join(
        "* (all producers: an operator's stop-all or the broker's memory alarm)" if d == ALL_DESTINATIONS else d
        for d in shown[:STOPPED_NAMED]
    )
    more = len(shown) - STOPPED_NAMED
    return f"{text} and {more} more" if more > 0 else text
