"""Grading through the plain subprocess runner: verdicts, feedback text, hangs, crashes, a pluggable runner."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from rlbus.model.tasks.builtin import HiddenTest, Task
from rlbus.model.tasks.grading import (
    GradeCase,
    GradeResult,
    extract_code,
    grade,
    grade_many,
    source_tests,
    subprocess_runner,
)

ADD2 = Task("t-add2", "int", 1, 'def f(x):\n    """Add 2."""\n', "f", "    x = x + 2\n    return x\n",
            (HiddenTest("(1,)", "3"), HiddenTest("(5,)", "7"), HiddenTest("(-2,)", "0")))


def test_correct_and_wrong_bodies() -> None:
    """The canonical body passes 3/3; an off-by-one body fails on the first test with a readable message."""
    ok = grade(ADD2, ADD2.solution)
    assert (ok.status, ok.n_passed, ok.n_tests, ok.reward) == ("passed", 3, 3, 1.0)
    bad = grade(ADD2, "    return x + 1\n")
    assert (bad.status, bad.n_passed, bad.reward) == ("failed", 0, 0.0)
    assert bad.feedback == "f(1) returned 2, expected 3"
    assert bad.observation() == "0/3 tests passed. f(1) returned 2, expected 3"


def test_partial_pass_counts_until_first_failure() -> None:
    """Tests run in order; n_passed counts those before the first failure."""
    result = grade(ADD2, "    return x + 2 if x > 0 else 99\n")
    assert (result.status, result.n_passed) == ("failed", 2)
    assert result.feedback == "f(-2) returned 99, expected 0"


def test_types_must_match() -> None:
    """A float equal in value to the expected int is still wrong (x / 1 is not x // 1)."""
    result = grade(ADD2, "    return (x + 2) / 1\n")
    assert result.status == "failed" and "returned 3.0, expected 3" in result.feedback


def test_errors_and_exceptions() -> None:
    """Syntax errors and a missing function are `error`; an exception in a test is `failed` with its text."""
    syntax, missing, raising = grade_many([(ADD2, "    return x +\n"), (ADD2, "def g(x):\n    return x\n"),
                                           (ADD2, "    return x // 0\n")])
    assert syntax.status == "error" and syntax.feedback.startswith("SyntaxError")
    assert missing.status == "error"
    assert missing.feedback == "NameError: the code does not define a function named 'f'"
    assert raising.status == "failed"
    assert raising.feedback == "f(1) raised ZeroDivisionError: integer division or modulo by zero"


def test_hangs_crashes_and_prints_do_not_spoil_the_batch() -> None:
    """A loop times out, os._exit crashes its case only, prints are swallowed; later cases are still graded."""
    codes = [
        "    while True:\n        pass\n",
        "    try:\n        while True:\n            pass\n    except BaseException:\n        while True:\n"
        "            pass\n",
        "import os\nos._exit(3)\n",
        "    print('x' * 100000)\n    return x + 2\n",
        "import sys\nsys.exit(0)\n",
        ADD2.solution,
    ]
    results = grade_many([(ADD2, c) for c in codes], timeout_s=0.5)
    assert [r.status for r in results] == ["timeout", "timeout", "crashed", "passed", "error", "passed"]
    assert results[0].feedback == "timed out after 0.5s"


def test_extract_code_from_fences() -> None:
    """A fenced block is taken from a chatty completion; plain text is returned as is."""
    assert extract_code("Here:\n```python\n    return x\n```\nDone") == "    return x\n"
    assert extract_code("    return x\n") == "    return x\n"


def test_runner_is_pluggable_and_batched() -> None:
    """grade_many makes one runner call for the whole batch, with prompt + body as the program."""
    calls: list[list[GradeCase]] = []

    def recording_runner(cases: Sequence[GradeCase]) -> list[GradeResult]:
        calls.append(list(cases))
        return subprocess_runner(cases)

    results = grade_many([(ADD2, ADD2.solution)] * 5 + [(ADD2, "    return 0\n")], runner=recording_runner)
    assert len(calls) == 1 and len(calls[0]) == 6
    assert calls[0][0].code == ADD2.prompt + ADD2.solution
    assert calls[0][0].tests == (("(1,)", "3"), ("(5,)", "7"), ("(-2,)", "0"))
    assert [r.passed for r in results] == [True] * 5 + [False]


CHECKED = Task("t-check", "file", 0, "def double(x):\n", "double", "    return 2 * x\n", (),
               "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-1) == -2\n")


def test_source_tests_run_after_the_pairs_with_a_check_call_as_one_test() -> None:
    """A `check(candidate)` source is one test called with the entry point; top-level asserts count one each;
    a source with neither is refused."""
    ok, bad = grade(CHECKED, CHECKED.solution), grade(CHECKED, "    return x\n")
    assert (ok.status, ok.n_passed, ok.n_tests) == ("passed", 1, 1)
    assert (bad.status, bad.n_passed, bad.n_tests) == ("failed", 0, 1)
    assert "of the tests: AssertionError" in bad.feedback
    both = Task("t-both", "int", 1, ADD2.prompt, "f", ADD2.solution, ADD2.tests,
                "assert f(10) == 12\nassert f(0) == 2\n")
    result = grade(both, "    return x + 2 if x < 10 else 0\n")
    assert (result.status, result.n_passed, result.n_tests) == ("failed", 3, 5)
    assert source_tests("f", "assert f(1) == 2\n") == "assert f(1) == 2\n"
    assert source_tests("f", CHECKED.test_source).endswith("assert _rlbus_run_check(check, f), 'check(f) failed'\n")
    with pytest.raises(ValueError, match="top-level assert"):
        source_tests("f", "x = 1\n")
