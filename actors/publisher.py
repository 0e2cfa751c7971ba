"""The weight publisher: every trainer version, encoded for the generators, written into every region.

Owns: `Publisher` (actor kind "publisher") and `RegionRelay` (actor kind "weights_relay"). The publisher
consumes VersionReady from the hub's STATE stream (its own durable, filter `state.version`, one message in
flight), downloads the raw bf16 version from CKPT (digest-checked, every tensor re-hashed), keeps the last
`keep_versions` versions decoded, and writes per version the deltas from the previous `delta_depth` versions
and from the latest full snapshot, plus a full snapshot (the trainer's own blob) for version 0 and every
`full_every` versions. One writer task per region copies the objects into that region's WEIGHTS store, then
CAS-advances its LATEST `latest` to the manifest and prunes versions older than `keep_versions`; a region that
fails is retried with backoff and catches up to the newest version. The manifest is announced on WEIGHTS
(msg_id `weights-<N>`) once every reachable region is ready, with `regions_ready`, and only then is
VersionReady acked. A version no region took is never announced; one whose CKPT object
is missing or corrupt is dead-lettered with the reason.
A region started in `relayed` (its launch's `relayed`, which `rlbus up` fills with the leaves behind a
`[regions.link]`) gets one object per version instead (`_write_link`: the delta from the version its relay holds,
or the version's full blob, named in its LATEST `link` key), and `RegionRelay`, a publisher for that one region
running on its own server (`rlbus up` starts one in each such leaf), makes the rest there from what it holds.
Does not: encode tensors (kernels/), apply weights (actors/common/weight_sync.py) or train (actors/trainer/actor.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import anyio
import msgspec
import nats.errors
import nats.js.errors
import numpy as np
import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, Header
from nats.js.object_store import ObjectStore
from torch import Tensor

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.config import PublisherConfig, PublisherLaunch, RelayLaunch, decode_config
from rlbus.actors.common.weight_sync import LATEST_KEY, decode_full
from rlbus.kernels.delta.codec import DeltaCorrupt, merge_positions, snapshot_due
from rlbus.kernels.delta.state import StateIndex, apply_state_, encode_state, read_index
from rlbus.messages import checks, codec
from rlbus.messages.bus import Bus, Delivery, digest
from rlbus.messages.errors import BadMessage, DigestMismatch, TopologyError
from rlbus.messages.history import last_message
from rlbus.messages.kv import KeyEntry, advance, put_at, read_key
from rlbus.messages.objects import Behind, fetch_object, store_digest
from rlbus.messages.retry import GIVE_UP_S, retry_policy
from rlbus.messages.schemas import VersionReady, WeightManifest
from rlbus.messages.streams import ensure_consumer
from rlbus.messages.subjects import Subjects
from rlbus.messages.wakeup import Wakeup
from rlbus.model.policies.interface import PolicyError, spec_files

log = structlog.get_logger()

_BUS_ERRORS: Final = (nats.errors.Error, TimeoutError, OSError)
_OBJECT_NAME: Final = re.compile(r"v(\d+)\.(full|from\d+)")
_UNLIMITED: Final = 1 << 40
LINK_KEY: Final = "link"
"""The key of a relayed region's LATEST bucket naming the one object of each version that crossed its link
(a WeightManifest listing it), written by the hub's publisher and read by the region's `RegionRelay`."""
LINK_OBJECT_WAIT_S: Final = 10.0
"""How long a region's relay waits for the object its `link` key names to be stored beside it."""
_Row = tuple[str, str, int, int | None, int]
"""One object of a manifest: name, digest, size, base version, version it yields."""


def object_name(version: int, base: int | None) -> str:
    """Name of a version's object in a region's WEIGHTS store: `v<N>.full` or `v<N>.from<B>`."""
    return f"v{version}.full" if base is None else f"v{version}.from{base}"


@dataclass(frozen=True, slots=True)
class EncodedVersion:
    """One stage of a version ready to write: its manifest (regions_ready empty) and the bytes of every
    object it lists. The early stage lists only the delta from the previous version; the final one all."""

    manifest: WeightManifest
    blobs: dict[str, bytes]
    timings: dict[str, float]
    """Seconds: receive (download + decode), encode_first (the delta from v-1), encode (all)."""
    final: bool = True
    staged_at: float = 0.0
    full: tuple[str, bytes] | None = None
    """(digest, blob) of the version's own full blob (the trainer's): what a relayed region that holds no base
    kept here is sent."""
    """`time.perf_counter()` when it was handed to the region writers."""


