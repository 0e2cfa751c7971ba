"""NVFP4 (per-token scale): torch reference by hand, Triton (TRITON_INTERPRET=1, subprocess)
bit-equal to torch on ragged rows, zeros, subnormals and the largest finite values."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rlbus.kernels.nvfp4 import (
    E2M1_VALUES,
    NVFP4,
    nvfp4_dequantize,
    nvfp4_quantize,
    nvfp4_quantize_torch,
    nvfp4_roundtrip,
)

_RUN_TRITON = """
import sys, torch
from rlbus.kernels.nvfp4 import nvfp4_quantize_triton
cases = torch.load(sys.argv[1])
out = {}
for name, x in cases.items():
    for scale in ("token", "tensor"):
        q = nvfp4_quantize_triton(x, scale)
        out[f"{name}/{scale}"] = (q.codes, q.block_scales, q.token_scales)
torch.save(out, sys.argv[2])
"""

FMAX = torch.finfo(torch.float32).max


def _cases() -> dict[str, torch.Tensor]:
    """Ragged last dims (1, 7, 37, 50), every E2M1 grid value and midpoint (ties) under a block
    scale of exactly 1, all-zero and -0 rows, fp32 subnormals, the largest finite values."""
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor(E2M1_VALUES)
    mids = (grid[1:] + grid[:-1]) / 2
    # Row amax 2688 -> s = 1. Blocks 0, 1: amax 6 -> block scale 1, so x/d is x itself; block 2
    # holds the row amax (block scale 448); block 3 is the midpoints again under block scale 448.
    b0 = torch.cat([grid, mids, torch.zeros(1)])
    b3 = torch.cat([mids * 448, torch.tensor([6.0 * 448]), torch.zeros(8)])
    ties = torch.cat([b0, -b0, torch.tensor([2688.0]), torch.zeros(15), b3]).view(1, 64)
    wild = torch.randn(6, 37, generator=g) * 10.0 ** torch.randint(-30, 30, (6, 1), generator=g).float()
    special = torch.zeros(6, 50)
    special[1, 3] = -0.0
    special[2, :20] = torch.linspace(1e-45, 1e-38, 20)  # subnormal row
    special[3] = FMAX * torch.linspace(-1, 1, 50)
    special[4, 0], special[4, 17], special[4, 49] = FMAX, -FMAX, 1.0
    special[5] = torch.randn(50, generator=g) * 1e-3
    special[5, 40] = 5e3  # one block dwarfs the rest: the small blocks' E4M3 scales go subnormal or 0
    return {
        "ties": ties,
        "wild": wild,
        "special": special,
        "k1": torch.tensor([[0.3], [-7.0], [0.0]]),
        "k7_3d": torch.randn(2, 3, 7, generator=g),
        "rows": torch.randn(70, 16, generator=g),
    }


@pytest.fixture(scope="module")
def triton_out(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.Tensor, ...]]:
    tmp = tmp_path_factory.mktemp("nvfp4")
    torch.save(_cases(), tmp / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run(
        [sys.executable, "-c", _RUN_TRITON, str(tmp / "in.pt"), str(tmp / "out.pt")],
        env=env, check=True, timeout=300,
    )
    return torch.load(tmp / "out.pt")


@pytest.mark.parametrize("scale", ["token", "tensor"])
def test_triton_is_bit_identical_to_torch(
    triton_out: dict[str, tuple[torch.Tensor, ...]], scale: str
) -> None:
    """Codes, E4M3 block scales and fp32 token scales equal the reference bit for bit."""
    for name, x in _cases().items():
        ref = nvfp4_quantize_torch(x, scale)  # type: ignore[arg-type]
        codes, bscales, s = triton_out[f"{name}/{scale}"]
        assert torch.equal(codes, ref.codes), name
        assert torch.equal(bscales, ref.block_scales), name
        assert torch.equal(s.view(torch.int32), ref.token_scales.view(torch.int32)), name


def test_reference_by_hand() -> None:
    """amax 2688 -> s = 1; block amax 6 -> block scale 1.0 (E4M3 0x38); values are E2M1 themselves.
    Ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4."""
    x = torch.zeros(32)
    x[:9] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.5])
    x[16] = 2688.0
    q = nvfp4_quantize_torch(x)
    assert q.token_scales.item() == 1.0
    assert q.block_scales.tolist() == [0x38, 0x7E]  # 1.0 and 448
    nib = [(b >> sh) & 15 for b in q.codes[:5].tolist() for sh in (0, 4)]
    assert nib[:9] == [0b0111, 0b0000, 0b0010, 0b0010, 0b0100, 0b0100, 0b0110, 0b0110, 0b1001]
    back = nvfp4_dequantize(q)
    assert back[:9].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5]
    assert back[16].item() == 2688.0


def test_ragged_shapes_and_zero_rows() -> None:
    """K = 37 -> 19 code bytes and 3 block scales per row; an all-zero row decodes to zeros."""
    x = torch.randn(2, 3, 37)
    x[1, 2] = 0
    q = nvfp4_quantize(x)
    assert q.codes.shape == (2, 3, 19) and q.block_scales.shape == (2, 3, 3) and q.token_scales.shape == (2, 3)
    back = nvfp4_roundtrip(x)
    assert back.shape == x.shape and torch.equal(back[1, 2], torch.zeros(37))
    err = (back - x).abs().amax(-1)
    assert bool((err <= x.abs().amax(-1) / 4).all())  # half the widest E2M1 gap (2) over 6, plus scale rounding


def test_largest_finite_values_stay_finite() -> None:
    """Rows holding +-FLT_MAX quantise and dequantise without overflow; FLT_MAX comes back exactly."""
    x = torch.tensor([[FMAX, -FMAX, 1.0, 0.0] * 4])
    back = nvfp4_roundtrip(x)
    assert bool(torch.isfinite(back).all())
    assert back[0, 0].item() == FMAX and back[0, 1].item() == -FMAX


def test_non_finite_row_is_confined_to_itself() -> None:
    """Out of contract (inf/NaN) a row's codes are meaningless, but other rows keep their codes."""
    x = torch.randn(4, 40)
    clean = nvfp4_quantize_torch(x)
    x[2, 5], x[3, 9] = float("inf"), float("nan")
    dirty = nvfp4_quantize_torch(x)
    assert torch.equal(dirty.codes[:2], clean.codes[:2])
    assert torch.equal(dirty.block_scales[:2], clean.block_scales[:2])


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="non-empty last dim"):
        nvfp4_quantize(torch.zeros(3, 0))
    with pytest.raises(TypeError, match="floating"):
        nvfp4_quantize(torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="unknown NVFP4 scale 'block'"):
        nvfp4_quantize(torch.zeros(3, 4), "block")  # type: ignore[arg-type]
    q = nvfp4_quantize(torch.ones(3, 20))
    with pytest.raises(ValueError, match="do not fit"):
        nvfp4_dequantize(NVFP4(q.codes, q.block_scales, q.token_scales, 40))
