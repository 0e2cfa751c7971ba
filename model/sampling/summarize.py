"""Multi-turn trajectories and self-summarisation of a history that outgrows its token budget.

Owns `Trajectory` (tokens with a policy mask, behaviour logprobs and versions, built turn by
turn) and `summarize_if_over_budget`, which prompts the policy to summarise and replaces the
history with the summary. Does not own the wording of the summary prompt (the tokenizer/tasks
side passes it in as token ids) or the episode loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlbus.model.policies.interface import Policy, as_policy
from rlbus.model.policies.quant import WeightQuant
from rlbus.model.policies.transformer import Transformer
from rlbus.model.sampling.generate import SampledSequence, SwapHook, generate


@dataclass
class Trajectory:
    """Every token an episode produced, in order. policy_mask marks tokens the policy sampled
    (these carry a behaviour logprob and version and enter the loss); prompts, observations and
    summary instructions are False, with logprob 0.0 and version -1."""

    tokens: list[int] = field(default_factory=list)
    policy_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add_context(self, tokens: Sequence[int]) -> None:
        """Append tokens the policy did not generate (prompt, observation, instruction)."""
        self.tokens.extend(tokens)
        self.policy_mask.extend([False] * len(tokens))
        self.logprobs.extend([0.0] * len(tokens))
        self.versions.extend([-1] * len(tokens))

    def add_sample(self, sample: SampledSequence) -> None:
        """Append a sampled completion (its prompt is assumed to be in the trajectory already)."""
        self.tokens.extend(sample.tokens.tolist())
        self.policy_mask.extend([True] * len(sample.tokens))
        self.logprobs.extend(sample.logprobs.tolist())
        self.versions.extend(sample.versions.tolist())

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(tokens int64, policy_mask bool, logprobs float32, versions int64), each (L,)."""
        return (
            torch.tensor(self.tokens, dtype=torch.long),
            torch.tensor(self.policy_mask, dtype=torch.bool),
            torch.tensor(self.logprobs, dtype=torch.float32),
            torch.tensor(self.versions, dtype=torch.long),
        )


@dataclass(frozen=True)
class Summary:
    """The result of a self-summarisation."""

    context: list[int]
    """The new history: context[:keep_prefix] + summary_prompt + summary tokens."""
    source: list[int]
    """What the policy read when it wrote the summary (old history, possibly middle-trimmed,
    then summary_prompt): the prompt to replay when training on the summary tokens."""
    sample: SampledSequence
    """The summary as sampled: tokens, behaviour logprobs, versions, routing over source + tokens."""

    def record_into(self, trajectory: Trajectory, summary_prompt: Sequence[int]) -> None:
        """Append the instruction (policy_mask False) and the summary (True) to a trajectory."""
        trajectory.add_context(summary_prompt)
        trajectory.add_sample(self.sample)


def summarize_if_over_budget(
    model: Policy | Transformer,
    context: Sequence[int],
    *,
    budget: int,
    keep_prefix: int,
    summary_prompt: Sequence[int],
    max_summary_tokens: int,
    eos_id: int | None,
    temperature: float = 1.0,
    version: int = 0,
    on_step: SwapHook | None = None,
    generator: torch.Generator | None = None,
    weight_quant: WeightQuant = "none",
) -> Summary | None:
    """None when len(context) <= budget; otherwise the policy summarises and the history shrinks.

    The policy reads context + summary_prompt and writes at most max_summary_tokens; the new
    context keeps the first keep_prefix tokens (the task statement), then summary_prompt and the
    summary, so it always fits the budget. If the old context is too long for the model to read
    with room to write, its oldest tokens after keep_prefix are dropped from what it reads.
    """
    if len(context) <= budget:
        return None
    if not 0 <= keep_prefix <= len(context):
        raise ValueError(f"keep_prefix {keep_prefix} must be within the context of {len(context)} tokens")
    if keep_prefix + len(summary_prompt) + max_summary_tokens > budget:
        raise ValueError(
            f"keep_prefix {keep_prefix} + summary prompt {len(summary_prompt)} + "
            f"max_summary_tokens {max_summary_tokens} must fit the budget {budget}"
        )
    max_seq_len = as_policy(model).max_seq_len
    room = max_seq_len - len(summary_prompt) - max_summary_tokens - keep_prefix
    if room < 0:
        raise ValueError(
            f"max_seq_len {max_seq_len} cannot hold the prefix, summary prompt "
            f"and {max_summary_tokens} summary tokens"
        )
    history = list(context[keep_prefix:])
    source = list(context[:keep_prefix]) + history[max(0, len(history) - room) :] + list(summary_prompt)
    sample = generate(
        model,
        [source],
        max_new_tokens=max_summary_tokens,
        temperature=temperature,
        eos_id=eos_id,
        version=version,
        on_step=on_step,
        generator=generator,
        weight_quant=weight_quant,
    )[0]
    new_context = list(context[:keep_prefix]) + list(summary_prompt) + sample.tokens.tolist()
    return Summary(context=new_context, source=source, sample=sample)
