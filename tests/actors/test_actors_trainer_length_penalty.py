"""The trainer's reward shaping: an episode's effort counts, the concave and convex penalties of
`[trainer.length_penalty]`, and the advantages a step computes from them (no bus, no model)."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.kinds import build_actor
from rlbus.actors.trainer.actor import objective
from rlbus.actors.trainer.config import EffortWeights, LengthPenaltyConfig, TrainerConfig
from rlbus.actors.trainer.core import EFFORT_KEYS, Objective, TrainerCore, effort_counts, shaped_rewards
from rlbus.actors.trainer.sharded import whole_batch
from rlbus.messages.errors import TopologyError
from rlbus.messages.schemas import Rollout, Segment, TensorBlob
from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.transformer import ModelConfig, Transformer


def _rollout(task: str, g: int, mask: list[int], *, reward: float = 1.0, segments: Sequence[list[int]] = (),
             **extra: Any) -> Rollout:
    """A rollout of prompt [1, 2] and one completion token per `mask` entry, with earlier `segments` (masks)."""
    def blobs(m: list[int]) -> dict[str, TensorBlob]:
        return {"prompt_tokens": TensorBlob.of([1, 2], "int32"), "completion_tokens": TensorBlob.of([5] * len(m), "int32"),
                "behaviour_logprobs": TensorBlob.of([-1.0] * len(m), "float32"),
                "policy_versions": TensorBlob.of([0] * len(m), "int32"), "loss_mask": TensorBlob.of(m, "uint8")}
    return Rollout(rollout_id=f"{task}-{g}", task_id=task, group_index=g, group_size=2, reward=reward,
                   segments=[Segment(**blobs(s)) for s in segments], **blobs(mask), **extra)


def test_effort_counts_of_an_agentic_episode() -> None:
    """Policy and observation tokens over every segment, the last run of policy tokens as the final message,
    tool calls and turns from the timings; recorded counts win over the fallbacks."""
    r = _rollout("t", 0, [1, 1, 0, 0, 0, 1, 1, 1, 0], segments=[[1, 1, 1, 0, 0]],
                 timings={"turns": 3.0, "tool_calls": 2.0})
    counts = dict(zip(EFFORT_KEYS, effort_counts(r), strict=True))
    assert counts == {"policy_tokens": 8.0, "tool_call_tokens": 0.0, "tool_output_tokens": 6.0, "final_tokens": 3.0,
                      "tool_calls": 2.0, "turns": 3.0}
    recorded = _rollout("t", 1, [1, 1, 1], timings={"attempts": 2.0}, tool_call_tokens=7, final_tokens=1)
    assert effort_counts(recorded) == (3.0, 7.0, 0.0, 1.0, 0.0, 2.0)
    assert effort_counts(_rollout("t", 2, [])) == (0.0, 0.0, 0.0, 0.0, 0.0, 1.0)


def test_concave_shaping_subtracts_coef_times_c_of_the_weighted_effort() -> None:
    """reward - coef * C(x), x = 1 * policy tokens + 0.5 * observation tokens + 2 * turns; coef 0 leaves rewards;
    the convex form still penalises completion length past its budget."""
    rollouts = [_rollout("a", 0, [1] * 10 + [0] * 4, timings={"turns": 2.0}), _rollout("a", 1, [1] * 30)]
    rewards = torch.tensor([1.0, 1.0])
    lengths = torch.tensor([14, 30])
    penalty = LengthPenaltyConfig(form="concave", coef=0.1, k=0.05, q=0.5,
                                  weights=EffortWeights(policy_tokens=1.0, tool_output_tokens=0.5, turns=2.0))
    x = torch.tensor([10 + 2 + 4.0, 30 + 2.0])
    cost = (torch.sqrt(1 + 0.05 * x) - 1) / (0.05 * 0.5)
    torch.testing.assert_close(shaped_rewards(rewards, lengths, rollouts, penalty), rewards - 0.1 * cost)
    off = LengthPenaltyConfig(form="concave", coef=0.0)
    assert shaped_rewards(rewards, lengths, rollouts, off) is rewards
    convex = LengthPenaltyConfig(coef=0.5, budget=20, power=2.0)
    torch.testing.assert_close(shaped_rewards(rewards, lengths, rollouts, convex), torch.tensor([1.0, 1 - 0.5 * 0.25]))


def test_a_step_prefers_the_cheaper_of_two_equal_episodes() -> None:
    """Through `objective(TrainerConfig)` and the whole-batch advantages every trainer rank computes: two passing
    episodes of one task get advantages of the cost difference, the cheaper one positive; without the penalty 0."""
    rollouts = [_rollout("a", 0, [1] * 5), _rollout("a", 1, [1] * 50)]
    config = TrainerConfig(length_penalty=LengthPenaltyConfig(form="concave", coef=0.2, k=0.1, q=1.0))
    adv = whole_batch(rollouts, objective(config)).advantages
    gap = 0.2 * (math.log1p(0.1 * 50) - math.log1p(0.1 * 5)) / 0.1
    torch.testing.assert_close(adv, torch.tensor([gap / 2, -gap / 2]))
    torch.testing.assert_close(whole_batch(rollouts, objective(TrainerConfig())).advantages, torch.zeros(2))


def test_the_trainer_core_step_applies_the_penalty() -> None:
    """Two passing episodes of one task, 2 and 6 policy tokens: without a penalty their advantages are 0 and the
    step leaves every weight as it was; with the concave penalty the same step moves the weights."""
    rollouts = [_rollout("a", 0, [1, 1]), _rollout("a", 1, [1] * 6)]
    moved = []
    for penalty in (LengthPenaltyConfig(), LengthPenaltyConfig(form="concave", coef=0.5, k=0.5, q=1.0)):
        torch.manual_seed(0)
        model = Transformer(ModelConfig.tiny(vocab_size=264))
        core = TrainerCore(BuiltinPolicy(model), BuiltinPolicy(copy.deepcopy(model)), lr=1e-2)
        before = {k: t.detach().clone() for k, t in core.policy.named_tensors().items()}
        stats = core.train_step(rollouts, Objective(kl_coef=0.0, grad_clip=0.0, length_penalty=penalty))
        assert stats.applied and stats.reward_mean == 1.0
        moved.append(any(not torch.equal(before[k], t) for k, t in core.policy.named_tensors().items()))
    assert moved == [False, True]


@pytest.mark.parametrize(("settings", "key"), [
    ({"k": 0.0}, "trainer.length_penalty.k"),
    ({"k": -1.0}, "trainer.length_penalty.k"),
    ({"q": -0.5}, "trainer.length_penalty.q"),
    ({"weights": {"turns": -1.0}}, "trainer.length_penalty.weights.turns"),
    ({"weights": {"policy_tokens": -0.1}}, "trainer.length_penalty.weights.policy_tokens"),
    ({"weights": {"tokens": 1.0}}, "trainer.length_penalty.weights"),
    ({"form": "cubic"}, "trainer.length_penalty.form"),
])
def test_bad_penalty_settings_are_refused_naming_the_key(settings: dict[str, Any], key: str) -> None:
    """k <= 0, q < 0, a negative or unknown weight and an unknown form: a TopologyError naming the key."""
    ident = ActorId(run="t", region="hub", kind="trainer", actor_id="hub-trainer-0")
    limits = ActorLimits(heartbeat_interval_s=1.0, drain_timeout_s=1.0)
    with pytest.raises(TopologyError, match=key.replace(".", r"\.")):
        build_actor("trainer", ident, None, {"length_penalty": settings}, limits)  # type: ignore[arg-type]
