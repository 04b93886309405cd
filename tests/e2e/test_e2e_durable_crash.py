"""The crash loop (issue 14): a real broker process killed with SIGKILL 20 times, at random moments, under
load from a producer that records how many of its messages the broker completed.

Each round starts a broker on the same data directory, drains the durable queue and checks it against
every earlier round: each message whose COMPLETE the producer saw is there exactly once, none is there
twice, and they come in the producer's order; a message acknowledged in an earlier round may only come
back flagged redelivered (its settlement was not yet on disk when the broker died). Then the round acks
what it drained, sends a "barrier" message and waits for its completion (its commit carries every
settlement before it), produces at full speed and kills the broker after a random 50-800 ms.

Completions of a durable queue that is never saturated come back in transfer order (each commit
releases its transfers in order), so the producer's completed count names a prefix of what it sent.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
from pathlib import Path

import trio

import flowbroker.client as fb
from tests.e2e.daemon import FLOWBROKER

ROUNDS = 20
MAX_PER_ROUND = 20_000
BODY_PAD = b"x" * 1000


async def start_broker(tmp_path: Path, data_dir: Path, n: int) -> tuple[subprocess.Popen[bytes], int]:
    port_file = tmp_path / f"ports-{n}.json"
    log = open(tmp_path / f"broker-{n}.log", "wb")
    proc = subprocess.Popen([FLOWBROKER, "serve", "--port", "0", "--no-admin", "--no-udp", "--no-metrics",
                             "--data-dir", str(data_dir), "--port-file", str(port_file)],
                            stdout=log, stderr=log)
    log.close()
    with trio.fail_after(30):
        while not port_file.exists():
            assert proc.poll() is None, (tmp_path / f"broker-{n}.log").read_text()
            await trio.sleep(0.05)
    return proc, int(json.loads(port_file.read_text())["port"])


def parse(body: bytes) -> tuple[int, int] | None:
    """(round, seq) of a load message; None for a barrier."""
    if body.startswith(b"barrier"):
        return None
    head = body.split(b"|", 1)[0]
    r, seq = head.split(b":")
    return int(r), int(seq)


async def test_completed_durable_messages_survive_20_kill_9s_exactly_once_and_in_order(tmp_path: Path) -> None:
    rng = random.Random(14)
    data_dir = tmp_path / "data"
    completed: dict[int, int] = {}  # round -> messages completed (a prefix of what it sent)
    sent: dict[int, int] = {}
    acked: set[tuple[int, int]] = set()
    checked = 0
    for n in range(ROUNDS + 1):
        proc, port = await start_broker(tmp_path, data_dir, n)
        try:
            async with await fb.connect(f"flowbroker://127.0.0.1:{port}") as conn:
                depth = (await conn.declare_queue("d", durable=True, max_count=10_000_000, max_size=1 << 34,
                                                  flow_stop_count=9_000_000, flow_stop_size=1 << 33))["count"]
                got: list[tuple[tuple[int, int], bool]] = []
                if depth:
                    async with conn.consumer("d", prefetch=1000) as consumer:
                        for _ in range(depth):
                            msg = await consumer.receive(timeout=30)
                            ident = parse(msg.body)
                            if ident is not None:
                                got.append((ident, msg.redelivered))
                            msg.settle_nowait(fb.Outcome.ACK)
                idents = [i for i, _ in got]
                assert idents == sorted(set(idents)), f"round {n}: out of order or duplicated"
                present = set(idents)
                for ident, redelivered in got:
                    if ident in acked:
                        assert redelivered, f"round {n}: acknowledged {ident} came back not flagged redelivered"
                    else:
                        assert ident[1] < sent[ident[0]]
                for r, count in completed.items():
                    missing = [(r, s) for s in range(count) if (r, s) not in acked and (r, s) not in present]
                    assert not missing, f"round {n}: {len(missing)} completed message(s) lost, first {missing[:3]}"
                checked += len(present - acked)
                acked |= present
                barrier = conn.producer(routing_key="d")
                await barrier.send(b"barrier %d" % n)
                await barrier.flush(timeout=30)
                if n == ROUNDS:
                    break
                producer = conn.producer(routing_key="d")
                sent[n] = 0

                async def load(r: int = n, p: fb.Producer = producer) -> None:
                    for seq in range(MAX_PER_ROUND):
                        await p.send(b"%d:%d|" % (r, seq) + BODY_PAD, timeout=30)
                        sent[r] = seq + 1

                async def kill(after: float, scope: trio.CancelScope) -> None:
                    await trio.sleep(after)
                    proc.send_signal(signal.SIGKILL)
                    while proc.poll() is None:
                        await trio.sleep(0.01)
                    await trio.sleep(0.2)  # what the dead socket still held reaches the client
                    scope.cancel()

                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(kill, rng.uniform(0.05, 0.8), nursery.cancel_scope)
                        await load()
                        await trio.sleep_forever()  # sent everything: wait for the kill
                except Exception:
                    pass  # the connection dies with the broker
                completed[n] = producer.statistics().completed
        except* (fb.ConnectionClosed, fb.PublishFailures, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            assert proc.wait(timeout=10) is not None, "the connection failed while the broker ran"
        finally:
            if proc.poll() is None:  # the last round ends it cleanly; a failed one in any way
                proc.send_signal(signal.SIGTERM if n == ROUNDS else signal.SIGKILL)
            proc.wait(timeout=30)
        if n < ROUNDS:
            assert proc.returncode == -signal.SIGKILL
            assert completed[n] <= sent[n]
    assert sum(completed.values()) > 0 and checked >= sum(completed.values())
