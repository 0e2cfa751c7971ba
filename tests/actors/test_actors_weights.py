"""Weights end to end on real nats-servers: a trainer stand-in (real AdamW steps) uploads versions, the
publisher writes deltas and snapshots into every region, and WeightSync instances in each region hold the
trainer's bf16 cast bit-exactly — through corruption, lag, joining late, a cut-off region, a swap in the
middle of a generation, a policy file whose upload ack came too late, and a SIGKILLed publisher process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats.errors
import pytest
import torch
from anyio.abc import TaskGroup
from helpers import eventually, new_run
from helpers.hf import build_family
from nats.js import JetStreamContext
from nats.js.api import PubAck
from torch import Tensor

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.common.config import PublisherConfig, PublisherLaunch
from rlbus.actors.common.fetch_plan import Part, plan_fetch
from rlbus.actors.common.weight_sync import WeightSync
from rlbus.actors.publisher import Publisher
from rlbus.kernels.delta.codec import bits_view
from rlbus.kernels.delta.state import state_digest, tensor_digests
from rlbus.messages import codec
from rlbus.messages.bus import Bus, ConnectOptions, Identity
from rlbus.messages.schemas import Event, WeightManifest
from rlbus.messages.streams import StreamSettings, provision_run, wait_routable
from rlbus.messages.subjects import LATEST_KEY
from rlbus.model.policies.builtin import config_dict
from rlbus.model.policies.hf import HFPolicy
from rlbus.model.policies.interface import Policy, policy_from_spec
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling.generate import generate
from rlbus.ops.bench.version_source import VersionSource
from rlbus.topology.backends.launch import kind_launch, kind_settings
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import load
from rlbus.topology.network.regions import CREDENTIALS_NAME, RegionSet

pytestmark = pytest.mark.anyio
FAST = ActorLimits(heartbeat_interval_s=0.3, drain_timeout_s=2.0)
CONFIG = ModelConfig.tiny()


# ---- the world ----------------------------------------------------------------------------------------
@dataclass
class _World:
    """Regions started for one fresh run, and every bus a test opened on them (closed before the servers stop)."""

    rs: RegionSet
    run: str
    buses: list[Bus] = field(default_factory=list)

    async def bus(self, region: str, role: str, actor: str | None = None) -> Bus:
        cred = self.rs.credentials(role)
        bus = await Bus.connect(self.rs.url(region), run=self.run, domain=region,
                                identity=Identity(actor_id=actor or f"{region}-{role}", kind=role, region=region),
                                options=ConnectOptions(user=cred.user, password=cred.password))
        self.buses.append(bus)
        return bus


@asynccontextmanager
async def _regions(tmp_path: Path, names: tuple[str, ...] = ("hub", "eu", "us"), *,
                   relay: bool = False) -> AsyncIterator[_World]:
    """Regions started for a fresh run (so role users may write its buckets), every stream provisioned."""
    run = new_run()
    rs = await anyio.to_thread.run_sync(lambda: RegionSet.start(tmp_path / "regions", names, "hub", run=run,
                                                                relay=relay))
    world = _World(rs, run)
    try:
        admin = await world.bus("hub", "admin")
        await provision_run(admin.nc, admin.subjects, hub="hub", domains=rs.domains, settings=StreamSettings.tiny())
        for region in names:
            await wait_routable(admin.nc, admin.subjects.tasks(region))
        yield world
    finally:
        for bus in world.buses:
            await bus.close()
        await anyio.to_thread.run_sync(rs.stop)


def _settings(rs: RegionSet, **overrides: Any) -> tuple[PublisherConfig, PublisherLaunch]:
    """The `[weights]` section and the launch values of a test publisher, `overrides` applied to either."""
    base: dict[str, Any] = {"regions": list(rs.regions), "hub": "hub", "keep_versions": 4, "full_every": 4,
                            "delta_depth": 2, "region_wait_s": 2.0, "retry_initial_s": 0.2, "retry_max_s": 1.0,
                            "ack_wait_s": 5.0, "threads": 1, **overrides}
    config = {k: v for k, v in base.items() if k in PublisherConfig.__struct_fields__}
    launch = {k: v for k, v in base.items() if k not in PublisherConfig.__struct_fields__}
    return PublisherConfig(**config), PublisherLaunch(**launch)


async def _start_publisher(tg: TaskGroup, world: _World, settings: tuple[PublisherConfig, PublisherLaunch],
                           ) -> Publisher:
    bus = await world.bus("hub", "publisher")
    config, launch = settings
    publisher = Publisher(ActorId(world.run, "hub", "publisher", "hub-publisher-0"), bus, config, FAST, launch)
    await tg.start(publisher.serve)
    return publisher


def _source(lr: float = 1e-3, seed: int = 0, *, kind: str = "builtin", root: Path | None = None) -> VersionSource:
    """A version source of the tiny built-in policy, or (kind "hf", `root` a scratch folder) of a tiny Qwen2
    directory loaded through transformers."""
    torch.manual_seed(seed)
    if kind == "hf":
        assert root is not None
        policy = HFPolicy.load(build_family(root, "qwen2-tied"), dtype=torch.float32)
        return VersionSource(policy, lr=lr, batch=2, seq_len=32, seed=seed)
    return VersionSource(Transformer(CONFIG), lr=lr, batch=2, seq_len=32, seed=seed)


def _assert_bit_exact(sync: WeightSync, want: Mapping[str, Tensor]) -> None:
    live = sync.model.named_tensors()
    assert set(live) == set(want)
    for name, tensor in want.items():
        assert live[name].dtype == torch.bfloat16
        assert torch.equal(bits_view(live[name]), bits_view(tensor)), name
    assert sync.held_digest == state_digest(tensor_digests(want))


async def _events(bus: Bus, kind: str) -> list[Event]:
    """Every stored Event of `kind` on the run's EVENTS stream."""
    js, s = bus.js, bus.subjects
    info = await js.stream_info(s.events_stream())
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            msg = await js.get_msg(s.events_stream(), seq)
        except nats.js.errors.NotFoundError:
            continue
        event = codec.decode_as(msg.data or b"", msg.headers, Event)
        if event.event == kind:
            out.append(event)
    return out


