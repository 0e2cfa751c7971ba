"""NVFP4 with per-token scales: E2M1 elements, one FP8 E4M3 scale per 16-element block along the last
dim, and one FP32 scale per row (token) where NVIDIA's NVFP4 has one per tensor.

- Owns: `NVFP4`, the torch references (`nvfp4_quantize_torch`, the formulas there), the Triton path
  (`nvfp4_quantize_triton`, kernel in kernels/_nvfp4_triton.py), dequantisation and the dispatch functions
  (Triton on CUDA, torch otherwise).
- Guarantee: a row's codes depend on that row only (batch-invariant, nothing leaks across tokens).
- Does not: own MXFP8 (kernels/mxfp8.py) or any matmul (kernels/quantmm.py).
"""

from __future__ import annotations

from typing import Any, Final, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK: Final = 16
E2M1_MAX: Final = 6.0
E4M3_MAX: Final = 448.0
TOKEN_DIVISOR: Final = E2M1_MAX * E4M3_MAX
SCALE_FLOOR: Final = 2.0**-126  # smallest normal fp32: keeps s_r > 0 for all-zero rows
E2M1_VALUES: Final = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

Scale = Literal["token", "tensor"]


class NVFP4(NamedTuple):
    """A quantised tensor of logical shape (..., k)."""

    codes: Tensor
    """uint8 (..., ceil(k/2)): two E2M1 codes (sign bit 3) per byte, element 2i in the low nibble."""
    block_scales: Tensor
    """uint8 (..., ceil(k/16)): E4M3 (`e4m3fn`) bit patterns."""
    token_scales: Tensor
    """float32 (...,): s_r per row (all equal under scale="tensor")."""
    k: int


def _rows(x: Tensor) -> Tensor:
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"NVFP4 needs a non-empty last dim, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"NVFP4 quantises floating tensors, got {x.dtype}")
    return x.reshape(-1, x.shape[-1]).float()


def _check_scale(scale: str) -> None:
    if scale not in ("token", "tensor"):
        raise ValueError(f"unknown NVFP4 scale {scale!r}; expected 'token' or 'tensor'")


def _e2m1_index(a: Tensor) -> Tensor:
    """|q| in [0, 6] -> index 0..7 of the nearest E2M1 value, ties to the even code."""
    _, exp = torch.frexp(a)  # a = m * 2^exp, m in [0.5, 1); exp = 0 for a = 0
    step = (exp - 1).clamp_min(0) - 1  # log2 of the grid step around a: 0.5 below 2, then 1, then 2
    r = torch.ldexp(torch.round(torch.ldexp(a, -step)), step)
    return sum((r >= v).to(torch.uint8) for v in E2M1_VALUES[1:])  # type: ignore[return-value]


