"""Continued pretraining of the policy on a synthetic corpus of solved coding tasks (the first training phase).

Owns: the corpus (prompt + canonical solution, and some two-attempt documents where a corrupted first
attempt gets test feedback and the retry is correct), the training loop, checkpoints
(`pretrain.pt` + `pretrain.json`), `load_checkpoint`, the final held-out greedy pass@1, and `settings_key`
(the digest under which `rlbus up` caches a pretrained base).
Does not own: the network (`transformer.py`), tasks and grading, or the CLI (`ops/pretrain.py`).
Deterministic given the seed and thread count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog
import torch
import torch.nn.functional as F

from rlbus.model.episodes import add_attempt, episode_tokens, start_episode
from rlbus.model.evaluate import EvalResult, evaluate_pass_at_1
from rlbus.model.grading import GradeResult, grade_many
from rlbus.model.tasks import Task, eval_tasks, train_tasks
from rlbus.model.tokenizer import ByteTokenizer
from rlbus.model.transformer import ModelConfig, Transformer

log = structlog.get_logger()

CHECKPOINT_NAME: Final = "pretrain.pt"
SUMMARY_NAME: Final = "pretrain.json"


@dataclass(frozen=True)
class PretrainConfig:
    """Everything a pretraining run needs besides seed, steps, threads and output folder."""

    model: ModelConfig
    batch_size: int = 32
    lr: float = 3e-3
    """Peak AdamW learning rate; linear warmup, then cosine to `lr * min_lr_ratio`."""
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    steps: int = 400
    """Default optimizer steps when `pretrain(steps=None)`."""
    retry_fraction: float = 0.1
    """Share of documents with a corrupted first attempt, its test feedback, then the correct retry."""
    prompt_loss_weight: float = 0.0
    """Loss weight of prompt/observation tokens; solution tokens weigh 1."""
    task_seed: int = 0
    """Seed of the held-out set (`eval_tasks(task_seed)`); training tasks never share its prompts."""
    eval_n: int = 200
    max_new_tokens: int = 128
    """Greedy decoding budget per held-out task (the longest canonical body is ~120 tokens)."""
    checkpoint_every: int = 100

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> PretrainConfig:
        """"small" (the CLI default, ~minutes on 2 cores) or "tiny" (seconds; for tests)."""
        vocab = ByteTokenizer().vocab_size
        match name:
            case "small":
                model = ModelConfig(vocab_size=vocab, d_model=128, n_layers=4, n_heads=4, d_ff=384, max_seq_len=512)
                base = cls(model=model)
            case "tiny":
                model = ModelConfig.tiny(vocab_size=vocab, max_seq_len=512)
                base = cls(model=model, batch_size=8, steps=30, warmup_steps=5, eval_n=20,
                           max_new_tokens=64, checkpoint_every=1000)
            case _:
                raise ValueError(f"unknown pretrain preset {name!r}; use 'small' or 'tiny'")
        return dataclasses.replace(base, **overrides)


@dataclass(frozen=True, slots=True)
class PretrainProgress:
    """One progress report: phase is "train" (after every optimizer step; the caller picks which to show),
    "eval", or "checkpoint" (each intermediate one at its step, the final one at `step == steps`)."""

    phase: str
    step: int
    steps: int
    elapsed_s: float
    loss: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    note: str = ""


@dataclass(frozen=True, slots=True)
class PretrainResult:
    """What a run produced: checkpoint and summary paths, losses, held-out pass@1 with its 95% interval."""

    checkpoint: Path
    summary: Path
    steps: int
    first_loss: float
    final_loss: float
    wall_s: float
    train_s: float
    eval: EvalResult


Progress = Callable[[PretrainProgress], None]


def corrupt(solution: str, rng: random.Random) -> str:
    """A plausible wrong attempt: change one integer literal, flip one operator, or drop one step line."""
    lines = solution.split("\n")
    steps = [i for i, line in enumerate(lines) if line.startswith("    ") and "return" not in line]
    literals = list(re.finditer(r"(?<![\w'])\d+", solution))
    kind = rng.choice(["literal", "operator", "drop"])
    if kind == "literal" and literals:
        m = rng.choice(literals)
        value = int(m.group()) + rng.choice([-2, -1, 1, 2])
        return solution[: m.start()] + str(max(0, value)) + solution[m.end():]
    swaps = {" + ": " - ", " - ": " + ", " * ": " + ", " > ": " < ", " < ": " > ", "[::-1]": "", ".upper()": ""}
    present = [k for k in swaps if k in solution]
    if kind == "operator" and present:
        old = rng.choice(present)
        return solution.replace(old, swaps[old], 1)
    if len(steps) > 1 and not any(line.strip().startswith(("if", "else")) for line in lines):
        del lines[rng.choice(steps)]
        return "\n".join(lines)
    return solution.replace("return ", "return -", 1) if "return x" in solution else solution + "\n"


def _documents(config: PretrainConfig, seed: int, tokenizer: ByteTokenizer) -> Iterator[tuple[list[int], list[float]]]:
    """Endless (ids, loss weights) documents: weights 1 on a correct solution, `prompt_loss_weight` elsewhere."""
    rng = random.Random(f"rlbus-pretrain:{seed}")
    tasks = train_tasks(seed, eval_seed=config.task_seed)
    while True:
        chunk = list(itertools.islice(tasks, 256))
        retry = [rng.random() < config.retry_fraction for _ in chunk]
        wrong = {i: corrupt(t.solution, rng) for i, t in enumerate(chunk) if retry[i]}
        graded = dict(zip(wrong, grade_many([(chunk[i], code) for i, code in wrong.items()]), strict=True))
        for i, task in enumerate(chunk):
            first = graded.get(i)
            yield _document(task, tokenizer, config.prompt_loss_weight,
                            (wrong[i], first) if first is not None and not first.passed else None)


def _document(task: Task, tokenizer: ByteTokenizer, prompt_weight: float,
              wrong: tuple[str, GradeResult] | None) -> tuple[list[int], list[float]]:
    episode = start_episode(task, tokenizer)
    if wrong is not None:
        episode = add_attempt(episode, [*tokenizer.encode(wrong[0]), tokenizer.end_turn_id], wrong[1], tokenizer)
    correct = GradeResult("passed", len(task.tests), len(task.tests), "")
    episode = add_attempt(episode, [*tokenizer.encode(task.solution), tokenizer.end_turn_id], correct, tokenizer)
    flat = episode_tokens(episode, tokenizer)
    last = len(episode.turns) - 1  # only the final (correct) attempt is a target
    weights = [1.0 if m and t == last else (0.0 if m else prompt_weight) for m, t in zip(flat.loss_mask, flat.turn,
                                                                                          strict=True)]
    return flat.ids, weights


def _batches(config: PretrainConfig, seed: int, tokenizer: ByteTokenizer
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(inputs (B,T), targets (B,T), weights (B,T)), right-padded per batch.

    Documents come in pools of 8 batches, sorted by length so a batch pads little, batches shuffled.
    """
    docs = _documents(config, seed, tokenizer)
    rng = random.Random(f"rlbus-batches:{seed}")
    limit = config.model.max_seq_len + 1
    pool_batches = 8
    while True:
        pool = sorted((next(docs) for _ in range(config.batch_size * pool_batches)), key=lambda d: len(d[0]))
        groups = [pool[i:i + config.batch_size] for i in range(0, len(pool), config.batch_size)]
        rng.shuffle(groups)
        for batch in groups:
            yield _pad(batch, limit, tokenizer.pad_id)


