"""One broker per data directory (docs/storage.md): a second broker given the same --data-dir does not start
nor read the journal, and says which pid holds it. Two brokers on one journal each recovered it and wrote
segments of their own; after a kill -9 a restart had lost 1,000 of 3,000 completed messages (a tester)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import trio

import flowbroker.client as fc
from flowbroker.broker.journal import segment_name
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


def test_a_data_dir_that_cannot_be_used_stops_the_broker_naming_the_key(tmp_path: Path) -> None:
    """A data_dir that is a file (or under one) was reported as the client port's listen failure ('another
    broker running?'), and a journal/ that is a file let the broker start and hang the first durable
    declare on a commit that could never be written (a tester)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    journal_file = tmp_path / "has-a-file-journal"
    journal_file.mkdir()
    (journal_file / "journal").write_text("")
    for data_dir, says in ((a_file, "cannot be used"), (a_file / "under", "cannot be used"),
                           (journal_file, "is not a directory")):
        config = tmp_path / "flowbroker.toml"  # (the --data-dir flag refuses a file itself, as a usage error)
        config.write_text(f'[storage]\ndata_dir = "{data_dir}"\n')
        broker = subprocess.Popen([FLOWBROKER, "serve", "--port", str(free_port()), "--no-admin", "--no-udp",
                                   "--config", str(config)], stderr=subprocess.PIPE, text=True,
                                  env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
        _, err = broker.communicate(timeout=60)
        assert broker.returncode == 1, err
        assert f"[storage] data_dir {data_dir}" in err and says in err and "cannot listen" not in err, err


def test_a_journal_that_cannot_be_read_stops_the_broker_naming_the_key_and_the_file(tmp_path: Path) -> None:
    """A directory named like a segment in journal/: `flowbroker serve` said "cannot listen on 127.0.0.1:PORT:
    Is a directory (another broker running? ...)", any OSError reading the journal taken for the client
    port's (a tester, 3 of 3). It says the data directory cannot be used, and which file, as
    docs/storage.md does."""
    data_dir = tmp_path / "data"
    stray = data_dir / "journal" / segment_name(99)
    stray.mkdir(parents=True)
    result = subprocess.run([FLOWBROKER, "serve", "--port", str(free_port()), "--no-admin", "--no-udp",
                             "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "HOME": str(tmp_path)})  # (PYTHONPATH kept: the tree under test)
    err = result.stderr
    assert result.returncode == 1 and "Traceback" not in err, err
    assert f"Error: [storage] data_dir {data_dir} cannot be used: " in err and f"{stray}: not a regular file" in err, err
    assert "cannot listen" not in err, err


def test_a_fifo_named_like_a_segment_stops_the_broker_at_start_not_hangs_it(tmp_path: Path) -> None:
    """`mkfifo journal/...07.seg`: recovery's read of it waited for ever, in a worker thread, and the first
    SIGTERM did not end the broker (a tester, 2 of 2). A segment that is not a regular file is a journal
    that cannot be read."""
    data_dir = tmp_path / "data"
    stray = data_dir / "journal" / segment_name(7)
    stray.parent.mkdir(parents=True)
    os.mkfifo(stray)
    result = subprocess.run([FLOWBROKER, "serve", "--port", str(free_port()), "--no-admin", "--no-udp",
                             "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "HOME": str(tmp_path)})
    err = result.stderr
    assert result.returncode == 1 and "Traceback" not in err, err
    assert f"Error: [storage] data_dir {data_dir} cannot be used: " in err and "not a regular file" in err, err
