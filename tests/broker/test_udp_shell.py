"""The broker's UDP shell over a real socket on 127.0.0.1: how much one pass takes in, and which wakes run a
pass of their own. A pass is one turn of the broker's event loop; what it takes in bounds how long a UDP
producer keeps every TCP connection waiting."""

from __future__ import annotations

from collections.abc import Hashable

import trio
import trio.testing

from flowbroker.broker.udp.datapath import Outgoing
from flowbroker.broker.udp.shell import PASS_BYTES, UdpShell
from flowbroker.transport.udp import open_udp
from tests.broker.coreharness import Harness

LOCAL = ("127.0.0.1", 0)


class RecordingShell(UdpShell):
    """A shell that records each pass: its datagrams' sizes, and whether it was told more may be waiting."""

    def __init__(self) -> None:
        h = Harness()
        super().__init__(h.config.udp, h.core, open_udp(LOCAL, so_rcvbuf=1 << 20))
        self.passes: list[tuple[list[int], bool]] = []

    def _pass(self, batch: list[tuple[bytes, tuple[str, int]]]) -> None:
        self.passes.append(([len(d) for d, _ in batch], self.datapath.more_waiting))
        super()._pass(batch)


async def test_a_pass_takes_in_at_most_pass_bytes_and_the_datagram_that_reaches_it() -> None:
    """Six 40,000-byte datagrams waiting: passes of two (80,000 reaches PASS_BYTES), each telling the data
    path that more may be waiting, and then a pass of none once the socket is found empty, which tells it
    that nothing is (the status messages that waited go out there)."""
    assert PASS_BYTES == 64 * 1024
    shell = RecordingShell()
    async with open_udp(LOCAL) as sender:
        for i in range(6):
            assert sender.send(bytes([i]) * 40_000, shell.endpoint.local_address)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(shell.run)
            with trio.fail_after(5):
                while sum(shell.datapath.refused.values()) < 6:  # unregistered: refused, counted
                    await trio.sleep(0.01)
                await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    taken = [(sizes, more) for sizes, more in shell.passes if sizes]
    assert taken == [([40_000, 40_000], True)] * 3
    assert shell.passes[3] == ([], False)  # the socket found empty after a bounded pass
    assert not shell.datapath.more_waiting


async def test_a_wake_during_a_pass_is_served_by_that_pass() -> None:
    """A wake while a pass takes in its datagrams (an SM that let a UDP subscription deliver) is served by
    the pass's own duty cycle, which follows: the waker runs no pass for it, unless the cycle left the
    ingress pending. A wake from outside a pass (a TCP consumer's settlement) runs one."""
    shell = RecordingShell()
    on_datagram = shell.datapath.on_datagram

    def waking(datagram: bytes | bytearray | memoryview, source: Hashable, now: int) -> None:
        shell.wake()
        on_datagram(datagram, source, now)

    shell.datapath.on_datagram = waking  # type: ignore[method-assign,assignment]
    do_work = shell.datapath.do_work
    wakes_in_cycle: list[bool] = []

    def working(now: int) -> Outgoing:
        out = do_work(now)
        wakes_in_cycle.append(shell.datapath.in_cycle)
        return out

    shell.datapath.do_work = working  # type: ignore[method-assign,assignment]
    async with open_udp(LOCAL) as sender:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(shell.run)
            await trio.testing.wait_all_tasks_blocked()
            sender.send(b"x" * 100, shell.endpoint.local_address)
            with trio.fail_after(5):
                while not shell.datapath.refused:
                    await trio.sleep(0.01)
                await trio.testing.wait_all_tasks_blocked()
            assert [sizes for sizes, _ in shell.passes] == [[100]]  # no second pass for the wake
            shell.wake()
            await trio.testing.wait_all_tasks_blocked()
            assert [sizes for sizes, _ in shell.passes] == [[100], []]  # the waker's
            # A wake in a pass whose cycle left the ingress pending (a poll stopped at the cycle's
            # message bound): the waker runs the next cycle.
            shell.datapath.ingress.pending = lambda: True  # type: ignore[method-assign]
            sender.send(b"y" * 200, shell.endpoint.local_address)
            with trio.fail_after(5):
                while sum(shell.datapath.refused.values()) < 2:
                    await trio.sleep(0.01)
                await trio.testing.wait_all_tasks_blocked()
            assert [sizes for sizes, _ in shell.passes] == [[100], [], [200], []]
            nursery.cancel_scope.cancel()
    assert wakes_in_cycle == [False] * 4  # cleared once the ingress's cycle ran, every pass
