"""A synthetic rollout source for trainer tests: groups sampled from a real model with `model.generate`,
made-up rewards (share of even token ids), the generator's id scheme (`<task>-<g>`) and per-token versions."""

from __future__ import annotations

import torch

from rlbus.messages.schemas import Rollout, TensorBlob
from rlbus.model.policies.interface import Policy, as_policy
from rlbus.model.policies.transformer import Transformer
from rlbus.model.sampling.generate import generate


def sample_rollouts(model: Policy | Transformer, *, tasks: int, group_size: int, version: int = 0, seed: int = 0,
                    prompt_len: int = 6, max_new_tokens: int = 6, tag: str = "task",
                    versions: int | None = None, temperature: float = 1.0) -> list[Rollout]:
    """`tasks` groups of `group_size` rollouts sampled at `temperature` (default 1) from `model` (its weights are
    `version`; `versions` overrides the per-token version recorded, e.g. to fake stale rollouts)."""
    policy = as_policy(model)
    gen = torch.Generator(device=policy.device).manual_seed(seed)
    vocab = min(policy.vocab_size, 250)
    out: list[Rollout] = []
    for t in range(tasks):
        prompt = torch.randint(1, vocab, (prompt_len,), generator=gen, device=policy.device).tolist()
        samples = generate(model, [prompt] * group_size, max_new_tokens=max_new_tokens, temperature=temperature,
                           version=version, generator=gen)
        task_id = f"{tag}-{seed}-{t}"
        for g, s in enumerate(samples):
            n = len(s.tokens)
            recorded = s.versions.tolist() if versions is None else [versions] * n
            out.append(Rollout(
                rollout_id=f"{task_id}-{g}", task_id=task_id, group_index=g, group_size=group_size,
                prompt_tokens=TensorBlob.of(prompt, "int32"),
                completion_tokens=TensorBlob.of(s.tokens.tolist(), "int32"),
                behaviour_logprobs=TensorBlob.of(s.logprobs.tolist(), "float32"),
                policy_versions=TensorBlob.of(recorded, "int32"),
                loss_mask=TensorBlob.of([1] * n, "uint8"),
                routing=None if s.routing is None else TensorBlob.of(s.routing.numpy(), "int64"),
                reward=float((s.tokens % 2 == 0).float().mean()) if n else 0.0,
                region="hub", generator_id="test"))
    return out
