"""The broker's UDP shell over a real socket on 127.0.0.1: how much one pass takes in, and which wakes run a
pass of their own. A pass is one turn of the broker's event loop; what it takes in bounds how long a UDP
producer keeps every TCP connection waiting."""

from __future__ import annotations

from collections.abc import Hashable

import trio
import trio.testing

from flowbroker.broker.udp.datapath import Outgoing
from flowbroker.broker.udp.shell import PASS_BYTES, UdpShell
from flowbroker.transport.frames import FrameType
from flowbroker.transport.udp import DEFAULT_BATCH, open_udp
from tests.broker.coreharness import Harness

LOCAL = ("127.0.0.1", 0)


class RecordingShell(UdpShell):
    """A shell that records each pass: its datagrams' sizes, and whether DATA was left for later passes."""

    def __init__(self) -> None:
        h = Harness()
        super().__init__(h.config.udp, h.core, open_udp(LOCAL, so_rcvbuf=1 << 20))
        self.passes: list[tuple[list[int], bool]] = []

    def _pass(self, batch: list[tuple[bytes, tuple[str, int]]]) -> None:
        self.passes.append(([len(d) for d, _ in batch], self.datapath.more_waiting))
        super()._pass(batch)


def _frame(frame_type: int, fill: int, size: int) -> bytes:
    """A datagram whose Aeron header says `frame_type` (what the shell sorts by), `fill` bytes after it."""
    return bytes(6) + frame_type.to_bytes(2, "little") + bytes([fill]) * (size - 8)


async def test_a_pass_takes_every_control_datagram_and_at_most_pass_bytes_of_data() -> None:
    """Six 40,000-byte DATA datagrams and a status message behind the third: the first pass takes the
    status message ahead of the data (a consumer's SM does not wait for a producer's window to be routed)
    and two DATA datagrams (80,000 bytes reach PASS_BYTES), the next passes two each in their order. Each
    pass tells the data path whether data is left for later (`more_waiting`), the last that none is."""
    assert PASS_BYTES == 64 * 1024
    shell = RecordingShell()
    data = [_frame(FrameType.DATA, i, 40_000) for i in range(6)]
    sm = _frame(FrameType.SM, 0xEE, 36)
    async with open_udp(LOCAL) as sender:
        for datagram in data[:3] + [sm] + data[3:]:
            assert sender.send(datagram, shell.endpoint.local_address)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(shell.run)
            with trio.fail_after(5):
                while sum(shell.datapath.refused.values()) < 7:  # unregistered: refused, counted
                    await trio.sleep(0.01)
                await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    taken = [(sizes, more) for sizes, more in shell.passes if sizes]
    assert taken == [([36, 40_000, 40_000], True), ([40_000, 40_000], True), ([40_000, 40_000], False)]
    assert len(shell.passes) == 3 and not shell.datapath.more_waiting
    assert not shell._backlog


async def test_data_read_ahead_is_bounded() -> None:
    """What a pass reads ahead is bounded: at most DEFAULT_BATCH datagrams a pass from the socket, and
    none once DEFAULT_BATCH DATA datagrams wait in the backlog (the rest stay in the kernel's buffer)."""
    shell = RecordingShell()
    async with open_udp(LOCAL) as sender:
        for i in range(3 * DEFAULT_BATCH):
            assert sender.send(_frame(FrameType.DATA, i % 256, 1500), shell.endpoint.local_address)
        await trio.sleep(0.05)
        first = shell._take()  # reads 64, takes 44 (44 x 1,500 B reach 64 KiB)
        assert len(first) == 44 and len(shell._backlog) == DEFAULT_BATCH - 44
        second = shell._take()  # reads only until 64 wait again
        assert len(second) == 44 and len(shell._backlog) == DEFAULT_BATCH - 44
        assert shell.endpoint.counters.datagrams_received == DEFAULT_BATCH + 44  # the rest in the kernel
        assert [d[8] for d, _ in first + second] == list(range(88))  # in their order
        shell.endpoint.close()


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
