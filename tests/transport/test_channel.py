"""Channel URI parsing: every parameter, defaults, addressing modes, and errors that name the bad part."""

from __future__ import annotations

import pytest

from flowbroker.transport.channel import (
    ChannelUri,
    CongestionControlName,
    ControlMode,
    Endpoint,
    InterfaceSpec,
    parse_channel,
    parse_aeron_size,
)
from flowbroker.transport.errors import ChannelUriError, TransportError


def test_defaults_from_the_reference_driver() -> None:
    ch = parse_channel("aeron:udp?endpoint=127.0.0.1:40123")
    assert ch.endpoint == Endpoint("127.0.0.1", 40123)
    assert ch.mtu == 1408
    assert ch.term_length == 16 * 1024 * 1024
    assert ch.ttl == 0
    assert ch.receiver_window == 128 * 1024
    assert ch.so_rcvbuf == 128 * 1024
    assert ch.cc is CongestionControlName.STATIC
    assert ch.fc is None and ch.gtag is None and ch.session_id is None
    assert ch.linger_ns == 5_000_000_000 and ch.nak_delay_ns == 100_000 and ch.max_resend == 16
    assert ch.reliable and ch.eos and ch.tether
    assert ch.is_unicast and not ch.is_multicast and not ch.is_multi_destination
    assert ch.control_endpoint is None
    assert ch.publication_window == 8 * 1024 * 1024
    assert str(ch) == "aeron:udp?endpoint=127.0.0.1:40123"


def test_every_parameter() -> None:
    uri = (
        "aeron:udp?endpoint=10.0.0.5:4050|control=10.0.0.1:4051|interface=10.0.0.0:0/24|ttl=4|mtu=8k"
        "|term-length=64k|session-id=-17|rcv-wnd=32k|fc=min,t:2s,g:7/3|cc=cubic|gtag=-9"
        "|init-term-id=100|term-id=103|term-offset=4096|so-rcvbuf=2m|so-sndbuf=1m|linger=200ms"
        "|nak-delay=50us|max-resend=4|pub-wnd=16k|reliable=false|eos=false|tether=false|rejoin=true"
        "|sparse=false|alias=primary"
    )
    ch = parse_channel(uri)
    assert ch == ChannelUri(
        endpoint=Endpoint("10.0.0.5", 4050),
        control=Endpoint("10.0.0.1", 4051),
        interface=InterfaceSpec("10.0.0.0", 0, 24),
        ttl=4, mtu=8192, term_length=65536, session_id=-17, rcv_wnd=32768, fc="min,t:2s,g:7/3",
        cc=CongestionControlName.CUBIC, gtag=-9, init_term_id=100, term_id=103, term_offset=4096,
        so_rcvbuf=2 * 1024 * 1024, so_sndbuf=1024 * 1024, linger_ns=200_000_000, nak_delay_ns=50_000,
        max_resend=4, pub_wnd=16384, reliable=False, eos=False, tether=False, rejoin=True, sparse=False,
        alias="primary",
    )
    assert ch.has_initial_position
    assert ch.receiver_window == 32768
    assert ch.publication_window == 16384
    assert str(ch) == uri
    assert str(ch.interface) == "10.0.0.0:0/24"


def test_receiver_window_capped_at_half_term() -> None:
    assert parse_channel("aeron:udp?endpoint=h:1|term-length=64k").receiver_window == 32768
    assert parse_channel("aeron:udp?endpoint=h:1|term-length=64k|rcv-wnd=1m").receiver_window == 32768


def test_multicast_data_odd_control_next_even() -> None:
    ch = parse_channel("aeron:udp?endpoint=224.10.9.7:4050|interface=127.0.0.1|ttl=1")
    assert ch.is_multicast and not ch.is_unicast
    assert ch.data_endpoint == Endpoint("224.10.9.7", 4050)
    assert ch.control_endpoint == Endpoint("224.10.9.8", 4050)
    assert ch.interface == InterfaceSpec("127.0.0.1")
    v6 = parse_channel("aeron:udp?endpoint=[ff02::3]:4050")
    assert v6.is_multicast and v6.control_endpoint == Endpoint("ff02::4", 4050)
    assert str(v6.data_endpoint) == "[ff02::3]:4050"


def test_multi_destination_cast_modes() -> None:
    manual = parse_channel("aeron:udp?control=192.168.0.3:4050|control-mode=manual")
    assert manual.is_multi_destination and manual.control_mode is ControlMode.MANUAL
    assert manual.endpoint is None and manual.control_endpoint == Endpoint("192.168.0.3", 4050)
    assert not manual.is_unicast
    bare_manual = parse_channel("aeron:udp?control-mode=manual")
    assert bare_manual.is_multi_destination and bare_manual.control is None
    dynamic = parse_channel("aeron:udp?control=192.168.0.3:4050|control-mode=dynamic")
    assert dynamic.control_mode is ControlMode.DYNAMIC
    # A subscription of a dynamic MDC stream: its endpoint plus the publication's control address.
    sub = parse_channel("aeron:udp?endpoint=192.168.0.4:4051|control=192.168.0.3:4050")
    assert sub.is_unicast and sub.has_explicit_control
    assert sub.control_endpoint == Endpoint("192.168.0.3", 4050)


def test_hosts_and_ipv6() -> None:
    assert parse_channel("aeron:udp?endpoint=localhost:0").endpoint == Endpoint("localhost", 0)
    ch = parse_channel("aeron:udp?endpoint=[::1]:9000|interface=[fe80::1]:0/64")
    assert ch.endpoint == Endpoint("::1", 9000)
    assert ch.interface == InterfaceSpec("fe80::1", 0, 64)
    assert Endpoint("::1", 9000).ip is not None and Endpoint("box.example", 1).ip is None


