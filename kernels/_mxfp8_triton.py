"""Triton kernels behind `rlbus.kernels.mxfp8` (imported lazily, on first Triton use).

JIT functions are unannotated: Triton reads parameter annotations as its own type hints.

Set TRITON_INTERPRET=1 before this module is first imported to run them on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pow2(e):
    """2^e exactly for int32 e in [-127, 127], built from bits as the product of two halves."""
    h1 = e >> 1
    h2 = e - h1
    a = ((h1 + 127) << 23).to(tl.float32, bitcast=True)
    b = ((h2 + 127) << 23).to(tl.float32, bitcast=True)
    return a * b


@triton.jit
def exponent(v):
    """floor(log2(v)) for normal positive float32 v (biased exponent bits - 127)."""
    return ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def quantize_kernel(x_ptr, codes_ptr, scales_ptr, n_blocks, GROUPS: tl.constexpr):
    rows = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    cols = tl.arange(0, 32)
    row_ok = rows < n_blocks
    offs = rows.to(tl.int64)[:, None] * 32 + cols[None, :]
    x = tl.load(x_ptr + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    shared = tl.minimum(tl.maximum(exponent(amax) - 8, -127), 127)  # zero/subnormal amax -> -127
    y = x * pow2(-shared)[:, None]
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.abs(y)
    e = tl.maximum(exponent(a), -6)  # E4M3 subnormals share exponent -6
    t = a * pow2(3 - e)  # in [0, 16): one unit = one E4M3 step
    r = (t + 8388608.0) - 8388608.0  # round half to even in one fp32 rounding
    q = r * pow2(e - 3)
    eq = exponent(q)
    normal = ((eq + 7) << 3) | ((q.to(tl.int32, bitcast=True) >> 20) & 7)
    sub = (q * 512.0).to(tl.int32)
    code = tl.where(q >= 0.015625, normal, sub) | (sign << 7)
    tl.store(codes_ptr + offs, code.to(tl.uint8), mask=row_ok[:, None])
    tl.store(scales_ptr + rows, (shared + 127).to(tl.uint8), mask=row_ok)


@triton.jit
def dequantize_kernel(codes_ptr, scales_ptr, out_ptr, n_blocks, GROUPS: tl.constexpr):
    rows = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    cols = tl.arange(0, 32)
    row_ok = rows < n_blocks
    offs = rows.to(tl.int64)[:, None] * 32 + cols[None, :]
    c = tl.load(codes_ptr + offs, mask=row_ok[:, None], other=0).to(tl.int32)
    shared = tl.load(scales_ptr + rows, mask=row_ok, other=127).to(tl.int32) - 127
    e = (c >> 3) & 15
    m = (c & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * pow2(e - 10))
    val = tl.where((c >> 7) == 1, -mag, mag) * pow2(shared)[:, None]
    tl.store(out_ptr + offs, val, mask=row_ok[:, None])