@dataclass
class _Region:
    """What the publisher knows about one region's weight bucket."""

    name: str
    target: EncodedVersion | None = None
    done: int | None = None
    """Version whose final manifest this region's LATEST holds (as far as this publisher wrote it)."""
    written: tuple[int, bool] | None = None
    """(version, final) of the last stage written here."""
    written_at: dict[int, float] = field(default_factory=dict)
    """`time.perf_counter()` when each version's first stage reached LATEST (benchmarks)."""
    present: dict[str, str] | None = None
    """Object name -> sha256 digest in the region's store; None until listed once."""
    store: ObjectStore | None = None
    """The region's WEIGHTS store handle (looked up once: each lookup is a request to the region; dropped
    when a write fails)."""
    relayed: bool = False
    """The region runs a `RegionRelay`: only one object per version crosses to it (`Publisher._write_link`)."""
    linked: int | None = None
    """Relayed region: the version of the last link object written there (its relay's version, as far as
    this publisher knows; read from the region's LATEST once)."""
    link_revision: int | None = None
    """Revision of the `link` key this publisher last wrote (the next write compare-and-sets on it, no read)."""
    link_names: set[str] = field(default_factory=set)
    """Link objects this publisher has started to put there (a name not in it is new in the store)."""
    failing: bool = False
    wake: Wakeup = field(default_factory=Wakeup)
    write_s: float = 0.0