async def _announcements(bus: Bus) -> list[WeightManifest]:
    """The WEIGHTS stream in order."""
    js, s = bus.js, bus.subjects
    state = (await js.stream_info(s.weights_stream())).state
    return [codec.decode_as((m := await js.get_msg(s.weights_stream(), seq)).data or b"", m.headers, WeightManifest)
            for seq in range(state.first_seq, state.last_seq + 1) if state.messages]


async def _all_hold(syncs: list[WeightSync], version: int, publisher: Publisher, timeout_s: float = 60) -> None:
    """Every sync swaps in `version`; past the hang guard, AssertionError saying where each sync (the manifest it
    saw, what it staged and holds, what it avoids) and each region writer stands."""
    try:
        with anyio.fail_after(timeout_s):
            for sync in syncs:
                await sync.wait_for_version(version)
    except TimeoutError:
        where = [f"{sync.bus.identity.actor_id}: latest {None if sync.latest is None else (sync.latest.version, sync.latest.objects)}"
                 f" staged {sync.staged_version} held {sync.held_version} avoid {sorted(sync._avoid)} rejected "
                 f"{sync.rejected} last {sync.last_path}" for sync in syncs]
        regions = {r.name: (r.written, r.done, r.failing) for r in publisher.regions.values()}
        raise AssertionError(f"hang guard: version {version} not held by every generator within {timeout_s:g} s; "
                             f"{'; '.join(where)}; regions (written, done, failing) {regions}") from None


async def _wait_announced(bus: Bus, version: int, timeout_s: float = 30) -> WeightManifest:
    announced = await eventually(lambda: _announcements(bus), lambda found: any(m.version == version for m in found),
                                 what=f"the manifest of version {version}", timeout_s=timeout_s)
    return next(m for m in announced if m.version == version)


