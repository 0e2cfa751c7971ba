"""Built-in repository tasks: small generated Python packages with a bug to fix or a function to add.

- Owns: `RepoTask` (files, instruction, hidden tests, how they are graded, a reference edit as tool calls),
  the built-in tasks `repo_task` / `repo_tasks` (deterministic from a seed, in `LEVELS`), `apply_edit` (a
  write_file or edit_file call on a dict of files, as the sandbox would do it) and `reference_of`.
- Guarantee: every built-in task's hidden tests pass on its reference solution and fail on its repository as
  given; `task_id` `repo-L<level>-<seed>` rebuilds the task.
- Does not: run anything (the sandbox) or serve these tasks (model/env/agentic.py).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from rlbus.model.tasks.builtin import prompt_hash
from rlbus.model.tasks.repo_grade import DEFAULT_COMMAND
from rlbus.model.tools.calls import ToolCall

LEVELS: Final = (1, 2, 3)
HIDDEN_TEST: Final = "test_hidden.py"
"""The hidden tests' file, written at the workspace root of the grading copy only."""
VERIFIER_KIND: Final = "rlbus-repo-task-v1"
"""`Task.verifier["kind"]` of a repository task; `Task.verifier["task"]` holds it as JSON."""
_ID: Final = re.compile(r"repo-L([0-9]+)-([0-9]+)")
_PACKAGES: Final = ("inventory", "ledger", "geometry", "textkit", "stats", "schedule", "catalog", "metrics",
                     "billing", "survey", "routing", "library", "weather", "orders", "grades", "playlist")


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
@dataclass(frozen=True, slots=True)
class _Fn:
    """A function of a generated module: its source lines, the line a bug replaces, what it does, test calls."""

    name: str
    params: str
    body: tuple[str, ...]
    bug_line: int
    bug: str
    does: str
    calls: tuple[str, ...]

    def source(self, *, buggy: bool = False) -> str:
        lines = list(self.body)
        if buggy:
            lines[self.bug_line] = self.bug
        return f"def {self.name}({self.params}):\n" + "".join(f"    {line}\n" for line in lines)


def _functions(rng: random.Random) -> list[_Fn]:
    """Every function kind, with constants and test inputs drawn from `rng`."""
    k = rng.randint(2, 9)
    lo, hi = rng.randint(-5, 0), rng.randint(5, 20)
    xs = [rng.randint(-9, 30) for _ in range(rng.randint(4, 7))]
    words = " ".join(rng.sample(["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa"], 3))
    items = [(rng.randint(1, 9), rng.randint(1, 5)) for _ in range(3)]
    return [
        _Fn("clamp", "x, lo, hi", ("return max(lo, min(x, hi))",), 0, "return max(lo, min(x, lo))",
            "limits x to the range lo..hi", (f"{hi + 7}, {lo}, {hi}", f"{lo - 3}, {lo}, {hi}", f"{hi - 1}, {lo}, {hi}")),
        _Fn("mean", "xs", ("return sum(xs) / len(xs)",), 0, "return sum(xs) / (len(xs) + 1)",
            "returns the arithmetic mean of xs", (repr(xs), repr(xs[:2]))),
        _Fn("count_vowels", "s", ('return sum(1 for c in s.lower() if c in "aeiou")',), 0,
            'return sum(1 for c in s.lower() if c in "aeio")', "counts the vowels (a, e, i, o, u) of s",
            (repr(words), repr("Queue Up"))),
        _Fn("is_multiple", "n", (f"return n % {k} == 0",), 0, f"return n % {k} == 1",
            f"tells whether n is a multiple of {k}", (str(k * 3), str(k * 3 + 1), "0")),
        _Fn("scale", "xs", (f"return [x * {k} for x in xs]",), 0, f"return [x + {k} for x in xs]",
            f"multiplies every element of xs by {k}", (repr(xs), "[]")),
        _Fn("total_price", "items", ("return sum(price * qty for price, qty in items)",), 0,
            "return sum(price + qty for price, qty in items)",
            "returns the total of price * qty over the (price, qty) pairs of items", (repr(items),)),
        _Fn("title_words", "s", ('return " ".join(w.capitalize() for w in s.split())',), 0,
            'return " ".join(w.lower() for w in s.split())', "capitalizes every word of s", (repr(words),)),
        _Fn("running_sum", "xs", ("out, total = [], 0", "for x in xs:", "    total += x", "    out.append(total)",
                                  "return out"), 2, "    total = x", "returns the running totals of xs",
            (repr(xs),)),
        _Fn("argmax", "xs", ("return max(range(len(xs)), key=lambda i: xs[i])",), 0,
            "return min(range(len(xs)), key=lambda i: xs[i])", "returns the index of the largest element of xs",
            (repr(xs),)),
        _Fn("count_above", "xs", (f"return sum(1 for x in xs if x > {k})",), 0,
            f"return sum(1 for x in xs if x >= {k})",
            f"counts the elements of xs greater than {k}", (repr(xs), repr([k, k + 1, xs[0]]))),
    ]


