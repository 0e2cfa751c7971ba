"""Weight versions as one blob: whole-model round trips, multi-version deltas, digests, corruption."""

from __future__ import annotations

import struct

import blake3
import numpy as np
import pytest
import torch

from rlbus.kernels.delta.codec import (
    BaseMismatch,
    DeltaCorrupt,
    Encoding,
    bits_view,
    merge_positions,
    tensor_digest,
)
from rlbus.kernels.delta.state import (
    StateIndex,
    StreamApplier,
    apply_state_,
    encode_state,
    read_index,
    state_digest,
    tensor_digests,
)


def _model(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed.weight": (torch.randn(300, 64, generator=gen) * 0.02).to(torch.bfloat16),
            "blocks.0.mlp.up.weight": (torch.randn(128, 64, generator=gen) * 0.02).to(torch.bfloat16),
            "blocks.0.norm.weight": torch.ones(64, dtype=torch.bfloat16),
            "head.scale": torch.randn(7, generator=gen, dtype=torch.float32),
            "head.bias": torch.randn(5, generator=gen).to(torch.float16)}


def _step(state: dict[str, torch.Tensor], seed: int, lr: float) -> dict[str, torch.Tensor]:
    """The bf16/fp16 cast of an fp32 step of size lr (what the trainer publishes), fp32 kept exact."""
    gen = torch.Generator().manual_seed(seed)
    return {k: (v.float() + lr * torch.randn(v.shape, generator=gen)).to(v.dtype) for k, v in state.items()}


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits_view(a[k]), bits_view(b[k])) for k in a)


def test_full_snapshot_then_delta_round_trip() -> None:
    """A joiner seeds from a snapshot, then a delta v0 -> v1 brings it to v1 exactly."""
    v0 = _model(0)
    v1 = _step(v0, 1, 1e-4)
    index0, snap = encode_state(v0)
    assert index0.base_digest is None and index0.count(Encoding.FULL) == len(v0)
    joiner = {k: torch.empty_like(v) for k, v in v0.items()}
    apply_state_(joiner, snap, verify=True)
    assert _equal(joiner, v0)
    index1, delta = encode_state(v1, v0)
    assert index1.base_digest == index0.version_digest
    apply_state_(joiner, delta, expect_base=index0.version_digest, verify=True)
    assert _equal(joiner, v1)
    assert len(delta) < len(snap)


def test_multi_version_delta_catches_up_a_lagging_generator() -> None:
    """A delta v0 -> v3 applied to v0 equals v3; the delta from v2 would refuse a target holding v0."""
    versions = [_model(0)]
    for i in range(1, 4):
        versions.append(_step(versions[-1], i, 3e-3))
    digests = [state_digest(tensor_digests(v)) for v in versions]
    index, blob = encode_state(versions[3], versions[0], base_digest=digests[0])
    lagging = _clone(versions[0])
    got = apply_state_(lagging, blob, expect_base=digests[0])
    assert _equal(lagging, versions[3]) and not _equal(lagging, versions[2])
    assert got.version_digest == digests[3] == index.version_digest
    _, from_v2 = encode_state(versions[3], versions[2], base_digest=digests[2])
    target = _clone(versions[0])
    with pytest.raises(BaseMismatch, match="fetch the delta"):
        apply_state_(target, from_v2, expect_base=digests[0])
    assert _equal(target, versions[0])


def test_version_digest_is_blake3_over_sorted_name_digest_pairs() -> None:
    """state_digest hashes (len, name, tensor digest) in name order with BLAKE3-16, by hand."""
    d = {"b": b"\x02" * 16, "a": b"\x01" * 16}
    pairs = struct.pack("<I", 1) + b"a" + d["a"] + struct.pack("<I", 1) + b"b" + d["b"]
    want = blake3.blake3(pairs).digest(16)
    assert state_digest(d) == want
    v = _model(3)
    index, _ = encode_state(v)
    assert index.digests == {k: tensor_digest(t) for k, t in v.items()}
    assert index.version_digest == state_digest(index.digests)


