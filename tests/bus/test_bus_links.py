"""Regions over shaped links: a leaf's nats-server in its own network namespace, joined to the hub by a veth.

What the link does to traffic (its bandwidth and latency are floors a transfer cannot beat; its bytes are
counted), that a leaf cut off by dropping every packet, or by taking the link down, keeps serving and catches up
exactly once, and that every namespace and interface is gone after a stop and after a SIGKILL (the next run or
`rlbus clean` removes them, never another run's). Needs root, ip, tc and nft; skipped with the reason elsewhere.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
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
from helpers.runs import FinishedRun
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from rlbus.messages import codec
from rlbus.messages.schemas import Heartbeat, VersionReady, WeightManifest
from rlbus.messages.streams import StreamSettings, provision_run, wait_routable
from rlbus.messages.subjects import LINK_KEY, Subjects
from rlbus.topology.examples import example_path
from rlbus.topology.network.links import (
    LinkSet,
    LinkShape,
    clean_leftovers,
    leftovers,
    namespaces_unavailable,
)
from rlbus.topology.network.regions import RegionSet

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
              "from rlbus.topology.network.regions import RegionSet\n"
              "from rlbus.topology.network.links import LinkShape\n"
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
LINKED_RL = """run = "linkrl"
[[regions]]
name = "hub"
role = "hub"
  [[regions.actors]]
  kind = "trainer"
  [[regions.actors]]
  kind = "publisher"
  [[regions.actors]]
  kind = "checkpointer"
[[regions]]
name = "eu"
  [[regions.actors]]
  kind = "feeder"
  [[regions.actors]]
  kind = "generator"
  count = 2
  [[regions.actors]]
  kind = "sandbox"
  [regions.link]
  bandwidth = "100mbit"
  latency = "5ms"
"""
"""The trainer side in the hub; the feeder, two generators and a sandbox in `eu` behind a shaped link (its tasks
do not cross the link: towards eu it carries the weights and little else); the tiny run's settings with a learning
rate that changes most weights each step and `LENGTH_REWARD` (a one-step delta of ~100 KB, not a few hundred
bytes). `rlbus up` starts a weights relay in eu."""
LENGTH_REWARD = """
[trainer.length_penalty]
budget = 1
coef = 1.0
power = 1.0
"""
"""A reward for short completions: the tiny policy passes no test, and without it every advantage is zero, so no
step would change a weight."""
RELAY_VERSIONS = 3
"""The run is measured until both of eu's generators hold this version."""
LINK_SLACK = 1.1
"""Bytes towards eu per version, at most this many times the one object of that version that crossed the link."""
BURST_BYTES = 2_000
"""Bytes in one 2 ms sample interval above which the link is carrying a transfer (8 Mbit/s; its keepalives,
acks and heartbeats move a few KB per second)."""


def _linked_rl_topology(path: Path) -> Path:
    tiny = example_path("tiny").read_text()
    settings = tiny[tiny.index("[feeder]"):].replace("[trainer]\n", "[trainer]\nlr = 0.001\n", 1)
    path.write_text(LINKED_RL + "\n" + settings + LENGTH_REWARD)
    return path


