"""MTP speculative sampling: a policy's multi-token-prediction heads draft, its main head verifies, and rejection
sampling keeps every sampled token distributed exactly as the policy's own, at any temperature.

- Owns: `speculative_sample` (batched, KV-cached, weights swapped in flight; greedy or sampled), `Drafter` and `drafter_for` (the heads of
  a built-in policy, `Transformer.mtp`, or of a Hugging Face policy, `HFPolicy.mtp_heads`) (counted in model/sampling/generate.py `SpeculativeStats`).
- Does not: train heads (model/training/mtp.py distils both policies' heads in a pretraining phase with
  `mtp_heads`; `[trainer] mtp_distill` keeps the built-in ones following the policy during RL), swap weights mid-call, record MoE routing (a routed policy is refused: sample it with
  `generate`), or batch turns across calls (model/sampling/engine.py).

Exactness (Leviathan et al. 2023; Chen et al. 2023). Head k drafts d_k ~ q_k from the hidden state of the last
kept token; one forward of the main model over [y, d_1..d_K] gives p_1..p_{K+1}. Draft k is accepted with
probability min(1, p_k(d_k) / q_k(d_k)); at the first rejection the token is drawn from
norm(max(0, p_k - q_k)) instead, and after K acceptances a bonus token is drawn from p_{K+1}. Each emitted token is
then distributed as p given its prefix. Rows of a batch share the cache's length, so every row keeps a = the
fewest acceptances of any unfinished row, plus one token at position a + 1: its accepted draft, its residual draw
or its bonus draw, each distributed as p (a depends on the other rows, whose draws are independent of this row's).
Greedy (temperature 0) accepts a draft when it equals the main head's argmax and always emits the argmax: the
tokens equal `generate(..., temperature=0)` token for token. The behaviour logprob of each token is
log softmax(logits / tau) of the verifying forward (tau = 1 for greedy), as `generate` records it; never the draft's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from rlbus.model.policies.interface import Policy, PolicyCache, as_policy
from rlbus.model.sampling.generate import (
    SampledSequence,
    SpeculativeStats,
    SwapHook,
    _check_budget,
    _Recorder,
    left_pad,
)


class Drafter:
    """A policy's main forward with the hidden state its MTP heads read, and those heads' logits.

    Built-in: the transformer's own heads over the last block's output, then its final norm and output head.
    Hugging Face: `HFPolicy.mtp_heads` over the input of the output embedding (the final norm's output), then the
    output embedding.
    """

    def __init__(self, policy: Policy, heads: Sequence[nn.Module], project: nn.Module | Any,
                 hidden_site: nn.Module | None) -> None:
        self.policy = policy
        self.heads = list(heads)
        self.project = project
        self._site = hidden_site

    @property
    def n_heads(self) -> int:
        return len(self.heads)

    def forward(self, tokens: Tensor, cache: PolicyCache, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """tokens (B, T) -> (logits (B, T, V), hidden (B, T, D)), the cache advanced as `Policy.forward` does."""
        if self._site is None:     # built-in: the transformer returns its hidden state
            out = self.policy.module(tokens, cache=cache, attention_mask=mask, with_mtp=False)
            return out.logits, out.hidden
        with _captured_input(self._site) as seen:
            logits = self.policy.forward(tokens, cache=cache, attention_mask=mask).logits
        return logits, seen[0]

    def draft_logits(self, hidden: Tensor, k: int) -> Tensor:
        """hidden (B, D) of the last kept token -> (B, k, V): head j's logits for the token j after the next."""
        h = hidden[:, None]
        return self.project(torch.cat([head(h) for head in self.heads[:k]], dim=1))   # one read-out for all


@contextlib.contextmanager
def _captured_input(module: nn.Module) -> Iterator[list[Tensor]]:
    seen: list[Tensor] = []
    handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        yield seen
    finally:
        handle.remove()


def drafter_for(policy: Policy | nn.Module) -> Drafter:
    """The drafter of `policy`'s MTP heads.

    :raises ValueError: a policy without MTP heads, or a routed (MoE) one.
    """
    policy = as_policy(policy)
    if policy.moe is not None:
        raise ValueError("speculative sampling records no MoE routing; sample a routed policy with `generate`")
    if policy.kind == "builtin":
        model = policy.module
        if not model.config.mtp_heads:
            raise ValueError("the built-in policy has no MTP heads (ModelConfig.mtp_heads = 0); speculative "
                             "sampling needs them (a pretraining phase with mtp_heads distils them)")
        return Drafter(policy, list(model.mtp), model.head, None)
    heads = getattr(policy, "mtp_heads", None)
    if heads is None or not len(heads):
        raise ValueError(f"{policy.kind} policy has no MTP heads (a Hugging Face directory holds them in "
                         "mtp_heads.safetensors: model/training/mtp.py distils them)")
    out = policy.module.get_output_embeddings()
    return Drafter(policy, list(heads.heads), out, out)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """The unnormalised distribution a rejected draft is replaced from: max(0, p - q)."""
    return (p - q).clamp_min(0)


def _logp(logits: Tensor, tau: float) -> Tensor:
    """log softmax(logits / tau) in float32, as `generate` computes it (x / 1 is x: no division at tau 1)."""
    x = logits.float()
    return torch.log_softmax(x if tau == 1 else x / tau, dim=-1)


def _leading(drafts: list[int], choice: list[int]) -> int:
    """How many drafts, from the first, equal the main head's choice at their position."""
    n = 0
    for d, c in zip(drafts, choice, strict=False):
        if d != c:
            break
        n += 1
    return n


def _draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """probs (N, V), rows not necessarily normalised -> (N,) int64 draws."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _drafts(drafter: Drafter, hidden: Tensor, k: int, temperature: float,
            generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
    """-> drafts (B, k) and their distributions q (B, k, V) (None when greedy)."""
    logits = drafter.draft_logits(hidden, k).float()
    if temperature == 0:
        return logits.argmax(-1), None
    q = torch.softmax(logits / temperature, dim=-1)
    B, K, V = q.shape
    return _draw(q.reshape(B * K, V), generator).view(B, K), q


@torch.no_grad()
def speculative_sample(
    policy: Policy | nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    eos_id: int | None = None,
    pad_id: int = 0,
    version: int = 0,
    on_step: SwapHook | None = None,
    draft_tokens: int | None = None,
    generator: torch.Generator | None = None,
    kv_dtype: torch.dtype | None = None,
) -> tuple[list[SampledSequence], SpeculativeStats]:
    """Sample up to max_new_tokens per prompt, drafting `draft_tokens` (default: every head) per forward.

    Same arguments and results as `generate` (left-padded prompts, eos, per-token behaviour logprobs at
    `temperature`, the version each token carries); `routing` is None. `on_step(n)` is called before each forward
    of the main model, n being the index of the first token it yields; a version it returns (weights swapped in
    place) is carried by every token of that forward on (drafts made with the old weights stay exact: acceptance
    uses the new p). See the module docstring for why the tokens are distributed exactly as `generate`'s.

    :raises ValueError: no MTP heads, a routed policy, `draft_tokens` outside [1, heads], a negative
        temperature, or a budget past the context.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    drafter = drafter_for(policy)
    net = drafter.policy
    K = drafter.n_heads if draft_tokens is None else draft_tokens
    if not 1 <= K <= drafter.n_heads:
        raise ValueError(f"draft_tokens {K} must be in [1, {drafter.n_heads}] (the policy's MTP heads)")
    tokens, mask = left_pad(prompts, pad_id, net.device)
    B, P = tokens.shape
    _check_budget(net.max_seq_len, P, max_new_tokens)
    tau = temperature or 1.0
    cache = net.new_cache(B, P + max_new_tokens, kv_dtype)
    stats = SpeculativeStats(forward_passes=1)
    record = _Recorder(B, eos_id)
    if on_step is not None and (new := on_step(0)) is not None:
        version = new
    logits, hidden = drafter.forward(tokens, cache, mask)
    logp = _logp(logits[:, -1], tau)
    y = logp.argmax(-1) if temperature == 0 else _draw(logp.exp(), generator)
    for b, (t, lp) in enumerate(zip(y.tolist(), logp.gather(-1, y[:, None])[:, 0].tolist(), strict=True)):
        record.add(b, t, lp, version)
    last = hidden[:, -1]
    n = 1
    # Per step: the bookkeeping runs on Python lists read out once (a step of a small model costs about what a
    # forward of one token does, so a few tensor operations and syncs per token would show).
    while n < max_new_tokens and not record.done():
        k = min(K, max_new_tokens - n - 1)
        drafts, q = _drafts(drafter, last, k, temperature, generator) if k else (y.new_zeros(B, 0), None)
        start = cache.length
        if on_step is not None and (new := on_step(n)) is not None:
            version = new
        logits, hidden = drafter.forward(torch.cat([y[:, None], drafts], dim=1), cache, None)
        stats.forward_passes += 1
        logp = _logp(logits, tau)                                    # (B, 1 + k, V)
        active = [b for b in range(B) if not record.finished[b]]
        if temperature == 0:
            choice = logp.argmax(-1)                                 # (B, 1 + k): the main head's tokens
            chosen = choice.tolist()
            held = [_leading(d, c) for d, c in zip(drafts.tolist(), chosen, strict=True)]
            a = min(held[b] for b in active)                         # drafts every unfinished row keeps
            nxt = choice[:, a]
            # the kept drafts equal the main head's tokens, so each row keeps its choices 0..a
            kept = [c[: a + 1] for c in chosen]
            kept_logp = logp[:, : a + 1].gather(-1, choice[:, : a + 1, None])[..., 0].tolist()
        else:
            p = logp.exp()
            if q is None:
                held_t = torch.zeros(B, dtype=torch.long, device=p.device)
            else:
                p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0]
                q_d = q.gather(-1, drafts[..., None])[..., 0]
                u = torch.rand(drafts.shape, generator=generator, device=p_d.device)
                accept = u * q_d <= p_d        # probability min(1, p / q)
                held_t = accept.long().cumprod(dim=1).sum(dim=1)     # (B,) drafts accepted in a row
            held = held_t.tolist()
            a = min(held[b] for b in active)
            # token a + 1 of each row: its accepted draft, a residual draw after a rejection, or a bonus draw
            if a == k:
                nxt = _draw(p[:, a], generator)
            else:
                assert q is not None
                rest = residual(p[:, a], q[:, a])
                empty = rest.sum(-1) <= 0             # p == q to rounding: a rejection there is measure zero
                rest[empty] = p[empty, a]
                nxt = torch.where(held_t > a, drafts[:, a], _draw(rest, generator))
            kept_t = torch.cat([drafts[:, :a], nxt[:, None]], dim=1)   # (B, a + 1)
            kept = kept_t.tolist()
            kept_logp = logp[:, : a + 1].gather(-1, kept_t[..., None])[..., 0].tolist()
        for b in active:
            for t, lp in zip(kept[b], kept_logp[b], strict=True):
                record.add(b, t, lp, version)
        stats.drafted += k * len(active)
        stats.accepted += a * len(active) + sum(held[b] > a for b in active)
        n += a + 1
        cache.truncate(start + 1 + a)
        y, last = nxt, hidden[:, a]
    stats.generated = sum(len(t) for t in record.tokens)
    return record.results(prompts, mask, []), stats
