"""Changes to the task library (model/tasks/library/): what the built-in repository tasks break, and which tests see it.

- Owns: the library as a repository (`library_files`, under the package name `PACKAGE`), its functions and their
  test calls (`library_functions`, `calls_of`), running those calls on any version of the library in this
  process with a step limit (`outcomes`), the changes a task is made of (`Change`: one mutator site, `site_change`;
  a signature reordered together with every call site, `signature_changes`), whether the tests catch a change
  (`caught`), and the split of functions into `train` and `heldout` (`split_of`; the held-out code,
  `held_out_sources`).
- Guarantee: the library's own code and changes of it are the only code run here (a change only moves an operator,
  a name, a bound, a statement or parameters, so it adds no I/O); a call that runs past `MAX_STEPS` traced lines
  counts as having raised. `split_of` depends on the qualified name alone.
- Does not: word tasks or write hidden tests (model/tasks/repo.py), or find mutator sites (model/tasks/mutators.py).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any, Final, Literal

from rlbus.model.tasks.library_tests import CALLS
from rlbus.model.tasks.mutators import Site, apply_site, functions, sites

PACKAGE: Final = "toolkit"
"""The library's package name in a task's repository."""
MODULES: Final = ("text", "mathx", "seqs", "dates", "money", "grid")
"""The library's modules, each one file of the package."""
LIBRARY_DIR: Final = Path(__file__).resolve().parent / "library"
MAX_STEPS: Final = 20_000
"""Traced lines one test call may run before it counts as raising (a change that loops forever)."""
HELDOUT_SHARE: Final = 5
"""One function in this many (by the hash of its qualified name) is held out."""
Split = Literal["train", "heldout"]
SPLITS: Final = ("train", "heldout")


def split_of(function: str) -> Split:
    """`heldout` for about one qualified function name in `HELDOUT_SHARE` (`toolkit.text.slugify`,
    `textwrap.TextWrapper._wrap_chunks`), by the first 8 bytes of its sha256; `train` for the others."""
    digest = int.from_bytes(hashlib.sha256(function.encode()).digest()[:8], "big")
    return "heldout" if digest % HELDOUT_SHARE == 0 else "train"


def path_of(module: str) -> str:
    """`text` -> `toolkit/text.py`."""
    return f"{PACKAGE}/{module}.py"


@functools.cache
def library_files() -> dict[str, str]:
    """The library as a repository: `toolkit/__init__.py` and one file per module of `MODULES`."""
    files = {f"{PACKAGE}/__init__.py": (LIBRARY_DIR / "__init__.py").read_text(encoding="utf-8")}
    for module in MODULES:
        files[path_of(module)] = (LIBRARY_DIR / f"{module}.py").read_text(encoding="utf-8")
    return files


@functools.cache
def library_functions() -> tuple[str, ...]:
    """`module.function` of every top-level function of the library that has test calls, in file order."""
    out = []
    for module in MODULES:
        tree = ast.parse(library_files()[path_of(module)])
        out += [f"{module}.{name}" for name, _, _ in functions(tree) if f"{module}.{name}" in CALLS]
    return tuple(out)


def qualified(function: str) -> str:
    """`text.slugify` -> `toolkit.text.slugify` (what `split_of` hashes)."""
    return f"{PACKAGE}.{function}"


def calls_of(function: str) -> tuple[str, ...]:
    """The test calls of `module.function` as source: `slugify('Hello, World!')`."""
    name = function.rpartition(".")[2]
    return tuple(f"{name}({args})" for args in CALLS[function])


@functools.cache
def callers() -> dict[str, frozenset[str]]:
    """For each library function, the functions whose result depends on it (itself included, callers of callers
    too), by the names each function's body calls."""
    direct: dict[str, set[str]] = {f: set() for f in library_functions()}
    by_name = {f.rpartition(".")[2]: f for f in library_functions()}
    for module in MODULES:
        for name, _, node in functions(ast.parse(library_files()[path_of(module)])):
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in by_name:
                    direct[by_name[call.func.id]].add(f"{module}.{name}")
    out = {}
    for f in direct:
        seen, todo = {f}, [f]
        while todo:
            for g in direct.get(todo.pop(), ()):
                if g not in seen:
                    seen.add(g)
                    todo.append(g)
        out[f] = frozenset(seen)
    return out


