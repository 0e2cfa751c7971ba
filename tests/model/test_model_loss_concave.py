"""The concave length penalty C(x) = ((1 + kx)^(1-q) - 1) / (k (1-q)) against its defining properties."""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.model.training.loss import concave_cost, effort_penalty

GRID = torch.linspace(0, 2000, 401)


@pytest.mark.parametrize("q", [0.0, 0.3, 0.5, 1.0, 1.7])
def test_concave_cost_is_zero_at_zero_and_increasing(q: float) -> None:
    """C(0) = 0 and C strictly increases over a grid of efforts, whatever the curvature q >= 0."""
    cost = concave_cost(GRID, 0.01, q)
    assert float(cost[0]) == 0.0
    assert bool((cost[1:] > cost[:-1]).all())


@pytest.mark.parametrize("q", [0.3, 0.5, 1.0, 1.7])
def test_concave_cost_is_concave_for_positive_q(q: float) -> None:
    """Second differences are negative over the grid for q > 0: each extra unit of effort costs less."""
    cost = concave_cost(GRID, 0.01, q).double()
    assert bool((cost[2:] - 2 * cost[1:-1] + cost[:-2] < 0).all())


def test_q_zero_is_linear_and_slope_at_zero_is_one() -> None:
    """q = 0 gives C(x) = x; for any q the first unit costs about 1 (C'(0) = 1)."""
    torch.testing.assert_close(concave_cost(GRID, 0.05, 0.0), GRID)
    for q in (0.5, 1.0, 2.0):
        assert concave_cost(torch.tensor([1e-4]), 0.05, q).item() == pytest.approx(1e-4, rel=1e-3)


def test_matches_the_log_limit_as_q_goes_to_one() -> None:
    """C at q = 1 is log(1 + kx)/k exactly, and C at q = 1 -/+ 1e-9 agrees with it (no division by zero)."""
    k = 0.02
    log_limit = torch.log1p(k * GRID.double()) / k
    torch.testing.assert_close(concave_cost(GRID, k, 1.0).double(), log_limit, rtol=1e-6, atol=1e-6)
    for q in (1 - 1e-9, 1 + 1e-9, 1 - 1e-4):
        near = concave_cost(GRID, k, q).double()
        assert bool(torch.isfinite(near).all())
        torch.testing.assert_close(near, log_limit, rtol=1e-3, atol=1e-4)
    assert concave_cost(torch.tensor([100.0]), k, 0.5).item() == pytest.approx(
        (math.sqrt(1 + k * 100) - 1) / (k * 0.5), rel=1e-6)


def test_effort_penalty_weighs_the_counts() -> None:
    """x = counts @ weights, penalty = coef * C(x); bad k, q, coef or weights are refused."""
    counts = torch.tensor([[10.0, 2.0, 0.0], [0.0, 0.0, 0.0], [100.0, 1.0, 5.0]])
    weights = torch.tensor([1.0, 0.0, 4.0])
    x = torch.tensor([10.0, 0.0, 120.0])
    torch.testing.assert_close(effort_penalty(counts, weights, coef=0.5, k=0.1, q=1.0),
                               0.5 * torch.log1p(0.1 * x) / 0.1)
    for bad in ({"k": 0.0, "q": 0.5}, {"k": 0.1, "q": -0.1}):
        with pytest.raises(ValueError, match="need k > 0 and q >= 0"):
            effort_penalty(counts, weights, coef=1.0, **bad)
    with pytest.raises(ValueError, match="non-negative weights"):
        effort_penalty(counts, -weights, coef=1.0, k=0.1, q=0.5)
    with pytest.raises(ValueError, match=r"\(N, F\)"):
        effort_penalty(counts, weights[:2], coef=1.0, k=0.1, q=0.5)