@pytest.mark.parametrize("where", ["payload", "index", "prefix", "truncated"])
def test_corrupted_blob_is_detected_and_nothing_applied(where: str) -> None:
    """Any flipped byte or a cut blob raises DeltaCorrupt before a single tensor changes."""
    v0 = _model(0)
    v1 = _step(v0, 1, 1e-3)
    _, blob = encode_state(v1, v0)
    bad = bytearray(blob)
    if where == "payload":
        bad[-3] ^= 0x01
    elif where == "index":
        bad[30] ^= 0x80
    elif where == "prefix":
        bad[0:4] = b"XXXX"
    else:
        del bad[-10:]
    target = _clone(v0)
    with pytest.raises(DeltaCorrupt):
        apply_state_(target, bytes(bad))
    assert _equal(target, v0)


def test_target_with_other_tensors_is_refused() -> None:
    """A target missing a tensor of the blob is a ValueError naming it."""
    v0 = _model(0)
    _, blob = encode_state(v0)
    target = _clone(v0)
    del target["head.bias"]
    with pytest.raises(ValueError, match=r"head\.bias"):
        apply_state_(target, blob)


def test_blob_index_reads_back_and_sizes_add_up() -> None:
    """read_index returns the index encode_state built; payload sizes sum to the blob tail."""
    v0 = _model(5)
    v1 = _step(v0, 6, 1e-4)
    index, blob = encode_state(v1, v0, threads=1)
    got, start = read_index(blob)
    assert got == index
    assert start + sum(h.size for h in index.headers) == len(blob)
    assert index.names == tuple(sorted(v1))
    assert {h.encoding for h in index.headers} <= set(Encoding)


def test_parallel_and_serial_encodings_are_identical() -> None:
    """The thread pool changes nothing in the bytes of deltas and snapshots, with or without the digests
    given, with candidate positions, nor in the recorded changes."""
    v0 = _model(7)
    v1 = _step(v0, 8, 1e-3)
    assert encode_state(v1, v0, threads=1)[1] == encode_state(v1, v0, threads=2)[1]
    assert encode_state(v1, threads=1)[1] == encode_state(v1, threads=2)[1]
    digests = tensor_digests(v1)
    assert encode_state(v1, v0, digests=digests, threads=2)[1] == encode_state(v1, v0, threads=1)[1]
    serial: dict[str, np.ndarray] = {}
    pooled: dict[str, np.ndarray] = {}
    encode_state(v1, v0, threads=1, changed=serial)
    _, blob = encode_state(v1, v0, threads=2, changed=pooled)
    assert serial.keys() == pooled.keys() and all(np.array_equal(serial[n], pooled[n]) for n in serial)
    assert encode_state(v1, v0, candidates=pooled, threads=2)[1] == blob


def test_threaded_apply_equals_the_serial_apply_and_reports_the_same_patches() -> None:
    """Applying a delta on two threads gives the same tensors and patches as on one; verify still catches
    a target that did not hold the base."""
    v0 = _model(3)
    v1 = _step(v0, 4, 1e-3)
    _, blob = encode_state(v1, v0)
    one, two = _clone(v0), _clone(v0)
    p1: dict[str, tuple | None] = {}
    p2: dict[str, tuple | None] = {}
    apply_state_(one, blob, threads=1, patches=p1)
    apply_state_(two, blob, threads=2, patches=p2, verify=True)
    assert _equal(one, v1) and _equal(two, v1) and p1.keys() == p2.keys()
    for name in p1:
        assert (p1[name] is None) == (p2[name] is None), name
        if p1[name] is not None:
            assert all(np.array_equal(a, b) for a, b in zip(p1[name], p2[name], strict=True)), name
    wrong = _step(v0, 99, 1e-3)                    # not the base: the sparse patch lands on other bits
    with pytest.raises(DeltaCorrupt, match="digest differs"):
        apply_state_(wrong, blob, threads=2, verify=True)


def test_replayed_patches_equal_the_staged_apply_bit_for_bit() -> None:
    """Patches recorded while applying a delta, written into another copy of the base, give the new version;
    tensors rewritten whole (dense XOR, full) report None."""
    v0 = _model(4)
    v1 = _step(v0, 5, 1e-3)
    v1["head.bias"] = torch.randn(5).to(torch.float16)           # every element changes: not sparse
    v1["head.scale"][2] = float("nan")
    _, blob = encode_state(v1, v0)
    staged, live = _clone(v0), _clone(v0)
    patches: dict[str, tuple | None] = {}
    index = apply_state_(staged, blob, patches=patches)
    assert set(patches) == set(v0) and _equal(staged, v1)
    encodings = dict(zip(index.names, (Encoding(h.encoding) for h in index.headers), strict=True))
    for name, patch in patches.items():
        assert (patch is None) == (encodings[name] in (Encoding.FULL, Encoding.DENSE_XOR)), name
        if patch is None:
            live[name].copy_(staged[name])
        else:
            pos, vals = patch
            assert pos.size == index.headers[index.names.index(name)].changed
            bits_view(live[name]).numpy()[pos] = vals
    assert _equal(live, v1)
    assert patches["head.bias"] is None


