"""The closing evaluation of `rlbus up`: the final checkpoint's weights on the evaluator's held-out set.

- Owns: `final_evaluation` (mark → state → pass@1 per family, scored as the evaluator would have;
  `evaluate_repo_state` and `episodes_result` for repository tasks), `base_evaluation` (the starting policy on
  the same tasks), `HeldOut` (the evaluator's settings they score under), `score_policy` and `write_report`.
- Does not: publish on the bus, or evaluate while the run is going (actors/evaluator.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import msgspec
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
from rlbus.model.tasks.sources import (
    BUILTIN,
    TaskSourceError,
    held_out_tasks,
    is_repo_file,
    is_repo_source,
    load_repo_tasks,
)

REPORT_NAME: Final = "final_eval.json"
"""In the state directory: the closing evaluation (version, step, pass@1, interval, per family)."""


@dataclass(frozen=True, slots=True)
class FinalEval:
    """The newest checkpoint's held-out pass@1, and the same scores as an `EvalReport` (the evaluator's keys)."""

    step: int
    policy_version: int
    result: EvalResult
    report: EvalReport | None = None


@dataclass(frozen=True, slots=True)
class HeldOut:
    """What a closing evaluation scores on and how: the evaluator's settings (`[evaluator]`, the generators' token
    budget and `[generator.agentic]` budgets), so that it scores as the evaluator would."""

    tasks: str = BUILTIN
    seed: int = 1
    n_tasks: int = 64
    max_tokens: int = 160
    samples: int = 0
    """Sampled episodes per repository task (`[evaluator] samples`)."""
    temperature: float = 0.7
    agentic: Mapping[str, Any] = field(default_factory=dict)
    """`[generator.agentic]` as plain values (actors/evaluator.py `held_out_budgets` reads them)."""
    threads: int = 1

    @classmethod
    def of(cls, topology: Any) -> HeldOut:
        """The held-out settings of a topology (topology/file/schema.py `Topology`)."""
        ev = topology.evaluator
        return cls(tasks=ev.tasks, seed=ev.seed, n_tasks=ev.n_tasks, max_tokens=topology.generator.max_tokens,
                   samples=ev.samples, temperature=ev.temperature,
                   agentic=msgspec.to_builtins(topology.generator.agentic), threads=topology.pretrain.threads)

    def load(self) -> list[Task] | list[RepoTask]:
        """The held-out tasks (repository tasks for a repository source).

        :raises TaskError: the source cannot be read (the text names it).
        """
        try:
            if is_repo_source(self.tasks) or is_repo_file(Path(self.tasks)):
                return load_repo_tasks(self.tasks, seed=self.seed, n=self.n_tasks)
            return held_out_tasks(self.tasks, self.seed, self.n_tasks)
        except TaskSourceError as err:
            raise TaskError(f"evaluator.tasks = {self.tasks!r}: {err}") from None


async def final_evaluation(bus: Bus, state_dir: Path, *, seed: int, n_tasks: int, max_tokens: int,
                           threads: int = 1, tasks: str = BUILTIN, held: HeldOut | None = None) -> FinalEval | None:
    """Evaluate the newest CheckpointMark's weights on the evaluator's held-out set (`held`, else `tasks`, `seed`,
    `n_tasks`, `max_tokens`, `threads`); None when the run has no checkpoint yet.

    The evaluator scores every `every_versions`-th version while the run goes on, so its last report can be
    up to `every_versions - 1` versions older than the weights the run ends with. Once the actors have
    drained, `rlbus up` scores the newest durable checkpoint (the one the ledger walks back from) the way the
    evaluator would have: the same tasks, the policy in bfloat16 as the generators and the evaluator hold it,
    greedy decoding with the evaluator's token budget (the generators'); graded in a `model.grading`
    subprocess like the pretrained base, since the sandbox actors have stopped. Repository tasks run as greedy
    agentic episodes (and `samples` sampled ones each) in the sessions of a sandbox supervisor of its own
    (`score_policy`).

    :raises RlbusError: the mark's state is neither in CKPT nor on disk with its digest, or `tasks` is
    unreadable.
    """
    held = held or HeldOut(tasks=tasks, seed=seed, n_tasks=n_tasks, max_tokens=max_tokens, threads=threads)
    held_out = held.load()
    s = bus.subjects
    mark = await last_message(bus.js, s.checkpoints_stream(), s.checkpoints(), CheckpointMark)
    if mark is None:
        return None
    state, _ = await load_state(bus, mark, str(state_dir))
    policy = await anyio.to_thread.run_sync(policy_from_state, state)
    result, report = await score_policy(policy, held, mark.policy_version, held_out)
    return FinalEval(mark.step, mark.policy_version, result, report)


async def base_evaluation(path: Path, held: HeldOut) -> EvalReport:
    """The starting policy (`path`: the run's pretrained base or model directory, in bfloat16 as version 0 is
    published) scored as `final_evaluation` scores the final checkpoint: the same tasks, budgets and samples.

    :raises RlbusError: nothing loadable at `path`, or the held-out source is unreadable.
    """
    from rlbus.ops.eval import load_policy

    held_out = held.load()
    policy, _ = await anyio.to_thread.run_sync(lambda: load_policy(path, device="cpu"))
    _, report = await score_policy(policy, held, 0, held_out)
    return report


async def score_policy(policy: Policy, held: HeldOut, version: int,
                       tasks: list[Task] | list[RepoTask] | None = None) -> tuple[EvalResult, EvalReport]:
    """`policy` on the held-out tasks as the evaluator scores version `version`: function-writing tasks greedy,
    graded in a `model.grading` subprocess; repository tasks as greedy agentic episodes and `held.samples` sampled
    ones per task (seeded by `held.seed`, as the evaluator seeds them) in a sandbox supervisor of its own."""
    from rlbus.actors.common.eval_report import episodes_report, scored_report

    tasks = held.load() if tasks is None else tasks
    if tasks and isinstance(tasks[0], RepoTask):
        greedy, sampled = await _episodes(policy, tasks, held)  # type: ignore[arg-type]
        report = episodes_report(version, held.seed, held.tasks, greedy, sampled, held.samples if sampled else 0)
        return episodes_result(greedy), report
    result = await anyio.to_thread.run_sync(_evaluate_policy, policy, tasks, held.max_tokens, held.threads)
    groups = [f"{t.family}/{t.level}" for t in tasks]  # type: ignore[union-attr]
    return result, scored_report(version, held.seed, held.tasks, groups, [r.passed for r in result.results])


def policy_from_state(blob: bytes | Mapping[str, bytes]) -> Policy:
    """The policy of a trainer state (a blob, or a checkpoint's objects by name, sharded or not) as a version
    of it is published: its fp32 master weights rounded
    to bfloat16 (actors/trainer/core.py `bf16_state`), on the CPU in eval mode (`state_policy`).

    :raises CheckpointError: not a trainer state, or one whose policy cannot be built.
    """
    return state_policy(blob, device="cpu", dtype=torch.bfloat16)


def _evaluate_state(blob: bytes | Mapping[str, bytes], tasks: list[Task], max_tokens: int, threads: int) -> EvalResult:
    return _evaluate_policy(policy_from_state(blob), tasks, max_tokens, threads)


def _evaluate_policy(policy: Policy, tasks: list[Task], max_tokens: int, threads: int) -> EvalResult:
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
    greedy, _ = await _episodes(policy_from_state(blob), tasks, HeldOut(max_tokens=max_tokens, threads=threads))
    return episodes_result(greedy)


async def _episodes(policy: Policy, tasks: list[RepoTask],
                    held: HeldOut) -> tuple[list[EpisodeResult], list[EpisodeResult]]:
    """The greedy episode of each task and `held.samples` sampled ones per task (task by task), in the sessions of a
    sandbox supervisor of its own, under `held.agentic`'s budgets."""
    from rlbus.actors.evaluator import held_out_budgets
    from rlbus.actors.sandbox.config import SandboxConfig
    from rlbus.ops.local_sandbox import local_sandbox

    budgets = held_out_budgets(held.agentic)
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, held.threads))
    try:
        async with local_sandbox("final-eval", SandboxConfig()) as sandbox:
            greedy = await evaluate_repo_tasks(sandbox, "hub", policy, tasks, max_tokens=held.max_tokens,
                                               budgets=budgets)
            sampled = [] if not held.samples else await evaluate_repo_tasks(
                sandbox, "hub", policy, [t for t in tasks for _ in range(held.samples)], max_tokens=held.max_tokens,
                budgets=budgets, temperature=held.temperature, seed=held.seed)
    finally:
        torch.set_num_threads(previous)
    return greedy, sampled


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
    """`final_eval.json`: the final weights' pass@1, its interval, per family, the evaluator's v0 report
    (the pretrained base on the same tasks) it is compared to, and `scores`: the evaluation's keys
    (actors/common/eval_report.py `report_keys`)."""
    r = final.result
    base = None if v0 is None else {"pass_at_1": v0.pass_at_1, "ci95": [v0.ci_low, v0.ci_high], "n": v0.n,
                                    "source": "evaluator v0"}
    doc = {"step": final.step, "policy_version": final.policy_version, "n": r.n, "passed": r.passed,
           "pass_at_1": r.pass_at_1, "ci95": [r.ci_low, r.ci_high],
           "by_family": {k: {"passed": p, "n": n} for k, (p, n) in r.by_family.items()}, "base": base}
    if final.report is not None:
        from rlbus.actors.common.eval_report import report_keys

        doc["scores"] = report_keys(final.report)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
