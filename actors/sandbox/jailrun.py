"""One shell command in a fresh jail with one session's workspace as its only writable directory.

- Owns: the command line of a per-call jail at each isolation level (`jail_argv`), `run_jailed` (output
  captured up to a cap, the jail killed past it or at its wall timeout, the exit code returned) and
  `SessionJail` (a long-lived jail for one session).
- Guarantee: under bwrap and unshare, killing the jail takes every process of the call with it; the
  weaker levels are spelled out on `jail_argv`.
- Does not: decide limits or parse tool calls (actors/sandbox/tools.py), touch NATS.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from subprocess import DEVNULL, PIPE, STDOUT
from typing import Any, Final

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from rlbus.actors.sandbox.pool import (
    SANDBOX_UID,
    Isolation,
    _processes_of,
    descendants,
    receive_frame,
    sandbox_python,
)

JAIL_WORKSPACE: Final = "/workspace"
"""Where the workspace is inside a bwrap jail (other levels run in the host path itself)."""
_SYSTEM_DIRS: Final = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_PATH: Final = "/usr/local/bin:/usr/bin:/bin"
CALL_ENV: Final = {"PATH": _PATH, "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
"""A call's environment (HOME added): no bytecode written, so an edit never runs against an older compile."""
DRAIN_S: Final = 2.0
"""After a kill, how long the output pipe may take to reach EOF (every writer is dead by then)."""


@dataclass(frozen=True, slots=True)
class RunLimits:
    """Per-call limits of a jailed command."""

    timeout_s: float
    cpu_seconds: float
    memory_mb: int
    max_processes: int
    max_file_mb: int
    max_open_files: int
    max_output_bytes: int


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """What a jailed command did: exit code (None when killed), combined output, and why it stopped."""

    exit_code: int | None
    output: str
    truncated: bool
    timed_out: bool
    elapsed_ms: float


def _is_root() -> bool:
    return os.geteuid() == 0


def python_in_jail() -> tuple[str, str]:
    """(interpreter, prefix) a jailed command can run (stdlib only is needed by the search tool)."""
    return sandbox_python(for_other_uid=_is_root())


