"""Fused logprob/entropy: torch reference by hand, Triton (TRITON_INTERPRET=1, subprocess) vs torch."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.kernels.logprob import token_logprob, token_logprob_entropy, token_logprob_entropy_torch

_RUN_TRITON = """
import sys, torch
from rlbus.kernels.logprob import _LogprobEntropy, token_logprob_entropy_triton
cases = torch.load(sys.argv[1])
out = [token_logprob_entropy_triton(c["logits"], c["targets"], c["temperature"]) for c in cases]
logits = cases[0]["logits"].clone().requires_grad_()
lp, ent = _LogprobEntropy.apply(logits, cases[0]["targets"], 0.7)
(lp * torch.arange(6.0) + ent * 0.5).sum().backward()
torch.save({"forward": out, "grad": logits.grad}, sys.argv[2])
"""


def _cases() -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 300, generator=g) * 4  # 300: a partial last block
    wide[1, 5] = float("-inf")  # a banned token
    big = torch.randn(3, 5000, generator=g) * 2  # > 4096: several blocks, online rescaling
    big[2, 4700] = 40.0  # the max arrives in a late block
    return [
        {"logits": wide, "targets": torch.randint(0, 300, (6,), generator=g), "temperature": 1.0},
        {
            "logits": wide.to(torch.bfloat16),
            "targets": torch.randint(0, 300, (6,), generator=g),
            "temperature": 0.7,
        },
        {"logits": big, "targets": torch.tensor([0, 4999, 4700]), "temperature": 1.0},
    ]


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the Triton kernel in a subprocess under the interpreter on the shared cases."""
    tmp = tmp_path_factory.mktemp("logprob")
    cases = _cases()
    torch.save(cases, tmp / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run(
        [sys.executable, "-c", _RUN_TRITON, str(tmp / "in.pt"), str(tmp / "out.pt")],
        env=env,
        check=True,
        timeout=240,
    )
    return cases, torch.load(Path(tmp / "out.pt"))


def test_reference_matches_hand_computation() -> None:
    """Uniform logits over V: logprob -ln V, entropy ln V; logits (ln 3, 0): p = 3/4, 1/4."""
    lp, ent = token_logprob_entropy_torch(torch.zeros(2, 8), torch.tensor([0, 7]))
    torch.testing.assert_close(lp, torch.full((2,), -math.log(8)))
    torch.testing.assert_close(ent, torch.full((2,), math.log(8)))
    lp, ent = token_logprob_entropy_torch(torch.tensor([[math.log(3), 0.0]]), torch.tensor([1]))
    torch.testing.assert_close(lp, torch.tensor([math.log(0.25)]))
    torch.testing.assert_close(ent, torch.tensor([-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]))


def test_reference_keeps_leading_dims_and_dispatches_on_cpu() -> None:
    """(B, T, V) logits give (B, T) outputs, and the CPU dispatch is the reference."""
    logits, targets = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 3))
    lp, ent = token_logprob_entropy(logits, targets)
    assert lp.shape == (2, 3)
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0])
    torch.testing.assert_close(ent, token_logprob_entropy_torch(logits, targets)[1])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_alone_equals_the_references_logprob_and_its_gradient(temperature: float,
                                                                     dtype: torch.dtype) -> None:
    """`token_logprob` (the trainer's: no entropy) gives the reference's logprob and the same gradient,
    a banned (-inf) token included; the logits' leading dims are kept."""
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(2, 5, 40, generator=g) * 3).to(dtype)
    base[0, 2, 7] = float("-inf")
    targets = torch.randint(0, 40, (2, 5), generator=g)
    targets[0, 2] = 3
    weights = torch.randn(2, 5, generator=g)
    alone, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    lp = token_logprob(alone, targets, temperature)
    want, _ = token_logprob_entropy_torch(ref, targets, temperature)
    assert lp.shape == (2, 5) and lp.dtype == torch.float32
    assert torch.equal(lp, want)
    (lp * weights).sum().backward()
    (want * weights).sum().backward()
    assert alone.grad is not None and ref.grad is not None
    assert torch.isfinite(alone.grad.float()).all()
    torch.testing.assert_close(alone.grad, ref.grad)


def test_triton_matches_torch_under_interpreter(
    triton_results: tuple[list[dict[str, Any]], dict[str, Any]],
) -> None:
    """Online-softmax kernel equals the materialised reference (fp32 and bf16 logits, temperature)."""
    cases, outputs = triton_results
    for case, (lp, ent) in zip(cases, outputs["forward"], strict=True):
        ref_lp, ref_ent = token_logprob_entropy_torch(case["logits"], case["targets"], case["temperature"])
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-5)


def test_triton_backward_matches_torch_autograd(
    triton_results: tuple[list[dict[str, Any]], dict[str, Any]],
) -> None:
    """The hand-written backward (logprob and entropy terms, a -inf logit) equals autograd's."""
    cases, outputs = triton_results
    logits = cases[0]["logits"].clone().requires_grad_()
    lp, ent = token_logprob_entropy_torch(logits, cases[0]["targets"], 0.7)
    (lp * torch.arange(6.0) + ent * 0.5).sum().backward()
    assert torch.isfinite(outputs["grad"]).all()
    torch.testing.assert_close(outputs["grad"], logits.grad, atol=1e-5, rtol=1e-4)
