"""Wireshark's Aeron dissector reads our frames exactly as we meant them.

The transport's own code paths produce the traffic (the term appender and sender scan for DATA runs,
fragments and the end-of-term PAD; the frame encoders for heartbeats, SM, NAK, SETUP, RTTM) and the UDP
module sends it over 127.0.0.1. ``tshark`` captures it on ``lo`` and decodes it with ``-d udp.port==N,aeron``;
the test fails on any malformed or length-invalid frame and on any field that differs from what was sent.
ERR and RSP_SETUP are left out: Debian's dissector (4.0) predates their current layouts.

Needs tshark and root (to capture on lo); CI installs tshark and runs as root. Never skipped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

from flowbroker.transport import frames as f
from flowbroker.transport.frames import DataFrame, FrameType, Nak, RttMeasurement, Setup, StatusMessage
from flowbroker.transport.terms import TermAppender, scan_for_availability
from flowbroker.transport.udp import UdpEndpoint, open_udp

pytestmark = pytest.mark.tshark

U32 = 0xFFFF_FFFF
U64 = 0xFFFF_FFFF_FFFF_FFFF
SESSION, STREAM = -1_234_567, 1001
TERM_LENGTH = 64 * 1024
MTU = 1408

Getter = Callable[[Any], int | str]

# Dissector field -> how to compute the expected value from our frame object.
DATA_FIELDS: dict[str, Getter] = {
    "frame_length": lambda fr: fr.frame_length, "version": lambda fr: 0, "flags": lambda fr: fr.flags,
    "type": lambda fr: fr.frame_type, "term_offset": lambda fr: fr.term_offset,
    "session_id": lambda fr: fr.session_id & U32, "stream_id": lambda fr: fr.stream_id & U32,
    "term_id": lambda fr: fr.term_id & U32,
}
FIELDS: dict[str, dict[str, Getter]] = {
    "aeron.data": {**DATA_FIELDS, "reserved_value": lambda fr: fr.reserved_value & U64},
    "aeron.pad": DATA_FIELDS,
    "aeron.heartbeat": {k: v for k, v in DATA_FIELDS.items()},
    "aeron.sm": {
        "frame_length": lambda fr: 44 if fr.group_tag is not None else 36, "version": lambda fr: 0,
        "flags": lambda fr: fr.flags, "type": lambda fr: 3, "session_id": lambda fr: fr.session_id & U32,
        "stream_id": lambda fr: fr.stream_id & U32,
        "consumption_term_id": lambda fr: fr.consumption_term_id & U32,
        "consumption_term_offset": lambda fr: fr.consumption_term_offset,
        "receiver_window": lambda fr: fr.receiver_window, "receiver_id": lambda fr: fr.receiver_id & U64,
    },
    "aeron.nak": {
        "frame_length": lambda fr: 28, "version": lambda fr: 0, "flags": lambda fr: fr.flags,
        "type": lambda fr: 2, "session_id": lambda fr: fr.session_id & U32,
        "stream_id": lambda fr: fr.stream_id & U32, "term_id": lambda fr: fr.term_id & U32,
        "term_offset": lambda fr: fr.term_offset, "length": lambda fr: fr.length,
    },
    "aeron.setup": {
        "frame_length": lambda fr: 40, "version": lambda fr: 0, "flags": lambda fr: fr.flags,
        "type": lambda fr: 5, "term_offset": lambda fr: fr.term_offset,
        "session_id": lambda fr: fr.session_id & U32, "stream_id": lambda fr: fr.stream_id & U32,
        "initial_term_id": lambda fr: fr.initial_term_id & U32,
        "active_term_id": lambda fr: fr.active_term_id & U32, "term_length": lambda fr: fr.term_length,
        "mtu": lambda fr: fr.mtu, "ttl": lambda fr: fr.ttl,
    },
    "aeron.rtt": {
        "frame_length": lambda fr: 40, "version": lambda fr: 0, "flags": lambda fr: fr.flags,
        "type": lambda fr: 6, "session_id": lambda fr: fr.session_id & U32,
        "stream_id": lambda fr: fr.stream_id & U32, "echo_timestamp": lambda fr: fr.echo_timestamp & U64,
        "reception_delta": lambda fr: fr.reception_delta & U64, "receiver_id": lambda fr: fr.receiver_id & U64,
    },
}
BAD_FILTER = " || ".join(
    ["_ws.malformed", "_ws.expert.severity == error", "!aeron"]
    + [f"aeron.analysis.invalid_{kind}_length" for kind in ("pad", "data", "nak", "sm", "rtt", "setup")]
)


def prefix_of(frame: f.Frame) -> str:
    if isinstance(frame, DataFrame):
        if frame.is_pad:
            return "aeron.pad"
        # The 4.0 dissector calls it a heartbeat only with flags exactly B|E; the EOS heartbeat (0xE0)
        # shows as a DATA frame of length 0. Not malformed, just labelled differently.
        return "aeron.heartbeat" if frame.is_heartbeat and frame.flags == f.UNFRAGMENTED else "aeron.data"
    return {StatusMessage: "aeron.sm", Nak: "aeron.nak", Setup: "aeron.setup", RttMeasurement: "aeron.rtt"}[
        type(frame)
    ]


class Traffic:
    """What is sent: each datagram with the frames it was meant to carry (None: appender DATA runs, checked
    by reassembling the stream from tshark's fields alone), and the messages of the data stream."""

    def __init__(self) -> None:
        self.datagrams: list[bytes] = []
        self.intended: list[list[f.Frame] | None] = []
        self.messages: list[bytes] = []
        self.initial_term_id = 2**31 - 1  # the stream crosses the int32 term-id wrap

    def add(self, frame: f.Frame) -> None:
        self.datagrams.append(f.encode_frame(frame))
        self.intended.append([frame])


def build_traffic() -> Traffic:
    """Datagrams as the transport would send them, covering every frame type the dissector knows."""
    t = Traffic()
    initial = t.initial_term_id
    app = TermAppender(TERM_LENGTH, initial, SESSION, STREAM, MTU)
    t.add(Setup(0, SESSION, STREAM, initial, initial, TERM_LENGTH, MTU, 0))
    t.add(Setup(4096, SESSION, STREAM, initial, -(2**31), TERM_LENGTH, 8192, 3, flags=f.SETUP_SEND_RESPONSE_FLAG))
    t.add(StatusMessage(SESSION, STREAM, 0, 0, 0, 0, flags=f.SM_SETUP_FLAG))
    t.add(StatusMessage(SESSION, STREAM, initial, 0, 32768, -42))
    t.add(StatusMessage(SESSION, STREAM, initial, 1024, 65536, 2**62 + 3, group_tag=7, flags=f.SM_EOS_FLAG))
    t.messages = [bytes([i % 251]) * size for i, size in enumerate([300, 300, 300, 300, 14, 0, 3000, 1000] * 25)]
    for message in t.messages:
        app.append(message, reserved_value=len(message))
    position = 0
    while position < app.position:  # the sender: runs of frames up to the MTU, PAD alone at the term end
        term = app.partition_for_position(position)
        offset = app.term_offset_for_position(position)
        available, padding = scan_for_availability(term, offset, MTU)
        t.datagrams.append(bytes(term[offset:offset + available]))
        t.intended.append(None)
        position += available + padding
    term_id = app.term_id_for_position(position)
    term_offset = app.term_offset_for_position(position)
    t.add(DataFrame(0, f.UNFRAGMENTED, term_offset, SESSION, STREAM, term_id))  # heartbeat
    t.add(DataFrame(0, f.BEGIN_END_AND_EOS_FLAGS, term_offset, SESSION, STREAM, term_id))  # EOS heartbeat
    t.add(Nak(SESSION, STREAM, initial, 29184, 1280))
    t.add(RttMeasurement(SESSION, STREAM, 1_700_000_000_123_456_789, 0, -42, flags=f.RTTM_REPLY_FLAG))
    t.add(RttMeasurement(SESSION, STREAM, 1_700_000_000_123_456_789, 5_000, 2**63 - 1))
    assert f.encode_frame(t.intended[-5][0]) == f.encode_heartbeat(term_offset, SESSION, STREAM, term_id)  # type: ignore[index]
    return t


def check_stream_from_tshark(packets: list[dict[str, list[str]]], t: Traffic) -> None:
    """Rebuild the message stream from tshark's DATA/PAD fields only: positions contiguous, B/E right."""
    position = 0
    messages: list[bytes] = []
    partial: bytearray | None = None
    for layers in packets:
        n_data = len(layers.get("aeron.data.frame_length", []))
        payloads = iter(bytes.fromhex(v.replace(":", "")) for v in layers.get("data.data", []))
        for i in range(n_data):
            length = as_int(layers["aeron.data.frame_length"][i])
            if length == 0:
                continue  # EOS heartbeat, labelled as DATA by this dissector
            term_id = as_int(layers["aeron.data.term_id"][i])
            term_offset = as_int(layers["aeron.data.term_offset"][i])
            count = (term_id - t.initial_term_id) & U32
            assert count * TERM_LENGTH + term_offset == position, f"DATA at {term_id}/{term_offset}"
            assert as_int(layers["aeron.data.session_id"][i]) == SESSION & U32
            assert as_int(layers["aeron.data.stream_id"][i]) == STREAM & U32
            assert as_int(layers["aeron.data.version"][i]) == 0 and as_int(layers["aeron.data.type"][i]) == 1
            flags = as_int(layers["aeron.data.flags"][i])
            payload = next(payloads) if length > 32 else b""
            assert len(payload) == length - 32
            if flags & f.UNFRAGMENTED == f.UNFRAGMENTED:
                messages.append(payload)
            elif flags & f.BEGIN_FLAG:
                partial = bytearray(payload)
            else:
                assert partial is not None
                partial += payload
                if flags & f.END_FLAG:
                    messages.append(bytes(partial))
                    partial = None
            position += f.align(length)
        for i, length_text in enumerate(layers.get("aeron.pad.frame_length", [])):
            term_offset = as_int(layers["aeron.pad.term_offset"][i])
            assert term_offset + as_int(length_text) == TERM_LENGTH
            position += as_int(length_text)
    assert messages == t.messages
    assert position > 2 * TERM_LENGTH  # crossed two term boundaries, one of them the int32 wrap


def capture(traffic: list[bytes], tmp_path: Path) -> tuple[Path, int, int, list[bytes]]:
    """Send ``traffic`` to a local port while tshark captures it; returns (pcap, port, sender port, received).

    "Capturing on" can be printed a moment before packets are really seen, so a separate canary socket
    sends heartbeats until tshark prints one; only then does the traffic go out. tshark is our own child,
    stopped by its pid once it has printed every traffic packet, or after a bounded time.
    """
    tshark = shutil.which("tshark")
    assert tshark is not None, "tshark is not installed (apt-get install tshark; .ci/run does it)"
    receiver = open_udp(("127.0.0.1", 0), so_rcvbuf=4 * 1024 * 1024)
    sender: UdpEndpoint = open_udp(("127.0.0.1", 0))
    canary = open_udp(("127.0.0.1", 0))
    port = receiver.local_address[1]
    sender_port = sender.local_address[1]
    canary_port = canary.local_address[1]
    pcap = tmp_path / "aeron.pcapng"
    log = tmp_path / "tshark.log"
    lines: list[int] = []

    def read_stdout(stream: IO[bytes]) -> None:
        for line in stream:
            text = line.decode(errors="replace").strip()
            if text.isdigit():
                lines.append(int(text))

    def wait_until(done: Callable[[], bool], timeout: float, what: str, tick: Callable[[], None]) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"tshark: {what}; log: {log.read_text(errors='replace')}")
            tick()
            time.sleep(0.05)

    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [tshark, "-i", "lo", "-f", f"udp port {port}", "-l", "-P", "-w", str(pcap),
             "-T", "fields", "-e", "udp.srcport"],
            stdout=subprocess.PIPE, stderr=log_file,
        )
    assert proc.stdout is not None
    reader = threading.Thread(target=read_stdout, args=(proc.stdout,), daemon=True)
    reader.start()
    received: list[bytes] = []
    try:
        heartbeat = f.encode_heartbeat(0, 1, 1, 1)
        wait_until(lambda: canary_port in lines, 30, "never saw the canary",
                   lambda: None if canary.send(heartbeat, ("127.0.0.1", port)) else None)
        for datagram in traffic:
            assert sender.send(datagram, ("127.0.0.1", port))
            time.sleep(0.002)  # keep well inside the capture buffer
        wait_until(lambda: lines.count(sender_port) >= len(traffic), 20, "missed traffic", lambda: None)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            got = receiver.try_receive()
            if got is None:
                if len(received) >= len(traffic):
                    break
                time.sleep(0.01)
            elif got[1][1] == sender_port:
                received.append(got[0])
    finally:
        if proc.poll() is None:
            proc.terminate()  # our own child, by its pid
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        reader.join(timeout=10)
        proc.stdout.close()
        sender.close()
        receiver.close()
        canary.close()
    return pcap, port, sender_port, received


