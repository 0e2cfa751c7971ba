"""Triton kernel behind `rlbus.kernels.logprob` (imported lazily, on first Triton use).

Set TRITON_INTERPRET=1 before this module is first imported to run it on CPU tensors.
JIT functions are unannotated: Triton reads parameter annotations as its own type hints.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def logprob_entropy_kernel(
    logits_ptr, targets_ptr, logprob_ptr, entropy_ptr, V, stride_row, inv_temp, BLOCK_V: tl.constexpr
):
    """One program per row: online logsumexp over BLOCK_V-wide slices of z = logits * inv_temp.

    m = running max, s = sum exp(z - m), t = sum exp(z - m) * z; rescaled by exp(m_old - m_new)
    when the max grows (Milakov & Gimelshein 2018). logprob = z_target - (m + log s),
    entropy = (m + log s) - t / s.
    """
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    t = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new)
        s = s * alpha + tl.sum(p, axis=0)
        t = t * alpha + tl.sum(tl.where(p > 0, p * z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(targets_ptr + row)
    z_t = tl.load(base + target).to(tl.float32) * inv_temp
    tl.store(logprob_ptr + row, z_t - lse)
    tl.store(entropy_ptr + row, lse - t / s)
