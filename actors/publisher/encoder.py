"""The version encoder: each trainer version as the objects a region's WEIGHTS store holds, apart from the bus.

- Owns: `VersionEncoder` (the last `keep_versions` versions kept decoded; per version the deltas from the
  previous `delta_depth` versions and from the latest full snapshot, a snapshot every `full_every` versions,
  in two stages), `EncodedVersion` (one stage: its manifest and the bytes of every object), `object_name`.
- Does not: download, upload or announce (actors/publisher/actor.py, actors/publisher/regions.py); no bus.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Final

import anyio
import numpy as np
from torch import Tensor

from rlbus.actors.common.config import PublisherConfig
from rlbus.kernels.delta.codec import merge_positions, snapshot_due
from rlbus.kernels.delta.state import StateIndex, encode_state
from rlbus.messages.bus import digest
from rlbus.messages.schemas import VersionReady, WeightManifest

_OBJECT_NAME: Final = re.compile(r"v(\d+)\.(full|from\d+)")
_Row = tuple[str, str, int, int | None, int]
"""One object of a manifest: name, digest, size, base version, version it yields."""


def object_name(version: int, base: int | None) -> str:
    """Name of a version's object in a region's WEIGHTS store: `v<N>.full` or `v<N>.from<B>`."""
    return f"v{version}.full" if base is None else f"v{version}.from{base}"


def object_version(name: str) -> int | None:
    """The version an `object_name` yields (None: not a version object, such as a policy file)."""
    match = _OBJECT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


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
    """`time.perf_counter()` when it was handed to the region writers."""
    full: tuple[str, bytes] | None = None
    """(digest, blob) of the version's own full blob (the trainer's): what a relayed region that holds no base
    kept here is sent."""


class VersionEncoder:
    """The decoded versions kept as delta bases, and the encoding of each new version from them."""

    def __init__(self, config: PublisherConfig, *, threads: int) -> None:
        self.config = config
        self.threads = threads
        self.kept: dict[int, dict[str, Tensor]] = {}
        """Decoded versions kept as bases."""
        self.digest_of: dict[int, bytes] = {}
        """Version digest of each kept version."""
        self.changed: dict[int, dict[str, np.ndarray]] = {}
        """Per kept version v, the positions of each tensor that differ from v-1 (from the v-1 delta's full
        comparison): deltas from older bases compare only the union along the chain."""
        self.snapshot: tuple[int, str, bytes] | None = None
        """(version, sha256 digest, blob) of the latest full snapshot."""

    @property
    def deltas(self) -> bool:
        """Whether versions are delta-encoded at all (`full_every` 1 publishes only full snapshots)."""
        return self.config.full_every > 1

    @property
    def snapshot_version(self) -> int | None:
        return self.snapshot[0] if self.snapshot is not None else None

    def keep(self, version: int, state: dict[str, Tensor], version_digest: bytes) -> None:
        """Keep a decoded version as a base."""
        self.kept[version], self.digest_of[version] = state, version_digest

    def bases_to_reload(self, version: int) -> tuple[set[int], int]:
        """Before encoding `version` after a restart (or a gap): the versions to bring back as bases (the last
        `delta_depth` and, with no snapshot yet, the scheduled one) not kept now, and the scheduled snapshot's
        version. A restarted publisher then writes the same objects as before."""
        scheduled = version - version % self.config.full_every
        wanted = set(range(max(0, version - self.config.delta_depth), version))
        if self.snapshot is None and scheduled < version:
            wanted.add(scheduled)
        return wanted - self.kept.keys(), scheduled

    async def encode(self, ready: VersionReady, blob: bytes, index: StateIndex, state: dict[str, Tensor] | None, *,
                     timings: dict[str, float], on_stage: Callable[[EncodedVersion], None]) -> EncodedVersion:
        """Encode the version's objects in two stages, each handed to `on_stage`: the delta from the previous
        version alone as soon as it is encoded (what nearly every generator needs), then everything (older
        bases, the delta from the snapshot, the snapshot). `state` None: no deltas (full snapshots only).
        -> the final stage."""
        v = ready.version
        if state is not None:
            self.keep(v, state, index.version_digest)
        snap = self.snapshot_version
        if snapshot_due(v, full_every=self.config.full_every) or snap is None or (
                self.deltas and snap not in self.kept):
            snap = v
            self.snapshot = (v, ready.digest, blob)
        recent = {b for b in self.kept if v - self.config.delta_depth <= b < v}
        bases = [] if state is None else sorted(recent | ({snap} if snap < v else set()), reverse=True)
        blobs: dict[str, bytes] = {}
        rows: list[_Row] = []
        t0 = time.perf_counter()
        for base in bases:
            changed: dict[str, np.ndarray] = {}
            _, delta = await anyio.to_thread.run_sync(partial(
                encode_state, state, self.kept[base], digests=index.digests,
                base_digest=self.digest_of[base], threads=self.threads,
                candidates=self._chain_candidates(base, v), changed=changed if base == v - 1 else None))
            if base == v - 1:
                self.changed[v] = changed
            name = object_name(v, base)
            blobs[name] = delta
            rows.append((name, digest(delta), len(delta), base, v))
            if base == v - 1:
                timings["encode_first_s"] = time.perf_counter() - t0
                on_stage(self._stage(ready, index, rows, blobs, final=False, timings=timings, full=blob))
        assert self.snapshot is not None           # set above
        snap_version, snap_digest, snap_blob = self.snapshot
        blobs[object_name(snap_version, None)] = snap_blob
        rows.append((object_name(snap_version, None), snap_digest, len(snap_blob), None, snap_version))
        timings["encode_s"] = time.perf_counter() - t0
        self._evict(v)
        final = self._stage(ready, index, rows, blobs, final=True, timings=timings, full=blob)
        on_stage(final)
        return final

    def _chain_candidates(self, base: int, version: int) -> dict[str, np.ndarray] | None:
        """Positions outside which `version` equals `base`, per tensor: the union of what every step between
        them changed; None (compare everything) when a step is not known or for the delta from v-1."""
        chain = range(base + 1, version + 1)
        if version - base < 2 or any(v not in self.changed for v in chain):
            return None
        return {name: merge_positions([self.changed[v][name] for v in chain])
                for name in self.changed[version]}

    @staticmethod
    def _stage(ready: VersionReady, index: StateIndex, rows: list[_Row], blobs: dict[str, bytes], *,
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

    def _evict(self, version: int) -> None:
        floor = version - max(self.config.keep_versions, self.config.delta_depth + 1) + 1
        snap = self.snapshot_version
        for old in [b for b in self.kept if b < floor and b != snap]:
            del self.kept[old]
            del self.digest_of[old]
        for old in [b for b in self.changed if b <= min(self.kept, default=version)]:
            del self.changed[old]          # no chain from a kept base passes through it any more