def _value(fn: _Fn, call: str, *, buggy: bool = False) -> Any:
    """The result of `fn(call)` (our own generated code, run here to write the expected values)."""
    scope: dict[str, Any] = {}
    exec(fn.source(buggy=buggy), scope)
    return eval(f"{fn.name}({call})", scope)


def _module(doc: str, parts: list[str], imports: str = "") -> str:
    head = f'"""{doc}"""\n\n' + (f"{imports}\n\n\n" if imports else "\n")
    return head + "\n\n".join(parts)


EXACT: Final = '''def exact(value):
    """The repr of a value made only of plain built-in types (exactly those, never a subclass)."""
    kind = type(value)
    if kind is list or kind is tuple:
        return kind.__name__ + "(" + ", ".join(exact(v) for v in value) + ")"
    if kind is dict:
        return "{" + ", ".join(exact(k) + ": " + exact(v) for k, v in value.items()) + "}"
    if kind is int or kind is float or kind is str or kind is bool or value is None:
        return repr(value)
    raise AssertionError(f"a {kind.__qualname__} is not a plain built-in value")
'''
"""The hidden tests' comparison: results are compared as the repr of exact built-in types."""


def exact(value: Any) -> str:
    """`EXACT`'s function, here (the expected side of a hidden test)."""
    scope: dict[str, Any] = {}
    exec(EXACT, scope)
    return scope["exact"](value)  # type: ignore[no-any-return]


def _asserts(*parts: tuple[str, list[str], list[tuple[str, str, Any]]]) -> str:
    """A unittest file from (module, names imported from it, cases): one test per case, each result compared by
    exact type and value."""
    imports = "".join(f"from {module} import {', '.join(sorted(set(names)))}\n" for module, names, _ in parts)
    cases = [case for _, _, part in parts for case in part]
    body = "\n".join(f"    def test_{i}_{name}(self):\n        self.assertEqual(exact({name}({call})), {exact(value)!r}, "
                     f"{f'{name}({call}) should be {value!r}'!r})\n" for i, (name, call, value) in enumerate(cases))
    return f"import unittest\n\n{imports}\n\n{EXACT}\n\nclass HiddenTests(unittest.TestCase):\n{body}"


def _caught(fn: _Fn) -> list[str]:
    """The test calls whose result the bug changes."""
    return [c for c in fn.calls if _value(fn, c) != _value(fn, c, buggy=True)]


@dataclass(frozen=True, slots=True)
class _Draw:
    """What one task is built from: its package, the function the task is about, four others to keep."""

    pkg: str
    target: _Fn
    others: tuple[_Fn, ...]

    @property
    def core(self) -> str:
        return f"{self.pkg}/core.py"

    @property
    def helpers(self) -> str:
        return f"{self.pkg}/helpers.py"

    def kept(self, i: int) -> tuple[str, str, Any]:
        """A test of the `i`-th other function (its first call): an edit must not break it."""
        fn = self.others[i]
        return fn.name, fn.calls[0], _value(fn, fn.calls[0])

    def cases(self) -> list[tuple[str, str, Any]]:
        return [(self.target.name, c, _value(self.target, c)) for c in self.target.calls]


def _one_line_fix(path: str, fn: _Fn) -> ToolCall:
    return ToolCall("edit_file", {"path": path, "old": f"    {fn.bug}\n", "new": f"    {fn.body[fn.bug_line]}\n"})


def _level_1(d: _Draw, rng: random.Random) -> tuple[str, dict[str, str], tuple[ToolCall, ...], str]:
    """A one-line bug in the function the instruction names."""
    where = rng.choice((d.core, d.helpers))
    other = d.helpers if where == d.core else d.core
    o = d.others
    files = {where: _module(f"{d.pkg} functions.", [d.target.source(buggy=True), o[0].source(), o[1].source()]),
             other: _module(f"More {d.pkg} functions.", [o[2].source(), o[3].source()])}
    instruction = (f"`{d.target.name}` in {where} is wrong: it should be the function that {d.target.does}. "
                   "Fix it without changing the other functions.")
    tests = _asserts((_dotted(where), [d.target.name, o[0].name, o[1].name], [*d.cases(), d.kept(0), d.kept(1)]),
                     (_dotted(other), [o[2].name, o[3].name], [d.kept(2), d.kept(3)]))
    return instruction, files, (_one_line_fix(where, d.target),), tests


def _level_2(d: _Draw, rng: random.Random) -> tuple[str, dict[str, str], tuple[ToolCall, ...], str]:
    """A function to add to the helpers module, which the core module already imports and calls."""
    t, o = d.target, d.others
    describe = f"describe_{t.name}"
    user = f"def {describe}(*args):\n    return f\"{t.name}{{args}} = {{{t.name}(*args)!r}}\"\n"
    files = {d.helpers: _module(f"{d.pkg} helpers.", [o[0].source(), o[1].source()]),
             d.core: _module(f"{d.pkg} core functions.", [user, o[2].source()],
                             imports=f"from {d.pkg}.helpers import {t.name}")}
    added = _module(f"{d.pkg} helpers.", [o[0].source(), o[1].source(), t.source()])
    instruction = (f"{d.core} imports `{t.name}` from {d.helpers}, which does not define it yet. Add "
                   f"`{t.name}({t.params})` to {d.helpers}: the function that {t.does}.")
    call = t.calls[0]
    described = (describe, call, f"{t.name}{eval(f'({call},)')!r} = {_value(t, call)!r}")
    tests = _asserts((_dotted(d.helpers), [t.name, o[0].name, o[1].name], [*d.cases(), d.kept(0), d.kept(1)]),
                     (_dotted(d.core), [describe, o[2].name], [described, d.kept(2)]))
    return instruction, files, (ToolCall("write_file", {"path": d.helpers, "content": added}),), tests


