"""Weight-delta codec, per tensor: bit-exact round trips with special values, encoding choice, digests."""

from __future__ import annotations

import blake3
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbus.kernels.delta import bitcode
from rlbus.kernels.delta.codec import (
    DeltaCorrupt,
    EncodedTensor,
    Encoding,
    apply_,
    apply_key_diffs,
    apply_key_diffs_torch_,
    bits_view,
    changed_elements,
    delta_base,
    device_changes,
    encode_tensor,
    find_changes,
    host_changes,
    key_diffs,
    ordered_key,
    snapshot_due,
    tensor_digest,
)

INT: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
                                       torch.float32: torch.int32}
SPECIALS: dict[torch.dtype, list[int]] = {
    # NaNs with several payloads and signs, +-Inf, +-0, smallest/largest subnormals, largest finite
    torch.bfloat16: [0x7FC0, 0x7F81, 0xFFC1, 0x7FFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F],
    torch.float16: [0x7E00, 0x7C01, 0xFE01, 0x7FFF, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF],
    torch.float32: [0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
                    0x00000001, 0x807FFFFF, 0x7F7FFFFF],
}
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _signed(pattern: int, width: int) -> int:
    return pattern - (1 << width) if pattern >= 1 << (width - 1) else pattern


def _tensor(patterns: list[int], dtype: torch.dtype) -> torch.Tensor:
    width = 16 if INT[dtype] == torch.int16 else 32
    return torch.tensor([_signed(p, width) for p in patterns], dtype=INT[dtype]).view(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits_view(a), bits_view(b))


@st.composite
def versions(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new) of one dtype: old mixes specials and random patterns; new edits some elements."""
    dtype = draw(st.sampled_from(list(INT)))
    width = 16 if INT[dtype] == torch.int16 else 32
    value = st.one_of(st.sampled_from(SPECIALS[dtype]), st.integers(0, (1 << width) - 1))
    old = draw(st.lists(value, min_size=1, max_size=300))
    new = list(old)
    for i, v in draw(st.lists(st.tuples(st.integers(0, len(old) - 1), value), max_size=len(old))):
        new[i] = v
    for i in draw(st.lists(st.integers(0, len(old) - 1), max_size=len(old))):  # +-1 ulp-like steps
        new[i] = (new[i] + draw(st.sampled_from([1, -1, 2]))) % (1 << width)
    return _tensor(old, dtype), _tensor(new, dtype)


@FAST
@given(versions(), st.sampled_from([Encoding.SPARSE, Encoding.BITMASK, Encoding.DENSE_XOR, Encoding.FULL]))
def test_every_delta_encoding_round_trips_bit_exactly(pair: tuple[torch.Tensor, torch.Tensor],
                                                      encoding: Encoding) -> None:
    """Applying encode(new, old) to a copy of old gives new bit for bit, NaN payloads and specials too."""
    old, new = pair
    enc = encode_tensor(new, old, encodings=(encoding,))
    assert enc.header.encoding == encoding
    target = old.clone()
    assert apply_(target, enc, verify=True) is target
    assert _same_bits(target, new)
    assert enc.header.digest == tensor_digest(new)


@FAST
@given(versions())
def test_full_snapshot_round_trips_into_any_buffer(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A snapshot (no base) fills a buffer holding anything with the exact bits."""
    _old, new = pair
    enc = encode_tensor(new)
    assert enc.header.encoding == Encoding.FULL and enc.header.changed == new.numel()
    target = torch.zeros_like(new)
    apply_(target, enc, verify=True)
    assert _same_bits(target, new)


@FAST
@given(st.lists(st.one_of(st.integers(0, 40), st.integers(0, 1 << 40)), min_size=1, max_size=500))
def test_integer_codes_round_trip(values: list[int]) -> None:
    """Rice/Exp-Golomb coding of non-negative integers decodes to the same sequence and consumes its bytes."""
    x = np.array(values, dtype=np.int64)
    out = bytearray(b"\x07")
    bitcode.encode_ints(x, out)
    mode, k = bitcode.choose_code(x)
    assert (len(out) - 1) * 8 >= bitcode.code_cost(x, mode, k)
    y, end = bitcode.decode_ints(bytes(out), 1, x.size)
    assert end == len(out) and np.array_equal(x, y)


