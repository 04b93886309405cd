"""A multicast group paced by its slowest member, end to end over real multicast UDP.

Loopback has no multicast route by default, so each test makes a network namespace of its own (lo up,
multicast on, 224.0.0.0/4 routed over it) and deletes it afterwards. In it run: tests/e2e/multicast_scenario.py
(a broker, a fast and a slow member on their own connections and multicast sockets, a flow-controlled
producer, all in one process so the group's queue and publication can be measured), the same with
`flowbroker serve` and every client a process of its own (tests/e2e/multicast_process.py), and the example
of docs/client.md's "Multicast groups", as written. The tests need root and iproute2 (`make system-tools`
installs iproute2); they fail, not skip, without them.
"""

from __future__ import annotations

import bisect
import json
import os
import select
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.daemon import stop

SCENARIO = Path(__file__).with_name("multicast_scenario.py")
ROOT = Path(__file__).resolve().parents[2]
WINDOW = 16 * 1024
STOP = 60


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"fb-mc-{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for args in (["link", "set", "lo", "up"], ["link", "set", "lo", "multicast", "on"],
                     ["route", "add", "224.0.0.0/4", "dev", "lo"]):
            subprocess.run(["ip", "-n", name, *args], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=True)


def run_scenario(namespace: str, fc: str, group: str) -> dict[str, Any]:
    proc = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, str(SCENARIO), fc, group],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def check_paced_by_the_slowest(r: dict[str, Any]) -> None:
    # every member got every message, once, in order, and every message was settled
    assert r["fast_in_order"] and r["slow_in_order"], (r["fast_count"], r["slow_count"])
    assert r["settled"] == 600 and r["queue_left"] == 0
    # the fast member was never more than one window (plus one message) ahead of the slow one's processing:
    # the slow member paced it through the group's min flow control
    per_message = r["term_bytes_per_message"]
    assert r["worst_lead"] <= WINDOW + per_message
    assert r["worst_lead"] > WINDOW // 2  # and it did run ahead as far as the window allowed
    # the group's queue held what the slow member had not processed, and its watermark stopped the producer
    # (FLOW_STOPPED naming the group's queue) and let it go again; the queue never passed the stop watermark
    # by more than what the producer's credit lets it have in flight (in messages)
    assert ["stopped", "g"] in r["events"] and ["resumed", "g"] in r["events"]
    assert r["max_depth"] >= STOP
    # (message_size: the 400-byte body + 512; one message may overflow the credit, as DCP lets one)
    assert r["max_depth"] <= STOP + r["producer_credit"] // (400 + 512) + 3
    assert not r["refused"], r["refused"]


def test_a_multicast_group_is_paced_by_its_slowest_member(namespace: str) -> None:
    r = run_scenario(namespace, "min", "239.7.7.1:40461")
    assert "fc=min," in r["channel"] and r["group_tag"] is None
    check_paced_by_the_slowest(r)
    # processing settles a member's messages: `unsettled` is the one in hand (it counted every one, a tester)
    assert (r["slow_unsettled_in_hand"], r["slow_unsettled_after"]) == (1, 0)


def test_tagged_flow_control_is_selectable(namespace: str) -> None:
    r = run_scenario(namespace, "tagged", "239.7.7.3:40463")
    assert isinstance(r["group_tag"], int) and f"fc=tagged,g:{r['group_tag']}," in r["channel"]
    check_paced_by_the_slowest(r)


LEAVE = Path(__file__).with_name("multicast_leave.py")


def run_leave(namespace: str, group: str, processed: int) -> dict[str, Any]:
    proc = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, str(LEAVE), group, str(processed)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("processed", [100, 200])
def test_a_member_that_leaves_settles_exactly_what_it_processed(namespace: str, processed: int) -> None:
    """Leaving with messages received and not taken settled them (lost: 2 runs in 9), and leaving right
    after processing everything settled nothing (all of it delivered again to the next member). A leave
    settles whole payloads: what it processed of its last, unfinished one comes again, never less."""
    for round_ in range(3):
        r = run_leave(namespace, f"239.7.7.{5 + 2 * round_}:{40465 + round_}", processed)
        per_payload = r["mtu"] // 1000 + 1
        assert r["first_in_order"] and processed - per_payload <= r["settled_by_first"] <= processed, r
        if processed < 200:
            assert r["buffered_at_leave"] > 0  # it did leave with messages received and never taken
        else:
            assert r["settled_by_first"] == 200  # everything processed: nothing comes again
        assert r["second"] == list(range(r["settled_by_first"], 200)) and r["second_extra"] == 0, r


