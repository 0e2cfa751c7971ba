"""Built-in repository tasks: the task library (model/tasks/library/, the `toolkit` package) with one function
broken, to fix.

- Owns: `RepoTask` (files, instruction, hidden tests, how they are graded, a reference edit as tool calls, the
  function it breaks), the built-in tasks `repo_task` / `repo_tasks` (deterministic from a seed, in `LEVELS`, of
  one split or both), their hidden test file (`hidden_tests`), `apply_edit` (a write_file or edit_file call on a
  dict of files, as the sandbox would do it) and `reference_of`.
- Guarantee: every built-in task's hidden tests pass on its reference solution and fail on its repository as
  given; `task_id` `repo-L<level>-<seed>` rebuilds the task; its instruction says what fails, never where or why.
- Does not: change the library or run its tests here (model/tasks/changes.py), run anything in the sandbox, or
  serve these tasks (model/env/agentic.py).
"""

from __future__ import annotations

import ast
import difflib
import functools
import random
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Final

import msgspec

from rlbus.model.tasks.builtin import prompt_hash
from rlbus.model.tasks.changes import (
    EXACT,
    MODULES,
    PACKAGE,
    SPLITS,
    Change,
    Split,
    callers,
    calls_of,
    caught,
    function_texts,
    library_files,
    library_functions,
    module_sites,
    original_outcomes,
    path_of,
    qualified,
    signature_changes,
    site_change,
    split_of,
)
from rlbus.model.tasks.mutators import KINDS, Site
from rlbus.model.tasks.repo_grade import DEFAULT_COMMAND
from rlbus.model.tools.calls import ToolCall

LEVELS: Final = (1, 2, 3)
HIDDEN_TEST: Final = "test_hidden.py"
"""The hidden tests' file, written at the workspace root of the grading copy only."""
VERIFIER_KIND: Final = "rlbus-repo-task-v1"
"""`Task.verifier["kind"]` of a repository task; `Task.verifier["task"]` holds it as JSON."""
_ID: Final = re.compile(r"repo-L([0-9]+)-([0-9]+)")


class RepoTask(msgspec.Struct, frozen=True, kw_only=True):
    """One repository task. `files` is the repository (path -> text), `hidden_tests` the files the grade writes
    last into a fresh copy of the final workspace; `test_command` "" (the default) runs their `test*.py` files under
    the grade runner (a per-test report), another command is judged by its exit code. `stdlib_under_test` names
    standard-library modules the repository's own files replace while grading; `timeout_s` caps the grade (None:
    the sandbox's limit). `reference` is an edit that solves it (write_file / edit_file calls), `solution` the
    changed files after it."""

    task_id: str
    level: int
    instruction: str
    files: dict[str, str]
    hidden_tests: dict[str, str]
    test_command: str = DEFAULT_COMMAND
    reference: tuple[ToolCall, ...] = ()
    solution: dict[str, str] = {}
    stdlib_under_test: tuple[str, ...] = ()
    timeout_s: float | None = None
    tags: tuple[str, ...] = ()
    function: str = ""
    """The qualified name of the function the task breaks (`toolkit.text.slugify`, `textwrap.TextWrapper.fill`):
    what `split_of` splits by; "" when unknown."""

    @property
    def prompt(self) -> str:
        """The instruction and every file with its path: what identifies the task (its prompt hash)."""
        return f"{self.instruction}\n\n" + "".join(f"--- {path}\n{self.files[path]}" for path in sorted(self.files))

    @property
    def prompt_hash(self) -> str:
        return prompt_hash(self.prompt)

    def verifier_spec(self) -> dict[str, str]:
        """The task as the `Task` message's verifier map: `{"kind": VERIFIER_KIND, "task": <JSON>}`, the JSON
        holding every field but the reference and its solution."""
        shown = msgspec.structs.replace(self, reference=(), solution={})
        return {"kind": VERIFIER_KIND, "task": msgspec.json.encode(shown).decode()}

    @classmethod
    def from_spec(cls, spec: Mapping[str, str]) -> RepoTask:
        """Rebuild a task from `verifier_spec()`.

        :raises ValueError: the spec is not a repository task's: the kind, or what is wrong in its JSON (with
            its path, such as `$.files`).
        """
        if spec.get("kind") != VERIFIER_KIND or "task" not in spec:
            raise ValueError(f"verifier kind {spec.get('kind')!r} is not {VERIFIER_KIND!r} with a 'task'")
        try:
            return msgspec.json.decode(spec["task"], type=cls)
        except msgspec.DecodeError as err:
            raise ValueError(f"repository task verifier: {err}") from None


