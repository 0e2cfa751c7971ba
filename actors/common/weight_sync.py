"""Generator-side weights: follow a region's published versions and swap them in between decoding steps.

- Owns: `WeightSync` (watch the region's LATEST `latest` key, fetch the planned objects from the region's
  WEIGHTS store digest-checked, apply them into staging off the event loop, swap in place from `maybe_swap`);
  the blob helpers the publisher shares (`decode_full`, `empty_state`).
- Guarantee: nothing unverified reaches the live model; a corrupt or missing object raises
  `Event(weights_rejected)` and the next plan avoids it.
- Does not: choose which objects to fetch (actors/common/fetch_plan.py), encode or publish versions
  (actors/publisher/), sample (model/sampling/generate.py) or know any policy implementation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final

import anyio
import nats.errors
import nats.js.errors
import structlog
import torch
from anyio.abc import TaskStatus
from torch import Tensor

from rlbus.actors.common.errors import WeightsError
from rlbus.actors.common.fetch_plan import Part, manifest_parts, plan_fetch
from rlbus.kernels.delta.codec import DTYPES, DeltaCorrupt, Patch, bits_view
from rlbus.kernels.delta.state import StateIndex, StreamApplier, apply_state_, read_index
from rlbus.messages import checks, codec
from rlbus.messages.bus import Bus
from rlbus.messages.errors import BadMessage, DigestMismatch
from rlbus.messages.kv import RETRIED
from rlbus.messages.objects import fetch_object, stream_object
from rlbus.messages.retry import GIVE_UP_S, retry_policy
from rlbus.messages.schemas import Event, WeightManifest
from rlbus.messages.subjects import LATEST_KEY, Subjects
from rlbus.messages.wakeup import Wakeup
from rlbus.model.policies.interface import (
    Policy,
    estimate_params,
    policy_from_spec,
    resolve_device,
    spec_files,
)

log = structlog.get_logger()

_FETCH_ERRORS: Final = (nats.errors.Error, TimeoutError, OSError)
STREAM_BATCH: Final = 4
"""Object chunks (512 KiB each) a streamed full snapshot holds in flight."""
_PATCH_LIMIT: Final = 1 / 8
"""Pending patches past this fraction of the model's elements are dropped for one full copy at the swap."""


# ---- blobs (shared with the publisher) ---------------------------------------------------------------
MAX_MODEL_PARAMS: Final = 1 << 31
"""Largest architecture a manifest may ask a generator to build (a bigger one is refused, not allocated)."""


def empty_state(index: StateIndex) -> dict[str, Tensor]:
    """Uninitialised CPU tensors with the names, shapes and dtypes a version blob's index lists."""
    return {name: torch.empty(tuple(h.shape), dtype=DTYPES[h.dtype])
            for name, h in zip(index.names, index.headers, strict=True)}


def decode_full(blob: bytes | memoryview, *, verify: bool = True, threads: int = 2
                ) -> tuple[dict[str, Tensor], StateIndex]:
    """A full-snapshot blob as fresh tensors; payload digests always checked, with `verify` every decoded
    tensor re-hashed against its digest too.

    :raises DeltaCorrupt: the blob fails a digest or is a delta (it needs a base).
    """
    index, _ = read_index(blob)
    if index.base_digest is not None:
        raise DeltaCorrupt("expected a full snapshot, got a delta (it needs its base version)")
    state = empty_state(index)
    apply_state_(state, blob, verify=verify, threads=threads)
    return state, index


# ---- the sync ---------------------------------------------------------------------------------------
class _PartFailed(Exception):
    """An object whose blob did not apply or verify (internal: carries which one)."""

    def __init__(self, part: Part, error: Exception) -> None:
        super().__init__(f"{part.name}: {error!r}")
        self.part = part
        self.error = error


