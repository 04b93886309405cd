"""Ctrl-C in a trio program that uses the SDK comes out where the program can catch it: a plain
KeyboardInterrupt in its own code, never from inside one of the connection's tasks. Unprotected, trio raised
it in whichever task was running, often the connection's writer (in a socket send, in msgpack's packer): the
program got a BaseExceptionGroup past its `except KeyboardInterrupt`, with a traceback (8 runs of 20), and
the writer was cut mid-frame. The connection's own tasks are KI-protected now."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import trio

PRODUCER = """
import sys, trio
import flowbroker.client as fb

async def main():
    async with await fb.connect(sys.argv[1]) as conn:
        await conn.declare_queue("ctrl-c", max_size=0, flow_stop_size=0, flow_stop_count=0)  # never stops it
        producer = conn.producer(routing_key="ctrl-c")
        print("sending", flush=True)
        while True:
            await producer.send(b"x" * 200)

try:
    trio.run(main)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


async def test_ctrl_c_reaches_the_program_not_the_connections_tasks(start_flowbroker) -> None:
    broker = await start_flowbroker()
    rng = random.Random(36)

    def one_run() -> tuple[int, str, str]:
        program = subprocess.Popen([sys.executable, "-c", PRODUCER, broker.url], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert program.stdout is not None
        assert program.stdout.readline() == "sending\n"
        time.sleep(rng.uniform(0.2, 0.6))  # somewhere in the middle of its sends
        program.send_signal(signal.SIGINT)
        out, err = program.communicate(timeout=30)
        return program.returncode, out, err

    for _ in range(12):
        code, out, err = await trio.to_thread.run_sync(one_run)
        # (a WARNING that the block ended with messages not completed may come first: it is the SDK's to say)
        assert (code, out) == (0, "interrupted\n") and "Traceback" not in err, err[-2000:]
