"""What settling costs a queue per message, in memory (no sockets, no core): `Queue.settle_many` over
batches of the oldest delivered messages, as a consumer's SETTLE frames bring them, in two states:

- `clear`: the queue holds no transfer;
- `saturated`: the queue is over its stop watermark and holds the completions of its newest messages
  (ten producers outrunning one consumer reach the default 80 MiB stop a few times in a
  many_producers.py run), while its consumer settles the oldest ones, which hold nothing.

    python benchmarks/settle_cost.py [--messages 200000] [--batch 500] [--repeat 5]

Prints nanoseconds per settled message for each state, the best of --repeat runs (least disturbed).
"""

from __future__ import annotations

import argparse
import time

from flowbroker.broker.message import HeldTransfer, Message, SessionRef
from flowbroker.broker.queue import Queue
from flowbroker.policies.overflow import Thresholds


class _Producer:
    """What a HeldTransfer needs of a session."""

    transfers_held_now = 0

    def __init__(self) -> None:
        self.ref = SessionRef(self)  # type: ignore[arg-type]

    def complete_transfer(self, tid: int, size: int) -> None:
        pass


def settle_ns(messages: int, batch: int, saturated: bool) -> float:
    """Fill a queue with `messages` (the newer half held when `saturated`), deliver the older half,
    settle it in batches; nanoseconds per settled message."""
    stop = messages // 2 if saturated else messages * 2
    queue = Queue("q", Thresholds(max_size=0, flow_stop_count=stop, flow_resume_count=stop // 2))
    producer = _Producer()
    for tid in range(messages):
        msg = Message("", "q", b"x", None, 1024)
        if queue.add(msg, None, 0):
            msg.held = HeldTransfer(producer, tid, 1024, 1)  # type: ignore[arg-type]  # (as BrokerCore._hold)
    delivered = [queue.store.take() for _ in range(messages // 2 - 1)]
    started = time.perf_counter()
    for i in range(0, len(delivered), batch):
        queue.settle_many(delivered[i:i + batch])
    elapsed = time.perf_counter() - started
    assert queue.saturated == saturated and bool(queue.held) == saturated
    return elapsed / len(delivered) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=500, help="messages per settle_many (per SETTLE frame)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for state, saturated in (("clear", False), ("saturated", True)):
        best = min(settle_ns(args.messages, args.batch, saturated) for _ in range(args.repeat))
        print(f"settle_many, queue {state}: {best:.0f} ns per message", flush=True)


if __name__ == "__main__":
    main()
