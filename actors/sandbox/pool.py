"""Jails and the pool of pre-forked sandbox executors.

Owns: which isolation levels this machine offers (bubblewrap, unshare + setpriv, rlimits only), the
command line that starts one executor (actors/sandbox/executor.py) inside a jail of each level, the
supervisor's side of the executor's frame protocol, and `ExecutorPool`: `size` executors, each
handed one execution at a time; a crashed or hung one is killed, reported and replaced.
Does not: talk to NATS, choose limits or verdict policy (actors/sandbox/supervisor.py).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import PIPE
from typing import IO, Any, Final, Literal

import anyio
import structlog
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from rlbus.messages.errors import RlbusError, SandboxCrashed
from rlbus.messages.retry import retry_policy
from rlbus.messages.wakeup import Wakeup

log = structlog.get_logger()

Isolation = Literal["bwrap", "unshare", "rlimits-only"]
LEVELS: Final[tuple[Isolation, ...]] = ("bwrap", "unshare", "rlimits-only")
ISOLATION_RANK: Final[dict[str, int]] = {"bwrap": 3, "unshare": 2, "rlimits-only": 1}
"""Numeric level for heartbeat gauges (which hold floats only)."""
SANDBOX_UID: Final = 65534
"""The non-root uid snippets run as (nobody): inside the jail and, for a root supervisor, on the host."""
EXEC_SOURCE_PATH: Final = Path(__file__).with_name("executor.py")
START_TIMEOUT_S: Final = 15.0
"""An executor must say it is ready within this (a fresh jail + interpreter takes ~0.1 s idle)."""
STANDBY_NAME: Final = "rlbus-standby"
"""Process name of an executor's pre-forked child while it waits for a request (actors/sandbox/executor.py)."""
_SYSTEM_DIRS: Final = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_CLEAN_ENV: Final = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"}


class ExecutorCrashed(SandboxCrashed):
    """The executor died or stopped answering during an execution (infrastructure, not the snippet)."""


class ExecutorStartFailed(RlbusError):
    """An executor could not be started or did not say it was ready."""


@dataclass(frozen=True, slots=True)
class Jail:
    """How to start executors of one isolation level: the command line and what it guarantees."""

    level: Isolation
    argv: tuple[str, ...]
    snippet_uid: int
    """The host uid snippets run as."""
    scratch: Path | None = None
    """A host directory this jail owns (rlimits-only working dirs); removed by `ExecutorPool.aclose`."""


def _is_root() -> bool:
    return os.geteuid() == 0


def _reachable_by_others(path: str) -> bool:
    """True when a uid other than the owner can traverse to `path` and read/execute it."""
    p = Path(path).resolve()
    for parent in [*reversed(p.parents), p]:
        try:
            mode = parent.stat().st_mode
        except OSError:
            return False
        if not mode & 0o001:
            return False
    return bool(p.stat().st_mode & 0o004)


def sandbox_python(*, for_other_uid: bool) -> tuple[str, str]:
    """(interpreter, prefix to mount) for executors: this interpreter when the snippet uid can reach
    its files, else the system's /usr/bin/python3 (stdlib only is needed)."""
    ours = (os.path.realpath(sys.executable), sys.base_prefix)
    candidates = [ours, ("/usr/bin/python3", "/usr"), ("/usr/local/bin/python3", "/usr/local")]
    for exe, prefix in candidates:
        if not os.access(exe, os.X_OK):
            continue
        if not for_other_uid or (_reachable_by_others(exe) and _reachable_by_others(prefix)):
            return exe, prefix
    raise ExecutorStartFailed("no Python interpreter readable by the sandbox uid "
                              f"{SANDBOX_UID} (tried {', '.join(c[0] for c in candidates)})")


def available_levels() -> list[Isolation]:
    """Isolation levels worth trying here, best first (rlimits-only always works)."""
    levels: list[Isolation] = []
    if shutil.which("bwrap"):
        levels.append("bwrap")
    if _is_root() and shutil.which("unshare") and shutil.which("setpriv"):
        levels.append("unshare")
    levels.append("rlimits-only")
    return levels