# ---- editing ---------------------------------------------------------------------------------------------
class EditError(ValueError):
    """An edit that cannot be applied: the message is what the policy is told."""


def apply_edit(files: Mapping[str, str], call: ToolCall) -> dict[str, str]:
    """`files` after a write_file or edit_file call (edit_file: `old` must occur exactly once).

    :raises EditError: edit_file on a missing file or with `old` absent or repeated; another tool.
    """
    out = dict(files)
    args = call.arguments
    match call.name:
        case "write_file":
            out[args["path"]] = args["content"]
        case "edit_file":
            path, old = args["path"], args["old"]
            if path not in out:
                raise EditError(f"no such file: {path}")
            found = out[path].count(old)
            if found != 1:
                raise EditError(f"{path}: the text to replace occurs {found} times; it must occur exactly once")
            out[path] = out[path].replace(old, args["new"], 1)
        case other:
            raise EditError(f"{other} does not edit files")
    return out


# ---- the pieces ------------------------------------------------------------------------------------------
README: Final = (f"# {PACKAGE}\n\nSmall documented utilities, one module each: "
                 + ", ".join(f"`{PACKAGE}.{m}`" for m in MODULES) + ".\n")
_SINGLE_KINDS: Final = {1: tuple(k for k in KINDS if k != "deletion"), 2: KINDS}
"""The mutator kinds of a level's one-file changes (level 3 reorders a signature with its callers)."""
SHOWN_CHARS: Final = 300
"""The most characters of a wrong result or an exception's message an instruction shows."""
_HEADER: Final = f'"""The hidden tests of the {PACKAGE} package: each result compared by exact type and value."""\n'


def tested_functions(paths: Iterable[str]) -> tuple[str, ...]:
    """The functions a task's hidden tests test: every function of the files `paths` and every function that calls
    one of them (through any chain of calls), in library order."""
    modules = {p.removeprefix(f"{PACKAGE}/").removesuffix(".py") for p in paths}
    own = [f for f in library_functions() if f.partition(".")[0] in modules]
    reached = set(own).union(*(callers()[f] for f in own))
    return tuple(f for f in library_functions() if f in reached)


def hidden_tests(tested: Sequence[str] | None = None) -> str:
    """The unittest file of the `tested` functions (None: the whole library): one test per call of
    `model/tasks/library_tests.py`, named `test_<function>_<i>`, comparing the result's `exact` repr to the
    library's own."""
    tested = library_functions() if tested is None else tested
    want = original_outcomes()
    by_module: dict[str, list[str]] = {}
    for function in tested:
        module, _, name = function.partition(".")
        by_module.setdefault(module, []).append(name)
    imports = "".join(f"from {PACKAGE}.{m} import {', '.join(sorted(names))}\n" for m, names in by_module.items())
    body = []
    for function in tested:
        for i, call in enumerate(calls_of(function)):
            value = want[call].removeprefix("= ")
            body.append(f"    def {_test_name(function, i)}(self):\n"
                        f"        self.assertEqual(exact({call}), {value!r}, {f'{call} should be {value}'!r})\n")
    return f"{_HEADER}\nimport unittest\n\n{imports}\n\n{EXACT}\n\nclass HiddenTests(unittest.TestCase):\n" + "\n".join(body)


def _test_name(function: str, i: int) -> str:
    return f"test_{function.rpartition('.')[2]}_{i}"


def _test_id(call: str) -> str:
    """The grade runner's id of the test of `call`."""
    for function in library_functions():
        calls = calls_of(function)
        if call in calls:
            return f"{HIDDEN_TEST.removesuffix('.py')}.HiddenTests.{_test_name(function, calls.index(call))}"
    raise KeyError(call)


