"""RL loss functions against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.model.training.loss import (
    aggregate,
    group_relative_advantages,
    k1_kl,
    length_penalty,
    lm_loss,
    rl_loss,
    shape_rewards,
    truncated_importance_weights,
)

LN2 = math.log(2.0)


def test_advantages_are_centred_per_group() -> None:
    """A = r - group mean: groups {1,0,0} and {3,5}."""
    adv = group_relative_advantages(torch.tensor([1.0, 0.0, 0.0, 3.0, 5.0]), torch.tensor([7, 7, 7, 9, 9]))
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0]))


def test_advantages_scaled_by_sample_std() -> None:
    """Group {1,0,0}: std sqrt(1/3); group {3,5}: std sqrt(2); a singleton group gets 0."""
    adv = group_relative_advantages(
        torch.tensor([1.0, 0.0, 0.0, 3.0, 5.0, 4.0]),
        torch.tensor([0, 0, 0, 1, 1, 2]),
        scale_by_std=True,
        eps=0.0,
    )
    s1, s2 = math.sqrt(1 / 3), math.sqrt(2.0)
    torch.testing.assert_close(
        adv, torch.tensor([(2 / 3) / s1, (-1 / 3) / s1, (-1 / 3) / s1, -1 / s2, 1 / s2, 0.0])
    )


def test_truncated_importance_weights() -> None:
    """Ratios 0.5/0.25, 0.2/0.4, 0.9/0.3 = 2, 0.5, 3 become 2, 0.5, 2.5 at cap 2.5, detached."""
    logp = torch.tensor([0.5, 0.2, 0.9]).log().requires_grad_()
    w = truncated_importance_weights(logp, torch.tensor([0.25, 0.4, 0.3]).log(), cap=2.5)
    torch.testing.assert_close(w, torch.tensor([2.0, 0.5, 2.5]))
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(logp, logp, cap=0.0)


def test_k1_is_minus_log_ref_over_policy_and_unbiased() -> None:
    """k1(0.5 vs ref 0.25) = ln 2; its mean under pi=[.5,.5], ref=[.25,.75] is KL = 0.5 ln(4/3)."""
    pi, ref = torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.75])
    k1 = k1_kl(pi.log(), ref.log())
    torch.testing.assert_close(k1[0], torch.tensor(LN2))
    torch.testing.assert_close((pi * k1).sum(), torch.tensor(0.5 * math.log(4 / 3)))


def test_length_penalty_shapes() -> None:
    """budget 100, coef 0.5: p=2 gives 0, 0, 0.125, 2.0 for L = 50, 100, 150, 300; p=1 gives 0.25, 1.0."""
    lengths = torch.tensor([50, 100, 150, 300])
    torch.testing.assert_close(
        length_penalty(lengths, 100, coef=0.5, power=2), torch.tensor([0.0, 0.0, 0.125, 2.0])
    )
    torch.testing.assert_close(
        length_penalty(lengths, 100, coef=0.5, power=1), torch.tensor([0.0, 0.0, 0.25, 1.0])
    )
    torch.testing.assert_close(
        shape_rewards(torch.ones(4), lengths, 100, coef=0.5, power=2), torch.tensor([1.0, 1.0, 0.875, -1.0])
    )
    curve = length_penalty(torch.arange(0, 400, 10), 100, coef=1.0, power=1.5)
    assert bool((curve[2:] - 2 * curve[1:-1] + curve[:-2] >= -1e-6).all())  # convex
    with pytest.raises(ValueError, match="power"):
        length_penalty(lengths, 100, power=0.5)


def test_aggregation_modes() -> None:
    """values [[1,2,3],[4,5,6]], mask [[1,1,0],[1,0,0]]: 7/3, (1.5+4)/2, 7/6, 7/10."""
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    torch.testing.assert_close(aggregate(values, mask, "token_mean"), torch.tensor(7 / 3))
    torch.testing.assert_close(aggregate(values, mask, "sequence_mean"), torch.tensor(2.75))
    torch.testing.assert_close(aggregate(values, mask, "token_sum_norm"), torch.tensor(7 / 6))
    torch.testing.assert_close(aggregate(values, mask, "token_sum_norm", norm=10), torch.tensor(0.7))
    empty_row = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    torch.testing.assert_close(aggregate(values, empty_row, "sequence_mean"), torch.tensor(1.5))
    torch.testing.assert_close(aggregate(values, torch.zeros_like(mask), "token_mean"), torch.tensor(0.0))


def test_rl_loss_value_and_gradient_by_hand() -> None:
    """Two tokens, pi=(.5,.2), mu=(.25,.4), ref=(.5,.1), A=2, cap 1.5, beta 0.1: loss and d/dlogp."""
    logp = torch.tensor([[0.5, 0.2]]).log().requires_grad_()
    terms = rl_loss(
        logp,
        torch.tensor([[0.25, 0.4]]).log(),
        torch.tensor([[0.5, 0.1]]).log(),
        torch.tensor([2.0]),
        torch.ones(1, 2, dtype=torch.bool),
        is_cap=1.5,
        kl_coef=0.1,
    )
    w = [1.5, 0.5]  # min(2, 1.5), min(0.5, 1.5)
    adv = [2.0 - 0.1 * 0.0, 2.0 - 0.1 * LN2]  # k1 = ln(.5/.5), ln(.2/.1)
    per = [-w[0] * adv[0] * math.log(0.5), -w[1] * adv[1] * math.log(0.2)]
    torch.testing.assert_close(terms.loss, torch.tensor(sum(per) / 2))
    torch.testing.assert_close(terms.kl, torch.tensor(LN2 / 2))
    torch.testing.assert_close(terms.mean_weight, torch.tensor(1.0))
    torch.testing.assert_close(terms.truncated_fraction, torch.tensor(0.5))
    terms.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-w[0] * adv[0] / 2, -w[1] * adv[1] / 2]]))


def test_lm_loss_by_hand() -> None:
    """Logits favouring the target by 2 nats give log(1 + e^-2) per token; uniform MTP logits ln 2."""
    tokens = torch.tensor([[0, 0, 0]])
    logits = torch.tensor([[[2.0, 0.0]] * 3])
    uniform = torch.zeros(1, 3, 2)
    expected = math.log(1 + math.exp(-2)) + 0.5 * LN2
    torch.testing.assert_close(lm_loss(logits, [uniform], tokens, mtp_weight=0.5), torch.tensor(expected))
