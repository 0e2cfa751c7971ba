"""`rlbus bench peer`: TRL's GRPOTrainer and `rlbus up` side by side: same model, tasks, reward and budget
(`--quick`: the same number of optimizer steps, whatever the wall-clock).

- Owns: the peer benchmark (`run`): the shared Hugging Face policy (`policy_dir`), the two arms one after the
  other (ops/bench/peer_rlbus.py, then ops/bench/peer_trl.py), the scoring of every snapshot by one evaluator
  (not charged to either arm), and the summary, its table and its PNG.
- Does not: assert speed or learning.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from rlbus.ops.bench.peer_trl import ArmRun, Shared

CACHE_ROOT: Final = Path(".rlbus/bench-peer")
"""Where the built policy is kept (relative to the working directory), one folder per size and step count."""
ARMS: Final = ("trl", "rlbus")
QUICK: Final = {"group_size": 4, "tasks_per_step": 2, "max_tokens": 32}
"""--quick's batch (8 rollouts a step) and completion length: a smoke test of both arms, not a comparison."""
QUICK_STEPS: Final = 2
"""--quick's optimizer steps per arm: its work is bounded by steps, not by a wall-clock budget, so a slow machine
takes longer but every arm still steps."""
_PRETRAIN_SEED: Final = 0
TASK_STEPS_PER_S: Final = 4
"""TRL's task list is sized to last its budget at this many optimizer steps a second, well above its pace
here (about one step a second where completions are short); 10 000 tasks take about 3 s to build."""
UNMATCHED: Final = (
    "KL: rlbus weighs the k1 estimator (-log r) by trainer.kl_coef, TRL the k3 estimator by beta; the same "
    "coefficient, not the same penalty",
    "off-policy correction: rlbus's generator runs ahead of the trainer (up to trainer.staleness_versions) and "
    "weighs tokens by the truncated ratio pi/mu (cap trainer.is_cap); TRL samples with the weights it trains "
    "(ratio 1, one iteration, its PPO clip never binds)",
    "threads: TRL is one process with 2 torch threads; rlbus runs a generator and a trainer of one thread each",
    "reference precision: rlbus holds the frozen KL reference in trainer.reference_dtype (auto: bfloat16 on a CPU "
    "with native bf16 matmuls, float32 elsewhere; see reference_dtype in the JSON), TRL in the policy's float32",
    "clock: TRL's runs from trainer.train() and stops at the end of the first step past the budget; rlbus's from "
    "the first task a generator can start (processes, servers and model loading excluded in both)",
)
"""Settings that cannot be made equal between the arms, and why (printed and in the JSON)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer-minutes", type=float, default=10.0,
                   help=f"peer: wall-clock budget per arm, minutes (default 10; --quick: no budget, each arm takes "
                        f"exactly {QUICK_STEPS} optimizer steps however long they take)")
    p.add_argument("--peer-held-out", type=int, default=2000,
                   help="peer: held-out tasks every snapshot is scored on (default 2000, the whole held-out pool: "
                        "95%% intervals of about +-0.015 at pass@1 0.15, about 12 s a snapshot; --quick: 8)")
    p.add_argument("--peer-size", choices=("tiny", "small"), default="small",
                   help="peer: recipe size of the shared Qwen2 policy (default small; --quick: tiny)")
    p.add_argument("--peer-pretrain-steps", type=int, default=160,
                   help="peer: pretraining steps of the built policy (default 160, greedy pass@1 about 0.11: room "
                        "to learn in 10 minutes; 200 steps starts near this size's plateau of about 0.2; --quick: 2)")
    p.add_argument("--peer-lr", type=float, default=3e-4,
                   help="peer: learning rate of both arms, constant (default 3e-4: at hf.toml's 1e-4 neither arm moves "
                        "beyond the intervals in 10 minutes, at 1e-3 the policy collapses)")
    p.add_argument("--peer-generators", type=int, default=1, help="peer: rlbus generator processes (default 1)")
    p.add_argument("--peer-dir", type=Path, default=None, metavar="DIR",
                   help="peer: keep snapshots, the arms' state and the PNG here (default: .rlbus/bench-peer/run-*)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run both arms, score them and return the summary.

    The shared Hugging Face policy is a recipe Qwen2 built and pretrained once into `.rlbus/bench-peer/`;
    with the shared settings the two arms run one after the other (rlbus first, ops/bench/peer_rlbus.py,
    then TRL, ops/bench/peer_trl.py), then every snapshot and the base v0 are scored by one evaluator
    (`model.evaluate.evaluate_pass_at_1`: greedy pass@1 with 95% Wilson intervals on the same held-out tasks,
    graded by the rlbus sandbox; the weights rounded to bfloat16 as rlbus publishes a version, computed in
    float32 as both arms sample), not charged to either arm; then the summary (throughputs, curves, the time
    rlbus takes to reach TRL's final pass@1), its table and its PNG. Both arms' rewards and every score come
    from one sandbox supervisor (ops/local_sandbox.py) beside the bench (the rlbus arm also runs its own, as
    `rlbus up` does).
    """
    import anyio
    import msgspec
    import torch

    from rlbus.model.policies.interface import reference_dtype
    from rlbus.model.tasks.sources import held_out_tasks
    from rlbus.ops.bench.peer_rlbus import rlbus_topology
    from rlbus.ops.local_sandbox import local_sandbox
    from rlbus.ops.pretrain import _quiet_transformers
    from rlbus.topology.examples import example_path
    from rlbus.topology.file.schema import Topology

    started = time.perf_counter()
    _quiet_transformers()
    quick = bool(getattr(args, "quick", False))
    minutes = None if quick else args.peer_minutes
    arm_steps = QUICK_STEPS if quick else None            # --quick: a number of steps, not a budget
    n_held = 8 if quick else args.peer_held_out
    size = "tiny" if quick else args.peer_size
    steps = 2 if quick else args.peer_pretrain_steps
    budget = None if minutes is None else minutes * 60.0
    marks = [] if budget is None else [float(m) for m in range(60, int(budget), 60)] + [budget]
    work = (args.peer_dir or CACHE_ROOT / f"run-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    (work / "snapshots").mkdir(parents=True, exist_ok=True)
    hf = msgspec.toml.decode(example_path("hf").read_bytes(), type=Topology)
    base = policy_dir(size, steps, quick=quick, eval_seed=hf.evaluator.seed)
    batch = QUICK if quick else {"group_size": hf.generator.group_size, "max_tokens": hf.generator.max_tokens,
                                 "tasks_per_step": hf.trainer.batch_rollouts // hf.generator.group_size}
    shared = Shared(**batch, temperature=hf.generator.temperature,
                    lr=args.peer_lr, kl_coef=hf.trainer.kl_coef,
                    grad_clip=1.0, seed=0)
    topology = rlbus_topology(f"p{uuid.uuid4().hex[:8]}", work / "rlbus", base, shared,
                              generators=args.peer_generators)
    held = held_out_tasks(hf.evaluator.tasks, hf.evaluator.seed, n_held)
    train = _train_tasks(topology, n=TASK_STEPS_PER_S * shared.tasks_per_step * max(16, int(budget or 0)))
    note = "" if n_held >= 500 else f" (quick: {n_held} held-out tasks, fewer than the 2000 of a real run)"
    _say(f"policy {base}; {_per_arm(minutes, arm_steps)}; held-out {n_held} tasks{note}; state in {work}")
    with anyio.from_thread.start_blocking_portal("asyncio") as portal, \
            portal.wrap_async_context_manager(local_sandbox("bench-peer", hf.sandbox)) as bus:
        grade = functools.partial(_grade, portal, bus)
        _say("rlbus: launching")
        from rlbus.ops.bench.peer_rlbus import run_rlbus

        (work / "rlbus").mkdir(exist_ok=True)
        rl = portal.call(functools.partial(run_rlbus, topology, work / "rlbus", budget_s=budget, marks=marks,
                                           out=work / "snapshots", timeout_s=300.0, progress=_say, steps=arm_steps))
        rl.extra["load_avg_5m"] = os.getloadavg()[1]       # the arm's own processes and other work on the machine
        _say(f"rlbus: {rl.steps} steps in {rl.wall_s:.0f}s")
        _say("trl: training")
        trl = _trl_arm(base, train, shared, budget, marks, work, grade, arm_steps)
        trl.extra["load_avg_5m"] = os.getloadavg()[1]
        _say(f"trl: {trl.steps} steps in {trl.wall_s:.0f}s")
        curves = _score_all(base, held, {"trl": trl, "rlbus": rl}, shared.max_tokens,
                            functools.partial(_runner, portal, bus))
    result = summarize(curves, {"trl": trl, "rlbus": rl})
    result.update({
        "quick": quick, "minutes": minutes, "steps_per_arm": arm_steps, "held_out_n": n_held,
        "policy_dir": str(base), "size": size, "pretrain_steps": steps, "generators": args.peer_generators,
        "reference_dtype": str(reference_dtype(topology.trainer.reference_dtype, torch.device("cpu"))).split(".")[-1],
        "matched": {"group_size": shared.group_size, "tasks_per_step": shared.tasks_per_step,
                    "temperature": shared.temperature, "max_completion_tokens": shared.max_tokens, "lr": shared.lr,
                    "lr_schedule": "constant", "kl_coef": shared.kl_coef, "grad_clip": shared.grad_clip,
                    "adam_betas": [0.9, 0.95], "advantages": "group mean-centred, not std-scaled",
                    "aggregation": "token mean over the batch", "attempts": 1, "reward": "sandbox pass/fail",
                    "sampling_dtype": "float32"},
        "unmatched": list(UNMATCHED), "png": str(plot(curves, work / "peer.png")), "state_dir": str(work),
        "load_avg_1m": os.getloadavg()[0], "total_s": round(time.perf_counter() - started, 1),
    })
    (work / "peer.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def policy_dir(size: str, steps: int, *, quick: bool, eval_seed: int) -> Path:
    """The cached pretrained recipe Qwen2 of `size` after `steps` steps on task documents, built (progress on
    stderr) when missing or unfinished."""
    from rlbus.model.policies.interface import is_hf_dir
    from rlbus.model.training.pretrain import PretrainConfig, new_hf_policy, pretrain
    from rlbus.ops.pretrain import PretrainPrinter

    out = CACHE_ROOT / f"hf-{size}-{steps}"
    summary = out / "pretrain.json"
    if is_hf_dir(out) and summary.is_file() and json.loads(summary.read_text()).get("final"):
        return out.resolve()
    quick_only = {"retry_fraction": 0.0, "warmup_steps": 1, "max_new_tokens": 16, "batch_size": 4} if quick else {}
    config = PretrainConfig.preset(size, eval_n=1 if quick else 64, checkpoint_every=10**9 if quick else 50,
                                   stdlib=False, code_fraction=0.0, task_seed=eval_seed, **quick_only)
    _say(f"building {out} (hf qwen2 {size}, {steps} pretraining steps on task documents); later runs reuse it")
    policy = new_hf_policy(config, "qwen2", size, _PRETRAIN_SEED, max_seq_len=config.model.max_seq_len)
    result = pretrain(config, steps, _PRETRAIN_SEED, out, 2, PretrainPrinter(sys.stderr, prefix="bench peer: ",
                                                                             every=20), policy=policy)
    _say(f"pretrained in {result.wall_s:.0f}s, loss {result.first_loss:.3f} -> {result.final_loss:.3f}")
    return out.resolve()


def _train_tasks(topology: Any, *, n: int) -> list[Any]:
    """The first `n` tasks of the sequence the rlbus feeder walks (its seed, levels, held-out exclusion)."""
    import itertools

    from rlbus.actors.common.feed import task_sequence
    from rlbus.topology.backends.launch import feeder_launch

    sequence = task_sequence(topology.feeder, feeder_launch(topology))
    return [sequence.get(i) for i in itertools.takewhile(lambda i: sequence.end is None or i < sequence.end,
                                                           range(n))]


def _trl_arm(base: Path, tasks: list[Any], shared: Shared, budget: float | None, marks: list[float], work: Path,
             grade: Callable[[Sequence[Any], Sequence[str]], list[bool]], steps: int | None) -> ArmRun:
    from rlbus.ops.bench.peer_trl import run_trl

    return run_trl(base, tasks, shared, budget_s=budget, marks=marks, out=work / "snapshots", grade=grade,
                   threads=2, progress=_say, steps=steps)


def _per_arm(minutes: float | None, steps: int | None) -> str:
    """What each arm runs for: a wall-clock budget, or (minutes None) a number of optimizer steps."""
    return f"{steps} optimizer steps per arm" if minutes is None else f"{minutes:g} min per arm"


def _grade(portal: Any, bus: Any, tasks: Sequence[Any], texts: Sequence[str]) -> list[bool]:
    """Pass/fail of each completion, from the sandbox (the rlbus generator's request: `case_for` on its code)."""
    from rlbus.model.tasks.grading import case_for, extract_code

    cases = [case_for(t, extract_code(x)) for t, x in zip(tasks, texts, strict=True)]
    return [r.passed for r in _runner(portal, bus, cases)]


def _runner(portal: Any, bus: Any, cases: Sequence[Any]) -> list[Any]:
    """A `model.grading.Runner` on the bench's sandbox supervisor."""
    from rlbus.actors.common.sandbox_client import grade_cases

    return list(portal.call(functools.partial(grade_cases, bus, "hub", cases, id_prefix=f"peer-{uuid.uuid4().hex}",
                                              concurrency=8)))


def _score_all(base: Path, tasks: list[Any], arms: dict[str, ArmRun], max_tokens: int,
               runner: Any) -> dict[str, list[dict[str, Any]]]:
    """Every arm's curve: v0 at 0 s, then each snapshot; equal weights are scored once."""
    import torch

    from rlbus.actors.common.weight_sync import decode_full
    from rlbus.model.policies.hf import HFPolicy
    from rlbus.model.sampling.evaluate import evaluate_pass_at_1

    torch.set_num_threads(2)
    policy = HFPolicy.load(base, dtype=torch.float32)
    start = policy.published_state(torch.bfloat16)          # v0 as version 0 is published
    seen: dict[tuple[str, int], dict[str, Any]] = {}

    def score(state: dict[str, Any], key: tuple[str, int], what: str) -> dict[str, Any]:
        if key not in seen:
            began = time.perf_counter()
            policy.load_tensors_(state)
            r = evaluate_pass_at_1(policy, policy.tokenizer, tasks, max_new_tokens=max_tokens, runner=runner)
            seen[key] = {"pass_at_1": r.pass_at_1, "ci95": [r.ci_low, r.ci_high], "passed": r.passed, "n": r.n}
            _say(f"scored {what}: pass@1 {r.pass_at_1:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] "
                 f"({time.perf_counter() - began:.0f}s)")
        return dict(seen[key])

    v0 = {"t_s": 0.0, **score(start, ("version", 0), "v0")}
    curves: dict[str, list[dict[str, Any]]] = {}
    for arm, result in arms.items():
        points = [v0]
        for i, (t, path) in enumerate(result.snapshots):
            what = f"{arm} snapshot {i + 1} ({t:.0f}s)"
            if arm == "rlbus":          # a version's weights are the same wherever it is taken
                version = result.extra["versions"][i]
                state = decode_full(path.read_bytes())[0] if ("version", version) not in seen else {}
                points.append({"t_s": round(t, 3), "version": version, **score(state, ("version", version), what)})
            else:
                points.append({"t_s": round(t, 3), **score(torch.load(path, weights_only=True), (arm, i), what)})
        curves[arm] = points
    return curves


def summarize(curves: dict[str, list[dict[str, Any]]], arms: dict[str, ArmRun]) -> dict[str, Any]:
    """The JSON keys from the curves (v0 first) and the arms' counters."""
    base, trl, rl = curves["trl"][0], curves["trl"][-1], curves["rlbus"][-1]
    learned = trl["ci95"][0] > base["ci95"][1]
    reached = next((p for p in curves["rlbus"][1:] if p["pass_at_1"] >= trl["pass_at_1"]), None)
    trl_wall, rl_wall = arms["trl"].wall_s, arms["rlbus"].wall_s
    time_to = None if reached is None else reached["t_s"]
    per_arm = {name: {"wall_s": round(a.wall_s, 3), "optimizer_steps": a.steps, "rollouts_trained": a.rollouts_trained,
                      "rollouts_per_s": a.rollouts_trained / a.wall_s, "rollouts_generated": a.rollouts_generated,
                      "generated_rollouts_per_s": a.rollouts_generated / a.wall_s,
                      "gen_tokens_per_s": a.completion_tokens / a.wall_s, **a.extra, "curve": curves[name]}
               for name, a in arms.items()}
    trl_rate, rl_rate = per_arm["trl"]["rollouts_per_s"], per_arm["rlbus"]["rollouts_per_s"]
    return {
        "trl_rollouts_per_s": trl_rate,
        "rlbus_rollouts_per_s": rl_rate,
        "throughput_ratio": rl_rate / trl_rate if trl_rate else None,
        "trl_final_pass_at_1": trl["pass_at_1"],
        "trl_final_ci95": trl["ci95"],
        "rlbus_final_pass_at_1": rl["pass_at_1"],
        "rlbus_final_ci95": rl["ci95"],
        "rlbus_time_to_trl_final_s": time_to,
        # not reached within rlbus's budget: the time is above it, so the ratio is below trl_wall / rl_wall
        "time_ratio": trl_wall / time_to if time_to else trl_wall / rl_wall,
        "time_ratio_is_bound": time_to is None,
        "trl_learned": learned,
        "base_pass_at_1": base["pass_at_1"],
        "base_ci95": base["ci95"],
        "rlbus_final_above_trl": rl["ci95"][0] > trl["ci95"][1],
        "arms": per_arm,
    }


def plot(curves: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """Both pass@1 curves with their 95% intervals on one wall-clock axis (matplotlib's Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for arm, label in (("trl", "TRL GRPOTrainer"), ("rlbus", "rlbus up")):
        points = curves[arm]
        t = [p["t_s"] / 60 for p in points]
        ax.plot(t, [p["pass_at_1"] for p in points], marker="o", markersize=3, label=label)
        ax.fill_between(t, [p["ci95"][0] for p in points], [p["ci95"][1] for p in points], alpha=0.2)
    ax.set_xlabel("training wall-clock (minutes)")
    ax.set_ylabel(f"held-out greedy pass@1 (n = {curves['trl'][0]['n']}, 95% CI)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
    return path


def table(result: dict[str, Any]) -> str:
    """The human table: one column per arm, then the curves, the ratios and what is not matched."""
    arms = result["arms"]
    rows = [("wall-clock (s)", "wall_s", "{:.0f}"), ("optimizer steps", "optimizer_steps", "{}"),
            ("rollouts trained/s", "rollouts_per_s", "{:.2f}"), ("rollouts generated/s", "generated_rollouts_per_s",
                                                                  "{:.2f}"),
            ("generation tokens/s", "gen_tokens_per_s", "{:.0f}"), ("train-time pass rate", "train_pass_rate", "{:.3f}"),
            ("load average (5 min) at end", "load_avg_5m", "{:.1f}")]
    width = 24
    lines = [f"rlbus bench peer: {_per_arm(result['minutes'], result.get('steps_per_arm'))}, qwen2 {result['size']} "
             f"({result['pretrain_steps']} pretraining steps), {result['held_out_n']} held-out tasks "
             f"(load {result['load_avg_1m']:.1f}, {result['total_s']:.0f}s in all)",
             f"{'':{width}}  {'trl':>10}  {'rlbus':>10}"]
    for label, key, fmt in rows:
        lines.append(f"{label:{width}}  " + "  ".join(f"{fmt.format(arms[a][key]):>10}" for a in ARMS))
    for a in ARMS:
        curve = ", ".join(f"{p['t_s']:.0f}s {p['pass_at_1']:.3f}" for p in arms[a]["curve"])
        lines.append(f"pass@1 {a}: {curve}")

    def ci(key: str) -> str:
        low, high = result[key]
        return f"[{low:.3f}, {high:.3f}]"

    lines.append(f"base v0 {result['base_pass_at_1']:.3f} {ci('base_ci95')}; TRL final {result['trl_final_pass_at_1']:.3f} "
                 f"{ci('trl_final_ci95')}; rlbus final {result['rlbus_final_pass_at_1']:.3f} {ci('rlbus_final_ci95')}")
    lines.append(f"throughput ratio (rlbus / TRL rollouts trained per second): {result['throughput_ratio']:.2f}")
    if result["time_ratio_is_bound"]:
        lines.append(f"rlbus did not reach TRL's final pass@1: time ratio < {result['time_ratio']:.2f}")
    else:
        lines.append(f"rlbus reached TRL's final pass@1 at {result['rlbus_time_to_trl_final_s']:.0f}s: time ratio "
                     f"{result['time_ratio']:.2f}")
    if not result["trl_learned"]:
        lines.append("TRL did not learn within its budget (its final interval overlaps v0's): rlbus's final is "
                     f"{'above' if result['rlbus_final_above_trl'] else 'not above'} TRL's final")
    lines.append("not matched: " + "; ".join(result["unmatched"]))
    lines.append(f"curve: {result['png']}")
    return "\n".join(lines)


def _say(text: str) -> None:
    print(f"bench peer: {text}", file=sys.stderr, flush=True)