class Publisher(Actor):
    """Turns every VersionReady into weight objects in every region and one WeightManifest announcement."""

    kind = "publisher"

    def __init__(self, ident: ActorId, bus: Bus, config: PublisherConfig, limits: ActorLimits | None = None,
                 launch: PublisherLaunch | None = None, *, relayed: Collection[str] = ()) -> None:
        super().__init__(ident, bus, limits)
        launch = launch or PublisherLaunch(regions=[ident.region], hub=ident.region)
        if launch.hub not in launch.regions:
            raise TopologyError(f"publisher: hub {launch.hub!r} is not one of the regions {launch.regions}")
        relayed = {*relayed, *launch.relayed}
        if bad := sorted(set(relayed) - (set(launch.regions) - {launch.hub})):
            raise TopologyError(f"publisher: relayed regions {bad} must be leaf regions of {launch.regions}")
        self.config = config
        self.launch = launch
        self.subjects: Subjects = bus.subjects
        self.regions = {name: _Region(name, relayed=name in relayed) for name in launch.regions}
        self._ckpt_domain = launch.hub
        """Where CKPT (the trainer's version blobs) lives: the hub."""
        self._kept: dict[int, dict[str, Tensor]] = {}
        self._changed: dict[int, dict[str, np.ndarray]] = {}
        """Per kept version v, the positions of each tensor that differ from v-1 (from the v-1 delta's full
        comparison): deltas from older bases compare only the union along the chain."""
        self._digest_of: dict[int, bytes] = {}
        self._snapshot: tuple[int, str, bytes] | None = None
        """(version, sha256 digest, blob) of the latest full snapshot."""
        self._unavailable: set[int] = set()
        """Versions not in CKPT (or corrupt there): never tried again as bases."""
        self._announced: int | None = None
        self._files: dict[str, bytes] = {}
        """Policy files (a Hugging Face config and tokenizer) by object name, as downloaded from CKPT once."""
        self._files_lock = anyio.Lock()
        """Held while a policy file is looked up or downloaded: region writers asking at once wait for the first."""
        self._progress = anyio.Condition()
        self.last: EncodedVersion | None = None
        self.trace: dict[int, dict[str, float]] = {}
        """Per recent version, `time.perf_counter()` marks: received, downloaded, decoded, staged (first stage
        handed to the writers), final, announced. For logs and `rlbus bench sync`."""
        """The newest stage handed to the region writers."""

    # ---- lifecycle ------------------------------------------------------------------------------
    async def setup(self) -> None:
        hub = self._js(self.launch.hub)
        await ensure_consumer(hub, self.subjects.state_stream(), ConsumerConfig(
            durable_name=self.subjects.durable("publisher"), filter_subject=self.subjects.version_ready(),
            ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.launch.ack_wait_s, max_deliver=-1, max_ack_pending=1))
        self._announced = await self._last_announced()
        self.policy_version = self._announced
        log.info("publisher_ready", announced=self._announced, regions=self.launch.regions)

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            for region in self.regions.values():
                tg.start_soon(self._region_writer, region)
            deliveries = self.bus.consume(self.subjects.state_stream(), self.subjects.durable("publisher"),
                                          VersionReady, batch=1, domain=self.launch.hub)
            async for delivery in deliveries:
                with self.busy():
                    async with anyio.create_task_group() as hold:
                        hold.start_soon(self._keep_in_progress, delivery)
                        await self._handle(delivery)
                        hold.cancel_scope.cancel()

    def _js(self, region: str) -> JetStreamContext:
        return self.bus.jetstream(region)

    async def _last_announced(self) -> int | None:
        """The version of the last good announcement on WEIGHTS (a bad last one is read back past)."""
        last = await last_message(self._js(self.launch.hub), self.subjects.weights_stream(), self.subjects.weights(),
                                  WeightManifest)
        return None if last is None else last.version

    async def _keep_in_progress(self, delivery: Delivery[VersionReady]) -> None:
        while True:
            await anyio.sleep(self.launch.ack_wait_s / 3)
            try:
                await delivery.in_progress()
            except _BUS_ERRORS as err:
                log.warning("publisher_in_progress_failed", error=repr(err))

    # ---- one version ----------------------------------------------------------------------------
    async def _handle(self, delivery: Delivery[VersionReady]) -> None:
        ready = delivery.message
        if self._announced is not None and ready.version <= self._announced:
            log.info("version_already_announced", version=ready.version, announced=self._announced)
            self.count("duplicates")
            await delivery.ack()
            return
        t0 = time.perf_counter()
        self._mark(ready.version, "received")
        received = await self._receive(ready)
        if received is None:
            self.count("versions_refused")
            reason = f"version {ready.version}: CKPT object {ready.object} is missing or corrupt; not announced"
            await self.emit("weights_rejected", detail=reason, version=str(ready.version))
            await self.bus.dead_letter(delivery.raw, reason=reason, source=self.subjects.state_stream())
            return
        encoded = await self._encode(ready, *received, timings={"receive_s": time.perf_counter() - t0})
        ready_regions = await self._await_regions(ready.version)
        manifest = msgspec.structs.replace(encoded.manifest, regions_ready=ready_regions)
        await self._announce(manifest)
        self._mark(ready.version, "announced")
        await delivery.ack()
        self._announced = self.policy_version = ready.version
        self.count("versions")
        self._set_gauges()
        await self._notify()
        log.info("weights_published", version=ready.version, regions=ready_regions, objects=manifest.objects,
                 bytes=sum(manifest.sizes), seconds=round(time.perf_counter() - t0, 3),
                 **{k: round(v, 3) for k, v in encoded.timings.items()})
        await self.emit("weights_published", detail=f"version {ready.version}", version=str(ready.version),
                        regions=",".join(ready_regions))

    async def _announce(self, manifest: WeightManifest) -> None:
        """Publish the manifest on WEIGHTS (msg id `weights-<N>`), retried with backoff for up to `GIVE_UP_S`;
        then the error fails the publisher, and its restart handles the unacked VersionReady again (objects
        already in a region are skipped, the announcement is deduplicated by its msg id)."""
        retry = retry_policy("weights_announce_retry", on=_BUS_ERRORS, initial_s=self.launch.retry_initial_s,
                             max_s=self.launch.retry_max_s, give_up_after_s=GIVE_UP_S, version=manifest.version)
        async for attempt in retry:
            with attempt:
                ack = await self.bus.publish(self.subjects.weights(), manifest, msg_id=f"weights-{manifest.version}")
                if ack.duplicate:             # announced before (a restart inside the duplicate window)
                    self.count("announcements_deduplicated")

    async def _await_regions(self, version: int) -> list[str]:
        """Regions whose LATEST holds `version`'s final manifest: all of them, or once the rest failed an
        attempt (or were slow for `region_wait_s`) those that are ready; never none."""
        deadline = time.monotonic() + self.launch.region_wait_s
        while True:
            ready = [r.name for r in self.regions.values() if r.done is not None and r.done >= version]
            waiting = [r for r in self.regions.values() if r.name not in ready and not r.failing]
            if ready and (not waiting or time.monotonic() >= deadline):
                return ready
            timeout = max(0.0, deadline - time.monotonic()) if ready else None
            with anyio.move_on_after(timeout):
                async with self._progress:
                    await self._progress.wait()

    async def wait_announced(self, version: int) -> None:
        """Return once `version` (or a newer one) is announced on WEIGHTS."""
        while self._announced is None or self._announced < version:
            async with self._progress:
                await self._progress.wait()

    @property
    def _deltas(self) -> bool:
        """Whether versions are delta-encoded at all (`full_every` 1 publishes only full snapshots)."""
        return self.config.full_every > 1

    async def _receive(self, ready: VersionReady
                       ) -> tuple[bytes, StateIndex, dict[str, Tensor] | None] | None:
        """The version's CKPT blob, its index and (when deltas are written) its tensors; None if unusable."""
        blob = await self._download(ready.object, ready.digest)
        if blob is None:
            return None
        self._mark(ready.version, "downloaded")
        try:
            index, _ = read_index(blob)
            if index.base_digest is not None:
                raise DeltaCorrupt("the CKPT object is a delta, not the version's full snapshot")
            if ready.version_digest and index.version_digest.hex() != ready.version_digest:
                raise DeltaCorrupt(f"version digest {index.version_digest.hex()} != announced "
                                   f"{ready.version_digest}")
            state = None
            if self._deltas:
                state, index = await anyio.to_thread.run_sync(partial(
                    decode_full, blob, verify=False, threads=self.launch.threads))
        except (DeltaCorrupt, ValueError) as err:
            log.error("version_blob_unusable", version=ready.version, error=repr(err))
            return None
        self._mark(ready.version, "decoded")
        return blob, index, state

    async def _encode(self, ready: VersionReady, blob: bytes, index: StateIndex,
                      state: dict[str, Tensor] | None, *, timings: dict[str, float]) -> EncodedVersion:
        """Encode the version's objects and hand them to the region writers in two stages: the delta from
        the previous version alone as soon as it is encoded (what nearly every generator needs), then
        everything (older bases, the delta from the snapshot, the snapshot). -> the final stage."""
        v = ready.version
        if state is not None:
            await self._reload_bases(v)
            self._kept[v], self._digest_of[v] = state, index.version_digest
        snap = self._snapshot[0] if self._snapshot is not None else None
        if snapshot_due(v, full_every=self.config.full_every) or snap is None or (
                self._deltas and snap not in self._kept):
            snap = v
            self._snapshot = (v, ready.digest, blob)
        recent = {b for b in self._kept if v - self.config.delta_depth <= b < v}
        bases = [] if state is None else sorted(recent | ({snap} if snap < v else set()), reverse=True)
        blobs: dict[str, bytes] = {}
        rows: list[_Row] = []
        t0 = time.perf_counter()
        for base in bases:
            changed: dict[str, np.ndarray] = {}
            _, delta = await anyio.to_thread.run_sync(partial(
                encode_state, state, self._kept[base], digests=index.digests,
                base_digest=self._digest_of[base], threads=self.launch.threads,
                candidates=self._chain_candidates(base, v), changed=changed if base == v - 1 else None))
            if base == v - 1:
                self._changed[v] = changed
            name = object_name(v, base)
            blobs[name] = delta
            rows.append((name, digest(delta), len(delta), base, v))
            if base == v - 1:
                timings["encode_first_s"] = time.perf_counter() - t0
                self._set_targets(self._stage(ready, index, rows, blobs, final=False, timings=timings, full=blob))
        assert self._snapshot is not None           # set above
        snap_version, snap_digest, snap_blob = self._snapshot
        blobs[object_name(snap_version, None)] = snap_blob
        rows.append((object_name(snap_version, None), snap_digest, len(snap_blob), None, snap_version))
        timings["encode_s"] = time.perf_counter() - t0
        self._evict(v)
        final = self._stage(ready, index, rows, blobs, final=True, timings=timings, full=blob)
        self._set_targets(final)
        return final

    def _chain_candidates(self, base: int, version: int) -> dict[str, np.ndarray] | None:
        """Positions outside which `version` equals `base`, per tensor: the union of what every step between
        them changed; None (compare everything) when a step is not known or for the delta from v-1."""
        chain = range(base + 1, version + 1)
        if version - base < 2 or any(v not in self._changed for v in chain):
            return None
        return {name: merge_positions([self._changed[v][name] for v in chain])
                for name in self._changed[version]}

    def _stage(self, ready: VersionReady, index: StateIndex, rows: list[_Row], blobs: dict[str, bytes], *,
               final: bool, timings: dict[str, float], full: bytes = b"") -> EncodedVersion:
        names, digests, sizes, bases, yields = (list(col) for col in zip(*rows, strict=True))
        v = ready.version
        manifest = WeightManifest(
            version=v, base_version=v - 1 if v - 1 in bases else None,
            encoding="delta" if v - 1 in bases else "full", objects=names, digests=digests, sizes=sizes,
            version_digest=index.version_digest.hex(), raw_bytes=ready.raw_bytes,
            model_config=ready.model_config, bases=bases, yields=yields)
        return EncodedVersion(manifest, dict(blobs), timings, final=final, staged_at=time.perf_counter(),
                              full=(ready.digest, full) if full else None)

    def _mark(self, version: int, what: str) -> None:
        self.trace.setdefault(version, {})[what] = time.perf_counter()
        while len(self.trace) > 64:
            del self.trace[min(self.trace)]

    def _set_targets(self, encoded: EncodedVersion) -> None:
        self._mark(encoded.manifest.version, "final" if encoded.final else "staged")
        if encoded.final:
            self.trace[encoded.manifest.version].setdefault("staged", encoded.staged_at)
        self.last = encoded
        for region in self.regions.values():
            region.target = encoded
            region.wake.set()

    async def _reload_bases(self, version: int) -> None:
        """After a restart (or a gap): bring back the last few versions and the scheduled snapshot from
        CKPT, so a restarted publisher writes the same objects as before. Missing ones are remembered."""
        scheduled = version - version % self.config.full_every
        wanted = set(range(max(0, version - self.config.delta_depth), version))
        if self._snapshot is None and scheduled < version:
            wanted.add(scheduled)
        for base in sorted(wanted - self._kept.keys() - self._unavailable):
            blob = await self._download(Subjects.version_object(base), None, attempts=1)
            try:
                if blob is None:
                    raise DeltaCorrupt("missing from CKPT")
                state, index = await anyio.to_thread.run_sync(
                    partial(decode_full, blob, threads=self.launch.threads))
            except (DeltaCorrupt, ValueError) as err:
                log.info("base_unavailable", version=base, error=repr(err))
                self._unavailable.add(base)
                continue
            self._kept[base], self._digest_of[base] = state, index.version_digest
            if self._snapshot is None and base == scheduled:
                self._snapshot = (base, digest(blob), blob)
            log.info("base_reloaded", version=base)

    def _evict(self, version: int) -> None:
        floor = version - max(self.config.keep_versions, self.config.delta_depth + 1) + 1
        snap = self._snapshot[0] if self._snapshot is not None else None
        for old in [b for b in self._kept if b < floor and b != snap]:
            del self._kept[old]
            del self._digest_of[old]
        for old in [b for b in self._changed if b <= min(self._kept, default=version)]:
            del self._changed[old]          # no chain from a kept base passes through it any more

    async def _download(self, name: str, expected: str | None, *,
                        attempts: int | None = None) -> bytes | None:
        """A CKPT object, retried with backoff: a missing or corrupt object `attempts` times (default
        `download_attempts`) before None; transient bus errors for up to `GIVE_UP_S`, then the error fails the
        publisher (its restart handles the unacked VersionReady again)."""
        tries = attempts or self.launch.download_attempts
        bad = 0
        unusable = (DigestMismatch, nats.js.errors.NotFoundError)
        retry = retry_policy("version_download_retry", on=(*unusable, *_BUS_ERRORS),
                             initial_s=self.launch.retry_initial_s, max_s=self.launch.retry_max_s,
                             give_up_after_s=GIVE_UP_S, until=lambda: bad >= tries, object=name)
        try:
            async for attempt in retry:
                with attempt:
                    try:
                        return await fetch_object(self._js(self._ckpt_domain), self.subjects.checkpoint_bucket(),
                                                  name, expected_digest=expected)
                    except unusable as err:
                        bad += 1
                        log.warning("version_object_unusable", object=name, attempt=bad, error=repr(err))
                        raise
        except unusable:
            return None
        raise AssertionError("unreachable: the policy returns or raises")

    # ---- regions --------------------------------------------------------------------------------
    async def _region_writer(self, region: _Region) -> None:
        """Bring one region to its newest target, whenever a newer one arrives (`_write_newest` retries)."""
        while True:
            target = region.target
            if target is None or (region.written is not None
                                  and region.written >= (target.manifest.version, target.final)):
                await region.wake.wait()
                continue
            t0 = time.perf_counter()
            target = await self._write_newest(region)
            version = target.manifest.version
            if region.failing:
                log.info("region_caught_up", region=region.name, version=version)
            region.failing, region.written = False, (version, target.final)
            region.write_s = time.perf_counter() - t0
            region.written_at.setdefault(version, time.perf_counter())
            if len(region.written_at) > 64:
                del region.written_at[min(region.written_at)]
            if target.final:
                region.done = version
            self._set_gauges()
            await self._notify()

    async def _write_newest(self, region: _Region) -> EncodedVersion:
        """Write the region's newest target, retried with backoff (a newer target cuts a wait short and is
        the one tried next); a failure marks the region failing, so announcements stop waiting for it.
        -> the target written."""
        retry = retry_policy(
            "region_write_failed", on=(*_BUS_ERRORS, BadMessage), initial_s=self.launch.retry_initial_s,
            max_s=self.launch.retry_max_s, sleep=region.wake.wait, region=region.name,
            version=lambda: region.target.manifest.version if region.target is not None else None,
            forever="a cut-off region catches up once its link heals; the other regions go on without it")
        async for attempt in retry:
            with attempt:
                target = region.target
                assert target is not None                 # set before the writer was woken
                try:
                    await self._write_region(region, target)
                except (*_BUS_ERRORS, BadMessage):
                    region.failing, region.store = True, None
                    self.count(f"region_failures_{region.name}")
                    await self._notify()
                    raise
                return target
        raise AssertionError("unreachable: the policy returns or raises")

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    async def _write_region(self, region: _Region, target: EncodedVersion) -> None:
        """Objects first (skipping those already there with the same digest), then LATEST, then pruning; a
        relayed region gets its one link object instead (`_write_link`)."""
        if region.relayed:
            await self._write_link(region, target)
            return
        js = self._js(region.name)
        bucket = self.subjects.weights_bucket(region.name)
        if region.store is None:
            region.store = await js.object_store(bucket)
        store = region.store
        if region.present is None:
            region.present = await _list_digests(store)
        m = target.manifest
        for name in self._policy_file_names(m):          # what a joiner needs to build the policy, first
            if name in region.present:
                continue
            data = await self._policy_file(name)
            region.present[name] = await self.bus.put_object(bucket, name, data, domain=region.name,
                                                             keep_same=True)
            self.count("policy_files_written")
        for name, want in zip(m.objects, m.digests, strict=True):
            if region.present.get(name) == want:
                continue
            region.present.pop(name, None)
            await self.bus.put_object(bucket, name, target.blobs[name], domain=region.name)
            region.present[name] = want
            self.count("objects_written")
        await advance_latest(js, self.subjects.latest_bucket(region.name),
                             msgspec.structs.replace(m, regions_ready=[region.name]),
                             domain=None if region.name == self.bus.domain else region.name)
        if target.final:
            await self._prune(region, store, m)

    async def _write_link(self, region: _Region, target: EncodedVersion) -> None:
        """Into a relayed region, one object per version: the delta from the version its relay holds (the one
        before, or after a gap a kept older one, from the final stage), else the version's full blob; then
        its LATEST `link` key names it. The region's `RegionRelay` makes the rest there. A stage that cannot
        carry it (the early one, when the region is further behind) writes nothing."""
        m = target.manifest
        v = m.version
        js = self._js(region.name)
        domain = None if region.name == self.bus.domain else region.name
        if region.linked is None:
            region.linked = await _held_version(js, self.subjects.latest_bucket(region.name))
        if region.linked is not None and region.linked >= v:
            return
        name = object_name(v, region.linked) if region.linked is not None else None
        if name is not None and name in target.blobs:
            base, blob = region.linked, target.blobs[name]
            digest_ = m.digests[m.objects.index(name)]
        elif not target.final:
            return                                       # the final stage may hold a delta from it
        else:
            if target.full is None:
                raise BadMessage(f"v{v}: no full blob to send region {region.name} (a relay's own stage)")
            name, base, (digest_, blob) = object_name(v, None), None, target.full
        # After this publisher's first link there, names it has not tried are new in the store, and the key is
        # compare-and-set on the revision it wrote: the object (`put_object(new=True)`) and the key go in one
        # round trip, the key right behind the object's metadata. The relay waits for that metadata.
        new = region.link_revision is not None and name not in region.link_names
        region.link_names.add(name)
        link = msgspec.structs.replace(
            m, base_version=base, encoding="full" if base is None else "delta", objects=[name], digests=[digest_],
            sizes=[len(blob)], bases=[base], yields=[v], regions_ready=[region.name])
        bucket = self.subjects.latest_bucket(region.name)
        data, _ = codec.encode(link, compress_above=_UNLIMITED)
        behind = Behind(Subjects.kv_key(bucket, LINK_KEY, domain=domain), data,
                        {Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(region.link_revision)}) if new else None
        try:
            await self.bus.put_object(self.subjects.weights_bucket(region.name), name, blob, domain=domain, new=new,
                                      behind=behind)
        finally:
            if behind is not None and behind.seq is not None:
                region.link_revision = behind.seq      # the key moved, even if the object then failed
        self.count("link_objects_written")
        if behind is None or behind.seq is None:       # not sent with it, or refused (another writer came between)
            region.link_revision = await _put_link(js, bucket, link, domain, region.link_revision)
        region.linked = v
        while len(region.link_names) > 64:
            region.link_names.discard(min(region.link_names, key=_link_order))

    @staticmethod
    def _policy_file_names(manifest: WeightManifest) -> list[str]:
        """Object names of the files the manifest's policy spec lists (none for the built-in policy).

        :raises BadMessage: a spec whose `files` is not a map of names to sha256 digests.
        """
        try:
            files = spec_files(manifest.model_config)
        except PolicyError as err:
            raise BadMessage(f"manifest v{manifest.version}: {err}") from None
        return [Subjects.policy_file_object(sha) for sha in sorted(set(files.values()))]

    async def _policy_file(self, name: str) -> bytes:
        """A policy file from the hub's CKPT (the trainer put it there before its first VersionReady), kept;
        downloaded once however many region writers ask for it at the same time.

        :raises BadMessage: it is not there (retried by the region writer).
        """
        async with self._files_lock:
            if name not in self._files:
                data = await self._download(name, None)
                if data is None:
                    raise BadMessage(f"policy file {name} is not in CKPT; the trainer uploads it before version 0")
                self._files[name] = data
        return self._files[name]

    async def _prune(self, region: _Region, store: ObjectStore, manifest: WeightManifest) -> None:
        """Delete objects of versions older than the last `keep_versions` (never one the manifest lists)."""
        assert region.present is not None
        floor = manifest.version - self.config.keep_versions + 1
        listed = set(manifest.objects)
        for name in list(region.present):
            match = _OBJECT_NAME.fullmatch(name)
            if match is None or name in listed or int(match.group(1)) >= floor:
                continue
            try:
                await store.delete(name)
            except nats.js.errors.NotFoundError:
                pass
            del region.present[name]
            self.count("objects_deleted")

    def _set_gauges(self) -> None:
        newest = max((r.target.manifest.version for r in self.regions.values() if r.target is not None),
                     default=-1)
        for r in self.regions.values():
            self.gauges[f"region_version_{r.name}"] = float(r.done if r.done is not None else -1)
            self.gauges[f"region_ready_{r.name}"] = float(r.done is not None and r.done >= newest)
        self.gauges["announced_version"] = float(self._announced if self._announced is not None else -1)