class WeightSync:
    """A region's published versions, staged off the event loop and swapped into a model in place.

    Use `async with WeightSync.open(bus, region) as sync:` (or `tg.start(sync.run)`); then
    `await sync.wait_for_version(0)`; pass `sync.maybe_swap` as `generate(..., on_step=)`.
    Thread safety: staging and swapping share one lock; `maybe_swap` never waits for it (a decode in
    progress means "not yet"), so generation never stalls on a download or a decode.

    A swap writes the elements the staged sparse deltas changed (no second decode), or else copies every
    staged tensor. The live policy is built from the first manifest's spec (`model_config`, any policy kind)
    with the files it lists (a Hugging Face config and tokenizer) fetched from the region's store.
    """

    def __init__(self, bus: Bus, region: str | None = None, *, model: Policy | None = None,
                 dtype: torch.dtype = torch.bfloat16, verify_every: int = 8, threads: int = 1,
                 retry_s: float = 1.0, device: str = "cpu") -> None:
        if verify_every < 1:
            raise ValueError(f"verify_every must be >= 1, got {verify_every}")
        self.bus = bus
        self.region = region or bus.identity.region
        self.dtype = dtype
        self.device = device
        """Where the live policy is built ("auto": CUDA when present); staging stays on the CPU."""
        self.verify_every = verify_every
        """Every full snapshot and every this-many-th delta re-hash every applied tensor against the
        version's digests (1: every version). Other deltas are checked by the object's sha256, every
        payload's digest, the base version's digest and the version digest, not re-hashed tensor by tensor."""
        self._since_verified = 0
        self.threads = threads
        self.retry_s = retry_s
        self._model = model
        self._live: dict[str, Tensor] | None = None
        self._staging: dict[str, Tensor] | None = None
        self._pending: list[dict[str, Patch | None]] | None = None
        """What turns the live model (held version) into the staging (staged version): the patches of every
        delta staged since the last swap, in order; None when the next swap copies every tensor."""
        self._pending_elements = 0
        self._staged_version: int | None = None
        self._staged_digest: bytes | None = None
        self._held_version: int | None = None
        self._held_digest: bytes | None = None
        self._lock = threading.Lock()
        self._build_lock = anyio.Lock()
        self._latest: WeightManifest | None = None
        self._wake = Wakeup()
        """A newer manifest arrived (the watcher wakes the stager)."""
        self._staged_event = Wakeup()
        """A version was staged (the stager wakes `wait_for_staged`)."""
        self._avoid: set[str] = set()
        self.last_path: list[str] = []
        """Object names fetched for the last staged version (tests and logs)."""
        self.rejected = 0
        self.swaps = 0
        self.verified = 0
        """Versions whose every tensor was re-hashed before it could be swapped in."""
        self.timings: dict[str, float] = {}
        """Seconds of the last staged version: fetch, apply; and of the last swap: swap."""
        self.last_swap_patched = 0
        """Tensors the last swap patched in place (the rest were copied whole)."""

    @classmethod
    @asynccontextmanager
    async def open(cls, bus: Bus, region: str | None = None, **options: Any) -> AsyncIterator[WeightSync]:
        """A running sync for the block (its watcher subscribed before the block starts)."""
        sync = cls(bus, region, **options)
        async with anyio.create_task_group() as tg:
            await tg.start(sync.run)
            try:
                yield sync
            finally:
                tg.cancel_scope.cancel()

    # ---- what generators read ---------------------------------------------------------------------
    @property
    def model(self) -> Policy:
        """The live policy (built from the first manifest's `model_config` when none was given)."""
        if self._model is None:
            raise RuntimeError("no weights yet: `await sync.wait_for_version(0)` before using the model")
        return self._model

    @property
    def held_version(self) -> int | None:
        """The version the live model holds (None before the first swap)."""
        return self._held_version

    @property
    def held_digest(self) -> bytes | None:
        """`state_digest` of the held version, as the manifest announced and the staging verified."""
        return self._held_digest

    @property
    def staged_version(self) -> int | None:
        """The version decoded and verified in the staging buffers, ready for the next swap."""
        return self._staged_version

    @property
    def latest(self) -> WeightManifest | None:
        """The newest manifest seen on the region's LATEST key."""
        return self._latest

    def build_model(self, files: Mapping[str, bytes] | None = None) -> Policy:
        """A policy of the latest manifest's spec in `dtype` on `device`, eval mode (weights: whatever init
        gives), with the files the spec lists (`fetch_files`).

        :raises RuntimeError: no manifest with a `model_config` yet.
        :raises PolicyError: the spec or its files make no policy, or the device cannot be had.
        """
        if self._latest is None or not self._latest.model_config:
            raise RuntimeError("no manifest with a model_config yet; wait for the publisher's first version")
        return policy_from_spec(self._latest.model_config, files, device=resolve_device(self.device),
                                dtype=self.dtype)

    async def fetch_files(self, spec: Mapping[str, Any]) -> dict[str, bytes]:
        """The files `spec` lists, from the region's WEIGHTS store (the publisher copies them there beside
        version 0), by file name; their sha256 is checked when the policy is built."""
        bucket = self.bus.subjects.weights_bucket(self.region)
        return {name: await fetch_object(self.bus.js, bucket, Subjects.policy_file_object(sha))
                for name, sha in spec_files(spec).items()}

    def maybe_swap(self, step: int = 0) -> int | None:
        """Copy the staged version into the live model in place and return it; None if nothing newer is
        staged or a decode holds the staging right now. Thread-safe; `generate`'s `on_step` hook."""
        if self._staged_version is None or self._staged_version == self._held_version or self._model is None:
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._swap_locked(step)
        finally:
            self._lock.release()

    async def wait_for_version(self, version: int) -> None:
        """Return once the live model holds `version` or newer, swapping in what is staged.

        The swap happens here, so call it between generations (a running `generate` on this model swaps
        through `maybe_swap` instead); `wait_for_staged` only waits.
        """
        while self._held_version is None or self._held_version < version:
            await self.wait_for_staged(version)
            await self._ensure_model()
            await anyio.to_thread.run_sync(self._swap_blocking)

    async def wait_for_staged(self, version: int) -> int:
        """Return the staged version once it is `version` or newer (decoded and verified, not yet live)."""
        while self._staged_version is None or self._staged_version < version:
            await self._staged_event.wait()
        return self._staged_version

    # ---- the watcher and the fetcher ------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Watch the region's LATEST key and stage every newer version until cancelled. Starting the watch rides out
        the region's server outage (for `GIVE_UP_S`), as an actor restarted while its server is down must."""
        retry = retry_policy("latest_watch_retry", on=RETRIED, initial_s=0.5, max_s=5.0, give_up_after_s=GIVE_UP_S,
                             region=self.region)
        async for attempt in retry:
            with attempt:
                kv = await self.bus.js.key_value(self.bus.subjects.latest_bucket(self.region))
                watcher = await kv.watch(LATEST_KEY)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._stage_loop)
                task_status.started()
                async for entry in watcher:
                    if entry is None or entry.operation in ("DEL", "PURGE"):   # end of history, delete, purge
                        continue
                    try:
                        if not entry.value:
                            raise BadMessage("an empty value where a WeightManifest belongs")
                        manifest = codec.decode_as(entry.value, None, WeightManifest)
                        checks.check(manifest)
                        self._check_architecture(manifest)
                    except BadMessage as err:              # a copy to the DLQ, once per KV revision
                        self.rejected += 1
                        log.warning("weights_manifest_unreadable", region=self.region, error=str(err))
                        bucket = self.bus.subjects.latest_bucket(self.region)
                        await self.bus.store_dead_letter(entry.value or b"", reason=str(err), source=bucket,
                                                         subject=Subjects.kv_key(bucket, LATEST_KEY),
                                                         key=str(entry.revision))
                        continue
                    if self._latest is None or manifest.version > self._latest.version or (
                            manifest.version == self._latest.version and manifest != self._latest):
                        self._latest = manifest
                        self._wake.set()
        finally:
            with anyio.move_on_after(2.0, shield=True):
                await watcher.stop()

    def _check_architecture(self, manifest: WeightManifest) -> None:
        """A manifest's `model_config` must be a policy spec of at most `MAX_MODEL_PARAMS` parameters (where
        the spec tells its size), and the one of the policy already built, if any (the architecture never
        changes within a run).

        :raises BadMessage: naming what is wrong.
        """
        if not manifest.model_config:
            return
        try:
            params = estimate_params(manifest.model_config)
        except (ValueError, TypeError, OverflowError) as err:
            raise BadMessage(f"manifest v{manifest.version}: unusable model_config: {err}"[:500]) from None
        if params is not None and params > MAX_MODEL_PARAMS:
            raise BadMessage(f"manifest v{manifest.version}: model_config of ~{params:.3g} parameters "
                             f"(at most {MAX_MODEL_PARAMS:.3g})")
        if self._model is not None and self._model.spec() != dict(manifest.model_config):
            raise BadMessage(f"manifest v{manifest.version}: model_config {str(manifest.model_config)[:200]} "
                             f"differs from the running model's architecture")

    async def _stage_loop(self) -> None:
        while True:
            manifest = self._latest
            staged = self._staged_version
            if manifest is None or (staged is not None and staged >= manifest.version):
                await self._wake.wait()
                continue
            if not await self._stage(manifest):
                await self._wake.wait(self.retry_s)       # retry, or sooner when a newer manifest arrives

    async def _stage(self, manifest: WeightManifest) -> bool:
        """Fetch, apply and verify one manifest into the staging buffers; False to retry later."""
        try:
            if manifest.model_config:
                await self._ensure_model()
        except (RuntimeError, ValueError, *_FETCH_ERRORS, nats.js.errors.NotFoundError, DigestMismatch) as err:
            # e.g. out of memory for the architecture, a policy file not (yet) in the region's store
            await self._reject(manifest, "", f"cannot build the model: {err!r}")
            return False
        try:
            parts = manifest_parts(manifest)
        except BadMessage as err:
            await self._reject(manifest, "", str(err))
            return False
        self._avoid &= {p.name for p in parts}      # names are per version: forget those no longer listed
        while (path := plan_fetch(parts, self._staged_version, manifest.version,
                                  avoid=self._avoid)) is not None:
            outcome = await self._try(manifest, path)
            if outcome is not None:
                return outcome
        log.info("weights_no_path", region=self.region, version=manifest.version, staged=self._staged_version,
                    avoided=sorted(self._avoid))
        return False

    async def _try(self, manifest: WeightManifest, path: list[Part]) -> bool | None:
        """One planned chain: True staged; False a transient failure (retry later); None an object was
        rejected and is avoided from now on (plan again). A lone full snapshot streams into the staging."""
        if len(path) == 1 and path[0].base is None:
            return await self._stream_full(manifest, path[0])
        t0 = time.perf_counter()
        blobs = []
        for part in path:
            try:
                blobs.append(await fetch_object(self.bus.js, self.bus.subjects.weights_bucket(self.region),
                                                part.name, expected_digest=part.digest))
            except (DigestMismatch, nats.js.errors.NotFoundError) as err:
                self._avoid.add(part.name)
                await self._reject(manifest, part.name, f"{type(err).__name__}: {err}")
                return None
            except _FETCH_ERRORS as err:
                log.warning("weights_fetch_failed", region=self.region, version=manifest.version,
                            object=part.name, error=repr(err))
                return False
        t1 = time.perf_counter()
        try:
            await anyio.to_thread.run_sync(self._apply, path, blobs, manifest)
        except _PartFailed as failed:
            self._avoid.add(failed.part.name)
            await self._reject(manifest, failed.part.name, repr(failed.error))
            return None
        self.timings.update(fetch=t1 - t0, apply=time.perf_counter() - t1)
        self.last_path = [p.name for p in path]
        log.info("weights_staged", region=self.region, version=manifest.version, objects=self.last_path,
                 bytes=sum(p.size for p in path), fetch_s=round(t1 - t0, 3),
                 apply_s=round(self.timings["apply"], 3))
        self._staged_event.set()
        return True

    async def _stream_full(self, manifest: WeightManifest, part: Part) -> bool | None:
        """Stream a full snapshot into the staging buffers chunk by chunk (`StreamApplier`, decoded in a worker
        thread), so the blob is never held whole beside them: the host memory a version takes is the staging
        copy plus one tensor's payload. Every tensor is re-hashed (`verify`), and the object's digests are
        checked when its last chunk arrived; until then, and on any failure, the staging is marked unusable
        (the live model is untouched and generation goes on under the held version). Same outcomes as `_try`."""
        t0 = time.perf_counter()
        await anyio.to_thread.run_sync(self._lock.acquire)
        try:
            self._staged_version = self._staged_digest = None
            self._pending = None
            applier = StreamApplier(self._staging_for, verify=True)
            bucket = self.bus.subjects.weights_bucket(self.region)
            try:
                await stream_object(self.bus.js, bucket, part.name,
                                    lambda chunk: anyio.to_thread.run_sync(applier.feed, chunk),
                                    expected_digest=part.digest, batch=STREAM_BATCH)
                index = applier.finish()
                want = bytes.fromhex(manifest.version_digest) if manifest.version_digest else None
                if want is not None and index.version_digest != want:
                    raise DeltaCorrupt(f"version {manifest.version} decodes to digest {index.version_digest.hex()}, "
                                       f"the manifest says {want.hex()}")
                if index.base_digest is not None:
                    raise DeltaCorrupt(f"object {part.name} is listed as a full snapshot but holds a delta")
            except (DigestMismatch, nats.js.errors.NotFoundError, DeltaCorrupt, ValueError) as err:
                failure: Exception | None = err
            except _FETCH_ERRORS as err:
                log.warning("weights_fetch_failed", region=self.region, version=manifest.version,
                            object=part.name, error=repr(err))
                return False
            else:
                failure = None
                self._staged_version, self._staged_digest = part.version, index.version_digest
                self._since_verified = 0
                self.verified += 1
        finally:
            self._lock.release()
        if failure is not None:
            self._avoid.add(part.name)
            await self._reject(manifest, part.name, f"{type(failure).__name__}: {failure}")
            return None
        elapsed = time.perf_counter() - t0
        self.timings.update(fetch=elapsed, apply=elapsed)
        self.last_path = [part.name]
        log.info("weights_staged", region=self.region, version=manifest.version, objects=self.last_path,
                 bytes=part.size, fetch_s=round(elapsed, 3), apply_s=round(elapsed, 3), streamed=True)
        self._staged_event.set()
        return True

    def _staging_for(self, index: StateIndex) -> dict[str, Tensor]:
        """The staging buffers for a full snapshot of `index`: the current ones when their names, shapes and
        dtypes match, else freshly allocated ones."""
        want = {n: (tuple(h.shape), DTYPES[h.dtype]) for n, h in zip(index.names, index.headers, strict=True)}
        have = {n: (tuple(t.shape), t.dtype) for n, t in (self._staging or {}).items()}
        if self._staging is None or have != want:
            self._staging = None                    # free the old buffers before allocating the new ones
            self._staging = empty_state(index)
        return self._staging

    def _apply(self, path: list[Part], blobs: list[bytes], manifest: WeightManifest) -> None:
        """Worker thread: apply the chain into the staging buffers, verifying every tensor. On any failure
        the staging is marked unusable (only a full snapshot rebuilds it); the live model is untouched.

        :raises _PartFailed: naming the object that did not check out.
        """
        want = bytes.fromhex(manifest.version_digest) if manifest.version_digest else None
        with self._lock:
            for part, blob in zip(path, blobs, strict=True):
                try:
                    self._apply_part(part, blob)
                    if part is path[-1] and want is not None and self._staged_digest != want:
                        got = (self._staged_digest or b"").hex()
                        raise DeltaCorrupt(f"version {manifest.version} decodes to digest {got}, the "
                                           f"manifest says {want.hex()}")
                except (DeltaCorrupt, ValueError) as err:     # WeightsError, BaseMismatch are ValueErrors
                    self._staged_version = self._staged_digest = None
                    self._pending = None
                    raise _PartFailed(part, err) from err

    def _apply_part(self, part: Part, blob: bytes) -> None:
        expect = None
        if part.base is None:
            self._staging_for(read_index(blob)[0])
        elif part.base != self._staged_version or self._staging is None:
            raise WeightsError(f"object {part.name} applies to version {part.base}, staging holds "
                               f"{self._staged_version}")
        else:
            expect = self._staged_digest
        verify = part.base is None or self._since_verified + 1 >= self.verify_every
        patches: dict[str, Patch | None] = {}
        index = apply_state_(self._staging, blob, expect_base=expect, verify=verify, threads=self.threads,
                             patches=patches)
        if (part.base is None) != (index.base_digest is None):
            raise DeltaCorrupt(f"object {part.name} is listed with base {part.base} but holds "
                               f"{'a full snapshot' if index.base_digest is None else 'a delta'}")
        self._pending_elements += sum(h.changed for h in index.headers)
        total = sum(t.numel() for t in self._staging.values())
        if (part.base is None or verify or self._pending is None
                or self._pending_elements > _PATCH_LIMIT * total):
            self._pending = None     # the next swap copies every tensor (after a re-hash: a fresh live copy)
        else:
            self._pending.append(patches)
        self._staged_version, self._staged_digest = part.version, index.version_digest
        self._since_verified = 0 if verify else self._since_verified + 1
        self.verified += verify

    async def _ensure_model(self) -> None:
        """Build the live policy from the latest manifest once (both the stager and a waiter may ask)."""
        async with self._build_lock:
            if self._model is None:
                assert self._latest is not None
                files = await self.fetch_files(self._latest.model_config)
                self._model = await anyio.to_thread.run_sync(self.build_model, files)

    def _swap_blocking(self) -> None:
        with self._lock:
            self._swap_locked(-1)

    def _swap_locked(self, step: int) -> int | None:
        staged = self._staged_version
        if staged is None or staged == self._held_version or self._staging is None or self._model is None:
            return None
        t0 = time.perf_counter()
        if self._live is None:
            self._live = self._model.named_tensors()
            if set(self._live) != set(self._staging):
                raise WeightsError(f"the model's tensors differ from the published version's: missing "
                                   f"{sorted(set(self._staging) - set(self._live))}, extra "
                                   f"{sorted(set(self._live) - set(self._staging))}")
        patched = self._bring_live(self._live, self._staging)
        self._pending, self._pending_elements = [], 0         # live == staging from here
        self.last_swap_patched = patched
        self._held_version, self._held_digest = staged, self._staged_digest
        self.swaps += 1
        self.timings["swap"] = time.perf_counter() - t0
        log.info("weights_applied", region=self.region, version=staged, step=step, patched=patched,
                 seconds=round(self.timings["swap"], 3))
        return staged

    def _bring_live(self, live: dict[str, Tensor], staging: dict[str, Tensor]) -> int:
        """Make every live tensor equal its staged one: replay the pending patches in order where every one
        is sparse and the live tensor is a contiguous CPU tensor of the staged dtype, else copy it whole.
        -> how many tensors were patched rather than copied."""
        patched = 0
        with torch.no_grad():
            for name, tensor in staging.items():
                target = live[name].data
                steps = None if self._pending is None else [p.get(name) for p in self._pending]
                if (steps is None or any(s is None for s in steps) or target.dtype != tensor.dtype
                        or target.device.type != "cpu" or not target.is_contiguous()):
                    target.copy_(tensor)
                    continue
                flat = bits_view(target).numpy()
                for pos, vals in steps:                 # type: ignore[misc]  # None excluded above
                    flat[pos] = vals
                patched += 1
        return patched

    async def _reject(self, manifest: WeightManifest, name: str, reason: str) -> None:
        self.rejected += 1
        log.warning("weights_rejected", region=self.region, version=manifest.version, object=name,
                    reason=reason)
        ident = self.bus.identity
        await self.bus.event(Event(event="weights_rejected", actor_id=ident.actor_id, actor_kind=ident.kind,
                                   region=self.region, detail=reason[:500],
                                   data={"version": str(manifest.version), "object": name,
                                         "staged": str(self._staged_version)}))

