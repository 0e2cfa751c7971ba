"""Held-out evaluation: greedy completions for many tasks at once, graded, as pass@1 with a Wilson interval.

Owns: batched greedy decoding over left-padded prompts with the KV cache (small on purpose; sampling with
logprobs and versions lives in `generate.py`), `wilson_interval`, and `evaluate_pass_at_1`.
Does not own: the task set (`tasks.py`) or the isolation of graded code (the runner's job).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlbus.model.episodes import completion_text
from rlbus.model.grading import GradeResult, Runner, grade_many, subprocess_runner
from rlbus.model.tasks import Task
from rlbus.model.tokenizer import ByteTokenizer
from rlbus.model.transformer import Transformer


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion p = k/n (Wilson 1927).

    centre = (p + z^2/2n) / (1 + z^2/n),  half = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/4n^2).
    z = 1.96 gives the 95% interval. n = 0 gives (0, 1).
    """
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


@torch.no_grad()
def greedy_complete(model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    stop_ids: Sequence[int], pad_id: int, batch_size: int = 64) -> list[list[int]]:
    """Greedy continuation of each prompt (ids) until a stop id (kept) or max_new_tokens; input order.

    Prompts are sorted by length and left-padded per batch; the cache holds prompt + new tokens.
    """
    was_training = model.training
    model.eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    stops = torch.tensor(list(stop_ids))
    for first in range(0, len(order), batch_size):
        rows = order[first:first + batch_size]
        width = max(len(prompts[i]) for i in rows)
        tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
        real = torch.zeros((len(rows), width), dtype=torch.bool)
        for r, i in enumerate(rows):
            tokens[r, width - len(prompts[i]):] = torch.tensor(list(prompts[i]))
            real[r, width - len(prompts[i]):] = True
        cache = model.new_cache(len(rows), min(width + max_new_tokens, model.config.max_seq_len))
        logits = model(tokens, cache=cache, attention_mask=real).logits[:, -1]
        done = torch.zeros(len(rows), dtype=torch.bool)
        generated: list[torch.Tensor] = []
        for _ in range(min(max_new_tokens, cache.max_len - width)):
            next_ids = logits.argmax(-1)
            generated.append(torch.where(done, pad_id, next_ids))
            done |= torch.isin(next_ids, stops)
            if bool(done.all()) or cache.length >= cache.max_len:
                break
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
        if generated:
            block = torch.stack(generated, dim=1).tolist()
            for r, i in enumerate(rows):
                out[i] = [t for t in block[r] if t != pad_id]
    model.train(was_training)
    return out


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


def evaluate_pass_at_1(model: Transformer, tokenizer: ByteTokenizer, tasks: Sequence[Task], *,
                       max_new_tokens: int = 160, runner: Runner = subprocess_runner,
                       batch_size: int = 64) -> EvalResult:
    """Greedy single-attempt pass@1 of `model` on `tasks`, graded in one runner call."""
    prompts = [tokenizer.prompt_ids(t.prompt) for t in tasks]
    ids = greedy_complete(model, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                          stop_ids=(tokenizer.end_turn_id, tokenizer.eos_id), pad_id=tokenizer.pad_id)
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