class RegionRelay(Publisher):
    """Inside a leaf region: that region's weight objects, made from the one object per version that crossed
    its link.

    The hub's publisher (started with the region in `relayed`) writes into the region's WEIGHTS store, per
    version, the delta from the version this relay holds (or the version's full blob) and names it in the
    region's LATEST `link` key. The relay watches that key on its own server, points LATEST `latest` at a delta
    at once (the early stage: what generators holding its base need; they check it themselves), fetches the
    object there (digest-checked), applies it to the base it keeps (every tensor re-hashed, the version digest compared),
    and from then on is a publisher for this one region: the same objects (the deltas from the last
    `delta_depth` versions it kept and from its snapshot, a snapshot every `full_every` versions, encoded
    here), the same LATEST `latest` advance and pruning; it announces nothing (the hub does). A base it does
    not hold (after a restart) is read once from the hub's CKPT, across the link.
    """

    kind = "weights_relay"

    def __init__(self, ident: ActorId, bus: Bus, config: PublisherConfig, limits: ActorLimits | None = None,
                 *, hub: str, threads: int = 2) -> None:
        region = ident.region
        super().__init__(ident, bus, config, limits, PublisherLaunch(regions=[region], hub=region, threads=threads))
        self.region = region
        self._ckpt_domain = hub
        self.relayed_version: int | None = None
        """The newest version this relay has handed to its region writer."""

    async def setup(self) -> None:
        log.info("region_relay_ready", region=self.region, hub=self._ckpt_domain)

    async def run(self) -> None:
        bucket = self.subjects.latest_bucket(self.region)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._region_writer, self.regions[self.region])
            kv = await self.bus.js.key_value(bucket)
            watcher = await kv.watch(LINK_KEY)
            try:
                async for entry in watcher:
                    if entry is None or entry.operation in ("DEL", "PURGE") or not entry.value:
                        continue
                    try:
                        link = codec.decode_as(entry.value, None, WeightManifest)
                        checks.check(link)
                        if len(link.objects) != 1 or len(link.digests) != 1:
                            raise BadMessage(f"link manifest v{link.version} lists {len(link.objects)} objects, "
                                             f"not one")
                    except BadMessage as err:
                        self.count("links_unreadable")
                        log.warning("region_relay_link_unreadable", region=self.region, error=str(err))
                        continue
                    if self.relayed_version is not None and link.version <= self.relayed_version:
                        continue
                    with self.busy():
                        await self._relay(link)
            finally:
                with anyio.move_on_after(2.0, shield=True):
                    await watcher.stop()

    async def _reload_bases(self, version: int) -> None:
        """Nothing: a relay encodes from the bases it holds (a restart holds only what it was sent since)."""

    async def _base(self, version: int) -> dict[str, Tensor] | None:
        """The kept state of `version`, or read from the hub's CKPT (a restart); None when not there either."""
        if version not in self._kept:
            blob = await self._download(Subjects.version_object(version), None, attempts=1)
            if blob is None:
                return None
            state, index = await anyio.to_thread.run_sync(partial(decode_full, blob, threads=self.launch.threads))
            self._kept[version], self._digest_of[version] = state, index.version_digest
            self.count("bases_from_hub")
        return self._kept[version]

    async def _link_object_stored(self, name: str, want: str) -> bool:
        """Whether the linked object's metadata, with the linked digest, is in the region's WEIGHTS store within
        `LINK_OBJECT_WAIT_S`: the hub sends the key right behind the object, and the key's stream may store it
        first (the object's stream stores the metadata behind every chunk)."""
        store = await self.bus.js.object_store(self.subjects.weights_bucket(self.region))
        with anyio.move_on_after(LINK_OBJECT_WAIT_S):
            while True:
                try:
                    info = await store.get_info(name)
                    if store_digest(info.digest or "") == want:
                        return True
                except nats.js.errors.NotFoundError:
                    pass
                await anyio.sleep(0.01)
        return False

    async def _relay(self, link: WeightManifest) -> None:
        """One version: its link object applied, then everything encoded and handed to the region writer. A
        bad object or a base that cannot be had is logged and skipped (the hub's next link carries on)."""
        v, name = link.version, link.objects[0]
        base = link.bases[0] if link.bases else link.base_version
        region = self.regions[self.region]
        t0 = time.perf_counter()
        self._mark(v, "received")
        if not await self._link_object_stored(name, link.digests[0]):
            self.count("links_refused")
            log.error("region_relay_link_refused", region=self.region, version=v, object=name,
                      error=f"not stored here {LINK_OBJECT_WAIT_S:g}s after its link key")
            return
        if base is not None:            # what a generator holding the base needs, at once (as the hub's early stage)
            await advance_latest(self.bus.js, self.subjects.latest_bucket(self.region),
                                 msgspec.structs.replace(link, regions_ready=[self.region]))
        try:
            blob = await fetch_object(self.bus.js, self.subjects.weights_bucket(self.region), name,
                                      expected_digest=link.digests[0])
            self._mark(v, "downloaded")
            if base is None:
                state, index = await anyio.to_thread.run_sync(partial(decode_full, blob, threads=self.launch.threads))
                full: bytes | None = blob
            else:
                kept = await self._base(base)
                if kept is None:
                    raise DeltaCorrupt(f"base v{base} is neither kept nor in CKPT")
                state = {k: t.clone() for k, t in kept.items()}
                index = await anyio.to_thread.run_sync(partial(
                    apply_state_, state, blob, expect_base=self._digest_of[base], verify=True,
                    threads=self.launch.threads))
                full = None
            if link.version_digest and index.version_digest.hex() != link.version_digest:
                raise DeltaCorrupt(f"version digest {index.version_digest.hex()} != linked {link.version_digest}")
        except (DeltaCorrupt, DigestMismatch, ValueError, nats.js.errors.NotFoundError) as err:
            self.count("links_refused")
            log.error("region_relay_link_refused", region=self.region, version=v, object=name, error=repr(err))
            return
        self._mark(v, "decoded")
        snap = self._snapshot[0] if self._snapshot is not None else None
        if full is None and (snapshot_due(v, full_every=self.config.full_every) or snap is None
                             or snap not in self._kept):
            _, full = await anyio.to_thread.run_sync(partial(
                encode_state, state, None, digests=index.digests, threads=self.launch.threads))
        ready = VersionReady(version=v, step=0, object=name, digest=digest(full) if full else "",
                             version_digest=link.version_digest, raw_bytes=link.raw_bytes,
                             model_config=link.model_config)
        if region.present is None:
            region.present = await _list_digests(await self.bus.js.object_store(self.subjects.weights_bucket(self.region)))
        region.present[name] = link.digests[0]             # already here: the writer skips it
        await self._encode(ready, full or b"", index, state, timings={"receive_s": time.perf_counter() - t0})
        self.relayed_version = v
        self.count("versions_relayed")


