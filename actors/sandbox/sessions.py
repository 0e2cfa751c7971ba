"""The sessions one sandbox supervisor holds: workspaces that persist across tool calls, under leases.

- Owns: `SessionHost`: opening a session, answering its tool calls one at a time (actors/sandbox/tools.py),
  renewing its lease on every call, destroying it on close, lease expiry (`reap`) and stop (`close_all`),
  spare jails (`maintain_spares`); and `reclaim_orphans` (what killed supervisors left).
- Guarantee: at most `[sandbox] max_sessions` open; a call in flight when its session goes is cancelled and
  its jail killed.
- Does not: talk to NATS (actors/sandbox/supervisor.py), do file or jail work itself
  (actors/sandbox/workspace.py, actors/sandbox/jailrun.py).
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import anyio
import structlog

from rlbus.actors.sandbox.config import SandboxConfig
from rlbus.actors.sandbox.jailrun import JailBroken, RunLimits, RunOutcome, SessionJail, run_jailed
from rlbus.actors.sandbox.pool import SANDBOX_UID, Isolation
from rlbus.actors.sandbox.tools import TOOLS, ToolArgsError, ToolLimits, check_args, run_tool
from rlbus.actors.sandbox.workspace import Workspace, WorkspaceError, unmount
from rlbus.messages.schemas import SessionOpen, SessionOpened, ToolCall, ToolResult

log = structlog.get_logger()

ROOT_PREFIX: Final = "rlbus-sessions-"
"""A supervisor's session root is `<scratch>/rlbus-sessions-<its pid>-<random>`."""
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
    jail: SessionJail | None = None

    def renew(self) -> None:
        self.deadline = time.monotonic() + self.lease_s


