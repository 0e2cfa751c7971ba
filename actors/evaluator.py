"""Evaluator: greedy pass@1 of published policy versions on the held-out task set.

- Owns: `Evaluator` (kind "evaluator"): the region's published versions followed (`WeightSync`), one version
  per block of `every_versions` scored on `n_tasks` held-out tasks graded in the region's sandboxes, and an
  `EvalReport` with the 95% Wilson interval published on `evals` (for repository tasks also mean@K, pass@k and
  what an episode costs: actors/common/eval_report.py).
- Guarantee: a drain cancels an evaluation in progress, so stopping never waits for the whole task set.
- Does not: train, sample for training, or publish weights.
Consumes WeightManifests (LATEST KV); produces EvalReport and Event(incident) when grading fails.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.common.agentic_eval import evaluate_repo_tasks
from rlbus.actors.common.config import EvaluatorConfig, EvaluatorLaunch, decode_config
from rlbus.actors.common.errors import TaskError
from rlbus.actors.common.eval_report import episodes_report, scored_report
from rlbus.actors.common.sandbox_client import grade_cases
from rlbus.actors.common.weight_sync import WeightSync
from rlbus.messages.bus import Bus
from rlbus.messages.errors import SandboxCrashed
from rlbus.messages.schemas import EvalReport, SandboxLimits
from rlbus.model.env import AgenticBudgets
from rlbus.model.env.episodes import completion_text
from rlbus.model.sampling.evaluate import greedy_complete, too_long
from rlbus.model.tasks.builtin import Task
from rlbus.model.tasks.grading import case_for, extract_code
from rlbus.model.tasks.repo import RepoTask
from rlbus.model.tasks.sources import (
    TaskSourceError,
    held_out_tasks,
    is_repo_file,
    is_repo_source,
    load_repo_tasks,
)

log = structlog.get_logger()


class Evaluator(Actor):
    """Evaluates version 0 and every `every_versions`-th version after it; one EvalReport each.

    It follows the region's published versions (actors/common/weight_sync.py `WeightSync`) and evaluates one
    version per block of `every_versions` (the first it holds in each block: 0, k, 2k, ... while it keeps
    up; a version that arrives while it is busy is skipped for the newest, so after a slow evaluation it may
    be k+1; a started or restarted evaluator first evaluates the version it finds) on `n_tasks` held-out
    tasks (`[evaluator] tasks`: the built-in `eval_tasks(seed)`, HumanEval or a tasks file,
    model/tasks/sources.py `held_out_tasks`; disjoint from training by prompt hash) with greedy decoding,
    grading each completion in the region's sandboxes (actors/common/sandbox_client.py). Repository tasks (a
    repository task file, or the built-in ones of "repo" / "repo:LEVEL" drawn from `seed`) are greedy agentic
    episodes instead, each in a sandbox session of the region under the launch's agentic budgets
    (actors/common/agentic_eval.py), then `samples` sampled episodes per task at `temperature` (seeded by `seed`,
    as every version is); pass@1 is the share whose hidden tests pass. A drain cancels an evaluation in progress between
    two decoding steps (or while it is graded).
    """

    kind = "evaluator"

    def __init__(self, ident: ActorId, bus: Bus, settings: EvaluatorConfig,
                 limits: ActorLimits | None = None, launch: EvaluatorLaunch | None = None) -> None:
        super().__init__(ident, bus, limits)
        self.settings = settings
        self.launch = launch or EvaluatorLaunch()
        self.tasks: list[Task] = []
        self.repo_tasks: list[RepoTask] = []
        """The held-out repository tasks, when `[evaluator] tasks` is a repository task file (then `tasks` is empty)."""
        self.last_evaluated: int | None = None
        # its schedule, for `rlbus health`: the version it reports may be this many (plus slack) behind by design
        self.gauges["every_versions"] = float(max(1, settings.every_versions))

    async def setup(self) -> None:
        torch.set_num_threads(1)
        source, n = self.settings.tasks, self.settings.n_tasks
        try:
            if is_repo_source(source):      # drawing them parses Python: on this thread (CPython 3.11's parser
                self.repo_tasks = load_repo_tasks(source, seed=self.settings.seed, n=n)   # is not thread-safe)
            elif is_repo_file(Path(source)):
                self.repo_tasks = await anyio.to_thread.run_sync(lambda: load_repo_tasks(source, n=n))
            else:
                self.tasks = await anyio.to_thread.run_sync(held_out_tasks, source, self.settings.seed, n)
        except TaskSourceError as err:
            raise TaskError(f"evaluator.tasks = {self.settings.tasks!r}: {err}") from None
        self.sync = WeightSync(self.bus, self.ident.region, device=self.launch.device)

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self.sync.run)
            target = 0
            while True:
                await self.sync.wait_for_staged(target)
                await self.sync.wait_for_version(target)     # swap in here, between evaluations
                version = self.sync.held_version
                assert version is not None
                if self._due(version):
                    with self.busy():
                        await self._evaluate(version)
                target = version + 1

    def _due(self, version: int) -> bool:
        every = max(1, self.settings.every_versions)
        if self.last_evaluated is None:
            return True
        return version // every > self.last_evaluated // every

    async def _evaluate(self, version: int) -> None:
        if self.repo_tasks:
            k, budgets = self.settings.samples, held_out_budgets(self.launch.agentic)
            try:
                episodes = await evaluate_repo_tasks(self.bus, self.ident.region, self.sync.model, self.repo_tasks,
                                                     max_tokens=self.launch.max_tokens, budgets=budgets,
                                                     on_step=_stop_if_cancelled)
                sampled = [] if not k else await evaluate_repo_tasks(
                    self.bus, self.ident.region, self.sync.model, [t for t in self.repo_tasks for _ in range(k)],
                    max_tokens=self.launch.max_tokens, budgets=budgets, on_step=_stop_if_cancelled,
                    temperature=self.settings.temperature, seed=self.settings.seed)
            except anyio.get_cancelled_exc_class():
                self.count("evaluations_cancelled")
                log.info("evaluation_cancelled", version=version, n=len(self.repo_tasks))
                raise
            except SandboxCrashed as err:
                self.count("eval_errors")
                await self.emit("incident", detail=f"evaluation of version {version} not graded: {err}")
                return
            await self._publish(episodes_report(version, self.settings.seed, self.settings.tasks, episodes, sampled, k))
            return
        model = self.sync.model
        tokenizer = model.tokenizer
        prompts = [tokenizer.prompt_ids(t.prompt) for t in self.tasks]
        try:
            # a drain cancels this task: the worker thread sees it before its next decoding step and stops
            ids = await anyio.to_thread.run_sync(lambda: greedy_complete(
                model, prompts, max_new_tokens=self.launch.max_tokens, batch_size=self.launch.batch_size,
                stop_id=tokenizer.stop_id, pad_id=tokenizer.pad_id, on_step=_stop_if_cancelled))
        except anyio.get_cancelled_exc_class():
            self.count("evaluations_cancelled")
            log.info("evaluation_cancelled", version=version, n=len(prompts))
            raise
        unread = sum(too_long(model, p, self.launch.max_tokens) for p in prompts)
        if unread:      # an empty completion each: they fail their tests and stay in n
            self.gauges["prompts_too_long"] = float(unread)
            log.warning("eval_prompts_too_long", version=version, n=unread, of=len(prompts),
                        max_seq_len=model.max_seq_len)
        cases = [case_for(task, extract_code(completion_text(c, tokenizer)))
                 for task, c in zip(self.tasks, ids, strict=True)]
        try:
            results = await grade_cases(self.bus, self.ident.region, cases, id_prefix=f"eval-{version}-"
                                        f"{uuid.uuid4().hex[:6]}", limits=SandboxLimits(wall_seconds=5.0))
        except SandboxCrashed as err:
            self.count("eval_errors")
            await self.emit("incident", detail=f"evaluation of version {version} not graded: {err}")
            return
        await self._publish(scored_report(version, self.settings.seed, self.settings.tasks,
                                          [f"{t.family}/{t.level}" for t in self.tasks], [r.passed for r in results]))

    async def _publish(self, report: EvalReport) -> None:
        version, n, low, high = report.policy_version, report.n, report.ci_low, report.ci_high
        await self.bus.publish_once(self.bus.subjects.evals(), report, msg_id=f"eval-{version}-{self.settings.seed}")
        self.last_evaluated = version
        self.policy_version = version
        self.count("evaluations")
        self.gauges["pass_at_1"] = report.pass_at_1
        log.info("evaluation_published", version=version, pass_at_1=round(report.pass_at_1, 4), n=n,
                 ci_low=round(low, 4), ci_high=round(high, 4))


def held_out_budgets(settings: Mapping[str, Any]) -> AgenticBudgets:
    """The budgets of a held-out episode from `[generator.agentic]`'s plain values (`EvaluatorLaunch.agentic`):
    its `AgenticBudgets` fields, the others (the tool list) left out; none given: the defaults."""
    return AgenticBudgets(**{k: v for k, v in settings.items() if k in AgenticBudgets.__struct_fields__})


def _stop_if_cancelled(step: int) -> None:
    """`greedy_complete`'s hook in the worker thread: raise the host task's cancellation, if it came."""
    anyio.from_thread.check_cancelled()


def build_evaluator(ident: ActorId, bus: Bus, settings: Mapping[str, Any], limits: ActorLimits,
                    launch: EvaluatorLaunch | None = None) -> Evaluator:
    """The evaluator of an `[evaluator]` section (plain values) — called by actors/kinds.py.

    :raises TopologyError: a setting is unknown or out of bounds (the text names it).
    """
    return Evaluator(ident, bus, decode_config("evaluator", settings, EvaluatorConfig), limits, launch)
