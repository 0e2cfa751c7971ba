"""The tools of a sandbox session: their arguments, checked, and what each does in the workspace.

- Owns: `TOOLS` (name → argument spec), `check_args` (a clear error for an unknown tool, a missing, unknown
  or mistyped argument), `run_tool` (one checked call on a session, its `Reply`; the tools listed there)
  and `judge` (the verdict of a grading run).
- Guarantee: output is capped at `[sandbox] max_output_kb` (`truncated`); `grade` never touches the
  workspace itself.
- Does not: hold sessions or leases (actors/sandbox/sessions.py), or know any file-system trick
  (actors/sandbox/workspace.py).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import stat
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

import msgspec

from rlbus.actors.sandbox.jailrun import JailBroken, RunOutcome, python_in_jail
from rlbus.actors.sandbox.workspace import Workspace, WorkspaceError, parts_of
from rlbus.model.tasks.repo_grade import (
    GradeReport,
    TestReport,
    TestStatus,
    expected_tests,
    is_test_file,
    module_of,
)

REQUIRED: Final = object()
"""Marks an argument without a default."""
Spec = dict[str, tuple[type, Any]]
TOOLS: Final[dict[str, Spec]] = {
    "list_files": {"path": (str, ".")},
    "read_file": {"path": (str, REQUIRED), "start_line": (int, None), "end_line": (int, None)},
    "write_file": {"path": (str, REQUIRED), "content": (str, REQUIRED)},
    "edit_file": {"path": (str, REQUIRED), "old": (str, REQUIRED), "new": (str, REQUIRED)},
    "search": {"pattern": (str, REQUIRED), "path": (str, ".")},
    "run": {"command": (str, REQUIRED), "timeout_s": (float, None)},
    "grade": {"files": (dict, {}), "stdlib_under_test": (list, []), "command": (str, ""), "timeout_s": (float, None)},
    "snapshot": {},
    "digest": {},
}
JAILED: Final = frozenset({"search", "run", "grade"})
"""Tools that run a jailed process: they queue under the supervisor's concurrency quota."""
GRADE_RUNNER: Final = Path(__file__).with_name("grade_runner.py")
"""Run as `python -I -c <its text> SPEC` in a grading copy: the hidden tests' grader (stdlib only)."""
GRADE_SLACK_BYTES: Final = 16 << 20
"""Room a grading copy has beyond the workspace and the hidden files (what the tests write)."""
MAX_ENTRIES: Final = 5000
"""Entries `list_files` reports at most (then `truncated`)."""
SEARCH_SOURCE: Final = r"""
import os, re, stat, sys
pattern, top, cap = re.compile(sys.argv[1]), sys.argv[2], int(sys.argv[3])
written = 0
found = False
def regular(path):
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
def scan(path):
    global written, found
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            data = f.read(1 << 20)
    except OSError:
        return
    if b"\0" in data[:8192]:
        return
    for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if pattern.search(line):
            found = True
            text = f"{os.path.normpath(path)}:{n}:{line[:500]}\n"
            sys.stdout.write(text)
            written += len(text)
            if written > cap:
                sys.exit(0)
if regular(top):
    scan(top)
for root, dirs, files in os.walk(top, followlinks=False):
    dirs.sort()
    for name in sorted(files):
        path = os.path.join(root, name)
        if regular(path):
            scan(path)
sys.exit(0 if found else 1)
"""


class ToolArgsError(Exception):
    """The call names no tool we have, or its arguments do not fit the tool's (the text says how)."""


