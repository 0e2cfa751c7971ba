"""Compiled codec loops: the same results and bytes as the numpy reference, on random and adversarial inputs."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import blake3
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbus.kernels.delta import bitcode
from rlbus.kernels.delta import codec as delta
from rlbus.kernels.delta.codec import (
    Encoding,
    _decode_diffs,
    _encode_diffs,
    apply_,
    bits_view,
    changed_elements,
    codec_backend,
    decode_payload_,
    encode_tensor,
    key_diffs,
    set_codec_backend,
)
from rlbus.kernels.delta.state import apply_state_, encode_state

delta_numba = pytest.importorskip("rlbus.kernels.delta.compiled")
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INT = {torch.bfloat16: np.int16, torch.float16: np.int16, torch.float32: np.int32}


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    delta_numba.warm_up()


@pytest.fixture
def backend() -> Iterator[Callable[[str], None]]:
    """Switch the codec backend inside a test; the previous one is restored after it."""
    previous = codec_backend()
    yield lambda name: set_codec_backend(name) and None
    set_codec_backend(previous)


def _outcome(fn: Callable[[], Any]) -> Any:
    """fn's result with arrays as lists, or its ValueError's message: two implementations compare equal."""
    try:
        r = fn()
    except ValueError as err:
        return ("ValueError", str(err))
    return [x.tolist() if isinstance(x, np.ndarray) else x for x in (r if isinstance(r, tuple) else (r,))]


def _pairs() -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(case, new, old) int16/int32 arrays: empty, tails of every length, none and all changed, edges of the
    scan's steps and of the compiled scan's first allocation, extreme bit patterns."""
    rng = np.random.default_rng(7)
    for dt in (np.int16, np.int32):
        info = np.iinfo(dt)
        for n in (0, 1, 2, 3, 5, 7, 8, 9, 4099, 65_541):
            old = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
            yield f"{dt.__name__} none of {n}", old.copy(), old
            yield f"{dt.__name__} all of {n}", old ^ dt(1), old
            some = old.copy()
            some[rng.random(n) < 0.03] += dt(1)
            yield f"{dt.__name__} some of {n}", some, old
        ends = np.zeros(301, dtype=dt)
        ends[[0, 150, 299, 300]] = (info.min, info.max, -1, info.min)
        yield f"{dt.__name__} edges", ends, np.zeros(301, dtype=dt)


@pytest.mark.parametrize("step_words", [1, 3, 1 << 16])
def test_compiled_scan_finds_what_the_reference_finds_and_hashes_the_same(step_words: int) -> None:
    """Positions, new and old bits, and the digest fed during the scan equal the reference's, for every case."""
    for case, new, old in _pairs():
        if step_words < 64 and new.size > 10_000:
            continue                               # thousands of steps: the small cases cover the edges
        h_ref, h_fast = blake3.blake3(), blake3.blake3()
        ref = changed_elements(new, old, h_ref)
        got = delta_numba.changed_elements(new, old, h_fast, step_words=step_words)
        for r, g in zip(ref, got, strict=True):
            assert r.dtype == g.dtype and np.array_equal(r, g), case
        assert h_fast.digest() == h_ref.digest() == blake3.blake3(new.tobytes()).digest(), case


ints = st.lists(st.one_of(st.integers(0, 3), st.integers(0, 60), st.integers(0, 1 << 20), st.integers(0, 1 << 44)),
                min_size=1, max_size=700)


@FAST
@given(ints)
def test_compiled_integer_code_writes_and_reads_the_reference_bytes(values: list[int]) -> None:
    """Rice and Exp-Golomb codes: byte-identical output (same parameter chosen), read back by both decoders."""
    x = np.array(values, dtype=np.int64)
    ref, got = bytearray(b"\x07"), bytearray(b"\x07")
    bitcode.encode_ints(x, ref)
    delta_numba.encode_ints(x, got)
    assert got == ref
    buf = np.frombuffer(bytes(ref), dtype=np.uint8)
    y, end = delta_numba.decode_ints(buf, 1, x.size)
    assert np.array_equal(y, x) and end == len(ref) == bitcode.decode_ints(bytes(ref), 1, x.size)[1]