def build_jail(level: Isolation, *, tmpfs_mb: int = 64, scratch_root: str | None = None) -> Jail:
    """The command line that starts one executor at `level`.

    bwrap: a user, pid, net, ipc, uts namespace as uid 65534 (a root supervisor first drops to 65534
    on the host with setpriv, so RLIMIT_NPROC holds), read-only /usr, fresh /proc and /dev, private
    tmpfs /tmp and /sandbox (working dirs), root read-only, the executor as pid 1.
    unshare (root only): pid, net, ipc, uts, mount namespaces; private tmpfs over /tmp, /var/tmp,
    /run/lock and /dev/shm; then setpriv to uid 65534 with no capabilities and no new privileges.
    rlimits-only: a plain child process (a subreaper), snippets as this uid (65534 when root).
    """
    source = EXEC_SOURCE_PATH.read_text()
    if level == "bwrap":
        python, prefix = sandbox_python(for_other_uid=_is_root())
        cfg = {"pidns": True, "work_root": "/sandbox", "wipe": ["/tmp", "/dev/shm"], "nproc_extra": 1}
        argv = ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups",
                "--pdeathsig=KILL"] if _is_root() else []
        argv += ["bwrap", "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                 "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
        for d in _SYSTEM_DIRS:
            if os.path.islink(d):
                argv += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                argv += ["--ro-bind", d, d]
        if not prefix.startswith("/usr/"):
            argv += ["--ro-bind", prefix, prefix]
        size = str(tmpfs_mb << 20)
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp",
                 "--size", size, "--tmpfs", "/sandbox", "--remount-ro", "/", "--chdir", "/", "--as-pid-1",
                 python, "-I", "-S", "-c", source, json.dumps(cfg)]
        return Jail("bwrap", tuple(argv), SANDBOX_UID if _is_root() else os.geteuid())
    if level == "unshare":
        if not _is_root():
            raise ExecutorStartFailed("the unshare jail needs root (to mount and to switch uid)")
        python, _ = sandbox_python(for_other_uid=True)
        cfg = {"pidns": True, "work_root": "/tmp/sandbox", "wipe": ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"],
               "nproc_extra": 1 + _processes_of(SANDBOX_UID)}
        opts = f"mode=1777,nosuid,nodev,size={tmpfs_mb}m"
        mounts = " && ".join(f"mount -t tmpfs -o {opts} tmpfs {d}" for d in ("/tmp", "/dev/shm"))
        mounts += "".join(f" && {{ [ ! -d {d} ] || mount -t tmpfs -o {opts} tmpfs {d}; }}" for d in ("/var/tmp", "/run/lock"))
        script = (f'{mounts} && exec setpriv --reuid={SANDBOX_UID} --regid={SANDBOX_UID} --clear-groups '
                  f'--inh-caps=-all --bounding-set=-all --no-new-privs --pdeathsig=KILL "$1" -I -S -c "$2" "$3"')
        argv = ["setpriv", "--pdeathsig=KILL", "unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc",
                "--net", "--ipc", "--uts", "--", "/bin/sh", "-c", script, "sh", python, source, json.dumps(cfg)]
        return Jail("unshare", tuple(argv), SANDBOX_UID)
    root = Path(tempfile.mkdtemp(prefix="rlbus-sandbox-", dir=scratch_root or _scratch_dir()))
    root.chmod(0o711)
    uid = SANDBOX_UID if _is_root() else os.geteuid()
    python, _ = sandbox_python(for_other_uid=_is_root())
    cfg = {"pidns": False, "work_root": str(root / "work"), "wipe": [],
           "drop_uid": SANDBOX_UID if _is_root() else None, "drop_gid": SANDBOX_UID if _is_root() else None,
           "nproc_extra": 1 + _processes_of(uid)}
    return Jail("rlimits-only", (python, "-I", "-S", "-c", source, json.dumps(cfg)), uid, scratch=root)


def _scratch_dir() -> str:
    """A tmpfs when there is one (working dirs are made and removed per execution), else the temp dir."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def _processes_of(uid: int) -> int:
    """Processes of `uid` on this host now (RLIMIT_NPROC counts them when the jail has no user namespace)."""
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                n += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                pass
    return n


def descendants(pid: int) -> list[int]:
    """Every process below `pid` on this host, parents before children (from /proc)."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        parent[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
    order: list[int] = []
    frontier = [pid]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier and p not in order]
        order += frontier
    return order


# ---- one executor -------------------------------------------------------------------------------
async def receive_frame(reader: BufferedByteReceiveStream, error: type[Exception], what: str) -> dict[str, Any]:
    """One frame (4-byte big-endian length + JSON, actors/sandbox/executor.py's framing) from a jailed process.

    :raises error: the pipe closed before a whole frame ("<what> pipe closed").
    """
    try:
        (n,) = struct.unpack(">I", await reader.receive_exactly(4))
        frame: dict[str, Any] = json.loads(await reader.receive_exactly(n))
    except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
            anyio.ClosedResourceError) as err:
        raise error(f"{what} pipe closed ({type(err).__name__})") from None
    return frame


