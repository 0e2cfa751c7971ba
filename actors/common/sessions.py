"""How generators and evaluators use sandbox sessions: open, call tools, grade, snapshot, close, over request/reply.

- Owns: `open_session`, `call_tool`, `snapshot_session`, `close_session`, `restore_files` (the opening files
  overlaid by a snapshot), `grade_args`, `SandboxSession` (tool, grade, snapshot, digest, close; an async context
  manager) and `SessionPort`, the environment's `WorkspacePort` over a session (`answered`: gone or busy raises).
- Guarantee: every call renews the session's lease; a session whose holder stops calling is destroyed by its
  supervisor after `lease_s`.
- Does not: run tools (actors/sandbox/), parse a model's tool calls or render results (model/).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Final

import nats.errors

from rlbus.messages import codec
from rlbus.messages.bus import Bus
from rlbus.messages.errors import SandboxCrashed
from rlbus.messages.schemas import (
    SessionClose,
    SessionClosed,
    SessionOpen,
    SessionOpened,
    ToolCall,
    ToolResult,
)
from rlbus.model.tasks.repo import RepoTask
from rlbus.model.tasks.repo_grade import DEFAULT_COMMAND, GradeReport, report_of
from rlbus.model.tools.calls import ToolOutcome

REPLY_GRACE_S: Final = 10.0
"""Time beyond a call's own timeout a requester waits (queueing under the quota, the bus)."""
OPEN_TIMEOUT_S: Final = 10.0


class SessionRefused(SandboxCrashed):
    """No session could be opened (the supervisor said why, or none answered)."""


async def _request(bus: Bus, subject: str, message: Any, timeout_s: float) -> Any:
    data, headers = codec.encode(message)
    try:
        msg = await bus.nc.request(subject, data, timeout=timeout_s, headers=headers or None)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as err:
        raise SandboxCrashed(f"no reply on {subject} within {timeout_s:g}s: {type(err).__name__}") from err
    return codec.decode(msg.data, msg.headers)


async def open_session(bus: Bus, region: str, files: Mapping[str, bytes], lease_s: float = 60.0,
                       timeout_s: float = OPEN_TIMEOUT_S, **limits: int) -> str:
    """A new session in `region` seeded with `files`; its id.

    :raises SessionRefused: the supervisor refused (its reason inside) or none answered.
    """
    request = SessionOpen(files=dict(files), lease_s=lease_s, **limits)
    try:
        answer = await _request(bus, bus.subjects.session_open(region), request, timeout_s)
    except SandboxCrashed as err:
        raise SessionRefused(f"no sandbox session opened in {region}: {err}") from err
    if not isinstance(answer, SessionOpened) or not answer.ok:
        why = answer.error if isinstance(answer, SessionOpened) else f"a {type(answer).__name__} came back"
        raise SessionRefused(f"no sandbox session opened in {region}: {why}")
    return answer.session_id


async def call_tool(bus: Bus, region: str, session_id: str, tool: str, args: Mapping[str, Any], *,
                    call_id: str | None = None, timeout_s: float = 30.0) -> ToolResult:
    """One tool call; its result (a refused call is a result with ok=False, not a raise).

    :raises SandboxCrashed: no reply within `timeout_s` (the supervisor is gone or overloaded).
    :raises SubjectError: `session_id` is not one `open_session` returned.
    """
    subject = bus.subjects.session_calls(region, bus.subjects.session_host(session_id))
    call = ToolCall(session_id=session_id, call_id=call_id or uuid.uuid4().hex[:16], tool=tool, args=dict(args))
    answer = await _request(bus, subject, call, timeout_s)
    if not isinstance(answer, ToolResult):
        raise SandboxCrashed(f"a {type(answer).__name__} came back for tool call {call.call_id}")
    return answer


async def snapshot_session(bus: Bus, region: str, session_id: str, *, timeout_s: float = 30.0) -> ToolResult:
    """The files changed since the session opened (`files`, `digests`) and the opening files deleted."""
    return await call_tool(bus, region, session_id, "snapshot", {}, timeout_s=timeout_s)


async def close_session(bus: Bus, region: str, session_id: str, *, timeout_s: float = 10.0) -> bool:
    """Destroy the session now; False when it was already gone (closed or expired)."""
    subject = bus.subjects.session_calls(region, bus.subjects.session_host(session_id))
    answer = await _request(bus, subject, SessionClose(session_id=session_id), timeout_s)
    return isinstance(answer, SessionClosed) and answer.existed


def restore_files(base: Mapping[str, bytes], snapshot: ToolResult) -> dict[str, bytes]:
    """The files to open a session with to restore a snapshotted workspace: `base` (the opening files)
    without the deleted ones, overlaid by the changed ones."""
    files = {k: v for k, v in base.items() if k.strip("/") not in set(snapshot.deleted)}
    files.update(snapshot.files)
    return files


