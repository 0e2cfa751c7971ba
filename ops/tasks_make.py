"""`rlbus tasks make -o FILE`: repository tasks made from the standard library and CPython's own tests.

- Owns: the command (`register`) and `make_tasks`: each module's seeded changes graded in a real sandbox
  supervisor, a change kept only when a test that passes on the original fails on it.
- Guarantee: a seed gives the same file; exit 0 with `--n` tasks written, 1 when the changes ran out first.
- Does not: word or build tasks (model/tasks/make.py), or change code (model/tasks/mutators.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from rlbus.model.tasks.make import StdlibModule
    from rlbus.model.tasks.repo_grade import GradeReport

DEFAULT_N: Final = 200
DEFAULT_POOL: Final = 2
"""Grades in flight (the sandbox's concurrency)."""
PROBE_TIMEOUT_S: Final = (30.0, 5.0)
"""A change's grade is cut at max(first, second x the unmodified module's grade time), at most the task's."""


def register(tasks_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `make` to the `rlbus tasks` actions."""
    from rlbus.model.tasks.make import DEFAULT_MODULES

    make = tasks_sub.add_parser(
        "make", help="make repository tasks from standard-library modules with one seeded bug each",
        description="Make repository tasks from standard-library modules: the module's file with one seeded "
                    "change, CPython's own test file for it as the hidden tests, the original file as the "
                    "solution. A change is kept only when the real sandbox grade shows a test that passes on the "
                    "original failing on it. Writes a repository task file that `rlbus tasks check` accepts.")
    make.add_argument("-o", "--output", required=True, metavar="FILE", help="the JSONL file to write")
    make.add_argument("--n", type=int, default=DEFAULT_N, metavar="N",
                      help=f"tasks to make, shared out evenly over the modules (default {DEFAULT_N})")
    make.add_argument("--seed", type=int, default=1, help="seed of the changes (default 1)")
    make.add_argument("--modules", default=",".join(DEFAULT_MODULES), metavar="M,M",
                      help=f"comma-separated standard-library modules (default {','.join(DEFAULT_MODULES)})")
    make.add_argument("--pool", type=int, default=DEFAULT_POOL, metavar="N",
                      help=f"grades in flight (default {DEFAULT_POOL})")
    make.set_defaults(handler=_make)


def _make(args: argparse.Namespace) -> int:
    from rlbus.actors.common.errors import TaskError
    from rlbus.model.tasks.make import MakeError

    modules = [m.strip() for m in args.modules.split(",") if m.strip()]
    if args.n < 1 or not modules:
        raise TaskError(f"--n {args.n} --modules {args.modules!r}: expected a positive number and some modules")
    started = time.monotonic()
    try:
        rows, stats = make_tasks(modules, args.n, seed=args.seed, pool=max(1, args.pool))
    except MakeError as err:
        raise TaskError(str(err)) from None
    out = Path(args.output)
    partial = out.with_name(out.name + ".partial")
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    partial.replace(out)
    seconds = time.monotonic() - started
    print(json.dumps({"tasks": len(rows), "output": str(out), "seconds": round(seconds, 1), **stats}))
    return 0 if len(rows) == args.n else 1


def _progress(line: str) -> None:
    print(f"rlbus tasks make: {line}", file=sys.stderr, flush=True)


def make_tasks(modules: Sequence[str], n: int, *, seed: int = 1, pool: int = DEFAULT_POOL,
               progress: Callable[[str], None] = _progress) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of `n` tasks over `modules` and what making them took (`tried`, `kept`, and the outcome of every
    change graded, per module: kept, passed (no test caught it), timeout (an endless loop, say), void (the
    grade found a problem: the module under test did not import, say), no verdict), grading in a sandbox
    supervisor served here.

    For each module (`--modules`, default textwrap, fractions, statistics, shlex, heapq, calendar) it grades
    the unmodified module against its CPython test file once, through a real sandbox supervisor on an
    embedded nats-server (ops/repo_grading.py `repository_grader`); tests that do not pass there are skipped
    by decorator and not counted, and the rest must then pass. Then it grades the module's seeded changes
    (model/tasks/mutators.py) in turn, `--pool` at a time, and keeps a change only when its grade is `failed`
    (not a timeout, not void) with at least one test that passes on the original failing: its fail-to-pass
    tests are recorded in the row. The first changes kept in stream order fill the module's share of `--n`,
    so a seed gives the same file. Rows go to `-o` (model/tasks/make.py words them), a file `rlbus tasks
    check` accepts; progress goes to stderr.

    :raises MakeError: a module that tasks cannot be made from (model/tasks/make.py `stdlib_module`), or whose
        unmodified file does not pass its tests once the failing ones are skipped.
    """
    from concurrent.futures import Future, ThreadPoolExecutor

    from rlbus.actors.sandbox.config import SandboxConfig
    from rlbus.messages.errors import SandboxCrashed
    from rlbus.model.tasks.make import (
        SKIP_REASON,
        TIMEOUT_S,
        MakeError,
        fail_to_pass,
        module_seed,
        quotas,
        stdlib_module,
        task_row,
    )
    from rlbus.model.tasks.mutators import Mutation, mutations
    from rlbus.ops.repo_grading import repository_grader

    modules_read = [stdlib_module(name) for name in modules]      # refused before any sandbox starts
    rows: list[dict[str, Any]] = []
    outcomes: dict[str, Counter[str]] = {}
    failure: MakeError | None = None
    config = SandboxConfig(pool_size=1, concurrency=pool, cpu_seconds=TIMEOUT_S, wall_seconds=TIMEOUT_S)
    with repository_grader("tasks-make", config) as grade, ThreadPoolExecutor(pool) as threads:
        def graded(module: StdlibModule, text: str, timeout_s: float) -> GradeReport:
            return grade({module.path: text}, {module.test_path: module.tests}, stdlib_under_test=[module.name],
                         timeout_s=timeout_s)

        for module, quota in zip(modules_read, quotas(n, modules).values(), strict=True):
            if quota == 0:
                continue
            try:
                module, base, base_s = _baseline(graded, module)
            except MakeError as err:            # raised out here, not through the sandbox's task group
                failure = err
                break
            set_aside = [t.name for t in base.tests if t.status == "not_run" and t.detail.endswith(SKIP_REASON)]
            progress(f"{module.name}: the unmodified module passes {base.n_passed} tests in {base_s:.1f} s"
                     + (f" ({len(set_aside)} set aside: {', '.join(set_aside)})" if set_aside else ""))
            probe_s = min(TIMEOUT_S, max(PROBE_TIMEOUT_S[0], PROBE_TIMEOUT_S[1] * base_s))
            stream = mutations({module.path: module.source}, module_seed(seed, module.name))
            ahead: deque[tuple[Mutation, Future[GradeReport]]] = deque()
            counts: Counter[str] = Counter()
            kept = 0
            while kept < quota:
                while len(ahead) < 2 * pool and (change := next(stream, None)) is not None:
                    ahead.append((change, threads.submit(graded, module, change.text, probe_s)))
                if not ahead:
                    break
                change, future = ahead.popleft()
                try:
                    report = future.result()
                except SandboxCrashed:            # no session, or no answer: the change is passed over
                    counts["no verdict"] += 1
                    continue
                failing_names = set(fail_to_pass(base, report))
                if report.verdict == "failed" and not report.problems and failing_names:
                    rows.append(task_row(module, change, [t for t in report.tests if t.name in failing_names]))
                    kept += 1
                    counts["kept"] += 1
                else:
                    counts[report.verdict if report.verdict in ("passed", "timeout") else
                           "void" if report.problems or report.verdict == "error" else "failed"] += 1
                if sum(counts.values()) % 10 == 0 or kept == quota:
                    progress(f"{module.name}: {kept}/{quota} kept of {sum(counts.values())} changes graded "
                             f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})")
            for _, future in ahead:
                future.cancel()
            for _, future in ahead:
                if not future.cancelled():
                    future.exception()
            outcomes[module.name] = counts
    if failure is not None:
        raise failure
    tried = sum(sum(c.values()) for c in outcomes.values())
    return rows, {"tried": tried, "kept": len(rows), "outcomes": {m: dict(c) for m, c in outcomes.items()}}


def _baseline(graded: Callable[[StdlibModule, str, float], GradeReport],
              module: StdlibModule) -> tuple[StdlibModule, GradeReport, float]:
    """The unmodified module graded (tests that do not pass set aside by `skip_tests`, and graded again): the
    module as the tasks hold it, its report, and the first grade's seconds.

    :raises MakeError: the grade is void or timed out, or fails with those tests set aside.
    """
    from rlbus.model.tasks.make import TIMEOUT_S, MakeError, skip_tests

    clock = time.monotonic()
    base = graded(module, module.source, TIMEOUT_S)
    seconds = time.monotonic() - clock
    if base.verdict in ("timeout", "error") or base.problems:
        raise MakeError(f"module {module.name!r}: the unmodified module's grade is {base.verdict}: "
                        f"{base.result().feedback[:500]}")
    set_aside = [t.name for t in base.counted if t.status != "passed"]
    if set_aside:
        module = skip_tests(module, set_aside)
        base = graded(module, module.source, TIMEOUT_S)
        if base.verdict != "passed":
            raise MakeError(f"module {module.name!r}: the unmodified module fails its tests with "
                            f"{', '.join(set_aside)} skipped: {base.result().feedback[:500]}")
    return module, base, seconds


__all__ = ["DEFAULT_N", "DEFAULT_POOL", "make_tasks", "register"]