# ---- tests ----------------------------------------------------------------------------------------------
def test_plan_takes_the_fewest_bytes_and_avoids_rejected_objects() -> None:
    """Hand-made manifest: from v5 the single delta; from v4 the 2-version delta; a joiner the snapshot plus
    its delta; avoiding that delta leaves no path for the joiner but the full snapshot of v6 when listed."""
    parts = [Part("v6.from5", "d1", 10, 5, 6), Part("v6.from4", "d2", 14, 4, 6), Part("v6.from3", "d3", 15, 3, 6),
             Part("v4.full", "d4", 900, None, 4)]
    assert plan_fetch(parts, 6, 6) == []
    assert [p.name for p in plan_fetch(parts, 5, 6) or []] == ["v6.from5"]
    assert [p.name for p in plan_fetch(parts, 4, 6) or []] == ["v6.from4"]
    assert [p.name for p in plan_fetch(parts, None, 6) or []] == ["v4.full", "v6.from4"]
    assert [p.name for p in plan_fetch(parts, 1, 6) or []] == ["v4.full", "v6.from4"]
    assert [p.name for p in plan_fetch(parts, 5, 6, avoid={"v6.from5"}) or []] == ["v4.full", "v6.from4"]
    assert plan_fetch(parts, 4, 6, avoid={"v6.from4"}) is None
    with_full = [*parts, Part("v6.full", "d5", 950, None, 6)]
    assert [p.name for p in plan_fetch(with_full, None, 6, avoid={"v6.from4"}) or []] == ["v6.full"]


def test_launcher_hands_the_publisher_its_weights_section_every_region_and_the_hub() -> None:
    """`kind_settings` for the publisher of the three-region example decodes into its PublisherConfig (the
    `[weights]` values) and `kind_launch` gives the example's regions and its hub."""
    topology = load(example_path("three_regions"))
    settings = msgspec.convert(kind_settings(topology, "publisher"), PublisherConfig)
    launch = kind_launch(topology, "publisher")
    assert isinstance(launch, PublisherLaunch)
    assert launch.regions == [r.name for r in topology.regions] and launch.hub == topology.hub.name
    assert (settings.keep_versions, settings.full_every, settings.delta_depth) == (
        topology.weights.keep_versions, topology.weights.full_every, topology.weights.delta_depth)


@pytest.mark.parametrize("kind", ["builtin", "hf"])
async def test_generators_in_three_regions_hold_the_trainers_bf16_cast_bit_exactly(tmp_path: Path, kind: str) -> None:
    """Versions 0-5 reach two syncs per region over deltas and snapshots; each holds every tensor of the
    trainer's bf16 cast bit for bit, and every announcement lists all three regions. For a Hugging Face policy
    each generator builds it from the config and tokenizer files the publisher copied to its region."""
    async with _regions(tmp_path) as world, anyio.create_task_group() as tg:
        rs = world.rs
        trainer = await world.bus("hub", "trainer")
        # no region is cut off: every announcement waits for all three however slow the machine (2 s would announce
        # without a region that a loaded machine wrote later), unless a write there failed (see regions_ready below)
        publisher = await _start_publisher(tg, world, _settings(rs, full_every=3, region_wait_s=120.0))
        syncs = []
        for region in rs.regions:
            for i in range(2):
                sync = WeightSync(await world.bus(region, "generator", f"{region}-gen-{i}"), region)
                await tg.start(sync.run)
                syncs.append(sync)
        source = _source(kind=kind, root=tmp_path / "models")
        await source.publish(trainer)
        for _ in range(5):
            await source.step_and_publish(trainer)
        await _all_hold(syncs, 5, publisher)
        for sync in syncs:
            assert sync.held_version == 5
            _assert_bit_exact(sync, source.history[5])
            assert sync.model.spec() == source.policy.spec() and sync.model.kind == kind
            if kind == "builtin":
                assert config_dict(sync.model.config) == config_dict(CONFIG)
            else:                      # same tokenizer as the trainer's, from the region's copy of its files
                assert sync.model.tokenizer.encode("def f(x):") == source.policy.tokenizer.encode("def f(x):")
        await _wait_announced(trainer, 5)      # generators may take a version before its final stage is out
        manifests = await _announcements(trainer)
        assert [m.version for m in manifests] == [0, 1, 2, 3, 4, 5]
        # an announcement leaves out only a region a write of which failed (on a machine stalled past a request's
        # timeout, say); with no failure, as nearly always, every announcement lists all three
        failed = {r for r in rs.regions if publisher.counters.get(f"region_failures_{r}")}
        assert all(set(rs.regions) - failed <= set(m.regions_ready) <= set(rs.regions) for m in manifests)
        v5 = manifests[-1]
        assert v5.objects == ["v5.from4", "v5.from3", "v3.full"] and v5.bases == [4, 3, None]
        assert v5.yields == [5, 5, 3] and v5.base_version == 4 and v5.encoding == "delta"
        assert manifests[3].objects[-1] == "v3.full" and manifests[3].yields[-1] == 3
        assert publisher.gauges["region_ready_us"] == 1.0 and publisher.gauges["region_version_eu"] == 5.0
        store = await trainer.jetstream("eu").object_store(trainer.subjects.weights_bucket("eu"))
        kept = {info.name for info in await store.list(ignore_deletes=True)}
        assert "v0.full" not in kept and "v1.from0" not in kept and {"v3.full", "v5.from4"} <= kept
        tg.cancel_scope.cancel()