def _symptom(call: str, want: str, found: str) -> str:
    """What the failing test of `call` reports, as the grade runner shows it (the assertion's own message, or
    what was raised)."""
    value, got = want.removeprefix("= "), found[2:]
    got = got if len(got) <= SHOWN_CHARS else got[:SHOWN_CHARS] + " ..."
    if found.startswith("= "):
        return f"AssertionError: {call} should be {value} (it is {got})"
    return f"{got}\n(raised by {call}, which should be {value})"


def _instruction(change: Change, level: int, failing: Mapping[str, tuple[str, str]]) -> str:
    """The instruction: what the failing tests report (level 1 also names the module), or for a removed body, the
    function's signature and docstring. Never the line or the change."""
    n = len(failing)
    count = f"{n} of the package's hidden tests fail" if n > 1 else "One of the package's hidden tests fails"
    where = f" The bug is in `{path_of(change.function.partition('.')[0])}`." if level == 1 else ""
    if change.kind == "deletion":
        path = function_texts()[change.function][0]
        node = ast.parse(library_files()[path]).body
        fn = next(d for d in node if isinstance(d, ast.FunctionDef) and d.name == change.function.rpartition(".")[2])
        doc = ast.get_docstring(fn) or ""
        return (f"`{fn.name}({ast.unparse(fn.args)})` raises NotImplementedError: its body is missing, and {count[0].lower()}"
                f"{count[1:]}.{where} Implement it as its docstring says:\n\n    \"\"\"{doc}\"\"\"\n\n"
                f"The tests are not part of the repository.\n")
    own = [c for c in calls_of(change.function) if c in failing]
    first = (own or list(failing))[0]
    symptom = "".join(f"    {line}\n" for line in _symptom(first, *failing[first]).splitlines())
    lead = "The first of them" if n > 1 else "It"
    name = first.partition("(")[0]
    return (f"{count}.{where} {lead}, `{_test_id(first)}` (a test of `{name}`), reports:\n\n{symptom}\nFix the "
            f"package so that every function does what its docstring says. The tests are not part of the "
            f"repository.\n")