def test_multi_version_delta_from_chained_changes_is_the_same_blob() -> None:
    """v0 -> v3 encoded comparing only the union of the positions each step changed equals, byte for byte,
    the blob of a full comparison (and the recorded positions are exactly where the bits differ)."""
    merged = merge_positions([np.array([1, 5, 9]), np.array([2, 5, 10]), np.array([0])])
    assert merged.tolist() == [0, 1, 2, 5, 9, 10]
    versions = [_model(7)]
    steps: list[dict[str, np.ndarray]] = []
    for i in range(1, 4):
        versions.append(_step(versions[-1], 10 + i, 2e-3))
        changed: dict[str, np.ndarray] = {}
        encode_state(versions[i], versions[i - 1], changed=changed)
        for name, pos in changed.items():
            new, old = bits_view(versions[i][name]).numpy(), bits_view(versions[i - 1][name]).numpy()
            want = np.flatnonzero(new != old)
            assert np.array_equal(pos, want), name
        steps.append(changed)
    candidates = {n: merge_positions([s[n] for s in steps]) for n in versions[0]}
    _, direct = encode_state(versions[3], versions[0])
    _, chained = encode_state(versions[3], versions[0], candidates=candidates)
    assert chained == direct
    target = _clone(versions[0])
    apply_state_(target, chained, verify=True)
    assert _equal(target, versions[3])


@pytest.mark.parametrize("piece", [1, 7, 333, 1 << 20])
def test_a_blob_streamed_in_pieces_applies_as_the_whole_blob_does(piece: int) -> None:
    """Snapshot and delta fed `piece` bytes at a time give the same tensors and patches as `apply_state_`, holding
    at most one payload (or the head) besides the piece."""
    v0, v1 = _model(0), _step(_model(0), 1, 1e-4)
    index0, snap = encode_state(v0)
    _, delta = encode_state(v1, v0)
    staged: dict[str, torch.Tensor] = {}

    def allocate(index: StateIndex) -> dict[str, torch.Tensor]:
        staged.update({k: torch.empty_like(v) for k, v in v0.items()})
        return staged

    for blob, want, base in ((snap, v0, None), (delta, v1, index0.version_digest)):
        patches: dict[str, object] = {}
        stream = StreamApplier(allocate if base is None else (lambda _: staged), expect_base=base, verify=True,
                               patches=patches)
        for at in range(0, len(blob), piece):
            stream.feed(blob[at:at + piece])
        assert stream.finish().version_digest == read_index(blob)[0].version_digest
        assert _equal(staged, want)
        whole = _clone(v0) if base is not None else {k: torch.empty_like(v) for k, v in v0.items()}
        expected: dict[str, object] = {}
        apply_state_(whole, blob, patches=expected)
        assert patches.keys() == expected.keys()
        largest = max(h.size for h in read_index(blob)[0].headers)
        assert stream.peak_buffer <= max(largest, read_index(blob)[1])


def test_a_streamed_blob_that_is_corrupt_short_or_long_or_for_another_base_is_refused() -> None:
    v0 = _model(0)
    index0, snap = encode_state(v0)
    _, delta = encode_state(_step(v0, 1, 1e-4), v0)

    def run(blob: bytes, base: bytes | None = None) -> None:
        stream = StreamApplier(lambda _: {k: torch.empty_like(v) for k, v in v0.items()}, expect_base=base)
        for at in range(0, len(blob), 100):
            stream.feed(blob[at:at + 100])
        stream.finish()

    flipped = bytearray(snap)
    flipped[-10] ^= 0xFF
    with pytest.raises(DeltaCorrupt, match="fails its digest"):
        run(bytes(flipped))
    with pytest.raises(DeltaCorrupt, match="ended after"):
        run(snap[:-1])
    with pytest.raises(DeltaCorrupt, match="more than"):
        run(snap + b"x")
    with pytest.raises(BaseMismatch):
        run(delta, base=b"\0" * len(index0.version_digest))
