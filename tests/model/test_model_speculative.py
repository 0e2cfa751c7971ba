"""MTP speculative sampling (model/sampling/speculative.py) on the built-in transformer: greedy output equal to
plain greedy decoding, behaviour logprobs equal to a plain forward's, and sampled continuations distributed as
the policy's (a chi-square test that a sampler with a wrong rejection rule fails)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling import speculative
from rlbus.model.sampling.generate import generate
from rlbus.model.sampling.speculative import speculative_sample
from rlbus.model.training.loss import lm_loss

torch.set_num_threads(1)
PROMPTS = [[1, 3, 5], [10, 11, 12, 13, 14], [7, 10]]


@pytest.fixture(scope="module")
def counting() -> Transformer:
    """A dense tiny model with 3 MTP heads trained for 40 steps on strided counting: its drafts are partly right."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=64, mtp_heads=3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        seq = (torch.randint(0, 64, (16, 1)) + torch.randint(1, 4, (16, 1)) * torch.arange(24)) % 64
        out = model(seq)
        loss = lm_loss(out.logits, out.mtp_logits, seq)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _full_logp(model: Transformer, prompt: list[int], tokens: torch.Tensor, tau: float) -> torch.Tensor:
    """One uncached forward over prompt + tokens: log softmax(logits / tau) of each generated token."""
    with torch.no_grad():
        logits = model(torch.tensor(prompt + tokens.tolist())[None], with_mtp=False).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / tau, -1)
    return logp.gather(-1, tokens[:, None])[:, 0]


def test_greedy_speculation_equals_plain_greedy(counting: Transformer) -> None:
    """Greedy: the same tokens, logprobs and finish reasons as `generate(temperature=0)`, with some drafts kept
    and some refused, and fewer forwards than tokens."""
    plain = generate(counting, PROMPTS, max_new_tokens=24, temperature=0)
    eos = int(plain[1].tokens[9])
    plain = generate(counting, PROMPTS, max_new_tokens=24, temperature=0, eos_id=eos)
    spec, stats = speculative_sample(counting, PROMPTS, max_new_tokens=24, temperature=0, eos_id=eos)
    for a, b in zip(plain, spec, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.finish_reason == b.finish_reason
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert spec[1].finish_reason == "eos" and spec[0].finish_reason == "length"
    assert 0 < stats.accepted < stats.drafted
    assert stats.generated == sum(len(s.tokens) for s in spec) and stats.forward_passes < 24


def test_sampled_logprobs_are_the_policys_at_the_temperature(counting: Transformer) -> None:
    """At temperature 0.8 the recorded logprob of every token is a plain forward's log softmax(logits / 0.8),
    not the draft head's."""
    seqs, stats = speculative_sample(counting, PROMPTS, max_new_tokens=20, temperature=0.8,
                                     generator=torch.Generator().manual_seed(3))
    assert stats.accepted > 0
    for prompt, s in zip(PROMPTS, seqs, strict=True):
        assert len(s.tokens) == 20
        torch.testing.assert_close(s.logprobs, _full_logp(counting, prompt, s.tokens, 0.8), atol=1e-4, rtol=0)


def test_a_weight_swap_between_forwards_versions_the_tokens_after_it(counting: Transformer) -> None:
    """A version the hook reports before the first forward that yields token 6 or later is carried by every token
    from that forward on; the tokens before it equal an unswapped run's."""
    other = Transformer(counting.config)
    other.load_state_dict(counting.state_dict())
    calls: list[int] = []

    def swap(step: int) -> int | None:
        calls.append(step)
        if step < 6 or any(c >= 6 for c in calls[:-1]):
            return None
        with torch.no_grad():
            for p in other.parameters():
                p.add_(0.05 * torch.randn_like(p))
        return 1

    before, _ = speculative_sample(counting, PROMPTS[:1], max_new_tokens=20, temperature=0)
    seq = speculative_sample(other, PROMPTS[:1], max_new_tokens=20, temperature=0, on_step=swap)[0][0]
    at = next(c for c in calls if c >= 6)
    assert calls == sorted(calls) and calls[0] == 0
    assert seq.versions.tolist() == [0] * at + [1] * (20 - at)
    assert seq.tokens[:at].tolist() == before[0].tokens[:at].tolist()


def test_speculation_refuses_a_policy_without_heads() -> None:
    with pytest.raises(ValueError, match="MTP heads"):
        speculative_sample(Transformer(ModelConfig.tiny()), PROMPTS, max_new_tokens=4)


# ---- the sampled distribution ---------------------------------------------------------------------------------
VOCAB, NEW, TAU = 4, 4, 0.7
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def peaked() -> Transformer:
    """A 4-token model with 2 MTP heads, weights large enough that p is far from uniform and the heads' q far from
    p (so drafts are refused often, and the residual matters)."""
    torch.manual_seed(1)
    model = Transformer(ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=16,
                                    mtp_heads=2, tie_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.6)
    return model.eval()


def _exact(model: Transformer) -> dict[tuple[int, ...], float]:
    """P(t_1..t_NEW | PROMPT) at TAU, by enumerating every prefix."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NEW):
        prefixes = list(probs)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(x) for x in prefixes]), with_mtp=False).logits[:, -1]
        step = torch.softmax(logits / TAU, -1).tolist()
        probs = {(*x, t): probs[x] * step[i][t] for i, x in enumerate(prefixes) for t in range(VOCAB)}
    return probs


def _chi_square(model: Transformer, draws: int) -> tuple[float, float]:
    """(statistic, critical value at p = 1e-4) of `draws` speculative continuations against `_exact`, cells with
    fewer than 5 expected merged."""
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=NEW), 0)
    g = torch.Generator().manual_seed(7)
    for _ in range(draws // 8):
        for s in speculative_sample(model, [PROMPT] * 8, max_new_tokens=NEW, temperature=TAU, generator=g)[0]:
            counts[tuple(s.tokens.tolist())] += 1
    exact = _exact(model)
    cells, rest_o, rest_e = [], 0.0, 0.0
    for key, observed in counts.items():
        expected = exact[key] * draws
        if expected >= 5:
            cells.append((observed, expected))
        else:
            rest_o, rest_e = rest_o + observed, rest_e + expected
    cells.append((rest_o, rest_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    z = 3.72   # one-sided p = 1e-4; Wilson-Hilferty approximation of the chi-square quantile
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_continuations_follow_the_policys_distribution(peaked: Transformer,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """4-token continuations at temperature 0.7, eight rows a call: the joint distribution passes a chi-square test
    against the exact one; the same sampler drawing a refused draft's replacement from p instead of
    max(0, p - q) fails it."""
    _, stats = speculative_sample(peaked, [PROMPT] * 64, max_new_tokens=NEW, temperature=TAU,
                                  generator=torch.Generator().manual_seed(0))
    assert 0 < stats.accepted < stats.drafted           # both the acceptance and the residual paths run
    stat, critical = _chi_square(peaked, 1600)
    assert stat < critical
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    biased, critical = _chi_square(peaked, 1600)
    assert biased > critical
