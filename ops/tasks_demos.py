"""`rlbus tasks demos SOURCE -o FILE`: demonstrations of agentic repository tasks by a scripted expert, every tool
call run in a real sandbox session.

- Owns: the command (`register`), `training_tasks` (the tasks demonstrations are drawn from), `demo_episode` (one
  episode: the expert's turns, each call run in the session, the observations as the sandbox answered, the grade)
  and `run_demos` (episodes on a sandbox supervisor served here until enough pass).
- Guarantee: a demonstration is kept only when the hidden tests pass on the workspace it left (the real grade);
  its observations are the real outputs; rows are the SFT chat layout Hugging Face chat templates take, one
  context a row.
- Does not: plan the expert's calls (model/env/demos.py), word the summary step (model/env/summaries.py) or train
  on the rows (`rlbus sft`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from rlbus.actors.generator.config import AgenticSettings
    from rlbus.messages.bus import Bus
    from rlbus.model.env.agentic import AgenticBudgets
    from rlbus.model.tasks.repo import RepoTask

DEFAULT_N: Final = 20
DEFAULT_POOL: Final = 2
"""Episodes (sandbox sessions) at once."""
ATTEMPTS_PER_DEMO: Final = 2
"""A built-in source is drawn from until `--n` demonstrations pass or `--n` x this many episodes ran."""

Message = dict[str, Any]
TokenCount = Callable[[str], int]
"""Tokens of a text, by the tokenizer the summary mark is counted in."""


def register(tasks_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `demos` to the `rlbus tasks` actions."""
    demos = tasks_sub.add_parser(
        "demos", help="write demonstrations of repository tasks by a scripted expert working in a real sandbox",
        description="Run a scripted expert on the training tasks of a repository task source: it lists the files, "
                    "reads the relevant ones, runs a check, edits from the task's solution, checks again and "
                    "submits, every call run in a real sandbox session. A demonstration is kept when the hidden "
                    "tests pass. Writes JSONL rows in the SFT chat layout ({messages, tools, task_id, meta}), one "
                    "context a row: an episode whose context passes --summary-at tokens gets a summary step and "
                    "goes on in a fresh context (a second row). Exit 0 when a demonstration is written, 1 when none "
                    "passed, 2 when the source is unreadable.")
    demos.add_argument("source", metavar="SOURCE", help="repo, repo:LEVEL, or the path of a repository task file "
                       "(its training split: the held-out one is never drawn)")
    demos.add_argument("-o", "--output", required=True, metavar="FILE", help="the JSONL file to write")
    demos.add_argument("--n", type=int, default=DEFAULT_N, metavar="N",
                       help=f"demonstrations to write (default {DEFAULT_N}; a file gives at most one a task)")
    demos.add_argument("--seed", type=int, default=1, help="seed of the tasks drawn and of the expert (default 1)")
    demos.add_argument("--summary-at", type=int, default=None, metavar="TOKENS",
                       help="tokens of context past which the expert summarises (default: [generator.agentic] "
                            "summary_at_tokens's default; 0: never)")
    demos.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="count tokens with DIR/tokenizer.json (default: the built-in byte tokenizer)")
    demos.add_argument("--pool", type=int, default=DEFAULT_POOL, metavar="N",
                       help=f"episodes at once (default {DEFAULT_POOL})")
    demos.add_argument("--json", action="store_true",
                       help="print one JSON object (demos, attempted, pass_rate, turns_mean)")
    demos.set_defaults(handler=_demos)


def default_summary_at() -> int:
    """`[generator.agentic] summary_at_tokens` as the topology's default has it (0: no summary step)."""
    from rlbus.actors.generator.config import AgenticSettings

    return AgenticSettings().summary_at_tokens


def demo_budgets(settings: AgenticSettings) -> AgenticBudgets:
    """The budgets of the generator's agentic episodes (`[generator.agentic]`, whose budget fields are
    `AgenticBudgets`'), for demonstrations that see what the policy will: results cut to its `observation_chars`,
    its turn and `run` limits, summaries fitted to its `summary_tokens`."""
    from rlbus.model.env.agentic import AgenticBudgets

    return AgenticBudgets(**{name: getattr(settings, name) for name in AgenticBudgets.__struct_fields__})


def training_tasks(source: str, seed: int, n: int) -> list[RepoTask]:
    """The first `n` tasks of the training split of `source` (model/tasks/sources.py `load_repo_tasks`): the built-in
    tasks of `repo` or `repo:LEVEL` drawn from `seed` with `:train`; a repository task file's rows whose function
    `split_of` puts in `train`, and those that name no function (no split holds them).

    :raises TaskSourceError: `source` names the held-out split, or what reading it raises.
    """
    from rlbus.model.tasks.changes import split_of
    from rlbus.model.tasks.sources import TaskSourceError, is_repo_source, load_repo_tasks, split_source

    base, split = split_source(source)
    if split == "heldout":
        raise TaskSourceError(f"task source {source!r}: demonstrations are drawn from the training split only")
    if is_repo_source(base):
        return load_repo_tasks(f"{base}:train", seed=seed, n=n)
    return [t for t in load_repo_tasks(base, seed=seed, n=1 << 30) if not t.function or split_of(t.function) == "train"][:n]


