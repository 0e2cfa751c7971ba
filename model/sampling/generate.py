"""Batched sampling from the policy with a KV cache, in-flight weight swaps and MTP speculation.

Owns `generate` (temperature / greedy sampling, eos, per-token behaviour logprob, policy version
and MoE routing, a swap hook between decoding steps, optional MXFP8 weights) over any `Policy`, and
`speculative_generate` (greedy; the built-in transformer's MTP heads draft, the main head verifies).
Does not own the policies, the tokenizer or multi-turn summarisation (`model/sampling/summarize.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.interface import Policy, as_policy
from rlbus.model.policies.quant import WeightQuant, refresh_quantized
from rlbus.model.policies.transformer import Transformer

SwapHook = Callable[[int], "int | None"]
"""on_step(step) -> new version or None. Called before the forward pass that yields generated token
`step` (0 = before the prompt prefill). A caller that returns a version has already swapped the
model's weights in place (`load_state_dict`, `param.copy_`), so token `step` and every later one
come from the new weights and carry that version, while the KV cache built so far is kept.
Pass `swapper.maybe_swap` to use an object."""


@dataclass(frozen=True)
class SampledSequence:
    """One generated sequence, pads stripped. N = number of generated tokens."""

    prompt: Tensor
    """(P,) int64 prompt ids as given."""
    tokens: Tensor
    """(N,) int64 generated ids; the last one is eos when finish_reason == "eos"."""
    logprobs: Tensor
    """(N,) float32 behaviour logprobs: log softmax(logits / tau)[token] of the distribution the
    token was drawn from, tau = temperature (tau = 1 for greedy). RL sampling uses temperature 1,
    which makes these the policy's plain logprobs. Under weight_quant they are the quantised model's."""
    versions: Tensor
    """(N,) int64 policy version of the weights whose logits produced each token."""
    routing: Tensor | None
    """(P + N, n_moe_layers, top_k) int64 experts each prompt and generated token ran through when
    it was fed to the model (replay it over prompt + tokens); None without MoE."""
    finish_reason: Literal["eos", "length"]


@dataclass
class SpeculativeStats:
    """Counters of one `speculative_generate` or model/sampling/speculative.py `speculative_sample` call, summed
    over active rows."""

    drafted: int = 0
    """Draft tokens proposed by the MTP heads and checked by the main head."""
    accepted: int = 0
    """Draft tokens kept (equal to the main head's greedy choice, or accepted by rejection sampling)."""
    forward_passes: int = 0
    """Model calls, prefill included."""
    generated: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, other: SpeculativeStats) -> SpeculativeStats:
        return SpeculativeStats(self.drafted + other.drafted, self.accepted + other.accepted,
                                self.forward_passes + other.forward_passes, self.generated + other.generated)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """prompts of lengths P_b -> tokens (B, P) int64 left-padded with pad_id, mask (B, P) bool."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generation needs at least one prompt and every prompt needs a token")
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for b, prompt in enumerate(prompts):
        tokens[b, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[b, width - len(prompt) :] = True
    return tokens.to(device), mask.to(device)


def distinct_prompts(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(the first row of each distinct prompt, in order; for each row the index of its prompt in that list).

    Rows that share a prompt (a group's samples) need its forward pass only once: `generate` prefills
    each distinct prompt once, the trainer's `shared_prompt_logprobs` runs it once.
    """
    slot: dict[tuple[int, ...], int] = {}
    first: list[int] = []
    copies: list[int] = []
    for b, prompt in enumerate(prompts):
        index = slot.setdefault(tuple(prompt), len(first))
        if index == len(first):
            first.append(b)
        copies.append(index)
    return first, copies


def sampling_kv_dtype(device: torch.device) -> torch.dtype | None:
    """The KV-cache dtype rlbus samples with on `device`: float32 on CPU, whatever the weights' dtype (attention
    over it, most of a decoding step at 64 rows, runs 1.6-1.8x faster there than over a bfloat16 cache, whose
    matmuls a CPU without bf16 units emulates); elsewhere None, the model's own."""
    return torch.float32 if device.type == "cpu" else None


