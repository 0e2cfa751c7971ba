"""Held-out evaluation: greedy completions for many tasks at once, graded, as pass@1 with a Wilson interval.

Owns: `wilson_interval`, `greedy_complete` (length-sorted batches through `generate.generate`) and
`evaluate_pass_at_1`.
Does not own: the task set (`tasks.py`) or the isolation of graded code (the runner's job).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlbus.model.env.episodes import completion_text
from rlbus.model.policies.interface import ChatTokenizer, Policy, as_policy
from rlbus.model.policies.transformer import Transformer
from rlbus.model.sampling.generate import generate
from rlbus.model.tasks.builtin import Task
from rlbus.model.tasks.grading import GradeResult, Runner, grade_many, subprocess_runner


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion p = k/n (Wilson 1927).

    centre = (p + z^2/2n) / (1 + z^2/n),  half = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/4n^2).
    z = 1.96 gives the 95% interval. n = 0 gives (0, 1). The bounds always hold the estimate: with no success
    the lower bound is exactly 0, with all successes the upper bound exactly 1 (in floating point the formula
    lands a rounding error off them, e.g. 5.6e-17 for 0 of 3).
    """
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low = 0.0 if successes == 0 else min(p, max(0.0, centre - half))
    high = 1.0 if successes == n else max(p, min(1.0, centre + half))
    return low, high


def greedy_complete(model: Policy | Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    stop_id: int, pad_id: int, batch_size: int = 64,
                    on_step: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy continuation of each prompt until `stop_id` (kept) or max_new_tokens; results in input order.

    Prompts are sorted by length before batching, so left padding stays small; each batch is one
    `generate(temperature=0)` call with the KV cache. `on_step(step)` runs before every decoding step of
    every batch; an exception it raises (a caller's cancellation) ends the decoding there. A prompt that
    leaves no room for `max_new_tokens` in the model's context (`too_long`) gets an empty completion
    (graded, it fails: a held-out task the model cannot read counts against it, not out of the set).
    """
    model = as_policy(model)
    was_training = model.module.training
    model.eval()
    order = sorted((i for i in range(len(prompts)) if not too_long(model, prompts[i], max_new_tokens)),
                   key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    try:
        for first in range(0, len(order), batch_size):
            rows = order[first:first + batch_size]
            samples = generate(model, [prompts[i] for i in rows], max_new_tokens=max_new_tokens,
                               temperature=0.0, eos_id=stop_id, pad_id=pad_id, on_step=on_step)
            for i, sample in zip(rows, samples, strict=True):
                out[i] = sample.tokens.tolist()
    finally:
        model.train(was_training)
    return out


def too_long(model: Policy | Transformer, prompt: Sequence[int], max_new_tokens: int) -> bool:
    """Whether `prompt` plus `max_new_tokens` exceeds the model's context (`max_seq_len`)."""
    return len(prompt) + max_new_tokens > as_policy(model).max_seq_len


@dataclass(frozen=True, slots=True)
class EvalResult:
    """pass@1 of greedy completions on a task set, its 95% Wilson interval, and per-task details."""

    n: int
    passed: int
    pass_at_1: float
    ci_low: float
    ci_high: float
    by_family: dict[str, tuple[int, int]]
    """family/level -> (passed, n)."""
    completions: list[str]
    results: list[GradeResult]


def evaluate_pass_at_1(model: Policy | Transformer, tokenizer: ChatTokenizer, tasks: Sequence[Task], *,
                       max_new_tokens: int = 160, runner: Runner = subprocess_runner,
                       batch_size: int = 64) -> EvalResult:
    """Greedy single-attempt pass@1 of `model` on `tasks`, graded in one runner call."""
    prompts = [tokenizer.prompt_ids(t.prompt) for t in tasks]
    ids = greedy_complete(model, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                          stop_id=tokenizer.stop_id, pad_id=tokenizer.pad_id)
    texts = [completion_text(c, tokenizer) for c in ids]
    results = grade_many(list(zip(tasks, texts, strict=True)), runner=runner)
    passed = sum(r.passed for r in results)
    by_family: dict[str, tuple[int, int]] = {}
    for task, result in zip(tasks, results, strict=True):
        key = f"{task.family}/{task.level}"
        k, n = by_family.get(key, (0, 0))
        by_family[key] = (k + result.passed, n + 1)
    low, high = wilson_interval(passed, len(tasks))
    return EvalResult(len(tasks), passed, passed / max(1, len(tasks)), low, high,
                      dict(sorted(by_family.items())), texts, results)