def test_heavy_tails_and_all_zeros_choose_the_same_code() -> None:
    """Exp-Golomb for a heavy tail, Rice k = 0 for zeros, a 63-bit-wide mean: the reference's bytes each time."""
    cases = [np.array([0] * 999 + [1 << 40], dtype=np.int64), np.zeros(1000, dtype=np.int64),
             np.array([1, 1 << 45, 3, 7] * 9, dtype=np.int64), np.arange(8, dtype=np.int64)]
    for x in cases:
        ref, got = bytearray(), bytearray()
        bitcode.encode_ints(x, ref)
        delta_numba.encode_ints(x, got)
        assert got == ref


@FAST
@given(st.binary(min_size=0, max_size=64), st.integers(0, 8), st.integers(1, 40))
def test_compiled_integer_decoder_on_garbage_agrees_with_the_reference(raw: bytes, offset: int, count: int) -> None:
    """Random bytes: the same values, or a ValueError with the same message, and never a read out of bounds."""
    buf = np.frombuffer(raw, dtype=np.uint8)
    assert _outcome(lambda: delta_numba.decode_ints(buf, offset, count)) == \
        _outcome(lambda: bitcode.decode_ints(raw, offset, count))


diffs = st.tuples(st.sampled_from([np.int16, np.int32]),
                  st.lists(st.one_of(st.sampled_from([1, -1, 2, -2, 3]), st.integers(-(1 << 31), (1 << 31) - 1)),
                           min_size=1, max_size=400))
"""(dtype, differences): never 0 once in the dtype, as between changed elements."""


@FAST
@given(diffs)
def test_compiled_value_differences_equal_the_reference(case: tuple[type, list[int]]) -> None:
    """Sign bits and escapes (extremes of the dtype included): same bytes, and both decoders read them back."""
    dt, values = case
    d = np.array(values, dtype=np.int64).astype(dt)   # wraps into the dtype: -2**15 and 2**15 - 1 appear
    d[d == 0] = 1
    ref, got = bytearray(), bytearray()
    _encode_diffs(d, ref)
    delta_numba.encode_diffs(d, got)
    assert got == ref
    back, end = delta_numba.decode_diffs(np.frombuffer(bytes(ref), dtype=np.uint8), 0, d.size, np.dtype(dt))
    assert np.array_equal(back, d) and back.dtype == d.dtype and end == len(ref)
    assert np.array_equal(_decode_diffs(memoryview(bytes(ref)), 0, d.size, np.dtype(dt))[0], d)


def test_compiled_sparse_apply_refuses_positions_that_do_not_ascend_inside() -> None:
    """Out of range, repeated or descending positions raise, and the target keeps its bits."""
    host = np.arange(10, dtype=np.int16)
    for pos in ([3, 10], [-1, 2], [4, 4], [5, 2]):
        with pytest.raises(ValueError, match="ascend strictly"):
            delta_numba.apply_sparse_(host, np.array(pos, dtype=np.int64), np.ones(2, dtype=np.int16))
        assert np.array_equal(host, np.arange(10, dtype=np.int16))


def _tensor_pairs() -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    for case, new, old in _pairs():
        if new.size == 4099:
            continue                               # the other sizes cover the same paths
        for dtype, it in INT.items():
            if it == new.dtype:
                yield case, torch.from_numpy(new.copy()).view(dtype), torch.from_numpy(old.copy()).view(dtype)


def test_every_encoding_writes_the_same_payload_and_applies_the_same_on_both_backends(
        backend: Callable[[str], None]) -> None:
    """Per tensor and encoding: identical headers and payloads; applying gives the new bits and the same patch."""
    for case, new, old in _tensor_pairs():
        for enc in Encoding:
            out = {}
            for name in ("numpy", "numba"):
                backend(name)
                e = encode_tensor(new, old, encodings=(enc,))
                target = old.clone()
                patch = decode_payload_(target, e.header, memoryview(e.payload), verify=True)
                assert torch.equal(bits_view(target), bits_view(new)), (case, enc, name)
                out[name] = (e, None if patch is None else [p.tolist() for p in patch])
            assert out["numba"] == out["numpy"], (case, enc)