def test_rice_cost_matches_hand_count() -> None:
    """Rice(k=2) of [0, 5, 9]: unary 0/1/2 (+3 stop bits) and 3*2 low bits = 12 bits."""
    x = np.array([0, 5, 9], dtype=np.int64)
    assert bitcode.code_cost(x, bitcode.RICE, 2) == (0 + 1 + 2) + 3 + 3 * 2
    assert bitcode.code_cost(x, bitcode.EXP_GOLOMB, 0) == 1 + 5 + 7  # 1 -> 1 bit, 6 -> 5, 10 -> 7


def test_heavy_tails_choose_exp_golomb() -> None:
    """Small values with rare huge outliers: Exp-Golomb beats every Rice parameter and is chosen."""
    x = np.array([0, 1, 2, 3, 1, 5, 2, 2**33, 0, 1, 3, 2**20], dtype=np.int64)
    mode, k = bitcode.choose_code(x)
    assert mode == bitcode.EXP_GOLOMB
    assert bitcode.code_cost(x, mode, k) < min(bitcode.code_cost(x, bitcode.RICE, r) for r in range(40))
    out = bytearray()
    bitcode.encode_ints(x, out)
    assert np.array_equal(bitcode.decode_ints(bytes(out), 0, x.size)[0], x)


def test_varints_round_trip() -> None:
    """LEB128: 300 is b'\\xac\\x02' and every value reads back."""
    out = bytearray()
    bitcode.put_varint(out, 300)
    assert bytes(out) == b"\xac\x02"
    for v in (0, 1, 127, 128, 2**35 + 7):
        buf = bytearray()
        bitcode.put_varint(buf, v)
        assert bitcode.get_varint(bytes(buf), 0) == (v, len(buf))


def test_ordered_key_sorts_like_the_floats_and_is_an_involution() -> None:
    """key(bits) orders finite bf16 values like the floats; key(key(b)) == b for all 65536 patterns."""
    every = np.arange(-(1 << 15), 1 << 15, dtype=np.int64).astype(np.int16)
    assert np.array_equal(ordered_key(ordered_key(every)), every)
    values = torch.from_numpy(every.copy()).view(torch.bfloat16).float()
    finite = torch.isfinite(values).numpy() & (every != np.int16(-(1 << 15)))  # -0 and +0 compare equal
    by_key = np.argsort(ordered_key(every[finite]), kind="stable")
    assert torch.all(torch.diff(values[torch.from_numpy(finite)][torch.from_numpy(by_key)]) >= 0)


def test_one_ulp_steps_are_differences_of_one() -> None:
    """Neighbouring floats differ by 1 in key space, across 0 and the exponent boundary, any sign."""
    old = torch.tensor([1.0, -1.0, 0.0, 2.0], dtype=torch.bfloat16)
    new = torch.tensor([1.0078125, -1.0078125, -0.0, 1.9921875], dtype=torch.bfloat16)
    d = key_diffs(bits_view(new).numpy(), bits_view(old).numpy())
    assert d.tolist() == [1, -1, -1, -1]
    assert np.array_equal(apply_key_diffs(bits_view(old).numpy(), d), bits_view(new).numpy())
    flat = bits_view(old.clone())
    apply_key_diffs_torch_(flat, torch.arange(4), torch.from_numpy(d))  # the device path, on CPU
    assert torch.equal(flat, bits_view(new))


def test_find_changes_reference_on_a_hand_example() -> None:
    """new [1,2,3,4] vs old [1,0,3,0]: positions [1,3], gaps [1,1], xor [2,4]."""
    pos, gaps, xor = find_changes(torch.tensor([1, 2, 3, 4], dtype=torch.int16),
                                  torch.tensor([1, 0, 3, 0], dtype=torch.int16))
    assert pos.tolist() == [1, 3] and gaps.tolist() == [1, 1] and xor.tolist() == [2, 4]


