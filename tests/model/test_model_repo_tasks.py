"""Built-in repository tasks: deterministic from a seed, in levels, rebuilt from their id or verifier spec, a
reference edit that changes only what it must; and, through the real sandbox, hidden tests that pass on every
reference solution and fail on every repository as given."""

from __future__ import annotations

import msgspec
import pytest

from rlbus.model.tasks.repo import (
    HIDDEN_TEST,
    LEVELS,
    EditError,
    RepoTask,
    apply_edit,
    repo_task,
    repo_task_of_id,
)
from rlbus.model.tasks.sources import TaskSourceError, load_repo_tasks, load_tasks
from rlbus.model.tools.calls import ToolCall

TASKS = [repo_task(level, seed) for level in LEVELS for seed in range(8)]


def test_tasks_are_deterministic_and_rebuilt_from_id_and_spec() -> None:
    """The same level and seed give the same task; its id rebuilds it; its verifier spec round-trips the files,
    tests, instruction and command (no reference inside); a bad spec is refused naming what is wrong; seeds give
    different tasks."""
    for task in TASKS:
        assert repo_task(task.level, int(task.task_id.rsplit("-", 1)[1])) == task == repo_task_of_id(task.task_id)
        spec = task.verifier_spec()
        assert task.reference and all(isinstance(v, str) for v in spec.values())
        assert RepoTask.from_spec(spec) == msgspec.structs.replace(task, reference=(), solution={})
    assert len({t.prompt_hash for t in TASKS}) == len(TASKS)
    with pytest.raises(ValueError, match="verifier kind"):
        RepoTask.from_spec({"kind": "rlbus-task-v1", "task": "{}"})
    broken = msgspec.json.encode({**msgspec.to_builtins(TASKS[0]), "files": [1]}).decode()
    with pytest.raises(ValueError, match=r"\$\.files"):
        RepoTask.from_spec({**TASKS[0].verifier_spec(), "task": broken})
    with pytest.raises(ValueError, match="level 4"):
        repo_task(4, 0)


def test_reference_edits_touch_what_each_level_says() -> None:
    """Level 1 and 3 change one line of one module, level 2 adds a function to the module another imports it from;
    the instruction of level 3 names only the caller, in the other module."""
    for task in TASKS:
        changed = sorted(p for p in task.solution if task.solution[p] != task.files.get(p))
        assert len(changed) == 1 and HIDDEN_TEST not in task.files
        before, after = task.files[changed[0]].splitlines(), task.solution[changed[0]].splitlines()
        if task.level in (1, 3):
            assert len(before) == len(after) and sum(a != b for a, b in zip(before, after, strict=True)) == 1
        else:
            assert after[: len(before)] == before and len(after) > len(before)
        if task.level == 3:
            assert changed[0] not in task.instruction and "core.py" in task.instruction


def test_apply_edit_refuses_what_it_cannot_do() -> None:
    """edit_file on a missing file, or with text absent or repeated, is refused with what is wrong."""
    files = {"a.py": "x = 1\nx = 1\n"}
    with pytest.raises(EditError, match="no such file"):
        apply_edit(files, ToolCall("edit_file", {"path": "b.py", "old": "x", "new": "y"}))
    with pytest.raises(EditError, match="occurs 2 times"):
        apply_edit(files, ToolCall("edit_file", {"path": "a.py", "old": "x = 1\n", "new": ""}))
    with pytest.raises(EditError, match="occurs 0 times"):
        apply_edit(files, ToolCall("edit_file", {"path": "a.py", "old": "z", "new": ""}))
    assert apply_edit(files, ToolCall("write_file", {"path": "b.py", "content": "y"}))["b.py"] == "y"


def test_repo_source_names() -> None:
    """`repo` cycles the levels, `repo:LEVEL` keeps one; a bad level or a function loader call is refused."""
    assert [t.level for t in load_repo_tasks("repo", n=6)] == [1, 2, 3, 1, 2, 3]
    assert {t.level for t in load_repo_tasks("repo:2", n=4)} == {2}
    with pytest.raises(TaskSourceError, match="level must be one of"):
        load_repo_tasks("repo:9")
    with pytest.raises(TaskSourceError, match="load_repo_tasks"):
        load_tasks("repo:1")


@pytest.mark.anyio
async def test_hidden_tests_pass_on_references_and_fail_on_repositories_in_the_sandbox() -> None:
    """Through a real sandbox supervisor on its own nats-server, each task's hidden tests (run by the grade runner
    in a session holding the repository) pass on the reference solution and fail on the repository as given."""
    import anyio

    from rlbus.actors.sandbox.config import SandboxConfig
    from rlbus.ops.local_sandbox import local_sandbox
    from rlbus.ops.repo_grading import grade_repository

    verdicts: dict[tuple[str, str], tuple[str, int, int]] = {}
    with anyio.fail_after(240):  # hang guard
        async with local_sandbox("repo-tasks", SandboxConfig(pool_size=2, concurrency=2)) as bus:
            limiter = anyio.CapacityLimiter(2)

            async def one(task: RepoTask, copy: str) -> None:
                files = task.solution if copy == "reference" else task.files
                async with limiter:
                    report = await grade_repository(bus, "hub", files, task.hidden_tests, timeout_s=20.0)
                grade = report.result()
                verdicts[task.task_id, copy] = (report.verdict, grade.n_passed, grade.n_tests)

            async with anyio.create_task_group() as tg:
                for task in TASKS:
                    for copy in ("reference", "given"):
                        tg.start_soon(one, task, copy)
    for task in TASKS:
        status, passed, total = verdicts[task.task_id, "reference"]
        assert (status, passed) == ("passed", total) and total >= 4, (task.task_id, verdicts[task.task_id, "reference"])
        status, passed, total = verdicts[task.task_id, "given"]
        assert status == "failed" and passed < total, (task.task_id, verdicts[task.task_id, "given"])