def byte_tokens(text: str) -> int:
    """Tokens of the built-in byte tokenizer: the text's UTF-8 bytes."""
    return len(text.encode("utf-8"))


def _counter(tokenizer: str | None) -> TokenCount:
    if tokenizer is None:
        return byte_tokens
    from rlbus.actors.common.errors import TaskError

    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
    except Exception as err:                   # a missing or unreadable file, in one line
        raise TaskError(f"--tokenizer {tokenizer}: cannot load tokenizer.json: {err}") from None
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def _demos(args: argparse.Namespace) -> int:
    import anyio

    from rlbus.actors.common.errors import TaskError
    from rlbus.model.tasks.sources import TaskSourceError, is_repo_source

    if args.n < 1 or args.pool < 1:
        raise TaskError(f"--n {args.n} --pool {args.pool}: expected positive numbers")
    summary_at = default_summary_at() if args.summary_at is None else args.summary_at
    count = _counter(args.tokenizer)
    cap = args.n * ATTEMPTS_PER_DEMO if is_repo_source(args.source) else 1 << 30
    try:
        tasks = training_tasks(args.source, args.seed, cap)
    except TaskSourceError as err:
        raise TaskError(str(err)) from None
    started = time.monotonic()
    result = anyio.run(run_demos, tasks, args.n, args.seed, summary_at, count, args.pool, backend="asyncio")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in result.rows), encoding="utf-8")
    report = result.report()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"rlbus tasks demos {args.source}: {report['demos']} demonstration(s) of {report['attempted']} "
              f"episode(s) (pass rate {report['pass_rate']:.2f}), {report['turns_mean']:.1f} turns a demonstration, "
              f"{len(result.rows)} row(s) ({result.summarized} with a summary step) in {out}, "
              f"{time.monotonic() - started:.0f}s")
    return 0 if report["demos"] else 1


# ---- episodes ---------------------------------------------------------------------------------------------
def cut(text: str, limit: int) -> str:
    """A tool result as the agentic environment shows it: past `limit` characters, cut, saying so
    (model/env/agentic.py `cut_result`)."""
    from rlbus.model.env.agentic import cut_result

    return cut_result(text, limit)


def context_tokens(messages: Sequence[Message], count: TokenCount) -> int:
    """Tokens of a context: the tool list, every turn's content and every call's text."""
    from rlbus.model.tools.calls import ToolCall, tools_text

    total = count(tools_text())
    for m in messages:
        total += count(m["content"])
        for c in m.get("tool_calls", ()):
            total += count(ToolCall(c["function"]["name"], c["function"]["arguments"]).text())
    return total


@dataclass
class Episode:
    """One expert episode: its contexts (a new one after each summary step), turns, grade."""

    task_id: str
    contexts: list[list[Message]]
    turns: int = 0
    passed: bool = False
    verdict: str = ""
    wrong_first: bool = False
    """The expert's first edit was wrong, and it corrected it."""


