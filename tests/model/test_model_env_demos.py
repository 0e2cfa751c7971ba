"""The scripted expert's planning (model/env/demos.py) and the summary text (model/env/summaries.py), with the
tools' answers written here: its edits rebuild the solution, its check names the task's functions, it reacts to a
failing check and its variation comes from the seed."""

from __future__ import annotations

import ast

import pytest

from rlbus.model.env.demos import (
    Expert,
    Observed,
    Step,
    check_command,
    edit_calls,
    probe_cases,
    wrong_version,
)
from rlbus.model.env.summaries import FRESH_HEAD, SUMMARY_HEAD, fresh_context, summary_text
from rlbus.model.tasks.repo import apply_edit, repo_task
from rlbus.model.tools.calls import ToolCall

TASKS = [repo_task(level, seed) for level in (1, 2, 3) for seed in range(4)]


def _answer(call_name: str, *, check_passes: bool) -> str:
    if call_name == "run":
        return "exit code 0\nok   f(1) = 1" if check_passes else "exit code 1\nFAIL f(1) = 2 (expected 1)"
    return "edited" if call_name == "edit_file" else "text"


def _episode(expert: Expert, *, fails_until_edits: int = 1) -> list[Step]:
    """The expert's steps when the check fails until `fails_until_edits` edits have been made."""
    observed: list[Observed] = []
    steps = []
    for _ in range(40):
        step = expert.next_step(observed)
        steps.append(step)
        if step.submits:
            return steps
        for call in step.calls:
            edits = sum(o.call.name in ("edit_file", "write_file") for o in observed)
            observed.append(Observed(call, _answer(call.name, check_passes=edits >= fails_until_edits)))
    raise AssertionError("the expert never submitted")


def test_edit_calls_rebuild_every_solution_from_its_repository() -> None:
    """For built-in tasks of every level, the expert's exact replacements applied in order turn each changed file
    into the solution's, each `old` occurring exactly once when applied."""
    for task in TASKS:
        for path, after in task.solution.items():
            before = task.files.get(path)
            if before is None or before == after:
                continue
            files = {path: before}
            for call in edit_calls(path, before, after):
                files = apply_edit(files, call)
            assert files[path] == after, task.task_id


def test_the_check_calls_the_named_functions_with_the_described_results() -> None:
    """The check script imports the function the instruction names and compares the results the hidden tests'
    messages state; the hidden test file itself is not in it."""
    for task in TASKS:
        command, tells = check_command(task)
        cases = probe_cases(task)
        assert tells and cases, task.task_id
        named = {c[1].partition("(")[0] for c in cases}
        assert all(f"`{name}" in task.instruction for name in named), task.task_id
        assert "assertEqual" not in command and "exact(" not in command
        script = command.split("\n", 1)[1].rsplit("EOF", 1)[0]
        ast.parse(script)


def test_the_expert_lists_reads_checks_edits_checks_and_submits() -> None:
    """Every plan lists the files, reads each file the solution changes before editing it, runs the check before
    and after its edits, and ends with a lone submit."""
    for task in TASKS:
        steps = _episode(Expert(task, seed=3))
        calls = [c for s in steps for c in s.calls]
        names = [c.name for c in calls]
        assert "list_files" in names and names[-1] == "submit" and steps[-1].calls == steps[-1].calls[-1:]
        first_edit = next(i for i, n in enumerate(names) if n in ("edit_file", "write_file"))
        read = {c.arguments["path"] for c in calls[:first_edit] if c.name == "read_file"}
        added = set(task.solution) - set(task.files)
        assert {c.arguments["path"] for c in calls if c.name in ("edit_file", "write_file")} <= read | added
        assert "run" in names[:first_edit] and "run" in names[first_edit:]
        assert all(s.content for s in steps)


@pytest.mark.parametrize("fails_until_edits", [2, 0])
def test_a_wrong_first_edit_is_corrected(fails_until_edits: int) -> None:
    """Over seeds, some episodes make a wrong first edit (text differing from both the repository and the
    solution); whether the check then fails or (missing it) passes, the episode ends on the solution's text."""
    task = repo_task(1, 4)
    (path,) = [p for p in task.solution if task.solution[p] != task.files.get(p)]
    corrected = 0
    for seed in range(30):
        expert = Expert(task, seed)
        steps = _episode(expert, fails_until_edits=fails_until_edits)
        edits = [c for s in steps for c in s.calls if c.name in ("edit_file", "write_file")]
        files = {path: task.files[path]}
        states = []
        for call in edits:
            files = apply_edit(files, call)
            states.append(files[path])
        assert states[-1] == task.solution[path]
        if len(edits) > 1 and states[0] not in (task.files[path], task.solution[path]):
            assert expert.wrong_first
            corrected += 1
    assert 0 < corrected < 30


def test_the_plan_is_the_seed_s_and_seeds_vary_it() -> None:
    """The same task and seed give the same steps; across seeds the first file read, the order and the turn count
    vary."""
    task = repo_task(3, 2)
    assert _episode(Expert(task, 5)) == _episode(Expert(task, 5))
    shapes = {tuple((c.name, c.arguments.get("path")) for s in _episode(Expert(task, seed)) for c in s.calls)
              for seed in range(12)}
    assert len(shapes) >= 4


def test_observations_must_follow_the_plan() -> None:
    """A call the plan did not make, or a step after submit, is refused."""
    task = repo_task(2, 1)
    expert = Expert(task, 0)
    assert expert.next_step([]).calls[0].name != "submit"
    with pytest.raises(ValueError, match="not the expert's"):
        expert.next_step([Observed(ToolCall("submit", {}), "")])
    steps = _episode(expert)
    observed = [Observed(c, _answer(c.name, check_passes=True)) for s in steps for c in s.calls]
    with pytest.raises(ValueError):
        expert.next_step(observed)


def test_wrong_version_changes_the_fixed_function_only() -> None:
    """A wrong fix parses, differs from the repository and the solution, and leaves every other function's text."""
    import random

    task = repo_task(1, 6)
    (path,) = [p for p in task.solution if task.solution[p] != task.files.get(p)]
    wrong = wrong_version(task.files[path], task.solution[path], random.Random(0))
    assert wrong is not None and wrong not in (task.files[path], task.solution[path])
    ast.parse(wrong)
    changed = [a for a, b in zip(wrong.splitlines(), task.solution[path].splitlines(), strict=True) if a != b]
    assert len(changed) == 1


def test_summary_and_fresh_context_text() -> None:
    """A summary lists findings and changes (or says none yet) and the next step; the fresh context is the task
    text, then the summary."""
    text = summary_text(found=["read a.py"], changed=[], next_step="edit a.py")
    assert text.splitlines() == [SUMMARY_HEAD, "- read a.py", "- nothing is changed yet", "Next: edit a.py"]
    fresh = fresh_context("Fix f.", text)
    assert fresh.startswith("Fix f.\n\n" + FRESH_HEAD) and text in fresh
    summary = Expert(repo_task(1, 1), 0).summary([])
    assert summary.startswith(SUMMARY_HEAD) and "Next: " in summary