def _level_3(d: _Draw, rng: random.Random) -> tuple[str, dict[str, str], tuple[ToolCall, ...], str]:
    """A one-line bug in a helper, reported only through its caller in the core module."""
    t, o = d.target, d.others
    report = f"{t.name}_report"
    caller = f"def {report}(*args):\n    return [{t.name}(*args)]\n"
    files = {d.helpers: _module(f"{d.pkg} helpers.", [o[0].source(), t.source(buggy=True)]),
             d.core: _module(f"{d.pkg} core functions.", [caller, o[1].source()],
                             imports=f"from {d.pkg}.helpers import {t.name}")}
    shown = _caught(t)[0]
    instruction = (f"`{report}({shown})` in {d.core} should give {[_value(t, shown)]!r} (it wraps a function "
                   f"that {t.does}), but it does not. Find the bug and fix it.")
    reports = [(report, c, [_value(t, c)]) for c in t.calls]
    tests = _asserts((_dotted(d.helpers), [t.name, o[0].name], [*d.cases(), d.kept(0)]),
                     (_dotted(d.core), [report, o[1].name], [*reports, d.kept(1)]))
    return instruction, files, (_one_line_fix(d.helpers, t),), tests


_LEVEL_BUILDERS: Final = {1: _level_1, 2: _level_2, 3: _level_3}


def _dotted(path: str) -> str:
    """The module name of a file path: pkg/core.py -> pkg.core."""
    return path.removesuffix(".py").replace("/", ".")


def repo_task(level: int, seed: int) -> RepoTask:
    """The task of `level` drawn from `seed` (the same every time).

    Levels:
    1. a one-line bug in the function the instruction names (one file);
    2. a function to add to one module that another module already imports and calls;
    3. a one-line bug in a helper of one module, reported only through its caller in another module.
    Every task's hidden tests pass on its reference solution and fail on its repository as given, by
    construction (a bug is kept only with a test call whose result it changes; a function not added yet fails
    the import; the tests check a set of tasks through the real sandbox); `task_id` is `repo-L<level>-<seed>`,
    so the id rebuilds the task. The hidden tests are unittest files run by the sandbox's grade runner; they
    compare each result by exact type and value (`exact`: plain built-in types only, so an object whose
    `__eq__` is always true fails).

    :raises ValueError: `level` is not one of `LEVELS`.
    """
    if level not in LEVELS:
        raise ValueError(f"repository task level {level} is not one of {LEVELS}")
    rng = random.Random(f"repo:{level}:{seed}")
    pkg = rng.choice(_PACKAGES)
    while True:  # every kind has test calls its bug changes; redraw should some constants ever hide it
        fns = _functions(rng)
        rng.shuffle(fns)
        if _caught(fns[0]):
            break
    instruction, code, reference, tests = _LEVEL_BUILDERS[level](_Draw(pkg, fns[0], tuple(fns[1:5])), rng)
    files = {f"{pkg}/__init__.py": f'"""The {pkg} package."""\n',
             "README.md": f"# {pkg}\n\nSmall utilities: `{pkg}.core` and `{pkg}.helpers`.\n", **code}
    solution = dict(files)
    for call in reference:
        solution = apply_edit(solution, call)
    return RepoTask(task_id=f"repo-L{level}-{seed}", level=level, instruction=instruction, files=files,
                    hidden_tests={HIDDEN_TEST: tests}, reference=reference, solution=solution)


def repo_task_of_id(task_id: str) -> RepoTask:
    """The task a `repo-L<level>-<seed>` id names.

    :raises ValueError: the id is not of that form, or its level is unknown.
    """
    found = _ID.fullmatch(task_id)
    if not found:
        raise ValueError(f"{task_id!r} is not a repository task id (repo-L<level>-<seed>)")
    return repo_task(int(found.group(1)), int(found.group(2)))


def repo_tasks(seed: int, *, level: int | None = None) -> Iterator[RepoTask]:
    """An endless stream of tasks from `seed`: of `level`, or cycling through `LEVELS` when None."""
    n = 0
    while True:
        lv = level if level is not None else LEVELS[n % len(LEVELS)]
        yield repo_task(lv, seed * 1_000_003 + n)
        n += 1


def reference_of(files: Mapping[str, str], solution: Mapping[str, str]) -> tuple[ToolCall, ...]:
    """The solution as write_file calls: each of its files that is new or differs from `files`, in path order."""
    return tuple(ToolCall("write_file", {"path": path, "content": text}) for path, text in sorted(solution.items())
                 if files.get(path) != text)