class SandboxSession:
    """A session held for one episode: the port an environment calls (`tool`, `grade`, `snapshot`, `close`).

    `await SandboxSession.open(bus, region, files)`, or `async with` one to close it at the end.
    """

    def __init__(self, bus: Bus, region: str, session_id: str, *, call_timeout_s: float = 30.0) -> None:
        self.bus = bus
        self.region = region
        self.session_id = session_id
        self.call_timeout_s = call_timeout_s
        self.closed = False
        self._ids = itertools.count()

    @classmethod
    async def open(cls, bus: Bus, region: str, files: Mapping[str, bytes], lease_s: float = 60.0,
                   timeout_s: float = OPEN_TIMEOUT_S, **limits: int) -> SandboxSession:
        return cls(bus, region, await open_session(bus, region, files, lease_s, timeout_s, **limits))

    async def tool(self, name: str, args: Mapping[str, Any]) -> ToolResult:
        """Call tool `name`; waits the call's own timeout (if it has one) plus REPLY_GRACE_S."""
        asked = args.get("timeout_s")
        own = float(asked) if isinstance(asked, (int, float)) and not isinstance(asked, bool) else 0.0
        wait = max(self.call_timeout_s, own + REPLY_GRACE_S)     # a misshapen timeout is the supervisor's to refuse
        return await call_tool(self.bus, self.region, self.session_id, name, args,
                               call_id=f"{self.session_id}-{next(self._ids)}", timeout_s=wait)

    async def grade(self, files: Mapping[str, str], command: str = DEFAULT_COMMAND, timeout_s: float | None = None,
                    *, stdlib_under_test: Sequence[str] = ()) -> GradeReport:
        """Grade a fresh copy of the workspace with the hidden `files` written last: the grade runner's per-test
        report (the default `command`), or a custom command judged by its exit code; a refused call is an `error`
        verdict saying why."""
        result = await self.tool("grade", grade_args(files, command, stdlib_under_test, timeout_s))
        return report_of(result.output, result.error)

    async def snapshot(self) -> ToolResult:
        return await self.tool("snapshot", {})

    async def digest(self) -> str:
        """`sha256:<hex>` of the workspace's files (the `digest` tool).

        :raises SandboxCrashed: no reply, or the session refused the call (gone, busy).
        """
        result = await self.tool("digest", {})
        if not result.ok:
            raise SandboxCrashed(f"digest of session {self.session_id}: {result.status} ({result.error[:200]})")
        return result.output

    async def close(self) -> bool:
        if self.closed:
            return False
        self.closed = True
        return await close_session(self.bus, self.region, self.session_id)

    async def __aenter__(self) -> SandboxSession:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            await self.close()
        except SandboxCrashed:
            pass                       # the lease ends it


__all__ = ["SandboxSession", "SessionRefused", "call_tool", "close_session", "open_session", "restore_files",
           "snapshot_session"]


def grade_args(hidden_tests: Mapping[str, str], command: str = DEFAULT_COMMAND, stdlib_under_test: Sequence[str] = (),
               timeout_s: float | None = None) -> dict[str, Any]:
    """The `grade` tool's arguments: the hidden tests, the command, the standard-library modules the workspace's
    copies replace, and the grade's wall limit when one is given (else the sandbox's)."""
    args: dict[str, Any] = {"files": dict(hidden_tests), "command": command,
                            "stdlib_under_test": list(stdlib_under_test)}
    if timeout_s is not None:
        args["timeout_s"] = timeout_s
    return args


def answered(result: ToolResult) -> ToolResult:
    """`result`, unless the session was gone or busy: then SandboxCrashed (the session is lost)."""
    if result.status in ("no_session", "busy"):
        raise SandboxCrashed(f"session {result.session_id}: {result.status} ({result.error[:200]})")
    return result


class SessionPort:
    """An episode's `WorkspacePort` (model/env/base.py) over its sandbox session. A call the sandbox does not
    answer, or that finds the session gone or busy, raises SandboxCrashed."""

    def __init__(self, session: SandboxSession) -> None:
        self.session = session

    async def tool(self, name: str, args: Mapping[str, Any]) -> ToolOutcome:
        result = answered(await self.session.tool(name, args))
        return ToolOutcome(output=result.output, error=result.error, exit_code=result.exit_code,
                           timed_out=result.status == "timeout")

    async def grade_workspace(self, task: RepoTask) -> GradeReport:
        args = grade_args(task.hidden_tests, task.test_command, task.stdlib_under_test, task.timeout_s)
        result = answered(await self.session.tool("grade", args))
        return report_of(result.output, result.error)
