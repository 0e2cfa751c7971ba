"""Quantised linear layers as the reference report trains MoE experts: the forward multiplies NVFP4 or
MXFP8 activations and weights, the backward multiplies MXFP8-quantised gradients and operands.

- Owns: `quant_linear` (one autograd function; the arithmetic there), its plain-torch reference
  `quant_linear_reference` (forward and both gradients written out), and `Precision`.
- Does not: own the number formats (kernels/nvfp4.py, kernels/mxfp8.py) or decide where layers use this
  (model/policies/).
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor

from rlbus.kernels.mxfp8 import mxfp8_dequantize_torch, mxfp8_quantize_torch, mxfp8_roundtrip
from rlbus.kernels.nvfp4 import nvfp4_dequantize_torch, nvfp4_quantize_torch, nvfp4_roundtrip

Precision: TypeAlias = Literal["bf16", "mxfp8", "nvfp4"]
PRECISIONS: tuple[Precision, ...] = ("bf16", "mxfp8", "nvfp4")


def check_precision(precision: str) -> Precision:
    """The precision itself, or ValueError naming the choices."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    return precision  # type: ignore[return-value]


def forward_roundtrip(x: Tensor, precision: Precision) -> Tensor:
    """x (..., K) as the forward's quantiser leaves it, in fp32 (x itself, as fp32, for bf16)."""
    match precision:
        case "nvfp4":
            return nvfp4_roundtrip(x.float())
        case "mxfp8":
            return mxfp8_roundtrip(x.float())
        case "bf16":
            return x.float()


class _QuantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, precision: Precision) -> Tensor:
        ctx.save_for_backward(x, w)
        rows = x.reshape(-1, x.shape[-1])
        y = forward_roundtrip(rows, precision) @ forward_roundtrip(w, precision).T
        return y.view(*x.shape[:-1], w.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1]).float()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = mxfp8_roundtrip(g2) @ mxfp8_roundtrip(w.float().T).T
            dx = dx.view(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            rows = x.reshape(-1, x.shape[-1]).float()
            dw = (mxfp8_roundtrip(g2.T.contiguous()) @ mxfp8_roundtrip(rows.T.contiguous()).T).to(w.dtype)
        return dx, dw, None


def quant_linear(x: Tensor, w: Tensor, precision: Precision) -> Tensor:
    """x (..., K), w (N, K) -> (..., N) in x's dtype.

    Every product is emulated: operands are quantised, dequantised to fp32, then multiplied in fp32
    (no FP4/FP8 tensor-core GEMM). Quantisation is along each product's reduction dim:
        forward   y  = Q(x) @ Q(w)^T              Q along K: NVFP4 per token (row of x / of w), or MXFP8
        backward  dx = M(g) @ M(w^T)^T            M = MXFP8 along N (out features)
                  dw = M(g^T) @ M(x^T)^T          M = MXFP8 along the tokens
    Quantisers pass gradients straight through. `precision="bf16"` is the plain `F.linear`.
    """
    if precision == "bf16":
        return F.linear(x, w)
    return _QuantLinear.apply(x, w, precision)  # type: ignore[no-any-return]


def _mx_torch(t: Tensor) -> Tensor:
    return mxfp8_dequantize_torch(*mxfp8_quantize_torch(t))


def quant_linear_reference(
    x: Tensor, w: Tensor, g: Tensor, precision: Precision
) -> tuple[Tensor, Tensor, Tensor]:
    """Plain torch, no autograd: x (M, K), w (N, K), upstream gradient g (M, N) -> (y, dx, dw) in fp32."""
    x, w, g = x.float(), w.float(), g.float()
    match precision:
        case "nvfp4":
            xq, wq = nvfp4_dequantize_torch(nvfp4_quantize_torch(x)), nvfp4_dequantize_torch(nvfp4_quantize_torch(w))
        case "mxfp8":
            xq, wq = _mx_torch(x), _mx_torch(w)
        case "bf16":
            return x @ w.T, g @ w, g.T @ x
    dx = _mx_torch(g) @ _mx_torch(w.T.contiguous()).T
    dw = _mx_torch(g.T.contiguous()) @ _mx_torch(x.T.contiguous()).T
    return xq @ wq.T, dx, dw