async def test_a_policy_file_whose_metadata_ack_comes_too_late_is_stored_whole_and_the_generator_builds_the_policy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The publisher's copy of a Hugging Face policy file into the region gets its metadata's ack after the
    timeout (as on a stalled process; the server stored it): the file stays whole in the region's store, so the
    generator builds the policy and holds version 0 bit for bit. With its chunks purged under the stored
    metadata, every build would wait out a whole download limit, and the upload of the same bytes again keep
    the broken copy."""
    late: list[str] = []
    publish = JetStreamContext.publish

    async def ack_after_the_timeout(js: JetStreamContext, subject: str, payload: bytes = b"",
                                    timeout: float | None = None, **kwargs: Any) -> PubAck:  # noqa: ASYNC109
        if not late and subject.startswith("$O.WEIGHTS_") and ".M." in subject and json.loads(payload).get(
                "name", "").startswith("policy-file-"):
            late.append(subject)
            timeout = 1e-6
        return await publish(js, subject, payload, timeout=timeout, **kwargs)

    monkeypatch.setattr(JetStreamContext, "publish", ack_after_the_timeout)
    async with _regions(tmp_path, ("hub",)) as world, anyio.create_task_group() as tg:
        trainer = await world.bus("hub", "trainer")
        publisher = await _start_publisher(tg, world, _settings(world.rs))
        sync = WeightSync(await world.bus("hub", "generator", "hub-gen-0"), "hub")
        await tg.start(sync.run)
        source = _source(kind="hf", root=tmp_path / "models")
        await source.publish(trainer)
        await _all_hold([sync], 0, publisher)
        assert late
        _assert_bit_exact(sync, source.history[0])
        tg.cancel_scope.cancel()


async def test_sparse_deltas_are_patched_into_the_live_model_equal_to_a_whole_copy(tmp_path: Path) -> None:
    """After a snapshot swap, two deltas staged before the next swap are replayed into the live tensors in
    order (no whole copy); the live model then equals the trainer's version and the staging bit for bit, and
    a re-hashed (verify_every) delta is copied whole."""
    async with _regions(tmp_path, ("hub",)) as world, anyio.create_task_group() as tg:
        trainer = await world.bus("hub", "trainer")
        await _start_publisher(tg, world, _settings(world.rs, full_every=8, delta_depth=1))
        sync = WeightSync(await world.bus("hub", "generator", "hub-gen-0"), "hub", verify_every=3)
        await tg.start(sync.run)
        source = _source(lr=1e-6)                                # ~1% of elements change per step
        await source.publish(trainer)
        with anyio.fail_after(30):
            await sync.wait_for_version(0)
        assert sync.last_swap_patched == 0                       # the snapshot: every tensor copied
        for _ in range(2):
            await source.step_and_publish(trainer)
        with anyio.fail_after(30):
            await sync.wait_for_staged(2)
            await sync.wait_for_version(2)
        assert sync.last_path == ["v2.from1"] and sync.verified == 1
        assert sync.last_swap_patched == len(source.history[2])  # every tensor patched, two steps each
        v0, v2 = source.history[0], source.history[2]
        assert sum(not torch.equal(bits_view(v0[k]), bits_view(v2[k])) for k in v2) > len(v2) // 2
        _assert_bit_exact(sync, source.history[2])
        assert sync._staging is not None
        assert all(torch.equal(bits_view(sync._staging[k]), bits_view(t)) for k, t in source.history[2].items())
        await source.step_and_publish(trainer)                   # the 3rd delta is re-hashed: copied whole
        with anyio.fail_after(30):
            await sync.wait_for_version(3)
        assert sync.verified == 2 and sync.last_swap_patched == 0
        _assert_bit_exact(sync, source.history[3])
        tg.cancel_scope.cancel()


async def test_corrupted_object_is_rejected_with_an_event_and_a_full_snapshot_is_used(tmp_path: Path) -> None:
    """Garbage written over the delta a generator would fetch fails its digest: an Event(weights_rejected)
    names it, and the generator rebuilds the version from the full snapshot plus the delta from it."""
    async with _regions(tmp_path, ("hub",)) as world, anyio.create_task_group() as tg:
        rs = world.rs
        trainer = await world.bus("hub", "trainer")
        await _start_publisher(tg, world, _settings(rs))
        gen_bus = await world.bus("hub", "generator", "hub-gen-0")
        sync = WeightSync(gen_bus, "hub")
        source = _source()
        await source.publish(trainer)
        await source.step_and_publish(trainer)
        async with anyio.create_task_group() as inner:
            await inner.start(sync.run)
            with anyio.fail_after(30):
                await sync.wait_for_version(1)
            inner.cancel_scope.cancel()
        await source.step_and_publish(trainer)
        manifest = await _wait_announced(trainer, 2)
        assert manifest.objects == ["v2.from1", "v2.from0", "v0.full"]
        admin = await world.bus("hub", "admin")
        store = await admin.js.object_store(admin.subjects.weights_bucket("hub"))
        await store.put("v2.from1", os.urandom(manifest.sizes[0]))
        await tg.start(sync.run)
        with anyio.fail_after(30):
            await sync.wait_for_version(2)
        assert sync.last_path == ["v0.full", "v2.from0"]
        _assert_bit_exact(sync, source.history[2])
        rejected = await _events(admin, "weights_rejected")
        assert [(e.data["object"], e.data["version"], e.actor_id) for e in rejected] == [("v2.from1", "2", "hub-gen-0")]
        assert "DigestMismatch" in rejected[0].detail
        tg.cancel_scope.cancel()


async def test_staging_that_drifted_in_memory_is_caught_by_the_tensor_rehash_and_rebuilt(tmp_path: Path) -> None:
    """One bit flipped in the staging buffers (held v1) makes the next delta apply to a wrong base: the
    re-hash rejects it with an Event before the swap, and the snapshot path rebuilds v2 bit-exactly."""
    async with _regions(tmp_path, ("hub",)) as world, anyio.create_task_group() as tg:
        trainer = await world.bus("hub", "trainer")
        await _start_publisher(tg, world, _settings(world.rs))
        sync = WeightSync(await world.bus("hub", "generator", "hub-gen-0"), "hub", verify_every=1)
        await tg.start(sync.run)
        source = _source()
        await source.publish(trainer)
        await source.step_and_publish(trainer)
        with anyio.fail_after(30):
            await sync.wait_for_version(1)
        assert sync._staging is not None
        bits_view(sync._staging["blocks.0.attn.qkv.weight"])[7] ^= 1     # a flipped bit in memory
        await source.step_and_publish(trainer)
        with anyio.fail_after(30):
            await sync.wait_for_version(2)
        assert sync.last_path == ["v0.full", "v2.from0"] and sync.rejected == 1
        _assert_bit_exact(sync, source.history[2])
        [event] = await _events(trainer, "weights_rejected")
        assert event.data["object"] == "v2.from1" and "digest" in event.detail
        tg.cancel_scope.cancel()


async def test_lagging_generator_catches_up_by_one_multi_version_delta_and_joiner_seeds_from_snapshot(
        tmp_path: Path) -> None:
    """A generator that held v1 while v2..v3 went by fetches only v3.from1; a joiner with no model builds it
    from the manifest's architecture and seeds from the v0 snapshot plus v3.from0; both are bit-exact."""
    async with _regions(tmp_path, ("hub",)) as world, anyio.create_task_group() as tg:
        rs = world.rs
        trainer = await world.bus("hub", "trainer")
        await _start_publisher(tg, world, _settings(rs, delta_depth=3))
        lagging = WeightSync(await world.bus("hub", "generator", "hub-gen-0"), "hub")
        source = _source()
        await source.publish(trainer)
        await source.step_and_publish(trainer)
        async with anyio.create_task_group() as inner:
            await inner.start(lagging.run)
            with anyio.fail_after(30):
                await lagging.wait_for_version(1)
            inner.cancel_scope.cancel()
        await source.step_and_publish(trainer)
        await source.step_and_publish(trainer)
        manifest = await _wait_announced(trainer, 3)
        assert manifest.objects == ["v3.from2", "v3.from1", "v3.from0", "v0.full"]
        joiner = WeightSync(await world.bus("hub", "generator", "hub-gen-1"), "hub")
        await tg.start(lagging.run)
        await tg.start(joiner.run)
        with anyio.fail_after(30):
            await lagging.wait_for_version(3)
            await joiner.wait_for_version(3)
        assert lagging.last_path == ["v3.from1"]
        assert joiner.last_path == ["v0.full", "v3.from0"]
        for sync in (lagging, joiner):
            _assert_bit_exact(sync, source.history[3])
        assert joiner.rejected == lagging.rejected == 0
        tg.cancel_scope.cancel()


