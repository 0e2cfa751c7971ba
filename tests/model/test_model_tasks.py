"""Coding tasks: deterministic generation, held-out disjointness, canonical solutions pass, wrong ones fail."""

from __future__ import annotations

import ast
import itertools
import random

from rlbus.model.tasks.builtin import EVAL_POOL, N_SHOWN, HiddenTest, Task, eval_tasks, make_task, train_tasks
from rlbus.model.tasks.grading import grade_many


def test_generation_is_deterministic() -> None:
    """The same seed gives the same tasks; another seed gives other prompts."""
    assert eval_tasks(3, 50) == eval_tasks(3, 50)
    assert list(itertools.islice(train_tasks(3), 50)) == list(itertools.islice(train_tasks(3), 50))
    assert {t.prompt for t in eval_tasks(3, 50)}.isdisjoint({t.prompt for t in eval_tasks(4, 50)})


def test_held_out_set_is_disjoint_from_training() -> None:
    """>= 200 distinct held-out prompts, none of whose hashes appears among 5000 training tasks."""
    held_out = eval_tasks(0, 200)
    hashes = {t.prompt_hash for t in held_out}
    assert len(held_out) == len(hashes) == 200
    train = list(itertools.islice(train_tasks(0), 5000))
    assert not hashes & {t.prompt_hash for t in train}
    pool = {t.prompt_hash for t in eval_tasks(0, EVAL_POOL)}
    assert not pool & {t.prompt_hash for t in train}
    other_eval = {t.prompt_hash for t in eval_tasks(7, 200)}
    assert not other_eval & {t.prompt_hash for t in itertools.islice(train_tasks(0, eval_seed=7), 2000)}


def test_every_family_is_present() -> None:
    """The held-out set covers int/str/list pipelines of 1-3 steps and the branch family."""
    kinds = {(t.family, t.level) for t in eval_tasks(0, 200)}
    assert kinds == {(f, n) for f in ("int", "str", "list") for n in (1, 2, 3)} | {("branch", 1)}


def test_prompt_shows_the_first_tests() -> None:
    """The docstring's examples are the first N_SHOWN hidden tests, written as f(arg) == result."""
    for task in eval_tasks(0, 20):
        for test in task.tests[:N_SHOWN]:
            (arg,) = ast.literal_eval(test.args)
            assert f"f({arg!r}) == {test.expected}" in task.prompt
        assert task.prompt.startswith("def f(") and task.prompt.endswith('"""\n')


def test_canonical_program_matches_a_hand_check() -> None:
    """prompt + solution is a runnable function whose tests agree with Python itself."""
    task = make_task(random.Random("hand-check"), "t0")
    namespace: dict[str, object] = {}
    exec(task.prompt + task.solution, namespace)
    fn = namespace["f"]
    assert callable(fn)
    for test in task.tests:
        assert fn(*ast.literal_eval(test.args)) == ast.literal_eval(test.expected)


def test_canonical_solutions_pass() -> None:
    """All 200 held-out and 100 training canonical solutions pass their hidden tests in one batch."""
    tasks = eval_tasks(0, 200) + list(itertools.islice(train_tasks(0), 100))
    results = grade_many([(t, t.solution) for t in tasks])
    assert [r.status for r in results] == ["passed"] * len(tasks)
    assert all(r.n_passed == r.n_tests == 6 for r in results)


def test_wrong_solutions_fail() -> None:
    """Returning the input unchanged, a constant, or another task's solution fails (no constant tasks)."""
    tasks = eval_tasks(0, 100)
    pairs: list[tuple[Task, str]] = []
    for task in tasks:
        var = task.prompt[len("def f("):task.prompt.index(")")]
        pairs += [(task, f"    return {var}\n"), (task, "    return 0\n")]
    results = grade_many(pairs)
    assert not any(r.passed for r in results)
    swapped = grade_many([(a, b.solution) for a, b in itertools.pairwise(tasks)
                          if a.solution != b.solution])
    assert sum(r.passed for r in swapped) <= 2  # only an accidentally equivalent pair may pass


def test_task_program_joins_prompt_and_body() -> None:
    """A body completion runs after the prompt's header; a full definition runs as is."""
    task = Task("t", "int", 1, 'def f(x):\n    """Add 2."""\n', "f", "    x = x + 2\n    return x\n",
                (HiddenTest("(1,)", "3"),))
    assert task.program("    return x\n") == 'def f(x):\n    """Add 2."""\n    return x\n'
    assert task.program("def f(x):\n    return 3\n") == "def f(x):\n    return 3\n"


def test_verifier_spec_round_trip() -> None:
    """A task shipped as prompt + verifier spec (str -> str) grades the same, without its solution."""
    task = eval_tasks(0, 1)[0]
    spec = task.verifier_spec()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in spec.items())
    rebuilt = Task.from_spec(task.task_id, task.prompt, spec)
    assert rebuilt.tests == task.tests and rebuilt.entry_point == "f" and rebuilt.solution == ""
    assert [r.passed for r in grade_many([(rebuilt, task.solution), (rebuilt, "    return 0\n")])] == [True, False]
