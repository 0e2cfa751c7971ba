"""Transformer: presets, KV cache, left padding, router replay, RoPE and RMSNorm against references."""

from __future__ import annotations

import pytest
import torch

from rlbus.model.policies.transformer import KVCache, ModelConfig, Transformer

torch.set_num_threads(1)


def _model(**overrides: object) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny(**overrides)).eval()


def _params(config: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(config).parameters())


def test_presets_have_the_promised_sizes() -> None:
    """tiny is about 100k parameters, small 2-5M, m30 at least 30M."""
    assert 80_000 <= _params(ModelConfig.tiny()) <= 150_000
    assert 2_000_000 <= _params(ModelConfig.small()) <= 5_000_000
    assert _params(ModelConfig.m30()) >= 30_000_000
    assert ModelConfig.tiny(vocab_size=300).vocab_size == 300


def test_config_rejects_inconsistent_shapes() -> None:
    """Bad head split, out-of-range MoE layer and top_k > n_experts are reported together."""
    with pytest.raises(ValueError, match="n_heads") as err:
        ModelConfig(d_model=30, n_heads=4, moe_layers=(9,), top_k=5)
    assert "moe_layers" in str(err.value) and "top_k" in str(err.value)


def test_rmsnorm_matches_hand_computation() -> None:
    """RMSNorm([3, 4]) = [3, 4] / sqrt((9 + 16) / 2)."""
    from rlbus.model.policies.transformer import RMSNorm

    x = torch.tensor([[3.0, 4.0]])
    norm = RMSNorm(2, eps=0.0)
    torch.testing.assert_close(norm(x), x / (12.5**0.5))


def test_rope_scores_depend_only_on_relative_position() -> None:
    """q.k after RoPE at positions (p+s, s) is the same for every shift s."""
    from rlbus.model.policies.transformer import apply_rope, rope_tables

    cos, sin = rope_tables(8, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    scores = [
        (
            apply_rope(q, cos[s + 5][None, None, None], sin[s + 5][None, None, None])
            * apply_rope(k, cos[s][None, None, None], sin[s][None, None, None])
        ).sum()
        for s in (0, 7, 30)
    ]
    torch.testing.assert_close(torch.stack(scores), scores[0].expand(3))


def test_kv_cache_decoding_equals_full_forward() -> None:
    """Prefill then one token at a time gives the full forward's logits, MTP logits and routing."""
    model = _model(moe_layers=(1,), mtp_heads=2)
    tokens = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 32)
        parts = [model(tokens[:, :7], cache=cache)]
        parts += [model(tokens[:, t : t + 1], cache=cache) for t in range(7, 24)]
    assert cache.length == 24 and cache.next_pos.tolist() == [24, 24]
    torch.testing.assert_close(torch.cat([p.logits for p in parts], 1), full.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        torch.cat([p.mtp_logits[1] for p in parts], 1), full.mtp_logits[1], atol=1e-5, rtol=0
    )
    assert torch.equal(torch.cat([p.routing for p in parts], 1), full.routing)  # type: ignore[misc]


def test_left_padded_batch_equals_each_prompt_alone() -> None:
    """A left-padded row, prefilled and then decoded, matches the same prompt run unpadded."""
    model = _model()
    long, short = torch.randint(0, 512, (10,)), torch.randint(0, 512, (4,))
    batch = torch.stack([long, torch.cat([torch.zeros(6, dtype=torch.long), short])])
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :6] = False
    nxt = torch.randint(0, 512, (2, 3))
    with torch.no_grad():
        cache = model.new_cache(2, 16)
        first = model(batch, cache=cache, attention_mask=mask).logits
        rest = torch.cat([model(nxt[:, i : i + 1], cache=cache).logits for i in range(3)], 1)
        alone = model(torch.cat([short, nxt[1]])[None]).logits[0]
        alone_long = model(torch.cat([long, nxt[0]])[None]).logits[0]
    torch.testing.assert_close(first[1, 6:], alone[:4], atol=1e-5, rtol=0)
    torch.testing.assert_close(rest[1], alone[4:], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([first[0], rest[0]]), alone_long, atol=1e-5, rtol=0)
    assert cache.next_pos.tolist() == [13, 7]


def test_router_replay_reproduces_experts_and_logits() -> None:
    """Replaying recorded routing gives the same experts and logits; other routing changes them."""
    model = _model(moe_layers=(0, 1), n_experts=4, top_k=2)
    tokens = torch.randint(0, 512, (2, 12))
    out = model(tokens)
    assert out.routing is not None and out.routing.shape == (2, 12, 2, 2)
    replay = model(tokens, routing=out.routing)
    assert torch.equal(replay.routing, out.routing)  # type: ignore[arg-type]
    assert torch.equal(replay.logits, out.logits)
    forced = (out.routing + 1) % 4
    assert not torch.allclose(model(tokens, routing=forced).logits, out.logits)


def test_router_gets_gradients_under_replay() -> None:
    """With forced experts the gates are recomputed from the router, so it still learns."""
    model = _model(moe_layers=(1,))
    tokens = torch.randint(0, 512, (1, 8))
    routing = model(tokens).routing
    model(tokens, routing=routing).logits.logsumexp(-1).sum().backward()
    grad = model.blocks[1].ffn.router.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_bad_routing_and_overflow_are_rejected() -> None:
    """Routing of the wrong shape and a cache overflow raise ValueError."""
    model = _model(moe_layers=(1,))
    with pytest.raises(ValueError, match="routing shape"):
        model(torch.zeros(1, 4, dtype=torch.long), routing=torch.zeros(1, 4, 2, 2, dtype=torch.long))
    cache: KVCache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="slots"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)


def test_cache_truncate_rolls_back_positions() -> None:
    """After truncating to L, feeding tokens again reproduces the logits of the first pass."""
    model = _model()
    tokens = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        cache = model.new_cache(1, 16)
        model(tokens[:, :5], cache=cache)
        first = model(tokens[:, 5:], cache=cache).logits
        cache.truncate(5)
        assert cache.next_pos.tolist() == [5]
        again = model(tokens[:, 5:], cache=cache).logits
    torch.testing.assert_close(again, first)


def test_bf16_model_keeps_fp32_rope_and_tracks_fp32_logits() -> None:
    """Cast to bf16 (how generators hold weights), RoPE stays fp32 and logits stay near fp32's."""
    model = _model(moe_layers=(1,))
    half = _model(moe_layers=(1,)).to(torch.bfloat16)
    assert half.rope_cos.dtype == torch.float32 and half.embed.weight.dtype == torch.bfloat16
    tokens = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        ref, out = model(tokens).logits, half(tokens).logits
        cache = half.new_cache(2, 40)
        cached = torch.cat(
            [half(tokens[:, :20], cache=cache).logits, half(tokens[:, 20:], cache=cache).logits], 1
        )
    assert out.dtype == torch.bfloat16 and cache.k[0].dtype == torch.bfloat16
    assert float((out.float() - ref).abs().max()) < 0.05
    torch.testing.assert_close(cached.float(), out.float(), atol=0.05, rtol=0)
