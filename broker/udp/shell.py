"""The trio shell of the broker's UDP data path: one socket, two tasks, the sans-IO ``DataPath`` between.

The receiver task waits for datagrams (with the data path's next deadline as the timeout), hands a batch
to ``DataPath.on_datagram`` and sends what ``do_work`` returns. The waker task runs ``do_work`` when the
core says something changed outside a datagram: a completion released a held message (the image's window
may open), a settle or a grant let a UDP subscription take more deliveries. Both run in the server's
nursery; sends never block (a full socket buffer drops the datagram, which Aeron's NAKs and heartbeats
recover, and is counted on the endpoint).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import trio

from flowbroker.broker.accept import RateLimitedLog
from flowbroker.broker.config import UdpConfig
from flowbroker.broker.core import BrokerCore
from flowbroker.broker.udp.datapath import DataPath, Outgoing, is_data_frame
from flowbroker.transport.channel import ChannelUri
from flowbroker.transport.udp import DEFAULT_BATCH, UdpEndpoint, now_ns, open_udp
from flowbroker.transport.udp.sockets import open_multicast_publication_endpoint

__all__ = ["UdpShell", "open_data_path"]

LOGGER = logging.getLogger("flowbroker.broker")

SOCKET_BUFFER = 4 * 1024 * 1024  # SO_RCVBUF/SO_SNDBUF asked for (the kernel may clamp them)

PASS_BYTES = 64 * 1024
"""The datagram bytes one pass takes in before the receiver yields (the datagram that reaches it is taken):
what a TCP connection's read takes (the server's RECEIVE_SIZE), so that a UDP producer's turn costs the
broker about what a TCP producer's does. With 64 datagrams a pass, a batching producer's pass routed up
to 3,400 messages without yielding: the queue's consumers fell behind, and with the consumer a TCP one,
publish-to-deliver p50 was 158-412 ms against 8-11 ms now, at the same rate or better
(docs/performance.md, "UDP passes as turns")."""


class UdpShell:
    """Runs a ``DataPath`` over a bound ``UdpEndpoint``; start ``run()`` in a nursery."""

    def __init__(self, config: UdpConfig, core: BrokerCore, endpoint: UdpEndpoint) -> None:
        self.endpoint = endpoint
        self._woken = trio.Event()
        self._woke_in_pass = False
        self._backlog: deque[tuple[bytes, tuple[str, int]]] = deque()  # data read ahead (`_take`)
        self._paused = False  # shutdown: no more datagrams taken from the endpoint
        self.faults = 0  # internal errors the data path survived (_fault)
        self._log_fault = RateLimitedLog(LOGGER, logging.ERROR, 60.0)
        self.datapath = DataPath(config, core, endpoint.local_address, self.wake)
        core.udp = self.datapath
        # A multicast group's socket: bound to its control group (where members' SMs and NAKs go), sending
        # its data to the data group; each has a receiver task like the endpoint's.
        self._groups: dict[tuple[str, int], tuple[UdpEndpoint, trio.CancelScope]] = {}
        self._nursery: trio.Nursery | None = None
        self.datapath.groups.open_socket = self._open_group
        self.datapath.groups.close_socket = self._close_group
        self.datapath.groups.read_pending = self._read_group_now
        # Called around each pass of the data path (the datagrams of a batch and the duty cycle): the
        # server's, so that TCP connections the pass woke (a consumer that the messages just routed were
        # delivered to, a producer told FLOW_STOPPED) are written to once, directly, at the end of the
        # pass, as after a TCP reader's chunk, instead of each waking its writer task.
        self.begin_pass: Callable[[], None] = _nothing
        self.end_pass: Callable[[], None] = _nothing

    @property
    def port(self) -> int:
        return int(self.endpoint.local_address[1])

    def wake(self) -> None:
        """Something changed outside a datagram: run the duty cycle soon (in the waker task), unless a pass
        under way will run it (`DataPath.in_cycle`): an SM that let a UDP subscription deliver woke the
        waker for a pass that found nothing left to do, two of every five passes. What the pass's cycle
        leaves for the next one (a publication whose poll stopped at the cycle's message bound) is
        asked of the ingress at the pass's end (`Ingress.pending`)."""
        if self.datapath.in_cycle:
            self._woke_in_pass = True
        else:
            self._woken.set()

    def _send(self, out: Outgoing) -> None:
        endpoint, groups = self.endpoint, self._groups
        for datagram, address in out:
            group = groups.get(address) if groups else None  # type: ignore[call-overload]
            (group[0] if group is not None else endpoint).send(datagram, address)  # type: ignore[arg-type]

    def _open_group(self, channel: ChannelUri, data: tuple[str, int]) -> None:
        """Bind a group's socket (synchronous; OSError if it cannot) and start its receiver."""
        if data in self._groups:
            return  # a closing group's socket, still open: the new group shares it
        if self._nursery is None:
            raise OSError("the UDP data path is not running")
        endpoint = open_multicast_publication_endpoint(channel, so_rcvbuf=SOCKET_BUFFER, so_sndbuf=SOCKET_BUFFER)
        scope = trio.CancelScope()
        self._groups[data] = (endpoint, scope)
        self._nursery.start_soon(self._group_receiver, endpoint, scope)

    def pause(self) -> None:
        """Shutdown: take no more datagrams from the endpoint, so that what producers send from now on is
        not taken (and not journalled after their completions were told); what the images hold is still
        routed by the passes that follow."""
        self._paused = True

    def status_now(self) -> None:
        """A duty cycle now, without datagrams: the status messages due go out (at shutdown, those that
        tell UDP producers what the journal's last commit completed, before their connections close)."""
        self._pass([])

    def _read_group_now(self, data: tuple[str, int], now_ns: int) -> None:
        """What a group's socket holds, handed to the data path at once (a member is leaving: its last
        status message may be there). Bounded: at most DEFAULT_BATCH datagrams."""
        group = self._groups.get(data)
        if group is None:
            return
        endpoint, datapath = group[0], self.datapath
        for _ in range(DEFAULT_BATCH):
            got = endpoint.try_receive() if not endpoint.closed else None
            if got is None:
                return
            datapath.on_datagram(got[0], got[1], now_ns)

    def _close_group(self, data: tuple[str, int]) -> None:
        group = self._groups.pop(data, None)
        if group is not None:
            group[1].cancel()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._waker)
                await self._receiver()
        finally:
            self._nursery = None
            self.endpoint.close()
            for endpoint, _ in self._groups.values():
                endpoint.close()

    def _pass(self, batch: list[tuple[bytes, tuple[str, int]]]) -> None:
        """Hand a batch of datagrams to the data path, run its duty cycle, send what it returns."""
        datapath = self.datapath
        self.begin_pass()
        datapath.in_cycle = True
        out: Outgoing = []
        try:
            now = now_ns()
            for datagram, source in batch:
                try:
                    datapath.on_datagram(datagram, source, now)
                except Exception as exc:  # a bug: this datagram is lost, not the broker (see _fault)
                    self._fault(exc, "a datagram")
            try:
                out = datapath.do_work(now)
            except Exception as exc:
                self._fault(exc, "the data path's duty cycle")
        finally:
            datapath.in_cycle = False
            if self._woke_in_pass:
                self._woke_in_pass = False
                if datapath.ingress.pending():
                    self._woken.set()
            self.end_pass()
        self._send(out)

    def _fault(self, exc: Exception, what: str) -> None:
        """A fault in the data path while handling `what` is logged with its traceback (the first, then at
        most one a minute, with how many there were) and counted, and the data path goes on: an exception
        out of this task ended the broker's nursery, and every TCP connection with it (a tester's message
        too large for a UDP consumer's publication, since refused before the offer)."""
        self.faults += 1
        self._log_fault("UDP data path: internal error handling %s (%d so far); going on", what, self.faults,
                        exc_info=exc)

    async def _group_receiver(self, endpoint: UdpEndpoint, scope: trio.CancelScope) -> None:
        try:
            with scope:
                while True:
                    self._pass(await endpoint.receive_batch(DEFAULT_BATCH, PASS_BYTES))
        finally:
            endpoint.close()

    async def _receiver(self) -> None:
        """A pass per turn (`_take`: every control datagram the socket holds, at most PASS_BYTES of data)
        with a plain yield after it; only an empty socket waits, in a cancel scope for the data path's
        next deadline (a cancel scope a pass cost more than the pass's datagram copies). While data is
        left for later passes (`DataPath.more_waiting`) a caught-up status message waits; the turn that
        finds nothing left runs a pass without datagrams first, for what that deferred."""
        datapath, endpoint = self.datapath, self.endpoint
        while True:
            if self._paused:
                await trio.sleep_forever()
            batch = self._take()
            waited = not batch
            if waited:
                if datapath.more_waiting:
                    datapath.more_waiting = False
                    self._pass(batch)
                with trio.move_on_at(datapath.deadline_ns(now_ns()) / 1_000_000_000):
                    await endpoint.wait_readable()
                batch = self._take()
            datapath.more_waiting = bool(self._backlog)
            self._pass(batch)
            if not waited:
                await trio.lowlevel.checkpoint()  # the wait yielded already

    def _take(self) -> list[tuple[bytes, tuple[str, int]]]:
        """This pass's datagrams. What the socket holds is read now, up to DEFAULT_BATCH datagrams and
        while the backlog of data read ahead is under DEFAULT_BATCH: control datagrams (a consumer's SMs
        and NAKs, SETUPs, RTTMs, anything malformed) go into this pass, data (DATA and PAD frames, in
        their order) into the backlog, of which this pass takes PASS_BYTES (the datagram that reaches it
        included). The socket is one queue for every peer: read in order, a UDP consumer's SM waited
        behind each datagram of a producer's window, one pass each, so the consumer's deliveries lagged
        its producer's and the queue grew (UDP -> UDP p50 193-252 ms against 8-12 ms read ahead)."""
        backlog, try_receive = self._backlog, self.endpoint.try_receive
        batch: list[tuple[bytes, tuple[str, int]]] = []
        for _ in range(DEFAULT_BATCH):
            if len(backlog) >= DEFAULT_BATCH:
                break
            got = try_receive()
            if got is None:
                break
            if is_data_frame(got[0]):
                backlog.append(got)
            else:
                batch.append(got)
        room = PASS_BYTES
        while backlog and room > 0:
            got = backlog.popleft()
            batch.append(got)
            room -= len(got[0])
        return batch

    async def _waker(self) -> None:
        while True:
            await self._woken.wait()
            self._woken = trio.Event()
            self._pass([])


def _nothing() -> None:
    pass


def open_data_path(config: UdpConfig, core: BrokerCore) -> UdpShell:
    """Bind the UDP endpoint of ``[udp] endpoint`` (OSError if it cannot be bound) and wrap it."""
    endpoint = open_udp(config.address(), so_rcvbuf=SOCKET_BUFFER, so_sndbuf=SOCKET_BUFFER)
    return UdpShell(config, core, endpoint)