def test_parse_size() -> None:
    assert parse_aeron_size("64k") == 65536 and parse_aeron_size("1M") == 1 << 20 and parse_aeron_size("1g") == 1 << 30
    assert parse_aeron_size("1408") == 1408
    with pytest.raises(ValueError):
        parse_aeron_size("12q")


BAD = [
    ("http://x", "scheme"),
    ("aeron:ipc", "media"),
    ("aeron:ipc?term-length=64k", "media"),
    ("aeron:tcp?endpoint=a:1", "media"),
    ("aeron:udp", "endpoint"),
    ("aeron:udp?mtu=1408", "endpoint"),
    ("aeron:udp?endpoint", "endpoint"),
    ("aeron:udp?endpoint=a:1||mtu=1408", "|"),
    ("aeron:udp?endpont=a:1", "endpont"),
    ("aeron:udp?endpoint=a:1|endpoint=b:2", "endpoint"),
    ("aeron:udp?endpoint=", "endpoint"),
    ("aeron:udp?endpoint=nohostport", "endpoint=nohostport"),
    ("aeron:udp?endpoint=a:70000", "endpoint=a:70000"),
    ("aeron:udp?endpoint=300.1.1.1:5", "endpoint=300.1.1.1:5"),
    ("aeron:udp?endpoint=[zz::1]:5", "endpoint=[zz::1]:5"),
    ("aeron:udp?endpoint=bad_host!:5", "endpoint=bad_host!:5"),
    ("aeron:udp?endpoint=224.10.9.8:4050", "endpoint=224.10.9.8:4050"),
    ("aeron:udp?endpoint=[ff02::4]:4050", "endpoint=[ff02::4]:4050"),
    ("aeron:udp?endpoint=224.10.9.7:0", "endpoint=224.10.9.7:0"),
    ("aeron:udp?endpoint=224.10.9.7:5|control-mode=manual", "control-mode"),
    ("aeron:udp?endpoint=a:1|control=224.0.0.9:5", "control=224.0.0.9:5"),
    ("aeron:udp?control-mode=sideways", "control-mode=sideways"),
    ("aeron:udp?control-mode=response|control=a:1", "control-mode=response"),
    ("aeron:udp?control-mode=dynamic", "control-mode=dynamic"),
    ("aeron:udp?endpoint=a:1|interface=/24", "interface=/24"),
    ("aeron:udp?endpoint=a:1|interface=10.0.0.1/40", "interface=10.0.0.1/40"),
    ("aeron:udp?endpoint=a:1|interface=10.0.0.1/x", "interface=10.0.0.1/x"),
    ("aeron:udp?endpoint=a:1|ttl=256", "ttl=256"),
    ("aeron:udp?endpoint=a:1|ttl=-1", "ttl=-1"),
    ("aeron:udp?endpoint=a:1|mtu=1400", "mtu=1400"),
    ("aeron:udp?endpoint=a:1|mtu=128k", "mtu=128k"),
    ("aeron:udp?endpoint=a:1|term-length=100000", "term-length=100000"),
    ("aeron:udp?endpoint=a:1|term-length=32k", "term-length=32k"),
    ("aeron:udp?endpoint=a:1|term-length=2g", "term-length=2g"),
    ("aeron:udp?endpoint=a:1|session-id=2147483648", "session-id=2147483648"),
    ("aeron:udp?endpoint=a:1|session-id=x", "session-id=x"),
    ("aeron:udp?endpoint=a:1|rcv-wnd=0", "rcv-wnd=0"),
    ("aeron:udp?endpoint=a:1|rcv-wnd=1k", "rcv-wnd=1k"),
    ("aeron:udp?endpoint=a:1|fc=fastest", "fc=fastest"),
    ("aeron:udp?endpoint=a:1|fc=min,t:soon", "fc=min,t:soon"),
    ("aeron:udp?endpoint=a:1|fc=max,t:1s", "fc=max,t:1s"),
    ("aeron:udp?endpoint=a:1|cc=reno", "cc=reno"),
    ("aeron:udp?endpoint=a:1|gtag=1.5", "gtag=1.5"),
    ("aeron:udp?endpoint=a:1|init-term-id=5", "init-term-id"),
    ("aeron:udp?endpoint=a:1|init-term-id=5|term-id=4|term-offset=0", "term-id=4"),
    ("aeron:udp?endpoint=a:1|init-term-id=5|term-id=5|term-offset=33", "term-offset=33"),
    ("aeron:udp?endpoint=a:1|linger=forever", "linger=forever"),
    ("aeron:udp?endpoint=a:1|max-resend=0", "max-resend=0"),
    ("aeron:udp?endpoint=a:1|reliable=yes", "reliable=yes"),
]


@pytest.mark.parametrize(("uri", "part"), BAD)
def test_bad_uris_name_the_bad_part(uri: str, part: str) -> None:
    with pytest.raises(ChannelUriError) as info:
        parse_channel(uri)
    err = info.value
    assert err.part == part
    assert part in str(err) and uri in str(err)
    assert isinstance(err, TransportError) and isinstance(err, ValueError)


def test_wrapping_initial_position_is_accepted() -> None:
    ch = parse_channel(
        "aeron:udp?endpoint=a:1|init-term-id=2147483647|term-id=-2147483647|term-offset=64|term-length=64k"
    )
    assert ch.term_id == -(2**31) + 1 and ch.term_offset == 64
