"""One process-wide lock around every AST built from Python code: thread-safe parsing on CPython 3.11.

- Owns: `install` (done on importing `rlbus.messages`, which every rlbus process does), `held`.
- Does not: make a C extension's own calls of the parser safe (they do not go through `compile`).

CPython 3.11 before gh-106905 keeps the AST builder's recursion depth in interpreter-global state. Building an AST
(`ast.parse`, `inspect.signature` of a builtin, pytest's assertion rewriting and failure reports) allocates many
objects, so the garbage collector may run a finalizer in the middle, and Python code lets the interpreter switch
threads; a second thread building an AST then leaves the first with "SystemError: AST constructor recursion depth
mismatch". rlbus runs work in worker threads (sampling, evaluation, scoring) beside an event loop, so two
parses at once can happen in any of its processes. `install` replaces `builtins.compile` with a wrapper that
holds one reentrant lock while it builds an AST from source (`PyCF_ONLY_AST`, what `ast.parse` asks for) or
compiles an AST object; compiling source text to code builds no AST objects and is not serialised.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import sys
import threading
from typing import Any

_LOCK = threading.RLock()
_compile = builtins.compile
_NEEDED = sys.version_info < (3, 12)
"""3.12 keeps the depth per call (gh-106905): nothing to serialise there."""


_FUTURE_FLAGS = 0
for _name in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _name).compiler_flag


def _locked_compile(source: Any, filename: Any, mode: str, flags: int = 0, dont_inherit: bool = False,
                    optimize: int = -1, **kwargs: Any) -> Any:
    if not dont_inherit:    # what `compile` inherits is its caller's future features, not this module's
        try:
            flags |= sys._getframe(1).f_code.co_flags & _FUTURE_FLAGS
        except ValueError:  # called from C with no Python frame: nothing to inherit
            pass
    if flags & ast.PyCF_ONLY_AST or isinstance(source, ast.AST):
        with _LOCK:
            return _compile(source, filename, mode, flags, True, optimize, **kwargs)
    return _compile(source, filename, mode, flags, True, optimize, **kwargs)


_locked_compile.__doc__ = _compile.__doc__
LOCKED_COMPILE_CODE = _locked_compile.__code__
"""The wrapper's code object: an audit hook's caller frame running it compiles source to code unless `held`."""


def install() -> bool:
    """Serialise AST building in this process (idempotent); returns whether the wrapper is in place."""
    if not _NEEDED:
        return False
    if builtins.compile is not _locked_compile:
        builtins.compile = _locked_compile
    return True


def held() -> bool:
    """Whether the calling thread builds an AST under the lock now (for an audit hook's `compile` event)."""
    return _LOCK._is_owned()  # type: ignore[attr-defined]  # RLock's own test of its owner
