"""A broker out of file descriptors backs off, logs it rarely, and serves again once descriptors free.

The broker runs as its own process with RLIMIT_NOFILE set to 64 (soft and hard, so raising the soft
limit at start cannot help), and the test opens more silent sockets than it can accept. Before, trio's
serve_listeners logged EMFILE ten times a second for as long as it lasted.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import time
from pathlib import Path

import trio

import flowbroker.client as fc
from tests.e2e.daemon import FLOWBROKER, free_port, stop, wait_listening

DESCRIPTORS = 64


def _limit_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))


def test_out_of_descriptors_backs_off_logs_rarely_and_recovers(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "flowbroker.toml"
    config.write_text(f"[server]\nport = {port}\nhandshake_timeout = 1.0\nmax_connections = 1000\n[udp]\nenabled = false\n")
    broker = subprocess.Popen([FLOWBROKER, "serve", "--no-admin", "--config", str(config)],
                              stderr=subprocess.PIPE, text=True, preexec_fn=_limit_descriptors)
    silent: list[socket.socket] = []
    try:
        wait_listening(port, broker)
        for _ in range(2 * DESCRIPTORS):  # more than it has descriptors for: the rest wait in the backlog
            silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(3.0)  # out of descriptors; silent ones time out of the handshake, the backlog drains
        for sock in silent:
            sock.close()
        silent.clear()

        async def a_client_is_served() -> None:
            with trio.fail_after(10):
                while True:
                    try:
                        conn = await fc.connect(f"flowbroker://127.0.0.1:{port}", timeout=5)
                        break
                    except fc.HandshakeError:  # the backlog of silent sockets may still be draining
                        await trio.sleep(0.2)
                async with conn:
                    await conn.declare_queue("served")

        trio.run(a_client_is_served)
    finally:
        for sock in silent:
            sock.close()
        err = stop(broker)
    assert broker.returncode == 0, err
    assert f"descriptor limit {DESCRIPTORS} (hard limit {DESCRIPTORS}), max_connections 1000" in err
    assert f"descriptor limit {DESCRIPTORS} is below max_connections 1000" in err
    failures = [line for line in err.splitlines() if "accept failed" in line]
    assert 1 <= len(failures) <= 2, failures  # about 3 s out of descriptors: once, not thirty times
    assert "Too many open files" in failures[0]
