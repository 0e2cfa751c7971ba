"""Policy numerics: NVFP4/MXFP8 expert layers through `set_numerics`, and router replay with its
plausibility threshold on the built-in MoE transformer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlbus.kernels.quantmm import quant_linear_reference
from rlbus.model.policies.quant import QuantLinear, set_numerics
from rlbus.model.policies.transformer import ModelConfig, MoE, Transformer


def _model(**overrides: object) -> Transformer:
    torch.manual_seed(0)
    base: dict[str, object] = {"vocab_size": 64, "moe_layers": (0, 1), "n_experts": 4, "top_k": 2}
    return Transformer(ModelConfig.tiny(**(base | overrides)))


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(1))


def _quantised(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]


@pytest.mark.parametrize("precision", ["nvfp4", "mxfp8"])
def test_expert_layers_run_quantised_and_train(precision: str) -> None:
    """Only the 2 x 4 x 3 expert Linears switch; logits move a little; every expert weight, the router
    and the embedding get finite gradients; switching back to bf16 restores the exact logits."""
    model = _model()
    tokens = _tokens()
    exact = model(tokens).logits.detach()
    params_before = [id(p) for p in model.parameters()]
    assert set_numerics(model, precision) == 24
    assert all(".experts." in n for n in _quantised(model))
    assert [id(p) for p in model.parameters()] == params_before
    out = model(tokens).logits
    drift = float((out - exact).detach().abs().max())
    assert 0 < drift < 0.5
    out.logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        if ".experts." in name or "router" in name or name == "embed.weight":
            assert p.grad is not None and bool(torch.isfinite(p.grad).all()) and bool(p.grad.abs().sum() > 0), name
    set_numerics(model, "bf16")
    assert not _quantised(model)
    assert torch.equal(model(tokens).logits.detach(), exact)


def test_quantised_expert_equals_the_reference_product() -> None:
    """One expert's down projection under NVFP4 is the reference's Q(x) @ Q(w)^T, bit for bit."""
    model = _model()
    set_numerics(model, "nvfp4")
    down = model.blocks[0].ffn.experts[1].down  # type: ignore[index, union-attr]
    x = torch.randn(9, down.in_features)
    want, _, _ = quant_linear_reference(x, down.weight.detach(), torch.zeros(9, down.out_features), "nvfp4")
    assert torch.equal(down(x).detach(), want)


def test_scope_all_quantises_every_linear_but_router_and_head() -> None:
    """A dense model has no experts: scope 'experts' quantises nothing, scope 'all' every block Linear."""
    dense = _model(moe_layers=(), tie_embeddings=False)
    assert set_numerics(dense, "nvfp4", "experts") == 0
    assert set_numerics(dense, "nvfp4", "all") == 2 * 5  # qkv, proj, gate, up, down per block
    assert "lm_head" not in _quantised(dense)
    moe = _model()
    set_numerics(moe, "mxfp8", "all")
    assert not any(n.endswith("router") for n in _quantised(moe))


def _moe_layer() -> tuple[MoE, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    cfg = ModelConfig.tiny(moe_layers=(0,), n_experts=6, top_k=2)
    moe = MoE(cfg)
    x = torch.randn(2, 7, cfg.d_model) * 4
    probs = torch.softmax(moe.router(x).float(), -1)
    return moe, x, probs


def test_replay_threshold_zero_replays_as_recorded() -> None:
    """Threshold 0 (the default) uses the forced experts whatever their router probability."""
    moe, x, probs = _moe_layer()
    worst = probs.topk(2, dim=-1, largest=False).indices
    _, used = moe(x, worst)
    assert torch.equal(used, worst)


def test_replay_threshold_replaces_implausible_experts() -> None:
    """Slot 1 replays each token's least likely expert: every such slot whose probability is below
    t times the k-th best gets the token's best own expert not already chosen; slot 0 (the own
    top-1) stays. Replaying the layer's own routing replaces nothing even at t = 1."""
    moe, x, probs = _moe_layer()
    own_p, own = probs.topk(2, dim=-1)
    forced = torch.stack([own[..., 0], probs.argmin(-1)], dim=-1)
    moe.replay_threshold = 0.5
    _, used = moe(x, forced)
    implausible = probs.gather(-1, forced[..., 1:]).squeeze(-1) < 0.5 * own_p[..., 1]
    assert bool(implausible.any())
    assert torch.equal(used[..., 0], own[..., 0])
    assert torch.equal(used[..., 1], torch.where(implausible, own[..., 1], forced[..., 1]))
    moe.replay_threshold = 1.0
    _, again = moe(x, own)
    assert torch.equal(again, own)


def test_transformer_reports_replaced_experts_through_routing() -> None:
    """Through the whole model: set_numerics sets the threshold on every MoE layer, and the returned
    routing differs from the replayed one exactly where experts were replaced."""
    model = _model()
    tokens = _tokens()
    own = model(tokens).routing
    assert own is not None
    flipped = (own + 1) % 4  # some of these will be implausible at t = 1
    set_numerics(model, replay_threshold=1.0)
    used = model(tokens, routing=flipped).routing
    assert used is not None
    replaced = int((used != flipped).sum())
    assert replaced > 0
    set_numerics(model, replay_threshold=0.0)
    assert torch.equal(model(tokens, routing=flipped).routing, flipped)  # type: ignore[arg-type]


def test_bad_settings_are_named() -> None:
    model = _model()
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        set_numerics(model, "fp8")
    with pytest.raises(ValueError, match="unknown precision_scope 'some'"):
        set_numerics(model, "nvfp4", "some")
    with pytest.raises(ValueError, match=r"router_replay_threshold 1.5 must be in \[0, 1\]"):
        set_numerics(model, replay_threshold=1.5)