async def test_restarted_publisher_rewrites_nothing_and_announces_the_same_manifests(tmp_path: Path) -> None:
    """A second publisher that gets versions 0-2 again (its durable gone and WEIGHTS purged, as if it had
    crashed before its acks) finds every object in place and LATEST ahead: it writes no object, leaves
    LATEST at its revision, encodes the same manifests, and its announcements are deduplicated."""
    async with _regions(tmp_path, ("hub", "eu")) as world, anyio.create_task_group() as tg:
        trainer = await world.bus("hub", "trainer")
        admin = await world.bus("hub", "admin")
        async with anyio.create_task_group() as first_tg:
            first = await _start_publisher(first_tg, world, _settings(world.rs))
            source = _source()
            await source.publish(trainer)
            await source.step_and_publish(trainer)
            await source.step_and_publish(trainer)
            await _wait_announced(trainer, 2)
            first_tg.cancel_scope.cancel()
        before = await _announcements(trainer)
        kv = await admin.jetstream("eu").key_value(admin.subjects.latest_bucket("eu"))
        revision = (await kv.get(LATEST_KEY)).revision
        await admin.js.delete_consumer(admin.subjects.state_stream(), admin.subjects.durable("publisher"))
        await admin.js.purge_stream(admin.subjects.weights_stream())
        second = await _start_publisher(tg, world, _settings(world.rs))
        with anyio.fail_after(30):                # hang guard
            await second.wait_announced(2)
        assert second.last is not None and first.last is not None
        assert (second.last.manifest.objects, second.last.manifest.digests) == (before[-1].objects,
                                                                                before[-1].digests)
        assert first.counters["objects_written"] > 0 and "objects_written" not in second.counters
        assert second.counters["announcements_deduplicated"] == 3 and await _announcements(trainer) == []
        assert (await kv.get(LATEST_KEY)).revision == revision
        tg.cancel_scope.cancel()


