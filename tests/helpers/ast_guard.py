"""The AST guard: an audit hook that records each AST built off the main thread outside rlbus's AST lock
(messages/astlock.py), for tests/conftest.py to fail the test it happened in, and
`import_rewritten_plugin_modules` (pytest's assertion rewriting parses too).

CPython 3.11 before gh-106905 keeps the AST builder's recursion depth in interpreter-global state, so two
threads building ASTs at once (pytest's failure report or assertion rewriting on the main thread, a worker
thread's `ast.parse`) fail with "SystemError: AST constructor recursion depth mismatch": inside pytest's
report, an INTERNALERROR. Importing `rlbus.messages` puts every `compile` that builds an AST under one lock, so
such a parse is safe wherever it runs; one that bypasses the lock (a reference to the builtin `compile` taken
before the lock was installed, a C extension's own parse) is still recorded.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
import threading
import traceback

import anyio
import pytest

from rlbus.messages import astlock


class AstOffMainThread:
    """An audit hook that records each AST built off the main thread without the AST lock: `ast.parse` (any `compile` with
    `PyCF_ONLY_AST`) and `compile` of an AST object, with the thread's name and stack. `compile`/`exec` of
    source text builds no AST objects (and no shared state) and is not recorded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._found: list[str] = []

    def hook(self, event: str, args: tuple[object, ...]) -> None:
        if event != "compile" or threading.current_thread() is threading.main_thread() or astlock.held():
            return
        caller = sys._getframe(1)                  # the Python frame that called compile() (ast.parse, ...)
        if caller.f_code is astlock.LOCKED_COMPILE_CODE:
            return                                 # the lock's wrapper builds ASTs only under the lock (held above)
        if isinstance(args[0], ast.AST) or "PyCF_ONLY_AST" in caller.f_code.co_names:
            stack = "".join(traceback.format_stack(caller))
            with self._lock:
                self._found.append(f"thread {threading.current_thread().name!r} parsed {args[1]!r}:\n{stack}")

    def take(self) -> list[str]:
        """What was recorded since the last `take`, and forget it."""
        with self._lock:
            found, self._found = self._found, []
        return found

    def check(self, when: str) -> None:
        """Fail the current test when an AST was built off the main thread since the last check."""
        found = self.take()
        if found:
            pytest.fail(f"an AST was built off the main thread {when} (move the parse to the main thread or a "
                        f"subprocess; see tests/helpers/ast_guard.py):\n" + "\n".join(found),
                        pytrace=False)


def import_rewritten_plugin_modules() -> None:
    """Import every module of anyio here, on the main thread. pytest rewrites the asserts of each module of a
    plugin's package as it is imported (anyio registers `anyio.pytest_plugin`), which parses its source, and
    anyio loads submodules lazily: `anyio.from_thread.check_cancelled()` first called in a worker thread (the
    evaluator's generation does) would parse anyio/from_thread.py there."""
    def walk(path: list[str], prefix: str) -> None:
        for module in pkgutil.iter_modules(path, prefix):
            try:
                imported = importlib.import_module(module.name)
            except ImportError:                    # anyio._backends._trio without trio
                continue
            if module.ispkg:
                walk(list(imported.__path__), module.name + ".")

    walk(list(anyio.__path__), "anyio.")
