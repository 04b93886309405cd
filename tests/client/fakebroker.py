"""A small scripted broker for the client SDK's tests: real TCP on 127.0.0.1, the real protocol state
machine in the broker role, and just enough behaviour to exercise the client.

By default it answers HELLO, requests (OK), noops, and completes every transfer at once with a
BUFFER_ACK for its bytes. Tests turn behaviours off (`auto_complete`, `auto_ack`, `answer_noops`) and
drive the rest by hand through `FakeConn.send(...)`, `complete(...)`, `ack(...)`. It also checks the
client's producer credit the way the real broker must: a transfer beyond the buffer by more than one
message is recorded in `violations`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from dataclasses import dataclass, field
from typing import Any

import trio

from flowbroker.protocol import (
    BufferAck,
    SenderWindow,
    Close,
    Complete,
    DeclareExchange,
    DeclareQueue,
    DeleteQueue,
    Error,
    ErrorCode,
    Frame,
    Hello,
    Noop,
    Ok,
    PurgeQueue,
    RemoteProtocolError,
    Role,
    State,
    Subscribe,
    Transfer,
    TransferEntry,
    Welcome,
    message_size,
)
from flowbroker.protocol import Connection as ProtocolConnection
from flowbroker.protocol import Bind, Cancel, Unbind


@dataclass
class FakeConn:
    broker: FakeBroker
    stream: trio.SocketStream
    proto: ProtocolConnection = field(default_factory=lambda: ProtocolConnection(Role.BROKER))
    received: list[Frame] = field(default_factory=list)
    transfers: dict[int, tuple[TransferEntry, int]] = field(default_factory=dict)
    transfer_frames: list[Transfer] = field(default_factory=list)
    completed: set[int] = field(default_factory=set)
    held: list[int] = field(default_factory=list)
    sender_window: SenderWindow = field(default_factory=SenderWindow)
    acked_bytes: int = 0
    completed_bytes: int = 0
    violations: list[str] = field(default_factory=list)
    next_id: int = 1
    closed: bool = False
    changed: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)
    reading_paused: trio.Event | None = None
    """Set by `pause_reading()`: the broker reads nothing more from this client until it is set."""
    _send_lock: trio.Lock = field(default_factory=trio.Lock)

    def pause_reading(self) -> None:
        """Stop reading from the client (a hung broker that still sends); its writes then stall."""
        self.reading_paused = trio.Event()

    def frames(self, kind: type[Any]) -> list[Any]:
        return [f for f in self.received if isinstance(f, kind)]

    async def send(self, *frames: Frame) -> None:
        async with self._send_lock:
            await self.stream.send_all(b"".join(self.proto.send(f) for f in frames))

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        with trio.fail_after(timeout):
            while not predicate():
                await self.changed.park()

    async def complete(self, ids: list[int] | None = None) -> None:
        """Complete `ids` (default: every transfer received and not completed), with a BUFFER_ACK for
        their bytes unless auto_ack is off."""
        ids = sorted(set(self.transfers) - self.completed) if ids is None else ids
        if not ids:
            return
        self.completed.update(ids)
        self.completed_bytes += sum(self.transfers[i][1] for i in ids)
        frames: list[Frame] = [self._complete_frame()]
        if self.broker.auto_ack:
            frames.append(self._ack_frame())
        await self.send(*frames)

    async def ack(self, acked_total: int | None = None) -> None:
        """BUFFER_ACK for everything completed (or an explicit absolute position, e.g. a stale one)."""
        total = self.completed_bytes if acked_total is None else acked_total
        freed = max(0, total - self.acked_bytes)
        self.acked_bytes = max(self.acked_bytes, total)
        self.sender_window.on_ack(max(self.sender_window.acked_position, total))
        await self.send(BufferAck(0, freed, total))

    def _ack_frame(self) -> BufferAck:
        freed = self.completed_bytes - self.acked_bytes
        self.acked_bytes = self.completed_bytes
        self.sender_window.on_ack(self.completed_bytes)
        return BufferAck(0, freed, self.completed_bytes)

    def _complete_frame(self) -> Complete:
        cumulative = 0
        while cumulative + 1 in self.completed:
            cumulative += 1
        above = sorted(i for i in self.completed if i > cumulative + 1)
        ranges: list[tuple[int, int]] = []
        for i in above:
            if ranges and i == ranges[-1][1] + 1:
                ranges[-1] = (ranges[-1][0], i)
            else:
                ranges.append((i, i))
        return Complete(cumulative, ranges)

    async def on_transfer(self, frame: Transfer) -> None:
        broker = self.broker
        if frame.first_id != self.next_id:
            self.violations.append(f"transfer id gap: expected {self.next_id}, got {frame.first_id}")
        self.transfer_frames.append(frame)
        replies: list[Frame] = []
        done: list[int] = []
        for offset, entry in enumerate(frame.entries):
            tid = frame.first_id + offset
            size = message_size(entry.body, entry.headers)
            if not self.sender_window.may_send():
                self.violations.append(
                    f"transfer {tid}: sent {self.sender_window.position} bytes, credit limit {self.sender_window.limit}"
                )
            self.sender_window.on_sent(size)
            self.transfers[tid] = (entry, size)
            queue = entry.routing_key
            if queue in broker.full_queues:
                replies.append(Error(ErrorCode.QUEUE_FULL, f"queue {queue} is full", None, tid, queue))
                done.append(tid)
            elif queue in broker.held_queues:
                self.held.append(tid)
            elif broker.auto_complete:
                done.append(tid)
        self.next_id = frame.first_id + len(frame.entries)
        if done:
            self.completed.update(done)
            self.completed_bytes += sum(self.transfers[i][1] for i in done)
            replies.append(self._complete_frame())
            if broker.auto_ack:
                replies.append(self._ack_frame())
        if replies:
            await self.send(*replies)

    async def release_held(self) -> None:
        held, self.held = self.held, []
        await self.complete(held)

    async def close(self, code: ErrorCode = ErrorCode.NORMAL, reason: str = "bye") -> None:
        if self.proto.state is State.OPEN:
            await self.send(Close(code, reason))
        await self.stream.aclose()


class FakeBroker:
    def __init__(
        self,
        *,
        buffer_size: int = 0,
        idle_timeout_ms: int = 0,
        max_message_size: int = 1024 * 1024,
        auto_complete: bool = True,
        auto_ack: bool = True,
        answer_noops: bool = True,
        answer_requests: bool = True,
        welcome: bool = True,
        max_prefetch: int = 10_000,
        after_welcome: tuple[Frame, ...] = (),
    ) -> None:
        self.buffer_size = buffer_size
        self.idle_timeout_ms = idle_timeout_ms
        self.max_message_size = max_message_size
        self.auto_complete = auto_complete
        self.auto_ack = auto_ack
        self.answer_noops = answer_noops
        self.answer_requests = answer_requests
        self.welcome = welcome
        self.max_prefetch = max_prefetch
        self.after_welcome = after_welcome
        """Frames sent in the same write as WELCOME (as the broker sends FLOW_STOPPED after a stop-all)."""
        """The prefetch in force a SUBSCRIBE's OK reports, as the broker's cap (the fake does not apply it)."""
        self.full_queues: set[str] = set()
        self.held_queues: set[str] = set()
        self.missing: set[str] = set()
        """Names for which requests get ERROR(NOT_FOUND)."""
        self.conns: list[FakeConn] = []
        self._accepted = trio.lowlevel.ParkingLot()
        self.port = 0

    @property
    def url(self) -> str:
        return f"flowbroker://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, self._handle, 0, host="127.0.0.1"))
            self.port = listeners[0].socket.getsockname()[1]
            task_status.started()

    async def connection(self, index: int = 0, timeout: float = 5.0) -> FakeConn:
        """The index-th accepted connection, once it has completed the handshake."""
        with trio.fail_after(timeout):
            while len(self.conns) <= index:
                await self._accepted.park()
        return self.conns[index]

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = FakeConn(self, stream)
        conn.sender_window = SenderWindow(self.buffer_size)
        try:
            async with stream:
                while True:
                    if conn.reading_paused is not None:
                        await conn.reading_paused.wait()
                    data = await stream.receive_some(65536)
                    conn.proto.receive_data(data)
                    while (frame := conn.proto.next_frame()) is not None:
                        conn.received.append(frame)
                        await self._on_frame(conn, frame)
                        conn.changed.unpark_all()
                    if not data:
                        break
        except (trio.BrokenResourceError, trio.ClosedResourceError, RemoteProtocolError):
            pass
        finally:
            conn.closed = True
            conn.changed.unpark_all()

    async def _on_frame(self, conn: FakeConn, frame: Frame) -> None:
        if isinstance(frame, Hello):
            if self.welcome:
                await conn.send(
                    Welcome(1, len(self.conns) + 1, "fake", 1024 * 1024 * 4, self.max_message_size,
                            self.idle_timeout_ms, self.buffer_size, "fake-broker"),
                    *self.after_welcome,
                )
                self.conns.append(conn)
                self._accepted.unpark_all()
        elif isinstance(frame, Transfer):
            await conn.on_transfer(frame)
        elif isinstance(frame, Noop):
            if not frame.reply and self.answer_noops:
                await conn.send(Noop(frame.nonce, True))
        elif isinstance(frame, (DeclareQueue, DeclareExchange, Bind, Unbind, DeleteQueue, PurgeQueue, Subscribe, Cancel)):
            if not self.answer_requests:
                return
            name = getattr(frame, "queue", None) or getattr(frame, "exchange", "")
            if name in self.missing:
                await conn.send(Error(ErrorCode.NOT_FOUND, f"no queue {name}", None, frame.request_id, name))
            elif isinstance(frame, Subscribe):
                prefetch = min(frame.prefetch, self.max_prefetch) if frame.prefetch else self.max_prefetch
                await conn.send(Ok(frame.request_id, {"queue": name, "prefetch": prefetch}))
            else:
                await conn.send(Ok(frame.request_id, {"name": name, "type": type(frame).__name__}))
