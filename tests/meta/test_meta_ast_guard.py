"""The AST guard (tests/helpers/ast_guard.py, an autouse fixture of tests/conftest.py): an AST built off the main
thread outside rlbus's AST lock (messages/astlock.py) fails the test it happened in; parses under the lock
(`ast.parse`, pytest's assertion rewriting of an imported module), source compiled or run as text, and parses on
the main thread do not."""

from __future__ import annotations

import ast
import importlib
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.ast_guard import AstOffMainThread

from rlbus.messages import astlock


def _on_worker(fn: Callable[[], object], name: str) -> None:
    worker = threading.Thread(target=fn, name=name)
    worker.start()
    worker.join()


def test_an_ast_built_on_a_worker_thread_outside_the_lock_fails_the_test(ast_guard: AstOffMainThread) -> None:
    """The check raises pytest's failure naming the thread, the file name and the stack of the parse (here the
    builtin `compile` as it was before the lock's wrapper replaced it)."""
    _on_worker(lambda: astlock._compile("x = 1\n", "<snippet>", "exec", ast.PyCF_ONLY_AST), "parsing-worker")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)during this test.*thread 'parsing-worker' parsed "
                                                     r"'<snippet>'.*test_meta_ast_guard.py"):
        ast_guard.check("during this test")


def test_ast_parse_and_pytest_rewriting_a_module_on_a_worker_thread_go_under_the_lock(
        ast_guard: AstOffMainThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ast.parse`, and importing a module named like a test file on a worker thread (pytest's assertion
    rewriting parses it there, as torch's torch/_inductor/test_operators.py is when an optimizer first imports
    torch._dynamo), build their ASTs under the lock: safe, not recorded."""
    seen: list[tuple[str, bool]] = []
    original = astlock._compile

    def spy(source: object, filename: object, mode: str, flags: int = 0, *args: object, **kwargs: object) -> object:
        if flags & ast.PyCF_ONLY_AST or isinstance(source, ast.AST):
            seen.append((threading.current_thread().name, astlock.held()))
        return original(source, filename, mode, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(astlock, "_compile", spy)
    _on_worker(lambda: ast.parse("x = 1\n", "<snippet>"), "parsing-worker")
    assert seen == [("parsing-worker", True)]
    (tmp_path / "test_guard_probe_module.py").write_text("def f():\n    assert 1 + 1 == 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "test_guard_probe_module", raising=False)
    _on_worker(lambda: importlib.import_module("test_guard_probe_module"), "importing-worker")
    assert ast_guard.take() == []
    assert seen[1:] and set(seen[1:]) == {("importing-worker", True)}   # its parse, its compile of the tree
    assert importlib.import_module("test_guard_probe_module").__loader__.__class__.__name__ == "AssertionRewritingHook"


def test_text_compiled_on_a_worker_and_parses_on_the_main_thread_pass(ast_guard: AstOffMainThread) -> None:
    """compile of source text builds no AST objects (dataclasses, namedtuples and imports compile text in every
    thread); ast.parse on the main thread is what pytest itself does."""
    _on_worker(lambda: compile("y = [i for i in range(3)]\n", "<text>", "exec"), "compiling-worker")
    ast.parse("z = 2\n")
    assert ast_guard.take() == []