def _pad(batch: list[tuple[list[int], list[float]]], limit: int, pad_id: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = min(limit, max(len(ids) for ids, _ in batch))
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    weights = torch.zeros((len(batch), width))
    for r, (doc, w) in enumerate(batch):
        ids[r, : min(width, len(doc))] = torch.tensor(doc[:width])
        weights[r, : min(width, len(w))] = torch.tensor(w[:width])
    return ids[:, :-1], ids[:, 1:], weights[:, 1:]


def _lr(step: int, steps: int, config: PretrainConfig) -> float:
    """Linear warmup to lr over warmup_steps, then cosine from lr to lr*min_lr_ratio at `steps`."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    frac = (step - config.warmup_steps) / max(1, steps - config.warmup_steps)
    floor = config.lr * config.min_lr_ratio
    return floor + 0.5 * (config.lr - floor) * (1 + math.cos(math.pi * min(1.0, frac)))


def pretrain(config: PretrainConfig, steps: int | None, seed: int, out_dir: Path, threads: int,
             progress: Progress | None = None) -> PretrainResult:
    """Train a fresh `Transformer(config.model)` for `steps`, checkpoint to `out_dir`, evaluate pass@1."""
    steps = config.steps if steps is None else steps
    if steps < 1 or threads < 1:
        raise ValueError(f"steps ({steps}) and threads ({threads}) must be >= 1")
    report = progress or (lambda _: None)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tokenizer = ByteTokenizer()
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model vocab_size {config.model.vocab_size} < tokenizer's {tokenizer.vocab_size}")
    model = Transformer(config.model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.95))
    start = time.monotonic()
    losses: list[float] = []
    tokens_seen = 0
    checkpoint = out_dir / CHECKPOINT_NAME
    batches = _batches(config, seed, tokenizer)
    model.train()
    for step in range(steps):
        inputs, targets, weights = next(batches)
        lr = _lr(step, steps, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        logits = model(inputs).logits
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        loss = (per_token * weights.reshape(-1)).sum() / weights.sum().clamp_min(1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        tokens_seen += int((targets != tokenizer.pad_id).sum())
        elapsed = time.monotonic() - start
        report(PretrainProgress("train", step + 1, steps, elapsed, losses[-1], lr, tokens_seen / elapsed))
        if (step + 1) % config.checkpoint_every == 0 and step + 1 < steps:
            _save(checkpoint, model, tokenizer, config, {"seed": seed, "step": step + 1, "final": False})
            report(PretrainProgress("checkpoint", step + 1, steps, elapsed, note=str(checkpoint)))
    train_s = time.monotonic() - start
    log.info("pretrain_trained", steps=steps, first_loss=losses[0], final_loss=losses[-1], seconds=round(train_s, 1))
    report(PretrainProgress("eval", steps, steps, train_s, note=f"greedy pass@1 on {config.eval_n} held-out tasks"))
    result = evaluate_pass_at_1(model, tokenizer, eval_tasks(config.task_seed, config.eval_n),
                                max_new_tokens=config.max_new_tokens)
    wall_s = time.monotonic() - start
    final_loss = sum(losses[-10:]) / len(losses[-10:])
    meta = {
        "seed": seed, "step": steps, "final": True, "threads": threads, "task_seed": config.task_seed,
        "first_loss": losses[0], "final_loss": final_loss, "train_s": round(train_s, 2), "wall_s": round(wall_s, 2),
        "eval": {"n": result.n, "passed": result.passed, "pass_at_1": result.pass_at_1,
                 "ci95": [result.ci_low, result.ci_high], "by_family": result.by_family},
    }
    _save(checkpoint, model, tokenizer, config, meta)
    summary = out_dir / SUMMARY_NAME
    summary.write_text(json.dumps({**meta, "config": dataclasses.asdict(config), "checkpoint": str(checkpoint),
                                   "tokenizer": tokenizer.info()}, indent=2) + "\n")
    log.info("pretrain_evaluated", pass_at_1=result.pass_at_1, ci95=[result.ci_low, result.ci_high],
             seconds=round(wall_s, 1))
    report(PretrainProgress("checkpoint", steps, steps, wall_s, note=str(checkpoint)))
    return PretrainResult(checkpoint, summary, steps, losses[0], final_loss, wall_s, train_s, result)


KEY_FORMAT: Final = 1
"""Part of every `settings_key`: bump it when a change to this module makes the same settings train another
policy (corpus, loop, checkpoint layout), so bases cached under older keys are no longer reused."""


def settings_key(config: PretrainConfig, steps: int, seed: int, threads: int) -> str:
    """A digest (16 hex digits) of everything that decides what `pretrain(config, steps, seed, _, threads)`
    produces: every field of `config` (model shape, schedule, corpus, held-out seed and size), the steps, the
    seed, the thread count (the run is deterministic per thread count) and `KEY_FORMAT`. Equal settings give
    equal keys; changing any one of them gives another key."""
    doc = {"format": KEY_FORMAT, "config": dataclasses.asdict(config), "steps": steps, "seed": seed,
           "threads": threads}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _save(path: Path, model: Transformer, tokenizer: ByteTokenizer, config: PretrainConfig,
          meta: dict[str, Any]) -> None:
    """Atomic torch.save of state_dict, model config, tokenizer info and meta (write, fsync, rename)."""
    payload = {"state_dict": model.state_dict(), "model_config": dataclasses.asdict(config.model),
               "tokenizer": tokenizer.info(), "pretrain_config": dataclasses.asdict(config), "meta": meta}
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def load_checkpoint(path: Path) -> tuple[Transformer, ByteTokenizer, dict[str, Any]]:
    """Rebuild (model in eval mode, tokenizer, meta) from a `pretrain.pt` (or its folder)."""
    path = path / CHECKPOINT_NAME if path.is_dir() else path
    payload = torch.load(path, map_location="cpu", weights_only=True)
    fields = dict(payload["model_config"])
    fields["moe_layers"] = tuple(fields.get("moe_layers", ()))
    model = Transformer(ModelConfig(**fields))
    model.load_state_dict(payload["state_dict"])
    model.eval()
    return model, ByteTokenizer.from_info(payload["tokenizer"]), dict(payload["meta"])
