"""`[trainer] mtp_distill`: an RL step that also distils the built-in policy's MTP heads from its main head, at the
positions generators draft from (read off the RL forward, whether it runs each prompt once or not), moves the heads
(only them) and lowers their distillation loss on the step's batch; at 0 the heads stay as they were. A policy the
key cannot serve is refused naming it, at the trainer and in `rlbus validate`."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers.rollouts import sample_rollouts

from rlbus.actors.trainer.actor import build_trainer_core
from rlbus.actors.trainer.config import TrainerConfig
from rlbus.actors.trainer.core import (
    Objective,
    RolloutBatch,
    TrainerCore,
    completion_windows,
    hidden_states,
    rollout_batch,
    shared_prompt_logprobs,
)
from rlbus.messages.errors import TopologyError
from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.training.mtp import distill_loss
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import validate


def _cores() -> tuple[TrainerCore, TrainerCore]:
    """Two equal cores of a tiny policy with 2 MTP heads (fresh heads draft the main head's next token)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=264, mtp_heads=2))
    return tuple(TrainerCore(BuiltinPolicy(copy.deepcopy(model)), BuiltinPolicy(copy.deepcopy(model)), lr=1e-3)
                 for _ in range(2))  # type: ignore[return-value]


def _heads_loss(core: TrainerCore, batch: RolloutBatch) -> float:
    """The heads' `distill_loss` where generators draft from, through a full forward of the batch."""
    with torch.no_grad(), hidden_states(core.policy) as seen:
        core.policy(batch.tokens)
    hidden, real = completion_windows(batch, seen)
    with torch.no_grad():
        return float(distill_loss(core.model.head(hidden), core.model.mtp_head_logits(hidden), real)[0])


def test_the_drafting_positions_are_those_of_the_full_forward_when_groups_share_a_prompt() -> None:
    """`completion_windows` of the RL forward that runs each prompt once equals that of a full forward."""
    core, _ = _cores()
    batch = rollout_batch(sample_rollouts(core.model, tasks=2, group_size=3, max_new_tokens=7))
    with torch.no_grad(), hidden_states(core.policy) as shared:
        assert shared_prompt_logprobs(core.policy, batch) is not None
    with torch.no_grad(), hidden_states(core.policy) as full:
        core.policy(batch.tokens)
    assert (len(shared), len(full)) == (2, 1)
    (a, real_a), (b, real_b) = completion_windows(batch, shared), completion_windows(batch, full)
    assert torch.equal(real_a, real_b) and int(real_a.sum()) == int(batch.lengths.sum()) + len(batch.lengths)
    torch.testing.assert_close(a[real_a], b[real_b], atol=1e-5, rtol=1e-4)


def test_a_step_with_mtp_distill_trains_the_heads_alone_and_lowers_their_loss() -> None:
    plain, distilled = _cores()
    rollouts = sample_rollouts(plain.model, tasks=2, group_size=2, max_new_tokens=8)
    batch = rollout_batch(rollouts)
    before = _heads_loss(distilled, batch)
    heads = {n: p.detach().clone() for n, p in plain.model.named_parameters() if n.startswith("mtp.")}
    assert plain.train_step(rollouts, Objective()).mtp_distill_loss is None
    stats = distilled.train_step(rollouts, Objective(mtp_distill=1.0))
    assert stats.applied and stats.mtp_distill_loss == pytest.approx(before, rel=1e-4)
    after_plain = dict(plain.model.named_parameters())
    after = dict(distilled.model.named_parameters())
    for name, value in after_plain.items():
        if name.startswith("mtp."):      # at 0 the heads do not change; with the key they do
            assert torch.equal(value, heads[name]), name
            assert not torch.equal(after[name], heads[name]) or name.endswith("norm.weight"), name
        else:                            # the trunk takes the same RL step either way
            assert torch.equal(value, after[name]), name
    assert any(not torch.equal(after[n], heads[n]) for n in heads)
    assert _heads_loss(distilled, batch) < min(before, _heads_loss(plain, batch))   # same trunk, heads closer to it


def test_mtp_distill_without_heads_is_refused_naming_the_key(tmp_path: Path) -> None:
    """The fresh built-in policy has no heads (refused when the trainer builds its core); a Hugging Face policy's
    heads are not part of a version (refused by `rlbus validate`), nor can several ranks distil them."""
    with pytest.raises(TopologyError, match=r"trainer\.mtp_distill = 0\.5: the built-in policy has no MTP heads"):
        build_trainer_core(TrainerConfig(mtp_distill=0.5), threads=1)
    assert build_trainer_core(TrainerConfig(), threads=1).policy.kind == "builtin"
    text = example_path("tiny").read_text().replace("[trainer]\n", "[trainer]\nmtp_distill = 0.5\nworld_size = 2\n", 1)
    text = text.replace('run = "tiny"', 'run = "tiny"\n\n[policy]\nkind = "hf"\n[policy.recipe]\nsize = "tiny"\n', 1)
    (tmp_path / "run.toml").write_text(text)
    _, problems = validate(tmp_path / "run.toml")
    found = [p.message for p in problems if p.key == "trainer.mtp_distill" and p.severity == "error"]
    assert len(found) == 2 and "Hugging Face" in found[0] and "world_size 2" in found[1], problems
