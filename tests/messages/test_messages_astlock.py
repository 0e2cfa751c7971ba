"""Building ASTs from two threads at once: CPython 3.11 fails one of them unless rlbus's lock serialises them
(messages/astlock.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# The main thread parses; a garbage cycle's finalizer, run by the collector in the middle of that parse (inside
# the C call: no Python frame between it and `ast.parse`, or the lock's wrapper with the lock held), lets a second
# thread parse meanwhile (it waits at most 1 s for it: under the lock the second parse waits its turn).
RACE = r'''
import ast, gc, sys, threading
if sys.argv[1] == "locked":
    import rlbus.messages  # installs the lock
source = "\n".join(f"def f{i}(a, b):\n    return [a + b * {i} for _ in range(3)]" for i in range(300))
go, done, fired = threading.Event(), threading.Event(), []

class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self):
        below = sys._getframe(1).f_code.co_name     # the Python frame whose C call ran the collector
        locked = sys.argv[1] == "locked" and __import__("rlbus.messages.astlock").messages.astlock.held()
        if not fired and (below == "parse" or (below == "_locked_compile" and locked)):
            fired.append(1)
            go.set()
            done.wait(1.0)

def other():
    go.wait()
    ast.parse("x = [1, 2, 3]\n" * 50)
    done.set()

t = threading.Thread(target=other)
t.start()
cycles = [Cycle() for _ in range(2000)]
del cycles
gc.set_threshold(1)
try:
    ast.parse(source)
    print("parsed", "finalizer ran mid-parse" if fired else "finalizer did not run")
except SystemError as err:
    print("SystemError:", err)
finally:
    gc.set_threshold(700)
    go.set()
    t.join()
'''


def race(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", RACE, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12 keeps the AST builder's depth per call (gh-106905)")
def test_a_parse_in_a_second_thread_during_a_parse_fails_without_the_lock_and_waits_its_turn_with_it() -> None:
    assert race("plain").startswith("SystemError: AST constructor recursion depth mismatch")
    assert race("locked") == "parsed finalizer ran mid-parse"


def test_compile_under_the_lock_keeps_its_callers_future_features_and_results() -> None:
    import ast

    from rlbus.messages import astlock

    assert astlock.install() == (sys.version_info < (3, 12))
    namespace: dict[str, object] = {}
    exec(compile("def f(x: int) -> undefined: pass", "<test>", "exec"), namespace)  # this module: annotations
    assert namespace["f"].__annotations__ == {"x": "int", "return": "undefined"}  # type: ignore[attr-defined]
    exec(compile("def g(x: int) -> int: pass", "<test>", "exec", dont_inherit=True), namespace)
    assert namespace["g"].__annotations__ == {"x": int, "return": int}  # type: ignore[attr-defined]
    assert eval(compile(ast.parse("1 + 2", mode="eval"), "<test>", "eval")) == 3
    assert not astlock.held()
