"""Held-out scores as an `EvalReport`, and back as the plain keys `rlbus eval` prints.

- Owns: `scored_report` (greedy verdicts, sampled pass counts and episode costs of one version → `EvalReport`),
  `episodes_report` (the same from agentic episodes: greedy ones, then K sampled per task) and `report_keys`
  (an `EvalReport` as a JSON object with `rlbus eval --json`'s keys). Used by the evaluator
  (actors/evaluator.py) and the closing evaluation of `rlbus up` (ops/final_eval.py), so both score alike.
- Does not: run episodes or grade (actors/common/agentic_eval.py), or estimate (model/sampling/scores.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlbus.actors.common.agentic_eval import EpisodeResult
from rlbus.messages.schemas import EvalReport, LevelScore
from rlbus.model.sampling.scores import grouped_scores

COST_KEYS = ("turns", "tool_calls", "policy_tokens", "observation_tokens", "wall_s")
"""What a greedy agentic episode costs; the report holds the mean of each (`<name>_mean`)."""


def _mean(values: Sequence[float]) -> float:
    return sum(values) / max(1, len(values))


def scored_report(version: int, seed: int, source: str, groups: Sequence[str], greedy: Sequence[bool],
                  passes: Sequence[int] | None = None, samples: int = 0, *,
                  episodes: Sequence[EpisodeResult] | None = None,
                  sampled: Sequence[EpisodeResult] | None = None, sample_seed: int = 0) -> EvalReport:
    """The report of one version: greedy pass@1 and its Wilson interval over the tasks (`groups`: each task's
    `family/level`, `greedy`: whether its greedy answer passed); with `passes` (per task, how many of
    `samples` passed) mean@K and pass@k with bootstrap intervals seeded by `sample_seed`; with `episodes` (the
    greedy agentic episodes, task by task) the mean of each `COST_KEYS`, and with `sampled` the policy tokens
    of a sampled episode. Each of these per level too."""
    overall, per = grouped_scores(groups, greedy, passes, samples, seed=sample_seed)
    rows: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        rows.setdefault(group, []).append(i)
    costs: dict[str, float | None] = dict.fromkeys((f"{k}_mean" for k in COST_KEYS), None)
    if episodes is not None:
        if len(episodes) != len(groups):
            raise ValueError("episodes must hold one greedy episode per task")
        costs = {f"{k}_mean": _mean([float(getattr(e, k)) for e in episodes]) for k in COST_KEYS}
    by_level = {}
    for group, scores in per.items():
        tokens = None if episodes is None else _mean([episodes[i].policy_tokens for i in rows[group]])
        by_level[group] = LevelScore(n=scores["n"], pass_at_1=scores["pass_at_1"], ci_low=scores["ci95"][0],
                                     ci_high=scores["ci95"][1], mean_at_k=scores.get("mean_at_k"),
                                     policy_tokens_mean=tokens)
    return EvalReport(
        policy_version=version, task_seed=seed, n=overall["n"], pass_at_1=overall["pass_at_1"],
        ci_low=overall["ci95"][0], ci_high=overall["ci95"][1], source=source, samples=samples if passes else 0,
        mean_at_k=overall.get("mean_at_k"), pass_at_k=overall.get("pass_at_k", {}),
        pass_at_k_ci95=overall.get("pass_at_k_ci95", {}), **costs,
        sampled_policy_tokens_mean=_mean([e.policy_tokens for e in sampled]) if sampled else None,
        by_level=by_level)


def episodes_report(version: int, seed: int, source: str, greedy: Sequence[EpisodeResult],
                    sampled: Sequence[EpisodeResult] = (), samples: int = 0, *, sample_seed: int = 0) -> EvalReport:
    """`scored_report` of agentic episodes: `greedy` one per task, `sampled` `samples` per task (task by task, as
    `evaluate_repo_tasks` returns them for each task repeated `samples` times); levels are `repo/<level>`."""
    if len(sampled) != len(greedy) * samples:
        raise ValueError(f"sampled must hold {samples} episodes per task, task by task")
    passes = [sum(e.passed for e in sampled[i * samples:(i + 1) * samples]) for i in range(len(greedy))]
    return scored_report(version, seed, source, [f"repo/{e.level}" for e in greedy], [e.passed for e in greedy],
                         passes if samples else None, samples, episodes=greedy, sampled=sampled or None,
                         sample_seed=sample_seed)


def report_keys(report: EvalReport) -> dict[str, Any]:
    """The report as `rlbus eval --json` names its scores: n, pass_at_1, ci95, and where the report has them
    mean_at_k, pass_at_k, pass_at_k_ci95 (with samples), the cost means (agentic episodes), and by_level."""
    out: dict[str, Any] = {"policy_version": report.policy_version, "source": report.source, "n": report.n,
                           "pass_at_1": report.pass_at_1, "ci95": [report.ci_low, report.ci_high],
                           "samples": report.samples}
    if report.samples:
        out.update(mean_at_k=report.mean_at_k, pass_at_k=dict(report.pass_at_k),
                   pass_at_k_ci95={k: list(v) for k, v in report.pass_at_k_ci95.items()})
    for key in (*(f"{k}_mean" for k in COST_KEYS), "sampled_policy_tokens_mean"):
        if (value := getattr(report, key)) is not None:
            out[key] = value
    out["by_level"] = {name: {k: v for k, v in (("n", s.n), ("pass_at_1", s.pass_at_1),
                                                ("ci95", [s.ci_low, s.ci_high]), ("mean_at_k", s.mean_at_k),
                                                ("policy_tokens_mean", s.policy_tokens_mean)) if v is not None}
                       for name, s in report.by_level.items()}
    return out


__all__ = ["COST_KEYS", "episodes_report", "report_keys", "scored_report"]
