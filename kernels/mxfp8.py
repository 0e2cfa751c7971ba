"""MXFP8 block quantisation (OCP Microscaling spec v1.0): 32-element blocks along the last dim,
one E8M0 power-of-two scale per block, FP8 E4M3 elements. A ragged last dim is padded with zeros
to whole blocks (the kernels see whole blocks), and the padding is cut off again.

Owns the Triton quantise/dequantise kernels, their torch references (same signatures) and the
dispatch functions (Triton on CUDA, torch otherwise). Inputs must be finite. Codes are uint8:
elements are E4M3 (OCP `e4m3fn`) bit patterns, scales are the biased exponent e + 127.
"""

from __future__ import annotations

from typing import Any, Final

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK: Final = 32
E4M3_MAX: Final = 448.0
E4M3_EMAX: Final = 8  # exponent of the largest normal E4M3 value, 448 = 1.75 * 2^8


def _blocks(x: Tensor) -> Tensor:
    """x (..., K) -> (rows * ceil(K/32), 32), the last block of each row padded with zeros."""
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"MXFP8 needs a non-empty last dim, got shape {tuple(x.shape)}")
    K = x.shape[-1]
    return F.pad(x.reshape(-1, K), (0, -K % BLOCK)).reshape(-1, BLOCK)


def _unblock(blocks: Tensor, shape: torch.Size) -> Tensor:
    """Inverse of `_blocks`: drop the padding, restore shape (..., K)."""
    K = shape[-1]
    return blocks.reshape(-1, K + (-K % BLOCK))[:, :K].reshape(shape)


def _scale_shape(shape: torch.Size) -> tuple[int, ...]:
    return (*shape[:-1], -(-shape[-1] // BLOCK))


def mxfp8_quantize_torch(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., K) float -> (codes uint8 (..., K), scales uint8 (..., ceil(K/32))).

    Per block: shared = clamp(floor(log2(max|x|)) - 8, -127, 127) (-127 for an all-zero block),
    element = e4m3(clamp(x / 2^shared, -448, 448)) rounded to nearest even, scale = shared + 127.
    """
    blocks = _blocks(x).float()
    amax = blocks.abs().amax(dim=-1)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1)
    shared = torch.where(amax > 0, exp - 1 - E4M3_EMAX, torch.full_like(exp, -127)).clamp(-127, 127)
    scaled = blocks * torch.pow(2.0, -shared.float())[:, None]
    codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return _unblock(codes, x.shape), (shared + 127).to(torch.uint8).view(_scale_shape(x.shape))


def mxfp8_dequantize_torch(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes uint8 (..., K), scales uint8 (..., ceil(K/32)) -> x (..., K): e4m3(code) * 2^(scale - 127)."""
    _check_codes(codes, scales)
    values = _blocks(codes).view(torch.float8_e4m3fn).float()
    factor = torch.pow(2.0, scales.reshape(-1).float() - 127)[:, None]
    return _unblock(values * factor, codes.shape).to(dtype)


def _check_codes(codes: Tensor, scales: Tensor) -> None:
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    if codes.dim() == 0 or tuple(scales.shape) != _scale_shape(codes.shape):
        raise ValueError(f"scales shape {tuple(scales.shape)} does not fit codes {tuple(codes.shape)}")


_GROUPS: Final = 16


def _mxfp8_triton() -> Any:
    from rlbus.kernels import _mxfp8_triton as module  # imports triton; reads TRITON_INTERPRET

    return module


def mxfp8_quantize_triton(x: Tensor) -> tuple[Tensor, Tensor]:
    """Same contract as `mxfp8_quantize_torch`, via a Triton kernel."""
    import triton

    blocks = _blocks(x).float().contiguous()
    n = blocks.shape[0]
    codes = torch.empty(blocks.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, dtype=torch.uint8, device=x.device)
    if n:
        grid = (triton.cdiv(n, _GROUPS),)
        _mxfp8_triton().quantize_kernel[grid](blocks, codes, scales, n, GROUPS=_GROUPS)
    return _unblock(codes, x.shape), scales.view(_scale_shape(x.shape))


def mxfp8_dequantize_triton(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Same contract as `mxfp8_dequantize_torch`, via a Triton kernel."""
    import triton

    _check_codes(codes, scales)
    blocks = _blocks(codes).contiguous()
    n = blocks.shape[0]
    out = torch.empty(blocks.shape, dtype=torch.float32, device=codes.device)
    if n:
        grid = (triton.cdiv(n, _GROUPS),)
        _mxfp8_triton().dequantize_kernel[grid](
            blocks, scales.contiguous().reshape(-1), out, n, GROUPS=_GROUPS
        )
    return _unblock(out, codes.shape).to(dtype)


def mxfp8_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dispatch: Triton on CUDA, torch reference otherwise."""
    return mxfp8_quantize_triton(x) if x.is_cuda else mxfp8_quantize_torch(x)


def mxfp8_dequantize(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dispatch: Triton on CUDA, torch reference otherwise."""
    if codes.is_cuda:
        return mxfp8_dequantize_triton(codes, scales, dtype)
    return mxfp8_dequantize_torch(codes, scales, dtype)


def mxfp8_roundtrip(x: Tensor) -> Tensor:
    """dequantize(quantize(x)) in x's dtype: the values an MXFP8 weight actually holds."""
    return mxfp8_dequantize(*mxfp8_quantize(x), dtype=x.dtype)
