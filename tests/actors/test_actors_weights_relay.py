"""One copy of each version per link: a leaf region behind a shaped link runs a `RegionRelay`, the hub's
publisher sends it one object per version (the one-step delta, or the full blob to join), and the relay makes
the region's other deltas and its snapshots there. Counted on the link's veth: per version it carries at most
1.1x the one-step delta, with two generators in the region; every generator of both regions holds the
trainer's bf16 cast bit-exactly, and one that joins late is served inside the region. A relay restarted after
missing versions reads the one base it lacks from the hub's CKPT and its region catches up; a region cut off by
dropped packets catches up after the heal by deltas. A link key stored before its object waits for it. Needs root, ip, tc and nft; skipped with the reason
elsewhere."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from anyio.abc import TaskStatus
from helpers import new_run
from torch import Tensor

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.common.config import PublisherConfig, PublisherLaunch
from rlbus.actors.common.weight_sync import WeightSync
from rlbus.actors.publisher import Publisher, RegionRelay
from rlbus.actors.publisher import relay as publisher_module
from rlbus.kernels.delta.codec import bits_view
from rlbus.kernels.delta.state import state_digest, tensor_digests
from rlbus.messages import codec
from rlbus.messages.bus import Bus, ConnectOptions, Identity
from rlbus.messages.kv import read_key
from rlbus.messages.objects import delete_object, fetch_object, put_object
from rlbus.messages.schemas import WeightManifest
from rlbus.messages.streams import StreamSettings, provision_run, wait_routable
from rlbus.messages.subjects import LATEST_KEY, LINK_KEY
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.ops.bench.version_source import VersionSource
from rlbus.topology.network.links import LinkShape, namespaces_unavailable
from rlbus.topology.network.regions import RegionSet

pytestmark = [pytest.mark.anyio,
              pytest.mark.skipif(namespaces_unavailable() is not None,
                                 reason=f"shaped links cannot be made here: {namespaces_unavailable()}")]

FAST = ActorLimits(heartbeat_interval_s=1.0, drain_timeout_s=2.0)
CONFIG = ModelConfig.tiny(d_model=128, d_ff=256, n_layers=4)
"""0.72M parameters: at lr 1e-3 a one-step delta is ~0.75 MB, so a version's fixed costs (its link manifest,
the acks) are small beside it, as they are for real models."""
VERSIONS = 4


@dataclass
class _Linked:
    """A hub and `eu` behind a shaped link, a fresh run provisioned, and every bus a test opened."""

    rs: RegionSet
    run: str
    buses: list[Bus] = field(default_factory=list)

    async def bus(self, region: str, role: str, actor: str) -> Bus:
        cred = self.rs.credentials(role)
        b = await Bus.connect(self.rs.url(region), run=self.run, domain=region,
                              identity=Identity(actor_id=actor, kind=role, region=region),
                              options=ConnectOptions(user=cred.user, password=cred.password))
        self.buses.append(b)
        return b

    def link_bytes(self) -> int:
        counters = self.rs.link_counters()["eu"]
        return counters["tx_bytes"] + counters["rx_bytes"]


@asynccontextmanager
async def _linked(tmp_path: Path) -> AsyncIterator[_Linked]:
    run = new_run()
    rs = await anyio.to_thread.run_sync(lambda: RegionSet.start(
        tmp_path / "regions", ("hub", "eu"), "hub", run=run,
        links={"eu": LinkShape(bandwidth_bps=200_000_000, latency_s=0.002)}))
    world = _Linked(rs, run)
    try:
        admin = await world.bus("hub", "admin", "admin")
        await provision_run(admin.nc, admin.subjects, hub="hub", domains=rs.domains, settings=StreamSettings.tiny())
        for region in rs.regions:
            await wait_routable(admin.nc, admin.subjects.tasks(region))
        yield world
    finally:
        for b in world.buses:
            await b.close()
        await anyio.to_thread.run_sync(rs.stop)


async def _serve_in(scope: anyio.CancelScope, relay: RegionRelay, *,
                    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve `relay` until `scope` is cancelled (a relay stopped on its own, the rest running on)."""
    with scope:
        await relay.serve(task_status=task_status)


def _assert_bit_exact(sync: WeightSync, want: Mapping[str, Tensor]) -> None:
    live = sync.model.named_tensors()
    assert set(live) == set(want)
    for name, tensor in want.items():
        assert torch.equal(bits_view(live[name]), bits_view(tensor)), name
    assert sync.held_digest == state_digest(tensor_digests(want))


