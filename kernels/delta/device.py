"""Triton kernel for the hot part of the weight-delta encoder: find changed elements and pack them.

Owns `find_changes`, the device twin of the torch reference `rlbus.kernels.delta.codec.find_changes`
(same signature, same results). Three launches: per-block change counts, per-block stream
compaction (XOR, mask, in-block exclusive scan, scatter of positions and XOR values), then gaps.
Does not own the entropy coding (numpy, CPU) or any decoding. On CPU run it under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from typing import Final

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK: Final = 1024


@triton.jit
def _count_kernel(new_ptr, old_ptr, counts_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """counts[b] = number of i in block b with new[i] != old[i]."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    a = tl.load(new_ptr + offs, mask=inside, other=0)
    b = tl.load(old_ptr + offs, mask=inside, other=0)
    changed = ((a ^ b) != 0).to(tl.int32)
    tl.store(counts_ptr + pid, tl.sum(changed, axis=0))


@triton.jit
def _pack_kernel(new_ptr, old_ptr, starts_ptr, pos_ptr, xor_ptr, n,  # type: ignore[no-untyped-def]
                 BLOCK: tl.constexpr):
    """Scatter the positions and XOR values of block b's changed elements from starts[b], in order."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    a = tl.load(new_ptr + offs, mask=inside, other=0)
    b = tl.load(old_ptr + offs, mask=inside, other=0)
    x = a ^ b
    changed = x != 0
    flag = changed.to(tl.int32)
    local = tl.cumsum(flag, axis=0) - flag  # exclusive scan: rank among the block's changed elements
    dest = tl.load(starts_ptr + pid) + local.to(tl.int64)
    tl.store(pos_ptr + dest, offs, mask=changed)
    tl.store(xor_ptr + dest, x, mask=changed)


@triton.jit
def _gaps_kernel(pos_ptr, gaps_ptr, k, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """gaps[i] = pos[i] - pos[i-1] - 1, with pos[-1] = -1."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < k
    cur = tl.load(pos_ptr + offs, mask=inside, other=0)
    prev = tl.load(pos_ptr + offs - 1, mask=inside & (offs > 0), other=-1)
    tl.store(gaps_ptr + offs, cur - prev - 1, mask=inside)


def find_changes(new_bits: Tensor, old_bits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """new_bits, old_bits (N,) int16/int32 -> positions (K,) int64, gaps (K,) int64, xor (K,).

    Same contract as `rlbus.kernels.delta.codec.find_changes`: ascending positions where the bits differ,
    gaps[i] = pos[i] - pos[i-1] - 1 (pos[-1] = -1), xor = new ^ old there.
    """
    if new_bits.shape != old_bits.shape or new_bits.dtype != old_bits.dtype:
        raise ValueError(f"find_changes needs equal shapes and dtypes, got {tuple(new_bits.shape)}/"
                         f"{new_bits.dtype} and {tuple(old_bits.shape)}/{old_bits.dtype}")
    if new_bits.dtype not in (torch.int16, torch.int32):
        raise TypeError(f"find_changes works on int16/int32 bit patterns, got {new_bits.dtype}")
    a, b = new_bits.reshape(-1).contiguous(), old_bits.reshape(-1).contiguous()
    n = a.numel()
    blocks = triton.cdiv(n, BLOCK)
    counts = torch.empty(max(blocks, 1), dtype=torch.int64, device=a.device)
    if blocks:
        _count_kernel[(blocks,)](a, b, counts, n, BLOCK=BLOCK)
    ends = torch.cumsum(counts[:blocks], 0)
    k = int(ends[-1]) if blocks else 0
    starts = ends - counts[:blocks]
    pos = torch.empty(k, dtype=torch.int64, device=a.device)
    xor = torch.empty(k, dtype=a.dtype, device=a.device)
    gaps = torch.empty(k, dtype=torch.int64, device=a.device)
    if k:
        _pack_kernel[(blocks,)](a, b, starts, pos, xor, n, BLOCK=BLOCK)
        _gaps_kernel[(triton.cdiv(k, BLOCK),)](pos, gaps, k, BLOCK=BLOCK)
    return pos, gaps, xor