def nvfp4_quantize_torch(x: Tensor, scale: Scale = "token") -> NVFP4:
    """x (..., K) finite float -> NVFP4.

    Per row r and block b (all fp32, IEEE round-to-nearest-even, divisions correctly rounded):
        s_r = max(amax_r / 2688, 2^-126)                 2688 = 6 (E2M1 max) * 448 (E4M3 max)
        S_rb = e4m3(min(amax_rb / (s_r * 6), 448))       stored as E4M3 bits
        d_rb = S_rb * s_r
        code = e2m1(clamp(x / d_rb, -6, 6))              0 (sign kept) where d_rb == 0
        x' = e2m1_value(code) * d_rb                     dequantised
    A row's codes depend on that row only (batch-invariant, nothing leaks across tokens);
    `scale="tensor"` uses one s for the whole tensor instead (NVIDIA's layout), the counter-case.
    The last dim may be ragged: a partial last block is padded with zeros. Codes pack two per byte,
    element 2i in the low nibble. Inputs must be finite: a row holding inf or NaN gets meaningless codes
    and scales (its s_r is inf/NaN); under the per-token scale no other row is affected.
    """
    _check_scale(scale)
    rows = _rows(x)
    M, K = rows.shape
    nb = -(-K // BLOCK)
    blocks = F.pad(rows, (0, nb * BLOCK - K)).view(M, nb, BLOCK)
    amax = rows.abs().amax(-1) if scale == "token" else rows.abs().amax().expand(M)
    s = torch.clamp(amax / TOKEN_DIVISOR, min=SCALE_FLOOR)
    bscale = (blocks.abs().amax(-1) / (s * E2M1_MAX)[:, None]).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    d = bscale.float() * s[:, None]
    q = torch.where(d[..., None] > 0, blocks / d[..., None], blocks * 0.0)
    idx = _e2m1_index(q.abs().clamp(max=E2M1_MAX))
    nib = (idx | (torch.signbit(q).to(torch.uint8) << 3)).view(M, nb * BLOCK // 2, 2)
    packed = (nib[..., 0] | (nib[..., 1] << 4))[:, : -(-K // 2)]
    lead = x.shape[:-1]
    return NVFP4(
        packed.reshape(*lead, -1), bscale.view(torch.uint8).reshape(*lead, nb), s.reshape(lead), K
    )


def _check_nvfp4(q: NVFP4) -> None:
    lead = q.token_scales.shape
    want = ((*lead, -(-q.k // 2)), (*lead, -(-q.k // BLOCK)))
    if q.codes.dtype != torch.uint8 or q.block_scales.dtype != torch.uint8:
        raise TypeError(f"codes and block_scales must be uint8, got {q.codes.dtype}, {q.block_scales.dtype}")
    if q.token_scales.dtype != torch.float32:
        raise TypeError(f"token_scales must be float32, got {q.token_scales.dtype}")
    if (tuple(q.codes.shape), tuple(q.block_scales.shape)) != want:
        raise ValueError(
            f"codes {tuple(q.codes.shape)} / block_scales {tuple(q.block_scales.shape)} do not fit "
            f"token_scales {tuple(lead)} and k={q.k}; expected {want[0]} / {want[1]}"
        )


def nvfp4_dequantize_torch(q: NVFP4, dtype: torch.dtype = torch.float32) -> Tensor:
    """NVFP4 -> x' (..., k): e2m1_value(code) * (e4m3(block_scale) * token_scale)."""
    _check_nvfp4(q)
    lead = q.token_scales.shape
    packed = q.codes.reshape(-1, q.codes.shape[-1])
    nib = torch.stack((packed & 15, packed >> 4), dim=-1).view(packed.shape[0], -1)
    table = torch.tensor(E2M1_VALUES, device=packed.device)
    vals = table[(nib & 7).long()]
    vals = torch.where((nib >> 3) == 1, -vals, vals)
    nb = q.block_scales.shape[-1]
    d = q.block_scales.reshape(-1, nb).view(torch.float8_e4m3fn).float() * q.token_scales.reshape(-1, 1)
    vals = F.pad(vals, (0, nb * BLOCK - vals.shape[-1])).view(-1, nb, BLOCK)
    return (vals * d[..., None]).view(-1, nb * BLOCK)[:, : q.k].reshape(*lead, q.k).to(dtype)


_CHUNK: Final = 4  # blocks per Triton loop step


def _nvfp4_triton() -> Any:
    from rlbus.kernels import _nvfp4_triton as module  # imports triton; reads TRITON_INTERPRET

    return module


def nvfp4_quantize_triton(x: Tensor, scale: Scale = "token") -> NVFP4:
    """Same contract as `nvfp4_quantize_torch`, via a Triton kernel (one program per row)."""
    _check_scale(scale)
    rows = _rows(x).contiguous()
    M, K = rows.shape
    nb = -(-K // BLOCK)
    codes = torch.empty(M, -(-K // 2), dtype=torch.uint8, device=x.device)
    bscales = torch.empty(M, nb, dtype=torch.uint8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    tensor_amax = rows.abs().amax().reshape(1) if scale == "tensor" and M else s.new_zeros(1)
    if M:
        _nvfp4_triton().quantize_kernel[(M,)](
            rows, codes, bscales, s, tensor_amax, K, nb, PER_TENSOR=scale == "tensor", CHUNK=_CHUNK
        )
    lead = x.shape[:-1]
    return NVFP4(codes.reshape(*lead, -1), bscales.reshape(*lead, nb), s.reshape(lead), K)


def nvfp4_quantize(x: Tensor, scale: Scale = "token") -> NVFP4:
    """Dispatch: Triton on CUDA, torch reference otherwise."""
    return nvfp4_quantize_triton(x, scale) if x.is_cuda else nvfp4_quantize_torch(x, scale)


def nvfp4_dequantize(q: NVFP4, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantise (plain torch on every device: a gather and two multiplies)."""
    return nvfp4_dequantize_torch(q, dtype)


def nvfp4_roundtrip(x: Tensor, scale: Scale = "token") -> Tensor:
    """dequantize(quantize(x)) in x's dtype: the values an NVFP4 operand actually holds."""
    return nvfp4_dequantize(nvfp4_quantize(x, scale), dtype=x.dtype)