def test_a_whole_state_encodes_to_the_same_blob_and_applies_the_same_on_both_backends(
        backend: Callable[[str], None]) -> None:
    """A version of odd-sized, empty, unchanged and fully changed tensors: one blob, one result, one patch set."""
    gen = torch.Generator().manual_seed(3)
    old = {"w": torch.randn(257, 33, generator=gen).bfloat16(), "b": torch.randn(7, generator=gen).half(),
           "e": torch.zeros(0, 4, dtype=torch.bfloat16), "s": torch.randn(1001, generator=gen),
           "u": torch.randn(64, generator=gen).bfloat16()}
    new = {k: v.clone() for k, v in old.items()}
    bits_view(new["w"])[::37] += 1
    bits_view(new["b"])[:] ^= 0x55
    bits_view(new["s"])[5::9] -= 3
    blobs, results = {}, {}
    for name in ("numpy", "numba"):
        backend(name)
        _, blobs[name] = encode_state(new, old)
        target, patches = {k: v.clone() for k, v in old.items()}, {}
        apply_state_(target, blobs[name], verify=True, patches=patches)
        results[name] = ({k: bits_view(v).tolist() for k, v in target.items()},
                         {k: None if p is None else [a.tolist() for a in p] for k, p in patches.items()})
    assert blobs["numba"] == blobs["numpy"]
    assert results["numba"] == results["numpy"]
    assert results["numba"][0] == {k: bits_view(v).tolist() for k, v in new.items()}


def test_a_payload_damaged_after_its_digest_fails_the_same_way_on_both_backends(
        backend: Callable[[str], None]) -> None:
    """Truncated or flipped sparse payloads (digest check skipped): DeltaCorrupt on both, the target untouched."""
    old = torch.randn(5000, generator=torch.Generator().manual_seed(1)).bfloat16()
    new = old.clone()
    bits_view(new)[::11] += 1
    bits_view(new)[::97] -= 40
    e = encode_tensor(new, old, encodings=(Encoding.SPARSE,))
    damaged = [e.payload[:-1], e.payload + b"\x00", e.payload[:len(e.payload) // 2],
               e.payload[:3] + bytes([e.payload[3] ^ 0xC0]) + e.payload[4:]]
    for payload in damaged:
        for name in ("numpy", "numba"):
            backend(name)
            target = old.clone()
            with pytest.raises(delta.DeltaCorrupt):
                decode_payload_(target, e.header, memoryview(payload), check=False)
            assert torch.equal(bits_view(target), bits_view(old)), name


def test_backend_names_are_checked() -> None:
    with pytest.raises(ValueError, match="not one of numba, numpy"):
        set_codec_backend("cython")
    assert codec_backend() == "numba"


def test_without_numba_the_codec_falls_back_to_the_numpy_path() -> None:
    """A process where numba does not import names the numpy backend and still round-trips bit-exactly."""
    code = (
        "import sys; sys.modules['numba'] = None\n"
        "import torch\n"
        "from rlbus.kernels.delta.codec import apply_, bits_view, codec_backend, encode_tensor, set_codec_backend\n"
        "old = torch.randn(999).bfloat16(); new = old.clone(); bits_view(new)[::7] += 1\n"
        "t = old.clone(); apply_(t, encode_tensor(new, old), verify=True)\n"
        "assert torch.equal(bits_view(t), bits_view(new))\n"
        "try:\n    set_codec_backend('numba')\nexcept ValueError as e:\n    print(e)\n"
        "print(codec_backend())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.splitlines() == ["codec backend 'numba' is unavailable here: numba does not import", "numpy"]


def test_key_differences_feed_both_backends_alike() -> None:
    """The diffs of a real bf16 step (+-1 ulp mostly, a few escapes) code to the same bytes."""
    old = torch.randn(20_000, generator=torch.Generator().manual_seed(5)).bfloat16()
    new = (old.float() * (1 + 1e-2 * torch.randn(20_000, generator=torch.Generator().manual_seed(6)))).bfloat16()
    a, b = bits_view(new).numpy(), bits_view(old).numpy()
    pos = np.flatnonzero(a != b)
    d = key_diffs(a[pos], b[pos])
    ref, got = bytearray(), bytearray()
    _encode_diffs(d, ref)
    delta_numba.encode_diffs(d, got)
    assert got == ref and pos.size > 1000
    target = old.clone()
    apply_(target, encode_tensor(new, old), verify=True)
    assert torch.equal(bits_view(target), bits_view(new))
