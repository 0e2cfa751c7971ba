"""Change-finding kernel: Triton (TRITON_INTERPRET=1, in a subprocess) equals the torch reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlbus.kernels.delta.codec import find_changes

_RUN_TRITON = """
import sys, torch
from rlbus.kernels.delta.device import find_changes
cases = torch.load(sys.argv[1])
torch.save([find_changes(new, old) for new, old in cases], sys.argv[2])
"""


def _cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sizes around the 1024-element block, both bit widths, none/some/all elements changed."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for dtype in (torch.int16, torch.int32):
        for n, frac in ((0, 0.0), (1, 1.0), (5, 0.5), (1023, 0.01), (1024, 0.0), (1025, 1.0), (3000, 0.2)):
            old = torch.randint(-(2**15), 2**15, (n,), generator=gen, dtype=torch.int32).to(dtype)
            new = old.clone()
            changed = torch.rand(n, generator=gen) < frac
            noise = torch.randint(1, 2**15, (int(changed.sum()),), generator=gen, dtype=torch.int32)
            new[changed] ^= noise.to(dtype)
            cases.append((new, old))
    return cases


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, list]:
    """Run the Triton kernel under the interpreter in a subprocess (the env var must precede the import)."""
    tmp = tmp_path_factory.mktemp("delta")
    cases = _cases()
    torch.save(cases, tmp / "in.pt")
    subprocess.run([sys.executable, "-c", _RUN_TRITON, str(tmp / "in.pt"), str(tmp / "out.pt")],
                   env={**os.environ, "TRITON_INTERPRET": "1"}, check=True, timeout=240)
    return cases, torch.load(Path(tmp / "out.pt"))


def test_triton_find_changes_equals_torch_reference(triton_results: tuple[list, list]) -> None:
    """Positions, gaps and XOR values agree exactly, dtype included, for every case."""
    cases, results = triton_results
    for (new, old), got in zip(cases, results, strict=True):
        want = find_changes(new, old)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), (new.numel(), new.dtype)


def test_reference_counts_match_the_cases(triton_results: tuple[list, list]) -> None:
    """The cases exercise empty, partial and complete change sets (so the comparison means something)."""
    cases, _ = triton_results
    counts = [int(find_changes(new, old)[0].numel()) for new, old in cases]
    assert 0 in counts and any(0 < c < n.numel() for c, (n, _) in zip(counts, cases, strict=True))
    assert any(c == n.numel() > 1000 for c, (n, _) in zip(counts, cases, strict=True))