async def test_a_relayed_region_gets_one_object_per_version_and_its_generators_hold_every_version_bit_exactly(
        tmp_path: Path) -> None:
    """v0's full blob, then one delta per version cross the link (counted on its veth); eu's relay makes the
    rest (a snapshot at v4); four generators hold v1-v4 bit-exactly, and a late joiner gets v4 in-region."""
    async with _linked(tmp_path) as world:
        run, bus, link_bytes = world.run, world.bus, world.link_bytes
        config = PublisherConfig(keep_versions=4, full_every=4, delta_depth=2)
        async with anyio.create_task_group() as tg:
            publisher = Publisher(ActorId(run, "hub", "publisher", "hub-publisher-0"), await bus("hub", "publisher", "p"),
                                  config, FAST, PublisherLaunch(regions=["hub", "eu"], hub="hub", threads=1),
                                  relayed=["eu"])
            await tg.start(publisher.serve)
            relay = RegionRelay(ActorId(run, "eu", "publisher", "eu-relay-0"), await bus("eu", "publisher", "r"),
                                config, FAST, hub="hub", threads=1)
            await tg.start(relay.serve)
            syncs = []
            for region in ("hub", "eu"):
                for i in range(2):
                    sync = WeightSync(await bus(region, "generator", f"{region}-gen-{i}"), region)
                    await tg.start(sync.run)
                    syncs.append(sync)
            trainer = await bus("hub", "trainer", "t")
            torch.manual_seed(0)
            source = VersionSource(Transformer(CONFIG), lr=1e-3, batch=2, seq_len=32, seed=0)
            await source.publish(trainer)                           # v0: eu joins with the full blob
            with anyio.fail_after(120):
                for sync in syncs:
                    await sync.wait_for_version(0)
            per_version = {}
            for v in range(1, VERSIONS + 1):
                await anyio.to_thread.run_sync(source.step)
                before = link_bytes()
                await source.publish(trainer)
                with anyio.fail_after(120):
                    for sync in syncs:
                        await sync.wait_for_version(v)
                    await publisher.wait_announced(v)
                    while relay.regions["eu"].done != v:         # the relay's final stage and pruning
                        await anyio.sleep(0.02)
                    # a round trip over the link: what eu's server had queued for the hub (the last acks) crossed
                    await trainer.jetstream("eu").account_info()
                assert publisher.last is not None
                sizes = dict(zip(publisher.last.manifest.objects, publisher.last.manifest.sizes, strict=True))
                per_version[v] = (link_bytes() - before, sizes[f"v{v}.from{v - 1}"])
                for sync in syncs:
                    assert sync.held_version == v
                    _assert_bit_exact(sync, source.history[v])
            for v, (crossed, one_step) in per_version.items():
                assert crossed <= 1.1 * one_step, (v, crossed, one_step, per_version)
            assert publisher.counters["link_objects_written"] == VERSIONS + 1     # v0's full blob, then a delta each
            eu = await read_key(trainer.jetstream("eu"), trainer.subjects.latest_bucket("eu"), LATEST_KEY)
            latest = codec.decode_as(eu.value or b"", None, WeightManifest)
            assert latest.version == VERSIONS and "v4.full" in latest.objects        # made in the region
            assert f"v{VERSIONS}.from{VERSIONS - 2}" in latest.objects
            link = await read_key(trainer.jetstream("eu"), trainer.subjects.latest_bucket("eu"), LINK_KEY)
            assert codec.decode_as(link.value or b"", None, WeightManifest).objects == [
                f"v{VERSIONS}.from{VERSIONS - 1}"]
            before = link_bytes()                                 # a generator joining now is served in-region
            joiner = WeightSync(await bus("eu", "generator", "eu-gen-late"), "eu")
            await tg.start(joiner.run)
            with anyio.fail_after(60):
                await joiner.wait_for_version(VERSIONS)
            _assert_bit_exact(joiner, source.history[VERSIONS])
            assert link_bytes() - before < 0.1 * per_version[VERSIONS][1]
            tg.cancel_scope.cancel()