# ---- running the library here ----------------------------------------------------------------------------
class _Sources(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports one version of the library under a private package name, from text."""

    def __init__(self, package: str, files: Mapping[str, str]) -> None:
        self.package = package
        self.files = files

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == self.package:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        head, _, tail = fullname.rpartition(".")
        if head == self.package and path_of(tail) in self.files:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        if module.__name__ == self.package:
            return
        tail = module.__name__.rpartition(".")[2]
        exec(_compiled(self.files[path_of(tail)], path_of(tail)), module.__dict__)


@functools.lru_cache(maxsize=64)
def _compiled(text: str, path: str) -> Any:
    return compile(text, path, "exec")


_COUNTER = itertools.count()
_LOCK = threading.Lock()


class _TooLong(Exception):
    """A test call ran past `MAX_STEPS` lines."""


def _load(files: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Each module's namespace of this version of the library."""
    package = f"_rlbus_library_{next(_COUNTER)}"
    finder = _Sources(package, files)
    with _LOCK:
        sys.meta_path.insert(0, finder)
        try:
            modules = {m: importlib.import_module(f"{package}.{m}").__dict__ for m in MODULES}
        finally:
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if n == package or n.startswith(f"{package}.")]:
                del sys.modules[name]
    return modules


def _run(call: str, scope: dict[str, Any]) -> str:
    """`= <repr>` of a call's exact result, or `! <what it raised>`."""
    steps = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > MAX_STEPS:
                raise _TooLong
        return tracer

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        value = eval(call, dict(scope))
        return f"= {exact(value)}"
    except _TooLong:
        return f"! it runs for more than {MAX_STEPS} steps"
    except Exception as err:
        return f"! {type(err).__name__}: {err}"
    finally:
        sys.settrace(before)


def outcomes(files: Mapping[str, str], tested: Sequence[str]) -> dict[str, str]:
    """Per test call of the `tested` functions (`module.function`), its outcome on this version of the library:
    `= <repr>` of the result (`exact`: plain built-in types only) or `! <Exception>: <message>`."""
    modules = _load(files)
    out = {}
    for function in tested:
        scope = modules[function.partition(".")[0]]
        for call in calls_of(function):
            out[call] = _run(call, scope)
    return out


@functools.cache
def original_outcomes() -> dict[str, str]:
    return outcomes(library_files(), library_functions())


EXACT: Final = '''def exact(value):
    """The repr of a value made only of plain built-in types (exactly those, never a subclass)."""
    kind = type(value)
    if kind is list:
        return "[" + ", ".join(exact(v) for v in value) + "]"
    if kind is tuple:
        return "(" + ", ".join(exact(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if kind is dict:
        return "{" + ", ".join(exact(k) + ": " + exact(v) for k, v in value.items()) + "}"
    if kind is int or kind is float or kind is str or kind is bool or value is None:
        return repr(value)
    raise AssertionError(f"a {kind.__qualname__} is not a plain built-in value")
'''
"""The hidden tests' comparison: the repr of a result made of exact built-in types (the plain repr for those)."""

_SCOPE: dict[str, Any] = {}
exec(EXACT, _SCOPE)


def exact(value: Any) -> str:
    """`EXACT`'s function, here."""
    return _SCOPE["exact"](value)  # type: ignore[no-any-return]


# ---- changes ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Change:
    """A change of the library: `function` (`module.function`) is the one it breaks, `kind` a mutator kind or
    `signature`, `files` the changed files (path, new text), `note` what changed (never shown)."""

    function: str
    kind: str
    files: tuple[tuple[str, str], ...]
    note: str

    def applied(self) -> dict[str, str]:
        return {**library_files(), **dict(self.files)}


@functools.cache
def function_texts() -> dict[str, tuple[str, int, int]]:
    """Per tested `module.function`: (its path, first and last line, 1-based) of its `def` in its file."""
    out = {}
    for module in MODULES:
        path = path_of(module)
        for name, _, node in functions(ast.parse(library_files()[path])):
            if f"{module}.{name}" in CALLS:
                out[f"{module}.{name}"] = (path, node.lineno, node.end_lineno or node.lineno)
    return out


def _function_source(function: str) -> tuple[str, str, str, str]:
    """(path, text before the function, the function's lines, text after it)."""
    path, first, last = function_texts()[function]
    lines = library_files()[path].splitlines(keepends=True)
    return path, "".join(lines[:first - 1]), "".join(lines[first - 1:last]), "".join(lines[last:])


@functools.cache
def module_sites() -> dict[str, tuple[Site, ...]]:
    """Every mutator site of each tested `module.function`, found in the function's own text (its lines of the file
    read as a module), in source order."""
    return {f: tuple(sites(ast.parse(_function_source(f)[2]))) for f in library_functions()}


