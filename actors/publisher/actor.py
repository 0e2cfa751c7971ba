"""The weight publisher: every trainer version, encoded for the generators, written into every region and
announced once.

- Owns: `Publisher` (actor kind "publisher"): VersionReady in, the version written into every region and
  announced as a manifest on WEIGHTS, then the VersionReady acked.
- Guarantee: a version no region took is never announced; one whose CKPT object is missing or corrupt is
  dead-lettered with the reason.
- Does not: encode (actors/publisher/encoder.py), write regions (actors/publisher/regions.py), apply weights
  (actors/common/weight_sync.py) or train.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from functools import partial
from typing import Any

import anyio
import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from torch import Tensor

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.config import PublisherConfig, PublisherLaunch, decode_config
from rlbus.actors.common.weight_sync import decode_full
from rlbus.actors.publisher.encoder import EncodedVersion, VersionEncoder
from rlbus.actors.publisher.regions import BUS_ERRORS, RegionState, RegionWriter
from rlbus.kernels.delta.codec import DeltaCorrupt
from rlbus.kernels.delta.state import StateIndex, read_index
from rlbus.messages.bus import Bus, Delivery, digest
from rlbus.messages.errors import BadMessage, DigestMismatch, TopologyError
from rlbus.messages.history import last_message
from rlbus.messages.objects import fetch_object
from rlbus.messages.retry import GIVE_UP_S, retry_policy
from rlbus.messages.schemas import VersionReady, WeightManifest
from rlbus.messages.streams import ensure_consumer
from rlbus.messages.subjects import Subjects

log = structlog.get_logger()


class Publisher(Actor):
    """Turns every VersionReady into weight objects in every region and one WeightManifest announcement.

    Consumes VersionReady from the hub's STATE stream (its own durable, one in flight), downloads the raw
    bf16 version from CKPT (digest-checked, every tensor re-hashed), hands it to the encoder and the region
    writers, announces the manifest on WEIGHTS (msg id `weights-<N>`) with `regions_ready`, and only then
    acks the VersionReady.
    A region in `relayed` (its launch's `relayed`, which `rlbus up` fills with the leaves behind a
    `[regions.link]`) gets one object per version instead, and its `RegionRelay` makes the rest there.
    """

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
        self.regions = {name: RegionState(name, relayed=name in relayed) for name in launch.regions}
        self.writers = {name: RegionWriter(bus, region, launch, keep_versions=config.keep_versions,
                                           policy_file=self._policy_file, count=self.count, progress=self._progress_made)
                        for name, region in self.regions.items()}
        self.encoder = VersionEncoder(config, threads=launch.threads)
        self._ckpt_domain = launch.hub
        """Where CKPT (the trainer's version blobs) lives: the hub."""
        self._unavailable: set[int] = set()
        """Versions not in CKPT (or corrupt there): never tried again as bases."""
        self._announced: int | None = None
        self._files: dict[str, bytes] = {}
        """Policy files (a Hugging Face config and tokenizer) by object name, as downloaded from CKPT once."""
        self._files_lock = anyio.Lock()
        """Held while a policy file is looked up or downloaded: region writers asking at once wait for the first."""
        self._progress = anyio.Condition()
        self.last: EncodedVersion | None = None
        """The newest stage handed to the region writers."""
        self.trace: dict[int, dict[str, float]] = {}
        """Per recent version, `time.perf_counter()` marks: received, downloaded, decoded, staged (first stage
        handed to the writers), final, announced. For logs and `rlbus bench sync`."""

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
                tg.start_soon(self.writers[region.name].run)
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
            except BUS_ERRORS as err:
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
        retry = retry_policy("weights_announce_retry", on=BUS_ERRORS, initial_s=self.launch.retry_initial_s,
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
            if self.encoder.deltas:
                state, index = await anyio.to_thread.run_sync(partial(
                    decode_full, blob, verify=False, threads=self.launch.threads))
        except (DeltaCorrupt, ValueError) as err:
            log.error("version_blob_unusable", version=ready.version, error=repr(err))
            return None
        self._mark(ready.version, "decoded")
        return blob, index, state

    async def _encode(self, ready: VersionReady, blob: bytes, index: StateIndex,
                      state: dict[str, Tensor] | None, *, timings: dict[str, float]) -> EncodedVersion:
        """Bring back missing bases (`_reload_bases`), then encode the version and hand each stage to the region
        writers as it is ready (`VersionEncoder.encode`). -> the final stage."""
        if state is not None:
            await self._reload_bases(ready.version)
        return await self.encoder.encode(ready, blob, index, state, timings=timings, on_stage=self._set_targets)

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
        """After a restart (or a gap): bring back the bases the encoder asks for from CKPT, so a restarted
        publisher writes the same objects as before. Missing ones are remembered."""
        wanted, scheduled = self.encoder.bases_to_reload(version)
        for base in sorted(wanted - self._unavailable):
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
            self.encoder.keep(base, state, index.version_digest)
            if self.encoder.snapshot is None and base == scheduled:
                self.encoder.snapshot = (base, digest(blob), blob)
            log.info("base_reloaded", version=base)

    async def _download(self, name: str, expected: str | None, *,
                        attempts: int | None = None) -> bytes | None:
        """A CKPT object, retried with backoff: a missing or corrupt object `attempts` times (default
        `download_attempts`) before None; transient bus errors for up to `GIVE_UP_S`, then the error fails the
        publisher (its restart handles the unacked VersionReady again)."""
        tries = attempts or self.launch.download_attempts
        bad = 0
        unusable = (DigestMismatch, nats.js.errors.NotFoundError)
        retry = retry_policy("version_download_retry", on=(*unusable, *BUS_ERRORS),
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

    # ---- regions ------------------------------------------------------------------------------
    async def _progress_made(self) -> None:
        """A region writer wrote or failed: gauges, and wake whoever waits for regions."""
        self._set_gauges()
        await self._notify()

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

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

    def _set_gauges(self) -> None:
        newest = max((r.target.manifest.version for r in self.regions.values() if r.target is not None),
                     default=-1)
        for r in self.regions.values():
            self.gauges[f"region_version_{r.name}"] = float(r.done if r.done is not None else -1)
            self.gauges[f"region_ready_{r.name}"] = float(r.done is not None and r.done >= newest)
        self.gauges["announced_version"] = float(self._announced if self._announced is not None else -1)


def build_publisher(ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits,
                    launch: PublisherLaunch | None = None) -> Publisher:
    """The publisher of a `[weights]` section (plain values) and the run's regions and hub.

    :raises TopologyError: a setting is unknown or out of bounds (the text names it).
    """
    return Publisher(ident, bus, decode_config("weights", settings, PublisherConfig), limits, launch)