async def test_a_restarted_relay_reads_the_one_base_it_lacks_from_the_hub_and_its_region_catches_up(
        tmp_path: Path) -> None:
    """The relay stops after v1; v2 and v3 are linked meanwhile (the hub and its generators go on). A new relay
    sees only the newest link (v3 from v2), reads v2 from CKPT once, and eu's generators reach v3 bit-exactly
    from the snapshot it encodes in the region."""
    async with _linked(tmp_path) as world, anyio.create_task_group() as tg:
        config = PublisherConfig(keep_versions=4, full_every=8, delta_depth=1)
        publisher = Publisher(ActorId(world.run, "hub", "publisher", "hub-publisher-0"),
                              await world.bus("hub", "publisher", "p"), config, FAST,
                              PublisherLaunch(regions=["hub", "eu"], hub="hub", threads=1), relayed=["eu"])
        await tg.start(publisher.serve)
        first = anyio.CancelScope()
        await tg.start(_serve_in, first, RegionRelay(ActorId(world.run, "eu", "publisher", "eu-relay-0"),
                                                     await world.bus("eu", "publisher", "r0"), config, FAST,
                                                     hub="hub", threads=1))
        syncs = {region: WeightSync(await world.bus(region, "generator", f"{region}-gen"), region)
                 for region in ("hub", "eu")}
        for sync in syncs.values():
            await tg.start(sync.run)
        trainer = await world.bus("hub", "trainer", "t")
        torch.manual_seed(0)
        source = VersionSource(Transformer(ModelConfig.tiny()), lr=1e-3, batch=2, seq_len=32, seed=0)
        await source.publish(trainer)
        await source.step_and_publish(trainer)
        with anyio.fail_after(60):
            for sync in syncs.values():
                await sync.wait_for_version(1)
        first.cancel()
        for _ in range(2):
            await source.step_and_publish(trainer)
        with anyio.fail_after(60):
            await syncs["hub"].wait_for_version(3)
            await publisher.wait_announced(3)
        assert syncs["eu"].held_version == 1
        relay = RegionRelay(ActorId(world.run, "eu", "publisher", "eu-relay-1"),
                            await world.bus("eu", "publisher", "r1"), config, FAST, hub="hub", threads=1)
        await tg.start(relay.serve)
        with anyio.fail_after(60):
            await syncs["eu"].wait_for_version(3)
        _assert_bit_exact(syncs["eu"], source.history[3])
        assert relay.counters.get("bases_from_hub") == 1 and relay.counters.get("versions_relayed") == 1
        assert publisher.counters["link_objects_written"] == 4                    # v0 full, then one delta each
        tg.cancel_scope.cancel()


async def test_a_relayed_region_cut_off_by_dropped_packets_catches_up_after_the_heal_by_deltas(
        tmp_path: Path) -> None:
    """eu's link drops every packet while v2-v4 are published (the hub and its generator go on, announced
    without eu); after the heal the write stalled by the cut completes (v2, a delta), the hub sends v4 as a
    delta from what eu then holds, never a full blob, and eu's generators hold v4 bit-exactly."""
    async with _linked(tmp_path) as world, anyio.create_task_group() as tg:
        config = PublisherConfig(keep_versions=4, full_every=8, delta_depth=3)
        publisher = Publisher(ActorId(world.run, "hub", "publisher", "hub-publisher-0"),
                              await world.bus("hub", "publisher", "p"), config, FAST,
                              PublisherLaunch(regions=["hub", "eu"], hub="hub", threads=1, region_wait_s=1.0,
                                              retry_initial_s=0.2, retry_max_s=1.0),
                              relayed=["eu"])
        await tg.start(publisher.serve)
        relay = RegionRelay(ActorId(world.run, "eu", "publisher", "eu-relay-0"),
                            await world.bus("eu", "publisher", "r"), config, FAST, hub="hub", threads=1)
        await tg.start(relay.serve)
        syncs = {region: WeightSync(await world.bus(region, "generator", f"{region}-gen"), region)
                 for region in ("hub", "eu")}
        for sync in syncs.values():
            await tg.start(sync.run)
        trainer = await world.bus("hub", "trainer", "t")
        torch.manual_seed(0)
        source = VersionSource(Transformer(ModelConfig.tiny()), lr=1e-3, batch=2, seq_len=32, seed=0)
        await source.publish(trainer)
        await source.step_and_publish(trainer)
        with anyio.fail_after(60):
            for sync in syncs.values():
                await sync.wait_for_version(1)
            while publisher.regions["eu"].done != 1:
                await anyio.sleep(0.02)
        await anyio.to_thread.run_sync(lambda: world.rs.cut("eu", "drop"))
        for _ in range(3):
            await source.step_and_publish(trainer)
        with anyio.fail_after(90):
            await syncs["hub"].wait_for_version(4)
            await publisher.wait_announced(4)
        assert syncs["eu"].held_version == 1 and publisher.regions["eu"].linked in (1, 2)   # v2's may stall
        written = publisher.counters["link_objects_written"]
        await anyio.to_thread.run_sync(lambda: world.rs.heal("eu"))
        with anyio.fail_after(120):
            await syncs["eu"].wait_for_version(4)
        _assert_bit_exact(syncs["eu"], source.history[4])
        assert publisher.counters["link_objects_written"] <= written + 2
        link = await read_key(trainer.jetstream("eu"), trainer.subjects.latest_bucket("eu"), LINK_KEY)
        assert codec.decode_as(link.value or b"", None, WeightManifest).objects in (["v4.from1"], ["v4.from2"])
        tg.cancel_scope.cancel()


