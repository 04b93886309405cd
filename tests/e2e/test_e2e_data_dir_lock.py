"""One broker per data directory (docs/storage.md): a second broker given the same --data-dir does not start
nor read the journal, and says which pid holds it. Two brokers on one journal each recovered it and wrote
segments of their own; after a kill -9 a restart had lost 1,000 of 3,000 completed messages (a tester)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import trio

import flowbroker.client as fc
from tests.e2e.daemon import FLOWBROKER, free_port, stop, wait_listening


def _serve(port: int, data_dir: Path, home: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([FLOWBROKER, "serve", "--port", str(port), "--no-admin", "--no-udp",
                             "--data-dir", str(data_dir)], stderr=subprocess.PIPE, text=True,
                            env={"HOME": str(home), "PATH": "/usr/bin:/bin"})


def test_a_second_broker_on_a_data_dir_in_use_does_not_start_and_the_first_keeps_its_messages(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first_port, second_port = free_port(), free_port()
    first = _serve(first_port, data_dir, tmp_path)
    try:
        wait_listening(first_port, first)

        async def publish(port: int, body: bytes) -> None:
            async with await fc.connect(f"flowbroker://127.0.0.1:{port}", timeout=10) as conn:
                await conn.declare_queue("d", durable=True)
                producer = conn.producer(routing_key="d")
                await producer.send(body)
                await producer.flush(timeout=10)

        trio.run(publish, first_port, b"first")
        second = _serve(second_port, data_dir, tmp_path)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 1, err
        assert f"data_dir {data_dir} is in use by another broker (pid {first.pid}" in err, err
        assert "recovered" not in err  # it read nothing
        trio.run(publish, first_port, b"again")  # the first is untouched
    finally:
        stop(first)
    restarted = _serve(first_port, data_dir, tmp_path)  # the lock went with the process
    try:
        wait_listening(first_port, restarted)

        async def drain() -> list[bytes]:
            async with await fc.connect(f"flowbroker://127.0.0.1:{first_port}", timeout=10) as conn:
                async with conn.consumer("d") as consumer:
                    return [(await consumer.receive(timeout=10)).body for _ in range(2)]

        assert trio.run(drain) == [b"first", b"again"]
    finally:
        stop(restarted)