def bwrap_prefix(workspace: Path, *, tmpfs_mb: int | None = None) -> list[str]:
    """The bwrap command line up to the command: `workspace` at /workspace (cwd, HOME), the rest as documented."""
    drop = ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups",
            "--pdeathsig=KILL"] if _is_root() else []
    out = [*drop, "bwrap", "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
           "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            out += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            out += ["--ro-bind", d, d]
    _, prefix = python_in_jail()
    if not prefix.startswith("/usr"):
        out += ["--ro-bind", prefix, prefix]
    size = ["--size", str(tmpfs_mb << 20)] if tmpfs_mb is not None else []
    return [*out, "--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/tmp", "--bind", str(workspace),
            JAIL_WORKSPACE, "--chdir", JAIL_WORKSPACE, "--setenv", "HOME", JAIL_WORKSPACE]


def jail_argv(level: Isolation, workspace: Path, argv: list[str], limits: RunLimits) -> tuple[list[str], str]:
    """(command line, cwd) running `argv` in `workspace` at `level` under `limits`.

    - bwrap: user, pid, net, ipc, uts and mount namespaces as uid 65534 (a root supervisor drops to 65534 on
      the host first, so RLIMIT_NPROC holds), read-only /usr and system dirs, fresh /proc, /dev and /tmp,
      the workspace bound read-write at /workspace and nothing else of the host. --die-with-parent: killing
      the bwrap process kills pid 1 of the namespace, which takes every process of the call with it
      (`setsid` does not leave a pid namespace), and a call's processes never outlive it.
    - unshare (root): pid, net, ipc, uts and mount namespaces, uid 65534 with no capabilities, cwd the
      workspace; the kill takes the namespace's pid 1 (and so every process in it). Weaker: the host's file
      system is visible, and writable wherever uid 65534 may write (every session's workspace is 65534's, so
      one call can reach another session's files).
    - rlimits-only: a new session and process group as uid 65534 (when root) with the rlimits; the timeout
      kills the process group. Weaker: no network isolation, the host's file system as above, and a process
      that calls `setsid` escapes the kill.
    Every level runs `prlimit` (CPU, address space, processes, file size, open files, no core) then
    `bash -c COMMAND`, with a clean environment (HOME and cwd the workspace).
    """
    cpu = max(1, int(-(-limits.cpu_seconds // 1)))
    nproc = limits.max_processes
    if level != "bwrap":           # no user namespace: RLIMIT_NPROC counts the uid's processes host-wide
        nproc += _processes_of(SANDBOX_UID if _is_root() else os.geteuid())
    limited = ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_mb << 20}",
               f"--nproc={nproc}", f"--fsize={limits.max_file_mb << 20}",
               f"--nofile={limits.max_open_files}", "--core=0", "--", *argv]
    drop = ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups"] if _is_root() else []
    if level == "bwrap":
        return [*bwrap_prefix(workspace), *limited], "/"
    if level == "unshare":
        caps = ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--pdeathsig=KILL"]
        out = ["setpriv", "--pdeathsig=KILL", "unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc",
               "--net", "--ipc", "--uts", "--", *drop, *caps, *limited]
        return out, str(workspace)
    return [*drop, *limited], str(workspace)


async def run_jailed(level: Isolation, workspace: Path, argv: list[str], limits: RunLimits) -> RunOutcome:
    """Run `argv` jailed in `workspace`; kill the jail at `limits.timeout_s` or past the output cap.

    Cancellation kills the jail too (a closed or expired session's call).
    """
    cmd, cwd = jail_argv(level, workspace, argv, limits)
    home = JAIL_WORKSPACE if level == "bwrap" else str(workspace)
    env = {**CALL_ENV, "HOME": home}
    started = time.perf_counter()
    process = await anyio.open_process(cmd, stdin=DEVNULL, stdout=PIPE, stderr=STDOUT, env=env, cwd=cwd,
                                       start_new_session=True)
    chunks: list[bytes] = []
    got = 0
    truncated = timed_out = False
    try:
        assert process.stdout is not None
        with anyio.move_on_after(limits.timeout_s) as scope:
            async for chunk in process.stdout:
                chunks.append(chunk)
                got += len(chunk)
                if got > limits.max_output_bytes:
                    truncated = True
                    break
            if not truncated:
                await process.wait()
        timed_out = scope.cancelled_caught
        if truncated or timed_out:
            _kill(process, level)
            with anyio.move_on_after(DRAIN_S):
                async for _ in process.stdout:   # drain: every writer is dead, EOF comes
                    pass
    finally:
        if process.returncode is None:
            _kill(process, level)
        with anyio.CancelScope(shield=True), anyio.move_on_after(5.0):
            await process.wait()
        await process.aclose()
    output = b"".join(chunks)[:limits.max_output_bytes].decode("utf-8", "replace")
    killed = truncated or timed_out
    return RunOutcome(None if killed else process.returncode, output, truncated, timed_out,
                      (time.perf_counter() - started) * 1000)


RUNNER_SOURCE: Final = Path(__file__).with_name("runner.py")
START_TIMEOUT_S: Final = 15.0
"""A session jail must say it is ready within this."""
REPLY_GRACE_S: Final = 5.0
"""A session jail that has not answered `timeout_s + REPLY_GRACE_S` after a request is killed as hung."""


class JailBroken(Exception):
    """A session jail died, hung or did not start; the session starts another for its next call."""


class SessionJail:
    """A long-lived bwrap jail with one workspace bound read-write at /workspace and actors/sandbox/runner.py
    as pid 1, running the session's calls one at a time (a fork and exec per call instead of a new jail)."""

    def __init__(self, process: Process, reader: BufferedByteReceiveStream, workspace: Path) -> None:
        self.process = process
        self.reader = reader
        self.workspace = workspace
        self.calls = 0

    @classmethod
    async def start(cls, workspace: Path, *, tmpfs_mb: int) -> SessionJail:
        """Start a jail on `workspace` and wait for its runner's ready frame.

        :raises JailBroken: it exited or stayed silent.
        """
        python, _ = python_in_jail()
        argv = [*bwrap_prefix(workspace, tmpfs_mb=tmpfs_mb), "--as-pid-1",
                python, "-I", "-S", "-c", RUNNER_SOURCE.read_text(), JAIL_WORKSPACE]
        process = await anyio.open_process(argv, stdin=PIPE, stdout=PIPE, stderr=DEVNULL,
                                           env={"PATH": _PATH, "LANG": "C.UTF-8"}, cwd="/", start_new_session=True)
        assert process.stdout is not None
        jail = cls(process, BufferedByteReceiveStream(process.stdout), workspace)
        try:
            with anyio.fail_after(START_TIMEOUT_S):
                hello = await jail._receive()
        except (TimeoutError, JailBroken) as err:
            await jail.kill()
            raise JailBroken(f"the session jail did not start: {err!r}") from None
        except BaseException:                    # cancelled while it started: nothing of it is left
            await jail.kill()
            raise
        if not hello.get("ready"):
            await jail.kill()
            raise JailBroken(f"the session jail said {hello!r} instead of ready")
        return jail

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def _receive(self) -> dict[str, Any]:
        return await receive_frame(self.reader, JailBroken, "session jail")

    async def run(self, argv: list[str], limits: RunLimits) -> RunOutcome:
        """One call in this jail. Cancellation kills the jail (its state is then unknown).

        :raises JailBroken: the jail died or hung (it is killed).
        """
        assert self.process.stdin is not None
        env = {**CALL_ENV, "HOME": JAIL_WORKSPACE}
        request = {"argv": argv, "timeout_s": limits.timeout_s, "cap": limits.max_output_bytes, "env": env,
                   "limits": {"cpu_seconds": limits.cpu_seconds, "memory_mb": limits.memory_mb,
                              "max_processes": limits.max_processes, "max_file_mb": limits.max_file_mb,
                              "max_open_files": limits.max_open_files}}
        data = json.dumps(request).encode()
        started = time.perf_counter()
        try:
            await self.process.stdin.send(struct.pack(">I", len(data)) + data)
            with anyio.fail_after(limits.timeout_s + REPLY_GRACE_S):
                reply = await self._receive()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, TimeoutError, JailBroken) as err:
            await self.kill()
            raise JailBroken(f"the session jail broke during a call: {err!r}") from None
        except BaseException:
            await self.kill()
            raise
        if "error" in reply:
            raise JailBroken(str(reply["error"]))
        self.calls += 1
        return RunOutcome(reply["exit_code"], str(reply["output"]), bool(reply["truncated"]),
                          bool(reply["timed_out"]), (time.perf_counter() - started) * 1000)

    async def kill(self) -> None:
        """SIGKILL the jail (pid 1 of its namespace goes with it, and every process in there) and reap it."""
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                try:
                    self.process.kill()
                except ProcessLookupError:
                    pass
            with anyio.move_on_after(5.0):
                await self.process.wait()
            await self.process.aclose()


def _kill(process: Process, level: Isolation) -> None:
    """SIGKILL the jail: bwrap/unshare take their pid namespace with them; rlimits-only kills its group."""
    try:
        if level == "rlimits-only":
            os.killpg(process.pid, signal.SIGKILL)
            return
        if level == "unshare":             # pid 1 of the namespace first: it takes the rest with it
            for pid in descendants(process.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        process.kill()
    except ProcessLookupError:
        pass


__all__ = ["JAIL_WORKSPACE", "JailBroken", "RunLimits", "RunOutcome", "SessionJail", "jail_argv", "python_in_jail",
           "run_jailed"]