async def test_a_link_key_stored_before_its_object_waits_for_it_and_one_never_stored_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub sends the `link` key right behind the object in one round trip, so the key's stream may store it
    first: the relay waits for the object's metadata, then relays it; a key naming an object that never comes is
    refused after `LINK_OBJECT_WAIT_S` and the relay goes on serving."""
    monkeypatch.setattr(publisher_module, "LINK_OBJECT_WAIT_S", 120.0)   # the object is put however slow the machine
    async with _linked(tmp_path) as world:
        config = PublisherConfig(keep_versions=4, full_every=4, delta_depth=2)
        writer = await world.bus("eu", "publisher", "w")
        weights, latest = writer.subjects.weights_bucket("eu"), writer.subjects.latest_bucket("eu")
        async with anyio.create_task_group() as tg:
            hub_scope = anyio.CancelScope()
            publisher = Publisher(ActorId(world.run, "hub", "publisher", "hub-publisher-0"),
                                  await world.bus("hub", "publisher", "p"), config, FAST,
                                  PublisherLaunch(regions=["hub", "eu"], hub="hub", threads=1), relayed=["eu"])
            await tg.start(_serve_in, hub_scope, publisher)
            torch.manual_seed(0)
            source = VersionSource(Transformer(ModelConfig.tiny()), lr=1e-3, batch=2, seq_len=32, seed=0)
            await source.publish(await world.bus("hub", "trainer", "t"))
            with anyio.fail_after(60):
                while publisher.regions["eu"].linked != 0:
                    await anyio.sleep(0.02)
            hub_scope.cancel()                                    # from here the test is the hub
            entry = await read_key(writer.js, latest, LINK_KEY)
            link = codec.decode_as(entry.value or b"", None, WeightManifest)
            assert link.objects == ["v0.full"]
            blob = await fetch_object(writer.js, weights, "v0.full")
            assert await delete_object(writer.js, weights, "v0.full")     # the key is there, its object not yet
            relay = RegionRelay(ActorId(world.run, "eu", "publisher", "eu-relay-0"),
                                await world.bus("eu", "publisher", "r"), config, FAST, hub="hub", threads=1)
            await tg.start(relay.serve)
            with anyio.fail_after(30):
                while "received" not in relay.trace.get(0, {}):      # it read the key, waits for the object
                    await anyio.sleep(0.02)
            assert relay.relayed_version is None
            await put_object(writer.js, weights, "v0.full", blob)
            with anyio.fail_after(30):
                while relay.relayed_version != 0:
                    await anyio.sleep(0.02)
            monkeypatch.setattr(publisher_module, "LINK_OBJECT_WAIT_S", 1.0)  # read by each wait as it starts
            never = msgspec.structs.replace(link, version=1, objects=["v1.full"])
            kv = await writer.js.key_value(latest)
            await kv.put(LINK_KEY, codec.encode(never, compress_above=1 << 40)[0])
            with anyio.fail_after(30):
                while not relay.counters.get("links_refused"):
                    await anyio.sleep(0.05)
            assert relay.relayed_version == 0 and relay.counters.get("versions_relayed") == 1
            held = await read_key(writer.js, latest, LATEST_KEY)
            assert codec.decode_as(held.value or b"", None, WeightManifest).version == 0
            tg.cancel_scope.cancel()
