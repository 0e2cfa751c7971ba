"""Held-out repository tasks as greedy agentic episodes (actors/common/agentic_eval.py), each in a real sandbox
session: the verdict is the hidden tests' on the workspace the episode leaves, so of two tasks whose untouched
repositories fail and pass, a policy that changes nothing passes exactly the second; the evaluator of a
repository task file publishes that pass@1 for a version it holds. Each result counts what its episode cost;
sampled episodes are seeded."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import torch
from helpers import eventually, new_run

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.common.agentic_eval import episode_result, eval_environment, evaluate_repo_tasks
from rlbus.actors.common.config import EvaluatorConfig, EvaluatorLaunch, PublisherConfig, PublisherLaunch
from rlbus.actors.common.errors import TaskError
from rlbus.actors.common.ledger import read_all
from rlbus.actors.evaluator import Evaluator
from rlbus.actors.publisher import Publisher
from rlbus.actors.sandbox.config import SandboxConfig
from rlbus.actors.sandbox.supervisor import SandboxSupervisor
from rlbus.messages.bus import Bus, ConnectOptions, Identity
from rlbus.messages.schemas import EvalReport
from rlbus.messages.streams import StreamSettings, provision_run
from rlbus.model.env import AgenticBudgets, AgenticState
from rlbus.model.env.episodes import Turn
from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.tasks.sources import held_out_hashes, load_repo_tasks, read_repo_tasks_file
from rlbus.model.tools.calls import ToolCall
from rlbus.ops.bench.version_source import published_state, upload_version
from rlbus.ops.local_sandbox import local_sandbox
from rlbus.topology.network.regions import RegionSet

pytestmark = pytest.mark.anyio
FAST = ActorLimits(heartbeat_interval_s=0.3, drain_timeout_s=2.0)
SANDBOX = SandboxConfig(pool_size=1, concurrency=2, cpu_seconds=4.0, wall_seconds=8.0, memory_mb=256,
                        max_processes=16, max_file_mb=1, max_open_files=64, max_output_kb=16, max_sessions=8,
                        workspace_mb=4, max_lease_s=600.0, session_spares=0)
BUGGY = {"calc/__init__.py": "", "calc/core.py": "def add(a, b):\n    return a - b\n"}
FIXED = {"calc/__init__.py": "", "calc/core.py": "def add(a, b):\n    return a + b\n"}
TESTS = {"tests/test_calc.py": "import unittest\n\nfrom calc.core import add\n\n\nclass Calc(unittest.TestCase):\n"
                               "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"}


def task_file(tmp_path: Path) -> Path:
    """A bug to fix, and a repository its hidden tests already pass as given (level 2)."""
    rows = [{"task_id": "buggy", "instruction": "add() subtracts; make it add.", "files": BUGGY,
             "hidden_tests": TESTS, "solution": FIXED},
            {"task_id": "fixed", "instruction": "Check that add() adds.", "files": FIXED, "hidden_tests": TESTS,
             "solution": {}, "level": 2}]
    path = tmp_path / "calc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny(max_seq_len: int) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny(max_seq_len=max_seq_len)).eval()


async def test_each_episode_is_graded_on_the_workspace_it_leaves(tmp_path: Path) -> None:
    """A tiny random policy writes no valid tool call: each episode spends its two turns and the
    hidden tests grade the repository as given, so the buggy one fails (reward 0) and the fixed one passes (1);
    results come back in task order; held-out episodes take no summaries."""
    tasks = read_repo_tasks_file(task_file(tmp_path))
    policy = BuiltinPolicy(tiny(2048))
    budgets = AgenticBudgets(max_turns=2)
    assert eval_environment(policy, budgets).budgets.summary_tokens == 0
    async with local_sandbox("agentic-eval", SANDBOX) as bus:
        results = await evaluate_repo_tasks(bus, "hub", policy, tasks, max_tokens=8, budgets=budgets,
                                            open_episodes=1)
    assert [(r.task_id, r.level, r.passed, r.reward) for r in results] == [("buggy", 0, False, 0.0),
                                                                         ("fixed", 2, True, 1.0)]
    assert all(r.turns == 2 and r.ended == "turns" for r in results), results
    for r in results:                   # two turns of at most 8 tokens, each answered by an observation
        assert 2 <= r.policy_tokens <= 16 and r.observation_tokens > 0 and r.wall_s > 0, r
        assert sum(r.tool_calls_by_tool.values()) <= r.tool_calls, r


def test_an_episode_result_counts_its_cost_from_the_state(tmp_path: Path) -> None:
    """Turns, tool-call blocks, the calls run by tool, policy and observation tokens, as the final state holds them."""
    (task, _) = read_repo_tasks_file(task_file(tmp_path))
    state = AgenticState(turns=(Turn("user", (1, 2, 3)), Turn("assistant", (4, 5)), Turn("observation", (6, 7, 8, 9)),
                                Turn("assistant", (10,))),
                         task=task, started_at=100.0, policy_turns=2, tool_calls=4, ended="submit", done=True,
                         calls=(ToolCall("run", {}), ToolCall("read", {}), ToolCall("run", {})), verdict="passed",
                         reward=1.0)
    r = episode_result(state, 2.5)
    assert (r.task_id, r.passed, r.reward, r.turns, r.ended) == ("buggy", True, 1.0, 2, "submit")
    assert (r.tool_calls, r.tool_calls_by_tool, r.policy_tokens, r.observation_tokens, r.wall_s) == (
        4, {"read": 1, "run": 2}, 3, 4, 2.5)


async def test_sampled_episodes_are_seeded(tmp_path: Path) -> None:
    """At a temperature, the same seed gives the same episodes (turns, tokens, calls, verdicts); the verdicts stay
    those of the repositories as given, which a random policy does not change."""
    tasks = read_repo_tasks_file(task_file(tmp_path))
    policy = BuiltinPolicy(tiny(2048))
    budgets = AgenticBudgets(max_turns=2)

    def cost(r: object) -> tuple[object, ...]:
        return tuple(getattr(r, k) for k in ("task_id", "passed", "turns", "ended", "tool_calls", "policy_tokens",
                                             "observation_tokens"))

    async with local_sandbox("agentic-eval", SANDBOX) as bus:
        runs = [await evaluate_repo_tasks(bus, "hub", policy, tasks + tasks, max_tokens=8, budgets=budgets,
                                          temperature=1.0, seed=3) for _ in range(2)]
    assert [cost(r) for r in runs[0]] == [cost(r) for r in runs[1]]
    assert [r.passed for r in runs[0]] == [False, True, False, True]


@asynccontextmanager
async def hub(tmp_path: Path) -> AsyncIterator[tuple[RegionSet, str, list[Bus]]]:
    run = new_run()
    rs = await anyio.to_thread.run_sync(lambda: RegionSet.start(tmp_path / "regions", ["hub"], "hub", run=run))
    buses: list[Bus] = []
    try:
        yield rs, run, buses
    finally:
        for bus in buses:
            await bus.close()
        await anyio.to_thread.run_sync(rs.stop)


async def test_the_evaluator_of_a_repository_task_file_reports_the_episodes_pass_at_1(tmp_path: Path) -> None:
    """Version 0 uploaded: the evaluator (`[evaluator] tasks` = the file, two samples per task) runs both tasks as
    greedy episodes and two sampled ones each in the region's sandbox sessions, under the one-turn budget it was
    launched with, and publishes n 2, pass@1 0.5 (only the already-fixed repository passes), the same for mean@2
    and pass@k (a random policy leaves each repository as given), one turn per episode, and the score per level."""
    path = task_file(tmp_path)
    async with hub(tmp_path) as (rs, run, buses):
        async def bus(role: str) -> Bus:
            cred = rs.credentials(role)
            made = await Bus.connect(rs.url("hub"), run=run, domain="hub", identity=Identity(f"hub-{role}", role, "hub"),
                                     options=ConnectOptions(user=cred.user, password=cred.password))
            buses.append(made)
            return made

        admin = await bus("admin")
        await provision_run(admin.nc, admin.subjects, hub="hub", domains=rs.domains, settings=StreamSettings.tiny())
        publisher = Publisher(ActorId(run, "hub", "publisher", "p0"), await bus("publisher"),
                              PublisherConfig(keep_versions=4, full_every=4), FAST,
                              PublisherLaunch(regions=["hub"], hub="hub", region_wait_s=2.0, retry_initial_s=0.2,
                                              retry_max_s=1.0, ack_wait_s=5.0, threads=1))
        sandbox = SandboxSupervisor(ActorId(run, "hub", "sandbox", "s0"), await bus("sandbox"), SANDBOX, FAST)
        evaluator = Evaluator(ActorId(run, "hub", "evaluator", "e0"), await bus("evaluator"),
                              EvaluatorConfig(every_versions=2, n_tasks=5, seed=1, tasks=str(path), samples=2), FAST,
                              EvaluatorLaunch(max_tokens=8, batch_size=4, agentic={"max_turns": 1,
                                                                                   "tool_list": "compact"}))
        async with anyio.create_task_group() as tg:
            for actor in (publisher, sandbox, evaluator):
                await tg.start(actor.serve)
            model = tiny(2048)
            await upload_version(await bus("trainer"), version=0, step=0, state=published_state(model),
                                 model_config=model.config)
            reports = await eventually(
                lambda: read_all(admin.js, admin.subjects.evals_stream(), admin.subjects.evals(), EvalReport),
                what="the report of version 0", timeout_s=120)
            tg.cancel_scope.cancel()
    (report,) = reports
    assert (report.policy_version, report.n, report.pass_at_1) == (0, 2, 0.5)
    assert (report.source, report.samples, report.mean_at_k, report.pass_at_k) == (str(path), 2, 0.5,
                                                                                   {"1": 0.5, "2": 0.5})
    assert set(report.pass_at_k_ci95) == {"1", "2"} and report.turns_mean == 1.0, report
    assert report.policy_tokens_mean is not None and 1 <= report.policy_tokens_mean <= 8, report
    assert report.sampled_policy_tokens_mean is not None and report.tool_calls_mean is not None, report
    assert {name: (s.n, s.pass_at_1, s.mean_at_k) for name, s in report.by_level.items()} == {
        "repo/0": (1, 0.0, 0.0), "repo/2": (1, 1.0, 1.0)}
    assert evaluator.counters.get("evaluations") == 1 and "eval_errors" not in evaluator.counters


async def test_the_evaluator_of_the_built_in_repository_tasks_draws_them_from_its_seed(admin_bus: Bus) -> None:
    """`[evaluator] tasks = "repo:2"` holds the first `n_tasks` built-in level-2 repository tasks of its seed as
    agentic tasks (no function-writing ones), exactly the prompts a feeder told of this held-out set skips;
    "repo:9" names no level and is refused at setup."""
    evaluator = Evaluator(ActorId(admin_bus.subjects.run, "hub", "evaluator", "e0"), admin_bus,
                          EvaluatorConfig(n_tasks=3, seed=5, tasks="repo:2"), FAST)
    await evaluator.setup()
    assert evaluator.tasks == [] and [t.task_id for t in evaluator.repo_tasks] == [
        t.task_id for t in load_repo_tasks("repo:2", seed=5, n=3)]
    assert {t.level for t in evaluator.repo_tasks} == {2}
    assert held_out_hashes("repo:2", seed=5, n=3) == {t.prompt_hash for t in evaluator.repo_tasks}
    bad = Evaluator(ActorId(admin_bus.subjects.run, "hub", "evaluator", "e1"), admin_bus,
                    EvaluatorConfig(tasks="repo:9"), FAST)
    with pytest.raises(TaskError, match="repo:9"):
        await bad.setup()
