"""Continued pretraining of a policy (built-in or Hugging Face) on solved coding tasks and real Python source.

- Owns: the training loop over any `Policy` (`pretrain`), its schedule, checkpoints, `loss.png`,
  `load_checkpoint`, the final held-out greedy pass@1, the start of a run (`new_hf_policy`, `load_start`) and
  `settings_key` (the digest under which `rlbus up` caches a pretrained base).
- Guarantee: deterministic given the seed and thread count.
- Does not: own the corpus and its decontamination (model/training/corpus.py), the networks
  (model/policies/transformer.py, model/policies/hf.py, model/policies/hf_recipe.py), tasks and grading, or
  the CLI (ops/pretrain.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, get_args

import structlog
import torch
import torch.nn.functional as F

from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.interface import ChatTokenizer, Policy, PolicyError, resolve_device
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling.evaluate import EvalResult, evaluate_pass_at_1
from rlbus.model.tasks.builtin import Task, eval_tasks, train_tasks
from rlbus.model.training.corpus import (
    Decontaminator,
    Document,
    code_documents,
    corrupt,
    mixed_documents,
    source_files,
    task_documents,
    tokenizer_texts,
)

__all__ = ["CHECKPOINT_NAME", "LOSS_PLOT", "SUMMARY_NAME", "PretrainConfig", "PretrainProgress", "PretrainResult",
           "check_hf_out", "corrupt", "load_checkpoint", "load_start", "new_hf_policy", "plot_losses", "pretrain",
           "settings_key"]

log = structlog.get_logger()

CHECKPOINT_NAME: Final = "pretrain.pt"
SUMMARY_NAME: Final = "pretrain.json"
LOSS_PLOT: Final = "loss.png"
HF_VOCAB: Final[dict[str, int]] = {"tiny": 1024, "small": 2048, "m30": 8192}
"""Vocabulary of the BPE tokenizer a `--hf` run trains, by size preset."""
TOKENIZER_CHARS: Final = 3_000_000
"""About how much text a new BPE tokenizer learns from (a sample: the standard library alone is ~10 MB)."""


@dataclass(frozen=True)
class PretrainConfig:
    """Everything a pretraining run needs besides seed, steps, threads, output folder and starting policy."""

    model: ModelConfig
    """The built-in transformer's shape (a run that starts from another policy takes that policy's shape)."""
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
    code_fraction: float = 0.0
    """Share of documents that are real Python source (`model/training/corpus.py`); 0 trains on task documents only."""
    code_tokens: int = 256
    """Longest code document, in tokens (at most the model's context): source files are split at line
    boundaries into pieces this long, so a batch of code costs about what a batch of task documents does."""
    corpus_dirs: tuple[str, ...] = ()
    """Folders of `.py` files read besides the standard library's (when `code_fraction` > 0)."""
    stdlib: bool = True
    """Whether the standard library's own sources are part of the code corpus."""

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> PretrainConfig:
        """"small" (the CLI default, ~minutes on 2 cores), "tiny" (seconds; for tests) or "m30" (~34M
        parameters). A Hugging Face run takes the schedule of its size's preset."""
        vocab = ByteTokenizer().vocab_size
        match name:
            case "small":
                model = ModelConfig(vocab_size=vocab, d_model=128, n_layers=4, n_heads=4, d_ff=384, max_seq_len=512)
                base = cls(model=model)
            case "tiny":
                model = ModelConfig.tiny(vocab_size=vocab, max_seq_len=512)
                base = cls(model=model, batch_size=8, steps=30, warmup_steps=5, eval_n=20,
                           max_new_tokens=64, checkpoint_every=1000)
            case "m30":
                base = cls(model=ModelConfig.m30(vocab_size=vocab), lr=1e-3, batch_size=16)
            case _:
                raise ValueError(f"unknown pretrain preset {name!r}; use 'small', 'tiny' or 'm30'")
        return dataclasses.replace(base, **overrides)


@dataclass(frozen=True, slots=True)
class PretrainProgress:
    """One progress report: phase is "train" (after every optimizer step; the caller picks which to show),
    "eval", or "checkpoint" (each intermediate one at its step, the final one at `step == steps`). A run that
    continues an earlier one counts steps from where that one stopped."""

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
    """What a run produced: checkpoint (the `pretrain.pt`, or the Hugging Face folder) and summary paths, losses,
    held-out pass@1 with its 95% interval, and the trained policy (in eval mode)."""

    checkpoint: Path
    summary: Path
    steps: int
    first_loss: float
    final_loss: float
    wall_s: float
    train_s: float
    eval: EvalResult
    policy: Policy | None = None
    start_step: int = 0
    """Steps of the run this one continued (0 for a fresh start); `steps` counts from 0 through both."""


Progress = Callable[[PretrainProgress], None]


def _documents(config: PretrainConfig, seed: int, tokenizer: ChatTokenizer) -> Iterator[Document]:
    """Endless task documents of `config` (`corpus.task_documents`)."""
    return task_documents(seed, tokenizer, eval_seed=config.task_seed, retry_fraction=config.retry_fraction,
                          prompt_loss_weight=config.prompt_loss_weight)


def _corpus(config: PretrainConfig, seed: int, tokenizer: ChatTokenizer, max_seq_len: int,
            held_out: Sequence[Task]) -> Iterator[Document]:
    """Task documents mixed with code documents at `config.code_fraction` (task documents alone at 0)."""
    tasks = _documents(config, seed, tokenizer)
    if config.code_fraction <= 0.0:
        return tasks
    files = source_files([Path(d) for d in config.corpus_dirs], stdlib=config.stdlib)
    code = code_documents(files, tokenizer, min(max_seq_len, config.code_tokens) + 1,
                          random.Random(f"rlbus-code:{seed}"), Decontaminator(held_out))
    return mixed_documents(tasks, code, config.code_fraction, random.Random(f"rlbus-mix:{seed}"))


def _batches(docs: Iterator[Document], batch_size: int, max_seq_len: int, pad_id: int, seed: int
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(inputs (B,T), targets (B,T), weights (B,T)), right-padded per batch.

    Documents come in pools of 8 batches, sorted by length so a batch pads little, batches shuffled.
    """
    rng = random.Random(f"rlbus-batches:{seed}")
    limit = max_seq_len + 1
    pool_batches = 8
    while True:
        pool = sorted((next(docs) for _ in range(batch_size * pool_batches)), key=lambda d: len(d[0]))
        groups = [pool[i:i + batch_size] for i in range(0, len(pool), batch_size)]
        rng.shuffle(groups)
        for batch in groups:
            yield _pad(batch, limit, pad_id)


def _pad(batch: list[Document], limit: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = min(limit, max(len(ids) for ids, _ in batch))
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    weights = torch.zeros((len(batch), width))
    for r, (doc, w) in enumerate(batch):
        ids[r, : min(width, len(doc))] = torch.tensor(doc[:width])
        weights[r, : min(width, len(w))] = torch.tensor(w[:width])
    return ids[:, :-1], ids[:, 1:], weights[:, 1:]


def lr_at(step: int, steps: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup to `lr` over `warmup` steps, then cosine to `lr * min_ratio` at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    floor = lr * min_ratio
    return floor + 0.5 * (lr - floor) * (1 + math.cos(math.pi * min(1.0, frac)))


def adamw(module: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.95) with weight decay on matrices only (not on norms' scales and biases)."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def weighted_ce_step(policy: Policy, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor,
                     weights: torch.Tensor, lr: float, grad_clip: float) -> float:
    """One optimizer step on the cross-entropy of `targets` after `inputs`, each token weighted by `weights`
    (0 leaves it out), normalised by the weights' sum; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    logits = policy.forward(inputs).logits.float()
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    loss = (per_token * weights.reshape(-1)).sum() / weights.sum().clamp_min(1.0)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.module.parameters(), grad_clip)
    optimizer.step()
    return loss.item()


def pretrain(config: PretrainConfig, steps: int | None, seed: int, out_dir: Path, threads: int,
             progress: Progress | None = None, *, policy: Policy | None = None, start_step: int = 0,
             origin: str = "", device: str = "cpu", documents: Iterator[Document] | None = None,
             seq_len: int | None = None, evaluate: bool = True) -> PretrainResult:
    """Train `policy` (default: a fresh `Transformer(config.model)` seeded by `seed`) for `steps`, checkpoint to
    `out_dir`, evaluate pass@1 on `eval_tasks(config.task_seed, config.eval_n)`.

    A built-in policy checkpoints to `out_dir/pretrain.pt` + `pretrain.json`; a Hugging Face one makes `out_dir`
    a model directory that `transformers` loads, with `pretrain.json` inside, replaced atomically. The loss
    comes from `policy.forward(inputs).logits`.
    `start_step` (the steps of the run `policy` comes from, named by `origin`) continues the step count and
    varies the data; the schedule spans this run's `steps`. `documents` replaces the corpus of `config` (a
    long-context phase's), `seq_len` caps a document below the policy's context, and `evaluate=False` skips the
    held-out pass@1 (the summary's `eval` is then null; a run of phases evaluates once, after the last).

    :raises ValueError: steps or threads below 1, or a vocabulary too small for the tokenizer.
    :raises PolicyError: `out_dir` holds files that a Hugging Face output would replace but did not write.
    """
    steps = config.steps if steps is None else steps
    if steps < 1 or threads < 1 or start_step < 0:
        raise ValueError(f"steps ({steps}) and threads ({threads}) must be >= 1, start_step ({start_step}) >= 0")
    report = progress or (lambda _: None)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    if policy is None:
        tokenizer = ByteTokenizer()
        if config.model.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"model vocab_size {config.model.vocab_size} < tokenizer's {tokenizer.vocab_size}")
        policy = BuiltinPolicy(Transformer(config.model), tokenizer)
    if isinstance(policy, BuiltinPolicy):
        config = dataclasses.replace(config, model=policy.config)
    else:
        check_hf_out(out_dir)
    policy.to_(device=resolve_device(device), dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = policy.tokenizer
    module = policy.module
    held_out = eval_tasks(config.task_seed, config.eval_n)
    data_seed = seed + start_step
    optimizer = adamw(module, config.lr, config.weight_decay)
    start = time.monotonic()
    losses: list[float] = []
    tokens_seen = 0
    total = start_step + steps
    hf = not isinstance(policy, BuiltinPolicy)
    checkpoint = out_dir if hf else out_dir / CHECKPOINT_NAME
    length = min(policy.max_seq_len, seq_len or policy.max_seq_len)
    docs = documents if documents is not None else _corpus(config, data_seed, tokenizer, length, held_out)
    batches = _batches(docs, config.batch_size, length, tokenizer.pad_id, data_seed)
    base = {"seed": seed, "threads": threads, "task_seed": config.task_seed, "policy": policy.kind,
            "start_step": start_step, "from": origin}
    policy.train()
    for step in range(steps):
        inputs, targets, weights = (t.to(policy.device) for t in next(batches))
        lr = lr_at(step, steps, config.lr, config.warmup_steps, config.min_lr_ratio)
        losses.append(weighted_ce_step(policy, optimizer, inputs, targets, weights, lr, config.grad_clip))
        tokens_seen += int((targets != tokenizer.pad_id).sum())
        elapsed = time.monotonic() - start
        done = start_step + step + 1
        report(PretrainProgress("train", done, total, elapsed, losses[-1], lr, tokens_seen / elapsed))
        if (step + 1) % config.checkpoint_every == 0 and step + 1 < steps:
            meta = {**base, "step": done, "final": False, "first_loss": losses[0], "losses": losses}
            if hf:
                _save_hf(out_dir, policy, {**meta, "config": _config_dict(config, hf), "checkpoint": str(checkpoint)})
            else:
                _save(checkpoint, policy.transformer, config, {k: meta[k] for k in ("seed", "step", "final")})
            report(PretrainProgress("checkpoint", done, total, elapsed, note=str(checkpoint)))
    train_s = time.monotonic() - start
    log.info("pretrain_trained", steps=steps, first_loss=losses[0], final_loss=losses[-1], seconds=round(train_s, 1),
             policy=policy.kind, start_step=start_step)
    policy.eval()
    if evaluate:
        report(PretrainProgress("eval", total, total, train_s,
                                note=f"greedy pass@1 on {config.eval_n} held-out tasks"))
        result = evaluate_pass_at_1(policy, tokenizer, held_out, max_new_tokens=config.max_new_tokens)
    else:
        result = EvalResult(0, 0, 0.0, 0.0, 1.0, {}, [], [])
    wall_s = time.monotonic() - start
    final_loss = sum(losses[-10:]) / len(losses[-10:])
    meta = {
        "seed": seed, "step": total, "final": True, "threads": threads, "task_seed": config.task_seed,
        "first_loss": losses[0], "final_loss": final_loss, "train_s": round(train_s, 2), "wall_s": round(wall_s, 2),
        "eval": eval_dict(result) if evaluate else None,
    }
    summary = out_dir / SUMMARY_NAME
    document = {**meta, "config": _config_dict(config, hf), "checkpoint": str(checkpoint), "policy": policy.kind,
                "start_step": start_step, "from": origin, "losses": losses}
    if hf:
        _save_hf(out_dir, policy, document)
    else:
        _save(checkpoint, policy.transformer, config, meta)
        summary.write_text(json.dumps({**document, "tokenizer": ByteTokenizer().info()}, indent=2) + "\n")
        plot_losses(out_dir / LOSS_PLOT, losses, start_step)
    if evaluate:
        log.info("pretrain_evaluated", pass_at_1=result.pass_at_1, ci95=[result.ci_low, result.ci_high],
                 seconds=round(wall_s, 1))
    report(PretrainProgress("checkpoint", total, total, wall_s, note=str(checkpoint)))
    return PretrainResult(checkpoint, summary, total, losses[0], final_loss, wall_s, train_s, result, policy,
                          start_step)


def eval_dict(result: EvalResult) -> dict[str, Any]:
    """The `eval` entry of a summary: n, passed, pass@1, its 95% interval and the count per family."""
    return {"n": result.n, "passed": result.passed, "pass_at_1": result.pass_at_1,
            "ci95": [result.ci_low, result.ci_high], "by_family": result.by_family}


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


def _config_dict(config: PretrainConfig, hf: bool) -> dict[str, Any]:
    """The config as plain values; without the built-in `model` shape for a Hugging Face policy (its own
    config.json says it)."""
    values = dataclasses.asdict(config)
    if hf:
        del values["model"]
    return values


# ---- built-in checkpoints ----------------------------------------------------------------------------------

def _save(path: Path, model: Transformer, config: PretrainConfig, meta: dict[str, Any]) -> None:
    """Atomic torch.save of state_dict, model config, tokenizer info and meta (write, fsync, rename)."""
    payload = {"state_dict": model.state_dict(), "model_config": dataclasses.asdict(config.model),
               "tokenizer": ByteTokenizer().info(), "pretrain_config": dataclasses.asdict(config), "meta": meta}
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


# ---- Hugging Face directories ----------------------------------------------------------------------------

WEIGHT_FILES: Final = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.pth")
"""Weights of an earlier model in a Hugging Face output folder: replaced, never carried over (a stale shard index
would make transformers load the old shards)."""


def check_hf_out(out_dir: Path) -> None:
    """A Hugging Face run replaces the folder `out_dir` (carrying its loose files over): refuse one holding folders,
    which it would not carry.

    :raises PolicyError: `out_dir` is a file, or a folder holding folders.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise PolicyError(f"output {out_dir} is a file; a Hugging Face run writes a folder there")
    folders = sorted(p.name for p in out_dir.iterdir() if p.is_dir()) if out_dir.is_dir() else []
    if folders:
        raise PolicyError(f"output folder {out_dir} holds folders ({', '.join(folders[:3])}): a Hugging Face run "
                          f"replaces the folder with the model directory; pass an empty or new --out")


def _save_hf(out_dir: Path, policy: Policy, summary: dict[str, Any], summary_name: str = SUMMARY_NAME) -> None:
    """`out_dir` becomes a complete model directory: the policy's files (tokenizer, chat template), then
    `save_pretrained` of its module (config, generation config, safetensors), the summary (`summary_name`) and
    `loss.png`.

    Written into a sibling temporary folder, then renamed over `out_dir` (the previous checkpoint is moved aside
    first and removed after), so a reader never sees a half-written directory under `out_dir`. Loose files already
    in `out_dir` that this does not write (notes, a cache's bookkeeping) are carried over, except `WEIGHT_FILES`.
    """
    out_dir = out_dir.resolve()
    tmp = out_dir.with_name(f".{out_dir.name}.partial")
    old = out_dir.with_name(f".{out_dir.name}.old")
    for stale in (tmp, old):
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir(parents=True)
    for name, data in policy.files().items():
        (tmp / name).write_bytes(data)
    policy.module.save_pretrained(tmp)  # type: ignore[operator]
    (tmp / summary_name).write_text(json.dumps(summary, indent=2) + "\n")
    plot_losses(tmp / LOSS_PLOT, summary.get("losses", []), int(summary.get("start_step", 0)))
    if out_dir.is_dir():
        for entry in out_dir.iterdir():
            keep = not any(fnmatch.fnmatch(entry.name, pattern) for pattern in WEIGHT_FILES)
            if entry.is_file() and keep and not (tmp / entry.name).exists():
                shutil.copy2(entry, tmp / entry.name)
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old.exists():
        shutil.rmtree(old)


def load_start(path: Path, *, device: str = "cpu") -> tuple[Policy, int]:
    """The policy a `--from` run continues, in fp32, and the steps it was trained for (its `pretrain.json`'s
    `step`; 0 when it has none, as a downloaded model does). A folder (or file) holding a `pretrain.pt` is a
    built-in checkpoint; anything else must be a Hugging Face model directory.

    :raises PolicyError: from `HFPolicy.load` (no such folder, not a model directory) or `BuiltinPolicy.load`.
    """
    folder = path if path.is_dir() else path.parent
    if path.is_file() or (path / CHECKPOINT_NAME).is_file():
        policy: Policy = BuiltinPolicy.load(path)
    else:
        from rlbus.model.policies.hf import HFPolicy

        policy = HFPolicy.load(path, device=device, dtype=torch.float32)
    step = 0
    if (folder / SUMMARY_NAME).is_file():
        try:
            step = int(json.loads((folder / SUMMARY_NAME).read_text()).get("step", 0))
        except (ValueError, TypeError, AttributeError) as err:
            raise PolicyError(f"{folder / SUMMARY_NAME}: not a pretrain summary ({err}); remove it to start the "
                              "step count at 0") from None
    return policy, step


def new_hf_policy(config: PretrainConfig, architecture: str, size: str, seed: int, *, max_seq_len: int,
                  device: str = "cpu") -> Policy:
    """A randomly initialised Hugging Face policy (`hf_recipe.build_hf_dir`) whose BPE tokenizer is trained on
    this run's corpus: training-task texts and a seeded sample of the source files (`corpus.tokenizer_texts`,
    decontaminated against the held-out set), about `TOKENIZER_CHARS` characters.

    :raises PolicyError: an architecture or size the recipe does not build.
    """
    from rlbus.model.policies.hf import HFPolicy
    from rlbus.model.policies.hf_recipe import Architecture, Size, build_hf_dir

    if architecture not in get_args(Architecture):
        raise PolicyError(f"--hf {architecture!r}: expected an architecture of {', '.join(get_args(Architecture))}")
    if size not in get_args(Size):
        raise PolicyError(f"--hf {architecture} builds the sizes {', '.join(get_args(Size))}, not --config {size}")
    files = source_files([Path(d) for d in config.corpus_dirs], stdlib=config.stdlib)
    held_out = Decontaminator(eval_tasks(config.task_seed, config.eval_n))
    tasks = itertools.islice(train_tasks(seed, eval_seed=config.task_seed), 500)
    texts = tokenizer_texts(files, tasks, held_out, random.Random(f"rlbus-bpe:{seed}"), max_chars=TOKENIZER_CHARS)
    with tempfile.TemporaryDirectory(prefix="rlbus-hf-init-") as tmp:
        build_hf_dir(Path(tmp), architecture=architecture, texts=texts,  # type: ignore[arg-type]
                     vocab_size=HF_VOCAB.get(size, 2048), size=size,  # type: ignore[arg-type]
                     max_seq_len=max_seq_len, seed=seed)
        return HFPolicy.load(Path(tmp), device=device, dtype=torch.float32)


def plot_losses(path: Path, losses: Sequence[float], start_step: int = 0,
                phases: Sequence[tuple[str, int]] = ()) -> None:
    """The loss curve as a PNG (matplotlib's Agg canvas, no pyplot state): every step, and a 10-step moving
    average once there are 20 steps; `phases` (each a label and the step it starts after) are marked by a dashed
    vertical line at their start and their label. Written to a temporary name, then renamed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = list(range(start_step + 1, start_step + len(losses) + 1))
    ax.plot(steps, losses, linewidth=0.8, alpha=0.6, label="loss")
    if len(losses) >= 20:
        smooth = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, linewidth=1.6, label="10-step mean")
        ax.legend(loc="lower left" if phases else "best")
    for label, begin in phases:
        ax.axvline(begin + 0.5, color="0.4", linestyle="--", linewidth=0.8)
        ax.annotate(label, (begin + 0.5, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -3),
                    textcoords="offset points", va="top", fontsize=8, rotation=90)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per target token)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