async def test_full_every_one_publishes_only_full_snapshots_without_decoding(tmp_path: Path) -> None:
    """With `full_every = 1` every manifest lists only that version's full snapshot (the trainer's blob as is)
    and a generator holding v0 takes v1 by fetching v1.full, bit-exactly."""
    async with _regions(tmp_path, ("hub",)) as world, anyio.create_task_group() as tg:
        trainer = await world.bus("hub", "trainer")
        await _start_publisher(tg, world, _settings(world.rs, full_every=1))
        sync = WeightSync(await world.bus("hub", "generator", "hub-gen-0"), "hub")
        await tg.start(sync.run)
        source = _source()
        await source.publish(trainer)
        with anyio.fail_after(30):
            await sync.wait_for_version(0)
        ready = await source.step_and_publish(trainer)
        with anyio.fail_after(30):
            await sync.wait_for_version(1)
        manifest = await _wait_announced(trainer, 1)
        assert manifest.objects == ["v1.full"] and manifest.bases == [None] and manifest.encoding == "full"
        assert manifest.digests == [ready.digest] and sync.last_path == ["v1.full"]
        _assert_bit_exact(sync, source.history[1])
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("kind", ["builtin", "hf"])
async def test_swap_mid_generation_changes_the_version_at_that_token_and_matches_a_kept_cache_reference(
        tmp_path: Path, kind: str) -> None:
    """Greedy generation with on_step=maybe_swap takes v1 at token K while v1 is published mid-generation:
    tokens before K carry v0, from K on v1, and the tokens equal a reference decoding the prefix under v0 and
    the rest under v1 with the same KV cache, token by token (through the policy interface, for the built-in
    and a Hugging Face policy alike)."""
    K, N = 6, 16
    async with _regions(tmp_path, ("hub",)) as world, anyio.create_task_group() as tg:
        rs = world.rs
        trainer = await world.bus("hub", "trainer")
        await _start_publisher(tg, world, _settings(rs))
        sync = WeightSync(await world.bus("hub", "generator", "hub-gen-0"), "hub")
        await tg.start(sync.run)
        source = _source(lr=3e-2, kind=kind, root=tmp_path / "models")
        await source.publish(trainer)
        with anyio.fail_after(30):
            await sync.wait_for_version(0)
        assert sync.model.kind == kind
        prompt = [[1, 5, 9, 30, 77, 12]]
        at_k = anyio.Event()
        staged = anyio.Event()
        seen: list[int] = []

        def hook(step: int) -> int | None:
            seen.append(step)
            if step == K:
                anyio.from_thread.run_sync(at_k.set)
                anyio.from_thread.run(staged.wait)      # the new version arrives while we generate
            return sync.maybe_swap(step)

        async def publish_v1() -> None:
            await at_k.wait()
            await source.step_and_publish(trainer)
            await sync.wait_for_staged(1)
            staged.set()

        tg.start_soon(publish_v1)
        with anyio.fail_after(60):
            [out] = await anyio.to_thread.run_sync(lambda: generate(
                sync.model, prompt, max_new_tokens=N, temperature=0.0, version=sync.held_version or 0,
                on_step=hook))
        assert out.versions.tolist() == [0] * K + [1] * (N - K)
        assert sync.held_version == 1
        _assert_bit_exact(sync, source.history[1])
        reference = _reference_decode(source.policy, prompt[0], source.history[0], source.history[1], K, N)
        assert out.tokens.tolist() == reference
        all_old = _reference_decode(source.policy, prompt[0], source.history[0], source.history[0], K, N)
        assert reference != all_old               # the swap mattered: v1 decodes differently from v0
        tg.cancel_scope.cancel()


