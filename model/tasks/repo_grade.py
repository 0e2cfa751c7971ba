"""The verdict of a repository task's hidden tests: a per-test report and the reward it gives.

Owns: `TestReport` and `GradeReport` (what the sandbox's `grade` tool returns as its output, JSON), `expected_tests`
(the test method names a hidden test file defines, read from its syntax tree outside the sandbox, so a test the
tested code hid from the loader counts as missing) and `report_of` (a grade reply's output, decoded).
Does not: run anything (actors/sandbox/grade_runner.py runs the tests, actors/sandbox/tools.py checks its report).
"""

from __future__ import annotations

import io
import tokenize
from collections.abc import Mapping
from typing import ClassVar, Final, Literal

import msgspec

from rlbus.model.tasks.grading import GradeResult

TestStatus = Literal["passed", "failed", "error", "skipped", "missing", "not_run"]
"""`not_run`: skipped by the hidden tests' own decorator (not counted); `skipped`: skipped while running (counted,
not passed); `missing`: defined by a hidden test file, never reported."""
Verdict = Literal["passed", "failed", "timeout", "error"]
DEFAULT_COMMAND: Final = ""
"""`test_command` of a task graded by the grade runner (the default); any other command is judged by exit code."""


class TestReport(msgspec.Struct, frozen=True):
    """One hidden test: its id (`module.Class.method`, or the command for a custom `test_command`), status, and
    what went wrong (a traceback tail)."""

    __test__: ClassVar[bool] = False
    """Not a test class (for pytest's collection of modules that import it)."""
    name: str
    status: TestStatus
    detail: str = ""


class GradeReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a grade found. `verdict` is passed only when every counted test passed and nothing voided the grade;
    `problems` says what voided it (the framework changed, no genuine report, a hidden test file failed to import);
    `judged_by` is `exit_code` for a custom test command (one pseudo-test, the command)."""

    verdict: Verdict
    tests: tuple[TestReport, ...] = ()
    problems: tuple[str, ...] = ()
    judged_by: Literal["report", "exit_code"] = "report"
    log: str = ""
    """The tail of what the tests printed."""

    @property
    def counted(self) -> list[TestReport]:
        return [t for t in self.tests if t.status != "not_run"]

    @property
    def n_passed(self) -> int:
        return 0 if self.problems else sum(t.status == "passed" for t in self.counted)

    @property
    def n_tests(self) -> int:
        return max(1, len(self.counted))

    def reward(self, *, partial_credit: bool = False) -> float:
        """1.0 when the verdict is passed, else 0.0; with `partial_credit`, the fraction of counted tests that
        passed (0.0 when the grade is void or timed out)."""
        if self.verdict == "passed":
            return 1.0
        if not partial_credit or self.verdict in ("timeout", "error"):
            return 0.0
        return self.n_passed / self.n_tests

    def result(self) -> GradeResult:
        """As the graders' `GradeResult` (feedback: the first problem or failing test)."""
        status = {"passed": "passed", "failed": "failed", "timeout": "timeout", "error": "error"}[self.verdict]
        first = next((t for t in self.counted if t.status != "passed"), None)
        feedback = (self.problems[0] if self.problems else
                    f"{first.name}: {first.status}\n{first.detail}" if first else self.log)
        return GradeResult(status, self.n_passed, self.n_tests, feedback[-2000:])  # type: ignore[arg-type]


def expected_tests(hidden_tests: Mapping[str, str]) -> dict[str, set[tuple[str, str]]]:
    """For each hidden `.py` file whose name starts with `test`, the (class, method) of every `test*` method its
    top-level classes define. Read with `tokenize` (no AST: the supervisor may call it off the main thread); a file
    that does not tokenize defines what was read before the error (the grade reports its import error)."""
    out: dict[str, set[tuple[str, str]]] = {}
    for path, source in hidden_tests.items():
        if is_test_file(path):
            out[path] = _test_methods(source)
    return out


def _test_methods(source: str) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    depth, cls, previous = 0, "", ""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.INDENT:
                depth += 1
            elif tok.type == tokenize.DEDENT:
                depth -= 1
                cls = cls if depth else ""
            elif tok.type == tokenize.NAME:
                if previous == "class" and depth == 0:
                    cls = tok.string
                elif previous == "def" and depth == 1 and cls and tok.string.startswith("test"):
                    found.add((cls, tok.string))
                previous = tok.string
            elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
                previous = ""
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return found


def is_test_file(path: str) -> bool:
    """A hidden file the grade runner loads as tests: `.py` whose file name starts with `test`."""
    name = path.rsplit("/", 1)[-1]
    return name.startswith("test") and name.endswith(".py")


def module_of(path: str) -> str:
    """The module name a hidden test file runs under: tests/test_x.py -> tests.test_x."""
    return path.removesuffix(".py").replace("/", ".")


_DECODER: Final = msgspec.json.Decoder(GradeReport)


def report_of(output: str, error: str = "") -> GradeReport:
    """The report in a `grade` reply's output; a reply without one (the call was refused: `error` says why) is an
    `error` verdict."""
    try:
        return _DECODER.decode(output)
    except msgspec.DecodeError:
        return GradeReport(verdict="error", problems=(error or f"the grade reply holds no report: {output[-500:]!r}",))


__all__ = ["DEFAULT_COMMAND", "GradeReport", "TestReport", "TestStatus", "Verdict", "expected_tests", "is_test_file",
           "module_of", "report_of"]