def sample_next(
    logits: Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """logits (B, V) -> (token (B,) int64, logprob (B,) float32) of log softmax(logits / tau)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logp = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
    if temperature == 0:
        token = logp.argmax(-1)
    else:
        token = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return token, logp.gather(-1, token[:, None])[:, 0]


def _check_budget(max_seq_len: int, prompt_len: int, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > max_seq_len:
        raise ValueError(
            f"prompt of {prompt_len} + {max_new_tokens} new tokens exceeds max_seq_len "
            f"{max_seq_len}; shorten the prompt or summarise the history"
        )


def _quantized(policy: Policy, scheme: WeightQuant) -> Policy:
    """A copy of `policy` in eval mode whose Linear weights are MXFP8 round-tripped."""
    if scheme not in ("none", "mxfp8"):
        raise ValueError(f"unknown weight_quant {scheme!r}; expected 'none' or 'mxfp8'")
    clone = policy.clone().eval()
    if scheme == "mxfp8":
        refresh_quantized(clone.module, policy.module)
    return clone


class _Recorder:
    """Collects per-row generated tokens until eos."""

    def __init__(self, batch: int, eos_id: int | None) -> None:
        self.eos_id = eos_id
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.logprobs: list[list[float]] = [[] for _ in range(batch)]
        self.versions: list[list[int]] = [[] for _ in range(batch)]
        self.finished = [False] * batch

    def add(self, b: int, token: int, logprob: float, version: int) -> None:
        if self.finished[b]:
            return
        self.tokens[b].append(token)
        self.logprobs[b].append(logprob)
        self.versions[b].append(version)
        self.finished[b] = token == self.eos_id

    def done(self) -> bool:
        return all(self.finished)

    def results(
        self, prompts: Sequence[Sequence[int]], mask: Tensor, routing: list[Tensor]
    ) -> list[SampledSequence]:
        out = []
        steps = torch.cat(routing[1:], dim=1).cpu() if len(routing) > 1 else None
        for b, prompt in enumerate(prompts):
            n = len(self.tokens[b])
            route = None
            if routing:
                parts = [routing[0][b][mask[b]].cpu()] + ([steps[b, :n]] if steps is not None else [])
                route = torch.cat(parts)
            out.append(
                SampledSequence(
                    prompt=torch.as_tensor(list(prompt), dtype=torch.long),
                    tokens=torch.tensor(self.tokens[b], dtype=torch.long),
                    logprobs=torch.tensor(self.logprobs[b], dtype=torch.float32),
                    versions=torch.tensor(self.versions[b], dtype=torch.long),
                    routing=route,
                    finish_reason="eos" if self.finished[b] else "length",
                )
            )
        return out


@torch.no_grad()
def generate(
    model: Policy | Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    eos_id: int | None = None,
    pad_id: int = 0,
    version: int = 0,
    on_step: SwapHook | None = None,
    generator: torch.Generator | None = None,
    weight_quant: WeightQuant = "none",
    kv_dtype: torch.dtype | None = None,
) -> list[SampledSequence]:
    """Sample up to max_new_tokens per prompt; one batched KV-cached forward per step.

    Prompts of unequal length are left-padded (pad_id) with an attention mask, so every row's
    positions start at 0. A row stops at eos; the batch stops when every row has.
    temperature 0 is greedy. weight_quant="mxfp8" samples from a copy of the model whose Linear
    weights are MXFP8 round-tripped (re-quantised after every swap the hook reports). kv_dtype (default
    the model's) is the KV cache's dtype, and attention runs in it (a float32 cache under bfloat16 weights
    is 1.6-1.8x faster on a CPU that emulates bf16 matmuls); the behaviour logprobs are then those of
    that computation.
    """
    model = as_policy(model)
    tokens, mask = left_pad(prompts, pad_id, model.device)
    B, P = tokens.shape
    _check_budget(model.max_seq_len, P, max_new_tokens)
    net = _quantized(model, weight_quant) if weight_quant != "none" else model
    # A prompt given several times (a group's G samples) is prefilled once; its cache rows are copied.
    distinct, copies = distinct_prompts(prompts)
    copy_of = torch.tensor(copies, dtype=torch.long, device=tokens.device)
    shared = len(distinct) < B
    cache = net.new_cache(len(distinct), P + max_new_tokens, kv_dtype)
    record = _Recorder(B, eos_id)
    routing: list[Tensor] = []
    rows = torch.tensor(distinct, dtype=torch.long, device=tokens.device)
    inputs: Tensor = tokens.index_select(0, rows) if shared else tokens
    input_mask: Tensor | None = mask.index_select(0, rows) if shared else mask
    live = list(range(B))  # the original row of each row still decoded
    for step in range(max_new_tokens):
        if on_step is not None and (new_version := on_step(step)) is not None:
            version = new_version
            if net is not model:
                refresh_quantized(net.module, model.module)
        out = net(inputs, cache=cache, attention_mask=input_mask)
        if step == 0 and shared:
            cache.keep_rows(copy_of, max_new_tokens)
            out = out._replace(logits=out.logits[:, -1:].index_select(0, copy_of),
                               routing=None if out.routing is None else out.routing.index_select(0, copy_of))
        if out.routing is not None:
            routing.append(_in_rows(out.routing, live, B))
        fed_last = [record.finished[b] for b in live]  # this forward fed their eos: routing complete
        token, logprob = sample_next(out.logits[:, -1], temperature, generator)
        for b, t, lp in zip(live, token.tolist(), logprob.tolist(), strict=True):
            record.add(b, t, lp, version)
        inputs, input_mask = token[:, None], None
        if record.done():
            break
        # Finished rows stop costing work: drop them from the batch once enough have finished.
        moe = out.routing is not None
        gone = {i for i, b in enumerate(live) if (fed_last[i] if moe else record.finished[b])}
        if len(gone) >= max(1, len(live) // _COMPACT_EVERY):
            keep = torch.tensor([i for i in range(len(live)) if i not in gone], dtype=torch.long,
                                device=token.device)
            cache.keep_rows(keep, max_new_tokens - step)  # the steps left + the routing-only forward
            inputs = inputs.index_select(0, keep)
            live = [live[i] for i in keep.tolist()]
    if routing:  # feed the last tokens once more, only to learn their routing
        last = net(inputs, cache=cache).routing
        routing.append(_in_rows(last, live, B))  # type: ignore[arg-type]
    return record.results(prompts, mask, routing)


_COMPACT_EVERY = 8
"""`generate` drops finished rows from its batch (and KV cache) once 1/_COMPACT_EVERY of the rows
still decoded have finished: each drop copies the cache, so it waits until it pays."""


def _in_rows(routing: Tensor, live: list[int], batch: int) -> Tensor:
    """routing (len(live), T, ...) of the rows still decoded -> (batch, T, ...) in their original rows."""
    if len(live) == batch:
        return routing
    full = routing.new_zeros((batch, *routing.shape[1:]))
    full[torch.tensor(live, dtype=torch.long, device=routing.device)] = routing
    return full


def _drafts(model: Transformer, hidden: Tensor, k: int) -> Tensor:
    """hidden (B, 1, D) at the last kept position -> greedy drafts (B, k) of the first k MTP heads."""
    return torch.cat([model.head(mtp(hidden)).argmax(-1) for mtp in model.mtp[:k]], dim=1)


@torch.no_grad()
def speculative_generate(
    model: BuiltinPolicy | Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int | None = None,
    pad_id: int = 0,
    version: int = 0,
    draft_tokens: int | None = None,
) -> tuple[list[SampledSequence], SpeculativeStats]:
    """Greedy decoding where MTP heads draft and the main head verifies (Stern et al. 2018;
    Cai et al. 2024, Medusa): the output equals `generate(..., temperature=0)` token for token.

    Each step feeds [y, d_1..d_K] (y: the main head's last greedy token, d_k: head k's guess
    for the token k after y). The main head's greedy choice after each fed token checks the next
    draft; the longest agreeing prefix d_1..d_a (a = the minimum over active rows, so rows stay
    aligned in the cache) is kept plus the main head's token after it, and the cache rolls back to
    drop the rejected drafts. logprobs are the main head's temperature-1 logprobs.
    """
    if isinstance(model, BuiltinPolicy):
        model = model.transformer
    n_heads = model.config.mtp_heads
    K = n_heads if draft_tokens is None else draft_tokens
    if not 1 <= K <= n_heads:
        raise ValueError(f"draft_tokens {K} must be in [1, mtp_heads={n_heads}]; the model needs MTP heads")
    tokens, mask = left_pad(prompts, pad_id, model.embed.weight.device)
    B, P = tokens.shape
    _check_budget(model.config.max_seq_len, P, max_new_tokens)
    cache = model.new_cache(B, P + max_new_tokens)
    stats = SpeculativeStats(forward_passes=1)
    record = _Recorder(B, eos_id)
    out = model(tokens, cache=cache, attention_mask=mask, with_mtp=False)
    routing = [out.routing] if out.routing is not None else []
    logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
    y = logp.argmax(-1)
    for b, (t, lp) in enumerate(zip(y.tolist(), logp.gather(-1, y[:, None])[:, 0].tolist(), strict=True)):
        record.add(b, t, lp, version)
    drafts = _drafts(model, out.hidden[:, -1:], K)  # type: ignore[index]
    n = 1
    while n < max_new_tokens and not record.done():
        k_eff = min(K, max_new_tokens - n - 1)
        start = cache.length
        out = model(torch.cat([y[:, None], drafts[:, :k_eff]], dim=1), cache=cache, with_mtp=False)
        stats.forward_passes += 1
        logp = torch.log_softmax(out.logits.float(), dim=-1)  # (B, 1+k, V)
        greedy = logp.argmax(-1)
        active = torch.tensor([not f for f in record.finished], device=greedy.device)
        agree = (greedy[:, :k_eff] == drafts[:, :k_eff]).long().cumprod(dim=1).sum(dim=1)
        a = int(agree[active].min()) if k_eff else 0
        n_active = int(active.sum())
        stats.drafted += k_eff * n_active
        stats.accepted += a * n_active
        kept = greedy[:, : a + 1]  # == drafts[:, :a] then the main head's next token
        kept_logp = logp[:, : a + 1].gather(-1, kept[..., None])[..., 0]
        for b in range(B):
            for t, lp in zip(kept[b].tolist(), kept_logp[b].tolist(), strict=True):
                record.add(b, t, lp, version)
        n += a + 1
        cache.truncate(start + 1 + a)
        if out.routing is not None:
            routing.append(out.routing[:, : a + 1])
        y = greedy[:, a]
        drafts = _drafts(model, out.hidden[:, a : a + 1], K)  # type: ignore[index]
    if routing:
        routing.append(model(y[:, None], cache=cache, with_mtp=False).routing)  # type: ignore[arg-type]
    stats.generated = sum(len(t) for t in record.tokens)
    return record.results(prompts, mask, routing), stats
