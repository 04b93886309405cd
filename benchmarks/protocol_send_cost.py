"""Connection.send's cost per message on TRANSFER frames of 100 entries (as the SDK queues them) and on
DELIVER frames of 100 entries (as the broker sends them): state machine, field checks and msgpack.

    python benchmarks/protocol_send_cost.py [FRAMES]
"""

from __future__ import annotations

import sys
import time

from flowbroker.protocol import PROTOCOL_VERSION, Deliver, Hello, Role, Transfer, Welcome
from flowbroker.protocol import Connection as ProtocolConnection

ENTRIES = 100


def pair() -> tuple[ProtocolConnection, ProtocolConnection]:
    client, broker = ProtocolConnection(Role.CLIENT), ProtocolConnection(Role.BROKER)
    broker.receive_data(client.send(Hello(PROTOCOL_VERSION, "bench", True, [], None)))
    broker.next_frame()
    client.receive_data(broker.send(Welcome(PROTOCOL_VERSION, 1, "bench", 8 << 20, 1 << 20, 0, 0, "bench")))
    client.next_frame()
    return client, broker


def main() -> None:
    frames = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    client, broker = pair()
    body = b"x" * 100
    transfer = [("", "q", body, None, None, None) for _ in range(ENTRIES)]  # the SDK's QueuedEntry tuples
    deliver = [(tag, "", "q", body, None, False) for tag in range(1, ENTRIES + 1)]
    for name, conn, make in (
        ("TRANSFER", client, lambda i: Transfer(1 + i * ENTRIES, transfer)),  # type: ignore[arg-type]
        ("DELIVER", broker, lambda i: Deliver(1, deliver)),  # type: ignore[arg-type]
    ):
        built = [make(i) for i in range(frames)]
        send = conn.send
        start = time.process_time()
        for frame in built:
            send(frame)
        used = time.process_time() - start
        print(f"Connection.send, {name} of {ENTRIES} entries: {used / frames / ENTRIES * 1e9:.0f} ns per message")


if __name__ == "__main__":
    main()
