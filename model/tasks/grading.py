"""Grading candidate code against a task's hidden tests, through a pluggable runner.

Owns: the runner protocol (`GradeCase` in, `GradeResult` out), the tests program of a Python test source
(`source_tests`: its top-level asserts, or one assert calling its `check(candidate)`), the default
`subprocess_runner` (one plain child process for a whole batch, per-case time limits, restarted past a
crash or hang), code extraction from a completion, and `grade` / `grade_many`.
Does not own: isolation. The sandbox actor supplies a runner that executes `harness.py` in a jail.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from rlbus.model.tasks.builtin import Task

HARNESS_PATH: Final = Path(__file__).with_name("harness.py")
"""The stdlib-only child script every runner executes (copy it into a sandbox as is)."""
GRACE_S: Final = 2.0
STARTUP_S: Final = 10.0

Status = Literal["passed", "failed", "error", "timeout", "crashed"]


@dataclass(frozen=True, slots=True)
class GradeCase:
    """One candidate to run: its source, the function to call, tests as (args repr, expected repr) pairs, and
    tests as Python source run after them (`source_tests` of the task's test source; "" for none)."""

    code: str
    entry_point: str
    tests: tuple[tuple[str, str], ...]
    timeout_s: float = 1.0
    test_source: str = ""

    @property
    def n_tests(self) -> int:
        """Tests of the case: one per pair, one per top-level assert of the test source."""
        return len(self.tests) + count_asserts(self.test_source)


@dataclass(frozen=True, slots=True)
class GradeResult:
    """Verdict for one candidate. `feedback` is the first failure, the observation of a multi-turn episode."""

    status: Status
    n_passed: int
    n_tests: int
    feedback: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def reward(self) -> float:
        """1.0 when every hidden test passes, else 0.0."""
        return 1.0 if self.passed else 0.0

    def observation(self) -> str:
        """Text shown to the policy after a failed attempt: tests passed and the first failure."""
        if self.passed:
            return f"All {self.n_tests} tests passed."
        return f"{self.n_passed}/{self.n_tests} tests passed. {self.feedback}"


_TOP_ASSERT: Final = re.compile(r"^assert\b", re.MULTILINE)
_CHECK_DEF: Final = re.compile(r"^def\s+check\s*\(", re.MULTILINE)
_CALL_CHECK: Final = (
    "\n\ndef _rlbus_run_check(check, candidate):\n    check(candidate)\n    return True\n\n\n"
    "assert _rlbus_run_check(check, {entry}), 'check({entry}) failed'\n"
)


def source_tests(entry_point: str, source: str) -> str:
    """The tests program of a test source, every test a top-level assert (what the sandbox counts).

    A source with top-level asserts (MBPP's `test_list`) runs as is, each assert one test. A source with
    none that defines `check(candidate)` at top level (HumanEval's `test`) gets one assert calling it with
    the entry point: one test, failed when `check` raises. Found by line patterns, not `ast`, so any thread
    may call it.
    :raises ValueError: the source has neither.
    """
    if _TOP_ASSERT.search(source):
        return source
    if _CHECK_DEF.search(source):
        return source.rstrip("\n") + "\n" + _CALL_CHECK.format(entry=entry_point)
    raise ValueError("a test source needs top-level assert statements or a top-level `def check(candidate):`")


def count_asserts(tests_program: str) -> int:
    """Top-level `assert` lines of a tests program (the executor counts the same statements)."""
    return len(_TOP_ASSERT.findall(tests_program))


Runner = Callable[[Sequence[GradeCase]], list[GradeResult]]
"""Runs a batch of cases, returning one result per case in order. Must never raise for bad code."""


def subprocess_runner(cases: Sequence[GradeCase], *, memory_mb: int = 1024) -> list[GradeResult]:
    """Run `cases` in one plain `python -I harness.py` child per batch (no isolation beyond a temp cwd).

    Each case has its own time limit inside the child. If the child dies or stops answering for
    `timeout_s + GRACE_S`, the current case is `crashed`/`timeout`, the child is killed by its pid and
    a fresh one takes the remaining cases. 200 cases cost ~one interpreter start (~50 ms).
    """
    results: list[GradeResult] = []
    with tempfile.TemporaryDirectory(prefix="rlbus-grade-") as workdir:
        while len(results) < len(cases):
            results.extend(_run_child(cases[len(results):], workdir, memory_mb))
    return results


def _run_child(cases: Sequence[GradeCase], workdir: str, memory_mb: int) -> list[GradeResult]:
    """Answer a prefix of `cases` (at least one) with one child process."""
    payload = "".join(
        json.dumps({"code": c.code, "entry_point": c.entry_point, "tests": [list(t) for t in c.tests],
                    "test_source": c.test_source, "timeout_s": c.timeout_s}) + "\n"
        for c in cases
    )
    env = {"PATH": os.environ.get("PATH", ""), "RLBUS_HARNESS_MEMORY_MB": str(memory_mb)}
    with tempfile.TemporaryFile("w+b") as stdin:
        stdin.write(payload.encode("utf-8"))
        stdin.seek(0)
        proc = subprocess.Popen(
            [sys.executable, "-I", str(HARNESS_PATH)], stdin=stdin, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd=workdir, env=env, start_new_session=True,
        )
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    results: list[GradeResult] = []
    buffer = b""
    stuck = False
    # the first answer also waits for the interpreter to start on a busy machine
    deadline = time.monotonic() + STARTUP_S + cases[0].timeout_s + GRACE_S
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while len(results) < len(cases):
            if b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                answer = json.loads(line)
                results.append(GradeResult(answer["status"], answer["n_passed"], answer["n_tests"],
                                           answer["feedback"]))
                if len(results) < len(cases):
                    deadline = time.monotonic() + cases[len(results)].timeout_s + GRACE_S
                continue
            case = cases[len(results)]
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):  # hung past its own alarm
                results.append(_stuck(case, "timeout", f"timed out after {case.timeout_s:g}s"))
                stuck = True
                break
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # EOF: the child died on this case (os._exit, segfault, memory kill)
                results.append(_stuck(case, "crashed", "the process running the code died"))
                stuck = True
                break
            buffer += chunk
    if stuck:
        _kill(proc)
    proc.stdout.close()
    proc.wait()
    return results


