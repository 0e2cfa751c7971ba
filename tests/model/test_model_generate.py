"""Generation: KV-cached sampling vs full-forward references, swaps mid-sequence, speculation, MXFP8."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlbus.model.policies.quant import quantized_copy
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling.generate import generate, speculative_generate
from rlbus.model.training.loss import lm_loss

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]


def _model(seed: int = 0, **overrides: object) -> Transformer:
    """Untied embeddings: a random tied model's greedy output just repeats its last token."""
    torch.manual_seed(seed)
    return Transformer(ModelConfig.tiny(tie_embeddings=False, **overrides)).eval()


def _full_logp(
    model: nn.Module, prompt: list[int], tokens: torch.Tensor, routing: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference: one uncached forward over prompt + tokens, logprob of each generated token."""
    seq = torch.tensor(prompt + tokens.tolist())[None]
    with torch.no_grad():
        out = model(seq, routing=None if routing is None else routing[None])
    logp = torch.log_softmax(out.logits[0, len(prompt) - 1 : -1], -1)
    return logp.gather(-1, tokens[:, None])[:, 0]


def _greedy_reference(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Reference greedy decoding by re-running the full forward for every token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor(seq)[None]).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def test_greedy_generation_matches_full_forward_reference() -> None:
    """KV-cached batched greedy decoding of unequal prompts equals per-prompt full re-forward."""
    model = _model()
    out = generate(model, PROMPTS, max_new_tokens=12, temperature=0)
    for prompt, seq in zip(PROMPTS, out, strict=True):
        assert seq.tokens.tolist() == _greedy_reference(model, prompt, 12)
        assert seq.finish_reason == "length" and seq.versions.tolist() == [0] * 12
        torch.testing.assert_close(seq.logprobs, _full_logp(model, prompt, seq.tokens), atol=1e-5, rtol=0)


def test_sampled_logprobs_are_the_sampling_distribution() -> None:
    """At temperature tau the behaviour logprob is log softmax(logits / tau) of the drawn token."""
    model = _model()
    g = torch.Generator().manual_seed(3)
    seq = generate(model, [PROMPTS[0]], max_new_tokens=8, temperature=0.5, generator=g)[0]
    full = torch.tensor(PROMPTS[0] + seq.tokens.tolist())[None]
    with torch.no_grad():
        logits = model(full).logits[0, len(PROMPTS[0]) - 1 : -1]
    expected = torch.log_softmax(logits / 0.5, -1).gather(-1, seq.tokens[:, None])[:, 0]
    torch.testing.assert_close(seq.logprobs, expected, atol=1e-5, rtol=0)


def test_generation_stops_at_eos_per_row() -> None:
    """A row ends with eos and reports it; other rows run on to max_new_tokens."""
    model = _model()
    free = generate(model, PROMPTS, max_new_tokens=10, temperature=0)
    eos = int(free[1].tokens[3])
    out = generate(model, PROMPTS, max_new_tokens=10, temperature=0, eos_id=eos)
    first = free[1].tokens.tolist().index(eos)
    assert out[1].tokens.tolist() == free[1].tokens.tolist()[: first + 1]
    assert out[1].finish_reason == "eos"
    for row in (0, 2):
        if eos not in free[row].tokens.tolist():
            assert out[row].tokens.tolist() == free[row].tokens.tolist()


def test_in_flight_swap_changes_version_at_the_right_token() -> None:
    """Weights copied in at step 5 give versions [7]*5 + [8]*rest and equal a manual old/new decode."""
    new_state = {k: v.clone() for k, v in _model(1).state_dict().items()}
    old_state = {k: v.clone() for k, v in _model(0).state_dict().items()}
    model = _model(0)

    def on_step(step: int) -> int | None:
        if step == 5:
            model.load_state_dict(new_state)
            return 8
        return None

    seq = generate(model, [PROMPTS[0]], max_new_tokens=12, temperature=0, version=7, on_step=on_step)[0]
    assert seq.versions.tolist() == [7] * 5 + [8] * 7

    ref = _model(0)
    ref.load_state_dict(old_state)
    tokens: list[int] = []
    with torch.no_grad():
        cache = ref.new_cache(1, 32)
        logits = ref(torch.tensor([PROMPTS[0]]), cache=cache).logits[0, -1]
        for step in range(12):
            if step == 5:
                ref.load_state_dict(new_state)  # same kept cache, new weights
            if step > 0:
                logits = ref(torch.tensor([[tokens[-1]]]), cache=cache).logits[0, -1]
            tokens.append(int(logits.argmax()))
    assert seq.tokens.tolist() == tokens
    old_only = generate(_model(0), [PROMPTS[0]], max_new_tokens=12, temperature=0)[0]
    assert seq.tokens[:5].tolist() == old_only.tokens[:5].tolist()
    assert seq.tokens[5:].tolist() != old_only.tokens[5:].tolist()  # the swap mattered


def test_routing_record_replays_to_the_behaviour_logprobs() -> None:
    """The recorded routing covers prompt + completion and, replayed, reproduces the logprobs."""
    model = _model(moe_layers=(0, 1), n_experts=4, top_k=2)
    out = generate(
        model, PROMPTS, max_new_tokens=9, temperature=1.0, generator=torch.Generator().manual_seed(1)
    )
    for prompt, seq in zip(PROMPTS, out, strict=True):
        assert seq.routing is not None and seq.routing.shape == (len(prompt) + 9, 2, 2)
        full = torch.tensor(prompt + seq.tokens.tolist())[None]
        with torch.no_grad():
            assert torch.equal(model(full).routing[0], seq.routing)  # type: ignore[index]
        torch.testing.assert_close(
            seq.logprobs, _full_logp(model, prompt, seq.tokens, seq.routing), atol=1e-5, rtol=0
        )


REPEATS = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[0]]


def _staggered_eos(rows: list[list[int]]) -> int:
    """A token that ends the rows at two or more different steps (so rows leave the batch one by one)."""
    for token in sorted({t for row in rows for t in row}):
        ends = {row.index(token) for row in rows if token in row}
        if len(ends) >= 2:
            return token
    raise AssertionError("no token ends the rows at different steps")


def test_repeated_prompts_and_finished_rows_leave_greedy_decoding_unchanged() -> None:
    """Repeated prompts are prefilled once and finished rows leave the batch: every row still equals
    its own full re-forward greedy decode, cut at its eos."""
    model = _model()
    free = [seq.tokens.tolist() for seq in generate(model, REPEATS, max_new_tokens=16, temperature=0)]
    eos = _staggered_eos(free)
    out = generate(model, REPEATS, max_new_tokens=16, temperature=0, eos_id=eos)
    for prompt, seq in zip(REPEATS, out, strict=True):
        reference = _greedy_reference(model, prompt, 16)
        cut = reference[: reference.index(eos) + 1] if eos in reference else reference
        assert seq.tokens.tolist() == cut
        assert seq.finish_reason == ("eos" if eos in reference else "length")
        torch.testing.assert_close(seq.logprobs, _full_logp(model, prompt, seq.tokens), atol=1e-5, rtol=0)
    assert len({len(seq.tokens) for seq in out}) >= 2


def test_routing_record_survives_shared_prefill_and_finished_rows() -> None:
    """With repeated prompts and rows ending at different steps, each row's routing record still
    covers its prompt and every fed token, and replays to its behaviour logprobs."""
    model = _model(moe_layers=(0, 1), n_experts=4, top_k=2)
    sample = {"max_new_tokens": 12, "temperature": 1.0}
    free = generate(model, REPEATS, generator=torch.Generator().manual_seed(1), **sample)  # type: ignore[arg-type]
    eos = _staggered_eos([seq.tokens.tolist() for seq in free])
    out = generate(model, REPEATS, eos_id=eos, generator=torch.Generator().manual_seed(1), **sample)  # type: ignore[arg-type]
    assert len({len(seq.tokens) for seq in out}) >= 2
    for prompt, seq in zip(REPEATS, out, strict=True):
        assert seq.routing is not None and seq.routing.shape == (len(prompt) + len(seq.tokens), 2, 2)
        full = torch.tensor(prompt + seq.tokens.tolist())[None]
        with torch.no_grad():
            assert torch.equal(model(full).routing[0], seq.routing)  # type: ignore[index]
        torch.testing.assert_close(
            seq.logprobs, _full_logp(model, prompt, seq.tokens, seq.routing), atol=1e-5, rtol=0
        )


def test_bf16_kv_cache_samples_what_the_fp32_cache_does_within_bf16_rounding() -> None:
    """kv_dtype=bfloat16 (the generator's cache): same seeded draws over a few tokens, behaviour logprobs
    within bf16 rounding of the fp32 cache's, yet not identical (attention really ran in bf16)."""
    model = _model()
    runs = [generate(model, REPEATS, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(5),
                     kv_dtype=dtype) for dtype in (None, torch.bfloat16)]
    for full, half in zip(*runs, strict=True):
        assert half.tokens.tolist() == full.tokens.tolist()
        torch.testing.assert_close(half.logprobs, full.logprobs, atol=3e-2, rtol=0)
    assert any(not torch.equal(f.logprobs, h.logprobs) for f, h in zip(*runs, strict=True))


@pytest.fixture(scope="module")
def counting_model() -> Transformer:
    """A tiny MoE+MTP model trained for 60 steps on strided counting: its drafts are partly right."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=64, mtp_heads=2, moe_layers=(1,)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        seq = (torch.randint(0, 64, (16, 1)) + torch.randint(1, 4, (16, 1)) * torch.arange(24)) % 64
        out = model(seq)
        loss = lm_loss(out.logits, out.mtp_logits, seq)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_speculative_decoding_equals_plain_greedy(counting_model: Transformer) -> None:
    """MTP drafting with main-head verification yields exactly the greedy tokens; stats add up."""
    prompts = [[1, 3, 5], [10, 11, 12], [7, 10]]
    plain = generate(counting_model, prompts, max_new_tokens=20, temperature=0)
    spec, stats = speculative_generate(counting_model, prompts, max_new_tokens=20)
    for a, b in zip(plain, spec, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        assert torch.equal(a.routing, b.routing)  # type: ignore[arg-type]
    assert 0 < stats.accepted < stats.drafted and stats.generated == 60
    # every pass but the prefill emits 1 + (accepted drafts per row) tokens per row
    assert 1 + (stats.forward_passes - 1) + stats.accepted // 3 == 20


def test_speculative_decoding_with_eos_equals_greedy() -> None:
    """Speculation stops each row at eos exactly where greedy does."""
    model = _model(mtp_heads=2)
    plain = generate(model, PROMPTS, max_new_tokens=15, temperature=0)
    eos = int(plain[0].tokens[6])
    a = generate(model, PROMPTS, max_new_tokens=15, temperature=0, eos_id=eos)
    b, _ = speculative_generate(model, PROMPTS, max_new_tokens=15, eos_id=eos)
    assert [s.tokens.tolist() for s in a] == [s.tokens.tolist() for s in b]
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]


def test_speculative_decoding_needs_mtp_heads() -> None:
    """Without MTP heads speculative decoding refuses with ValueError."""
    with pytest.raises(ValueError, match="MTP"):
        speculative_generate(_model(), PROMPTS, max_new_tokens=4)


def test_mxfp8_generation_samples_from_the_quantized_copy() -> None:
    """weight_quant='mxfp8' logprobs are those of the MXFP8 copy, close to but not the fp32 ones."""
    model = _model()
    seq = generate(model, [PROMPTS[0]], max_new_tokens=8, temperature=0, weight_quant="mxfp8")[0]
    q = quantized_copy(model)
    torch.testing.assert_close(seq.logprobs, _full_logp(q, PROMPTS[0], seq.tokens), atol=1e-5, rtol=0)
    exact = _full_logp(model, PROMPTS[0], seq.tokens)
    drift = (seq.logprobs - exact).abs()
    assert 0 < drift.max() < 0.5
    assert torch.equal(q.embed.weight, model.embed.weight)


def test_prompt_plus_budget_must_fit_the_model() -> None:
    """A prompt that leaves no room for max_new_tokens is rejected before any work."""
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(_model(), [[1] * 250], max_new_tokens=10)