def decode_with_tshark(pcap: Path, port: int, *args: str) -> str:
    return subprocess.run(
        ["tshark", "-r", str(pcap), "-d", f"udp.port=={port},aeron", *args],
        check=True, capture_output=True, timeout=60,
    ).stdout.decode()


def as_int(text: str) -> int:
    return int(text, 0)


def test_tshark_decodes_every_frame_as_sent(tmp_path: Path) -> None:
    t = build_traffic()
    traffic = t.datagrams
    assert len(traffic) > 60
    pcap, port, sender_port, received = capture(traffic, tmp_path)
    assert received == traffic  # loopback delivered every datagram unchanged
    only_ours = f"udp.srcport == {sender_port}"

    all_bad = decode_with_tshark(pcap, port, "-Y", BAD_FILTER, "-T", "fields", "-e", "frame.number")
    assert all_bad.strip() == "", f"tshark found malformed/invalid frames in packets {all_bad.split()}"

    fields = ["frame.number", "udp.length", "data.data", "aeron.sm.feedback"] + [
        f"{prefix}.{name}" for prefix, names in FIELDS.items() for name in names
    ]
    extract = [arg for name in fields for arg in ("-e", name)]
    packets = [
        p["_source"]["layers"]
        for p in json.loads(decode_with_tshark(pcap, port, "-Y", only_ours, "-T", "json", *extract))
    ]
    assert len(packets) == len(traffic)

    seen_prefixes: set[str] = set()
    for sent, intended, layers in zip(traffic, t.intended, packets):
        assert as_int(layers["udp.length"][0]) == len(sent) + 8
        if intended is None:
            frames, reason = f.decode_datagram(sent)
            assert reason is None
        else:
            frames = intended
        by_prefix: dict[str, list[f.Frame]] = {}
        for frame in frames:
            by_prefix.setdefault(prefix_of(frame), []).append(frame)
        for prefix, names in FIELDS.items():
            ours = by_prefix.get(prefix, [])
            for name, getter in names.items():
                theirs = [as_int(v) for v in layers.get(f"{prefix}.{name}", [])]
                assert theirs == [getter(fr) for fr in ours], (
                    f"packet {layers['frame.number'][0]}: {prefix}.{name}: tshark {theirs}, "
                    f"sent {[getter(fr) for fr in ours]}"
                )
        seen_prefixes.update(by_prefix)
        sms = [fr for fr in by_prefix.get("aeron.sm", []) if isinstance(fr, StatusMessage)]
        tags = [fr.group_tag.to_bytes(8, "little", signed=True).hex() for fr in sms if fr.group_tag is not None]
        assert layers.get("aeron.sm.feedback", []) == tags
    assert seen_prefixes == set(FIELDS)
    check_stream_from_tshark(packets, t)
    # Multi-frame datagrams and every fragment flag made it onto the wire.
    assert max(len(layers.get("aeron.data.frame_length", [])) for layers in packets) >= 4
    flags = {as_int(v) for layers in packets for v in layers.get("aeron.data.flags", [])}
    assert {f.BEGIN_FLAG, 0, f.END_FLAG, f.UNFRAGMENTED, f.BEGIN_END_AND_EOS_FLAGS} <= flags
