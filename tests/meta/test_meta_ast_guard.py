"""The AST guard (tests/helpers/ast_guard.py, an autouse fixture of tests/conftest.py): an AST built off the main thread (`ast.parse`, pytest's assertion rewriting
of an imported module) fails the test it happened in; source compiled or run as text, and parses on the main
thread, do not."""

from __future__ import annotations

import ast
import importlib
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.ast_guard import AstOffMainThread


def _on_worker(fn: Callable[[], object], name: str) -> None:
    worker = threading.Thread(target=fn, name=name)
    worker.start()
    worker.join()


def test_ast_parse_on_a_worker_thread_fails_the_test(ast_guard: AstOffMainThread) -> None:
    """The check raises pytest's failure naming the thread, the file name and the stack of the parse."""
    _on_worker(lambda: ast.parse("x = 1\n", "<snippet>"), "parsing-worker")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)during this test.*thread 'parsing-worker' parsed "
                                                     r"'<snippet>'.*test_meta_ast_guard.py.*ast.py"):
        ast_guard.check("during this test")


def test_a_module_rewritten_by_pytest_on_a_worker_thread_is_caught(
        ast_guard: AstOffMainThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing a module named like a test file on a worker thread runs pytest's assertion rewriting there
    (as torch's torch/_inductor/test_operators.py is when an optimizer first imports torch._dynamo)."""
    (tmp_path / "test_guard_probe_module.py").write_text("def f():\n    assert 1 + 1 == 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "test_guard_probe_module", raising=False)
    _on_worker(lambda: importlib.import_module("test_guard_probe_module"), "importing-worker")
    found = ast_guard.take()
    assert found and all("thread 'importing-worker'" in f for f in found)
    assert any("_pytest/assertion/rewrite.py" in f for f in found)


def test_text_compiled_on_a_worker_and_parses_on_the_main_thread_pass(ast_guard: AstOffMainThread) -> None:
    """compile of source text builds no AST objects (dataclasses, namedtuples and imports compile text in every
    thread); ast.parse on the main thread is what pytest itself does."""
    _on_worker(lambda: compile("y = [i for i in range(3)]\n", "<text>", "exec"), "compiling-worker")
    ast.parse("z = 2\n")
    assert ast_guard.take() == []
