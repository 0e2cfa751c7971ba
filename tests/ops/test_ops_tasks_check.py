"""`rlbus tasks check` as a real command on a real sandbox: HumanEval's references all pass and their broken
copies all fail; a file with one wrong reference is reported and the exit code says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.ops.tasks import _text

KEYS = {"tasks", "reference_passed", "broken_rejected", "exceptions", "isolation"}


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "tasks", "check", *args, "--json"],
                          capture_output=True, text=True, timeout=600)


def test_humaneval_references_all_pass_and_their_broken_copies_all_fail() -> None:
    """All 164 HumanEval reference solutions pass their `check` in the sandbox; all 164 copies whose entry
    point returns None fail it; progress goes to stderr."""
    done = _check("humaneval", "--pool", "6")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert set(report) == KEYS
    assert (report["tasks"], report["reference_passed"], report["broken_rejected"]) == (164, 164, 164)
    assert report["exceptions"] == [] and report["isolation"] in ("bwrap", "unshare", "rlimits-only")
    assert "328/328 graded" in done.stderr


def test_a_wrong_reference_is_listed_and_the_exit_code_says_so(tmp_path: Path) -> None:
    """In a file of three tasks (pairs, a check function, MBPP asserts), the one whose reference is wrong is
    the one exception, as a reference that failed its tests; every broken copy is rejected; exit 1."""
    rows = [
        {"task_id": "pairs", "prompt": "def inc(x):\n", "entry_point": "inc", "solution": "    return x + 1\n",
         "tests": [{"args": "(1,)", "expected": "2"}, {"args": "(5,)", "expected": "6"}]},
        {"task_id": "wrong", "prompt": "def sq(x):\n", "entry_point": "sq", "solution": "    return x + x\n",
         "test": "def check(candidate):\n    assert candidate(3) == 9\n"},
        {"task_id": 7, "text": "Write a function to join words with dashes.", "code": "def dash(ws):\r\n  return '-'.join(ws)",
         "test_list": ["assert dash(['a', 'b']) == 'a-b'", "assert dash([]) == ''"], "test_setup_code": ""},
    ]
    path = tmp_path / "three.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = _check(str(path))
    assert done.returncode == 1, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert (report["tasks"], report["reference_passed"], report["broken_rejected"]) == (3, 2, 3)
    (only,) = report["exceptions"]
    assert (only["task_id"], only["copy"], only["status"]) == ("wrong", "reference", "failed")
    assert only["detail"].startswith("0/1 tests passed")
    assert "FAILED: 1 exception(s)" in _text(str(path), report)
    (path.parent / "bad.jsonl").write_text('{"id": 1}\n')
    unreadable = _check(str(path.parent / "bad.jsonl"))
    assert unreadable.returncode == 2 and "bad.jsonl:1: expected an object" in unreadable.stderr


@pytest.mark.parametrize("limit", ["0", "-3"])
def test_a_limit_below_one_is_refused(limit: str) -> None:
    """`--limit` must be a positive number of tasks."""
    done = _check("builtin", "--limit", limit)
    assert done.returncode == 2 and "expected a positive number" in done.stderr


CALC = {"calc/__init__.py": "", "calc/core.py": "def add(a, b):\n    return a - b\n"}
CALC_TESTS = {"tests/test_calc.py": "import unittest\n\nfrom calc.core import add\n\n\nclass Calc(unittest.TestCase):\n"
                                    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
                                    "    def test_zero(self):\n        self.assertEqual(add(0, 0), 0)\n"}


def _repo_row(task_id: str, **over: object) -> dict[str, object]:
    return {"task_id": task_id, "instruction": "Make add add.", "files": CALC, "hidden_tests": CALC_TESTS,
            "solution": {"calc/core.py": "def add(a, b):\n    return a + b\n"}, "level": 1, "tags": ["calc"], **over}


def test_repository_task_files_are_checked_through_sandbox_sessions(tmp_path: Path) -> None:
    """A repository task file: the sound task counts for both copies; a solution that does not fix it is listed
    as a failed reference, a task whose untouched repository already passes as a broken copy not rejected, and
    a solution adding a module the tests import passes; `rlbus tasks check repo --limit 2` checks built-ins."""
    rows = [_repo_row("sound"),
            _repo_row("unfixed", solution={"calc/core.py": "def add(a, b):\n    return a * b\n"}),
            _repo_row("already", files={**CALC, "calc/core.py": "def add(a, b):\n    return a + b\n"}),
            _repo_row("added", files={"calc/__init__.py": ""}, stdlib_under_test=[], timeout_s=20,
                      solution={"calc/core.py": "def add(a, b):\n    return a + b\n"})]
    path = tmp_path / "repos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = _check(str(path), "--pool", "2")
    assert done.returncode == 1, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert set(report) == KEYS and (report["tasks"], report["reference_passed"], report["broken_rejected"]) == (4, 3, 3)
    assert [(e["task_id"], e["copy"], e["status"]) for e in report["exceptions"]] == [
        ("unfixed", "reference", "failed"), ("already", "broken", "passed")]
    assert report["exceptions"][0]["detail"].startswith("1/2 tests passed")
    built_in = _check("repo", "--limit", "2")
    assert built_in.returncode == 0, built_in.stderr[-2000:]
    assert json.loads(built_in.stdout)["reference_passed"] == 2


@pytest.mark.parametrize(("row", "key"), [
    ({"files": {"../outside.py": "x = 1\n"}}, "files"),
    ({"hidden_tests": {"/abs/test_x.py": ""}}, "hidden_tests"),
    ({"solution": {"calc/core.py": 12}}, "solution"),
    ({"instruction": None}, "instruction"),
    ({"stdlib_under_test": "textwrap"}, "stdlib_under_test"),
    ({"timeout_s": -1}, "timeout_s"),
    ({"hidden_test": {}}, "hidden_test"),
])
def test_a_bad_repository_row_is_refused_naming_file_line_and_key(tmp_path: Path, row: dict[str, object],
                                                                  key: str) -> None:
    """A row with a path outside the repository, non-text, a wrong type or an unknown key is refused in one line
    naming the file, the line and the key; exit 2, nothing graded."""
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_repo_row("ok")) + "\n\n" + json.dumps(_repo_row("bad", **row)) + "\n")
    done = _check(str(path))
    assert done.returncode == 2 and f"bad.jsonl:3: key '{key}'" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "graded" not in done.stderr
