"""Opening a connection: the stream and the HELLO/WELCOME handshake, within one deadline.

`open_connection` is the one place a connection's stream is made, so TLS (issue 15) drops in here: `connect`
opens TCP from a `flowbroker://` URL, `connect_stream` takes a stream the caller opened. Every failure
before WELCOME is a HandshakeError that says what to do (wrong port, refused, timed out), and the stream is
closed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import dataclasses
import ssl

import trio

from flowbroker.client.connection import RECEIVE_SIZE, Connection
from flowbroker.client.credentials import AuthArg, hello_auth
from flowbroker.client.errors import AuthenticationError, HandshakeError, check_timeout, check_timeout_option
from flowbroker.client.url import DEFAULT_URL, parse_url
from flowbroker.protocol import (
    CAPABILITY_DELIVER_BATCH,
    CAPABILITY_MANDATORY,
    PROTOCOL_VERSION,
    AuthChallenge,
    AuthResponse,
    Close,
    Error,
    ErrorCode,
    Hello,
    RemoteProtocolError,
    Role,
    Welcome,
)
from flowbroker.protocol import Connection as ProtocolConnection
from flowbroker.protocol.names import LOGIN_THROTTLED
from flowbroker.protocol.scram import ScramClient, ScramError

__all__ = ["connect", "connect_stream", "open_connection"]


async def connect(
    url: str = DEFAULT_URL,
    *,
    client_name: str = "flowbroker-python",
    flow_control: bool = True,
    timeout: float = 10.0,
    auth: AuthArg = None,
    request_timeout: float = 30.0,
    close_timeout: float = 5.0,
    ssl_context: ssl.SSLContext | None = None,
    reconnect_timeout: float = 30.0,
) -> Connection:
    """Open TCP (and TLS for a `flowbroker+tls://` URL) and do the HELLO/WELCOME handshake, all within
    `timeout` seconds. `ssl_context`: for TLS, the CA to trust and a client certificate to present
    (default: `ssl.create_default_context()`, the system's CAs, the URL's host checked).

    Returns a Connection to use as `async with await connect(...) as conn`. Raises HandshakeError
    (refused, timed out, or answered with ERROR/CLOSE) or ValueError for a bad URL. A connection with
    idempotent producers that is lost reconnects to the same URL for up to `reconnect_timeout` seconds
    (docs/client.md, "Idempotent producers"), over TLS again for a `flowbroker+tls://` URL and logging in
    again with the same `auth` (a fresh SCRAM exchange: a new client nonce); others close as before.
    """
    address = parse_url(url)
    hello = Hello(PROTOCOL_VERSION, client_name, flow_control, [CAPABILITY_MANDATORY, CAPABILITY_DELIVER_BATCH])
    check_connection_timeouts(request_timeout, close_timeout, reconnect_timeout)

    if ssl_context is not None and not address.tls:
        raise ValueError(f"{url!r}: ssl_context is for flowbroker+tls:// URLs")
    context = (ssl_context or ssl.create_default_context()) if address.tls else None

    async def open_tcp() -> trio.abc.Stream:
        tcp = await trio.open_tcp_stream(address.host, address.port)
        if context is None:
            return tcp
        tls = trio.SSLStream(tcp, context, server_hostname=address.host)
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError as exc:
            await trio.aclose_forcefully(tls)
            cause = exc.__cause__ or exc
            text = str(cause)
            hint = (" (this port does not speak TLS: the broker's plain port? Its TLS port is [tls] port)"
                    if "WRONG_VERSION_NUMBER" in text else
                    " (trust the CA that signed the broker's certificate: the SDK's ssl_context= with "
                    "load_verify_locations, or SSL_CERT_FILE for the CLI, docs/security.md)"
                    if "CERTIFICATE_VERIFY_FAILED" in text else "")
            raise HandshakeError(f"TLS handshake with {address} failed: {cause}{hint}") from exc
        return tls

    async def reopen() -> tuple[trio.abc.Stream, ProtocolConnection, Welcome]:
        return await handshake(open_tcp, hello, address, timeout, auth)

    stream, proto, welcome = await handshake(open_tcp, hello, address, timeout, auth)
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
    auth: AuthArg = None,
    request_timeout: float = 30.0,
    close_timeout: float = 5.0,
) -> Connection:
    """`connect` over a stream the caller opened (a `trio.SSLStream` over TCP, an in-memory stream in a
    test): the HELLO/WELCOME handshake within `timeout`, then a Connection that owns the stream (it
    closes it; so does a failed handshake). Raises HandshakeError as `connect` does."""
    hello = Hello(PROTOCOL_VERSION, client_name, flow_control, [CAPABILITY_MANDATORY, CAPABILITY_DELIVER_BATCH])
    check_connection_timeouts(request_timeout, close_timeout)

    async def given() -> trio.abc.Stream:
        return stream

    return await open_connection(given, hello, "the broker", timeout, request_timeout, close_timeout, auth)


def check_connection_timeouts(request: float, close: float, reconnect: float = 30.0) -> None:
    """The connection's own timeouts, checked before anything is opened: NaN is a ValueError naming the
    option (it was taken, and failed only at the close, in trio's words, a tester); a negative one is a
    deadline already passed, as everywhere in the SDK (the Connection takes a negative close_timeout as 0)."""
    for name, value in (("request_timeout", request), ("close_timeout", close), ("reconnect_timeout", reconnect)):
        check_timeout_option(name, value)


async def open_connection(
    open_stream: Callable[[], Awaitable[trio.abc.Stream]],
    hello: Hello,
    address: object,
    timeout: float,
    request_timeout: float,
    close_timeout: float,
    auth: AuthArg = None,
) -> Connection:
    """Open the stream and do the handshake on it, all within `timeout`; the one place a connection's
    stream is made (TLS goes here: `open_stream` returns whatever trio stream the URL asks for)."""
    stream, proto, welcome = await handshake(open_stream, hello, address, timeout, auth)
    return Connection(stream, proto, welcome, request_timeout=request_timeout, close_timeout=close_timeout)


async def handshake(
    open_stream: Callable[[], Awaitable[trio.abc.Stream]],
    hello: Hello,
    address: object,
    timeout: float,
    auth: AuthArg = None,
) -> tuple[trio.abc.Stream, ProtocolConnection, Welcome]:
    """`open_connection` without the Connection: the stream, its protocol state after WELCOME, and the
    WELCOME (also how a lost connection reopens: `Connection(reopen=...)`). `auth` (credentials, not a
    HELLO auth map already built) is turned into HELLO's auth here, on every call: a reconnect logs in with
    a SCRAM exchange of its own (a new client nonce), continued when the broker sends AUTH_CHALLENGE; a
    `hello` that carries an auth map already is sent as it is."""
    check_timeout("connect", timeout)
    scram: ScramClient | None = None
    if auth is not None:
        auth_map, scram = hello_auth(auth)
        hello = dataclasses.replace(hello, auth=auth_map)
    stream: trio.abc.Stream | None = None
    proto = ProtocolConnection(Role.CLIENT)
    try:
        with trio.fail_after(max(timeout, 0.0)):  # a negative one: a deadline already passed
            stream = await open_stream()
            await stream.send_all(proto.send(hello))
            welcome = await _await_welcome(stream, proto, address, scram)
    except trio.TooSlowError:
        await _close_quietly(stream)
        # With credentials, the likeliest cause is the login throttle, not a broker that is down: a few
        # mistyped passwords and the CLI said only this (a tester).
        hint = ("; the broker delays the logins of an address that failed some recently (up to [auth] "
                "failed_login_max_delay, 30 s by default; docs/security.md): a longer timeout waits for the turn"
                if auth is not None and stream is not None else "")
        raise HandshakeError(f"no WELCOME from {address} within {timeout} s{hint}") from None
    except OSError as exc:
        await _close_quietly(stream)
        raise HandshakeError(f"cannot connect to {address}: {exc} (is the broker running there? `flowbroker serve` "
                             "listens on 127.0.0.1:5680 unless --port says otherwise)") from exc
    except (HandshakeError, RemoteProtocolError, trio.BrokenResourceError) as exc:
        await _close_quietly(stream)
        if isinstance(exc, HandshakeError):
            raise
        cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) and exc.__cause__ else exc
        # TLS 1.3: the broker refuses a client certificate after the handshake, with an alert or a reset
        if isinstance(cause, ssl.SSLError) or (isinstance(stream, trio.SSLStream) and isinstance(cause, ConnectionResetError)):
            raise HandshakeError(f"handshake with {address} failed: TLS: {cause} (the broker may require a client "
                                 "certificate it trusts: the SDK's ssl_context= with load_cert_chain; the CLI "
                                 "presents none: use the SDK, or the plain port with a user and password)") from exc
        raise HandshakeError(f"handshake with {address} failed: {str(cause) or type(cause).__name__}") from exc
    except BaseException:
        await _close_quietly(stream)
        raise
    proto.set_max_frame_size(max(64, welcome.max_frame_size))
    assert stream is not None
    return stream, proto, welcome


async def _await_welcome(
    stream: trio.abc.Stream, proto: ProtocolConnection, address: object = "the peer", scram: ScramClient | None = None
) -> Welcome:
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
        try:
            proto.receive_data(bytes(data))
            frame = proto.next_frame()
        except RemoteProtocolError as exc:
            if proto.frames_received:
                raise
            # Its first bytes are no frame: another protocol's server (an SSH banner read as a frame of
            # 1.4 GB "exceeds max_frame_size", a tester), not a broker with a bad frame.
            raise HandshakeError(f"{address} does not speak the flowbroker protocol: its first bytes {head!r} "
                                 f"are no frame ({exc}); is this the broker port (5680 unless [server] port "
                                 "says otherwise)?") from None
        while frame is not None:
            if isinstance(frame, Welcome):
                if scram is not None:
                    _verify_broker(scram, frame, address)
                return frame
            if isinstance(frame, AuthChallenge):
                if scram is None:
                    raise HandshakeError(f"{address} sent AUTH_CHALLENGE, but this connection has no SCRAM exchange")
                try:
                    await stream.send_all(proto.send(AuthResponse(scram.final(frame.data))))
                except ScramError as exc:
                    raise HandshakeError(f"{address}: bad SCRAM challenge: {exc}") from None
            elif isinstance(frame, Error):
                error = frame
            elif isinstance(frame, Close):
                code = error.code if error is not None else frame.code
                # The broker's CLOSE usually repeats its ERROR's text: say it once.
                texts = [error.text] if error is not None else []
                if frame.reason and frame.reason not in texts:
                    texts.append(frame.reason)
                refused = AuthenticationError if code is ErrorCode.UNAUTHORIZED else HandshakeError
                if code is ErrorCode.UNAUTHORIZED and texts and texts[0].startswith(LOGIN_THROTTLED):
                    # The address's failed logins (perhaps another client's on it), not these credentials,
                    # which the broker did not look at: worth trying again later, a reconnect does.
                    refused = HandshakeError
                # (named: a Spark job's error showed "authentication failed", never the UNAUTHORIZED that
                # docs/spark.md says, and its code travelled as a bare 15, a tester)
                raise refused(f"broker refused the connection ({getattr(code, 'name', code)}): {'; '.join(texts)}", code)
            frame = proto.next_frame()
        if not data:
            hint = "" if head else (": it sent nothing back (a TLS port? It needs a flowbroker+tls:// URL)")
            raise HandshakeError(f"the broker closed the connection during the handshake{hint}",
                                 error.code if error else None)


def _verify_broker(scram: ScramClient, welcome: Welcome, address: object) -> None:
    """SCRAM is mutual: a WELCOME without the broker's proof, or with a wrong one, is not the broker
    holding this user's credential (an impostor, or a man in the middle)."""
    if welcome.auth_data is None:
        raise AuthenticationError(f"{address} let us in without proving it knows our credential (WELCOME has "
                                  "no SCRAM server signature): not trusted")
    try:
        scram.verify(welcome.auth_data)
    except ScramError as exc:
        raise AuthenticationError(f"{address}: {exc}") from None


async def _close_quietly(stream: trio.abc.Stream | None) -> None:
    if stream is not None:
        await trio.aclose_forcefully(stream)