@dataclass(eq=False)
class ExecutorProcess:
    """One running executor: its process, its protocol stream and its stderr file."""

    jail: Jail
    process: Process
    reader: BufferedByteReceiveStream
    stderr: IO[bytes]
    hello: dict[str, Any] = field(default_factory=dict)
    executions: int = 0

    @classmethod
    async def start(cls, jail: Jail) -> ExecutorProcess:
        """Start one executor and wait for its ready frame.

        :raises ExecutorStartFailed: when it exits or stays silent (the jail's error is in the message).
        """
        errfile = tempfile.TemporaryFile()
        try:
            process = await anyio.open_process(list(jail.argv), stdin=PIPE, stdout=PIPE, stderr=errfile,
                                               env=_CLEAN_ENV, cwd="/")
        except OSError as err:
            errfile.close()
            raise ExecutorStartFailed(f"{jail.level}: cannot start {jail.argv[0]}: {err}") from err
        assert process.stdout is not None
        ex = cls(jail, process, BufferedByteReceiveStream(process.stdout), errfile)
        try:
            with anyio.fail_after(START_TIMEOUT_S):
                ex.hello = await ex._receive()
        except (TimeoutError, ExecutorCrashed) as err:
            why = ex.error_text() or repr(err)
            await ex.kill()
            raise ExecutorStartFailed(f"{jail.level} executor did not start: {why}") from None
        if not ex.hello.get("ready"):
            await ex.kill()
            raise ExecutorStartFailed(f"{jail.level} executor said {ex.hello!r} instead of ready")
        return ex

    async def _receive(self) -> dict[str, Any]:
        return await receive_frame(self.reader, ExecutorCrashed, "executor")

    async def execute(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one execution and wait for its result.

        :raises ExecutorCrashed: the executor died, or gave no answer within `timeout_s` (then it is killed).
        """
        assert self.process.stdin is not None
        data = json.dumps(request).encode()
        try:
            await self.process.stdin.send(struct.pack(">I", len(data)) + data)
            with anyio.fail_after(timeout_s):
                result = await self._receive()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as err:
            await self.kill()
            raise ExecutorCrashed(f"executor pipe broken: {err!r}") from None
        except TimeoutError:
            await self.kill()
            raise ExecutorCrashed(f"executor gave no answer within {timeout_s:g}s (killed)") from None
        except ExecutorCrashed as err:
            await self.kill()
            code = self.process.returncode
            raise ExecutorCrashed(f"{err} (exit {code}) {self.error_text()}".strip()) from None
        self.executions += 1
        return result

    def host_pids(self) -> list[int]:
        """Host pids of the executor: its jail wrapper and the executor process itself (tests kill these)."""
        return [self.process.pid, *descendants(self.process.pid)]

    def executor_pid(self) -> int:
        """Host pid of the executor program itself: pid 1 of the jail's pid namespace (or the process)."""
        if self.jail.level == "rlimits-only":
            return self.process.pid
        for pid in descendants(self.process.pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if nspid and nspid[-1] == "1":
                return pid
        raise ProcessLookupError(f"no pid-1 executor below {self.process.pid}")

    def snippet_pids(self) -> list[int]:
        """Host pids of snippet processes running under this executor now (its idle standby child,
        named `rlbus-standby`, excluded): empty between executions."""
        out = []
        for pid in descendants(self.executor_pid()):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() != STANDBY_NAME:
                    out.append(pid)
            except OSError:
                continue
        return out

    def error_text(self) -> str:
        try:
            self.stderr.seek(0)
            return self.stderr.read()[-2000:].decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""

    async def kill(self) -> None:
        """SIGKILL the jail (its pid-1 executor takes every snippet process with it) and reap it."""
        if self.process.returncode is None:
            try:
                self.process.kill()
            except ProcessLookupError:
                pass
        with anyio.move_on_after(5.0, shield=True):
            await self.process.wait()
        await self.process.aclose()
        self.stderr.close()

    async def close(self) -> None:
        """Ask the executor to exit (EOF on its input), then make sure it did."""
        if self.process.stdin is not None:
            try:
                await self.process.stdin.aclose()
            except (anyio.BrokenResourceError, OSError):
                pass
        with anyio.move_on_after(2.0, shield=True):
            await self.process.wait()
        await self.kill()


# ---- the pool -----------------------------------------------------------------------------------
class ExecutorPool:
    """`size` pre-forked executors in one jail level; `execute()` borrows one for one execution.

    A crashed or hung executor is killed and a replacement is started in the background (`maintain()`),
    with backoff while starts keep failing; every failure is reported through `on_failure`.
    """

    def __init__(self, jail: Jail, size: int, *,
                 on_failure: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.jail = jail
        self.size = size
        self.on_failure = on_failure
        self.live: set[ExecutorProcess] = set()
        self.started = 0
        self.crashes = 0
        self._send, self._idle = anyio.create_memory_object_stream[ExecutorProcess](size)
        self._wanted = Wakeup()
        self._closed = False

    async def start(self) -> None:
        """Start executors until the pool is full; at least one must start.

        :raises ExecutorStartFailed: when not even one executor started.
        """
        errors: list[str] = []

        async def one() -> None:
            try:
                self._add(await ExecutorProcess.start(self.jail))
            except ExecutorStartFailed as err:
                errors.append(str(err))

        async with anyio.create_task_group() as tg:
            for _ in range(self.size):
                tg.start_soon(one)
        if not self.live:
            raise ExecutorStartFailed("; ".join(errors))
        if len(self.live) < self.size:
            self._wanted.set()

    def _add(self, ex: ExecutorProcess) -> None:
        self.live.add(ex)
        self.started += 1
        self._send.send_nowait(ex)

    async def maintain(self) -> None:
        """Forever: when an executor is missing, start one (backoff 0.1 s → 5 s while starts fail)."""
        while True:
            await self._wanted.wait()
            while not self._closed and len(self.live) < self.size:
                ex = await self._start_one()
                if ex is not None:
                    self._add(ex)
                    log.info("sandbox_executor_started", isolation=self.jail.level, live=len(self.live))

    async def _start_one(self) -> ExecutorProcess | None:
        """One executor, retried with backoff while starts fail (each failure reported); None once closed."""
        retry = retry_policy("sandbox_executor_start_failed", on=ExecutorStartFailed, initial_s=0.1, max_s=5.0,
                             isolation=self.jail.level,
                             forever="the pool must refill whenever executors can start again (each failure "
                                     "is reported to the supervisor)")
        async for attempt in retry:
            with attempt:
                if self._closed:
                    return None
                try:
                    return await ExecutorProcess.start(self.jail)
                except ExecutorStartFailed as err:
                    await self._report(f"executor start failed: {err}")
                    raise
        raise AssertionError("unreachable: the policy returns or raises")

    async def _report(self, what: str) -> None:
        if self.on_failure is not None:
            await self.on_failure(what)

    async def execute(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Run one execution on an idle executor (waits for one).

        :raises ExecutorCrashed: its executor died or hung; it is replaced in the background.
        """
        ex = await self._idle.receive()
        try:
            result = await ex.execute(request, timeout_s)
        except ExecutorCrashed:
            self.live.discard(ex)
            self.crashes += 1
            self._wanted.set()
            raise
        except BaseException:            # cancelled mid-execution: the executor's state is unknown
            self.live.discard(ex)
            self._wanted.set()
            with anyio.CancelScope(shield=True):
                await ex.kill()
            raise
        self._send.send_nowait(ex)
        return result

    def executors(self) -> list[ExecutorProcess]:
        return list(self.live)

    async def aclose(self) -> None:
        """Stop every executor and remove the jail's scratch directory."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            for ex in list(self.live):
                await ex.close()
            self.live.clear()
        if self.jail.scratch is not None:
            shutil.rmtree(self.jail.scratch, ignore_errors=True)


async def first_working_jail(levels: list[Isolation], **jail_kw: Any) -> tuple[Jail, list[str]]:
    """The best level of `levels` whose executor starts and answers here, and why better ones did not.

    :raises ExecutorStartFailed: when none works.
    """
    why: list[str] = []
    for level in levels:
        jail: Jail | None = None
        try:
            jail = build_jail(level, **jail_kw)
            ex = await ExecutorProcess.start(jail)
        except ExecutorStartFailed as err:
            why.append(f"{level}: {err}")
            if jail is not None and jail.scratch is not None:
                shutil.rmtree(jail.scratch, ignore_errors=True)
            continue
        await ex.close()
        return jail, why
    raise ExecutorStartFailed("no sandbox level works here: " + "; ".join(why))


__all__ = ["ISOLATION_RANK", "LEVELS", "ExecutorCrashed", "ExecutorPool", "ExecutorProcess",
           "ExecutorStartFailed", "Isolation", "Jail", "available_levels", "build_jail", "first_working_jail"]
