"""Pretraining in phases: main, long-context and SFT phases run in order into one model directory.

- Owns: `Phase`, `run_phases` (each phase from the one before it, a marker per finished phase, a resume at the
  first unfinished one, one held-out pass@1 after the last, the summary and `loss.png` with the phases marked),
  `phases_done`, `extend_context` (the context and the RoPE base of a built-in or Hugging Face policy, written
  into its own config) and `held_out_loss`.
- Guarantee: a run stopped inside a phase, or between a phase's save and its marker, and started again with the
  same phases ends with the weights of an unbroken run, each phase trained once from its predecessor's output: a
  phase's weights and its step count are written together (a built-in `pretrain.pt` holds its step, a Hugging
  Face directory is replaced whole with its `pretrain.json`), and its marker only after that.
- A phase with `mtp_heads` then distils that many MTP heads from scratch from its model, frozen, on the
  pretraining corpus (model/training/mtp.py), before its marker: a Hugging Face policy's into
  `mtp_heads.safetensors` beside it, the built-in policy's into its own model (`ModelConfig.mtp_heads`), saved
  again in its `pretrain.pt` at the same step, so later phases and every load have them (a resume that finds the
  model saved but not marked distils them again, from scratch, with the same seed).
- Does not: own the training loops (model/training/pretrain.py `pretrain`, model/training/sft.py `sft`), the
  corpus (model/training/corpus.py) or the `[pretrain]` keys (topology/file/schema.py `PretrainPhase`).
"""

from __future__ import annotations

import dataclasses
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import structlog
import torch
import torch.nn.functional as F

from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.interface import Policy, PolicyError
from rlbus.model.policies.transformer import Transformer
from rlbus.model.sampling.evaluate import EvalResult, evaluate_pass_at_1
from rlbus.model.tasks.builtin import eval_tasks
from rlbus.model.training.corpus import (
    Decontaminator,
    long_documents,
    repositories,
    repository_ids,
    split_repositories,
    stdlib_root,
    windows,
)
from rlbus.model.training.pretrain import (
    CHECKPOINT_NAME,
    LOSS_PLOT,
    SUMMARY_NAME,
    PretrainConfig,
    PretrainProgress,
    Progress,
    _save,
    _save_hf,
    eval_dict,
    load_start,
    plot_losses,
    pretrain,
)

__all__ = ["HELD_OUT_DOCS", "Phase", "PhasesResult", "extend_context", "held_out_loss", "marker_name", "phases_done",
           "run_phases"]

log = structlog.get_logger()

HELD_OUT_DOCS: Final = 4
"""Held-out windows the long-context loss is measured on, before and after the phase."""
SFT_LR: Final = 1e-4
SFT_WARMUP: Final = 5
PhaseKind = Literal["main", "long_context", "sft"]


@dataclass(frozen=True, slots=True)
class Phase:
    """One phase (`[[pretrain.phases]]`, topology/file/schema.py `PretrainPhase` says what each field means);
    None takes the run's default."""

    name: str
    kind: PhaseKind = "main"
    steps: int = 1
    seq_len: int | None = None
    lr: float | None = None
    warmup_steps: int | None = None
    min_lr_ratio: float | None = None
    batch_size: int | None = None
    data: str = ""
    rope_theta: float | None = None
    mtp_heads: int = 0
    mtp_steps: int | None = None
    tool_list: str = "auto"
    """An sft phase's framing of the tools, as the agentic generator lists them (`[generator.agentic] tool_list`)."""
    observation_tokens: int | None = None
    """An sft phase's cut of an observation, as the generator cuts it (`[generator.agentic] observation_tokens`);
    None: model/training/sft.py's default."""


@dataclass(frozen=True, slots=True)
class PhasesResult:
    """What a run of phases produced: the model (a `pretrain.pt` or the directory), the summary, the total step
    count, the held-out pass@1 after the last phase, each phase's record (its marker) and the policy."""

    checkpoint: Path
    summary: Path
    steps: int
    eval: EvalResult
    phases: list[dict[str, Any]]
    policy: Policy
    wall_s: float


def marker_name(index: int, phase: Phase) -> str:
    """The file that says phase `index` (from 0) finished: `phase-<index + 1>-<name>.done` (its record, JSON)."""
    return f"phase-{index + 1}-{phase.name}.done"


