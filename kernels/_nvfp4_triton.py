"""Triton kernel behind `rlbus.kernels.nvfp4` (imported lazily, on first Triton use).

- Owns: `quantize_kernel` (one program per row) and its E4M3 / E2M1 rounding and code helpers.
- Guarantee: the same codes as the torch reference (divisions round to nearest; the one a*b+c is exact).
- Does not: choose between Triton and torch, or hold the format (kernels/nvfp4.py).

JIT functions are unannotated: Triton reads parameter annotations as its own type hints.
Set TRITON_INTERPRET=1 before this module is first imported to run it on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlbus.kernels._mxfp8_triton import exponent, pow2


@triton.jit
def e4m3_value(y):
    """y in [0, 448] -> y rounded to the nearest E4M3 value (ties to even), as fp32."""
    e = tl.maximum(exponent(y), -6)  # E4M3 subnormals share exponent -6; fp32 subnormals too
    t = y * pow2(3 - e)  # one unit = one E4M3 step
    r = (t + 8388608.0) - 8388608.0
    return r * pow2(e - 3)


@triton.jit
def e4m3_code(q):
    """An exact non-negative E4M3 value -> its 8-bit pattern."""
    normal = ((exponent(q) + 7) << 3) | ((q.to(tl.int32, bitcast=True) >> 20) & 7)
    sub = (q * 512.0).to(tl.int32)
    return tl.where(q >= 0.015625, normal, sub)


@triton.jit
def e2m1_code(q):
    """q (fp32, |q| <= 6 after the clamp) -> 4-bit E2M1 code, sign in bit 3, ties to even."""
    sign = (q.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.minimum(tl.abs(q), 6.0)
    step = tl.maximum(exponent(a), 0) - 1  # subnormal/zero a -> exponent -127 -> step -1
    t = a * pow2(-step)
    r = ((t + 8388608.0) - 8388608.0) * pow2(step)
    idx = (
        (r >= 0.5).to(tl.int32) + (r >= 1.0).to(tl.int32) + (r >= 1.5).to(tl.int32)
        + (r >= 2.0).to(tl.int32) + (r >= 3.0).to(tl.int32) + (r >= 4.0).to(tl.int32)
        + (r >= 6.0).to(tl.int32)
    )
    return idx | (sign << 3)


@triton.jit
def quantize_kernel(
    x_ptr, codes_ptr, bscale_ptr, s_ptr, tensor_amax_ptr, K, n_blocks,
    PER_TENSOR: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program per row: a pass for the row's amax, then a pass that quantises CHUNK blocks of 16 at a
    time, even and odd columns as two (CHUNK, 8) tiles so that each byte's two codes sit side by side.

    Divisions use `div_rn` (IEEE round-to-nearest): on CUDA Triton's `/` on fp32 is an approximate
    division, which would make codes differ from the torch reference. The only a*b+c pattern (a times a
    power of two, plus 2^23) is exact with or without FMA contraction.
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * K
    blk = tl.arange(0, CHUNK)
    pair = tl.arange(0, 8)
    if PER_TENSOR:
        amax = tl.load(tensor_amax_ptr)
    else:
        amax = 0.0
        for c0 in range(0, n_blocks * 16, CHUNK * 16):
            col = c0 + blk[:, None] * 16 + pair[None, :] * 2
            even = tl.load(x_row + col, mask=col < K, other=0.0)
            odd = tl.load(x_row + col + 1, mask=col + 1 < K, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.maximum(tl.abs(even), tl.abs(odd))))
    s = tl.maximum(tl.div_rn(amax, 2688.0), 1.1754943508222875e-38)
    tl.store(s_ptr + row, s)
    s6 = s * 6.0
    half = (K + 1) // 2
    for b0 in range(0, n_blocks, CHUNK):
        b = b0 + blk
        col = b[:, None] * 16 + pair[None, :] * 2
        even = tl.load(x_row + col, mask=col < K, other=0.0)
        odd = tl.load(x_row + col + 1, mask=col + 1 < K, other=0.0)
        bamax = tl.max(tl.maximum(tl.abs(even), tl.abs(odd)), axis=1)
        bval = e4m3_value(tl.minimum(tl.div_rn(bamax, s6), 448.0))
        d = (bval * s)[:, None]
        ok = d > 0.0
        d_safe = tl.where(ok, d, 1.0)
        q_even = tl.where(ok, tl.div_rn(even, d_safe), even * 0.0)
        q_odd = tl.where(ok, tl.div_rn(odd, d_safe), odd * 0.0)
        byte = e2m1_code(q_even) | (e2m1_code(q_odd) << 4)
        byte_idx = b[:, None] * 8 + pair[None, :]
        tl.store(codes_ptr + row * half + byte_idx, byte.to(tl.uint8), mask=byte_idx < half)
        tl.store(bscale_ptr + row * n_blocks + b, e4m3_code(bval).to(tl.uint8), mask=b < n_blocks)