def _reference_decode(trained: Policy, prompt: list[int], old: Mapping[str, Tensor], new: Mapping[str, Tensor],
                      k: int, n: int) -> list[int]:
    """Greedy token by token on a bf16 policy of `trained`'s spec and files: prefill and tokens 0..k-1 under
    `old`, then `new` loaded in place, same cache."""
    model = policy_from_spec(trained.spec(), trained.files(), dtype=torch.bfloat16)
    model.load_tensors_(old)
    cache = model.new_cache(1, len(prompt) + n)
    tokens: list[int] = []
    inputs = torch.tensor([prompt])
    with torch.no_grad():
        for step in range(n):
            if step == k:
                model.load_tensors_(new)
            logits = model.forward(inputs, cache=cache).logits[:, -1]
            token = int(torch.log_softmax(logits.float(), dim=-1).argmax(-1))
            tokens.append(token)
            inputs = torch.tensor([[token]])
    return tokens


async def test_cut_off_region_does_not_block_the_others_and_catches_up_after_heal(tmp_path: Path) -> None:
    """With `us` cut off, versions are announced with hub and eu ready and the gauge says us is behind; after
    the heal us's writer brings it to the newest version and its generator reaches it bit-exactly."""
    async with _regions(tmp_path, relay=True) as world, anyio.create_task_group() as tg:
        rs = world.rs
        trainer = await world.bus("hub", "trainer")
        publisher = await _start_publisher(tg, world, _settings(rs, region_wait_s=30.0))
        us_sync = WeightSync(await world.bus("us", "generator", "us-gen-0"), "us")
        await tg.start(us_sync.run)
        source = _source()
        await source.publish(trainer)
        with anyio.fail_after(30):
            await us_sync.wait_for_version(0)
        await anyio.to_thread.run_sync(rs.cut, "us")
        await source.step_and_publish(trainer)
        await source.step_and_publish(trainer)
        announced = await _wait_announced(trainer, 2, timeout_s=25)   # well before region_wait_s: us is failing
        assert sorted(announced.regions_ready) == ["eu", "hub"]
        assert publisher.gauges["region_ready_us"] == 0.0 and publisher.gauges["region_version_us"] == 0.0
        assert us_sync.held_version == 0
        await anyio.to_thread.run_sync(rs.heal, "us")
        with anyio.fail_after(40):
            await us_sync.wait_for_version(2)
        _assert_bit_exact(us_sync, source.history[2])
        assert publisher.gauges["region_ready_us"] == 1.0
        tg.cancel_scope.cancel()


