"""The weight fetch plan without a bus: a manifest's objects as edges, and the fewest-bytes chain to a version."""

from __future__ import annotations

import pytest

from rlbus.actors.common.fetch_plan import Part, manifest_parts, plan_fetch
from rlbus.messages.errors import BadMessage
from rlbus.messages.schemas import WeightManifest


def _manifest() -> WeightManifest:
    """v9 as a publisher lists it: deltas from v8 and v7, the delta from the v5 snapshot, and that snapshot."""
    return WeightManifest(version=9, base_version=8, encoding="delta",
                          objects=["v9.from8", "v9.from7", "v9.from5", "v5.full"],
                          digests=["d8", "d7", "d5", "f5"], sizes=[10, 18, 40, 1000],
                          bases=[8, 7, 5, None], yields=[9, 9, 9, 5])


def test_manifest_parts_are_the_listed_edges() -> None:
    """Each object becomes an edge base -> version with its digest and size; the snapshot yields its own version."""
    parts = manifest_parts(_manifest())
    assert [(p.name, p.digest, p.size, p.base, p.version) for p in parts] == [
        ("v9.from8", "d8", 10, 8, 9), ("v9.from7", "d7", 18, 7, 9), ("v9.from5", "d5", 40, 5, 9),
        ("v5.full", "f5", 1000, None, 5)]


def test_a_manifest_without_bases_reads_as_one_encoding() -> None:
    """An older publisher's manifest (no bases/yields): every object takes its encoding's base to the version."""
    delta = WeightManifest(version=3, base_version=2, encoding="delta", objects=["a"], digests=["x"], sizes=[5])
    full = WeightManifest(version=3, encoding="full", objects=["b"], digests=["y"], sizes=[50])
    assert manifest_parts(delta) == [Part("a", "x", 5, 2, 3)]
    assert manifest_parts(full) == [Part("b", "y", 50, None, 3)]


def test_a_manifest_whose_lists_disagree_is_refused() -> None:
    """Objects, digests and sizes of different lengths are a BadMessage naming the counts."""
    bad = WeightManifest(version=4, objects=["a", "b"], digests=["x"], sizes=[1, 2])
    with pytest.raises(BadMessage, match="v4: 2 objects, 1 digests, 2 sizes"):
        manifest_parts(bad)


@pytest.mark.parametrize(("staged", "expected"), [
    (9, []),                                   # already there
    (8, ["v9.from8"]),                         # the one-step delta
    (7, ["v9.from7"]),                         # a two-step delta, not via a version it does not hold
    (5, ["v9.from5"]),                         # from the snapshot's version
    (6, ["v5.full", "v9.from5"]),              # nothing from 6: the snapshot, then the delta from it
    (None, ["v5.full", "v9.from5"]),           # a joiner
    (12, ["v5.full", "v9.from5"]),             # ahead of the manifest (a restarted publisher): start over
])
def test_the_plan_is_the_fewest_bytes_chain(staged: int | None, expected: list[str]) -> None:
    """From each held version, the chain of least total size that ends at the manifest's version."""
    plan = plan_fetch(manifest_parts(_manifest()), staged, 9)
    assert plan is not None and [p.name for p in plan] == expected


def test_an_avoided_object_is_routed_around_or_leaves_no_plan() -> None:
    """A rejected object is never planned again: the next cheapest chain, and None when every chain needs it."""
    parts = manifest_parts(_manifest())
    assert [p.name for p in plan_fetch(parts, 8, 9, avoid={"v9.from8"}) or []] == ["v5.full", "v9.from5"]
    assert plan_fetch(parts, 8, 9, avoid={"v9.from8", "v5.full"}) is None
    assert plan_fetch(parts, None, 9, avoid={"v9.from5"}) is None


def test_a_cheaper_chain_of_several_deltas_beats_a_direct_one() -> None:
    """Costs add along a chain: two small deltas through a held-over version beat one large direct delta."""
    parts = [Part("v3.from1", "a", 100, 1, 3), Part("v2.from1", "b", 10, 1, 2), Part("v3.from2", "c", 10, 2, 3)]
    assert [p.name for p in plan_fetch(parts, 1, 3) or []] == ["v2.from1", "v3.from2"]
    assert plan_fetch(parts, 1, 4) is None                      # no object yields v4
