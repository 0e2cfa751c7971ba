"""The region writers: one task per region brings that region's WEIGHTS store and LATEST bucket to the newest
encoded version.

- Owns: `RegionState` (what the publisher knows of one region), `RegionWriter` (objects first, skipping those
  already there; then LATEST `latest` compare-and-set forward; then pruning; a relayed region gets one link
  object per version instead), `advance_latest`, and the `link` key's writes.
- Guarantee: LATEST only moves forward, and only once every object its manifest lists is stored; a failed
  region is retried with backoff and catches up to the newest version.
- Does not: encode (actors/publisher/encoder.py) or announce (actors/publisher/actor.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import Header
from nats.js.object_store import ObjectStore

from rlbus.actors.common.config import PublisherLaunch
from rlbus.actors.publisher.encoder import EncodedVersion, object_name, object_version
from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.errors import BadMessage
from rlbus.messages.kv import KeyEntry, advance, put_at, read_key
from rlbus.messages.objects import Behind, store_digest
from rlbus.messages.retry import retry_policy
from rlbus.messages.schemas import WeightManifest
from rlbus.messages.subjects import LATEST_KEY, LINK_KEY, Subjects
from rlbus.messages.wakeup import Wakeup
from rlbus.model.policies.interface import PolicyError, spec_files

log = structlog.get_logger()

BUS_ERRORS: Final = (nats.errors.Error, TimeoutError, OSError)
"""Transient failures of a bus call: retried."""
_UNLIMITED: Final = 1 << 40


@dataclass
class RegionState:
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
    """The region runs a `RegionRelay`: only one object per version crosses to it (`RegionWriter._write_link`)."""
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


class RegionWriter:
    """Writes one region's newest target whenever a newer one arrives (`run`, one task per region).

    `policy_file(name)` gives a policy file's bytes (from the hub's CKPT), `count(name)` counts an event on the
    owning actor, and `progress()` is awaited after every write and failure (gauges, waiters)."""

    def __init__(self, bus: Bus, region: RegionState, launch: PublisherLaunch, *, keep_versions: int,
                 policy_file: Callable[[str], Awaitable[bytes]], count: Callable[[str], None],
                 progress: Callable[[], Awaitable[None]]) -> None:
        self.bus = bus
        self.region = region
        self.launch = launch
        self.keep_versions = keep_versions
        self.subjects: Subjects = bus.subjects
        self._policy_file = policy_file
        self._count = count
        self._progress = progress

    async def run(self) -> None:
        """Bring the region to its newest target, whenever a newer one arrives (`_write_newest` retries)."""
        region = self.region
        while True:
            target = region.target
            if target is None or (region.written is not None
                                  and region.written >= (target.manifest.version, target.final)):
                await region.wake.wait()
                continue
            t0 = time.perf_counter()
            target = await self._write_newest()
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
            await self._progress()

    async def _write_newest(self) -> EncodedVersion:
        """Write the region's newest target, retried with backoff (a newer target cuts a wait short and is
        the one tried next); a failure marks the region failing, so announcements stop waiting for it.
        -> the target written."""
        region = self.region
        retry = retry_policy(
            "region_write_failed", on=(*BUS_ERRORS, BadMessage), initial_s=self.launch.retry_initial_s,
            max_s=self.launch.retry_max_s, sleep=region.wake.wait, region=region.name,
            version=lambda: region.target.manifest.version if region.target is not None else None,
            forever="a cut-off region catches up once its link heals; the other regions go on without it")
        async for attempt in retry:
            with attempt:
                target = region.target
                assert target is not None                 # set before the writer was woken
                try:
                    await self._write(target)
                except (*BUS_ERRORS, BadMessage):
                    region.failing, region.store = True, None
                    self._count(f"region_failures_{region.name}")
                    await self._progress()
                    raise
                return target
        raise AssertionError("unreachable: the policy returns or raises")

    async def _write(self, target: EncodedVersion) -> None:
        """Objects first (skipping those already there with the same digest), then LATEST, then pruning; a
        relayed region gets its one link object instead (`_write_link`)."""
        region = self.region
        if region.relayed:
            await self._write_link(target)
            return
        js = self.bus.jetstream(region.name)
        bucket = self.subjects.weights_bucket(region.name)
        if region.store is None:
            region.store = await js.object_store(bucket)
        store = region.store
        if region.present is None:
            region.present = await list_digests(store)
        m = target.manifest
        for name in policy_file_names(m):          # what a joiner needs to build the policy, first
            if name in region.present:
                continue
            data = await self._policy_file(name)
            region.present[name] = await self.bus.put_object(bucket, name, data, domain=region.name,
                                                             keep_same=True)
            self._count("policy_files_written")
        for name, want in zip(m.objects, m.digests, strict=True):
            if region.present.get(name) == want:
                continue
            region.present.pop(name, None)
            await self.bus.put_object(bucket, name, target.blobs[name], domain=region.name)
            region.present[name] = want
            self._count("objects_written")
        await advance_latest(js, self.subjects.latest_bucket(region.name),
                             msgspec.structs.replace(m, regions_ready=[region.name]),
                             domain=None if region.name == self.bus.domain else region.name)
        if target.final:
            await self._prune(store, m)

    async def _write_link(self, target: EncodedVersion) -> None:
        """Into a relayed region, one object per version: the delta from the version its relay holds (the one
        before, or after a gap a kept older one, from the final stage), else the version's full blob; then
        its LATEST `link` key names it. The region's `RegionRelay` makes the rest there. A stage that cannot
        carry it (the early one, when the region is further behind) writes nothing."""
        region = self.region
        m = target.manifest
        v = m.version
        js = self.bus.jetstream(region.name)
        domain = None if region.name == self.bus.domain else region.name
        if region.linked is None:
            region.linked = await held_version(js, self.subjects.latest_bucket(region.name))
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
        self._count("link_objects_written")
        if behind is None or behind.seq is None:       # not sent with it, or refused (another writer came between)
            region.link_revision = await put_link(js, bucket, link, domain, region.link_revision)
        region.linked = v
        while len(region.link_names) > 64:
            region.link_names.discard(min(region.link_names, key=_link_order))

    async def _prune(self, store: ObjectStore, manifest: WeightManifest) -> None:
        """Delete objects of versions older than the last `keep_versions` (never one the manifest lists)."""
        region = self.region
        assert region.present is not None
        floor = manifest.version - self.keep_versions + 1
        listed = set(manifest.objects)
        for name in list(region.present):
            version = object_version(name)
            if version is None or name in listed or version >= floor:
                continue
            try:
                await store.delete(name)
            except nats.js.errors.NotFoundError:
                pass
            del region.present[name]
            self._count("objects_deleted")


def _link_order(name: str) -> int:
    version = object_version(name)
    return -1 if version is None else version


def policy_file_names(manifest: WeightManifest) -> list[str]:
    """Object names of the files the manifest's policy spec lists (none for the built-in policy).

    :raises BadMessage: a spec whose `files` is not a map of names to sha256 digests.
    """
    try:
        files = spec_files(manifest.model_config)
    except PolicyError as err:
        raise BadMessage(f"manifest v{manifest.version}: {err}") from None
    return [Subjects.policy_file_object(sha) for sha in sorted(set(files.values()))]


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


async def put_link(js: JetStreamContext, bucket: str, link: WeightManifest, domain: str | None,
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


async def held_version(js: JetStreamContext, bucket: str) -> int | None:
    """The version a region's LATEST `latest` key holds (None: none, or unreadable)."""
    entry = await read_key(js, bucket, LATEST_KEY)
    if not entry.value:
        return None
    try:
        return codec.decode_as(entry.value, None, WeightManifest).version
    except BadMessage:
        return None


async def list_digests(store: ObjectStore) -> dict[str, str]:
    """Object name -> `sha256:<hex>` of every object in a store (from the store's own metadata)."""
    try:
        infos = await store.list(ignore_deletes=True)
    except nats.js.errors.NotFoundError:
        return {}
    return {info.name: store_digest(info.digest) for info in infos
            if info.name and info.digest and not info.deleted}