class SessionHost:
    """Sessions of one supervisor. `limiter` is the supervisor's concurrency limiter; `busy` marks it busy.

    A session is a workspace under the supervisor's scratch root, seeded with the opening files, owned by
    the sandbox uid when root. It is a workspace, not an executor: its jailed calls (`run`, `search`;
    `grade` too) take a slot of the supervisor's concurrency limiter like any snippet, so the sessions of a
    group queue for the same quota. At the bwrap level each session has its own long-lived jail
    (jailrun.SessionJail: the workspace bound, actors/sandbox/runner.py as pid 1, a fork and exec per call,
    every process of a call killed before it answers); from the first open on, `[sandbox] session_spares`
    of them are kept started ahead on empty workspaces (`maintain_spares`), so an open adopts one; a session
    without one, or whose jail broke, starts one at its next jailed call. `grade` runs in a fresh jail on a
    fresh copy. Other levels start a fresh jail per call (jailrun.run_jailed). Per-tool latency (median of
    the recent calls) and the open sessions are kept for the heartbeat. A new host first removes what
    supervisors killed without cleaning up left under the scratch root (`reclaim_orphans`: roots named by a
    pid that runs no more).
    """

    def __init__(self, config: SandboxConfig, level: Isolation, limiter: anyio.CapacityLimiter,
                 busy: Callable[[], AbstractContextManager[None]], *, scratch_root: str | None = None) -> None:
        self.config = config
        self.level = level
        self.limiter = limiter
        self.busy = busy
        self.sessions: dict[str, Session] = {}
        scratch = scratch_root or scratch_dir()
        reclaim_orphans(scratch)
        self.root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-", dir=scratch))
        self.root.chmod(0o711)
        self.uid = SANDBOX_UID if os.geteuid() == 0 else None
        self.latency: dict[str, deque[float]] = {name: deque(maxlen=LATENCY_WINDOW) for name in TOOLS}
        self.last_ms: dict[str, float] = {}
        self.expired = 0
        self.opened = 0
        self.limits = ToolLimits(max_output_bytes=config.max_output_kb << 10, max_timeout_s=config.wall_seconds)
        self.spares: list[tuple[Workspace, SessionJail]] = []
        self._background: list[SessionJail] = []
        self._spare_wanted = anyio.Event()
        self._first_open = anyio.Event()
        self.jails_started = 0
        self.jails_broken = 0
        self.spare_misses = 0

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
        self._first_open.set()
        jail: SessionJail | None = None
        if self.spares:
            ws, jail = self.spares.pop()
            ws.max_file_bytes, ws.max_total_bytes = max_file, max_total
            self._spare_wanted.set()
        else:
            if self.level == "bwrap" and self.config.session_spares:
                self.spare_misses += 1
            ws = self._workspace(max_file, max_total)
        try:
            ws.seed(dict(request.files))
        except WorkspaceError as err:
            ws.remove()
            if jail is not None:
                self._discard(jail)
            return SessionOpened(ok=False, isolation=self.level, error=f"cannot seed the workspace: {err}")
        self.sessions[session_id] = Session(session_id, ws, lease, time.monotonic() + lease, jail=jail)
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
                if session.jail is not None:
                    await session.jail.kill()
                session.workspace.remove()
        return True

    def _workspace(self, max_file: int, max_total: int) -> Workspace:
        """A new, empty workspace directory (on a tmpfs of `workspace_mb` when root)."""
        return Workspace(self.root / f"ws-{uuid.uuid4().hex[:16]}", max_file_bytes=max_file, max_total_bytes=max_total,
                         uid=self.uid, quota_bytes=self.config.workspace_mb << 20)

    def _discard(self, jail: SessionJail) -> None:
        """A jail to kill outside a synchronous path (`maintain_spares` does it)."""
        self._background.append(jail)
        self._spare_wanted.set()

    async def maintain_spares(self) -> None:
        """Forever (bwrap only), from the first open on (a supervisor that never holds a session starts no
        jail): keep `session_spares` jails started on empty workspaces; a failed start is logged and retried
        after a pause."""
        if self.level != "bwrap":
            return
        await self._first_open.wait()
        while True:
            self._spare_wanted = anyio.Event()
            while self._background:
                await self._background.pop().kill()
            while len(self.spares) < self.config.session_spares:
                ws = self._workspace(0, 0)
                try:
                    jail = await SessionJail.start(ws.root, tmpfs_mb=self.config.workspace_mb)
                except JailBroken as err:
                    ws.remove()
                    log.warning("sandbox_session_jail_start_failed", error=str(err))
                    await anyio.sleep(1.0)
                    continue
                except BaseException:            # stopping mid-start: the jail is killed by start itself
                    ws.remove()
                    raise
                self.jails_started += 1
                self.spares.append((ws, jail))
            if len(self.spares) >= self.config.session_spares and not self._background:
                await self._spare_wanted.wait()

    async def close_all(self) -> None:
        """Every session and spare jail destroyed, then the scratch root removed (the supervisor stops)."""
        with anyio.CancelScope(shield=True):
            for sid in list(self.sessions):
                await self.close(sid)
            for jail in [j for _, j in self.spares] + self._background:
                await jail.kill()
            for ws, _ in self.spares:
                ws.remove()
            self.spares.clear()
            self._background.clear()
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
                    reply = await run_tool(session.workspace, call.tool, args, self.limits,
                                           functools.partial(self._runner, session), self.root)
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

    async def _runner(self, session: Session, where: Path, argv: list[str], timeout_s: float) -> RunOutcome:
        """A jailed process under the supervisor's quota and the `[sandbox]` limits: in the session's own jail
        when it runs in the session's workspace at the bwrap level, else in a fresh jail."""
        c = self.config
        limits = RunLimits(timeout_s=timeout_s, cpu_seconds=c.cpu_seconds, memory_mb=c.memory_mb,
                           max_processes=c.max_processes, max_file_mb=c.max_file_mb,
                           max_open_files=c.max_open_files, max_output_bytes=self.limits.max_output_bytes)
        async with self.limiter:
            with self.busy():
                if self.level != "bwrap" or where != session.workspace.root:
                    return await run_jailed(self.level, where, argv, limits)
                try:
                    if session.jail is None or not session.jail.alive:
                        session.jail = await SessionJail.start(where, tmpfs_mb=c.workspace_mb)
                        self.jails_started += 1
                    return await session.jail.run(argv, limits)
                except JailBroken as err:
                    self.jails_broken += 1
                    session.jail = None
                    log.warning("sandbox_session_jail_broken", session_id=session.session_id, error=str(err))
                    raise JailBroken(f"the session's jail broke ({err}); the next call starts another") from None

    # ---- health -----------------------------------------------------------------------------------
    def gauges(self) -> dict[str, float]:
        out = {"sessions_open": float(len(self.sessions)), "sessions_expired": float(self.expired),
               "sessions_opened": float(self.opened), "session_spares": float(len(self.spares)),
               "session_jails_started": float(self.jails_started), "session_jails_broken": float(self.jails_broken),
               "session_spare_misses": float(self.spare_misses)}
        for tool, samples in self.latency.items():
            if samples:
                out[f"tool_{tool}_ms"] = round(statistics.median(samples), 3)
                out[f"tool_{tool}_last_ms"] = round(self.last_ms[tool], 3)
        return out


def reclaim_orphans(scratch: str) -> list[Path]:
    """Remove the session roots under `scratch` of supervisors that died without cleaning up (SIGKILL): their
    pid (in the name) runs no more. Their workspaces' tmpfs mounts are detached first. The roots removed."""
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    removed = []
    for root in Path(scratch).glob(f"{ROOT_PREFIX}*-*"):
        pid = root.name[len(ROOT_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        for mount in mounts:
            if mount.startswith(f"{root}/"):
                unmount(Path(mount))
        shutil.rmtree(root, ignore_errors=True)
        removed.append(root)
    return removed


def scratch_dir() -> str:
    """A tmpfs when there is one, else the temp dir (the pool's choice, for the same reasons)."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def too_long(*ids: str) -> str | None:
    """The first id longer than MAX_ID characters, for a refusal."""
    return next((i for i in ids if len(i) > MAX_ID), None)


__all__ = ["ROOT_PREFIX", "Session", "SessionHost", "reclaim_orphans", "scratch_dir", "too_long"]
