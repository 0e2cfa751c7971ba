"""The task library behind the built-in repository tasks (model/tasks/library/, model/tasks/changes.py): its own
tests pass on it in a fresh interpreter, the mutators and signature reorders give at least 500 distinct
(function, change) pairs its tests catch, results are compared by exact type, and the `train` / `heldout` split
goes by function, for the built-in tasks and for task files."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.model.tasks.changes import (
    caught,
    exact,
    library_files,
    library_functions,
    qualified,
    signature_changes,
    single_changes,
    split_of,
)
from rlbus.model.tasks.mutators import KINDS
from rlbus.model.tasks.repo import HIDDEN_TEST, hidden_tests, repo_task
from rlbus.model.tasks.sources import (
    TaskSourceError,
    held_out_functions,
    held_out_hashes,
    load_repo_tasks,
)


def test_the_library_passes_its_own_tests_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """The hidden test file of the whole library, run by unittest in another interpreter on the library as
    written, passes every test (the expected values computed here are what the library gives there); one
    function broken by hand fails its tests there."""
    for path, text in library_files().items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    (tmp_path / HIDDEN_TEST).write_text(hidden_tests())
    run = subprocess.run([sys.executable, "-m", "unittest", "-q", "test_hidden"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "OK" in run.stderr, run.stderr[-2000:]
    text = tmp_path / "toolkit" / "text.py"
    text.write_text(text.read_text().replace('return "-".join(words)', 'return "_".join(words)'))
    run = subprocess.run([sys.executable, "-m", "unittest", "-q", "test_hidden"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and "test_slugify_0" in run.stderr and "should be 'hello-world'" in run.stderr


def test_at_least_500_distinct_function_change_pairs_are_caught_by_the_tests() -> None:
    """Over every library function in turn (one change of each per round) and every signature reorder, distinct
    (function, changed files) pairs whose test outcomes differ from the library's reach 500, spread over more than
    50 functions and every mutator kind; no sandbox is involved (the library runs here)."""
    pairs: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    kinds: set[str] = set()
    for change in signature_changes():
        if caught(change):
            pairs.add((change.function, change.files))
            kinds.add(change.kind)
    streams = [single_changes(f) for f in library_functions()]
    for change in itertools.chain.from_iterable(itertools.zip_longest(*streams)):
        if len(pairs) >= 500 and kinds >= {*KINDS, "signature"}:
            break
        if change is not None and (change.function, change.files) not in pairs and caught(change):
            pairs.add((change.function, change.files))
            kinds.add(change.kind)
    assert len(pairs) >= 500
    assert len({f for f, _ in pairs}) > 50 and kinds == {*KINDS, "signature"}


def test_results_are_compared_by_exact_builtin_type() -> None:
    """`exact` is the plain repr of plain values and refuses an always-equal object or a subclass of a built-in
    type; the hidden tests compare through it."""
    class AlwaysEqual:
        def __eq__(self, other: object) -> bool:
            return True

    class Text(str):
        pass

    assert exact([1, (2,), {"a": None}, 1.5, True]) == repr([1, (2,), {"a": None}, 1.5, True])
    for value in (AlwaysEqual(), Text("x"), [Text("x")], {1: AlwaysEqual()}):
        with pytest.raises(AssertionError, match="not a plain built-in value"):
            exact(value)
    assert "self.assertEqual(exact(slugify('Hello, World!')), \"'hello-world'\"" in hidden_tests()


def test_the_builtin_split_goes_by_function_and_training_skips_the_held_out_functions() -> None:
    """About a fifth of the library's functions are held out (by the hash of the qualified name); `repo:train`
    and `repo:heldout` tasks share no function and each is of its split; `held_out_functions` of a `:heldout`
    source is exactly the held-out functions, so no training task of `repo:train` is about one, nor has the
    prompt of a held-out task."""
    held = {qualified(f) for f in library_functions() if split_of(qualified(f)) == "heldout"}
    assert 0.1 < len(held) / len(library_functions()) < 0.35
    assert held_out_functions("repo:heldout") == held and held_out_functions("repo") == frozenset()
    train, heldout = load_repo_tasks("repo:train", seed=3, n=45), load_repo_tasks("repo:heldout", seed=3, n=15)
    assert {t.function for t in heldout} <= held and not {t.function for t in train} & held
    assert {t.level for t in heldout} == {t.level for t in train} == {1, 2, 3}
    assert not {t.prompt_hash for t in train} & {t.prompt_hash for t in heldout}
    assert repo_task(heldout[0].level, int(heldout[0].task_id.rsplit("-", 1)[1])) == heldout[0]


def _row(task_id: str, function: str | None) -> dict[str, object]:
    row: dict[str, object] = {"task_id": task_id, "instruction": "fix it", "files": {"m.py": "X = 1\n"},
                              "hidden_tests": {"test_m.py": "import unittest\n"}, "solution": {"m.py": "X = 2\n"}}
    return row if function is None else {**row, "function": function}


def test_a_task_file_splits_by_its_rows_function(tmp_path: Path) -> None:
    """`FILE:train` and `FILE:heldout` hold the rows of each split by their `function` (tasks of one function
    together, never in both), their union the file; the evaluator's `FILE:heldout` prompts are the hashes
    training skips; a split of a file with a row naming no function is refused naming the task."""
    functions = [f"mod.f{i}" for i in range(30)]
    path = tmp_path / "made.jsonl"
    path.write_text("".join(json.dumps(_row(f"t{i}-{k}", f)) + "\n" for i, f in enumerate(functions) for k in range(2)))
    whole = load_repo_tasks(str(path), n=1000)
    train, heldout = (load_repo_tasks(f"{path}:{s}", n=1000) for s in ("train", "heldout"))
    assert heldout and train and len(train) + len(heldout) == len(whole) == 60
    assert not {t.function for t in train} & {t.function for t in heldout}
    assert all(split_of(t.function) == "heldout" for t in heldout)
    assert held_out_hashes(f"{path}:heldout") == {t.prompt_hash for t in heldout}
    assert held_out_functions(f"{path}:heldout") == {t.function for t in heldout}
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps(_row("plain", None)) + "\n")
    assert len(load_repo_tasks(str(bare))) == 1
    with pytest.raises(TaskSourceError, match="'plain' names no function"):
        load_repo_tasks(f"{bare}:heldout")


def test_the_pretraining_corpus_refuses_the_code_of_held_out_library_functions() -> None:
    """A source file holding a held-out library function's code (reflowed) is refused by the corpus's
    decontamination; one holding only training functions passes."""
    from rlbus.model.tasks.builtin import eval_tasks
    from rlbus.model.tasks.changes import function_texts
    from rlbus.model.training.corpus import Decontaminator

    clean = Decontaminator(eval_tasks(0, 5))
    lines = {f: library_files()[p].splitlines(keepends=True)[a - 1:b] for f, (p, a, b) in function_texts().items()}
    held = [f for f in library_functions() if split_of(qualified(f)) == "heldout"]
    train = [f for f in library_functions() if split_of(qualified(f)) == "train"]
    assert not clean.clean("import os\n\n" + "".join(lines[held[0]]).replace("\n    ", "\n        ") + "\nX = 1\n")
    assert clean.clean("".join(line for f in train for line in lines[f]))
