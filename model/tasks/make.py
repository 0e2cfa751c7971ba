"""Repository tasks made from real code: a standard-library module with one seeded bug, its CPython tests
hidden.

- Owns: what a made task is, apart from running anything: `stdlib_module` (a module and its adapted CPython
  test file), `seeded`, `skip_tests`, `fail_to_pass`, `instruction` (an issue report, never the change) and
  `task_row` (the row of a repository task file, model/tasks/sources.py).
- Does not: change code (model/tasks/mutators.py) or grade it (ops/tasks_make.py runs the hidden tests in the
  sandbox and keeps a change only when some test that passes on the original fails on it).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from rlbus.model.tasks.mutators import Mutation
from rlbus.model.tasks.repo_grade import GradeReport, TestReport

DEFAULT_MODULES: Final = ("textwrap", "fractions", "statistics", "shlex", "heapq", "calendar")
LEVEL_OF_KIND: Final = {"compare": 1, "arith": 1, "constant": 1, "off_by_one": 1, "return": 1,
                        "variable": 2, "arguments": 2, "condition": 2, "statement": 2, "deletion": 3}
"""A made task's `level`: 1 an operator, number, bound or returned value changed; 2 a name, argument order,
condition or statement changed; 3 the function's body removed (to be implemented again)."""
TIMEOUT_S: Final = 60.0
"""A made task's `timeout_s` (its grade: the module's whole CPython test file)."""
SKIP_REASON: Final = "does not pass on the unmodified module in the grading sandbox"
ADAPTATIONS: Final[dict[str, tuple[tuple[str, str], ...]]] = {
    # unittest.mock imported by a hidden test changes the framework the grade runner guards: the grade is void.
    "shlex": (("from unittest import mock\n", "from test.support import swap_attr\n"),
              ("@mock.patch('sys.stdin', io.StringIO())", "@swap_attr(__import__('sys'), 'stdin', io.StringIO())")),
    # The merge doctest is found through sys.modules['heapq'], which the grade runner leaves empty until the
    # module under test is imported: import it first.
    "heapq": (("from test import support\n", "import heapq\nfrom test import support\n"),),
}
"""Text replacements of a CPython test file, each of which must match exactly once."""


class MakeError(ValueError):
    """A module tasks cannot be made from: no source file, no CPython test file, an adaptation that no longer
    matches, or tests of the unmodified module that fail and cannot be set aside."""


@dataclass(frozen=True, slots=True)
class StdlibModule:
    """A standard-library module as a repository: `path` (`textwrap.py`) holding `source`, and its hidden
    CPython test file `test_path` holding `tests` (adapted, and with the tests set aside by `skip_tests`)."""

    name: str
    path: str
    source: str
    test_path: str
    tests: str


def stdlib_module(name: str) -> StdlibModule:
    """The installed module `name` (a single `.py` file) and its CPython test file, adapted.

    The test file is `Lib/test/test_<name>.py`, as installed, with the few `ADAPTATIONS` the grading sandbox
    needs and `random` seeded (`seeded`).

    :raises MakeError: the module is not a single source file, its test file is not installed, or an adaptation
        does not match.
    """
    spec = importlib.util.find_spec(name)
    origin = spec.origin if spec is not None else None
    if origin is None or not origin.endswith(".py") or spec.submodule_search_locations is not None:   # type: ignore[union-attr]
        raise MakeError(f"module {name!r}: not a single Python source file of the standard library ({origin})")
    test_spec = importlib.util.find_spec(f"test.test_{name}")
    if test_spec is None or test_spec.origin is None or not test_spec.origin.endswith(".py"):
        raise MakeError(f"module {name!r}: CPython's Lib/test/test_{name}.py is not installed")
    tests = Path(test_spec.origin).read_text(encoding="utf-8")
    for old, new in ADAPTATIONS.get(name, ()):
        if tests.count(old) != 1:
            raise MakeError(f"module {name!r}: the adaptation of test_{name}.py expects {old!r} exactly once, "
                            f"found {tests.count(old)} times")
        tests = tests.replace(old, new)
    return StdlibModule(name, f"{name}.py", Path(origin).read_text(encoding="utf-8"), f"test_{name}.py",
                        seeded(tests))


SEED_LINES: Final = "import random\nrandom.seed(0)  # rlbus: the same random data in every grade\n"