DOC_RUNNER = r"""
set -e
"$FLOWBROKER" serve --no-admin 2>"$HOME/broker.log" &
broker=$!
trap 'kill $broker 2>/dev/null; wait $broker 2>/dev/null || true' EXIT
for i in $(seq 200); do
  "$PYTHON" -c 'import socket; socket.create_connection(("127.0.0.1", 5680), 0.2).close()' 2>/dev/null && break
  sleep 0.05
done
"$PYTHON" -c "$BLOCK"
"""


def client_md_multicast_example() -> str:
    """The python block of docs/client.md's "Multicast groups" section (skipped by the docs runner, which runs
    on the host; run here instead, as written)."""
    text = (ROOT / "docs" / "client.md").read_text()
    section = text.split("### Multicast groups", 1)[1].split("\n### ", 1)[0]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    return block


def test_the_client_md_multicast_example_runs_as_written(namespace: str, tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "FLOWBROKER": str(Path(sys.executable).with_name("flowbroker")),
           "PYTHON": sys.executable, "BLOCK": client_md_multicast_example()}
    proc = subprocess.run(["ip", "netns", "exec", namespace, "bash", "-c", DOC_RUNNER], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    assert proc.stdout.strip().splitlines()[-1] == "True"


PROCESS = Path(__file__).with_name("multicast_process.py")


def _in(namespace: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, sys.executable, str(PROCESS), *args]


def _wait_line(proc: subprocess.Popen[str], expected: str, timeout: float) -> None:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no {expected!r} within {timeout} s"
    line = proc.stdout.readline().strip()
    assert line == expected, (line, proc.stderr.read() if proc.stderr else "")


def test_broker_members_and_producer_in_separate_processes(namespace: str, tmp_path: Path) -> None:
    """`flowbroker serve`, a fast member, a slow member and a producer, each a process of its own in the
    namespace: the fast member never had more than one window (in messages) beyond what the slow one had
    processed at that moment (CLOCK_MONOTONIC is the host's, so the two logs compare)."""
    count, window, body = 400, 16 * 1024, 400
    config = tmp_path / "broker.toml"
    config.write_text('[credit]\npolicy = "static"\nstatic_size = 16384\n\n[admin]\nenabled = false\n')
    env = {**os.environ, "HOME": str(tmp_path)}
    with (tmp_path / "broker.log").open("w") as log:
        broker = subprocess.Popen(["ip", "netns", "exec", namespace, str(Path(sys.executable).with_name("flowbroker")),
                                   "serve", "--config", str(config)], env=env, stdout=subprocess.DEVNULL, stderr=log,
                                  text=True)
    members: list[subprocess.Popen[str]] = []
    try:
        subprocess.run(_in(namespace, "setup"), check=True, timeout=60, cwd=ROOT, env=env)
        for delay in ("0", "0.003"):
            proc = subprocess.Popen(_in(namespace, "member", "min", "239.7.7.5:40465", delay, str(count), str(window)),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
            members.append(proc)
            _wait_line(proc, "joined", 30)
        produced = subprocess.run(_in(namespace, "produce", str(count), str(body)), capture_output=True, text=True,
                                  timeout=120, cwd=ROOT, env=env)
        assert produced.returncode == 0, produced.stderr[-4000:]
        events = json.loads(produced.stdout.strip().splitlines()[-1])["events"]
        outs = []
        for proc in members:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-4000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in members:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        stop(broker)
    fast, slow = outs
    expected = ["%05d" % i + "b" * (body - 5) for i in range(count)]
    assert fast["bodies"] == expected and slow["bodies"] == expected
    # 448 term bytes a message (400 + its envelope, 32-byte header, aligned): the window in messages, plus the
    # one a window may overflow by
    in_window = window // 448 + 1
    lead = 0
    for i, t in enumerate(fast["times"]):
        slow_done = bisect.bisect_right(slow["times"], t)
        lead = max(lead, i + 1 - slow_done)
    assert in_window // 2 < lead <= in_window + 1
    assert ["stopped", "g"] in events and ["resumed", "g"] in events