def check_args(tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments with defaults filled in.

    :raises ToolArgsError: unknown tool, missing/unknown argument, or one of the wrong type.
    """
    spec = TOOLS.get(tool)
    if spec is None:
        raise ToolArgsError(f"unknown tool {tool!r}; the tools are {', '.join(TOOLS)}")
    wanted = ", ".join(f"{k}{'' if d is REQUIRED else '?'}" for k, (_, d) in spec.items()) or "none"
    extra = sorted(set(args) - set(spec))
    if extra:
        raise ToolArgsError(f"{tool}: unknown argument {extra[0]!r} (arguments: {wanted})")
    out: dict[str, Any] = {}
    for name, (kind, default) in spec.items():
        if name not in args or args[name] is None:
            if default is REQUIRED:
                raise ToolArgsError(f"{tool}: missing argument {name!r} (arguments: {wanted})")
            out[name] = default
            continue
        value = args[name]
        fits = (isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
                else isinstance(value, int) and not isinstance(value, bool) if kind is int
                else isinstance(value, kind))
        if not fits:
            raise ToolArgsError(f"{tool}: argument {name!r} must be {_KIND_NAMES[kind]}, got {type(value).__name__}")
        if kind is dict and not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ToolArgsError(f"{tool}: argument {name!r} must map paths (strings) to file texts (strings)")
        if kind is list and not all(isinstance(v, str) and v.isidentifier() for v in value):
            raise ToolArgsError(f"{tool}: argument {name!r} must be a list of module names")
        out[name] = float(value) if kind is float else value
    return out


_KIND_NAMES: Final = {str: "a string", int: "an integer", float: "a number", dict: "an object", list: "a list"}


@dataclass
class Reply:
    """What a tool produced; the session turns it into a ToolResult."""

    ok: bool
    output: str = ""
    error: str = ""
    truncated: bool = False
    exit_code: int | None = None
    status: str = "ok"
    files: dict[str, bytes] | None = None
    digests: dict[str, str] | None = None
    deleted: list[str] | None = None


Runner = Callable[[Path, list[str], float], Awaitable[RunOutcome]]
"""Runs argv jailed in a directory with a timeout (the session's level, limits and the quota)."""


@dataclass(frozen=True, slots=True)
class ToolLimits:
    """The supervisor's limits for tool output and jailed calls."""

    max_output_bytes: int
    max_timeout_s: float


def _capped(text: str, cap: int) -> tuple[str, bool]:
    data = text.encode()
    if len(data) <= cap:
        return text, False
    return data[:cap].decode("utf-8", "ignore"), True


async def run_tool(ws: Workspace, tool: str, args: dict[str, Any], limits: ToolLimits, runner: Runner,
                   scratch: Path) -> Reply:
    """One checked call (`check_args`) on `ws`. A refused file operation is an error reply, not a raise.

    The tools (arguments: required, then optional with their default):
    - `list_files` {path="."}: every entry below `path`, one per line, sorted; directories end in `/`,
      symbolic links in `@` (listed, never entered), other special files in `?`.
    - `read_file` {path, start_line?, end_line?}: the file's text (lines start..end, 1-based, inclusive).
    - `write_file` {path, content}: create or replace a file (parent directories made).
    - `edit_file` {path, old, new}: replace the one occurrence of `old` by `new`; an error says how many
      times `old` occurs when that is not exactly once.
    - `search` {pattern, path="."}: Python regex, `path:line:text` per matching line (links, special and
      binary files skipped); exit 1 when nothing matches. Runs jailed, so a pathological pattern only meets
      the timeout.
    - `run` {command, timeout_s?}: `bash -c command` in the workspace, jailed (actors/sandbox/jailrun.py),
      stdout and stderr together; killed past its timeout (`status` timeout) or its output cap
      (`truncated`, `status` output_limit). `ok` is True when the command ran to its end, whatever its exit.
    - `grade` {files={}, stdlib_under_test=[], command="", timeout_s?}: the hidden tests `files` (path →
      text) in a fresh copy of the workspace (without its `__pycache__`), never in the workspace itself: whatever the copy holds at
      those paths is replaced by them, written last. With no `command`, actors/sandbox/grade_runner.py runs
      the hidden `test*.py` files (isolated interpreter, outside the copy) and reports each test under a
      nonce only this side knows; the reply's `output` is a `GradeReport` (model/tasks/repo_grade.py) as
      JSON, passed only when the one genuine report names every test the hidden files define, each passed,
      and the framework was left as it was. A `command` runs as `bash -c` in the copy and is judged by its
      exit code alone (one pseudo-test). `exit_code` 0: passed.
    - `snapshot` {}: the files changed or added since the session opened (`ToolResult.files`, with sha256
      hex in `digests`) and the opening files deleted since (`deleted`); links and special files are not
      captured (named in `output`). Reopening with the opening files overlaid by these restores the
      workspace.
    - `digest` {}: `output` is `sha256:<hex>` of every regular file's path and content
      (Workspace.tree_digest): a workspace restored from a snapshot has the digest the snapshotted one had.
    Output is capped at `[sandbox] max_output_kb` (`truncated`).
    """
    try:
        return await _TOOLS_IMPL[tool](ws, args, limits, runner, scratch)
    except (WorkspaceError, JailBroken) as err:
        return Reply(False, error=str(err), status="error")


async def _list(ws: Workspace, args: dict[str, Any], limits: ToolLimits, runner: Runner, scratch: Path) -> Reply:
    lines = []
    for rel, kind, _ in ws.entries(args["path"]):
        lines.append(rel + {"dir": "/", "link": "@", "other": "?"}.get(kind, ""))
        if len(lines) >= MAX_ENTRIES:
            break
    output, truncated = _capped("\n".join(lines) + ("\n" if lines else ""), limits.max_output_bytes)
    return Reply(True, output, truncated=truncated or len(lines) >= MAX_ENTRIES)


async def _read(ws: Workspace, args: dict[str, Any], limits: ToolLimits, runner: Runner, scratch: Path) -> Reply:
    text = ws.read_bytes(args["path"]).decode("utf-8", "replace")
    start, end = args["start_line"], args["end_line"]
    if start is not None or end is not None:
        lines = text.splitlines(keepends=True)
        first = max(1, start or 1)
        last = len(lines) if end is None else end
        if last < first:
            return Reply(False, error=f"read_file: end_line {last} is before start_line {first}", status="error")
        text = "".join(lines[first - 1:last])
    output, truncated = _capped(text, limits.max_output_bytes)
    return Reply(True, output, truncated=truncated)


async def _write(ws: Workspace, args: dict[str, Any], limits: ToolLimits, runner: Runner, scratch: Path) -> Reply:
    data = args["content"].encode()
    ws.write_bytes(args["path"], data)
    return Reply(True, f"wrote {len(data)} bytes to {'/'.join(parts_of(args['path']))}\n")


async def _edit(ws: Workspace, args: dict[str, Any], limits: ToolLimits, runner: Runner, scratch: Path) -> Reply:
    path, old, new = args["path"], args["old"], args["new"]
    if not old:
        return Reply(False, error="edit_file: 'old' is empty; give the exact text to replace", status="error")
    try:
        text = ws.read_bytes(path).decode("utf-8")
    except UnicodeDecodeError:
        return Reply(False, error=f"edit_file: {path} is not UTF-8 text", status="error")
    count = text.count(old)
    if count != 1:
        return Reply(False, error=f"edit_file: the old text occurs {count} times in {path}; it must occur "
                                  f"exactly once (add surrounding lines to make it unique)", status="error")
    ws.write_bytes(path, text.replace(old, new, 1).encode())
    return Reply(True, f"edited {path}\n")


def _outcome(out: RunOutcome, limits: ToolLimits, timeout_s: float) -> Reply:
    output, truncated = _capped(out.output, limits.max_output_bytes)
    if out.timed_out:
        return Reply(False, output, f"the command was killed after {timeout_s:g} s (its wall timeout)",
                     truncated, None, "timeout")
    if out.exit_code == -signal.SIGXCPU:        # its CPU-time limit: a busy command can meet it before the wall's
        return Reply(False, output, "the command was killed at its CPU-time limit", truncated, None, "timeout")
    if out.truncated:
        return Reply(False, output, f"the command's output passed {limits.max_output_bytes} bytes; it was "
                                    f"killed", True, None, "output_limit")
    return Reply(True, output, truncated=truncated, exit_code=out.exit_code)


def _timeout(args: dict[str, Any], limits: ToolLimits) -> float:
    asked = args["timeout_s"]
    if asked is not None and asked <= 0:
        raise WorkspaceError(f"timeout_s must be positive, got {asked:g}")
    return limits.max_timeout_s if asked is None else min(asked, limits.max_timeout_s)


async def _search(ws: Workspace, args: dict[str, Any], limits: ToolLimits, runner: Runner, scratch: Path) -> Reply:
    try:
        re.compile(args["pattern"])
    except re.error as err:
        return Reply(False, error=f"search: {args['pattern']!r} is not a valid regular expression: {err}",
                     status="error")
    parts = parts_of(args["path"])
    if parts:
        _exists(ws, parts)
    python, _ = python_in_jail()
    argv = [python, "-I", "-S", "-c", SEARCH_SOURCE, args["pattern"], "/".join(parts) or ".",
            str(limits.max_output_bytes)]
    timeout_s = limits.max_timeout_s
    out = await runner(ws.root, argv, timeout_s)
    reply = _outcome(out, limits, timeout_s)
    if reply.ok and out.exit_code not in (0, 1):
        return Reply(False, reply.output, f"search failed (exit {out.exit_code})", reply.truncated, out.exit_code,
                     "error")
    return reply


def _exists(ws: Workspace, parts: list[str]) -> None:
    """Refuse a search path that is a link or missing (the walk in the jail would skip it silently)."""
    parent = "/".join(parts[:-1]) or "."
    for rel, kind, _ in ws.entries(parent):
        if rel == "/".join(parts):
            if kind == "link":
                raise WorkspaceError(f"{rel} is a symbolic link; links are not followed")
            return
    raise WorkspaceError(f"{'/'.join(parts)}: no such file or directory")


async def _run(ws: Workspace, args: dict[str, Any], limits: ToolLimits, runner: Runner, scratch: Path) -> Reply:
    timeout_s = _timeout(args, limits)
    out = await runner(ws.root, ["bash", "-c", args["command"]], timeout_s)
    return _outcome(out, limits, timeout_s)


async def _grade(ws: Workspace, args: dict[str, Any], limits: ToolLimits, runner: Runner, scratch: Path) -> Reply:
    timeout_s = _timeout(args, limits)
    hidden, command = args["files"], args["command"]
    nonce = secrets.token_hex(16)
    spec_name = f".rlbus-grade-{secrets.token_hex(8)}.json"
    spec = json.dumps({"nonce": nonce, "stdlib_under_test": list(args["stdlib_under_test"]),
                       "tests": {p: t for p, t in hidden.items() if is_test_file(p)}})
    written = sorted(hidden.items()) + ([] if command else [(spec_name, spec)])
    where = scratch / f"grade-{uuid.uuid4().hex[:12]}"
    added = sum(len(text.encode()) for _, text in written)
    fresh: Workspace | None = None
    try:
        fresh = ws.copy_to(where, extra_bytes=added + GRADE_SLACK_BYTES, without_bytecode=True)
        for path, text in written:          # last, over whatever the copy holds there (file, directory or link)
            _clear(where, parts_of(path))
            fresh.write_bytes(path, text.encode())
        python, _ = python_in_jail()
        argv = ["bash", "-c", command] if command else [python, "-I", "-c", GRADE_RUNNER.read_text(), spec_name]
        out = await runner(where, argv, timeout_s)
    finally:
        if fresh is not None:
            fresh.remove()
        shutil.rmtree(where, ignore_errors=True)
    report = judge(out, nonce, hidden, command)
    status = "timeout" if report.verdict == "timeout" else "output_limit" if out.truncated else "ok"
    return Reply(status == "ok", msgspec.json.encode(report).decode(), error=report.problems[0] if report.problems
                 else "", exit_code=0 if report.verdict == "passed" else 1, status=status)


def _clear(root: Path, parts: list[str]) -> None:
    """Make room for a file at `parts` below `root` (a grading copy nothing runs in yet): a link or file where a
    directory is needed, and whatever is at the path itself, removed."""
    where = root
    for i, name in enumerate(parts):
        where = where / name
        try:
            mode = os.lstat(where).st_mode
        except FileNotFoundError:
            return
        last = i == len(parts) - 1
        if stat.S_ISDIR(mode) and not last:
            continue
        if stat.S_ISDIR(mode):
            shutil.rmtree(where)
        else:
            where.unlink()
        return


class _RunnerReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The grade runner's line, after its nonce."""

    tests: dict[str, tuple[str, str]]
    problems: list[str]
    import_errors: dict[str, str]
    log: str


def judge(out: RunOutcome, nonce: str, hidden: Mapping[str, str], command: str) -> GradeReport:
    """The verdict of a grading run: a custom `command` by its exit code; the grade runner by its one line that
    starts with `nonce`, every test the hidden files define (read here) reported, and no problem."""
    log = out.output[-2000:]
    judged_by: Literal["report", "exit_code"] = "exit_code" if command else "report"
    if out.timed_out or out.exit_code == -signal.SIGXCPU:
        return GradeReport(verdict="timeout", problems=("the tests ran past their time limit",), judged_by=judged_by,
                           log=log)
    if command:
        ok = out.exit_code == 0 and not out.truncated
        return GradeReport(verdict="passed" if ok else "failed", judged_by="exit_code", log=log,
                           tests=(TestReport(command, "passed" if ok else "failed", f"exit code {out.exit_code}"),))
    lines = [line[len(nonce):] for line in out.output.splitlines() if line.startswith(nonce)]
    if len(lines) != 1:
        why = "its output passed the cap" if out.truncated else f"exit code {out.exit_code}"
        return GradeReport(verdict="error", log=log, problems=(
            f"no genuine report from the grade runner ({len(lines)} lines carry its nonce; {why})",))
    try:
        raw = msgspec.json.decode(lines[0], type=_RunnerReport)
    except msgspec.DecodeError as err:
        return GradeReport(verdict="error", log=log, problems=(f"the grade runner's report does not decode: {err}",))
    statuses = set(get_args(TestStatus))
    tests = [TestReport(name, status if status in statuses else "failed", detail)  # type: ignore[arg-type]
             for name, (status, detail) in sorted(raw.tests.items())]
    for path, names in sorted(expected_tests(hidden).items()):
        module = module_of(path)
        reported = {t.name.rsplit(".", 1)[-1] for t in tests if t.name.startswith(f"{module}.")}
        why = raw.import_errors.get(path, "defined by the hidden tests, never reported")
        tests += [TestReport(f"{module}.{cls}.{name}", "missing", why) for cls, name in sorted(names)
                  if name not in reported]
    problems = list(raw.problems)
    counted = [t for t in tests if t.status != "not_run"]
    if not counted:
        problems.append("no hidden test ran" + "".join(f"; {p}: {e.strip().splitlines()[-1]}"
                                                       for p, e in raw.import_errors.items() if e.strip()))
    passed = not problems and all(t.status == "passed" for t in counted)
    return GradeReport(verdict="passed" if passed else "failed", tests=tuple(tests), problems=tuple(problems),
                       log=raw.log[-2000:])


async def _snapshot(ws: Workspace, args: dict[str, Any], limits: ToolLimits, runner: Runner, scratch: Path) -> Reply:
    files, digests, deleted, skipped = ws.changed()
    lines = [f"{len(files)} changed or new, {len(deleted)} deleted"]
    lines += [f"not captured (link or special file): {p}" for p in skipped]
    return Reply(True, "\n".join(lines) + "\n", files=files, digests=digests, deleted=deleted)


async def _digest(ws: Workspace, args: dict[str, Any], limits: ToolLimits, runner: Runner, scratch: Path) -> Reply:
    return Reply(True, ws.tree_digest())


_TOOLS_IMPL: Final[dict[str, Callable[[Workspace, dict[str, Any], ToolLimits, Runner, Path], Awaitable[Reply]]]] = {
    "list_files": _list, "read_file": _read, "write_file": _write, "edit_file": _edit, "search": _search,
    "run": _run, "grade": _grade, "snapshot": _snapshot,
    "digest": _digest,
}
assert set(_TOOLS_IMPL) == set(TOOLS)


__all__ = ["JAILED", "TOOLS", "Reply", "Runner", "ToolArgsError", "ToolLimits", "check_args", "judge", "run_tool"]
