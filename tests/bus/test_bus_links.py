"""Regions over shaped links: a leaf's nats-server in its own network namespace, joined to the hub by a veth.

What the link does to traffic (its bandwidth and latency are floors a transfer cannot beat; its bytes are
counted), that a leaf cut off by dropping every packet, or by taking the link down, keeps serving and catches up
exactly once, and that every namespace and interface is gone after a stop and after a SIGKILL (the next run or
`rlbus clean` removes them, never another run's). Needs root, ip, tc and nft; skipped with the reason elsewhere.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import anyio
import nats
import nats.errors
import nats.js.errors
import pytest
from helpers import eventually, eventually_sync, new_run
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from rlbus.messages.streams import StreamSettings, provision_run, wait_routable
from rlbus.messages.subjects import Subjects
from rlbus.topology.links import LinkSet, LinkShape, clean_leftovers, leftovers, namespaces_unavailable
from rlbus.topology.regions import RegionSet

pytestmark = [pytest.mark.anyio,
              pytest.mark.skipif(namespaces_unavailable() is not None,
                                 reason=f"shaped links cannot be made here: {namespaces_unavailable()}")]

LATENCY_S = 0.02
"""One-way latency of the links under test (the round trip is twice it)."""
RATE_BPS = 20_000_000
SPIKE_S = 0.05
CATCH_UP_S = 90.0
"""Hang guard for the hub to catch up after a heal (sourcing retries on a backoff that grows with the outage)."""


async def _quiet(err: Exception) -> None:
    """error_cb for clients whose link is cut on purpose."""


async def _connect(rs: RegionSet, region: str, role: str) -> NATS:
    return await nats.connect(**rs.connect_options(region, role), error_cb=_quiet)


@pytest.fixture
def linked(tmp_path: Path) -> Iterator[RegionSet]:
    """A hub and `eu`, eu in a namespace behind a 20 Mbit/s link with 20 ms each way; everything removed after."""
    base = tmp_path / "regions"
    try:
        rs = RegionSet.start(base, ["hub", "eu"], "hub", links={
            "eu": LinkShape(bandwidth_bps=RATE_BPS, latency_s=LATENCY_S)})
        try:
            yield rs
        finally:
            rs.stop()
        assert leftovers(base) == ([], [])
    finally:
        clean_leftovers(base)


def test_link_is_a_floor_on_round_trips_and_transfers_and_counts_its_bytes(linked: RegionSet) -> None:
    """A request from eu to the hub takes at least the round trip, 2 MB at least their time at the rate, and
    both are counted on the veth; degraded, a request takes at least the spiked round trip and the link drops
    packets; restored, it drops none."""
    assert linked.netns("eu") is not None and linked.netns("hub") is None
    link = linked.links.links["eu"] if linked.links is not None else None
    assert link is not None and linked.url("eu").startswith(f"nats://{link.server_addr}:")

    async def round_trips(eu: NATS, n: int = 10) -> list[float]:
        rtts = []
        for _ in range(n):
            start = time.monotonic()
            await eu.request("probe.rtt", b"x", timeout=10)
            rtts.append(time.monotonic() - start)
        return rtts

    async def main() -> tuple[list[float], float, int, list[float], int]:
        hub = await _connect(linked, "hub", "admin")
        eu = await _connect(linked, "eu", "admin")
        probes = await hub.subscribe("probe.rtt")

        async def echo() -> None:                # an echo's failure surfaces in the task group, not a callback
            async for msg in probes.messages:
                await msg.respond(msg.data)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(echo)
                result = await measure(hub, eu)
                tg.cancel_scope.cancel()
            return result
        finally:
            await hub.close()
            await eu.close()

    async def measure(hub: NATS, eu: NATS) -> tuple[list[float], float, int, list[float], int]:
        got = await hub.subscribe("probe.bulk")
        await hub.flush()
        await eventually(lambda: eu.request("probe.rtt", b"x", timeout=1), what="echo across the link",
                         timeout_s=15, ignoring=(nats.errors.NoRespondersError, nats.errors.TimeoutError))
        rtts = await round_trips(eu)
        before = linked.link_counters()["eu"]["rx_bytes"]
        chunks = [os.urandom(100_000) for _ in range(20)]  # fresh bytes: the leaf link compresses (s2)
        start = time.monotonic()
        for chunk in chunks:
            await eu.publish("probe.bulk", chunk)
        for _ in chunks:
            await got.next_msg(timeout=30)
        took = time.monotonic() - start
        carried = linked.link_counters()["eu"]["rx_bytes"] - before
        linked.degrade("eu", loss=0.3, extra_latency_s=SPIKE_S)
        spiked = await round_trips(eu, 5)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:  # 200 datagrams into the namespace
            for _ in range(200):
                udp.sendto(b"x", (link.leaf_addr, 9))
        dropped = link.dropped()
        linked.degrade("eu")
        return rtts, took, carried, spiked, dropped

    rtts, took, carried, spiked, dropped = anyio.run(main)
    print(f"asked round trip {2 * LATENCY_S * 1e3:.0f} ms, measured median "
          f"{sorted(rtts)[len(rtts) // 2] * 1e3:.1f} ms (min {min(rtts) * 1e3:.1f}); 2 MB in {took:.2f}s")
    assert min(rtts) >= 2 * LATENCY_S
    assert carried >= 2_000_000                               # the payloads crossed this veth
    assert took >= (2_000_000 - 2 * 64 * 1024) * 8 / RATE_BPS  # tbf: no faster than the rate, less one burst
    assert min(spiked) >= 2 * (LATENCY_S + SPIKE_S)           # degraded: a latency spike each way
    assert dropped > 0                                        # and 30% loss (P(no drop of 200 datagrams) ~ 1e-31)
    assert link.dropped() == 0                                # restored


def test_a_killed_runs_links_are_removed_by_rlbus_clean_and_no_other_runs(tmp_path: Path) -> None:
    """SIGKILL of the process holding links leaves them (and its leaf server) behind; `rlbus clean` on its state
    directory removes all of it, and another run's links stay."""
    from rlbus.ops.clean import _handler as clean

    state, other = tmp_path / "state", tmp_path / "other"
    script = ("import sys, time\n"
              "from rlbus.topology.regions import RegionSet\n"
              "from rlbus.topology.links import LinkShape\n"
              f"RegionSet.start({str(state / 'nats')!r}, ['hub', 'eu'], 'hub', links={{'eu': LinkShape()}})\n"
              "print('up', flush=True)\n"
              "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    others = LinkSet.create(other, {"eu": LinkShape()})
    try:
        assert proc.stdout is not None
        assert b"up\n" in iter(proc.stdout.readline, b"")      # after its log lines; b"" would be its exit
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        interfaces, namespaces = leftovers(state / "nats")
        assert len(interfaces) == 2 and len(namespaces) == 1  # link and console veths, one namespace
        assert clean(argparse.Namespace(run="r", state_dir=state)) == 0
        assert not state.exists()
        eventually_sync(lambda: leftovers(state / "nats"), lambda left: left == ([], []),
                        what="the killed run's links removed", timeout_s=15)
        assert leftovers(other) != ([], [])                   # another run's links are not touched
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        others.stop()
        clean_leftovers(state / "nats")
    assert leftovers(other) == ([], [])


DEMO = """run = "linkdemo"
[[regions]]
name = "hub"
role = "hub"
  [[regions.actors]]
  kind = "demo_consumer"
[[regions]]
name = "eu"
  [[regions.actors]]
  kind = "demo_producer"
  [regions.link]
  bandwidth = "100mbit"
  latency = "5ms"
"""


def test_rlbus_up_runs_a_linked_region_in_its_namespace_and_the_next_run_cleans_after_a_sigkill(
        tmp_path: Path) -> None:
    """`rlbus up` puts eu's server and its actor in eu's namespace; SIGKILLed, it leaves them and the links; the
    next `rlbus up` on the same state directory stops what was left, makes the links afresh, runs and removes
    everything when it stops."""
    topology, state = tmp_path / "demo.toml", tmp_path / "state"
    topology.write_text(DEMO)
    cmd = [sys.executable, "-m", "rlbus.ops.cli", "up", str(topology), "--state-dir", str(state)]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert first.stdout is not None
        assert any(line.startswith("rlbus up: shaped links to hub: eu=100mbit/5ms") for line in first.stdout)
        _, [netns] = leftovers(state / "nats")

        def in_netns() -> set[str]:
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
            return {Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                    .rsplit("/", 1)[-1] for pid in pids if Path(f"/proc/{pid}").exists()}

        eventually_sync(in_netns, lambda names: {"nats-server"} < names, what="eu's server and actor in its netns",
                        timeout_s=30)
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert leftovers(state / "nats")[1] == [netns]
        second = subprocess.run([*cmd, "--for", "2"], capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
        assert "that a killed `rlbus up`" in second.stderr and "shaped links to hub" in second.stdout
        assert leftovers(state / "nats") == ([], [])
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        from rlbus.ops.up import stop_leftovers

        stop_leftovers(state)
        clean_leftovers(state / "nats")


async def _msg_ids(js: JetStreamContext, stream: str) -> Counter[str]:
    state = (await js.stream_info(stream)).state
    ids: Counter[str] = Counter()
    for seq in range(state.first_seq, state.last_seq + 1):
        msg = await js.get_msg(stream, seq)
        ids[(msg.headers or {}).get("Nats-Msg-Id", "")] += 1
    return ids


async def _publish_rollouts(nc: NATS, s: Subjects, ids: list[str]) -> None:
    js = nc.jetstream()
    for rid in ids:
        ack = await js.publish(s.rollouts("eu"), rid.encode(), headers={"Nats-Msg-Id": rid})
        assert ack.domain == "eu" and ack.stream == s.rollouts_stream("eu")


@pytest.mark.parametrize("mode", ["drop", "down"])
async def test_leaf_cut_on_its_link_keeps_serving_and_catches_up_exactly_once(linked: RegionSet, mode: str) -> None:
    """Cut by dropping every packet (TCP stalls, nothing is reset) or by taking the link down, eu still stores
    rollouts and serves its own tasks; healed, the hub holds each rollout exactly once."""
    s = Subjects(new_run())
    admin = await _connect(linked, "hub", "admin")
    try:
        await provision_run(admin, s, hub="hub", domains=linked.domains, settings=StreamSettings.tiny())
        await wait_routable(admin, s.tasks("eu"))
    finally:
        await admin.close()
    gen = await _connect(linked, "eu", "generator")
    local_feeder = await _connect(linked, "eu", "feeder")
    hub_feeder = await _connect(linked, "hub", "feeder")
    hub_js = hub_feeder.jetstream()
    rollouts = [f"before-{i}" for i in range(5)]
    try:
        await _publish_rollouts(gen, s, rollouts)
        await eventually(lambda: hub_js.stream_info(s.hub_rollouts_stream()),
                         lambda info: info.state.messages == 5, what="5 rollouts at the hub", timeout_s=20)
        psub = await gen.jetstream().pull_subscribe_bind(durable=s.durable("generator", "eu"),
                                                         stream=s.tasks_stream("eu"))
        linked.cut("eu", mode)
        assert linked.is_cut("eu")
        with pytest.raises((nats.js.errors.NoStreamResponseError, nats.errors.TimeoutError)):
            await hub_feeder.jetstream().publish(s.tasks("eu"), b"lost", timeout=1)
        served = []
        links_before = linked.relays["eu"].connections_total
        for i in range(8):  # eu alone: its rollouts are acked by its own stream, its tasks served from it
            await _publish_rollouts(gen, s, [f"cut-{i}"])
            rollouts.append(f"cut-{i}")
            await local_feeder.jetstream().publish(s.tasks("eu"), f"task-{i}".encode(),
                                                   headers={"Nats-Msg-Id": f"task-{i}"})
            [task] = await psub.fetch(1, timeout=5)
            await task.ack_sync()
            served.append(task.data.decode())
            await anyio.sleep(0.3)
        assert served == [f"task-{k}" for k in range(8)]
        assert (await hub_js.stream_info(s.hub_rollouts_stream())).state.messages == 5  # nothing crossed
        await anyio.to_thread.run_sync(lambda: linked.heal("eu", timeout_s=60))
        await _publish_rollouts(gen, s, ["cut-0"])  # a retried publish stays one rollout
        await eventually(lambda: hub_js.stream_info(s.hub_rollouts_stream()),
                         lambda info: info.state.messages >= len(rollouts), what="every rollout at the hub",
                         timeout_s=CATCH_UP_S)
        assert await _msg_ids(hub_js, s.hub_rollouts_stream()) == Counter(rollouts)
        if mode == "drop":  # the leaf link's TCP connection stalled and resumed: it was never reset
            assert linked.relays["eu"].connections_total == links_before
        await psub.unsubscribe()
    finally:
        for nc in (gen, local_feeder, hub_feeder):
            await nc.close()