def seeded(tests: str) -> str:
    """`tests` with `SEED_LINES` before its first import (after any `from __future__` import): tests that draw
    random data (heapq's) draw the same in every grade, so whether a change is caught, and by which tests, is
    repeatable."""
    tree = ast.parse(tests)
    first = next((n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)
                  and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")), None)
    if first is None:
        return SEED_LINES + tests
    lines = tests.splitlines(keepends=True)
    return "".join([*lines[:first.lineno - 1], SEED_LINES, *lines[first.lineno - 1:]])


def skip_tests(module: StdlibModule, test_ids: Sequence[str], reason: str = SKIP_REASON) -> StdlibModule:
    """`module` with each test of `test_ids` (`test_x.Class.method`) decorated `@unittest.skip(reason)`: the
    grade runner reports it `not_run`, not counted.

    :raises MakeError: an id is not a method of a top-level class of the test file (a doctest, say), or the file
        does not `import unittest`.
    """
    if not test_ids:
        return module
    tree = ast.parse(module.tests)
    if not any(isinstance(n, ast.Import) and any(a.name == "unittest" and a.asname is None for a in n.names)
               for n in tree.body):
        raise MakeError(f"{module.test_path}: no top-level `import unittest` for the skip decorator")
    methods = {(cls.name, fn.name): fn for cls in tree.body if isinstance(cls, ast.ClassDef)
               for fn in cls.body if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)}
    prefix = module.test_path.removesuffix(".py") + "."
    lines = module.tests.splitlines(keepends=True)
    inserts: dict[int, str] = {}
    for test_id in test_ids:
        parts = test_id.removeprefix(prefix).split(".") if test_id.startswith(prefix) else []
        fn = methods.get((parts[0], parts[1])) if len(parts) == 2 else None
        if fn is None:
            raise MakeError(f"{module.test_path}: test {test_id!r} fails on the unmodified module and is not a "
                            f"test method that can be skipped")
        first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
        inserts[first] = " " * fn.col_offset + f"@unittest.skip({reason!r})\n"
    for line in sorted(inserts, reverse=True):
        lines.insert(line - 1, inserts[line])
    return StdlibModule(module.name, module.path, module.source, module.test_path, "".join(lines))


def fail_to_pass(original: GradeReport, changed: GradeReport) -> list[str]:
    """Ids of the tests that pass on the original and not on the changed module, in the report's order."""
    passed = {t.name for t in original.tests if t.status == "passed"}
    return [t.name for t in changed.tests if t.name in passed and t.status != "passed"]


_FRAME: Final = re.compile(r"^\s+File \"")
_RAISED: Final = re.compile(r"^[A-Za-z_][\w.]*(:\s|:?$)")
"""The first line of what a traceback says was raised: a dotted name at column 0, then `: ` or nothing."""
_ADDRESS: Final = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")
"""An object's address in a repr: it differs from run to run, so a message shows `0x...` for it."""


def failure_message(detail: str, max_chars: int = 600) -> str:
    """What a failing test says, without the traceback's frames (which would show the changed lines): the
    exception and its message, from the first traceback in `detail` that has one, with object addresses masked.
    A traceback may be indented (a doctest's, inside its report): the exception is the first line after the last
    frame that is indented less than the frame. The grade keeps a detail's end, so it may begin part-way through
    a traceback or through the message itself: a cut first line is dropped, and a detail cut inside the message
    gives what is left of it."""
    for i, part in enumerate(detail.split("Traceback (most recent call last):")):
        lines = part.strip("\n").splitlines()[1 if i == 0 else 0:]      # before any header: a cut first line
        last_frame = max((k for k, line in enumerate(lines) if _FRAME.match(line)), default=-1)
        depth = _indent(lines[last_frame]) if last_frame >= 0 else 0
        start = next((k for k in range(last_frame + 1, len(lines)) if _indent(lines[k]) < max(1, depth)
                      and _RAISED.match(lines[k].strip())), None)
        if start is None and i == 0 and last_frame < 0 and any(line.strip() for line in lines):
            start = 0                                                      # cut inside the message
        if start is not None:
            cut = _indent(lines[start])
            text = "\n".join(line[cut:] if line[:cut].isspace() else line for line in lines[start:])
            message = _ADDRESS.sub("0x...", text.strip())
            return message[:max_chars] + (" ..." if len(message) > max_chars else "")
    return ""


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _documented(source: str, function: str) -> bool:
    node: Any = ast.parse(source)
    for part in function.split("."):
        node = next((n for n in node.body if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                     and n.name == part), None)
        if node is None:
            return False
    return ast.get_docstring(node) is not None


