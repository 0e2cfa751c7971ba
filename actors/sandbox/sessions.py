"""The sessions one sandbox supervisor holds: workspaces that persist across tool calls, under leases.

Owns: `SessionHost`: opening a session (a workspace under the supervisor's scratch root, seeded with the
opening files, owned by the sandbox uid when root), answering its tool calls one at a time (actors/sandbox/
tools.py), renewing its lease on every call, and destroying it on close, when its lease runs out (`reap`)
and when the supervisor stops (`close_all`); a call in flight when its session goes is cancelled and its
jail killed. At most `[sandbox] max_sessions` are open. A session is a workspace, not an executor: its
jailed calls (`run`, `grade`, `search`) take a slot of the supervisor's concurrency limiter like any
snippet, so the sessions of a group queue for the same quota. Per-tool latency (median of the recent
calls) and the open sessions are kept for the heartbeat.
Does not: talk to NATS (actors/sandbox/supervisor.py), do file or jail work itself (workspace.py,
jailrun.py).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import anyio
import structlog

from rlbus.actors.sandbox.config import SandboxConfig
from rlbus.actors.sandbox.jailrun import RunLimits, RunOutcome, run_jailed
from rlbus.actors.sandbox.pool import SANDBOX_UID, Isolation
from rlbus.actors.sandbox.tools import TOOLS, ToolArgsError, ToolLimits, check_args, run_tool
from rlbus.actors.sandbox.workspace import Workspace, WorkspaceError
from rlbus.messages.schemas import SessionOpen, SessionOpened, ToolCall, ToolResult

log = structlog.get_logger()

REAP_INTERVAL_S: Final = 0.25
"""How often leases are checked."""
LATENCY_WINDOW: Final = 64
"""Recent calls per tool whose median the heartbeat shows."""
MAX_ID: Final = 256


@dataclass(eq=False)
class Session:
    """One open session: its workspace, lease and the calls in flight."""

    session_id: str
    workspace: Workspace
    lease_s: float
    deadline: float
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    scopes: set[anyio.CancelScope] = field(default_factory=set)
    closed: bool = False
    calls: int = 0

    def renew(self) -> None:
        self.deadline = time.monotonic() + self.lease_s


class SessionHost:
    """Sessions of one supervisor. `limiter` is the supervisor's concurrency limiter; `busy` marks it busy."""

    def __init__(self, config: SandboxConfig, level: Isolation, limiter: anyio.CapacityLimiter,
                 busy: Callable[[], AbstractContextManager[None]], *, scratch_root: str | None = None) -> None:
        self.config = config
        self.level = level
        self.limiter = limiter
        self.busy = busy
        self.sessions: dict[str, Session] = {}
        self.root = Path(tempfile.mkdtemp(prefix="rlbus-sessions-", dir=scratch_root or _scratch_dir()))
        self.root.chmod(0o711)
        self.uid = SANDBOX_UID if os.geteuid() == 0 else None
        self.latency: dict[str, deque[float]] = {name: deque(maxlen=LATENCY_WINDOW) for name in TOOLS}
        self.last_ms: dict[str, float] = {}
        self.expired = 0
        self.opened = 0
        self.limits = ToolLimits(max_output_bytes=config.max_output_kb << 10, max_timeout_s=config.wall_seconds)

    # ---- open / close -----------------------------------------------------------------------------
    def open(self, request: SessionOpen, session_id: str) -> SessionOpened:
        """Make and seed a workspace; refused past `max_sessions` or when the files do not fit."""
        if len(self.sessions) >= self.config.max_sessions:
            return SessionOpened(ok=False, isolation=self.level,
                                 error=f"this sandbox supervisor holds {len(self.sessions)} sessions, its limit "
                                       f"([sandbox] max_sessions = {self.config.max_sessions}); retry later")
        if not request.lease_s > 0:
            return SessionOpened(ok=False, isolation=self.level, error=f"lease_s must be positive, got {request.lease_s}")
        max_file = self.config.max_file_mb << 20
        max_total = self.config.workspace_mb << 20
        if request.max_file_kb is not None:
            max_file = min(max_file, max(0, request.max_file_kb) << 10)
        if request.max_workspace_kb is not None:
            max_total = min(max_total, max(0, request.max_workspace_kb) << 10)
        lease = min(request.lease_s, self.config.max_lease_s)
        ws = Workspace(self.root / session_id, max_file_bytes=max_file, max_total_bytes=max_total, uid=self.uid)
        try:
            ws.seed(dict(request.files))
        except WorkspaceError as err:
            ws.remove()
            return SessionOpened(ok=False, isolation=self.level, error=f"cannot seed the workspace: {err}")
        self.sessions[session_id] = Session(session_id, ws, lease, time.monotonic() + lease)
        self.opened += 1
        return SessionOpened(session_id=session_id, ok=True, isolation=self.level, lease_s=lease)

    async def close(self, session_id: str) -> bool:
        """Destroy a session now: cancel its call in flight (its jail is killed), remove the workspace.
        False when there was no such session."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        session.closed = True
        for scope in list(session.scopes):
            scope.cancel()
        with anyio.CancelScope(shield=True):
            async with session.lock:             # the cancelled call has finished with the workspace
                session.workspace.remove()
        return True

    async def close_all(self) -> None:
        """Every session destroyed, then the scratch root removed (the supervisor stops)."""
        with anyio.CancelScope(shield=True):
            for sid in list(self.sessions):
                await self.close(sid)
            shutil.rmtree(self.root, ignore_errors=True)

    async def reap(self) -> None:
        """Forever: destroy sessions whose lease ran out (a session with a call in flight is not idle)."""
        while True:
            await anyio.sleep(REAP_INTERVAL_S)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if not session.scopes and session.deadline < now:
                    log.info("sandbox_session_expired", session_id=session.session_id, lease_s=session.lease_s)
                    self.expired += 1
                    await self.close(session.session_id)

    # ---- calls ------------------------------------------------------------------------------------
    async def call(self, call: ToolCall) -> ToolResult:
        """Answer one tool call (calls of one session run one at a time, in arrival order)."""
        started = time.monotonic()

        def result(ok: bool, *, error: str = "", status: str = "ok", **kw: object) -> ToolResult:
            return ToolResult(session_id=call.session_id, call_id=call.call_id, ok=ok, error=error, status=status,
                              elapsed_ms=round((time.monotonic() - started) * 1000, 3), **kw)  # type: ignore[arg-type]

        session = self.sessions.get(call.session_id)
        if session is None:
            return result(False, status="no_session",
                          error=f"no session {call.session_id!r} here (closed, expired, or never opened)")
        session.renew()
        try:
            args = check_args(call.tool, call.args)
        except ToolArgsError as err:
            return result(False, error=str(err), status="error")
        with anyio.CancelScope() as scope:
            session.scopes.add(scope)
            try:
                async with session.lock:
                    if session.closed:
                        scope.cancel()
                    await anyio.lowlevel.checkpoint()
                    reply = await run_tool(session.workspace, call.tool, args, self.limits, self._runner,
                                           self.root)
            finally:
                session.scopes.discard(scope)
                session.renew()
        if scope.cancelled_caught:
            return result(False, status="no_session", error=f"session {call.session_id!r} was closed during the call")
        session.calls += 1
        elapsed = (time.monotonic() - started) * 1000
        self.latency[call.tool].append(elapsed)
        self.last_ms[call.tool] = elapsed
        return result(reply.ok, error=reply.error, status=reply.status, output=reply.output,
                      truncated=reply.truncated, exit_code=reply.exit_code, files=reply.files or {},
                      digests=reply.digests or {}, deleted=reply.deleted or [])

    async def _runner(self, where: Path, argv: list[str], timeout_s: float) -> RunOutcome:
        """A jailed process under the supervisor's quota and the `[sandbox]` limits."""
        c = self.config
        limits = RunLimits(timeout_s=timeout_s, cpu_seconds=c.cpu_seconds, memory_mb=c.memory_mb,
                           max_processes=c.max_processes, max_file_mb=c.max_file_mb,
                           max_open_files=c.max_open_files, max_output_bytes=self.limits.max_output_bytes)
        async with self.limiter:
            with self.busy():
                return await run_jailed(self.level, where, argv, limits)

    # ---- health -----------------------------------------------------------------------------------
    def gauges(self) -> dict[str, float]:
        out = {"sessions_open": float(len(self.sessions)), "sessions_expired": float(self.expired),
               "sessions_opened": float(self.opened)}
        for tool, samples in self.latency.items():
            if samples:
                out[f"tool_{tool}_ms"] = round(statistics.median(samples), 3)
                out[f"tool_{tool}_last_ms"] = round(self.last_ms[tool], 3)
        return out


def _scratch_dir() -> str:
    """A tmpfs when there is one, else the temp dir (the pool's choice, for the same reasons)."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def too_long(*ids: str) -> str | None:
    """The first id longer than MAX_ID characters, for a refusal."""
    return next((i for i in ids if len(i) > MAX_ID), None)


__all__ = ["Session", "SessionHost", "too_long"]
