"""`rlbus bench precision`: what the MoE experts' NVFP4 / MXFP8 forward and MXFP8 backward do to the numbers
the trainer sees, on the built-in MoE policy and on a Qwen3-MoE built on the spot.

- Owns: the precision benchmark (`run`): logprob drift, batch invariance, router mismatch, gradient error
  and a short RL run per recipe, each against the plain bf16 forward in the same run.
- Does not: assert anything about the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from rlbus.ops.bench.hf_model import CACHE_ROOT

RECIPES: Final = ("bf16", "mxfp8", "nvfp4")
RL_RECIPES: Final = ("bf16", "nvfp4")
SWEEP: Final = (0.9, 1.0)
"""Further plausibility thresholds of the checked replay, reported under `routing.sweep` (1.0: every replayed
expert outside the trainer's own top k is replaced)."""
_SEED: Final = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision-preset", choices=["tiny", "small"], default="tiny",
                   help="precision: pretrain preset of the built-in MoE policy (MoE feed-forward on every other "
                        "layer, 4 experts, top 2; default tiny)")
    p.add_argument("--precision-pretrain-steps", type=int, default=1500,
                   help="precision: pretraining steps of the built-in MoE policy, cached (default 1500)")
    p.add_argument("--precision-threshold", type=float, default=0.5,
                   help="precision: router replay plausibility threshold of the checked arm (default 0.5)")
    p.add_argument("--precision-rl-steps", type=int, default=40,
                   help="precision: optimizer steps per recipe of the RL run (default 40; 0 skips it)")
    p.add_argument("--precision-heldout", type=int, default=500,
                   help="precision: held-out tasks of the RL run's evaluations (default 500)")
    p.add_argument("--precision-tasks-per-step", type=int, default=4,
                   help="precision: tasks per RL step, each sampled --precision-group times (default 4)")
    p.add_argument("--precision-group", type=int, default=8, help="precision: samples per task (default 8)")
    p.add_argument("--precision-lr", type=float, default=1e-4, help="precision: RL learning rate (default 1e-4)")
    p.add_argument("--precision-threads", type=int, default=1, help="precision: torch threads (default 1)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every figure and return them.

    Every figure is measured against the plain forward ("bf16": `F.linear` on the
    fp32 master weights, what `[trainer] precision = "bf16"` runs) in the same run:
    - `logprob_drift`: |logprob - bf16 logprob| per completion token (mean, p99) of the same sampled rollouts, per
      recipe (`bf16`, `mxfp8`, `nvfp4` on the experts; `bfloat16_weights`: the plain forward of the model cast to
      bfloat16, what a generator's published version computes); routing is free (not replayed), so a flipped
      expert counts.
    - `batch_invariant_nvfp4`: a token's NVFP4 codes and scales, and its row-wise layer output, are bit-identical
      whichever tokens share its batch; `batch_variance_per_tensor` the counter-case (largest change of a token's
      layer output relative to its largest output, with one scale per tensor); `batch_invariant_gemm` whether the
      batched fp32 product itself is (the CPU GEMM's reduction order depends on the batch).
    - `router_mismatch_p99`: p99 of |trainer logprob - behaviour logprob| per token with router replay off, on, and
      on with the plausibility check (`--precision-threshold`; `routing.sweep`: at 0.9 and 1.0). Behaviour: a
      generator sampling from the bfloat16 cast of the policy (KV cache, batched decoding); trainer: the fp32
      master, one full-sequence forward; both run NVFP4 experts. The check moves a replayed expert to the trainer's
      own choice, away from the behaviour's: it buys plausible routing with part of what replay saved, and lowers
      this mismatch below replay's only by chance.
    - `grad_check`: relative error ||g - g_bf16|| / ||g_bf16|| of each parameter's gradient of the mean completion
      logprob under the mxfp8 recipe (MXFP8 forward and backward on the experts) against the plain one.
    - `rl`: a short RL run per recipe (bf16, nvfp4) from the same pretrained base, same seed, same task stream and
      equal optimizer steps (`build_core` and `TrainerCore.train_step`; a generator built from the published spec, at
      its precision, holding the published bfloat16 version in float32, samples each batch; tasks of levels 1-2, one
      attempt, reward 1 for passing every hidden test, only groups whose rewards differ trained, as the default run),
      held-out greedy pass@1 of the trainer's policy before and after.
    The built-in policy is pretrained on task documents once into `.rlbus/bench/precision-<preset>-<steps>/`; the
    Qwen3-MoE (randomly initialised, `build_hf_dir`) is built into `.rlbus/bench/precision-qwen3-moe/`.
    """
    import torch

    quick = bool(getattr(args, "quick", False))
    torch.set_num_threads(max(1, args.precision_threads))
    preset = "tiny" if quick else args.precision_preset
    pretrain_steps = 5 if quick else args.precision_pretrain_steps
    shape = ({"tasks": 2, "group": 2, "new_tokens": 16} if quick else {"tasks": 8, "group": 4, "new_tokens": 64})
    started = time.perf_counter()
    policy, path = _builtin(preset, pretrain_steps, args.precision_threads)
    rollouts = _sample(policy, shape, "bf16")
    result: dict[str, Any] = {"policy": {"preset": preset, "pretrain_steps": pretrain_steps,
                                         **_moe_shape(policy)}, "rollouts": shape}
    _say(f"policy ready ({time.perf_counter() - started:.0f} s); drift, batch invariance, router mismatch, gradients")
    result["logprob_drift"] = _drift(policy, rollouts)
    result |= _batch_invariance(_expert_weight(policy))
    moe_rollouts = _sample(policy, shape, "nvfp4")
    result["router_mismatch_p99"], result["routing"] = _mismatch(policy, moe_rollouts, args.precision_threshold)
    result["routing"]["threshold"] = args.precision_threshold
    result["grad_check"] = _grad_check(policy, rollouts)
    _say(f"built-in done ({time.perf_counter() - started:.0f} s); Qwen3-MoE")
    hf = _qwen3_moe()
    hf_rollouts = _sample(hf, shape, "bf16")
    result["qwen3_moe"] = {
        **_moe_shape(hf), "logprob_drift": _drift(hf, hf_rollouts),
        **dict(zip(("router_mismatch_p99", "routing"),
                   _mismatch(hf, _sample(hf, shape, "nvfp4"), args.precision_threshold), strict=True))}
    rl_steps = 1 if quick else args.precision_rl_steps
    rl_shape = ({"steps": 1, "heldout": 4, "tasks": 1, "group": 2, "new_tokens": 16} if quick else
                {"steps": rl_steps, "heldout": args.precision_heldout, "tasks": args.precision_tasks_per_step,
                 "group": args.precision_group, "new_tokens": 128})
    if rl_steps > 0:
        result["rl"] = {"settings": {**rl_shape, "lr": args.precision_lr, "temperature": _RL_TEMPERATURE}}
        for recipe in RL_RECIPES:
            _say(f"RL at {recipe} ({time.perf_counter() - started:.0f} s)")
            result["rl"][recipe] = _rl(path, recipe, rl_shape, args.precision_lr)
        bf16, nvfp4 = result["rl"]["bf16"], result["rl"]["nvfp4"]
        result["rl"]["verdict"] = {"bf16_learned": bf16["ci95"][0] > bf16["base_ci95"][1],
                                   "nvfp4_overlaps_bf16": nvfp4["ci95"][0] <= bf16["ci95"][1]
                                   and bf16["ci95"][0] <= nvfp4["ci95"][1]}
    result["wall_s"] = time.perf_counter() - started
    return result


def _say(line: str) -> None:
    print(f"bench precision: {line}", file=sys.stderr, flush=True)


# ---- policies -------------------------------------------------------------------------------------------------
def _builtin(preset: str, steps: int, threads: int) -> tuple[Any, Path]:
    """The built-in MoE policy of `preset` pretrained `steps` steps on task documents (cached) and its checkpoint."""
    import json

    from rlbus.model.policies.interface import load_policy
    from rlbus.model.training.pretrain import CHECKPOINT_NAME, SUMMARY_NAME, PretrainConfig, pretrain

    out = CACHE_ROOT / f"precision-{preset}-{steps}"
    summary = out / SUMMARY_NAME
    if not (summary.is_file() and json.loads(summary.read_text()).get("final")):
        config = PretrainConfig.preset(preset, eval_n=8, checkpoint_every=10**9)
        layers = tuple(range(1, config.model.n_layers, 2))
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, moe_layers=layers,
                                                                       n_experts=4, top_k=2))
        pretrain(config, steps, _SEED, out, threads)
    return load_policy(out / CHECKPOINT_NAME), out / CHECKPOINT_NAME


def _qwen3_moe() -> Any:
    """A tiny Qwen3-MoE (4 experts, top 2, every layer sparse; random weights) through rlbus's HF policy."""
    import torch

    from rlbus.model.policies.hf import HFPolicy
    from rlbus.model.policies.hf_checks import inspect_dir
    from rlbus.model.policies.hf_recipe import build_hf_dir
    from rlbus.model.policies.interface import PolicyError
    from rlbus.model.tasks.builtin import eval_tasks

    out = CACHE_ROOT / "precision-qwen3-moe"
    try:
        inspect_dir(out)
    except PolicyError:  # missing or unfinished: build it again
        texts = [t.prompt + "\n" + t.solution for t in eval_tasks(1, 200)]
        build_hf_dir(out, architecture="qwen3_moe", texts=texts, vocab_size=512, size="tiny", max_seq_len=512)
    return HFPolicy.load(out, dtype=torch.float32)


def _moe_shape(policy: Any) -> dict[str, Any]:
    params = sum(p.numel() for p in policy.module.parameters())
    n_moe, top_k = policy.moe
    return {"architecture": type(policy.module).__name__, "params": params, "moe_layers": n_moe, "top_k": top_k,
            "quantised_layers": _numerics(policy, "nvfp4")[1]}


def _numerics(policy: Any, precision: str, threshold: float = 0.0) -> tuple[Any, int]:
    """A copy of `policy` whose experts run `precision`, router replay checked at `threshold`, and how many Linear
    layers that quantised."""
    from rlbus.model.policies.quant import set_numerics

    net = policy.clone()
    return net, set_numerics(net.module, precision, "experts", threshold)


def _expert_weight(policy: Any) -> Any:
    from torch import nn

    return next(m.weight for name, m in policy.module.named_modules()
                if ".experts." in f".{name}." and isinstance(m, nn.Linear)).detach().float()


# ---- sampling -------------------------------------------------------------------------------------------------
def _sample(policy: Any, shape: dict[str, int], precision: str) -> list[Any]:
    """Rollouts a generator samples: the bfloat16 cast of `policy` at `precision`, temperature 1, KV cache,
    batched; training tasks (seed 1), `shape["group"]` samples each, routing recorded."""
    import torch

    from rlbus.model.sampling.generate import generate
    from rlbus.model.tasks.builtin import train_tasks

    stream = train_tasks(1, eval_seed=0)
    tasks = [next(stream) for _ in range(shape["tasks"])]
    gen = _numerics(policy, precision)[0].to_(dtype=torch.bfloat16).eval()
    tok = policy.tokenizer
    prompts = [tok.prompt_ids(t.prompt) for t in tasks for _ in range(shape["group"])]
    with torch.no_grad():
        samples = generate(gen, prompts, max_new_tokens=shape["new_tokens"], temperature=1.0, eos_id=tok.stop_id,
                           pad_id=tok.pad_id, generator=torch.Generator().manual_seed(_SEED))
    return _rollouts(samples, [t.task_id for t in tasks for _ in range(shape["group"])], shape["group"],
                     [0.0] * len(samples))


def _rollouts(samples: Sequence[Any], task_ids: Sequence[str], group: int, rewards: Sequence[float]) -> list[Any]:
    from rlbus.messages.schemas import Rollout, TensorBlob

    out = []
    for i, (s, task_id, reward) in enumerate(zip(samples, task_ids, rewards, strict=True)):
        n = len(s.tokens)
        out.append(Rollout(
            rollout_id=f"precision-{task_id}-{i}", task_id=task_id, group_index=i % group, group_size=group,
            prompt_tokens=TensorBlob.of(s.prompt.tolist(), "int32"),
            completion_tokens=TensorBlob.of(s.tokens.tolist(), "int32"),
            behaviour_logprobs=TensorBlob.of(s.logprobs.float().tolist(), "float32"),
            policy_versions=TensorBlob.of([0] * n, "int32"), loss_mask=TensorBlob.of([], "uint8"),
            routing=None if s.routing is None else TensorBlob.of(s.routing.numpy(), "int64"),
            reward=reward, region="hub", generator_id="bench"))
    return out


# ---- drift ----------------------------------------------------------------------------------------------------
def _token_logprobs(policy: Any, rollouts: Sequence[Any], *, replay: bool, threshold: float = 0.0,
                    precision: str = "bf16") -> tuple[Any, Any, int]:
    """Per completion token: (trainer logprob, behaviour logprob), both flat, and the experts the check
    replaced; the trainer as `TrainerCore` builds it (fp32 master) at `precision`."""
    import torch

    from rlbus.actors.trainer.core import TrainerCore, rollout_batch

    net, _ = _numerics(policy, precision, threshold)
    core = TrainerCore(net, net.clone(), lr=1e-5, seed=_SEED)
    batch = rollout_batch(rollouts, moe=core.moe if replay else None)
    with torch.no_grad():
        logp, replaced = core.logprobs_replaced(core.policy, batch)
    return logp[batch.mask], batch.behaviour[batch.mask], replaced


def _stats(diff: Any) -> dict[str, float]:
    d = diff.double().abs()
    return {"mean": float(d.mean()), "p99": float(d.quantile(0.99))}


def _drift(policy: Any, rollouts: Sequence[Any]) -> dict[str, dict[str, float]]:
    import torch

    from rlbus.actors.trainer.core import rollout_batch
    from rlbus.kernels.logprob import token_logprob

    reference, _, _ = _token_logprobs(policy, rollouts, replay=False)
    out = {}
    for recipe in RECIPES:
        logp, _, _ = _token_logprobs(policy, rollouts, replay=False, precision=recipe)
        out[recipe] = _stats(logp - reference)
    batch = rollout_batch(rollouts)
    cast = policy.clone().to_(dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = cast(batch.tokens).logits[:, :-1].float()
    out["bfloat16_weights"] = _stats(token_logprob(logits, batch.tokens[:, 1:])[batch.mask] - reference)
    return out


def _mismatch(policy: Any, rollouts: Sequence[Any], threshold: float) -> tuple[dict[str, float], dict[str, Any]]:
    """p99 |trainer - behaviour| per token with replay off, on, and checked at `threshold`; and the routing: the
    share of (token, MoE layer) whose experts the trainer's own router picks differently from the recorded ones,
    and how many replayed experts the check replaced."""
    import torch

    from rlbus.actors.trainer.core import rollout_batch

    out: dict[str, float] = {}
    replaced = 0
    for arm, replay, t in (("off", False, 0.0), ("replay", True, 0.0), ("replay_checked", True, threshold)):
        trainer, behaviour, n = _token_logprobs(policy, rollouts, replay=replay, threshold=t, precision="nvfp4")
        out[arm] = _stats(trainer - behaviour)["p99"]
        replaced = max(replaced, n)
    sweep = {}
    for t in SWEEP:
        trainer, behaviour, n = _token_logprobs(policy, rollouts, replay=True, threshold=t, precision="nvfp4")
        sweep[str(t)] = {"p99": _stats(trainer - behaviour)["p99"], "replaced_experts": n}
    batch = rollout_batch(rollouts, moe=policy.moe)
    net, _ = _numerics(policy, "nvfp4")
    with torch.no_grad():
        own = net.to_(dtype=torch.float32)(batch.tokens).routing
    real = torch.arange(batch.tokens.shape[1])[None, :] < (batch.prompt_lengths + batch.lengths)[:, None]
    differs = (own.sort(-1).values != batch.routing.sort(-1).values).any(-1)[real]
    return out, {"flipped_share": float(differs.float().mean()), "replaced_experts": replaced,
                 "expert_slots": int(real.sum()) * policy.moe[0] * policy.moe[1], "sweep": sweep}


# ---- kernels --------------------------------------------------------------------------------------------------
def _batch_invariance(w: Any) -> dict[str, Any]:
    """Target tokens quantised alone and inside batches of louder, quieter and zero tokens (`w`: a real expert
    weight, N x K): per-token and per-tensor NVFP4 values and row-wise outputs, and the batched product."""
    import torch

    from rlbus.kernels.nvfp4 import nvfp4_roundtrip
    from rlbus.kernels.quantmm import quant_linear

    g = torch.Generator().manual_seed(_SEED)
    K = w.shape[1]
    targets = torch.randn(8, K, generator=g)
    mates = [torch.randn(5, K, generator=g) * 1e2, torch.randn(3, K, generator=g) * 1e-3, torch.zeros(2, K),
             torch.randn(31, K, generator=g)]
    invariant, gemm_invariant = True, True
    per_tensor, gemm = 0.0, 0.0
    for i in range(len(targets)):
        target = targets[i:i + 1]
        for scale in ("token", "tensor"):
            wq = nvfp4_roundtrip(w, scale)
            alone = nvfp4_roundtrip(target, scale)
            y_alone = alone @ wq.T
            for m in mates:
                cut = i % (m.shape[0] + 1)
                batch = torch.cat([m[:cut], target, m[cut:]])
                row = nvfp4_roundtrip(batch, scale)[cut:cut + 1]
                y = row @ wq.T
                if scale == "token":
                    invariant &= torch.equal(row, alone) and torch.equal(y, y_alone)
                    y_gemm = quant_linear(batch, w, "nvfp4")[cut:cut + 1]
                    y_one = quant_linear(target, w, "nvfp4")
                    gemm_invariant &= torch.equal(y_gemm, y_one)
                    gemm = max(gemm, float((y_gemm - y_one).abs().max() / y_one.abs().max()))
                else:
                    per_tensor = max(per_tensor, float((y - y_alone).abs().max() / y_alone.abs().max()))
    return {"batch_invariant_nvfp4": bool(invariant), "batch_variance_per_tensor": per_tensor,
            "batch_invariant_gemm": bool(gemm_invariant), "batch_variance_gemm": gemm}


def _grad_check(policy: Any, rollouts: Sequence[Any]) -> dict[str, Any]:
    """||g_mxfp8 - g_bf16|| / ||g_bf16|| per parameter, of the mean completion-token logprob."""
    from rlbus.actors.trainer.core import TrainerCore, rollout_batch

    batch = rollout_batch(rollouts)
    grads = {}
    for recipe in ("bf16", "mxfp8"):
        net, _ = _numerics(policy, recipe)
        core = TrainerCore(net, net.clone(), lr=1e-5, seed=_SEED)
        core.policy.train()
        logp = core.logprobs(core.policy, batch)
        (-(logp * batch.mask).sum() / batch.mask.sum()).backward()
        grads[recipe] = {n: p.grad.detach().clone() for n, p in core.model.named_parameters() if p.grad is not None}
    errors = {n: float((grads["mxfp8"][n] - g).norm() / g.norm()) for n, g in grads["bf16"].items()
              if float(g.norm()) > 0}
    experts = [e for n, e in errors.items() if ".experts." in f".{n}."]
    return {"per_tensor": errors, "max": max(errors.values()), "max_experts": max(experts),
            "max_other": max(e for n, e in errors.items() if ".experts." not in f".{n}.")}


# ---- the RL run -----------------------------------------------------------------------------------------------
_RL_TEMPERATURE: Final = 0.7


_RL_LEVELS: Final = (1, 2)
"""Task levels of the RL run, as the default run's feeder draws them (`feeder.levels`)."""
_RL_ROUNDS: Final = 4
"""Sampling rounds a step may take to fill its batch with groups whose rewards differ."""


def _rl(path: Path, recipe: str, shape: dict[str, int], lr: float) -> dict[str, Any]:
    """Held-out greedy pass@1 of the base and after `shape["steps"]` RL steps at `recipe`, and the p99 per-token
    |trainer - behaviour| of the trained batches (replayed routing).

    Each step trains on `shape["tasks"]` groups whose rewards differ (as `[trainer] drop_flat_groups`), sampled in
    up to `_RL_ROUNDS` rounds of that many tasks; a step that finds fewer trains on those it found (and on the
    last round's flat groups when it found none, so that every recipe takes the same optimizer steps)."""
    import torch

    from rlbus.actors.trainer.core import Objective, build_core, rollout_batch
    from rlbus.model.env.episodes import completion_text
    from rlbus.model.policies.interface import policy_from_spec
    from rlbus.model.sampling.evaluate import evaluate_pass_at_1
    from rlbus.model.sampling.generate import generate
    from rlbus.model.tasks.builtin import eval_tasks, train_tasks
    from rlbus.model.tasks.grading import grade_many

    held = eval_tasks(0, shape["heldout"])
    core = build_core(str(path), lr=lr, seed=_SEED, device="cpu", precision=recipe)
    tok = core.policy.tokenizer
    base = evaluate_pass_at_1(core.policy, tok, held, max_new_tokens=shape["new_tokens"])
    stream = (t for t in train_tasks(1, eval_seed=0) if t.level in _RL_LEVELS)
    sampler = torch.Generator().manual_seed(_SEED)
    objective = Objective(temperature=_RL_TEMPERATURE, kl_coef=0.05)
    G = shape["group"]
    gaps, rewards, sampled = [], [], 0
    started = time.perf_counter()
    for step in range(shape["steps"]):
        behaviour = policy_from_spec(core.model_config_dict(), core.policy_files(), dtype=torch.float32)
        behaviour.load_tensors_(core.bf16_state())
        kept: list[Any] = []
        for _ in range(_RL_ROUNDS):
            tasks = [next(stream) for _ in range(shape["tasks"])]
            prompts = [tok.prompt_ids(t.prompt) for t in tasks for _ in range(G)]
            with torch.no_grad():
                samples = generate(behaviour, prompts, max_new_tokens=shape["new_tokens"],
                                   temperature=_RL_TEMPERATURE, eos_id=tok.stop_id, pad_id=tok.pad_id,
                                   generator=sampler)
            owners = [t for t in tasks for _ in range(G)]
            graded = grade_many([(t, completion_text(s.tokens.tolist(), tok))
                                 for t, s in zip(owners, samples, strict=True)])
            rollouts = _rollouts(samples, [t.task_id for t in owners], G, [r.reward for r in graded])
            rewards.extend(r.reward for r in graded)
            sampled += len(tasks)
            groups = [rollouts[i:i + G] for i in range(0, len(rollouts), G)]
            for group in [g for g in groups if len({r.reward for r in g}) > 1][:shape["tasks"] - len(kept) // G]:
                kept.extend(group)
            if len(kept) >= shape["tasks"] * G:
                break
        batch_rollouts = kept or rollouts
        batch = rollout_batch(batch_rollouts, moe=core.moe)
        with torch.no_grad():
            logp = core.logprobs(core.policy, batch, _RL_TEMPERATURE)
        gaps.append((logp - batch.behaviour)[batch.mask])
        stats = core.train_step(batch_rollouts, objective)
        _say(f"{recipe} step {step + 1}/{shape['steps']}: {len(kept) // G} informative groups, batch reward "
             f"{stats.reward_mean:.3f}, loss {stats.loss:.4f}")
    train_s = time.perf_counter() - started
    final = evaluate_pass_at_1(core.policy, tok, held, max_new_tokens=shape["new_tokens"])
    return {"base": base.pass_at_1, "base_ci95": [base.ci_low, base.ci_high], "pass_at_1": final.pass_at_1,
            "ci95": [final.ci_low, final.ci_high], "mismatch_p99": _stats(torch.cat(gaps))["p99"],
            "sampled_reward_mean": sum(rewards) / max(1, len(rewards)), "tasks_sampled": sampled,
            "train_s": train_s, "n": final.n}


# ---- the table ------------------------------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    r = result
    pol = r["policy"]
    lines = [f"built-in MoE ({pol['preset']}, {pol['params']} params, {pol['moe_layers']} MoE layers, top "
             f"{pol['top_k']}, pretrained {pol['pretrain_steps']} steps; {pol['quantised_layers']} expert Linear "
             f"layers quantised); {r['rollouts']['tasks']} x {r['rollouts']['group']} rollouts of "
             f"<= {r['rollouts']['new_tokens']} tokens",
             f"{'recipe':<17} {'drift mean':>10} {'drift p99':>10}   {'Qwen3-MoE mean':>14} {'p99':>10}"]
    hf = r["qwen3_moe"]
    for recipe, d in r["logprob_drift"].items():
        h = hf["logprob_drift"][recipe]
        lines.append(f"{recipe:<17} {d['mean']:>10.5f} {d['p99']:>10.5f}   {h['mean']:>14.5f} {h['p99']:>10.5f}")
    lines.append("router mismatch p99 |trainer - behaviour| (bfloat16 generator, KV cache, batched vs fp32 trainer, "
                 "NVFP4 experts in both):")
    for name, m, rt in (("built-in", r["router_mismatch_p99"], r["routing"]),
                        ("Qwen3-MoE", hf["router_mismatch_p99"], hf["routing"])):
        lines.append(f"  {name:<9} off {m['off']:.4f}, replay {m['replay']:.4f}, replay checked at "
                     f"{r['routing']['threshold']} {m['replay_checked']:.4f}; trainer's own experts differ on "
                     f"{rt['flipped_share']:.1%} of (token, layer); check replaced {rt['replaced_experts']} of "
                     f"{rt['expert_slots']} expert slots; "
                     + ", ".join(f"at {t}: {v['p99']:.4f} ({v['replaced_experts']} replaced)"
                                 for t, v in rt["sweep"].items()))
    lines.append(f"Qwen3-MoE: {hf['params']} params, {hf['moe_layers']} MoE layers, top {hf['top_k']}, random "
                 f"weights; {hf['quantised_layers']} expert Linear layers quantised")
    lines.append(f"batch_invariant_nvfp4 {r['batch_invariant_nvfp4']}; batch_variance_per_tensor "
                 f"{r['batch_variance_per_tensor']:.4f}; batched fp32 GEMM invariant {r['batch_invariant_gemm']} "
                 f"(largest change {r['batch_variance_gemm']:.2e})")
    gc = r["grad_check"]
    lines.append(f"grad_check (mxfp8 vs bf16, relative L2 per tensor): max {gc['max']:.4f}, experts "
                 f"{gc['max_experts']:.4f}, other {gc['max_other']:.4f} over {len(gc['per_tensor'])} tensors")
    if "rl" in r:
        s = r["rl"]["settings"]
        lines.append(f"RL: {s['steps']} steps x {s['tasks']} tasks x {s['group']} samples, lr {s['lr']}, "
                     f"held-out n = {s['heldout']}")
        for recipe in RL_RECIPES:
            x = r["rl"][recipe]
            lines.append(f"  {recipe:<6} base {x['base']:.3f} [{x['base_ci95'][0]:.3f}, {x['base_ci95'][1]:.3f}] -> "
                         f"{x['pass_at_1']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]; mismatch p99 "
                         f"{x['mismatch_p99']:.4f}; sampled reward {x['sampled_reward_mean']:.3f} over {x['tasks_sampled']} "
                         f"tasks; {x['train_s']:.0f} s")
        v = r["rl"]["verdict"]
        lines.append(f"  bf16 learned (final interval above the base's): {v['bf16_learned']}; nvfp4's interval "
                     f"overlaps bf16's: {v['nvfp4_overlaps_bf16']}")
    lines.append(f"wall {r['wall_s']:.0f} s; cpu count {os.cpu_count()}")
    return "\n".join(lines)
