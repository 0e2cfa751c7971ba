"""Held-out scores from pass counts: greedy pass@1, mean@K, unbiased pass@k with bootstrap intervals, per group.

Owns: `pass_at_k` (the unbiased estimator of Chen et al. 2021), `pass_at_k_interval` (a seeded percentile
bootstrap over tasks), `scores` (the keys `rlbus eval` reports for one set of tasks) and `grouped_scores` (those
keys overall and per group).
Does not: generate, grade or run episodes (model/sampling/evaluate.py, actors/common/agentic_eval.py, ops/eval.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from rlbus.model.sampling.evaluate import wilson_interval

RESAMPLES: Final = 1000
"""Bootstrap resamples of the tasks for each pass@k interval."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of `k` of `n` samples, drawn without replacement, is among the `c` that pass:
    1 - C(n-c, k) / C(n, k) (exact integer binomials, so any n is safe)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _per_task(passes: Sequence[int], samples: int) -> np.ndarray:
    """tasks x K: row t, column k-1 holds pass@k of task t."""
    table = [[pass_at_k(samples, c, k) for k in range(1, samples + 1)] for c in range(samples + 1)]
    return np.array([table[c] for c in passes], dtype=np.float64).reshape(len(passes), samples)


def pass_at_k_interval(passes: Sequence[int], samples: int, *, resamples: int = RESAMPLES, seed: int = 0,
                       level: float = 0.95) -> dict[str, list[float]]:
    """{"k": [low, high]} for k = 1..`samples`: the percentile interval of mean pass@k over `resamples` resamples
    of the tasks with replacement (one seeded draw shared by every k). No task gives [0, 1]."""
    if not passes:
        return {str(k): [0.0, 1.0] for k in range(1, samples + 1)}
    values = _per_task(passes, samples)
    rng = np.random.default_rng(seed)
    n = len(passes)
    weights = rng.multinomial(n, np.full(n, 1.0 / n), size=resamples)    # resamples x tasks: times each is drawn
    means = weights @ values / n                                          # resamples x K
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail], axis=0)
    return {str(k): [float(low[k - 1]), float(high[k - 1])] for k in range(1, samples + 1)}


def scores(greedy: Sequence[bool], passes: Sequence[int] | None, samples: int, *, seed: int = 0) -> dict[str, Any]:
    """The scores of one set of tasks: n, greedy_passed, pass_at_1 (greedy) and ci95 (its Wilson interval); with
    `passes` (per task, how many of `samples` samples passed) also mean_at_k (the mean pass rate of the samples;
    sampled_pass_at_1 is the same number), pass_at_k ({"k": unbiased pass@k averaged over tasks}) and
    pass_at_k_ci95 (`pass_at_k_interval`)."""
    n, won = len(greedy), sum(bool(g) for g in greedy)
    low, high = wilson_interval(won, n)
    out: dict[str, Any] = {"n": n, "greedy_passed": won, "pass_at_1": won / max(1, n), "ci95": [low, high]}
    if passes is None:
        return out
    if len(passes) != n or samples < 1 or not all(0 <= c <= samples for c in passes):
        raise ValueError(f"passes must hold, for each of the {n} tasks, a count from 0 to samples ({samples})")
    mean = sum(passes) / max(1, n * samples)
    values = _per_task(passes, samples)
    at_k = values.mean(axis=0) if n else np.zeros(samples)
    out.update(mean_at_k=mean, sampled_pass_at_1=mean,
               pass_at_k={str(k): float(at_k[k - 1]) for k in range(1, samples + 1)},
               pass_at_k_ci95=pass_at_k_interval(passes, samples, seed=seed))
    return out


def grouped_scores(groups: Sequence[str], greedy: Sequence[bool], passes: Sequence[int] | None, samples: int, *,
                   seed: int = 0) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """`scores` over all tasks, and per group (sorted by name) over that group's tasks."""
    if len(groups) != len(greedy) or (passes is not None and len(passes) != len(greedy)):
        raise ValueError("groups, greedy and passes must cover the same tasks")
    members: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    per = {group: scores([greedy[i] for i in rows], None if passes is None else [passes[i] for i in rows],
                         samples, seed=seed)
           for group, rows in sorted(members.items())}
    return scores(greedy, passes, samples, seed=seed), per


__all__ = ["RESAMPLES", "grouped_scores", "pass_at_k", "pass_at_k_interval", "scores"]