def test_word_wise_cpu_path_equals_the_reference() -> None:
    """The numpy change finder (64-bit words in L2-sized steps, then lanes, then the tail) gives the
    reference positions and the new and old bits there, within one step, across several, and unchanged."""
    gen = torch.Generator().manual_seed(0)
    for dtype, n in ((torch.int16, 60_003), (torch.int32, 60_001), (torch.int16, 3), (torch.int16, 600_003),
                     (torch.int32, 300_001)):
        old = torch.randint(-1000, 1000, (n,), dtype=dtype, generator=gen)
        new = old.clone()
        new[torch.randint(0, n, (n // 100,), generator=gen)] += 1
        new[[0, n // 2, n - 2, n - 1]] -= 3
        new[n // 2 + 1] = -old[n // 2 + 1] - 1  # sign flip
        ref = find_changes(new, old)[0].numpy()
        pos, new_vals, old_vals = changed_elements(new.numpy(), old.numpy())
        assert np.array_equal(pos, ref)
        assert np.array_equal(new_vals, new.numpy()[ref]) and np.array_equal(old_vals, old.numpy()[ref])
        assert new_vals.dtype == old_vals.dtype == new.numpy().dtype
        none = changed_elements(old.numpy(), old.numpy().copy())
        assert none[0].size == none[1].size == none[2].size == 0 and none[0].dtype == np.int64


def test_device_path_finds_the_same_changes_as_the_host_path() -> None:
    """The device change path (run here with the torch reference on CPU) matches the numpy path exactly."""
    gen = torch.Generator().manual_seed(9)
    old = (torch.randn(5001, generator=gen) * 0.02).to(torch.bfloat16)
    new = old.clone()
    bits_view(new)[torch.randint(0, 5001, (70,), generator=gen)] -= 2
    host, dev = host_changes(bits_view(new), bits_view(old)), device_changes(bits_view(new), bits_view(old))
    assert host.n == dev.n == 5001
    for field in ("pos", "new_vals", "old_vals"):
        assert np.array_equal(getattr(host, field), getattr(dev, field)), field


def _sizes(new: torch.Tensor, old: torch.Tensor) -> dict[Encoding, int]:
    return {e: encode_tensor(new, old, encodings=(e,)).header.size for e in Encoding}


def test_few_changes_choose_sparse() -> None:
    """0.5% of elements one ulp away: sparse, the smallest of all four."""
    gen = torch.Generator().manual_seed(1)
    old = (torch.randn(100_000, generator=gen) * 0.02).to(torch.bfloat16)
    new = old.clone()
    idx = torch.randperm(old.numel(), generator=gen)[:500]
    bits_view(new)[idx] += 1
    enc = encode_tensor(new, old)
    sizes = _sizes(new, old)
    assert enc.header.encoding == Encoding.SPARSE and enc.header.changed == 500
    assert enc.header.size == min(sizes.values())


def test_every_element_one_ulp_away_chooses_bitmask() -> None:
    """All elements stepped by +-1: the all-ones mask is nearly free, values cost ~1 bit: bitmask."""
    gen = torch.Generator().manual_seed(2)
    old = (torch.randn(50_000, generator=gen) * 0.02).to(torch.bfloat16)
    new = old.clone()
    bits_view(new).add_(torch.randint(0, 2, (50_000,), generator=gen, dtype=torch.int16) * 2 - 1)
    enc = encode_tensor(new, old)
    assert enc.header.encoding == Encoding.BITMASK
    assert enc.header.size == min(_sizes(new, old).values())


def test_random_low_byte_noise_chooses_dense_xor() -> None:
    """Every element's low byte XORed with noise: dense XOR (one random plane, one zero plane) is smallest."""
    gen = torch.Generator().manual_seed(3)
    old = (torch.randn(50_000, generator=gen) * 0.02).to(torch.bfloat16)
    new = old.clone()
    bits_view(new).bitwise_xor_(torch.randint(1, 256, (50_000,), generator=gen, dtype=torch.int16))
    enc = encode_tensor(new, old)
    assert enc.header.encoding == Encoding.DENSE_XOR
    assert enc.header.size == min(_sizes(new, old).values())


def test_unrelated_regular_tensor_chooses_full_and_no_base_means_full() -> None:
    """A constant tensor replacing noise compresses best on its own; without a base only FULL exists."""
    old = torch.randn(50_000, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    new = torch.full((50_000,), 0.5, dtype=torch.bfloat16)
    assert encode_tensor(new, old).header.encoding == Encoding.FULL
    assert encode_tensor(new).header.encoding == Encoding.FULL
    with pytest.raises(ValueError, match="without a base"):
        encode_tensor(new, encodings=(Encoding.SPARSE,))


def test_unchanged_tensor_costs_one_byte() -> None:
    """An identical tensor encodes as a sparse payload holding just the count 0."""
    t = torch.randn(4096).to(torch.bfloat16)
    enc = encode_tensor(t, t.clone())
    assert (enc.header.encoding, enc.header.changed, enc.payload) == (Encoding.SPARSE, 0, b"\x00")


def test_corrupted_payload_is_rejected_before_touching_the_target() -> None:
    """A flipped payload bit fails the digest with DeltaCorrupt (a ValueError); the target is untouched."""
    old = torch.randn(10_000).to(torch.bfloat16)
    new = old.clone()
    bits_view(new)[::97] += 1
    enc = encode_tensor(new, old)
    bad = bytearray(enc.payload)
    bad[len(bad) // 2] ^= 0x10
    target = old.clone()
    with pytest.raises(DeltaCorrupt, match="digest"):
        apply_(target, EncodedTensor(enc.header, bytes(bad)))
    assert isinstance(DeltaCorrupt("x"), ValueError)
    assert _same_bits(target, old)


def test_verify_catches_a_wrong_base() -> None:
    """Applying a delta to a tensor that is not its base is caught by verify=True."""
    old = torch.randn(1000).to(torch.bfloat16)
    new = old.clone()
    bits_view(new)[::7] += 1
    wrong = old.clone()
    bits_view(wrong)[3] += 5
    with pytest.raises(DeltaCorrupt, match="did not hold the base"):
        apply_(wrong, encode_tensor(new, old), verify=True)


def test_tensor_digest_is_blake3_of_little_endian_bytes() -> None:
    """The digest is BLAKE3-16 of the raw bytes: bf16 1.0 is 0x3F80, stored as b'\\x80\\x3f'."""
    assert blake3.blake3(b"").hexdigest() == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    t = torch.ones(2, dtype=torch.bfloat16)
    assert tensor_digest(t) == blake3.blake3(b"\x80\x3f\x80\x3f").digest(16)


def test_mismatched_shapes_and_dtypes_are_refused() -> None:
    """A base of another shape or dtype, or an unsupported dtype, is a ValueError/TypeError naming it."""
    with pytest.raises(ValueError, match="does not match"):
        encode_tensor(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="float64"):
        encode_tensor(torch.zeros(4, dtype=torch.float64))
    enc = encode_tensor(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        apply_(torch.zeros(4, dtype=torch.float16), enc)


def test_snapshot_and_base_planning() -> None:
    """Snapshots at version 0 and every full_every; joiners and generators past the kept window get full."""
    assert [v for v in range(10) if snapshot_due(v, full_every=4)] == [0, 4, 8]
    kept = range(6, 11)
    assert delta_base(10, None, kept=kept) is None
    assert delta_base(10, 7, kept=kept) == 7
    assert delta_base(10, 3, kept=kept) is None
    assert delta_base(10, 10, kept=kept) is None


@pytest.mark.parametrize(("dtype", "n"), [(torch.bfloat16, 1), (torch.bfloat16, 3), (torch.float16, 300_001),
                                          (torch.float32, 5), (torch.float32, 140_003)])
def test_digest_fused_into_the_change_scan_equals_the_plain_digest(dtype: torch.dtype, n: int) -> None:
    """The tensor digest hashed step by step during the comparison (tails and all) is BLAKE3 of the bytes."""
    gen = torch.Generator().manual_seed(n)
    old = torch.randn(n, generator=gen).to(dtype)
    new = old.clone()
    bits_view(new)[::5] += 1
    enc = encode_tensor(new, old)
    assert enc.header.digest == blake3.blake3(bits_view(new).numpy().tobytes()).digest(16) == tensor_digest(new)