def instruction(module: StdlibModule, mutation: Mutation, failing: Sequence[TestReport], shown: int = 3) -> str:
    """The task's issue text: which function, how many of the module's tests fail and what the first one says.
    It names neither the line nor the change."""
    what = "method" if "." in mutation.function else "function"
    names = "".join(f"- `{t.name}`\n" for t in failing[:shown]) + (
        f"- ... and {len(failing) - shown} more\n" if len(failing) > shown else "")
    count, verb = (f"{len(failing)} tests", "") if len(failing) != 1 else ("1 test", "s")
    if mutation.kind == "deletion":
        guide = ("its docstring" if _documented(module.source, mutation.function) else "its name") + \
                " and the rest of the module"
        return (f"Implement the {what} `{mutation.function}` in `{module.path}` (the standard library's "
                f"`{module.name}` module).\n\nIts body has been removed: it raises NotImplementedError. Write it so "
                f"that it does what {guide} expect. {count} of the module's test suite exercise{verb} it:\n\n"
                f"{names}\nThe test suite is not part of the repository.\n")
    first = next((t for t in failing if t.detail), None)
    said = failure_message(first.detail) if first is not None else ""
    which = "The first of them" if len(failing) > 1 else "It"
    report = f"\n{which} fails with:\n\n" + "".join(f"    {line}\n" for line in said.splitlines()) if said else ""
    return (f"The {what} `{mutation.function}` in `{module.path}` (the standard library's `{module.name}` module) "
            f"behaves incorrectly.\n\n{count} of the module's test suite fail{verb}:\n\n{names}{report}\nFix the bug in "
            f"`{module.path}` so that `{mutation.function}` does what its documentation and callers expect, "
            f"without breaking the other tests. The test suite is not part of the repository.\n")


def task_id(module: StdlibModule, mutation: Mutation) -> str:
    """`stdlib-<module>-<kind>-<first 10 hex of the changed file's sha256>`: the same change, the same id."""
    return f"stdlib-{module.name}-{mutation.kind}-{hashlib.sha256(mutation.text.encode()).hexdigest()[:10]}"


def task_row(module: StdlibModule, mutation: Mutation, failing: Sequence[TestReport]) -> dict[str, Any]:
    """The repository task file row of a kept change (`failing`: its fail-to-pass tests' reports).

    The repository is the one file with the change; the solution is the original file; `stdlib_under_test`
    makes the grade import the repository's copy instead of the standard library's; `function` is the changed
    function's qualified name (`textwrap.TextWrapper._wrap_chunks`), what the `:train` / `:heldout` splits go by.
    """
    return {"task_id": task_id(module, mutation), "instruction": instruction(module, mutation, failing),
            "files": {module.path: mutation.text}, "hidden_tests": {module.test_path: module.tests},
            "solution": {module.path: module.source}, "stdlib_under_test": [module.name],
            "timeout_s": TIMEOUT_S, "level": LEVEL_OF_KIND[mutation.kind], "tags": [module.name, mutation.kind],
            "function": f"{module.name}.{mutation.function}",
            "fail_to_pass": [t.name for t in failing]}


def module_seed(seed: int, name: str) -> int:
    """The mutation stream's seed for one module: each module's stream is its own, whatever else is made."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big")


def quotas(n: int, modules: Sequence[str]) -> dict[str, int]:
    """`n` tasks shared out over `modules` as evenly as can be, the first modules taking the remainder."""
    return {m: n // len(modules) + (1 if i < n % len(modules) else 0) for i, m in enumerate(modules)}


__all__ = ["ADAPTATIONS", "DEFAULT_MODULES", "LEVEL_OF_KIND", "SEED_LINES", "SKIP_REASON", "TIMEOUT_S", "MakeError", "StdlibModule",
           "fail_to_pass", "failure_message", "instruction", "module_seed", "quotas", "seeded", "skip_tests",
           "stdlib_module",
           "task_id", "task_row"]
