"""A producer whose messages travel over UDP, the Aeron data path (docs/client.md, "Producing over UDP").

`conn.producer(..., transport="udp")` returns one. It behaves like the TCP `Producer` (it is one: the same
deadlines, errors, statistics, flow events and end-of-block report) but sends each message as an Aeron
DATA frame of its own `Publication` to the broker's UDP endpoint, registered over the TCP connection:

- on first use it binds a UDP socket on the TCP connection's local address, sends REGISTER_PUBLICATION
  (exchange, default routing key, stream id, its UDP port) and gets the session id, term length and mtu
  to publish with;
- the broker's status messages pace it: their window is this producer's credit grant and their
  consumption position is the broker's completion point. `send` offers the message to the publication's
  term and returns its position; while the term is full (the broker's window closed: a saturated queue,
  a stop-all, the memory alarm) it waits, at most `timeout`, then raises `FlowControlTimeout` naming the
  flow-stopped queues (`block=False`: `FlowControlled` at once);
- a message is complete once the consumption position passes it: `flush()` waits for that, and raises
  the refusals the broker relayed for this publication (ERROR with its session id), typed as for TCP.
  Leaving the producer's `async with` flushes (at most `close_timeout`) and closes the publication.

A message carries its routing key and headers only when they differ from the registration's (the
envelope of protocol/envelope.py). When the broker's answer says `publish_batch`, a burst of bare messages
goes as PUBLISH_BATCH payloads, as many bodies to an Aeron message as fit one datagram: `send` claims each
body's place in the open batch (the position it returns is the batch's end as it stands with that body, so
the broker's consumption position, which moves to the end of a whole batch, passes it exactly when the
batch is complete), and a batch is appended to the term once the next body no longer fits it.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import socket
from types import TracebackType
from typing import TYPE_CHECKING, Any

import trio

from flowbroker.client.errors import (
    ConnectionClosed,
    FlowControlled,
    FlowControlTimeout,
    check_key,
    check_timeout,
    stopped_suffix,
)
from flowbroker.client.producer import _SHORT_KEY, Producer, check_message
from flowbroker.client.url import check_udp_endpoint
from flowbroker.protocol import ErrorCode, Headers
from flowbroker.protocol.envelope import (
    PUBLISH_BATCH_KIND,
    array_head_length,
    bin_length,
    encode_publish,
    pack_publish_bodies,
)
from flowbroker.protocol.frames import ClosePublication, RegisterPublication
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME
from flowbroker.transport.drivers import OfferVerdict, offer_verdict
from flowbroker.transport.frames import DATA_HEADER_LENGTH
from flowbroker.transport.publication import Publication, PublicationConfig
from flowbroker.transport.udp import DEFAULT_BATCH, UdpEndpoint, now_ns, open_udp

if TYPE_CHECKING:
    from flowbroker.client.connection import Connection

__all__ = ["UdpProducer", "DEFAULT_PUBLICATION_STREAM"]

log = logging.getLogger("flowbroker.client")

DEFAULT_PUBLICATION_STREAM = 1001
"""The Aeron stream id a UDP producer publishes on unless given one."""

PUBLICATION_WINDOW = 256 * 1024
"""Bytes the application may offer beyond what the broker's window lets the publication send (Aeron's
pub-wnd): how much a producer buffers on its own side before `send` waits."""

_LINGER_NS = 100_000_000  # after close: keep answering NAKs this long (the broker has completed everything)
_BARE_FRAME_EXTRA = DATA_HEADER_LENGTH + 1 + 31  # a bare body's frame: header, envelope byte, alignment


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


class UdpProducer(Producer):
    """A `Producer` over the UDP data path. Create it with `conn.producer(..., transport="udp")`."""

    def __init__(
        self,
        conn: Connection,
        exchange: str,
        routing_key: str,
        *,
        window: int = 1000,
        send_timeout: float = 60.0,
        mandatory: bool = False,
        stream_id: int = DEFAULT_PUBLICATION_STREAM,
        udp_endpoint: str | None = None,
    ) -> None:
        if udp_endpoint is not None:  # here, not at the first send: that would register, then fail
            check_udp_endpoint(udp_endpoint, "udp_endpoint")
        super().__init__(conn, exchange, routing_key, window=window, send_timeout=send_timeout, mandatory=mandatory)
        self.stream_id = stream_id
        self.udp_endpoint = udp_endpoint
        """The broker's UDP endpoint as host:port; None: the one REGISTER_PUBLICATION answers."""
        self.session_id: int | None = None
        self.publication: Publication | None = None
        self._endpoint: UdpEndpoint | None = None
        self._broker: tuple[str, int] | None = None
        """The broker's UDP endpoint, numeric: the only source of status messages this producer takes."""
        self.foreign = 0
        """Datagrams that reached this producer's socket from another address than the broker's endpoint,
        dropped: a forged status message moved the completion point past messages never routed, and
        `flush()` reported them complete (a tester)."""
        self._ends: collections.deque[int] = collections.deque()
        """The end position of each message sent and not yet complete, in order."""
        self._batch: list[Any] = []
        """What of bare messages `send` took and the publication has not been given yet: their bodies, or
        with `publish_batch` the bodies of each PUBLISH_BATCH (a list per batch, the last one open).
        Appended in one `Publication.offer_many` (`_commit`) once a datagram's worth waits, or before
        anything else touches the publication. Their positions were claimed by `send` as the append will
        write them."""
        self._batch_end = 0  # the tail once the batch is appended: where the next message starts
        self._batch_room = 0  # bytes of the active term left after the batch
        self._claim_limit = 0  # the publication limit the batch's claims were checked against (see _commit)
        self._bare_limit = 0  # a bare body shorter than this is one frame (mtu - header)
        self._publish_batch = False  # the broker takes PUBLISH_BATCH (REGISTER_PUBLICATION's answer)
        self._open_start = 0  # where the open PUBLISH_BATCH starts
        self._open_length = 0  # its payload's bytes so far
        self._opening: trio.Lock = trio.Lock()
        self._dirty = trio.Event()
        self._done = trio.Event()
        self._closed = False
        self._scope = trio.CancelScope()  # the run task's: aclose ends it

    # -------------------------------------------------------------- state

    def has_credit(self) -> bool:
        """A message may be offered now without waiting (the publication's term has room)."""
        pub = self.publication
        return (pub is not None and self._outstanding < self.window and pub.is_connected
                and (self._batch_end if self._batch else pub.position) < pub.publication_limit)

    def _describe_wait(self) -> str:
        pub = self.publication
        if pub is None:
            return "UDP publication not registered yet"
        return (f"{self._outstanding}/{self.window} messages not complete, UDP publication {self.session_id}: "
                f"position {pub.position}, limit {pub.publication_limit}, broker's window "
                f"{pub.statistics().receiver_window} bytes")

    def _limit_name(self) -> str:
        if self._conn.is_closed:
            return "closed"
        return "window" if self._outstanding >= self.window else "buffer"

    # -------------------------------------------------------------- opening

    async def open(self, timeout: float | None = None) -> None:
        """Register the publication with the broker (done by the first `send` if not called)."""
        async with self._opening:
            if self.publication is not None:
                return
            conn = self._conn
            conn._check_open()
            # as the broker would answer, but before the request: one over 64 KiB was over the control
            # frames' limit, and the broker closed the connection (a tester)
            check_key(self.routing_key, "routing key")
            local_host = conn._local_host()
            endpoint = open_udp((local_host, 0), so_rcvbuf=1 << 20, so_sndbuf=1 << 20)
            try:
                port = int(endpoint.local_address[1])
                # Shielded (the request has its own deadline): a cancel while the answer is on its way would
                # leave a registration nobody knows the session id of, until the connection closes.
                with trio.CancelScope(shield=True):
                    answer: dict[str, Any] = await conn._request(
                        lambda rid: RegisterPublication(rid, self.exchange, self.routing_key, self.stream_id, port),
                        timeout,
                    )
            except BaseException:
                endpoint.close()
                raise
            try:
                await trio.lowlevel.checkpoint_if_cancelled()  # the cancel that came meanwhile, given back below
                host, broker_port = _host_port(self.udp_endpoint or conn.udp_endpoint or str(answer["endpoint"]))
                if host in ("0.0.0.0", "::", ""):
                    host = conn._peer_host() or host
                # The numeric address, once: status messages are taken from it alone (below), and sendto
                # does not resolve a name again for every datagram.
                infos = await trio.socket.getaddrinfo(host, broker_port, family=endpoint.family,
                                                      type=socket.SOCK_DGRAM)
                broker = (str(infos[0][4][0]), int(infos[0][4][1]))
                config = PublicationConfig(
                    session_id=int(answer["session_id"]), stream_id=self.stream_id,
                    term_length=int(answer["term_length"]), mtu=int(answer["mtu"]),
                    initial_term_id=random.randrange(-(2**31), 2**31),
                    publication_window=min(PUBLICATION_WINDOW, int(answer["term_length"]) // 2),
                    max_messages_per_send=1024, linger_ns=_LINGER_NS,
                )
                # The broker's image timed out (this process stopped past 10 s): the new one is sent again
                # what the broker had not consumed, not only what follows (docs/client.md).
                publication = Publication(config, now_ns(), destination=broker, rejoin_at_consumed=True)
            except BaseException:
                # Registered, but unusable: give the registration back, or each send would leave one
                # more behind (they are bounded per connection).
                endpoint.close()
                with trio.CancelScope(shield=True):  # (also when a cancel is what ended `open`)
                    await self._unregister(answer.get("session_id"), conn.close_timeout)
                raise
            self.session_id = config.session_id
            self._publish_batch = answer.get("publish_batch") is True
            self._endpoint = endpoint
            self._broker = broker
            self.publication = publication
            conn._udp_producers[self.session_id] = self
            assert conn._nursery is not None
            conn._nursery.start_soon(conn._contained, self._run, f"UDP publication {self.session_id}")
            self._send_now()
            # Connected once the broker's image answered the SETUP with a status message: only then does
            # `send(block=False)` mean what it says (no window yet is not a closed window).
            limit = conn.request_timeout if timeout is None else timeout
            with trio.move_on_after(limit):
                while not self.publication.is_connected:
                    conn._check_open()
                    await conn._wait_credit()
            if not self.publication.is_connected:
                raise ConnectionClosed(
                    ErrorCode.IDLE_TIMEOUT,
                    f"UDP publication {self.session_id}: no status message from the broker's UDP endpoint "
                    f"{host}:{broker_port} within {limit:g} s; is UDP from this host to it allowed?",
                )

    # -------------------------------------------------------------- sending

    async def send(
        self,
        body: bytes,
        headers: Headers | None = None,
        routing_key: str | None = None,
        *,
        timeout: float | None = None,
        block: bool = True,
    ) -> int:
        """Offer one message to the publication; returns the position after it (its completion point).

        Waits while the broker's window is closed, at most `timeout` seconds (None: `send_timeout`;
        math.inf: no deadline), then raises `FlowControlTimeout`; `block=False` raises `FlowControlled` at
        once instead. Refuses what the broker could not take before sending, as the TCP producer does."""
        conn = self._conn
        await trio.lowlevel.checkpoint_if_cancelled()
        if conn._closed is not None:
            conn._check_open()
        if timeout is not None and timeout != timeout:  # NaN: refused whether or not the send would wait
            check_timeout("send", timeout, "send_timeout")
        pub = self.publication
        if pub is None:
            await self.open()
            pub = self.publication
            assert pub is not None
        own_key = routing_key is None or routing_key == self.routing_key
        key = self.routing_key if routing_key is None else routing_key
        max_size = conn.welcome.max_message_size
        if type(body) is not bytes or headers or len(key) > _SHORT_KEY or len(body) + 4 * (len(key) + len(self.exchange)) > max_size:
            check_message(self.exchange, key, body, headers, max_size)
        if own_key and not headers:
            # The common message, a bare body: claimed here (its frame fits in the active term, and starts
            # below the publication limit as `offer` requires) and appended with the rest of the batch.
            if not self._batch:  # the first claim of a batch starts from the tail as it is now
                self._claimed(pub)
            if self._publish_batch:
                result = self._claim_in_batch(pub, body)
                if result:
                    self._sent(pub, result)
                    return result
            start = self._batch_end
            aligned = (len(body) + _BARE_FRAME_EXTRA) & ~31
            if (not self._publish_batch and aligned <= self._batch_room and start < pub.publication_limit
                    and len(body) < self._bare_limit and self._outstanding < self.window and not self._closed):
                self._batch.append(body)
                result = self._batch_end = start + aligned
                self._batch_room -= aligned
                self._sent(pub, result)
                return result
            payload = b"\x00" + body
        else:
            payload = encode_publish(body, None if own_key else key, headers)
        if len(payload) > pub.max_message_length:
            raise ValueError(f"a message of {len(body)} bytes ({len(payload)} with its envelope) exceeds the UDP "
                             f"publication's maximum {pub.max_message_length} (term_length / 8, the envelope "
                             "included); send it over TCP")
        self._commit(pub)  # what was claimed before it goes first
        result = pub.offer(payload) if self._outstanding < self.window and not self._closed else -1
        if result <= 0:  # the common case above: offered at once; otherwise wait for the window
            result = await self._offer_waiting(pub, payload, timeout, block)
        self._sent(pub, result)
        return result

    async def flush(self, timeout: float | None = None) -> None:
        """As `Producer.flush`; after `aclose()` with messages not complete, raises `ConnectionClosed` at
        once: their completion can never come (they stay unconfirmed, for the end of the block to report)."""
        if self._completions_ended is not None and self._outstanding:
            check_timeout("flush", timeout, "send_timeout")
            await trio.lowlevel.checkpoint()
            raise ConnectionClosed(ErrorCode.NORMAL, f"UDP publication {self.session_id} is closed: "
                                   f"{self._outstanding} messages not completed {self._completions_ended}")
        await super().flush(timeout)

    def _claim_in_batch(self, pub: Publication, body: bytes) -> int:
        """Claim `body`'s place in the open PUBLISH_BATCH, or in a new one after it when it does not fit
        (one datagram: the mtu, at most MAX_ENTRIES_PER_FRAME bodies); the batch's end with it, or 0 when
        it cannot be claimed (too big for a batch, the term's end, the window: the general path)."""
        if self._outstanding >= self.window or self._closed:
            return 0
        piece = bin_length(len(body))
        frames = self._batch
        if frames:
            frame = frames[-1]
            count = len(frame) + 1
            length = self._open_length + piece + (2 if count == 16 else 0)  # fixarray -> array 16 at 16
            if count <= MAX_ENTRIES_PER_FRAME and length <= self._bare_limit:
                end = self._open_start + ((length + DATA_HEADER_LENGTH + 31) & ~31)
                grow = end - self._batch_end
                if grow <= self._batch_room:
                    frame.append(body)
                    self._open_length = length
                    self._batch_room -= grow
                    self._batch_end = end
                    return end
        start = self._batch_end
        length = 1 + array_head_length(1) + piece
        aligned = (length + DATA_HEADER_LENGTH + 31) & ~31
        if length > self._bare_limit or aligned > self._batch_room or start >= pub.publication_limit:
            return 0
        frames.append([body])
        self._claim_limit = pub.publication_limit  # what this frame's start was checked against
        self._open_start = start
        self._open_length = length
        self._batch_room -= aligned
        self._batch_end = start + aligned
        return self._batch_end

    def _sent(self, pub: Publication, result: int) -> None:
        """A message was taken, ending at position `result`: count it, send what fills datagrams."""
        self._ends.append(result)
        self._outstanding += 1
        if self._outstanding == 1:
            self._conn._active_producers[self] = None
            self._unconfirmed_reported = False
        # Datagrams go out once a datagram's worth is waiting (the run task sends the rest when it runs), so
        # a burst of sends packs several messages into each datagram: with PUBLISH_BATCH, once a batch is
        # full (the next body opened another); else once a datagram's worth of frames waits.
        if self._publish_batch:
            if len(self._batch) > 1:
                self._send_now(closed_batches=True)
        elif result - pub.sender_position >= pub.mtu:
            self._send_now(whole_datagrams=True)  # the datagrams it fills; the rest waits for more
        self._dirty.set()

    def _claimed(self, pub: Publication) -> None:
        """A batch begins: its claims start from the publication's tail (which anything may have moved
        while no batch was open: an append on the general path, a new term)."""
        appender = pub.appender
        self._batch_end = pub.position
        self._batch_room = pub.term_length - appender.term_offset
        self._claim_limit = pub.publication_limit  # (unchanged while a bare batch is open: see _commit)
        self._bare_limit = pub.mtu - DATA_HEADER_LENGTH  # a bare body below this is one frame

    def _commit(self, pub: Publication, keep_open: bool = False) -> None:
        """Append the claimed batch. Whatever may move the publication's limit or state (its duty cycle,
        a status message, closing) runs only after this, so the claims made still hold, except for the open
        PUBLISH_BATCH that `_send_now(closed_batches=True)` keeps open across a duty cycle: that cycle may
        lower the limit (the broker's receiver timed out, or its image said end of stream: the limit falls
        to the sender position, as Aeron's does when nobody is connected). The append is given the limit
        the claims were checked against (`_claim_limit`), so a claim holds: what was claimed goes into the
        term, and is sent once the broker is heard from again, as any message waiting for the window. (A
        producer stopped 7-14 s had its batch refused here on resume and died with INTERNAL_ERROR, 1,000
        messages unconfirmed: a tester.) A refusal then is a bug, reported as the connection's internal
        error."""
        batch = self._batch
        if not batch:
            return
        if self._publish_batch:
            if keep_open:  # the full batches only: the open one may take more
                closed, batch[:] = batch[:-1], batch[-1:]
                claimed = self._open_start
            else:
                closed, claimed = batch, self._batch_end
            end = pub.offer_many([pack_publish_bodies(bodies) for bodies in closed], PUBLISH_BATCH_KIND,
                                 self._claim_limit)
        else:
            end, claimed = pub.offer_many(batch, b"\x00", self._claim_limit), self._batch_end
        if end != claimed:
            raise ConnectionClosed(ErrorCode.INTERNAL_ERROR,
                                   f"UDP publication {self.session_id}: the batch claimed up to position "
                                   f"{claimed} could not be appended (offer_many {end})")
        if not keep_open:
            batch.clear()

    async def _offer_waiting(self, pub: Publication, payload: bytes, timeout: float | None, block: bool) -> int:
        """Offer `payload` until it is taken: while back-pressured, wait for the broker's window (at most
        `timeout`) or, with `block=False`, raise FlowControlled at once."""
        conn = self._conn
        check_timeout("send", timeout, "send_timeout")
        timeout = self.send_timeout if timeout is None else timeout
        deadline = trio.current_time() + timeout if timeout != math.inf else math.inf
        waited_since: float | None = None
        try:
            while True:
                if self._closed:
                    raise ConnectionClosed(ErrorCode.NORMAL, f"UDP publication {self.session_id} is closed")
                if self._outstanding < self.window:
                    self._commit(pub)  # another task's claims, made while this one waited, go first
                    result = pub.offer(payload)
                    verdict = offer_verdict(result)
                else:  # the producer's own window of messages not yet complete is full
                    verdict = OfferVerdict.WAIT
                if verdict is OfferVerdict.DONE:
                    if result < 0:
                        raise ConnectionClosed(ErrorCode.INTERNAL_ERROR,
                                               f"UDP publication {self.session_id} cannot send (offer {result})")
                    return result
                if verdict is OfferVerdict.RETRY_NOW:
                    continue
                if not block:
                    self._blocked_count += 1
                    destinations = conn.flow_state.destinations
                    raise FlowControlled(f"no credit ({self._describe_wait()}{stopped_suffix(destinations)})",
                                         destinations, self._limit_name())
                if waited_since is None:
                    waited_since = trio.current_time()
                    self._blocked_count += 1
                    self._send_now()
                if trio.current_time() >= deadline:
                    destinations = conn.flow_state.destinations
                    raise FlowControlTimeout(
                        f"send timed out after {timeout:g} s ({self._describe_wait()}{stopped_suffix(destinations)})",
                        destinations, self._limit_name(), timeout)
                with trio.move_on_at(deadline):
                    await conn._wait_credit()
                conn._check_open()
        finally:
            if waited_since is not None:
                self._blocked_seconds += trio.current_time() - waited_since

    def _send_now(self, *, whole_datagrams: bool = False, closed_batches: bool = False) -> None:
        """Append what `send` claimed and send what the window allows. `closed_batches`: the full
        PUBLISH_BATCHes only, the open one stays open for the next sends."""
        pub, endpoint = self.publication, self._endpoint
        if pub is None or endpoint is None or endpoint.closed:
            return
        self._commit(pub, keep_open=closed_batches)
        for datagram, address in pub.do_work(now_ns(), whole_datagrams=whole_datagrams):
            endpoint.send(datagram, address)  # type: ignore[arg-type]

    def _on_progress(self) -> None:
        """Status messages arrived: count the messages the broker's consumption position passed, wake waiters."""
        pub = self.publication
        assert pub is not None
        position = pub.consumption_position
        ends = self._ends
        done = 0
        while ends and ends[0] <= position:
            ends.popleft()
            done += 1
        if done:
            self._on_completed(done)
        self._conn._credit_lot.unpark_all()

    # -------------------------------------------------------------- the task

    async def _run(self) -> None:
        """Status messages, NAKs and timers in; data, SETUPs and heartbeats out, until closed."""
        pub, endpoint = self.publication, self._endpoint
        assert pub is not None and endpoint is not None
        try:
            with self._scope:
                await self._serve(pub, endpoint)
        finally:
            endpoint.close()
            self._done.set()
            self._conn._credit_lot.unpark_all()

    async def _serve(self, pub: Publication, endpoint: UdpEndpoint) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sender)
            while not pub.is_done:
                batch: list[tuple[bytes, tuple[str, int]]] = []
                with trio.move_on_at(pub.next_deadline_ns() / 1_000_000_000):
                    batch = await endpoint.receive_batch(DEFAULT_BATCH)
                now = now_ns()
                if batch:
                    self._commit(pub)  # before a status message may move the limit the claims used
                broker_host, broker_port = self._broker or ("", 0)
                for datagram, source in batch:
                    if source[1] != broker_port or source[0] != broker_host:
                        self.foreign += 1
                        continue
                    pub.on_datagram(datagram, source, now)
                self._send_now()
                if batch:
                    self._on_progress()
            nursery.cancel_scope.cancel()

    @trio.lowlevel.enable_ki_protection
    async def _sender(self) -> None:
        """Sends what `send` left for later (less than a datagram), once the sending task yields."""
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            self._send_now()

    # -------------------------------------------------------------- closing

    async def _unregister(self, session_id: Any, timeout: float | None) -> None:
        """CLOSE_PUBLICATION for `session_id` (a registration `open` could not use, or `aclose`'s), unless
        the connection is closed: the broker ends its publications with it."""
        conn = self._conn
        if not isinstance(session_id, int) or conn.is_closed:
            return
        try:
            await conn._request(lambda rid: ClosePublication(rid, session_id), timeout)
        except Exception as exc:  # the connection is going away: the broker ends it with the connection
            log.debug("closing UDP publication %s: %s", session_id, exc)

    async def aclose(self, timeout: float | None = None) -> None:
        """Close the publication: CLOSE_PUBLICATION to the broker, then its socket, within `timeout`
        in all (None: the connection's `close_timeout`). Messages not yet complete are not waited for
        (`flush()` first, or leave the `async with` block, which does, within the same `close_timeout`);
        the broker forgets the publication at once, so nothing more is sent on it (no end of stream), and
        their completion never comes: they are unconfirmed from then on, reported by the end of the
        producer's or the connection's block at once (`Producer._completions_ended`)."""
        check_timeout("producer close", timeout, "close_timeout")  # before anything is closed
        if self._closed or self.publication is None:
            self._closed = True
            return
        self._closed = True
        self._send_now()  # what send took goes out before the publication closes
        conn = self._conn
        session_id = self.session_id
        assert session_id is not None
        limit = conn.close_timeout if timeout is None else timeout
        deadline = trio.current_time() + limit
        # What holds the messages not yet complete (a saturated queue): the broker resumes the connection
        # on the publication's close, before its answer, so it is read now for the report.
        held_by = conn.flow_state.destinations
        await self._unregister(session_id, limit)  # (None would have been request_timeout: 30 s)
        conn._udp_producers.pop(session_id, None)
        self._scope.cancel()
        # No status message comes any more: the messages not complete are unconfirmed from now on, reported
        # by the end of the producer's or the connection's block at once, never waited for (nor dropped).
        self._completions_ended = (f"when UDP publication {session_id} was closed (producer.aclose(): "
                                   "their completion is never told)")
        self._held_by = held_by
        with trio.move_on_at(deadline):
            await self._done.wait()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        deadline = trio.current_time() + self._conn.close_timeout  # the flush and the close together
        try:
            await super().__aexit__(exc_type, exc, tb)
        finally:
            with trio.CancelScope(shield=True):
                await self.aclose(max(0.0, deadline - trio.current_time()))
