"""Quantised linear: the autograd function equals its plain-torch reference bit for bit; the MXFP8
backward's gradients stay close to bf16 ones (relative error per tensor)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlbus.kernels.quantmm import check_precision, quant_linear, quant_linear_reference


def _operands(seed: int, m: int = 13, k: int = 40, n: int = 24) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.1, torch.randn(m, n, generator=g))


def _autograd(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, precision: str) -> tuple[torch.Tensor, ...]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quant_linear(x, w, precision)  # type: ignore[arg-type]
    y.backward(g)
    assert x.grad is not None and w.grad is not None
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("precision", ["nvfp4", "mxfp8", "bf16"])
def test_autograd_equals_reference(precision: str) -> None:
    """Ragged K = 40 and M = 13: forward and both gradients are bit-identical to the reference."""
    x, w, g = _operands(0)
    for got, want in zip(_autograd(x, w, g, precision), quant_linear_reference(x, w, g, precision),  # type: ignore[arg-type]
                         strict=True):
        assert torch.equal(got, want)


def test_quantised_forward_is_not_the_plain_product() -> None:
    """NVFP4 and MXFP8 forwards differ from F.linear, NVFP4 (3 bits) more than MXFP8 (4 bits)."""
    x, w, _ = _operands(1)
    exact = F.linear(x, w)
    err = {p: float((quant_linear(x, w, p) - exact).norm() / exact.norm()) for p in ("nvfp4", "mxfp8")}
    assert 0 < err["mxfp8"] < err["nvfp4"] < 0.25


def test_leading_dims_pass_through() -> None:
    x = torch.randn(2, 3, 40, requires_grad=True)
    w = torch.randn(8, 40, requires_grad=True)
    y = quant_linear(x, w, "nvfp4")
    y.sum().backward()
    assert y.shape == (2, 3, 8) and x.grad is not None and x.grad.shape == x.shape


def test_mxfp8_backward_against_bf16_gradients() -> None:
    """Relative error per tensor ||g_mxfp8 - g_bf16|| / ||g_bf16|| of dx and dw. Measured here (and at
    M, K, N = 512, 256, 768): dx 0.043, dw 0.042 against bf16, while bf16 is 0.003 off fp32; two E4M3
    operands of 3 mantissa bits each account for it."""
    x, w, g = _operands(2, m=64, k=96, n=64)
    _, dx32, dw32 = quant_linear_reference(x, w, g, "bf16")
    xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    F.linear(xb, wb).backward(g.bfloat16())
    assert xb.grad is not None and wb.grad is not None
    _, dx_mx, dw_mx = _autograd(x, w, g, "mxfp8")
    for mx, bf, fp in ((dx_mx, xb.grad.float(), dx32), (dw_mx, wb.grad.float(), dw32)):
        vs_bf16 = float((mx - bf).norm() / bf.norm())
        bf_vs_fp32 = float((bf - fp).norm() / fp.norm())
        assert bf_vs_fp32 < 0.01 < vs_bf16 < 0.06


def test_unknown_precision_is_named() -> None:
    with pytest.raises(ValueError, match="unknown precision 'fp4'; expected one of bf16, mxfp8, nvfp4"):
        check_precision("fp4")