async def advance_latest(js: JetStreamContext, bucket: str, manifest: WeightManifest, *,
                         domain: str | None = None, key: str = LATEST_KEY) -> bool:
    """Compare-and-set a LATEST bucket's `latest` key to `manifest` unless it already holds a newer version,
    or this version with every object `manifest` lists (a version's final stage lists more than its early
    one). `js` reaches the bucket's domain, `domain` is given when that is not the client's own (the write
    then goes through `$JS.<domain>.API`). -> True when written; concurrent writers (a restarted
    publisher) only ever move it forward.
    """
    data, _ = codec.encode(manifest, compress_above=_UNLIMITED)

    def decide(entry: KeyEntry) -> bytes | None:
        try:
            current = codec.decode_as(entry.value, None, WeightManifest) if entry.value else None
        except BadMessage:                        # garbage: overwrite it
            current = None
        if current is not None and (current.version > manifest.version or (
                current.version == manifest.version and set(current.objects) >= set(manifest.objects))):
            return None
        return data

    return await advance(js, bucket, key, decide, domain=domain) is not None


async def _put_link(js: JetStreamContext, bucket: str, link: WeightManifest, domain: str | None,
                    revision: int | None) -> int | None:
    """Write a relayed region's `link` key: on `revision` when this publisher wrote the last one (one request),
    else (or when another writer came between) as `advance_latest` does. -> the revision written (None:
    a newer link was there)."""
    data, _ = codec.encode(link, compress_above=_UNLIMITED)
    if revision is not None:
        try:
            return await put_at(js, bucket, LINK_KEY, data, revision=revision, domain=domain)
        except nats.js.errors.KeyWrongLastSequenceError:
            pass

    def decide(entry: KeyEntry) -> bytes | None:
        try:
            current = codec.decode_as(entry.value, None, WeightManifest) if entry.value else None
        except BadMessage:
            current = None
        return None if current is not None and current.version >= link.version else data

    return await advance(js, bucket, LINK_KEY, decide, domain=domain)


