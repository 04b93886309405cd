"""`flowbroker publish` from stdin sends no line once one is refused, not even the line it was reading when
the refusal came (a tester: lines a second apart to a missing exchange; the first was refused within
milliseconds, and the second was still sent and refused).

The CLI runs in a thread of the test (its own trio.run), over real sockets to a real broker, its stdin a
pipe the test writes: so the test can see the CLI's producer take the refusal before it writes the next line."""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

import pytest
import trio
from click.testing import CliRunner, Result

from flowbroker.broker import cli
from flowbroker.client.producer import Producer
from flowbroker.protocol import ErrorCode


async def test_the_line_read_while_a_refusal_came_is_not_sent(
        start_flowbroker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    broker = await start_flowbroker()
    refused = threading.Event()
    on_error = Producer._on_error

    def taking_refusal(producer: Producer, error: Any) -> None:
        on_error(producer, error)
        refused.set()

    monkeypatch.setattr(Producer, "_on_error", taking_refusal)
    read_end, write_end = os.pipe()
    client_log = logging.getLogger("flowbroker.client")
    level = client_log.level  # (publish quiets the SDK's log: for the rest of the process, in a thread)

    def publish() -> Result:
        with open(read_end, "rb") as stdin:
            return CliRunner().invoke(cli.main, ["publish", "--url", broker.url, "--exchange", "nosuch", "-k", "x",
                                                 "--json"], input=stdin)

    async def feed() -> None:
        try:
            os.write(write_end, b"a\n")
            assert await trio.to_thread.run_sync(refused.wait, 10), "line a was not refused"
            os.write(write_end, b"b\n")  # read after the refusal came: not to be sent
        finally:
            os.close(write_end)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            result = await trio.to_thread.run_sync(publish)
    finally:
        client_log.setLevel(level)
    assert result.exit_code == 1, result.output
    outcome = json.loads(result.stdout)
    assert (outcome["requested"], outcome["sent"], outcome["failed"], outcome["not_sent"]) == (2, 1, 1, 1), outcome
    assert "no exchange named 'nosuch'" in outcome["error"]
    assert broker.core.errors_sent[ErrorCode.NOT_FOUND] == 1  # the broker was sent line a alone
