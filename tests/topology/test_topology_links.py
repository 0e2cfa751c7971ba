"""Shaped links, the parts that need no namespace: the `[regions.link]` keys and their errors, the strings a
shape is parsed from, the relay's userspace delay (a floor on every round trip, a stream never reordered), and
what `validate` and the regions do where namespaces cannot be made."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from rlbus.topology.file.load import validate_text
from rlbus.topology.network.links import LinkShape, parse_percent, parse_rate, parse_time
from rlbus.topology.network.regions import RegionSet
from rlbus.topology.network.relay import Relay

LEAF = '''run = "links"
[[regions]]
name = "hub"
role = "hub"
[[regions]]
name = "eu"
  [[regions.actors]]
  kind = "demo_producer"
'''


def test_link_keys_parse_into_a_shape() -> None:
    """`[regions.link]` strings become bits per second, seconds and a fraction; leaves without a link have none."""
    topology, problems = validate_text(LEAF + '  [regions.link]\n  bandwidth = "100mbit"\n  latency = "30ms"\n'
                                              '  jitter = "1.5ms"\n  loss = "0.1%"\n', local_cores=2)
    assert topology is not None, [str(p) for p in problems]
    assert topology.link_shapes() == {"eu": LinkShape(bandwidth_bps=100_000_000, latency_s=0.03, jitter_s=0.0015,
                                                      loss=0.001)}
    assert (parse_rate("1gbit"), parse_rate("512kbit"), parse_time("250us"), parse_percent("0%")) == \
           (1_000_000_000, 512_000, 0.00025, 0.0)
    for bad, parse in (("100mbps", parse_rate), ("0mbit", parse_rate), ("30", parse_time), ("100%", parse_percent)):
        with pytest.raises(ValueError, match=repr(bad)):
            parse(bad)


@pytest.mark.parametrize(("link", "key", "expected"), [
    ('bandwidth = "100mbps"', "regions[1].link.bandwidth", "a rate like '100mbit'"),
    ('latency = "30"', "regions[1].link.latency", "a time like '30ms'"),
    ('loss = "0.1"', "regions[1].link.loss", "a percentage like '0.1%'"),
    ('loss = "100%"', "regions[1].link.loss", "a link that drops every packet is a cut"),
    ('latency = "5ms"\n  jitter = "10ms"', "regions[1].link.jitter", "exceeds latency 5ms"),
    ('delay = "5ms"', "regions[1].link.delay", "unknown key 'delay'"),
])
def test_a_bad_link_key_is_located_with_what_was_expected(link: str, key: str, expected: str) -> None:
    topology, problems = validate_text(LEAF + f"  [regions.link]\n  {link}\n", local_cores=2)
    assert topology is None
    assert [(p.key, expected in p.message) for p in problems] == [(key, True)], [str(p) for p in problems]


def test_a_link_on_the_hub_is_refused() -> None:
    text = LEAF.replace('role = "hub"\n', 'role = "hub"\n  [regions.link]\n  latency = "1ms"\n')
    topology, problems = validate_text(text, local_cores=2)
    assert topology is None and [p.key for p in problems] == ["regions[0].link"]
    assert "is the hub" in problems[0].message


def test_relay_delays_each_direction_and_keeps_the_stream_in_order() -> None:
    """Through a relay with 20 ms ± 10 ms each way, every echo takes at least the 20 ms round-trip floor
    (2 × (20 − 10) ms) and 200 numbered chunks come back in the order they were sent."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    with Relay(("127.0.0.1", port), latency_s=0.02, jitter_s=0.01) as relay, \
            socket.create_connection(("127.0.0.1", relay.port), timeout=10) as conn:
        rtts = []
        for i in range(5):
            start = time.monotonic()
            conn.sendall(b"%d;" % i)
            assert conn.recv(16) == b"%d;" % i
            rtts.append(time.monotonic() - start)
        sent = b"".join(b"%d;" % i for i in range(200))
        for i in range(200):
            conn.sendall(b"%d;" % i)
            time.sleep(0.0005)
        got = b""
        while len(got) < len(sent):
            got += conn.recv(65536)
        relay.spike(0.05)
        start = time.monotonic()
        conn.sendall(b"x")
        assert conn.recv(1) == b"x"
        spiked = time.monotonic() - start
    server.close()
    thread.join(10)
    assert min(rtts) >= 2 * (0.02 - 0.01)
    assert got == sent
    assert spiked >= 2 * (0.02 - 0.01 + 0.05)


NO_NAMESPACES = "network namespaces need root (this process runs as uid 1000)"


def test_where_namespaces_cannot_be_made_validate_names_each_link_and_up_runs_on_loopback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host that cannot make namespaces (the host check answers as for a non-root user), `validate` warns on
    each `[regions.link]`, and the regions start on loopback with the reason, which `rlbus up` prints in one line."""
    import rlbus.topology.network.links
    import rlbus.topology.network.regions
    from rlbus.ops.up import links_line
    from rlbus.topology.file.load import validate

    for module in (rlbus.topology.network.links, rlbus.topology.network.regions):
        monkeypatch.setattr(module, "namespaces_unavailable", lambda: NO_NAMESPACES)
    path = tmp_path / "links.toml"
    path.write_text(LEAF + '  [regions.link]\n  latency = "30ms"\n')
    topology, problems = validate(path, local_cores=2)
    assert topology is not None
    assert [(p.key, p.severity) for p in problems] == [("regions[1].link", "warning")]
    assert NO_NAMESPACES in problems[0].message and "on loopback" in problems[0].message
    with RegionSet.start(tmp_path / "nats", ["hub", "eu"], "hub", links=topology.link_shapes()) as rs:
        assert rs.links is None and rs.links_skipped == NO_NAMESPACES and rs.netns("eu") is None
        assert rs.url("eu").startswith("nats://127.0.0.1:") and rs.linked() == {"eu"}
        line = links_line(rs, topology)
    assert line == f"rlbus up: [regions.link] of eu ignored: {NO_NAMESPACES}; running on loopback, unshaped"