@pytest.mark.chaos
async def test_sigkilled_publisher_process_loses_no_announcement(tmp_path: Path) -> None:
    """A publisher process SIGKILLed while versions wait for it (frozen by SIGSTOP first, so the kill always
    comes mid-stream, however fast it is) is restarted; every version is announced once
    (a repeat only ever as the same manifest), in order, and the region's LATEST ends at the newest."""
    async with _regions(tmp_path, ("hub", "eu")) as world:
        rs, run = world.rs, world.run
        trainer = await world.bus("hub", "trainer")
        settings = _settings(rs, region_wait_s=5.0)
        source = _source()
        proc = _spawn_publisher(rs, run, settings, tmp_path / "pub-1.log")
        try:
            await source.publish(trainer)
            for _ in range(3):
                await source.step_and_publish(trainer)
            await _wait_announced(trainer, 1, timeout_s=60)
            await source.step_and_publish(trainer)
            await _wait_announced(trainer, 4, timeout_s=60)
            proc.send_signal(signal.SIGSTOP)      # frozen, so versions 5 and 6 are still waiting when it dies
            for _ in range(2):
                await source.step_and_publish(trainer)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            at_kill = [m.version for m in await _announcements(trainer)]
            assert at_kill == list(range(5))
            for _ in range(2):
                await source.step_and_publish(trainer)
            proc = _spawn_publisher(rs, run, settings, tmp_path / "pub-2.log")
            await _wait_announced(trainer, 8, timeout_s=60)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
        manifests = await _announcements(trainer)
        assert [m.version for m in manifests] == list(range(9))
        counts = Counter(m.version for m in manifests)
        assert set(counts.values()) == {1}
        for manifest in manifests:
            assert manifest.version_digest == state_digest(tensor_digests(source.history[manifest.version])).hex()
        kv = await trainer.jetstream("eu").key_value(trainer.subjects.latest_bucket("eu"))
        latest = codec.decode_as((await kv.get(LATEST_KEY)).value or b"", None, WeightManifest)
        assert latest.version == 8 and latest.objects == manifests[-1].objects
        assert latest.digests == manifests[-1].digests


def _spawn_publisher(rs: RegionSet, run: str, settings: tuple[PublisherConfig, PublisherLaunch],
                     log_path: Path) -> subprocess.Popen[bytes]:
    config, launch = settings
    args = [sys.executable, "-m", "rlbus.ops.actor", "--kind", "publisher", "--run", run, "--region", "hub",
            "--id", "hub-publisher-0", "--url", rs.url("hub"), "--domain", "hub", "--role", "publisher",
            "--credentials", str(rs.base_dir / CREDENTIALS_NAME), "--settings",
            msgspec.json.encode(config).decode(), "--launch", msgspec.json.encode(launch).decode(),
            "--heartbeat-s", "0.5", "--drain-s", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log_path.open("wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