def _edit_calls(files: Mapping[str, str], solution: Mapping[str, str]) -> tuple[ToolCall, ...]:
    """The solution as edit_file calls: one per changed block of lines, top to bottom, each `old` widened by
    unchanged lines (never into another block) until it occurs once in the file; one write_file for a file where
    that cannot be done."""
    calls: list[ToolCall] = []
    for path in sorted(p for p in solution if files.get(p) != solution[p]):
        before, after = files.get(path, ""), solution[path]
        a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
        blocks = [op[1:] for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
        edits: list[ToolCall] = []
        current = before
        for k, (i1, i2, j1, j2) in enumerate(blocks):
            floor = blocks[k - 1][1] if k else 0
            ceiling = blocks[k + 1][0] if k + 1 < len(blocks) else len(a)
            lo, hi = i1, i2
            while not (old := "".join(a[lo:hi])) or current.count(old) != 1:
                if (lo, hi) == (floor, ceiling):
                    break
                lo, hi = max(floor, lo - 1), min(ceiling, hi + 1)
            if not old or current.count(old) != 1:
                break
            call = ToolCall("edit_file", {"path": path, "old": old, "new": "".join(a[lo:i1] + b[j1:j2] + a[i2:hi])})
            current = apply_edit({path: current}, call)[path]
            edits.append(call)
        calls += edits if current == after else [ToolCall("write_file", {"path": path, "content": after})]
    return tuple(calls)


@functools.cache
def _level_functions(level: int) -> tuple[str, ...]:
    """The library functions a task of `level` can be about."""
    if level == 3:
        return tuple(dict.fromkeys(c.function for c in signature_changes()))
    return tuple(f for f in library_functions() if any(s.kind in _SINGLE_KINDS[level] for s in module_sites()[f]))


def _function_of(level: int, seed: int) -> tuple[random.Random, str]:
    rng = random.Random(f"repo:{level}:{seed}")
    return rng, rng.choice(_level_functions(level))


def _change_of(level: int, seed: int) -> tuple[Change, dict[str, tuple[str, str]]]:
    """The change of the task of `level` drawn from `seed`, and the test calls it fails: the function first, then
    (levels 1, 2) a kind among those it has and a site of that kind, drawn again until the tests catch it."""
    rng, function = _function_of(level, seed)
    if level == 3:
        options = [c for c in signature_changes() if c.function == function]
        while True:
            change = rng.choice(options)
            if failing := caught(change):
                return change, failing
    by_kind: dict[str, list[Site]] = {}
    for site in module_sites()[function]:
        if site.kind in _SINGLE_KINDS[level]:
            by_kind.setdefault(site.kind, []).append(site)
    for _ in range(1000):
        kind = rng.choice(sorted(by_kind))
        change = site_change(function, rng.choice(by_kind[kind]))
        if change is not None and (failing := caught(change)):
            return change, failing
    raise AssertionError(f"no change of {function} at level {level} is caught by its tests")    # a library defect


def repo_task(level: int, seed: int) -> RepoTask:
    """The task of `level` drawn from `seed` (the same every time): one function of the library
    (model/tasks/library/, the repository's `toolkit` package) broken by a change its hidden tests catch.

    Levels:
    1. one change of one function (an operator, a number, a bound, a name, an argument order, a condition, a
       dropped statement, a return of None: model/tasks/mutators.py), in one file; the instruction names the file;
    2. the same changes or a function's body removed, in one file the instruction does not name;
    3. a function's parameters reordered together with every call of it, in several files (the package works as
       before; the function's own tests, which use its documented order, fail): the fix touches each file.
    The instruction says what the first failing test reports (its id and assertion message) or, for a removed
    body, the function's signature and docstring; never the line or the change. The hidden tests
    (`test_hidden.py`, `hidden_tests`) test every function of the changed files and every function that calls one
    of them (`tested_functions`), comparing each result by exact type and value (`exact`: plain built-in types only, so an object whose `__eq__` is always true fails). A change is
    kept only when a test's outcome differs, run here on the library (model/tasks/changes.py); the tests check a
    set of tasks through the real sandbox. `task_id` is `repo-L<level>-<seed>`, so the id rebuilds the task;
    `function` is the broken function's qualified name (what `split_of` splits by).

    :raises ValueError: `level` is not one of `LEVELS`.
    """
    if level not in LEVELS:
        raise ValueError(f"repository task level {level} is not one of {LEVELS}")
    change, failing = _change_of(level, seed)
    files = {**library_files(), "README.md": README}
    solution = dict(files)
    files.update(change.files)
    reference = _edit_calls(files, solution)
    return RepoTask(task_id=f"repo-L{level}-{seed}", level=level, instruction=_instruction(change, level, failing),
                    files=files, hidden_tests={HIDDEN_TEST: hidden_tests(tested_functions(dict(change.files)))},
                    reference=reference, solution=solution,
                    tags=(change.kind,), function=qualified(change.function))


def repo_task_of_id(task_id: str) -> RepoTask:
    """The task a `repo-L<level>-<seed>` id names.

    :raises ValueError: the id is not of that form, or its level is unknown.
    """
    found = _ID.fullmatch(task_id)
    if not found:
        raise ValueError(f"{task_id!r} is not a repository task id (repo-L<level>-<seed>)")
    return repo_task(int(found.group(1)), int(found.group(2)))


def repo_tasks(seed: int, *, level: int | None = None, split: Split | None = None) -> Iterator[RepoTask]:
    """An endless stream of tasks from `seed`: of `level`, or cycling through `LEVELS` when None; with `split`,
    only tasks whose function `split_of` puts in it (the seeds of the others are passed over).

    :raises ValueError: `split` is not one of `SPLITS`, or no function of `level` is in it.
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    for lv in (LEVELS if level is None else (level,)):
        if split is not None and not any(split_of(qualified(f)) == split for f in _level_functions(lv)):
            raise ValueError(f"no function of level {lv} is in the {split} split")
    n, made = 0, 0
    while True:
        lv = level if level is not None else LEVELS[made % len(LEVELS)]
        task_seed = seed * 1_000_003 + n
        n += 1
        if split is not None and split_of(qualified(_function_of(lv, task_seed)[1])) != split:
            continue
        made += 1
        yield repo_task(lv, task_seed)


def reference_of(files: Mapping[str, str], solution: Mapping[str, str]) -> tuple[ToolCall, ...]:
    """The solution as write_file calls: each of its files that is new or differs from `files`, in path order."""
    return tuple(ToolCall("write_file", {"path": path, "content": text}) for path, text in sorted(solution.items())
                 if files.get(path) != text)
