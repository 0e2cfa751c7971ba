"""MXFP8: torch reference by hand, Triton (TRITON_INTERPRET=1, subprocess) bit-equal to torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rlbus.kernels.mxfp8 import (
    mxfp8_dequantize,
    mxfp8_dequantize_torch,
    mxfp8_quantize,
    mxfp8_quantize_torch,
    mxfp8_roundtrip,
)

_RUN_TRITON = """
import sys, torch
from rlbus.kernels.mxfp8 import mxfp8_dequantize_triton, mxfp8_quantize_triton
data = torch.load(sys.argv[1])
q = mxfp8_quantize_triton(data["x"])
d = mxfp8_dequantize_triton(data["codes"], data["scales"])
r = mxfp8_quantize_triton(data["ragged"])
rd = mxfp8_dequantize_triton(*r)
torch.save({"codes": q[0], "scales": q[1], "deq": d, "ragged": r, "ragged_deq": rd}, sys.argv[2])
"""


def _grid() -> torch.Tensor:
    """Every finite non-negative E4M3 value."""
    values = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values)]


def _inputs() -> torch.Tensor:
    """Blocks with amax 300 (scale 2^0): every E4M3 value, every midpoint (ties), both signs,
    then the same blocks scaled by 2^-70 and 2^50, random data over 40 decades, zeros, -0."""
    grid = _grid()
    mids = (grid[1:] + grid[:-1]) / 2
    body = torch.cat([grid, mids, -grid, -mids, torch.zeros(31 - (4 * grid.numel() - 2) % 31)])
    blocks = torch.cat([torch.full((body.numel() // 31, 1), 300.0), body.view(-1, 31)], dim=1)
    g = torch.Generator().manual_seed(0)
    wild = torch.randn(16, 32, generator=g) * 10.0 ** torch.randint(-20, 20, (16, 1), generator=g).float()
    special = torch.zeros(2, 32)
    special[0, 3] = -0.0
    special[1, 7] = 1e-39  # a subnormal-only block
    return torch.cat([blocks, blocks * 2.0**-70, blocks * 2.0**50, wild, special])


def _ragged() -> torch.Tensor:
    """(2, 3, 45): a partial second block per row, with a zero row, a subnormal and +-FLT_MAX."""
    x = torch.randn(2, 3, 45, generator=torch.Generator().manual_seed(1))
    x[0, 1] = 0
    x[1, 0, 40] = 1e-40
    x[1, 2, 33], x[1, 2, 44] = torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max
    return x


@pytest.fixture(scope="module")
def triton_results(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run the Triton kernels in a subprocess under the interpreter."""
    tmp = tmp_path_factory.mktemp("mxfp8")
    x = _inputs()
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # 0x7F / 0xFF are NaN in E4M3
    codes = codes.view(8, 32)
    data = {
        "x": x,
        "codes": codes,
        "scales": torch.tensor([[127], [0], [1], [120], [130], [127], [200], [60]], dtype=torch.uint8),
        "ragged": _ragged(),
    }
    torch.save(data, tmp / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run(
        [sys.executable, "-c", _RUN_TRITON, str(tmp / "in.pt"), str(tmp / "out.pt")],
        env=env,
        check=True,
        timeout=240,
    )
    return data, torch.load(tmp / "out.pt")


def test_reference_quantizes_by_hand() -> None:
    """Block amax 1 -> scale 2^-8 (code 119); 1 -> 256 = 0x78, 0.5 -> 0x70, -0.25 -> 0xE8, 2^-17 -> 0x01."""
    x = torch.zeros(32)
    x[:4] = torch.tensor([1.0, 0.5, -0.25, 2.0**-17])
    codes, scales = mxfp8_quantize_torch(x)
    assert scales.tolist() == [119]
    assert codes[:5].tolist() == [0x78, 0x70, 0xE8, 0x01, 0x00]
    torch.testing.assert_close(mxfp8_dequantize_torch(codes, scales), x)


def test_reference_rounds_and_saturates() -> None:
    """amax 3.9 -> scale 2^-7: 3.9*128 = 499.2 saturates to 448 (0x7E); 3*128 = 384 is 0x7C."""
    x = torch.zeros(32)
    x[:3] = torch.tensor([3.9, 3.0, 1.0 + 1 / 16])  # 136 sits between 128 and 144: ties to 128
    codes, scales = mxfp8_quantize_torch(x)
    assert scales.tolist() == [120]
    assert codes[:3].tolist() == [0x7E, 0x7C, 0x70]
    assert mxfp8_dequantize(codes, scales)[:3].tolist() == [3.5, 3.0, 1.0]


def test_zero_block_and_shapes() -> None:
    """An all-zero block gets scale code 0 and decodes to zeros; a ragged K is padded to whole
    blocks (33 -> 2 scales per row) and the padding cut off again; an empty last dim is refused."""
    _, scales = mxfp8_quantize(torch.zeros(2, 64))
    assert scales.shape == (2, 2) and scales.unique().tolist() == [0]
    assert torch.equal(mxfp8_roundtrip(torch.zeros(2, 64)), torch.zeros(2, 64))
    x = torch.zeros(3, 33)
    x[:, 32] = 1.0
    codes, scales = mxfp8_quantize(x)
    assert codes.shape == (3, 33) and scales.shape == (3, 2)
    assert torch.equal(mxfp8_dequantize(codes, scales), x)
    with pytest.raises(ValueError, match="non-empty last dim"):
        mxfp8_quantize(torch.zeros(3, 0))


def test_roundtrip_error_is_bounded() -> None:
    """Relative to its block max, a round-tripped value is off by at most 1/8 (saturation bound)."""
    x = torch.randn(16, 128)
    err = (mxfp8_roundtrip(x) - x).abs().view(16, 4, 32)
    assert bool((err <= x.abs().view(16, 4, 32).amax(-1, keepdim=True) / 8 + 1e-12).all())


def test_triton_quantize_is_bit_identical_to_torch(
    triton_results: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    """Codes and scales from the Triton kernel equal the torch reference bit for bit (ties, -0 too)."""
    data, out = triton_results
    codes, scales = mxfp8_quantize_torch(data["x"])
    assert torch.equal(out["codes"], codes)
    assert torch.equal(out["scales"], scales)


def test_triton_dequantize_matches_torch_on_every_code(
    triton_results: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    """All 254 finite codes under eight scales decode identically."""
    data, out = triton_results
    assert torch.equal(out["deq"], mxfp8_dequantize_torch(data["codes"], data["scales"]))


def test_triton_matches_torch_on_ragged_rows(
    triton_results: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    """K = 45 (one whole and one partial block per row): codes, scales and dequantised values equal."""
    data, out = triton_results
    codes, scales = mxfp8_quantize_torch(data["ragged"])
    assert torch.equal(out["ragged"][0], codes) and torch.equal(out["ragged"][1], scales)
    assert torch.equal(out["ragged_deq"], mxfp8_dequantize_torch(codes, scales))
