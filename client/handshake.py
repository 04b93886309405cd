"""Opening a connection: the stream and the HELLO/WELCOME handshake, within one deadline.

`open_connection` is the one place a connection's stream is made, so TLS (issue 15) drops in here: `connect`
opens TCP from a `flowbroker://` URL, `connect_stream` takes a stream the caller opened. Every failure
before WELCOME is a HandshakeError that says what to do (wrong port, refused, timed out), and the stream is
closed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from flowbroker.client.connection import RECEIVE_SIZE, Connection
from flowbroker.client.errors import HandshakeError
from flowbroker.client.url import DEFAULT_URL, parse_url
from flowbroker.protocol import (
    CAPABILITY_MANDATORY,
    PROTOCOL_VERSION,
    Close,
    Error,
    Hello,
    RemoteProtocolError,
    Role,
    Welcome,
)
from flowbroker.protocol import Connection as ProtocolConnection

__all__ = ["connect", "connect_stream", "open_connection"]


async def connect(
    url: str = DEFAULT_URL,
    *,
    client_name: str = "flowbroker-python",
    flow_control: bool = True,
    timeout: float = 10.0,
    auth: dict[str, Any] | None = None,
    request_timeout: float = 30.0,
    close_timeout: float = 5.0,
    reconnect_timeout: float = 30.0,
) -> Connection:
    """Open TCP and do the HELLO/WELCOME handshake, all within `timeout` seconds.

    Returns a Connection to use as `async with await connect(...) as conn`. Raises HandshakeError
    (refused, timed out, or answered with ERROR/CLOSE) or ValueError for a bad URL. A connection with
    idempotent producers that is lost reconnects to the same URL for up to `reconnect_timeout` seconds
    (docs/client.md, "Idempotent producers"); others close as before.
    """
    address = parse_url(url)
    hello = Hello(PROTOCOL_VERSION, client_name, flow_control, [CAPABILITY_MANDATORY], auth)

    async def open_tcp() -> trio.abc.Stream:
        return await trio.open_tcp_stream(address.host, address.port)

    async def reopen() -> tuple[trio.abc.Stream, ProtocolConnection, Welcome]:
        return await handshake(open_tcp, hello, address, timeout)

    stream, proto, welcome = await handshake(open_tcp, hello, address, timeout)
    conn = Connection(stream, proto, welcome, request_timeout=request_timeout, close_timeout=close_timeout,
                      reopen=reopen, reconnect_timeout=reconnect_timeout)
    conn.udp_endpoint = address.udp
    return conn


async def connect_stream(
    stream: trio.abc.Stream,
    *,
    client_name: str = "flowbroker-python",
    flow_control: bool = True,
    timeout: float = 10.0,
    auth: dict[str, Any] | None = None,
    request_timeout: float = 30.0,
    close_timeout: float = 5.0,
) -> Connection:
    """`connect` over a stream the caller opened (a `trio.SSLStream` over TCP, an in-memory stream in a
    test): the HELLO/WELCOME handshake within `timeout`, then a Connection that owns the stream (it
    closes it; so does a failed handshake). Raises HandshakeError as `connect` does."""
    hello = Hello(PROTOCOL_VERSION, client_name, flow_control, [CAPABILITY_MANDATORY], auth)

    async def given() -> trio.abc.Stream:
        return stream

    return await open_connection(given, hello, "the broker", timeout, request_timeout, close_timeout)


async def open_connection(
    open_stream: Callable[[], Awaitable[trio.abc.Stream]],
    hello: Hello,
    address: object,
    timeout: float,
    request_timeout: float,
    close_timeout: float,
) -> Connection:
    """Open the stream and do the handshake on it, all within `timeout`; the one place a connection's
    stream is made (TLS goes here: `open_stream` returns whatever trio stream the URL asks for)."""
    stream, proto, welcome = await handshake(open_stream, hello, address, timeout)
    return Connection(stream, proto, welcome, request_timeout=request_timeout, close_timeout=close_timeout)


async def handshake(
    open_stream: Callable[[], Awaitable[trio.abc.Stream]], hello: Hello, address: object, timeout: float
) -> tuple[trio.abc.Stream, ProtocolConnection, Welcome]:
    """`open_connection` without the Connection: the stream, its protocol state after WELCOME, and the
    WELCOME (also how a lost connection reopens: `Connection(reopen=...)`)."""
    stream: trio.abc.Stream | None = None
    proto = ProtocolConnection(Role.CLIENT)
    try:
        with trio.fail_after(timeout):
            stream = await open_stream()
            await stream.send_all(proto.send(hello))
            welcome = await _await_welcome(stream, proto, address)
    except trio.TooSlowError:
        await _close_quietly(stream)
        raise HandshakeError(f"no WELCOME from {address} within {timeout} s") from None
    except OSError as exc:
        await _close_quietly(stream)
        raise HandshakeError(f"cannot connect to {address}: {exc}") from exc
    except (HandshakeError, RemoteProtocolError, trio.BrokenResourceError) as exc:
        await _close_quietly(stream)
        if isinstance(exc, HandshakeError):
            raise
        raise HandshakeError(f"handshake with {address} failed: {exc}") from exc
    except BaseException:
        await _close_quietly(stream)
        raise
    proto.set_max_frame_size(max(64, welcome.max_frame_size))
    assert stream is not None
    return stream, proto, welcome


async def _await_welcome(stream: trio.abc.Stream, proto: ProtocolConnection, address: object = "the peer") -> Welcome:
    error: Error | None = None
    head = b""  # the first bytes: an HTTP answer ("HTTP/1.1 400 ...") means this is not the broker port
    while True:
        data = await stream.receive_some(RECEIVE_SIZE)
        if len(head) < 4:
            head += bytes(data[: 4 - len(head)])
            if head == b"HTTP":
                raise HandshakeError(
                    f"{address} answered in HTTP: this is an HTTP port (the broker's admin API?), not the broker "
                    f"port; the broker port is 5680 unless [server] port says otherwise (flowbroker://HOST:5680)"
                )
        proto.receive_data(bytes(data))
        while (frame := proto.next_frame()) is not None:
            if isinstance(frame, Welcome):
                return frame
            if isinstance(frame, Error):
                error = frame
            elif isinstance(frame, Close):
                code = error.code if error is not None else frame.code
                text = f"{error.text}; " if error is not None else ""
                raise HandshakeError(f"broker refused the connection: {text}{frame.reason}", code)
        if not data:
            raise HandshakeError("the broker closed the connection during the handshake", error.code if error else None)


async def _close_quietly(stream: trio.abc.Stream | None) -> None:
    if stream is not None:
        await trio.aclose_forcefully(stream)

