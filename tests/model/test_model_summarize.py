"""Self-summarisation: history over budget is replaced by the policy's own summary."""

from __future__ import annotations

import pytest
import torch

from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling.generate import generate
from rlbus.model.sampling.summarize import Trajectory, summarize_if_over_budget

torch.set_num_threads(1)
PROMPT = [1, 2, 3, 4]
SUMMARY_PROMPT = [9, 9, 8]


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny(tie_embeddings=False, max_seq_len=64)).eval()


def test_within_budget_nothing_happens() -> None:
    """A context at or under its budget is left alone."""
    assert (
        summarize_if_over_budget(
            _model(),
            list(range(20)),
            budget=20,
            keep_prefix=4,
            summary_prompt=SUMMARY_PROMPT,
            max_summary_tokens=5,
            eos_id=None,
        )
        is None
    )


def test_summary_replaces_history_and_joins_the_trajectory() -> None:
    """Over budget: new context = prefix + instruction + summary; only the summary is policy-masked."""
    model = _model()
    context = PROMPT + list(range(20, 50))  # 34 tokens > budget 24
    trajectory = Trajectory()
    trajectory.add_context(context)
    summary = summarize_if_over_budget(
        model,
        context,
        budget=24,
        keep_prefix=4,
        summary_prompt=SUMMARY_PROMPT,
        max_summary_tokens=6,
        eos_id=None,
        temperature=0,
        version=3,
    )
    assert summary is not None
    expected = generate(model, [context + SUMMARY_PROMPT], max_new_tokens=6, temperature=0)[0]
    assert summary.source == context + SUMMARY_PROMPT
    assert summary.sample.tokens.tolist() == expected.tokens.tolist()
    assert summary.context == PROMPT + SUMMARY_PROMPT + expected.tokens.tolist()
    assert len(summary.context) <= 24
    summary.record_into(trajectory, SUMMARY_PROMPT)
    tokens, policy, logprobs, versions = trajectory.tensors()
    assert tokens.tolist() == context + SUMMARY_PROMPT + expected.tokens.tolist()
    assert policy.tolist() == [False] * 37 + [True] * 6
    assert versions.tolist() == [-1] * 37 + [3] * 6
    torch.testing.assert_close(logprobs[37:], expected.logprobs)


def test_too_long_history_is_trimmed_after_the_prefix() -> None:
    """A history the model cannot read whole keeps its prefix and its newest tokens."""
    context = PROMPT + list(range(100, 180))  # 84 tokens > max_seq_len 64
    summary = summarize_if_over_budget(
        _model(),
        context,
        budget=30,
        keep_prefix=4,
        summary_prompt=SUMMARY_PROMPT,
        max_summary_tokens=10,
        eos_id=None,
        temperature=0,
    )
    assert summary is not None
    room = 64 - 3 - 10 - 4
    assert summary.source == PROMPT + context[-room:] + SUMMARY_PROMPT
    assert len(summary.source) + 10 == 64


def test_summary_that_cannot_fit_the_budget_is_refused() -> None:
    """prefix + instruction + max summary longer than the budget raises ValueError."""
    with pytest.raises(ValueError, match="budget"):
        summarize_if_over_budget(
            _model(),
            list(range(40)),
            budget=20,
            keep_prefix=10,
            summary_prompt=SUMMARY_PROMPT,
            max_summary_tokens=10,
            eos_id=None,
        )
