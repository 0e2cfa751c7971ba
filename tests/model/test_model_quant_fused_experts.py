"""Numerics of a Qwen3-MoE through rlbus's HF policy: `set_numerics` puts its fused experts (3-D parameters, not
Linear layers) on `quant_linear`, and `router_replay_threshold` checks its replayed routing as the built-in MoE's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.hf import build_family, prompts, random_state

from rlbus.model.policies.hf import HFPolicy
from rlbus.model.policies.quant import _fused_experts_forward, set_numerics


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> HFPolicy:
    root: Path = tmp_path_factory.mktemp("models")
    policy = HFPolicy.load(build_family(root, "qwen3_moe"), dtype=torch.float32)
    policy.load_tensors_(random_state(policy, seed=1))
    return policy


def _experts(policy: HFPolicy) -> list[torch.nn.Module]:
    return [m.experts for m in policy.module.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]


def test_fused_forward_at_bf16_is_transformers_eager_forward(policy: HFPolicy) -> None:
    """The quantised forward's loop, run at the plain precision, computes what transformers' own forward does."""
    experts = _experts(policy)[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, experts.hidden_dim, generator=g)
    index = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g)
    with torch.no_grad():
        ours = _fused_experts_forward(SimpleNamespace(**{**vars(experts), **dict(experts.named_parameters()),
                                                         "act_fn": experts.act_fn, "precision": "bf16"}),
                                      x, index, weights)
        theirs = experts(x, index, weights)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_set_numerics_quantises_fused_experts_and_back(policy: HFPolicy) -> None:
    """nvfp4 on the experts changes the logits and counts two layers per expert; gradients reach the 3-D expert
    weights; bf16 restores the plain forward bit for bit; parameter names stay."""
    net = policy.clone()
    ids = torch.tensor([prompts(net)[1]])
    names = [n for n, _ in net.module.named_parameters()]
    with torch.no_grad():
        plain = net(ids).logits
    n_experts = int(net.config.num_experts)
    assert set_numerics(net.module, "nvfp4") == 2 * n_experts * len(_experts(net))
    assert [n for n, _ in net.module.named_parameters()] == names
    quantised = net(ids).logits
    assert not torch.equal(quantised, plain)
    quantised.float().logsumexp(-1).sum().backward()
    assert all(bool(e.gate_up_proj.grad.abs().sum() > 0) and bool(e.down_proj.grad.abs().sum() > 0)
               for e in _experts(net))
    assert set_numerics(net.module, "bf16") == 0
    with torch.no_grad():
        assert torch.equal(net(ids).logits, plain)


def test_replay_threshold_replaces_implausible_experts(policy: HFPolicy) -> None:
    """Replaying each token's two least likely experts: kept as given at threshold 0, replaced by the router's own
    choice at threshold 1 (the used routing, which the output reports, is then the natural one)."""
    net = policy.clone()
    ids = torch.tensor([prompts(net)[1]])
    with torch.no_grad():
        natural = net(ids).routing
        assert natural is not None
        forced = _least_likely(net, ids)
        assert not bool((forced == natural.sort(-1).values).all())
        set_numerics(net.module, "bf16", replay_threshold=0.0)
        assert torch.equal(net(ids, routing=forced).routing, forced)
        set_numerics(net.module, "bf16", replay_threshold=1.0)
        used = net(ids, routing=forced).routing
    assert used is not None
    assert torch.equal(used.sort(-1).values, natural.sort(-1).values)


def _least_likely(net: HFPolicy, ids: torch.Tensor) -> torch.Tensor:
    """(1, T, n_moe_layers, 2): each token's two least likely experts per sparse layer, from the natural forward's
    router logits."""
    logits: list[torch.Tensor] = []
    gates = [m.gate for m in net.module.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
    hooks = [g.register_forward_hook(lambda _m, _a, out: logits.append(out[0])) for g in gates]
    try:
        net(ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([lg.topk(2, dim=-1, largest=False).indices for lg in logits], dim=1)[None]