def phases_done(out_dir: Path, phases: list[Phase]) -> bool:
    """Whether `run_phases` finished `phases` in `out_dir`: its final summary, written after the last phase's
    marker, lists them (a phase's own summary lists none)."""
    summary = out_dir / SUMMARY_NAME
    if not summary.is_file():
        return False
    try:
        doc = json.loads(summary.read_text())
    except ValueError:
        return False
    return bool(doc.get("final")) and [p.get("name") for p in doc.get("phases", [])] == [p.name for p in phases]


def ntk_theta(theta: float, ratio: float, head_dim: int) -> float:
    """The RoPE base for a context `ratio` times longer, NTK-aware: `theta * ratio ** (d / (d - 2))`."""
    return theta * ratio ** (head_dim / max(head_dim - 2, 1))


def extend_context(policy: Policy, seq_len: int, rope_theta: float | None = None) -> tuple[Policy, float]:
    """`policy` with a context of `seq_len` and the RoPE base `rope_theta` (default `ntk_theta` of the ratio), and
    that base. A built-in policy gets a new `ModelConfig` (same weights); a Hugging Face one has `max_position_embeddings`
    and the RoPE base rewritten in its config.json (`rope_parameters`, or `rope_theta`) and is loaded again, so
    plain transformers loads what it saves.

    :raises PolicyError: `seq_len` not past the policy's context, or a config without a RoPE base.
    """
    if seq_len <= policy.max_seq_len:
        raise PolicyError(f"seq_len {seq_len}: a long-context phase extends the context past the policy's "
                          f"{policy.max_seq_len} tokens")
    ratio = seq_len / policy.max_seq_len
    if isinstance(policy, BuiltinPolicy):
        cfg = policy.config
        theta = rope_theta or ntk_theta(cfg.rope_theta, ratio, cfg.d_model // cfg.n_heads)
        model = Transformer(dataclasses.replace(cfg, max_seq_len=seq_len, rope_theta=theta))
        model.load_state_dict(policy.transformer.state_dict())
        return BuiltinPolicy(model.to(policy.device), policy.tokenizer), theta
    from rlbus.model.policies.hf import HFPolicy

    with tempfile.TemporaryDirectory(prefix="rlbus-long-") as tmp:
        folder = Path(tmp)
        for name, data in policy.files().items():
            (folder / name).write_bytes(data)
        policy.module.save_pretrained(folder)  # type: ignore[operator]
        config = json.loads((folder / "config.json").read_text())
        rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else None
        old = (rope or config).get("rope_theta")
        if not isinstance(old, int | float):
            raise PolicyError("config.json: no rope_theta (nor rope_parameters.rope_theta); a long-context phase "
                              "extends a RoPE model")
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        theta = rope_theta or ntk_theta(float(old), ratio, head_dim)
        (rope if rope is not None else config)["rope_theta"] = theta
        config["max_position_embeddings"] = seq_len
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        extended = HFPolicy.load(folder, device=policy.device, dtype=torch.float32)
    return extended, theta


def held_out_loss(policy: Policy, docs: list[list[int]]) -> float:
    """Mean cross-entropy (nats per predicted token) of `policy` on `docs`, one at a time, without gradients."""
    total, count = 0.0, 0
    was_training = policy.module.training
    policy.eval()
    with torch.no_grad():
        for ids in docs:
            x = torch.tensor([ids], device=policy.device)
            logits = policy.forward(x[:, :-1]).logits.float()[0]
            total += float(F.cross_entropy(logits, x[0, 1:], reduction="sum"))
            count += len(ids) - 1
    if was_training:
        policy.train()
    return total / max(count, 1)


def _saved_step(out_dir: Path, hf: bool) -> int | None:
    """The step count the model in `out_dir` was saved with (written together with its weights), None when
    there is none."""
    if hf:
        summary = out_dir / SUMMARY_NAME
        if not (out_dir / "config.json").is_file() or not summary.is_file():
            return None
        return int(json.loads(summary.read_text()).get("step", -1))
    file = out_dir / CHECKPOINT_NAME
    if not file.is_file():
        return None
    return int(torch.load(file, map_location="cpu", weights_only=True)["meta"].get("step", -1))


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


def _save_model(out_dir: Path, policy: Policy, document: dict[str, Any]) -> None:
    """`out_dir` holds `policy` with `document` as its summary (the weights and the step together, as
    `_saved_step` reads them)."""
    if isinstance(policy, BuiltinPolicy):
        out_dir.mkdir(parents=True, exist_ok=True)
        _save(out_dir / CHECKPOINT_NAME, policy.transformer, PretrainConfig(model=policy.config),
              {"seed": document.get("seed", 0), "step": document["step"], "final": False})
        _write_json(out_dir / SUMMARY_NAME, document)
    else:
        _save_hf(out_dir, policy, document)


def _main(config: PretrainConfig, phase: Phase, seed: int, out_dir: Path, threads: int, progress: Progress | None,
          policy: Policy | None, begin: int, origin: str, device: str) -> tuple[Policy, list[float], dict[str, Any]]:
    dirs = (*config.corpus_dirs, phase.data) if phase.data else config.corpus_dirs
    cfg = _schedule(config, phase, corpus_dirs=dirs,
                    code_fraction=config.code_fraction or (0.5 if phase.data else 0.0))
    result = pretrain(cfg, phase.steps, seed, out_dir, threads, progress, policy=policy, start_step=begin,
                      origin=origin, device=device, seq_len=phase.seq_len, evaluate=False)
    assert result.policy is not None
    losses = json.loads((out_dir / SUMMARY_NAME).read_text())["losses"]
    return result.policy, losses, {"seq_len": phase.seq_len or result.policy.max_seq_len}


def _long(config: PretrainConfig, phase: Phase, seed: int, out_dir: Path, threads: int, progress: Progress | None,
          policy: Policy, begin: int, origin: str, device: str) -> tuple[Policy, list[float], dict[str, Any]]:
    assert phase.seq_len is not None        # the schema refuses a long-context phase without one
    before_len = policy.max_seq_len
    extended, theta = extend_context(policy, phase.seq_len, phase.rope_theta)
    roots = [Path(phase.data)] if phase.data else [stdlib_root()]
    clean = Decontaminator(eval_tasks(config.task_seed, config.eval_n))
    train, held = split_repositories(repositories(roots))
    length = phase.seq_len + 1
    docs = [w for repo in held for w in windows(repository_ids(repo, extended.tokenizer, clean), length)]
    docs = sorted(docs, key=len, reverse=True)[:HELD_OUT_DOCS]
    before = held_out_loss(extended, docs)
    report = progress or (lambda _: None)
    report(PretrainProgress("long context", begin, begin + phase.steps, 0.0,
                            note=f"context {before_len} -> {phase.seq_len}, rope base {theta:,.0f}; held-out loss "
                                 f"at {phase.seq_len} tokens {before:.4f} ({len(docs)} windows of {len(held)} "
                                 "held-out repositories)"))
    batch = phase.batch_size or max(1, config.batch_size * before_len // phase.seq_len)
    cfg = _schedule(config, phase, batch_size=batch)
    documents = long_documents(train, extended.tokenizer, length, random.Random(f"rlbus-long:{seed + begin}"), clean)
    result = pretrain(cfg, phase.steps, seed, out_dir, threads, progress, policy=extended, start_step=begin,
                      origin=origin, device=device, documents=documents, seq_len=phase.seq_len, evaluate=False)
    assert result.policy is not None
    after = held_out_loss(result.policy, docs)
    report(PretrainProgress("long context", begin + phase.steps, begin + phase.steps, result.train_s,
                            note=f"held-out loss at {phase.seq_len} tokens {before:.4f} -> {after:.4f}"))
    losses = json.loads((out_dir / SUMMARY_NAME).read_text())["losses"]
    record = {"seq_len": phase.seq_len, "from_seq_len": before_len, "rope_theta": theta, "batch_size": batch,
              "held_out": {"before": before, "after": after, "documents": len(docs),
                           "tokens": sum(len(d) for d in docs), "repositories": [name for name, _ in held]}}
    return result.policy, losses, record


def _sft(config: PretrainConfig, phase: Phase, seed: int, out_dir: Path, threads: int, progress: Progress | None,
         policy: Policy, begin: int, origin: str, device: str) -> tuple[Policy, list[float], dict[str, Any]]:
    from rlbus.model.training.sft import SFTConfig, read_conversations, sft

    conversations = read_conversations(Path(phase.data))
    sft_config = SFTConfig(steps=phase.steps, lr=phase.lr or SFT_LR, batch_size=phase.batch_size or config.batch_size,
                           warmup_steps=SFT_WARMUP if phase.warmup_steps is None else phase.warmup_steps,
                           min_lr_ratio=config.min_lr_ratio if phase.min_lr_ratio is None else phase.min_lr_ratio,
                           tool_list=phase.tool_list,  # type: ignore[arg-type]
                           **({} if phase.observation_tokens is None else
                              {"observation_tokens": phase.observation_tokens}))
    result = sft(policy, conversations, sft_config, seed=seed + begin, threads=threads, progress=progress,
                 device=device, start_step=begin)
    document = {"seed": seed, "step": begin + phase.steps, "final": False, "policy": policy.kind,
                "start_step": begin, "from": origin, "losses": result.losses}
    _save_model(out_dir, result.policy, document)
    return result.policy, result.losses, {"data": phase.data, "conversations": result.conversations,
                                          "truncated": result.truncated, "skipped": result.skipped,
                                          "trained_tokens": result.trained_tokens}


def _distill(config: PretrainConfig, phase: Phase, seed: int, out_dir: Path, policy: Policy, begin: int
             ) -> dict[str, Any]:
    """Distil `phase.mtp_heads` fresh heads from the phase's model (frozen) on the pretraining corpus of a main
    phase's data, for `mtp_steps` steps (default the phase's), and save them: a Hugging Face policy's into
    `mtp_heads.safetensors` beside the model, the built-in policy's in its `pretrain.pt` (written again with them,
    its step and summary unchanged). Returns their record.

    :raises PolicyError: a routed (MoE) policy: speculative sampling, the heads' only use, refuses it.
    """
    from rlbus.model.policies.hf import HFPolicy
    from rlbus.model.training.mtp import MTP_FILE, distill_mtp_heads, summary
    from rlbus.model.training.pretrain import _corpus

    if policy.moe is not None:
        raise PolicyError(f"phase {phase.name!r}: mtp_heads on a routed (MoE) policy; speculative sampling records "
                          "no routing and refuses it, so its heads would never draft")
    dirs = (*config.corpus_dirs, phase.data) if phase.data and phase.kind == "main" else config.corpus_dirs
    cfg = dataclasses.replace(config, corpus_dirs=dirs,
                              code_fraction=config.code_fraction or (0.5 if phase.data and phase.kind == "main"
                                                                     else 0.0))
    length = min(policy.max_seq_len, phase.seq_len or policy.max_seq_len)
    documents = _corpus(cfg, seed + begin, policy.tokenizer, length, eval_tasks(config.task_seed, config.eval_n))
    result = distill_mtp_heads(policy, documents, n_heads=phase.mtp_heads, steps=phase.mtp_steps or phase.steps,
                               batch_size=phase.batch_size or config.batch_size, seq_len=length, seed=seed + begin)
    if isinstance(policy, BuiltinPolicy):       # the heads are weights of its model: save it again, same step
        meta = torch.load(out_dir / CHECKPOINT_NAME, map_location="cpu", weights_only=True)["meta"]
        _save(out_dir / CHECKPOINT_NAME, policy.transformer, dataclasses.replace(config, model=policy.config),
              dict(meta))
        return {**summary(result), "file": CHECKPOINT_NAME}
    assert isinstance(policy, HFPolicy)
    policy.set_mtp_heads(result.heads)
    tmp = out_dir / f".{MTP_FILE}.tmp"
    tmp.write_bytes(policy.files()[MTP_FILE])
    tmp.replace(out_dir / MTP_FILE)
    return summary(result)


def _schedule(config: PretrainConfig, phase: Phase, **more: Any) -> PretrainConfig:
    """`config` with the phase's schedule; no intermediate checkpoint (a phase is saved once, at its end)."""
    pick = {"lr": phase.lr, "warmup_steps": phase.warmup_steps, "min_lr_ratio": phase.min_lr_ratio,
            "batch_size": phase.batch_size}
    chosen = {k: v for k, v in pick.items() if v is not None}
    return dataclasses.replace(config, **{**chosen, "checkpoint_every": phase.steps + 1, **more})


RUNNERS: Final = {"main": _main, "long_context": _long, "sft": _sft}


def run_phases(config: PretrainConfig, phases: list[Phase], seed: int, out_dir: Path, threads: int,
               progress: Progress | None = None, *, policy: Policy | None = None, start_step: int = 0,
               origin: str = "", device: str = "cpu") -> PhasesResult:
    """Run `phases` in order into `out_dir`, the first from `policy` (None: a fresh built-in one, as `pretrain`),
    each later one from the model the one before it saved; then greedy pass@1 on the held-out tasks once, the
    summary (`pretrain.json`: every phase's record, all losses) and `loss.png` with the phases marked.

    A phase's marker (`marker_name`, its record) is written after its model; a run started again skips the phases
    with a marker, and one whose model was saved but not marked gets its marker, so each phase trains once.

    :raises PolicyError: `out_dir` holds markers of other phases, or a model at a step no phase boundary has.
    """
    if not phases:
        raise ValueError("run_phases needs at least one phase")
    report = progress or (lambda _: None)
    started = time.monotonic()
    hf = policy is not None and not isinstance(policy, BuiltinPolicy)
    records: list[dict[str, Any]] = []
    current: Policy | None = None
    begin = start_step
    for k, phase in enumerate(phases):
        marker = out_dir / marker_name(k, phase)
        end = begin + phase.steps
        head = {"index": k + 1, "name": phase.name, "kind": phase.kind, "steps": phase.steps, "start_step": begin}
        if marker.is_file():
            record = json.loads(marker.read_text())
            if {key: record.get(key) for key in head} != head:
                raise PolicyError(f"{marker}: the marker of another phase ({record.get('kind')} "
                                  f"{record.get('steps')} steps from step {record.get('start_step')}); these phases "
                                  f"need a new output folder")
            records.append(record)
            current, begin = None, end
            continue
        saved = _saved_step(out_dir, hf) if out_dir.is_dir() else None
        if saved == end:                    # saved, then stopped before its marker was written
            summary = json.loads((out_dir / SUMMARY_NAME).read_text()) if (out_dir / SUMMARY_NAME).is_file() else {}
            record = {**head, "losses": summary.get("losses", []) if summary.get("step") == end else [],
                      "resumed": "saved before its marker"}
            if phase.mtp_heads:
                record["mtp"] = _distill(config, phase, seed, out_dir, load_start(out_dir, device=device)[0], begin)
            _write_json(marker, record)
            records.append(record)
            current, begin = None, end
            continue
        if k == 0:
            start = policy
        elif current is not None:
            start = current
        elif saved == begin:
            start, _ = load_start(out_dir, device=device)
        else:
            raise PolicyError(f"{out_dir}: holds a model at step {saved}, not at the end of phase {k} "
                              f"({begin}); these phases need a new output folder")
        if phase.kind != "main" and start is None:
            raise PolicyError(f"phase {phase.name!r} ({phase.kind}) needs a model to start from: put a main phase "
                              "first or start from a model directory")
        report(PretrainProgress("phase", begin, end, time.monotonic() - started,
                                note=f"{k + 1}/{len(phases)} {phase.name!r} ({phase.kind}), {phase.steps} steps"))
        t0 = time.monotonic()
        trained, losses, extra = RUNNERS[phase.kind](config, phase, seed, out_dir, threads, progress, start, begin,
                                                     origin, device)
        if phase.mtp_heads:
            extra["mtp"] = _distill(config, phase, seed, out_dir, trained, begin)
        record = {**head, "losses": losses, "seconds": round(time.monotonic() - t0, 2), **extra}
        _write_json(marker, record)
        log.info("pretrain_phase_done", phase=phase.name, kind=phase.kind, steps=phase.steps,
                 final_loss=losses[-1] if losses else None)
        records.append(record)
        current, begin = trained, end
        hf = not isinstance(trained, BuiltinPolicy)
    final = current if current is not None else load_start(out_dir, device=device)[0]
    final.eval()
    held_out = eval_tasks(config.task_seed, config.eval_n)
    report(PretrainProgress("eval", begin, begin, time.monotonic() - started,
                            note=f"greedy pass@1 on {config.eval_n} held-out tasks"))
    result = evaluate_pass_at_1(final, final.tokenizer, held_out, max_new_tokens=config.max_new_tokens)
    losses = [x for r in records for x in r["losses"]]
    previous = json.loads((out_dir / SUMMARY_NAME).read_text()) if (out_dir / SUMMARY_NAME).is_file() else {}
    summary = {**previous, "seed": seed, "step": begin, "final": True, "threads": threads,
               "task_seed": config.task_seed, "policy": final.kind, "start_step": start_step, "from": origin,
               "first_loss": losses[0] if losses else None,
               "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
               "eval": eval_dict(result), "wall_s": round(time.monotonic() - started, 2),
               "phases": [{k: v for k, v in r.items() if k != "losses"} for r in records], "losses": losses}
    _write_json(out_dir / SUMMARY_NAME, summary)
    marks = [(f"{r['name']} ({r['kind']})", r["start_step"]) for r in records]
    plot_losses(out_dir / LOSS_PLOT, losses, start_step, marks)
    checkpoint = out_dir / CHECKPOINT_NAME if isinstance(final, BuiltinPolicy) else out_dir
    report(PretrainProgress("checkpoint", begin, begin, time.monotonic() - started, note=str(checkpoint)))
    return PhasesResult(checkpoint, out_dir / SUMMARY_NAME, begin, result, records, final,
                        time.monotonic() - started)
