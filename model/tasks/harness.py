"""Child-process harness that runs many (code, tests) cases and prints one JSON result line per case.

Owns: executing untrusted candidate code against its tests, with a per-case time limit.
Does not own: isolation (the sandbox actor runs this same file inside its jail) or scheduling.
Stdlib only and self-contained, so a sandbox can copy and run it as a plain script:
stdin: JSON lines {"code", "entry_point", "tests": [[args_repr, expected_repr], ...], "test_source", "timeout_s"}
(`test_source`: optional Python run statement by statement after the pairs, each top-level assert a test);
stdout: JSON lines {"n_passed", "n_tests", "status", "feedback"} in input order.
"""

from __future__ import annotations

import ast
import io
import json
import os
import resource
import signal
import sys
from types import FrameType
from typing import Final

FEEDBACK_CHARS: Final = 300
OUTPUT_CHARS: Final = 10_000


class CaseTimeout(BaseException):
    """Raised by SIGALRM inside a case; a BaseException so `except Exception` in candidate code misses it."""


class _Capped(io.StringIO):
    """A stdout replacement that keeps at most OUTPUT_CHARS characters."""

    def write(self, text: str) -> int:
        room = OUTPUT_CHARS - self.tell()
        if room > 0:
            super().write(text[:room])
        return len(text)


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise CaseTimeout


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= FEEDBACK_CHARS else text[: FEEDBACK_CHARS - 3] + "..."


def _call_text(entry: str, args: tuple[object, ...]) -> str:
    return f"{entry}({', '.join(repr(a) for a in args)})"


def run_case(case: dict[str, object]) -> dict[str, object]:
    """Exec the code in a fresh namespace and run its tests; the first failure becomes the feedback."""
    code, entry = str(case["code"]), str(case["entry_point"])
    tests = [(ast.literal_eval(a), ast.literal_eval(e)) for a, e in case["tests"]]  # type: ignore[union-attr]
    source = list(ast.parse(str(case.get("test_source", "")), "<tests>").body)
    n_tests, n_passed = len(tests) + sum(isinstance(node, ast.Assert) for node in source), 0
    timeout_s = float(case.get("timeout_s", 1.0))  # type: ignore[arg-type]
    status, feedback = "passed", ""
    saved_stdout = sys.stdout
    sys.stdout = _Capped()
    signal.setitimer(signal.ITIMER_REAL, timeout_s, 0.05)  # keeps firing if candidate code swallows one
    try:
        try:
            namespace: dict[str, object] = {"__name__": "__candidate__"}
            exec(compile(code, "<candidate>", "exec"), namespace)
            fn = namespace.get(entry)
            if not callable(fn):
                raise NameError(f"the code does not define a function named {entry!r}")
        except CaseTimeout:
            raise
        except BaseException as err:  # SyntaxError, SystemExit, anything the module body raises
            status, feedback = "error", f"{type(err).__name__}: {err}"
        else:
            for args, expected in tests:
                try:
                    got = fn(*args)
                except CaseTimeout:
                    raise
                except BaseException as err:
                    status = "failed"
                    feedback = f"{_call_text(entry, args)} raised {type(err).__name__}: {err}"
                    break
                if got == expected and type(got) is type(expected):
                    n_passed += 1
                    continue
                status = "failed"
                feedback = f"{_call_text(entry, args)} returned {got!r}, expected {expected!r}"
                break
            if status == "passed":
                status, feedback, passed = _run_source(source, namespace)
                n_passed += passed
    except CaseTimeout:
        status, feedback = "timeout", f"timed out after {timeout_s:g}s"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0, 0.0)
        sys.stdout = saved_stdout
    return {"n_passed": n_passed, "n_tests": n_tests, "status": status, "feedback": _short(feedback)}


def _run_source(source: list[ast.stmt], namespace: dict[str, object]) -> tuple[str, str, int]:
    """(status, feedback, asserts passed) of running a test source's statements in the candidate's namespace;
    the first failing statement ends it."""
    passed = 0
    for node in source:
        try:
            exec(compile(ast.Module(body=[node], type_ignores=[]), "<tests>", "exec"), namespace)
        except CaseTimeout:
            raise
        except BaseException as err:
            return "failed", f"line {node.lineno} of the tests: {type(err).__name__}: {err}", passed
        passed += isinstance(node, ast.Assert)
    return "passed", "", passed


def main() -> None:
    """Read every case first, then answer each on the saved stdout; candidates print into a capped buffer."""
    memory_mb = int(os.environ.get("RLBUS_HARNESS_MEMORY_MB", "1024"))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    cases = [json.loads(line) for line in sys.stdin if line.strip()]
    out = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # stray writes to fd 1 (os.write, subprocesses) can't corrupt the protocol
    signal.signal(signal.SIGALRM, _on_alarm)
    sys.setrecursionlimit(2000)
    for case in cases:
        try:
            result = run_case(case)
        except MemoryError:
            result = {"n_passed": 0, "n_tests": len(case["tests"]), "status": "error",
                      "feedback": "MemoryError: the code used too much memory"}
        out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
