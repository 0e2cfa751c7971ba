"""The closing evaluation of `rlbus up`: the final checkpoint's weights on the evaluator's held-out set.

- Owns: `final_evaluation` (mark → state → pass@1 per family, scored as the evaluator would have;
  `evaluate_repo_state` and `episodes_result` for a repository task file) and `write_report`.
- Does not: publish on the bus, or evaluate while the run is going (actors/evaluator.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
import torch

from rlbus.actors.common.agentic_eval import EpisodeResult, evaluate_repo_tasks
from rlbus.actors.common.config import EvaluatorLaunch
from rlbus.actors.common.errors import TaskError
from rlbus.actors.trainer.core import state_policy
from rlbus.actors.trainer.resume import load_state
from rlbus.messages.bus import Bus
from rlbus.messages.history import last_message
from rlbus.messages.schemas import CheckpointMark, EvalReport
from rlbus.model.policies.interface import Policy
from rlbus.model.sampling.evaluate import EvalResult, evaluate_pass_at_1, wilson_interval
from rlbus.model.tasks.builtin import Task
from rlbus.model.tasks.repo import RepoTask
from rlbus.model.tasks.sources import BUILTIN, TaskSourceError, held_out_tasks, is_repo_file, load_repo_tasks

REPORT_NAME: Final = "final_eval.json"
"""In the state directory: the closing evaluation (version, step, pass@1, interval, per family)."""


@dataclass(frozen=True, slots=True)
class FinalEval:
    """The newest checkpoint's held-out pass@1."""

    step: int
    policy_version: int
    result: EvalResult


async def final_evaluation(bus: Bus, state_dir: Path, *, seed: int, n_tasks: int, max_tokens: int,
                           threads: int = 1, tasks: str = BUILTIN) -> FinalEval | None:
    """Evaluate the newest CheckpointMark's weights on the evaluator's held-out set (`tasks`: its source);
    None when the run has no checkpoint yet.

    The evaluator scores every `every_versions`-th version while the run goes on, so its last report can be
    up to `every_versions - 1` versions older than the weights the run ends with. Once the actors have
    drained, `rlbus up` scores the newest durable checkpoint (the one the ledger walks back from) the way the
    evaluator would have: the same tasks (`held_out_tasks(tasks, seed, n_tasks)`), the policy in bfloat16 as
    the generators and the evaluator hold it, greedy decoding with the evaluator's token budget (the
    generators'); graded in a `model.grading` subprocess like the pretrained base, since the sandbox actors
    have stopped. A repository task file's tasks run as greedy agentic episodes in the sessions of a sandbox
    supervisor of its own (ops/local_sandbox.py; actors/common/agentic_eval.py).

    :raises RlbusError: the mark's state is neither in CKPT nor on disk with its digest, or `tasks` is
    unreadable.
    """
    try:
        repo = is_repo_file(Path(tasks))
        held_out: list[Task] | list[RepoTask] = (load_repo_tasks(tasks, n=n_tasks) if repo
                                                 else held_out_tasks(tasks, seed, n_tasks))
    except TaskSourceError as err:
        raise TaskError(f"evaluator.tasks = {tasks!r}: {err}") from None
    s = bus.subjects
    mark = await last_message(bus.js, s.checkpoints_stream(), s.checkpoints(), CheckpointMark)
    if mark is None:
        return None
    state, _ = await load_state(bus, mark, str(state_dir))
    if repo:
        result = await evaluate_repo_state(state, held_out, max_tokens, threads)  # type: ignore[arg-type]
    else:
        result = await anyio.to_thread.run_sync(_evaluate_state, state, held_out, max_tokens, threads)
    return FinalEval(mark.step, mark.policy_version, result)


def policy_from_state(blob: bytes | Mapping[str, bytes]) -> Policy:
    """The policy of a trainer state (a blob, or a checkpoint's objects by name, sharded or not) as a version
    of it is published: its fp32 master weights rounded
    to bfloat16 (actors/trainer/core.py `bf16_state`), on the CPU in eval mode (`state_policy`).

    :raises CheckpointError: not a trainer state, or one whose policy cannot be built.
    """
    return state_policy(blob, device="cpu", dtype=torch.bfloat16)


def _evaluate_state(blob: bytes | Mapping[str, bytes], tasks: list[Task], max_tokens: int, threads: int) -> EvalResult:
    policy = policy_from_state(blob)
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        return evaluate_pass_at_1(policy, policy.tokenizer, tasks, max_new_tokens=max_tokens,
                                  batch_size=EvaluatorLaunch().batch_size)
    finally:
        torch.set_num_threads(previous)


async def evaluate_repo_state(blob: bytes | Mapping[str, bytes], tasks: list[RepoTask], max_tokens: int,
                              threads: int) -> EvalResult:
    """A trainer state's policy (bf16, as published) on repository tasks: one greedy agentic episode each in a
    sandbox supervisor of its own (`local_sandbox`), as an `EvalResult` (`episodes_result`)."""
    from rlbus.actors.sandbox.config import SandboxConfig
    from rlbus.ops.local_sandbox import local_sandbox

    policy = policy_from_state(blob)
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        async with local_sandbox("final-eval", SandboxConfig()) as sandbox:
            episodes = await evaluate_repo_tasks(sandbox, "hub", policy, tasks, max_tokens=max_tokens)
    finally:
        torch.set_num_threads(previous)
    return episodes_result(episodes)


def episodes_result(episodes: Sequence[EpisodeResult]) -> EvalResult:
    """Held-out agentic episodes as an `EvalResult`: pass@1 the share whose hidden tests passed, per family
    `repo/<level>`, with no completions or grade results of their own."""
    passed = sum(e.passed for e in episodes)
    low, high = wilson_interval(passed, len(episodes))
    by_family: dict[str, tuple[int, int]] = {}
    for e in episodes:
        p, n = by_family.get(f"repo/{e.level}", (0, 0))
        by_family[f"repo/{e.level}"] = (p + e.passed, n + 1)
    return EvalResult(n=len(episodes), passed=passed, pass_at_1=passed / max(1, len(episodes)), ci_low=low,
                      ci_high=high, by_family=dict(sorted(by_family.items())), completions=[], results=[])


def write_report(final: FinalEval, v0: EvalReport | None, path: Path) -> Path:
    """`final_eval.json`: the final weights' pass@1, its interval, per family, and the evaluator's v0 report
    (the pretrained base on the same tasks) it is compared to."""
    r = final.result
    base = None if v0 is None else {"pass_at_1": v0.pass_at_1, "ci95": [v0.ci_low, v0.ci_high], "n": v0.n,
                                    "source": "evaluator v0"}
    doc = {"step": final.step, "policy_version": final.policy_version, "n": r.n, "passed": r.passed,
           "pass_at_1": r.pass_at_1, "ci95": [r.ci_low, r.ci_high],
           "by_family": {k: {"passed": p, "n": n} for k, (p, n) in r.by_family.items()}, "base": base}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
