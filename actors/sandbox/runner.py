"""The runner inside one session's jail: pid 1 of the jail's pid namespace, it runs each jailed call.

- Owns: the runner's side of the pipe protocol (4-byte big-endian length + UTF-8 JSON frames on fds 0/1, the
  framing of actors/sandbox/executor.py): per request one forked child runs `argv` (`run`), then every
  other process of the namespace is killed and reaped (`kill_rest`) before the answer.
- Guarantee: no process of a call outlives it, as with a fresh jail per call; the runner is not dumpable.
- Does not: build the jail (actors/sandbox/jailrun.py). Stdlib only: run as `python -I -S -c <this file's
  text>` with an interpreter the jail can reach.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import struct
import sys
import time
from typing import Any, Final

READ_CHUNK: Final = 1 << 16
PR_SET_DUMPABLE: Final = 4


def read_exactly(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> dict[str, Any]:
    (n,) = struct.unpack(">I", read_exactly(fd, 4))
    return json.loads(read_exactly(fd, n))


def write_frame(fd: int, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _limits(limits: dict[str, Any]) -> None:
    cpu = max(1, int(-(-float(limits["cpu_seconds"]) // 1)))
    for what, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, int(limits["memory_mb"]) << 20),
                        (resource.RLIMIT_NPROC, int(limits["max_processes"]) + 1),
                        (resource.RLIMIT_FSIZE, int(limits["max_file_mb"]) << 20),
                        (resource.RLIMIT_NOFILE, int(limits["max_open_files"])), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (value, value + 1 if what == resource.RLIMIT_CPU else value))


def _child(req: dict[str, Any], w: int) -> None:
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.closerange(3, 1 << 16)
        for sig in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        _limits(req["limits"])
        argv = [str(a) for a in req["argv"]]
        os.execvpe(argv[0], argv, {str(k): str(v) for k, v in req["env"].items()})
    except BaseException as err:
        os.write(2, f"cannot run {req.get('argv', ['?'])[:1]}: {err!r}\n".encode())
    os._exit(127)


def kill_rest() -> None:
    """Kill and reap every other process of this pid namespace (this process is its pid 1)."""
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        time.sleep(0.001)


def run(req: dict[str, Any]) -> dict[str, Any]:
    """One jailed call: `{"argv", "timeout_s", "cap", "limits", "env"}` -> `{"exit_code", "output",
    "truncated", "timed_out"}`.

    One forked child (new session, the rlimits, stdout and stderr into one pipe, cwd the workspace) exec's
    `argv`; the runner reads its output up to `cap` bytes, waits for it until `timeout_s`, then — whether it
    ended, timed out or flooded — kills every other process of the namespace (`kill(-1)` from pid 1 reaches
    them all, `setsid` or not) and reaps them before it answers. So no process of a call outlives it. The
    runner is not dumpable (a same-uid command can neither ptrace it nor open its /proc fds), and as pid 1
    of the namespace it gets no signal from inside it but those it handles.
    """
    cap = int(req["cap"])
    deadline = time.monotonic() + float(req["timeout_s"])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(req, w)
    os.close(w)
    pidfd = os.pidfd_open(pid)
    out = bytearray()
    truncated = timed_out = False
    exit_code: int | None = None
    watching = [r, pidfd]
    try:
        while watching:
            left = deadline - time.monotonic()
            ready = select.select(watching, [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                timed_out = True
                break
            if pidfd in ready:                   # the command ended: the rest of its processes go now
                exit_code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                watching.remove(pidfd)
                kill_rest()
            if r in ready:
                chunk = os.read(r, READ_CHUNK)
                if not chunk:
                    watching.remove(r)
                    continue
                out += chunk
                if len(out) > cap:
                    truncated = True
                    break
    finally:
        kill_rest()
        os.close(pidfd)
    while r in watching and len(out) <= cap and (chunk := os.read(r, READ_CHUNK)):
        out += chunk                             # every writer is dead: what is left is buffered, then EOF
    os.close(r)
    truncated = truncated or len(out) > cap
    return {"exit_code": None if timed_out or truncated else exit_code,
            "output": bytes(out[:cap]).decode("utf-8", "replace"), "truncated": truncated, "timed_out": timed_out}


def main() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:    # same-uid commands cannot ptrace or read us
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.chdir(sys.argv[1] if len(sys.argv) > 1 else "/")
    write_frame(1, {"ready": True, "pid": os.getpid()})
    while True:
        try:
            req = read_frame(0)
        except EOFError:
            kill_rest()
            return
        try:
            reply = run(req)
        except Exception as err:                 # a bad request of the supervisor's: say so, keep serving
            kill_rest()
            reply = {"exit_code": None, "output": "", "truncated": False, "timed_out": False,
                     "error": f"runner: {err!r}"}
        write_frame(1, reply)


if __name__ == "__main__":
    main()