async def demo_episode(bus: Bus, task: RepoTask, seed: int, *, summary_at: int, count: TokenCount,
                       budgets: AgenticBudgets | None = None) -> Episode:
    """Run the expert on `task` in a fresh sandbox session (region hub of `bus`): each of its turns' calls run in
    the session, each observation what the session answered (cut to `budgets.observation_chars` as the environment
    cuts it); after `submit` the workspace is graded on the hidden tests. Once a context passes `summary_at` tokens,
    having grown by at least a quarter of that since it started (so a fresh context that starts near the mark is not
    summarised turn after turn), the expert answers `SUMMARY_REQUEST` with its summary (`fitted` to
    `budgets.summary_tokens` with its stop id) and goes on in a fresh context. An episode past the turn budget ends
    ungraded (not passed). The rows' first user turns are the task without a tool list (`task_text`): SFT puts the
    list where the policy's framing has it. `budgets`: the generator's (`[generator.agentic]`), default
    `AgenticBudgets()`.

    :raises SandboxCrashed: the session could not be opened or stopped answering.
    """
    from rlbus.actors.common.sessions import SandboxSession, SessionPort
    from rlbus.model.env.agentic import AgenticBudgets, task_text
    from rlbus.model.env.demos import Expert, Observed
    from rlbus.model.env.summaries import SUMMARY_REQUEST, fitted, fresh_context
    from rlbus.model.tools.calls import outcome_text

    budgets = budgets or AgenticBudgets()
    limit = budgets.summary_tokens
    expert = Expert(task, seed)
    first = task_text(task)
    episode = Episode(task.task_id, [[{"role": "user", "content": first}]])
    observed: list[Observed] = []
    files = {path: text.encode() for path, text in task.files.items()}
    async with await SandboxSession.open(bus, "hub", files, lease_s=120.0) as session:
        port = SessionPort(session)
        start = context_tokens(episode.contexts[-1], count)
        while True:
            messages = episode.contexts[-1]
            if summary_at and (now := context_tokens(messages, count)) > summary_at and now - start >= summary_at // 4:
                summary = expert.summary(observed)
                if limit:
                    summary = fitted(summary, lambda text: count(text) + 1 <= limit)
                messages += [{"role": "user", "content": SUMMARY_REQUEST}, {"role": "assistant", "content": summary}]
                episode.contexts.append([{"role": "user", "content": fresh_context(first, summary)}])
                messages = episode.contexts[-1]
                start = context_tokens(messages, count)
            step = expert.next_step(observed)
            episode.turns += 1
            messages.append({"role": "assistant", "content": step.content, "tool_calls": [
                {"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}} for c in step.calls]})
            if step.submits:
                break
            if episode.turns >= budgets.max_turns:
                episode.verdict = "turns"
                return episode
            for call in step.calls:
                args = dict(call.arguments)
                if call.name == "run":
                    args["timeout_s"] = budgets.run_timeout_s       # as the environment bounds a run
                outcome = await port.tool(call.name, args)
                text = cut(outcome_text(call, outcome), budgets.observation_chars)
                observed.append(Observed(call, text))
                messages.append({"role": "tool", "name": call.name, "content": text})
        report = await port.grade_workspace(task)
    episode.verdict = report.verdict
    episode.passed = report.verdict == "passed"
    episode.wrong_first = expert.wrong_first
    return episode


def rows_of(episode: Episode, *, seed: int, source: str = "") -> list[dict[str, Any]]:
    """The SFT rows of an episode, one a context: {messages, tools, task_id, meta}."""
    from rlbus.model.tools.calls import TOOL_SCHEMAS

    n = len(episode.contexts)
    return [{"messages": messages, "tools": list(TOOL_SCHEMAS), "task_id": episode.task_id,
             "meta": {"expert_seed": seed, "context": k, "contexts": n, "turns": episode.turns,
                      "grade": episode.verdict, "wrong_first": episode.wrong_first, **({"source": source} if source else {})}}
            for k, messages in enumerate(episode.contexts)]


@dataclass
class DemoRun:
    """What `run_demos` made: the rows to write and the counts of the report."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    attempted: int = 0
    kept: int = 0
    turns: int = 0
    summarized: int = 0
    failures: list[str] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        """`rlbus tasks demos --json`: demos, attempted, pass_rate, turns_mean."""
        return {"demos": self.kept, "attempted": self.attempted,
                "pass_rate": round(self.kept / self.attempted, 4) if self.attempted else 0.0,
                "turns_mean": round(self.turns / self.kept, 2) if self.kept else 0.0}


async def run_demos(tasks: Sequence[RepoTask], n: int, seed: int, summary_at: int, count: TokenCount = byte_tokens,
                    pool: int = DEFAULT_POOL, budgets: AgenticBudgets | None = None) -> DemoRun:
    """Episodes of `tasks` (`demo_episode`, under `budgets`), in order, `pool` at once, on a sandbox supervisor served
    here (ops/local_sandbox.py), until `n` demonstrations pass or the tasks run out; the passing ones' rows in task
    order. An episode still running when the `n`-th passes is cancelled and not counted. Progress to stderr."""
    import anyio

    from rlbus.actors.sandbox.config import SandboxConfig
    from rlbus.messages.errors import SandboxCrashed
    from rlbus.ops.local_sandbox import local_sandbox

    run = DemoRun()
    done: dict[int, list[dict[str, Any]]] = {}
    config = SandboxConfig(pool_size=1, concurrency=pool, cpu_seconds=60.0, wall_seconds=60.0)
    async with local_sandbox("tasks-demos", config) as bus:
        limiter = anyio.CapacityLimiter(pool)

        async def one(index: int, task: RepoTask, scope: anyio.CancelScope) -> None:
            async with limiter:
                if run.kept >= n:
                    return
                try:
                    episode = await demo_episode(bus, task, seed, summary_at=summary_at, count=count, budgets=budgets)
                except SandboxCrashed as err:
                    run.attempted += 1
                    run.failures.append(f"{task.task_id}: {err}"[:300])
                    print(f"rlbus tasks demos: {task.task_id}: no sandbox answer: {err}"[:300], file=sys.stderr,
                          flush=True)
                    return
                run.attempted += 1
                if episode.passed and run.kept < n:
                    run.kept += 1
                    run.turns += episode.turns
                    run.summarized += len(episode.contexts) > 1
                    done[index] = rows_of(episode, seed=seed)
                print(f"rlbus tasks demos: {task.task_id} {episode.verdict or 'ungraded'} in {episode.turns} turns "
                      f"({run.kept}/{n} kept, {run.attempted} run)", file=sys.stderr, flush=True)
                if run.kept >= n:
                    scope.cancel()

        async with anyio.create_task_group() as work:
            for index, task in enumerate(tasks):
                work.start_soon(one, index, task, work.cancel_scope)
    run.rows = [row for index in sorted(done) for row in done[index]]
    return run
