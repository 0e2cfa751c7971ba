"""The feeder's repository task source: `[feeder] tasks = "repo"` walks the built-in repository tasks (levels in
turn, or one level with "repo:LEVEL", either of one split with ":train") and hands each out with its repository
verifier, skipping the functions and prompts of the evaluator's held-out split; `rlbus validate` refuses an
unknown source, one beside a tasks file, and levels beside it, each naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbus.actors.common.config import REPO_LEVELS, FeederConfig, FeederLaunch
from rlbus.actors.common.feed import listed_tasks, task_sequence, task_source, verifier_for
from rlbus.model.tasks.repo import LEVELS, VERIFIER_KIND, RepoTask, repo_task_of_id
from rlbus.model.tasks.sources import held_out_functions, load_repo_tasks
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import validate

BASE = (Path(__file__).resolve().parents[1] / "topology" / "bad" / "levels_with_tasks_file.toml").read_text().split(
    "[feeder]")[0]


def test_levels_named_for_validation_are_the_tasks_levels() -> None:
    """The levels `rlbus validate` accepts are those of model/tasks/repo.py."""
    assert REPO_LEVELS == LEVELS


@pytest.mark.parametrize(("source", "levels"), [("repo", [1, 2, 3, 1, 2, 3]), ("repo:2", [2] * 6),
                                               ("repo:3:train", [3] * 6)])
def test_repo_source_feeds_repository_tasks_with_their_verifier(source: str, levels: list[int]) -> None:
    """Each task of the sequence is a repository task whose verifier rebuilds it exactly; the saved position names
    the source and seed, so another source or seed never resumes it."""
    config = FeederConfig(tasks=source, seed=5)
    sequence = task_sequence(config, FeederLaunch())
    tasks = [sequence.get(i) for i in range(6)]
    assert all(isinstance(t, RepoTask) for t in tasks)
    assert [t.level for t in tasks] == levels
    assert len({t.task_id for t in tasks}) == 6
    for task in tasks:
        spec = verifier_for(task)
        assert spec["kind"] == VERIFIER_KIND
        assert RepoTask.from_spec(spec).files == repo_task_of_id(task.task_id).files == task.files  # type: ignore
    assert task_source(config) == f"{source}:5" != task_source(FeederConfig(tasks=source, seed=6))


def test_training_skips_the_functions_and_prompts_of_a_held_out_split(tmp_path: Path) -> None:
    """With the evaluator on `repo:heldout`, a feeder of `repo` (same seed) feeds no task of a held-out function
    and no held-out prompt; with the evaluator on `FILE:heldout`, a feeder of the whole file feeds exactly its
    `train` rows."""
    held = load_repo_tasks("repo:heldout", seed=5, n=12)
    sequence = task_sequence(FeederConfig(tasks="repo", seed=5), FeederLaunch(eval_tasks="repo:heldout", eval_seed=5))
    fed = [sequence.get(i) for i in range(40)]
    assert not {t.function for t in fed} & held_out_functions("repo:heldout")  # type: ignore[union-attr]
    assert not {t.prompt_hash for t in fed} & {t.prompt_hash for t in held}
    rows = tmp_path / "tasks.jsonl"
    tasks = load_repo_tasks("repo", seed=2, n=30)
    rows.write_text("".join(json.dumps({"task_id": t.task_id, "instruction": t.instruction, "files": t.files,
                                        "hidden_tests": t.hidden_tests, "solution": t.solution,
                                        "function": t.function}) + "\n" for t in tasks))
    config = FeederConfig(tasks=str(rows), epochs=1)
    listed = task_sequence(config, FeederLaunch(eval_tasks=f"{rows}:heldout"), listed_tasks(config))
    train = [t.task_id for t in load_repo_tasks(f"{rows}:train", n=30)]
    assert listed.end == len(train) < 30 and [listed.get(i).task_id for i in range(len(train))] == train


def test_training_skips_the_prompts_of_the_held_out_builtin_repository_tasks_of_another_seed() -> None:
    """The built-in repository tasks are a finite set of changes that every seed draws again: with the evaluator on
    `repo:3` of seed 1 (4 tasks), a feeder of `repo:3` of seed 0 feeds their prompts within 40 tasks unless it knows
    how many the evaluator holds out (`eval_n`), and then none of them."""
    held = {t.prompt_hash for t in load_repo_tasks("repo:3", seed=1, n=4)}
    config = FeederConfig(tasks="repo:3", seed=0)

    def fed(launch: FeederLaunch) -> set[str]:
        sequence = task_sequence(config, launch)
        return {sequence.get(i).prompt_hash for i in range(40)}

    assert fed(FeederLaunch(eval_tasks="repo:3", eval_seed=1)) & held
    assert not fed(FeederLaunch(eval_tasks="repo:3", eval_seed=1, eval_n=4)) & held


@pytest.mark.parametrize(("feeder", "key", "fragment"), [
    ('tasks = "repo:4"', "feeder.tasks",
     "expected 'builtin', 'humaneval', 'repo' or 'repo:LEVEL' with LEVEL one of 1, 2, 3"),
    ('tasks = "repo:2:test"', "feeder.tasks", "(each may end in :train or :heldout)"),
    ('tasks = "mbpp"', "feeder.tasks", "is not a built-in task source"),
    ('tasks = "repo"\ntasks_file = "tasks.jsonl"', "feeder.tasks", "both name the training tasks"),
    ('tasks = "repo:1"\nlevels = [1]', "feeder.levels", "take their level in feeder.tasks"),
])
def test_validate_refuses_a_bad_repo_source(tmp_path: Path, feeder: str, key: str, fragment: str) -> None:
    """One error, naming the key and what was expected."""
    path = tmp_path / "t.toml"
    path.write_text(f"{BASE}[feeder]\n{feeder}\n")
    topology, problems = validate(path, local_cores=64)
    errors = [p for p in problems if p.severity == "error"]
    assert topology is None and [p.key for p in errors] == [key] and fragment in errors[0].message, problems


def test_validate_warns_when_the_builtin_context_cannot_hold_a_repository_task(tmp_path: Path) -> None:
    """Repository tasks on the built-in policy's default 512-token context: a warning naming [pretrain] max_seq_len;
    none with a 2048-token context."""
    path = tmp_path / "t.toml"
    path.write_text(f'{BASE}[feeder]\ntasks = "repo"\n')
    topology, problems = validate(path, local_cores=64)
    assert topology is not None and [(p.key, p.severity) for p in problems] == [("feeder.tasks", "warning")]
    assert "max_seq_len = 2048" in problems[0].message
    path.write_text(f'{BASE}[feeder]\ntasks = "repo"\n[pretrain]\nmax_seq_len = 2048\n')
    assert validate(path, local_cores=64)[1] == []


def test_agentic_example_validates_clean() -> None:
    """The shipped `agentic` topology feeds the training split of level-1 repository tasks and has no problem."""
    topology, problems = validate(example_path("agentic"), local_cores=64)
    assert topology is not None and topology.feeder.tasks == "repo:1:train" and problems == []
