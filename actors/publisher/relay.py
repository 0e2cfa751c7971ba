"""The weights relay: inside a leaf region, that region's weight objects, made from the one object per version
that crossed its link.

- Owns: `RegionRelay` (actor kind "weights_relay"): watches its region's LATEST `link` key, points `latest` at
  a delta at once, applies the linked object to the base it keeps, then encodes and writes the region's usual
  objects as the publisher does for one region (it announces nothing: the hub does).
- Guarantee: a bad link object or a base it cannot have is refused and logged; nothing unverified is written.
- Does not: cross the link (the hub's publisher writes the link object) or read CKPT except for a missing base.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import partial
from typing import Any, Final

import anyio
import msgspec
import nats.js.errors
import structlog
from torch import Tensor

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.common.config import PublisherConfig, PublisherLaunch, RelayLaunch, decode_config
from rlbus.actors.common.weight_sync import decode_full
from rlbus.actors.publisher.actor import Publisher
from rlbus.actors.publisher.regions import advance_latest, list_digests
from rlbus.kernels.delta.codec import DeltaCorrupt, snapshot_due
from rlbus.kernels.delta.state import apply_state_, encode_state
from rlbus.messages import checks, codec
from rlbus.messages.bus import Bus, digest
from rlbus.messages.errors import BadMessage, DigestMismatch, TopologyError
from rlbus.messages.objects import fetch_object, store_digest
from rlbus.messages.schemas import VersionReady, WeightManifest
from rlbus.messages.subjects import LINK_KEY, Subjects

log = structlog.get_logger()

LINK_OBJECT_WAIT_S: Final = 10.0
"""How long a region's relay waits for the object its `link` key names to be stored beside it."""


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
            tg.start_soon(self.writers[self.region].run)
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
        if version not in self.encoder.kept:
            blob = await self._download(Subjects.version_object(version), None, attempts=1)
            if blob is None:
                return None
            state, index = await anyio.to_thread.run_sync(partial(decode_full, blob, threads=self.launch.threads))
            self.encoder.keep(version, state, index.version_digest)
            self.count("bases_from_hub")
        return self.encoder.kept[version]

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
                    apply_state_, state, blob, expect_base=self.encoder.digest_of[base], verify=True,
                    threads=self.launch.threads))
                full = None
            if link.version_digest and index.version_digest.hex() != link.version_digest:
                raise DeltaCorrupt(f"version digest {index.version_digest.hex()} != linked {link.version_digest}")
        except (DeltaCorrupt, DigestMismatch, ValueError, nats.js.errors.NotFoundError) as err:
            self.count("links_refused")
            log.error("region_relay_link_refused", region=self.region, version=v, object=name, error=repr(err))
            return
        self._mark(v, "decoded")
        snap = self.encoder.snapshot_version
        if full is None and (snapshot_due(v, full_every=self.config.full_every) or snap is None
                             or snap not in self.encoder.kept):
            _, full = await anyio.to_thread.run_sync(partial(
                encode_state, state, None, digests=index.digests, threads=self.launch.threads))
        ready = VersionReady(version=v, step=0, object=name, digest=digest(full) if full else "",
                             version_digest=link.version_digest, raw_bytes=link.raw_bytes,
                             model_config=link.model_config)
        if region.present is None:
            region.present = await list_digests(await self.bus.js.object_store(self.subjects.weights_bucket(self.region)))
        region.present[name] = link.digests[0]             # already here: the writer skips it
        await self._encode(ready, full or b"", index, state, timings={"receive_s": time.perf_counter() - t0})
        self.relayed_version = v
        self.count("versions_relayed")


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
