"""Built-in repository tasks: deterministic from a seed, in levels, rebuilt from their id or verifier spec, a
reference edit that changes only what it must, an instruction that says what fails and never where (but at
level 1) or how; and, through the real sandbox (`rlbus tasks check`'s machinery), hidden tests that pass on
reference solutions and fail on repositories as given."""

from __future__ import annotations

import msgspec
import pytest

from rlbus.model.tasks.changes import library_files
from rlbus.model.tasks.mutators import KINDS
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
    assert len({t.prompt_hash for t in TASKS}) == len({(t.level, tuple(sorted(t.files.items()))) for t in TASKS}) > 20
    with pytest.raises(ValueError, match="verifier kind"):
        RepoTask.from_spec({"kind": "rlbus-task-v1", "task": "{}"})
    broken = msgspec.json.encode({**msgspec.to_builtins(TASKS[0]), "files": [1]}).decode()
    with pytest.raises(ValueError, match=r"\$\.files"):
        RepoTask.from_spec({**TASKS[0].verifier_spec(), "task": broken})
    with pytest.raises(ValueError, match="level 4"):
        repo_task(4, 0)


def test_reference_edits_touch_what_each_level_says() -> None:
    """Levels 1 and 2 change one file, level 3 several (a signature and its callers); only level 1's instruction
    names a file, and it is the changed one. The instruction names the broken function or a failing test of it,
    never the change; the reference is small edit_file calls that rebuild the solution; the repository is the
    library with that function's file(s) changed."""
    for task in TASKS:
        changed = sorted(p for p in task.solution if task.solution[p] != task.files.get(p))
        assert HIDDEN_TEST not in task.files and set(task.files) == set(task.solution)
        assert (len(changed) == 1) if task.level in (1, 2) else (len(changed) >= 2), task.task_id
        named = [p for p in task.files if p in task.instruction]
        assert named == (changed if task.level == 1 else []), task.task_id
        name = task.function.rpartition(".")[2]
        assert task.function.startswith("toolkit.") and task.tags[0] in (*KINDS, "signature")
        assert f"`{name}" in task.instruction or "should be" in task.instruction, task.task_id
        assert all(c.name == "edit_file" and len(c.arguments["old"]) < 400 for c in task.reference), task.task_id
        files = dict(task.files)
        for call in task.reference:
            files = apply_edit(files, call)
        assert files == task.solution == {**library_files(), "README.md": task.files["README.md"]}


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
    """`repo` cycles the levels, `repo:LEVEL` keeps one, either with a split; a bad level or a function loader call
    is refused."""
    assert [t.level for t in load_repo_tasks("repo", n=6)] == [1, 2, 3, 1, 2, 3]
    assert {t.level for t in load_repo_tasks("repo:2", n=4)} == {2}
    assert [t.level for t in load_repo_tasks("repo:heldout", n=3)] == [1, 2, 3]
    assert {t.level for t in load_repo_tasks("repo:3:train", n=3)} == {3}
    with pytest.raises(TaskSourceError, match="level must be one of"):
        load_repo_tasks("repo:9")
    with pytest.raises(TaskSourceError, match="level must be one of"):
        load_repo_tasks("repo:test")
    with pytest.raises(TaskSourceError, match="load_repo_tasks"):
        load_tasks("repo:1")


def test_hidden_tests_pass_on_references_and_fail_on_repositories_in_the_sandbox() -> None:
    """`rlbus tasks check`'s machinery (a real sandbox supervisor on its own nats-server, the grade runner in a
    session holding the repository) on two tasks of each level, one of them held out: every reference passes and
    every repository as given fails; so does a solved repository whose function returns an always-equal string
    subclass (the hidden tests compare exact built-in types)."""
    import anyio

    from rlbus.ops.tasks import check_repo_tasks

    tasks = [*load_repo_tasks("repo:train", seed=1, n=3), *load_repo_tasks("repo:heldout", seed=1, n=3)]
    assert len({t.task_id for t in tasks}) == 6
    text = next(t for t in tasks if "def test_slugify_0(" in t.hidden_tests[HIDDEN_TEST])
    fooled = text.solution["toolkit/text.py"] + (
        "\n\nclass _Same(str):\n    def __eq__(self, other):\n        return True\n\n    __hash__ = str.__hash__\n\n\n"
        "_slugify = slugify\n\n\ndef slugify(title):\n    return _Same(_slugify(title))\n")
    tasks.append(msgspec.structs.replace(text, task_id="always-equal", files={**text.solution, "toolkit/text.py": fooled}))
    report = anyio.run(check_repo_tasks, tasks, 2, backend="asyncio")
    assert report["reference_passed"] == report["broken_rejected"] == 7, report["exceptions"]