def _link_order(name: str) -> int:
    match = _OBJECT_NAME.fullmatch(name)
    return int(match.group(1)) if match else -1


async def _held_version(js: JetStreamContext, bucket: str) -> int | None:
    """The version a region's LATEST `latest` key holds (None: none, or unreadable)."""
    entry = await read_key(js, bucket, LATEST_KEY)
    if not entry.value:
        return None
    try:
        return codec.decode_as(entry.value, None, WeightManifest).version
    except BadMessage:
        return None


async def _list_digests(store: ObjectStore) -> dict[str, str]:
    """Object name -> `sha256:<hex>` of every object in a store (from the store's own metadata)."""
    try:
        infos = await store.list(ignore_deletes=True)
    except nats.js.errors.NotFoundError:
        return {}
    return {info.name: store_digest(info.digest) for info in infos
            if info.name and info.digest and not info.deleted}


def build_publisher(ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits,
                    launch: PublisherLaunch | None = None) -> Publisher:
    """The publisher of a `[weights]` section (plain values) and the run's regions and hub.

    :raises TopologyError: a setting is unknown or out of bounds (the text names it).
    """
    return Publisher(ident, bus, decode_config("weights", settings, PublisherConfig), limits, launch)


def build_region_relay(ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits,
                       launch: RelayLaunch | None = None) -> RegionRelay:
    """The weights relay of `ident.region` (a leaf) for a `[weights]` section (plain values) and its hub.

    :raises TopologyError: a setting is unknown or out of bounds, or no launch names the hub.
    """
    if launch is None:
        raise TopologyError("weights_relay: no launch values; it needs the hub region (RelayLaunch hub)")
    if launch.hub == ident.region:
        raise TopologyError(f"weights_relay: region {ident.region!r} is the hub; a relay runs in a leaf region")
    return RegionRelay(ident, bus, decode_config("weights", settings, PublisherConfig), limits, hub=launch.hub,
                       threads=launch.threads)
