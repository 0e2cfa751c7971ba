"""model/sampling/scores.py: the unbiased pass@k against hand-computed binomials, its bootstrap interval (seeded,
holding the estimate, degenerate where every task agrees) and the report keys overall and per group."""

from __future__ import annotations

import pytest

from rlbus.model.sampling.evaluate import wilson_interval
from rlbus.model.sampling.scores import grouped_scores, pass_at_k, pass_at_k_interval, scores


def test_pass_at_k_is_one_minus_the_chance_that_k_draws_all_fail() -> None:
    """n=5, c=2: 1 - C(3,k)/C(5,k) = 1 - 3/5, 1 - 3/10, 1 - 1/10, 1 - 0/5, 1 - 0/1."""
    assert [pass_at_k(5, 2, k) for k in range(1, 6)] == pytest.approx([0.4, 0.7, 0.9, 1.0, 1.0])
    assert [pass_at_k(5, 0, k) for k in range(1, 6)] == [0.0] * 5
    assert [pass_at_k(5, 5, k) for k in range(1, 6)] == [1.0] * 5
    assert pass_at_k(256, 1, 1) == pytest.approx(1 / 256) and pass_at_k(256, 1, 256) == 1.0
    for n, c, k in ((5, 6, 1), (5, 2, 0), (5, 2, 6), (5, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_the_bootstrap_interval_is_seeded_and_holds_the_estimate() -> None:
    passes = [0, 1, 2, 5, 3, 0, 4, 2, 1, 5]
    report = scores([c >= 3 for c in passes], passes, 5)
    ci = pass_at_k_interval(passes, 5, seed=7)
    assert ci == pass_at_k_interval(passes, 5, seed=7) and ci != pass_at_k_interval(passes, 5, seed=8)
    assert list(ci) == ["1", "2", "3", "4", "5"]
    for k, (low, high) in ci.items():
        assert 0.0 <= low < report["pass_at_k"][k] < high <= 1.0, (k, low, high)
    assert pass_at_k_interval([0, 0, 0], 2) == {"1": [0.0, 0.0], "2": [0.0, 0.0]}
    assert pass_at_k_interval([2, 2], 2) == {"1": [1.0, 1.0], "2": [1.0, 1.0]}
    assert pass_at_k_interval([], 2) == {"1": [0.0, 1.0], "2": [0.0, 1.0]}


def test_scores_report_greedy_mean_and_pass_at_k_overall_and_per_group() -> None:
    """Two tasks of n=5 samples with 2 and 0 passes: mean@5 = 2/10, pass@k the mean of (0.4, 0.7, 0.9, 1, 1)
    and zeros; greedy 1 of 2 with its Wilson interval."""
    total, per = grouped_scores(["a/1", "b/1", "a/1"], [True, False, False], [2, 0, 5], 5)
    assert (total["n"], total["greedy_passed"], total["pass_at_1"]) == (3, 1, 1 / 3)
    assert total["ci95"] == list(wilson_interval(1, 3))
    assert total["mean_at_k"] == total["sampled_pass_at_1"] == 7 / 15
    assert [total["pass_at_k"][str(k)] for k in range(1, 6)] == pytest.approx(
        [(0.4 + 1) / 3, (0.7 + 1) / 3, (0.9 + 1) / 3, 2 / 3, 2 / 3])
    assert list(per) == ["a/1", "b/1"] and per["b/1"]["pass_at_k"] == {str(k): 0.0 for k in range(1, 6)}
    assert per["a/1"]["pass_at_k"]["1"] == pytest.approx(0.7) and per["a/1"]["mean_at_k"] == 0.7
    assert per["b/1"]["pass_at_k_ci95"]["3"] == [0.0, 0.0]
    greedy_only, per = grouped_scores(["a/1"], [False], None, 0)
    assert greedy_only == {"n": 1, "greedy_passed": 0, "pass_at_1": 0.0, "ci95": [0.0, wilson_interval(0, 1)[1]]}
    with pytest.raises(ValueError, match="same tasks"):
        grouped_scores(["a/1"], [True, False], None, 0)
    with pytest.raises(ValueError, match="count from 0"):
        scores([True], [3], 2)