def _stuck(case: GradeCase, status: Status, feedback: str) -> GradeResult:
    return GradeResult(status, 0, case.n_tests, feedback)


def _kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child's own session (it was started with start_new_session), i.e. only what we started."""
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass


def extract_code(completion: str) -> str:
    """The code inside a completion: the first ``` fenced block when there is one, else the text itself."""
    if "```" in completion:
        _, _, rest = completion.partition("```")
        first_line, _, body = rest.partition("\n")
        if first_line.strip() not in ("", "python", "py"):
            body = rest
        return body.partition("```")[0]
    return completion


def case_for(task: Task, code: str, *, timeout_s: float = 1.0) -> GradeCase:
    """The runner case grading a completion (`task.program(code)`) on all of `task`'s hidden tests (its pairs,
    then its test source as `source_tests` makes it).

    :raises ValueError: the task's test source has no test (`source_tests`).
    """
    source = source_tests(task.entry_point, task.test_source) if task.test_source else ""
    return GradeCase(task.program(code), task.entry_point, tuple((t.args, t.expected) for t in task.tests), timeout_s,
                     source)


def grade_many(pairs: Sequence[tuple[Task, str]], *, runner: Runner = subprocess_runner,
               timeout_s: float = 1.0) -> list[GradeResult]:
    """Grade many (task, completion) pairs in one runner call; results in input order."""
    if not pairs:
        return []
    return runner([case_for(task, extract_code(code), timeout_s=timeout_s) for task, code in pairs])


def grade(task: Task, code: str, *, runner: Runner = subprocess_runner, timeout_s: float = 1.0) -> GradeResult:
    """Grade one completion against `task`'s hidden tests."""
    return grade_many([(task, code)], runner=runner, timeout_s=timeout_s)[0]
