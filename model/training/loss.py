"""RL losses as pure functions of tensors: advantages, off-policy weights, KL, length shaping.

Owns the math the trainer composes: group-relative advantages, truncated importance weights
against behaviour logprobs, the k1 KL estimator, a convex and a concave length penalty, masked aggregation
and `rl_loss`, which puts them together. Does not own batching, logprob computation
(`rlbus.kernels.logprob`) or optimisation. Shapes: N rollouts, B sequences, T tokens.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, TypeAlias

import torch
from torch import Tensor

Aggregation: TypeAlias = Literal["token_mean", "sequence_mean", "token_sum_norm"]


def group_relative_advantages(
    rewards: Tensor, group_ids: Tensor, *, scale_by_std: bool = False, eps: float = 1e-6
) -> Tensor:
    """A_i = r_i - mean{r_j : g_j = g_i}, optionally / (std{r_j : g_j = g_i} + eps).

    rewards (N,) float, group_ids (N,) int -> (N,). GRPO (Shao et al. 2024, DeepSeekMath) divides
    by the group std; Dr. GRPO (Liu et al. 2025) shows that biases towards easy/hard groups and
    drops it, hence the default. std is the sample std (ddof=1, as TRL); a group of one has std 0,
    and a group with std + eps == 0 gets advantage 0.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_ids must both be (N,), got {tuple(rewards.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    counts = torch.bincount(inverse, minlength=n_groups).to(rewards.dtype)
    means = (
        torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
        / counts
    )
    centred = rewards - means[inverse]
    if not scale_by_std:
        return centred
    sq = torch.zeros_like(means).index_add_(0, inverse, centred**2)
    std = torch.where(counts > 1, (sq / (counts - 1).clamp_min(1)).sqrt(), torch.zeros_like(sq))
    denom = std[inverse] + eps
    return torch.where(
        denom > 0, centred / denom.clamp_min(torch.finfo(rewards.dtype).tiny), torch.zeros_like(centred)
    )


def truncated_importance_weights(logp_policy: Tensor, logp_behaviour: Tensor, cap: float) -> Tensor:
    """w_t = min(pi_theta(x_t) / mu(x_t), cap) = min(exp(logp_policy - logp_behaviour), cap), detached.

    logp_policy, logp_behaviour (B, T) -> (B, T). mu is the policy that sampled the token (possibly
    several versions old, possibly MXFP8). Truncation bounds the variance (IMPALA's rho-bar,
    Espeholt et al. 2018; truncated IS for rollout/trainer mismatch, Yao et al. 2025). The weight
    is a constant: gradients flow only through the log-probability it multiplies.
    """
    if cap <= 0:
        raise ValueError(f"importance-weight cap must be > 0, got {cap}")
    return torch.exp(logp_policy.detach() - logp_behaviour).clamp(max=cap)


def k1_kl(logp_policy: Tensor, logp_ref: Tensor) -> Tensor:
    """k1 = -log r with r = pi_ref(x_t) / pi_theta(x_t), i.e. logp_policy - logp_ref; (B, T) -> (B, T).

    For x ~ pi_theta, E[k1] = KL(pi_theta || pi_ref) (Schulman 2020, "Approximating KL divergence").
    Single samples can be negative. Differentiable in both arguments.
    """
    return logp_policy - logp_ref


def length_penalty(lengths: Tensor, budget: float, *, coef: float = 1.0, power: float = 2.0) -> Tensor:
    """P(L) = coef * max(0, L / budget - 1) ** power; lengths (N,) -> (N,) float.

    Zero within the budget, then growing as a power of the relative overshoot; convex in L for
    power >= 1 (a ReLU composed with a convex increasing power), so each extra token costs more
    than the one before. Subtract it from the reward (`shape_rewards`).
    """
    if budget <= 0 or coef < 0 or power < 1:
        raise ValueError(f"need budget > 0, coef >= 0, power >= 1; got {budget}, {coef}, {power}")
    over = (lengths.to(torch.float32) / budget - 1).clamp_min(0)
    return coef * over**power


def shape_rewards(
    rewards: Tensor, lengths: Tensor, budget: float, *, coef: float = 1.0, power: float = 2.0
) -> Tensor:
    """r_i - P(L_i) with P from `length_penalty`; rewards, lengths (N,) -> (N,)."""
    return rewards - length_penalty(lengths, budget, coef=coef, power=power).to(rewards.dtype)


def concave_cost(x: Tensor, k: float, q: float) -> Tensor:
    """C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)), and its limit log(1 + k x) / k at q = 1; x (N,) -> (N,) float.

    C(0) = 0 and C'(x) = (1 + k x)^(-q): the first unit of effort costs 1 and later ones less and less for q > 0
    (concave), so a little effort costs most on a short episode and little more on a long one. q = 0 is linear,
    q > 1 is bounded by 1 / (k (q - 1)). Computed in float64 as expm1((1 - q) log1p(k x)) / (k (1 - q)), which
    stays accurate as q -> 1 and needs no special case but q = 1 itself. x must be >= 0.
    """
    if k <= 0 or q < 0:
        raise ValueError(f"need k > 0 and q >= 0; got k={k}, q={q}")
    log1p = torch.log1p(k * x.to(torch.float64))
    a = 1.0 - q
    cost = log1p / k if a == 0 else torch.expm1(a * log1p) / (k * a)
    return cost.to(torch.float32)


def effort_penalty(counts: Tensor, weights: Tensor, *, coef: float, k: float, q: float) -> Tensor:
    """coef * C(x) with x = counts @ weights (`concave_cost`); counts (N, F) >= 0, weights (F,) >= 0 -> (N,).

    The columns are per-episode counts (tokens of each kind, tool calls, turns; actors/trainer/core.py
    `EFFORT_KEYS`), x the weighted effort of each episode. Subtract it from the reward."""
    if counts.dim() != 2 or weights.shape != counts.shape[1:]:
        raise ValueError(f"counts must be (N, F) and weights (F,), got {tuple(counts.shape)} and "
                         f"{tuple(weights.shape)}")
    if coef < 0 or bool((weights < 0).any()) or bool((counts < 0).any()):
        raise ValueError(f"need coef >= 0 and non-negative weights and counts; got coef={coef}, "
                         f"weights={weights.tolist()}")
    x = counts.to(torch.float64) @ weights.to(torch.float64)
    return coef * concave_cost(x, k, q)


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: Aggregation = "token_mean",
    *,
    norm: float | None = None,
    sequences: Tensor | None = None,
    denominator: float | None = None,
) -> Tensor:
    """Reduce per-token values (B, T) over mask (B, T) (True/1 = counts) to a scalar.

    token_mean:     sum_bt m v / sum_bt m  (every token weighs the same; DAPO, Yu et al. 2025)
    sequence_mean:  mean_b (sum_t m v / sum_t m) over sequences with a token (GRPO, Shao et al. 2024)
    token_sum_norm: sum_bt m v / norm, norm a constant, default B * T (Dr. GRPO, Liu et al. 2025)
    An empty mask gives 0. `sequences` (B,) int64 maps rows to sequences for sequence_mean, when one
    sequence spans several rows (a rollout's segments); None: each row is a sequence.
    `denominator` replaces the divisor of every mode (`global_denominator`): when `values` are one shard of a
    batch split across trainer ranks, the shards' results then add up to the whole batch's.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have one shape")
    m = mask.to(values.dtype)
    total = (values * m).sum()
    match mode:
        case "token_mean" | "token_sum_norm" if denominator is not None:
            return total / denominator
        case "token_mean":
            return total / m.sum().clamp_min(1)
        case "sequence_mean":
            per_token = m.sum(-1)
            sums = (values * m).sum(-1)
            if sequences is not None:
                n = int(sequences.max()) + 1 if sequences.numel() else 0
                per_token = per_token.new_zeros(n).index_add_(0, sequences, per_token)
                sums = sums.new_zeros(n).index_add_(0, sequences, sums)
            per_seq = sums / per_token.clamp_min(1)
            has = per_token > 0
            return per_seq[has].sum() / (has.sum().clamp_min(1) if denominator is None else denominator)
        case "token_sum_norm":
            return total / (norm if norm is not None else values.numel())
        case _:
            raise ValueError(
                f"unknown aggregation {mode!r}; expected token_mean, sequence_mean or token_sum_norm"
            )


def global_denominator(mode: Aggregation, *, tokens: int, sequences: int, elements: int) -> float:
    """What `aggregate` divides by over a whole batch, for `aggregate(..., denominator=)` on its shards.

    tokens: masked tokens of the whole batch; sequences: its sequences with at least one masked token;
    elements: B * T of its padded (B, T) layout (token_sum_norm's default norm).
    """
    match mode:
        case "token_mean":
            return float(max(tokens, 1))
        case "sequence_mean":
            return float(max(sequences, 1))
        case "token_sum_norm":
            return float(elements)
        case _:
            raise ValueError(f"unknown aggregation {mode!r}; expected token_mean, sequence_mean or token_sum_norm")


class LossTerms(NamedTuple):
    loss: Tensor
    """Scalar to backpropagate."""
    pg_loss: Tensor
    """Aggregated -w (A - beta k1) logp (scalar)."""
    kl: Tensor
    """Aggregated k1 (scalar, detached): the KL(pi_theta || pi_ref) estimate."""
    mean_weight: Tensor
    """Mean truncated IS weight over masked tokens (detached)."""
    truncated_fraction: Tensor
    """Fraction of masked tokens whose ratio exceeded the cap (detached)."""


def rl_loss(
    logp: Tensor,
    logp_behaviour: Tensor,
    logp_ref: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    is_cap: float = 2.0,
    kl_coef: float = 0.0,
    mode: Aggregation = "token_mean",
    sequences: Tensor | None = None,
    denominator: float | None = None,
) -> LossTerms:
    """Off-policy corrected policy gradient with the k1 KL folded into the per-token advantage.

    logp (B, T) current-policy logprobs of the sampled tokens (with grad); logp_behaviour,
    logp_ref (B, T); advantages (B,) per sequence or (B, T); mask (B, T) policy tokens.
        w_t = min(exp(logp_t - logp_behaviour_t), is_cap)           (detached)
        A'_t = A - kl_coef * k1_t,  k1_t = logp_t - logp_ref_t       (detached)
        loss_t = -w_t * A'_t * logp_t,   loss = aggregate(loss_t, mask, mode)
    k1 enters as a reward (its gradient, E[k1 grad logp], is grad KL), not as a loss term: the
    gradient of k1 itself has zero mean under pi_theta (Tang & Munos 2025; Zhang et al. 2025).
    `sequences` (B,): which sequence each row belongs to, for sequence_mean (`aggregate`). `denominator`: the
    whole batch's divisor when these rows are one rank's shard (`aggregate`, `global_denominator`); loss and kl
    are then that shard's part of the whole batch's (mean_weight and truncated_fraction stay the shard's own).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    if not logp.shape == logp_behaviour.shape == logp_ref.shape == advantages.shape == mask.shape:
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, behaviour {tuple(logp_behaviour.shape)}, "
            f"ref {tuple(logp_ref.shape)}, advantages {tuple(advantages.shape)}, mask {tuple(mask.shape)}"
        )
    weights = truncated_importance_weights(logp, logp_behaviour, is_cap)
    kl = k1_kl(logp.detach(), logp_ref)
    per_token = -weights * (advantages - kl_coef * kl) * logp
    pg = aggregate(per_token, mask, mode, sequences=sequences, denominator=denominator)
    m = mask.bool()
    n = m.sum().clamp_min(1)
    ratio = torch.exp(logp.detach() - logp_behaviour)
    return LossTerms(
        loss=pg,
        pg_loss=pg.detach(),
        kl=aggregate(kl, mask, mode, sequences=sequences, denominator=denominator).detach(),
        mean_weight=weights[m].sum() / n,
        truncated_fraction=(ratio[m] > is_cap).sum() / n,
    )


def lm_loss(
    logits: Tensor,
    mtp_logits: list[Tensor],
    tokens: Tensor,
    *,
    mask: Tensor | None = None,
    mtp_weight: float = 1.0,
) -> Tensor:
    """Next-token cross-entropy plus multi-token prediction (Gloeckle et al. 2024).

    logits (B, T, V) predict tokens[:, t+1]; mtp_logits[k-1] (B, T, V) predict tokens[:, t+1+k];
    tokens (B, T) int64; mask (B, T) bool marks target tokens that count (default all).
    loss = CE_main + mtp_weight * mean_k CE_k, each a token mean over its valid targets.
    """
    if mask is None:
        mask = torch.ones_like(tokens, dtype=torch.bool)

    def ce(pred: Tensor, shift: int) -> Tensor:
        target, valid = tokens[:, shift:], mask[:, shift:]
        per = torch.nn.functional.cross_entropy(
            pred[:, :-shift].flatten(0, 1).float(), target.flatten(), reduction="none"
        ).view_as(target)
        return aggregate(per, valid, "token_mean")

    main = ce(logits, 1)
    if not mtp_logits:
        return main
    return main + mtp_weight * torch.stack([ce(m, k + 2) for k, m in enumerate(mtp_logits)]).mean()
