"""Which weight objects to fetch: the plan from the version a generator holds to the one a manifest announces.

- Owns: `Part` (one object as an edge base -> version), `manifest_parts`, `plan_fetch` (the fewest-bytes chain:
  a delta from the held version, a multi-version delta, or a full snapshot [+ the delta from it]).
- Does not: fetch, apply or verify anything (actors/common/weight_sync.py); no bus, no torch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from rlbus.messages.errors import BadMessage
from rlbus.messages.schemas import WeightManifest


@dataclass(frozen=True, slots=True)
class Part:
    """One object of a manifest: `base` -> `version` (base None: a full snapshot of `version`)."""

    name: str
    digest: str
    size: int
    base: int | None
    version: int


def manifest_parts(manifest: WeightManifest) -> list[Part]:
    """The manifest's objects as parts; a manifest without `bases` is read as one object of its encoding."""
    n = len(manifest.objects)
    if len(manifest.bases) == n and len(manifest.yields) == n:
        bases, yields = list(manifest.bases), list(manifest.yields)
    else:
        base = manifest.base_version if manifest.encoding == "delta" else None
        bases, yields = [base] * n, [manifest.version] * n
    if not len(manifest.digests) == len(manifest.sizes) == n:
        raise BadMessage(f"manifest v{manifest.version}: {n} objects, {len(manifest.digests)} digests, "
                         f"{len(manifest.sizes)} sizes")
    return [Part(name, digest, size, base, version) for name, digest, size, base, version
            in zip(manifest.objects, manifest.digests, manifest.sizes, bases, yields, strict=True)]


def plan_fetch(parts: list[Part], staged: int | None, target: int, *,
               avoid: frozenset[str] | set[str] = frozenset()) -> list[Part] | None:
    """The fewest-bytes chain of parts from `staged` (None: nothing usable) to `target`.

    Parts are edges base -> version; a full snapshot is an edge from "nothing", which is always
    available, so any chain may start with one. -> [] when staged == target; None when no chain
    avoids the object names in `avoid`. Dijkstra over a handful of edges.
    """
    if staged == target:
        return []
    start: list[tuple[int, int, int | None, list[Part]]] = [(0, 0, None, [])]
    if staged is not None:
        start.append((0, 1, staged, []))
    heap, tie, done = start, 2, set[int | None]()
    while heap:
        cost, _, node, path = heapq.heappop(heap)
        if node == target:
            return path
        if node in done:
            continue
        done.add(node)
        for part in parts:
            if part.base == node and part.name not in avoid and part.version not in done:
                heapq.heappush(heap, (cost + part.size, tie, part.version, [*path, part]))
                tie += 1
    return None