def site_change(function: str, site: Site) -> Change | None:
    """The change of one site of `function` (a site of `module_sites`), made in the function's own lines (checked
    as mutators.apply_site checks it: exactly that node changed) and put back in its file; None when no text edit
    makes exactly that change."""
    path, before, text, after = _function_source(function)
    done = apply_site(text, site)
    if done is None:
        return None
    return Change(function, site.kind, ((path, before + done[0] + after),), done[1])


def caught(change: Change) -> dict[str, tuple[str, str]]:
    """The test calls whose outcome the change alters: call -> (expected, found); empty when the tests miss it."""
    tested = sorted(callers()[change.function], key=library_functions().index)
    found = outcomes(change.applied(), tested)
    want = original_outcomes()
    return {call: (want[call], got) for call, got in found.items() if got != want[call]}


def _offsets(text: str) -> list[int]:
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _span(starts: list[int], node: ast.AST) -> tuple[int, int]:
    return (starts[node.lineno - 1] + node.col_offset,                                   # type: ignore[attr-defined]
            starts[node.end_lineno - 1] + node.end_col_offset)                           # type: ignore[attr-defined]


def _permuted(text: str, spans: list[tuple[int, int]], order: Sequence[int]) -> list[tuple[int, int, str]]:
    """Edits putting the texts of `spans` in `order` (spans[order[k]]'s text at the k-th span)."""
    return [(a, b, text[spans[j][0]:spans[j][1]]) for (a, b), j in zip(spans, order, strict=True)]


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    for a, b, new in sorted(edits, reverse=True):
        text = text[:a] + new + text[b:]
    return text


@functools.cache
def signature_changes() -> tuple[Change, ...]:
    """Every reordering of a library function's positional parameters (no defaults, no `*args`) made together with
    every positional call of it in the library, kept when it touches more than one file: the package works as
    before, but the function's own tests, which call it in the documented order, do not."""
    out = []
    files = library_files()
    trees = {path_of(m): ast.parse(files[path_of(m)]) for m in MODULES}
    calls_by_name: dict[tuple[str, str], list[ast.Call]] = {}
    for path, tree in trees.items():
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
                calls_by_name.setdefault((path, call.func.id), []).append(call)
    for function in library_functions():
        module, _, name = function.partition(".")
        home = path_of(module)
        node = next(n for q, _, n in functions(trees[home]) if q == name)
        params = node.args.args
        if len(params) < 2 or node.args.defaults or node.args.vararg or node.args.posonlyargs:
            continue
        sites_by_file: dict[str, list[ast.Call]] = {}
        for path in trees:
            for call in calls_by_name.get((path, name), ()):
                if call.keywords or len(call.args) != len(params) or any(isinstance(a, ast.Starred) for a in call.args):
                    break
                sites_by_file.setdefault(path, []).append(call)
            else:
                continue
            sites_by_file = {}
            break
        if not any(path != home for path in sites_by_file):
            continue
        for order in itertools.permutations(range(len(params))):
            if list(order) == sorted(order):
                continue
            changed = {}
            for path in sorted({home, *sites_by_file}):
                text = files[path]
                starts = _offsets(text)
                edits = []
                if path == home:
                    edits += _permuted(text, [_span(starts, p) for p in params], order)
                for call in sites_by_file.get(path, ()):
                    edits += _permuted(text, [_span(starts, a) for a in call.args], order)
                changed[path] = _apply(text, edits)
            shown = ", ".join(params[j].arg for j in order)
            out.append(Change(function, "signature", tuple(sorted(changed.items())),
                              f"{name}'s parameters became ({shown}) with every call"))
    return tuple(out)


def held_out_sources() -> tuple[str, ...]:
    """The code of every `heldout` function of the library (its lines of its file), in library order: what the
    pretraining corpus must not hold (model/training/corpus.py `Decontaminator`)."""
    return tuple(_function_source(f)[2] for f in library_functions() if split_of(qualified(f)) == "heldout")


def single_changes(function: str) -> Iterator[Change]:
    """Every site change of `function`, in site order (not yet checked against the tests)."""
    for site in module_sites()[function]:
        change = site_change(function, site)
        if change is not None:
            yield change


__all__ = ["EXACT", "HELDOUT_SHARE", "LIBRARY_DIR", "MAX_STEPS", "MODULES", "PACKAGE", "SPLITS", "Change", "Split",
           "callers", "calls_of", "caught", "exact", "function_texts", "held_out_sources", "library_files", "library_functions", "module_sites",
           "original_outcomes", "outcomes", "path_of", "qualified", "signature_changes", "single_changes",
           "site_change", "split_of"]