class _TxSampler:
    """The bytes a veth has sent (`tx_bytes`: towards the leaf, from its root end) every `SAMPLE_S`, on a thread."""

    SAMPLE_S = 0.002
    """Well under the link's round trip: a version's transfer starts a round trip after the last one's key is
    stored (the hub reads that key's ack first), so the two are told apart."""

    def __init__(self, interface: str) -> None:
        self.path = Path("/sys/class/net") / interface / "statistics" / "tx_bytes"
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="link-tx-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), int(self.path.read_text())))
            self._stop.wait(self.SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.samples.append((time.monotonic(), int(self.path.read_text())))

    def transfer(self, t0: float, t1: float) -> int:
        """Bytes sent from the first sample at or after `t0` (the last transfer's end: its key was stored) or,
        when later, shortly before the first burst after it (a sample interval that moved more than
        `BURST_BYTES`: a transfer, not the link's keepalives and acks; two intervals earlier, so its first
        packets count), to the first sample after `t1`."""
        rows = self.samples
        first = next((i for i, (at, _) in enumerate(rows) if at >= t0), len(rows) - 1)
        burst = next((i for i in range(first + 1, len(rows))
                      if rows[i][0] <= t1 and rows[i][1] - rows[i - 1][1] > BURST_BYTES), None)
        start = max(burst - 3, first) if burst is not None else first
        return next(n for at, n in rows if at > t1) - rows[start][1]


async def _watch_run(state: Path, run: str, ready: dict[int, float], links: list[tuple[float, WeightManifest]],
                     beats: dict[str, Heartbeat]) -> None:
    """When each VersionReady is published at the hub; through eu's console (its server's unshaped address, not
    the link) every update of eu's LATEST `link` key after the first read (time seen, manifest) and the last
    heartbeat of each actor in eu; until both of eu's generators have applied `RELAY_VERSIONS` to their live
    model (their logs' `weights_applied`) and the relay's heartbeat counts every version it relayed."""
    doc = json.loads((state / "run.json").read_text())
    cred = json.loads(Path(doc["credentials"]["eu"]).read_text())["admin"]
    s = Subjects(run)
    hub = await nats.connect(doc["urls"]["hub"], user=cred["user"], password=cred["password"], error_cb=_quiet)
    eu = await nats.connect(doc["urls"]["eu"], user=cred["user"], password=cred["password"], error_cb=_quiet)
    ready_sub = await hub.subscribe(s.version_ready())
    beat_sub = await eu.subscribe(s.all_health())
    await hub.flush()

    async def take_ready() -> None:
        async for msg in ready_sub.messages:
            ready.setdefault(codec.decode_as(msg.data, msg.headers, VersionReady).version, time.monotonic())

    async def take_beats() -> None:
        async for msg in beat_sub.messages:
            hb = codec.decode_as(msg.data, msg.headers, Heartbeat)
            if hb.region == "eu":
                beats[hb.actor_id] = hb

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(take_ready)
            tg.start_soon(take_beats)
            watcher = await eu.jetstream(domain="eu").key_value(s.latest_bucket("eu"))
            updates = await watcher.watch(LINK_KEY)
            try:
                first = True
                with anyio.fail_after(240):                              # hang guard
                    async for entry in updates:
                        if entry is not None and entry.value and not first:
                            links.append((time.monotonic(), codec.decode_as(entry.value, None, WeightManifest)))
                        first = False
                        if links and links[-1][1].version >= RELAY_VERSIONS:
                            break
                    relay = "eu-weights_relay-0"
                    while (min(map(max, _applied(state).values()), default=-1) < RELAY_VERSIONS
                           or relay not in beats or beats[relay].counters.get("versions_relayed", 0) < len(links)):
                        await anyio.sleep(0.1)
            finally:
                await updates.stop()
            tg.cancel_scope.cancel()
    finally:
        await ready_sub.unsubscribe()
        await beat_sub.unsubscribe()
        await eu.close()
        await hub.close()


def _applied(state: Path) -> dict[str, list[int]]:
    """eu generator -> the versions it brought its live model to, in order (its log's `weights_applied`)."""
    out: dict[str, list[int]] = {}
    for i in range(2):
        path = state / "logs" / f"eu-generator-{i}.log"
        lines = path.read_text().splitlines() if path.exists() else []
        out[path.stem] = [int(e["version"]) for e in map(_json_or_none, lines)
                          if e is not None and e.get("event") == "weights_applied"]
    return out


def _json_or_none(line: str) -> dict[str, object] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def test_rlbus_up_relays_each_version_once_to_a_linked_region_in_its_namespace_and_cleans_after_a_sigkill(
        tmp_path: Path, finished_run: FinishedRun) -> None:
    """`rlbus up` puts eu's server and its actors, a weights relay among them, in eu's namespace: from the
    transfer that follows a version's VersionReady to its `link` key in eu, the link towards eu carries at
    most 1.1x the one object of that version that crossed it (the delta from the version eu held; counted on
    the veth); both of eu's generators come to hold the newest version from what the relay made there.
    SIGKILLed, the run leaves its processes and the links; the next `rlbus up` on the same state directory
    (the bus demo) stops what was left, makes the links afresh, runs and removes everything when it stops.
    """
    topology, state = _linked_rl_topology(tmp_path / "linked.toml"), tmp_path / "state"
    shutil.copytree(finished_run.state / "pretrained", state / "pretrained")     # no pretraining here
    demo = tmp_path / "demo.toml"
    demo.write_text(DEMO)
    cmd = [sys.executable, "-m", "rlbus.ops.cli", "up", str(topology), "--state-dir", str(state)]
    ready: dict[int, float] = {}
    links: list[tuple[float, WeightManifest]] = []
    beats: dict[str, Heartbeat] = {}
    with (tmp_path / "out").open("w") as out_file:
        first = subprocess.Popen(cmd, stdout=out_file, stderr=subprocess.STDOUT, text=True)
    try:
        eventually_sync(lambda: (tmp_path / "out").read_text(), lambda out: "rlbus up: bus ready" in out,
                        what="the run's servers and streams", timeout_s=60)     # provisioned before actors start
        [veth] = [i for i in leftovers(state / "nats")[0] if i.endswith("h")]     # the link's root end
        _, [netns] = leftovers(state / "nats")
        sampler = _TxSampler(veth)
        try:
            anyio.run(_watch_run, state, "linkrl", ready, links, beats)
        finally:
            sampler.stop()
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
        in_netns = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    for pid in pids if Path(f"/proc/{pid}").exists()]
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert leftovers(state / "nats")[1] == [netns]
        second = subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "up", str(demo), "--state-dir", str(state),
                                 "--for", "2"], capture_output=True, text=True, timeout=120)
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
    assert "rlbus up: shaped links to hub: eu=100mbit/5ms" in (tmp_path / "out").read_text()
    assert any("nats-server" in c for c in in_netns) and sum("--kind generator" in c for c in in_netns) == 2
    assert any("--kind weights_relay" in c for c in in_netns), in_netns
    rows = []
    for (t_before, before), (t_link, link) in itertools.pairwise(links):
        if link.version in ready:                 # its VersionReady published while this test listened
            carried = sampler.transfer(max(ready[link.version], t_before), t_link)
            rows.append((link.version, before.version, link.objects[0], link.sizes[0], carried))
    print("version, eu's version before it, its link object, the object's bytes, bytes towards eu:", rows)
    assert [v for v, *_ in rows] == list(range(rows[0][0], RELAY_VERSIONS + 1)) and len(rows) >= 2, rows
    for version, before, name, size, carried in rows:
        assert name == f"v{version}.from{before}", rows          # the delta from what eu holds, nothing else
        assert 0.9 * size <= carried <= LINK_SLACK * size, rows  # it crossed then (the leaf link compresses, s2)
    applied = _applied(state)
    print("versions applied by eu's generators:", applied)
    assert all(versions and max(versions) >= RELAY_VERSIONS for versions in applied.values()), applied
    relay = beats["eu-weights_relay-0"]                      # a row of `rlbus health`, like every actor's
    assert relay.actor_kind == "weights_relay" and relay.state in ("ready", "busy"), relay
    assert relay.counters.get("versions_relayed", 0) >= len(links) and not relay.counters.get("links_refused"), relay


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
