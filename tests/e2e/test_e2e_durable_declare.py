"""Durable queues against a real broker process, as an application and an operator meet them: a queue
whose durability a redeclare gets wrong is refused rather than answered OK (the client would believe a
memory-only queue keeps its messages across a restart), while `flowbroker publish` still writes to a
durable queue and its message survives the restart; and a producer without flow control is refused by
durable queues while the disk alarm is on, since nothing can pace it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import trio

import flowbroker.client as fb
from flowbroker.protocol.errors import ErrorCode

from tests.e2e.daemon import FLOWBROKER, stop


async def start_broker(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """A broker process journalling under tmp_path/data; returns it and its URL."""
    port_file = tmp_path / "ports.json"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([FLOWBROKER, "serve", "--port", "0", "--no-admin", "--no-udp", "--no-metrics",
                             "--data-dir", str(tmp_path / "data"), "--port-file", str(port_file), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with trio.fail_after(30):
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else "broker exited"
            await trio.sleep(0.05)
    return proc, f"flowbroker://127.0.0.1:{json.loads(port_file.read_text())['port']}"


async def test_a_redeclare_that_changes_durability_is_refused_and_publish_still_reaches_a_durable_queue(
        tmp_path: Path) -> None:
    proc, url = await start_broker(tmp_path)
    try:
        async with await fb.connect(url) as conn:
            await conn.declare_queue("q")
            with pytest.raises(fb.RequestError) as refused:
                await conn.declare_queue("q", durable=True)
            assert refused.value.code == ErrorCode.ALREADY_EXISTS and "memory-only" in str(refused.value)
            await conn.declare_queue("d", durable=True, flow_stop_count=100)
            with pytest.raises(fb.RequestError) as refused:
                await conn.declare_queue("d", flow_stop_count=100)
            assert refused.value.code == ErrorCode.ALREADY_EXISTS and "durable=True" in str(refused.value)
            await conn.declare_queue("d", durable=True, flow_stop_count=100)  # the same again: OK
        # the CLI declares the queue it publishes to with the wire's defaults: a durable one is taken as it is
        published = await trio.to_thread.run_sync(lambda: subprocess.run(
            [FLOWBROKER, "publish", "--url", url, "-k", "d", "kept"], capture_output=True, text=True, timeout=60,
            env={**os.environ, "FLOWBROKER_USER": ""}))
        assert published.returncode == 0, published.stderr
    finally:
        stop(proc)
    proc, url = await start_broker(tmp_path)
    try:
        async with await fb.connect(url) as conn:
            assert (await conn.declare_queue("d", durable=True, flow_stop_count=100))["count"] == 1
            assert (await conn.declare_queue("q"))["count"] == 0  # memory-only: a new, empty queue
    finally:
        stop(proc)


async def test_the_disk_alarm_refuses_a_producer_without_flow_control_on_durable_queues_only(tmp_path: Path) -> None:
    config = tmp_path / "flowbroker.toml"
    config.write_text('[storage]\ndisk_free_limit = "1024TiB"\n')  # more than any disk: the alarm is on at once
    proc, url = await start_broker(tmp_path, "--config", str(config))
    try:
        # leaving the paced connection reports its held transfers, which the alarm never completes
        with pytest.raises(fb.PublishFailures):
            async with await fb.connect(url, close_timeout=0.5) as paced, \
                    await fb.connect(url, flow_control=False) as unpaced:
                await paced.declare_queue("d", durable=True)
                await paced.declare_queue("m")
                events = paced.flow_events()
                held = paced.producer(routing_key="d")
                sent = 0
                with trio.fail_after(20):  # the alarm comes on after the first commit's look at the disk
                    while not paced.flow_state.is_stopped:
                        await held.send(b"held")
                        sent += 1
                        await trio.sleep(0.05)
                event = await events.get()
                assert event is not None and event.stop is not None and event.stop.threshold == "disk"
                to_memory = unpaced.producer(routing_key="m")
                await to_memory.send(b"taken")
                await to_memory.flush(timeout=10)
                to_durable = unpaced.producer(routing_key="d")
                await to_durable.send(b"refused")
                with pytest.raises(fb.PublishError) as refused:
                    await to_durable.flush(timeout=10)
                assert refused.value.code == ErrorCode.RESOURCE_EXHAUSTED and refused.value.destination == "d"
                assert "disk alarm" in str(refused.value)
                assert (await paced.declare_queue("d", durable=True))["count"] == sent  # held ones, not the refused
    finally:
        stop(proc)
