"""Sandbox sessions against a real server and real jails: every tool through a generator-role client,
grading in a fresh copy, snapshot and restore into a new session, the session quota, lease expiry,
sessions destroyed when the supervisor stops, and the heartbeat's session gauges."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import nats
import pytest
from helpers import eventually
from helpers.sandbox_sessions import BEST, CONFIG, marked, new_marker, provision, role_bus, serving
from msgspec.structs import replace

from rlbus.actors.common.sessions import (
    SandboxSession,
    SessionRefused,
    call_tool,
    open_session,
    restore_files,
)
from rlbus.actors.sandbox.pool import SANDBOX_UID, available_levels, descendants
from rlbus.actors.sandbox.sessions import ROOT_PREFIX, reclaim_orphans, scratch_dir
from rlbus.actors.sandbox.workspace import Workspace, unmount
from rlbus.messages.bus import Bus
from rlbus.topology.network.servers import EmbeddedServer

pytestmark = pytest.mark.anyio
FILES = {"pkg/__init__.py": b"", "pkg/calc.py": b"def add(a, b):\n    return a - b\n", "README": b"calc\n"}
TESTS = "from pkg.calc import add\nassert add(2, 3) == 5\nprint('passed')\n"


async def test_tools_work_in_a_persistent_workspace(nats_server: EmbeddedServer, admin_bus: Bus) -> None:
    """A generator opens a session; list, read, edit, write, search and run see one persistent workspace;
    grading runs in a fresh copy and leaves the workspace as it was."""
    async with serving(admin_bus), role_bus(nats_server, "generator", admin_bus.subjects.run) as gen:
        async with await SandboxSession.open(gen, "hub", FILES, lease_s=30) as s:
            listed = await s.tool("list_files", {})
            assert listed.output.splitlines() == ["README", "pkg/", "pkg/__init__.py", "pkg/calc.py"]
            assert (await s.tool("read_file", {"path": "pkg/calc.py", "start_line": 2})).output == "    return a - b\n"
            failing = await s.grade({"test_add.py": TESTS}, "python3 test_add.py")
            assert (failing.verdict, failing.judged_by) == ("failed", "exit_code") and "AssertionError" in failing.log
            twice = await s.tool("edit_file", {"path": "pkg/calc.py", "old": "a", "new": "x"})
            assert not twice.ok and "occurs 3 times" in twice.error
            edited = await s.tool("edit_file", {"path": "pkg/calc.py", "old": "a - b", "new": "a + b"})
            assert edited.ok, edited
            assert (await s.tool("write_file", {"path": "docs/notes.md", "content": "fixed add\n"})).ok
            found = await s.tool("search", {"pattern": r"a \+ b|fixed"})
            assert found.output.splitlines() == ["docs/notes.md:1:fixed add", "pkg/calc.py:2:    return a + b"]
            ran = await s.tool("run", {"command": "echo out; echo err >&2; touch made_by_run; exit 3"})
            assert (ran.ok, ran.exit_code, ran.output, ran.status) == (True, 3, "out\nerr\n", "ok")
            passing = await s.grade({"test_add.py": TESTS}, "python3 test_add.py && touch made_by_grade")
            assert (passing.verdict, passing.log) == ("passed", "passed\n"), passing
            after = (await s.tool("list_files", {})).output.splitlines()
            assert "made_by_run" in after and "made_by_grade" not in after and "test_add.py" not in after
            assert (await s.tool("search", {"pattern": "nothing-matches-this"})).exit_code == 1


async def test_snapshot_restores_into_a_new_session(admin_bus: Bus) -> None:
    """A snapshot holds the changed and new files with their sha256 and the deleted ones; a session opened
    with the opening files overlaid by it holds the same files as the first, and has its digest (links and empty
    directories are not part of it; a changed byte is)."""
    async with serving(admin_bus):
        async with await SandboxSession.open(admin_bus, "hub", FILES) as first:
            await first.tool("write_file", {"path": "pkg/calc.py", "content": "def add(a, b):\n    return a + b\n"})
            await first.tool("run", {"command": "rm README && mkdir -p out && printf 'x\\0y' > out/blob.bin"})
            snap = await first.snapshot()
            assert snap.ok and sorted(snap.files) == ["out/blob.bin", "pkg/calc.py"] and snap.deleted == ["README"]
            assert all(hashlib.sha256(v).hexdigest() == snap.digests[k] for k, v in snap.files.items())
            want = (await first.tool("run", {"command": "find . -type f | sort | xargs sha256sum"})).output
            tree = await first.digest()
            await first.tool("run", {"command": "mkdir -p empty/dir && ln -s pkg/calc.py link"})  # not captured
            assert await first.digest() == tree
        async with await SandboxSession.open(admin_bus, "hub", restore_files(FILES, snap)) as second:
            got = (await second.tool("run", {"command": "find . -type f | sort | xargs sha256sum"})).output
            assert got == want and "blob.bin" in got
            assert await second.digest() == tree and tree.startswith("sha256:")
            await second.tool("write_file", {"path": "out/blob.bin", "content": "x"})
            assert await second.digest() != tree


async def test_session_quota_lease_expiry_and_stop(admin_bus: Bus) -> None:
    """Past max_sessions an open is refused saying so; a session nobody calls is destroyed after its lease
    (a late call gets no_session); stopping the supervisor destroys the rest with their workspaces."""
    config = replace(CONFIG, max_sessions=2)
    async with serving(admin_bus, config) as actor:
        assert actor.sessions is not None
        root = actor.sessions.root
        kept = await open_session(admin_bus, "hub", FILES, lease_s=30)
        short = await open_session(admin_bus, "hub", {}, lease_s=0.5)
        short_dir = actor.sessions.sessions[short].workspace.root
        with pytest.raises(SessionRefused, match="max_sessions = 2"):
            await open_session(admin_bus, "hub", {})
        await eventually(lambda: short not in actor.sessions.sessions, what="the short lease to expire", timeout_s=10)
        late = await call_tool(admin_bus, "hub", short, "list_files", {})
        assert (late.ok, late.status) == (False, "no_session") and not short_dir.exists()
        assert (await call_tool(admin_bus, "hub", kept, "read_file", {"path": "README"})).output == "calc\n"
        gauges = actor.heartbeat().gauges
        assert gauges["sessions_open"] == 1 and gauges["sessions_expired"] == 1 and gauges["tool_read_file_ms"] > 0
        kept_dir = actor.sessions.sessions[kept].workspace.root
        assert (kept_dir / "pkg" / "calc.py").read_bytes() == FILES["pkg/calc.py"]
    assert not root.exists()


async def test_calls_renew_the_lease(admin_bus: Bus) -> None:
    """A session whose holder keeps calling outlives its lease many times over."""
    async with serving(admin_bus) as actor:
        assert actor.sessions is not None
        sid = await open_session(admin_bus, "hub", {}, lease_s=0.4)
        with anyio.fail_after(20):
            for _ in range(8):
                await anyio.sleep(0.15)
                assert (await call_tool(admin_bus, "hub", sid, "list_files", {})).ok
        assert sid in actor.sessions.sessions


@pytest.mark.skipif(BEST != "bwrap", reason="the facts of the bwrap jail (bubblewrap is not available here)")
async def test_run_sees_only_its_workspace(admin_bus: Bus) -> None:
    """In the bwrap jail a command runs as uid 65534 in /workspace, sees no host directory but the system's
    read-only ones, has loopback only, and cannot write /usr."""
    async with serving(admin_bus), await SandboxSession.open(admin_bus, "hub", FILES) as s:
        facts = await s.tool("run", {"command": "id -u; pwd; ls /; ls /sys/class/net 2>/dev/null || "
                                                "cat /proc/net/dev | tail -n +3 | cut -d: -f1; touch /usr/x || echo ro"})
        lines = facts.output.split()
        assert lines[:2] == ["65534", "/workspace"], facts.output
        assert {"root", "work", "home", "etc", "dev", "proc"} & set(lines) == {"dev", "proc"}
        assert "lo" in lines and "eth0" not in lines and lines[-1] == "ro"


@pytest.mark.parametrize("level", available_levels()[1:] or [pytest.param("none", marks=pytest.mark.skip(
    reason="no weaker isolation level than the best one here"))])
async def test_weaker_levels_run_in_the_workspace_as_the_sandbox_uid(admin_bus: Bus, level: str) -> None:
    """At the unshare and rlimits-only levels a fresh jail per call runs in the workspace's host directory as
    uid 65534 (when root) with the file tools seeing what it wrote, and its timeout kills the command."""
    marker = new_marker()
    async with serving(admin_bus, level=level) as actor, await SandboxSession.open(admin_bus, "hub", FILES) as s:
        assert actor.isolation == level and actor.sessions is not None
        ran = await s.tool("run", {"command": "id -u; pwd; echo made > out.txt"})
        assert ran.ok and ran.output.split()[1] == str(actor.sessions.sessions[s.session_id].workspace.root), ran
        assert ran.output.split()[0] == ("65534" if os.geteuid() == 0 else str(os.geteuid()))
        assert (await s.tool("read_file", {"path": "out.txt"})).output == "made\n"
        slept = await s.tool("run", {"command": f"export {marker}=1; sleep 3600", "timeout_s": 0.5})
        assert slept.status == "timeout"
        await eventually(lambda: marked(marker), lambda pids: not pids, what="the command killed", timeout_s=10)


async def test_only_sandboxes_listen_on_session_subjects(nats_server: EmbeddedServer, admin_bus: Bus) -> None:
    """A generator subscribing to session opens or to a supervisor's calls (to forge results) is refused, and an
    observer may not open a session; a generator may."""
    s = admin_bus.subjects
    errors: list[str] = []

    async def on_error(err: Exception) -> None:
        errors.append(str(err))

    async with serving(admin_bus):
        generator = await nats.connect(**nats_server.connect_options("generator"), error_cb=on_error,
                                       allow_reconnect=False)
        observer = await nats.connect(**nats_server.connect_options("observer"), error_cb=on_error,
                                      allow_reconnect=False)
        try:
            await generator.subscribe(s.session_open("hub"))
            await generator.subscribe(s.session_calls("hub", "sb1"))
            await observer.publish(s.session_open("hub"), b"x")
            await generator.flush()
            await observer.flush()
            await eventually(lambda: len(errors), lambda n: n >= 3, what="three permission violations", timeout_s=10)
            assert sorted(e.split('"')[1] for e in errors) == sorted(
                [s.session_open("hub").lower(), s.session_calls("hub", "sb1").lower(), s.session_open("hub").lower()])
            assert all("permissions violation" in e for e in errors)
        finally:
            await generator.close()
            await observer.close()
        async with role_bus(nats_server, "generator", s.run) as gen:
            sid = await open_session(gen, "hub", {})
            assert (await call_tool(gen, "hub", sid, "list_files", {})).ok


def test_roots_of_dead_supervisors_are_reclaimed(tmp_path: Path) -> None:
    """A session root named by a pid that runs no more (its supervisor was SIGKILLed) is removed with its
    workspaces' tmpfs mounts; one of a live process, and any other directory, is left alone."""
    dead_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1      # no process has it, ever
    dead = tmp_path / f"{ROOT_PREFIX}{dead_pid}-abc"
    live = tmp_path / f"{ROOT_PREFIX}{os.getpid()}-def"
    other = tmp_path / f"{ROOT_PREFIX}ghi"
    for root in (dead, live, other):
        root.mkdir()
        Workspace(root / "ws-1", max_file_bytes=1 << 20, max_total_bytes=1 << 20,
                  uid=SANDBOX_UID if os.geteuid() == 0 else None, quota_bytes=1 << 20).write_bytes("f", b"x")
    mounted = [w for w in (dead / "ws-1", live / "ws-1", other / "ws-1") if _is_mount(w)]
    try:
        assert reclaim_orphans(str(tmp_path)) == [dead]
        assert not dead.exists() and not _is_mount(dead / "ws-1")
        assert (live / "ws-1" / "f").read_bytes() == b"x" and (other / "ws-1" / "f").exists()
        assert len(mounted) == (3 if os.geteuid() == 0 else 0)
    finally:
        for w in (live / "ws-1", other / "ws-1"):
            if _is_mount(w):
                unmount(w)


def _is_mount(path: Path) -> bool:
    return any(line.split()[4] == str(path) for line in Path("/proc/self/mountinfo").read_text().splitlines())


async def test_a_sigkilled_supervisor_leaves_no_jail_and_its_root_is_reclaimed(
        nats_server: EmbeddedServer, admin_bus: Bus, tmp_path: Path) -> None:
    """A supervisor process (sandbox role) SIGKILLed while a session's command runs leaves no process of its
    jails; the next supervisor on the machine removes its session root and the workspace mounts in it."""
    await provision(admin_bus)
    settings = {"pool_size": 1, "concurrency": 1, "wall_seconds": 30.0, "session_spares": 1}
    cred = nats_server.credential("sandbox")
    log = (tmp_path / "actor.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "rlbus.ops.actor", "--kind", "sandbox", "--run", admin_bus.subjects.run,
                             "--region", "hub", "--id", "sbk", "--url", nats_server.url, "--role", "sandbox",
                             "--settings", json.dumps(settings), "--heartbeat-s", "0.2", "--drain-s", "2"],
                            env={**os.environ, "RLBUS_NATS_USER": cred.user, "RLBUS_NATS_PASSWORD": cred.password},
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        async with role_bus(nats_server, "generator", admin_bus.subjects.run) as gen:
            sid = await eventually(lambda: open_session(gen, "hub", FILES, timeout_s=2), what="a session opened",
                                   timeout_s=60, ignoring=(SessionRefused,))
            assert (await call_tool(gen, "hub", sid, "run", {"command": "echo up"})).output == "up\n"
            roots = list(Path(scratch_dir()).glob(f"{ROOT_PREFIX}{proc.pid}-*"))
            jail_pids = set(descendants(proc.pid))
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: call_tool(gen, "hub", sid, "run", {"command": "sleep 600"}, timeout_s=5))
                await eventually(lambda: set(descendants(proc.pid)) - jail_pids, what="the command running")
                jail_pids = set(descendants(proc.pid))
                proc.kill()
                tg.cancel_scope.cancel()
        assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=15)) == -signal.SIGKILL
        await eventually(lambda: [p for p in jail_pids if Path(f"/proc/{p}/stat").exists()
                                  and b") Z" not in Path(f"/proc/{p}/stat").read_bytes()],
                         lambda left: not left, what="no process of the killed supervisor's jails", timeout_s=10)
        assert len(roots) == 1 and roots[0].exists()
        async with serving(admin_bus, actor_id="sbk2"):
            assert not roots[0].exists()
            assert not [m for m in Path("/proc/self/mountinfo").read_text().split() if m.startswith(str(roots[0]))]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


async def test_grading_never_runs_bytecode_older_than_its_source(admin_bus: Bus) -> None:
    """A fix graded after the buggy code was compiled passes: `run` writes no bytecode, and the grade's copy
    leaves out `__pycache__` (here an unchecked-hash .pyc of the buggy code, which Python would load whatever the
    source says)."""
    async with serving(admin_bus):
        async with await SandboxSession.open(admin_bus, "hub", FILES) as s:
            assert (await s.tool("run", {"command": "python3 -c 'import pkg.calc'"})).exit_code == 0
            assert "__pycache__" not in (await s.tool("run", {"command": "find . -name __pycache__"})).output
            compiled = await s.tool("run", {"command": "python3 -m compileall -q --invalidation-mode unchecked-hash "
                                                       "pkg && find pkg -name '*.pyc'"})
            assert "calc" in compiled.output, compiled
            assert (await s.tool("edit_file", {"path": "pkg/calc.py", "old": "a - b", "new": "a + b"})).ok
            stale = await s.tool("run", {"command": "python3 -c 'from pkg.calc import add; print(add(2, 3))'"})
            assert stale.output == "-1\n", stale  # the workspace's own runs see what they compiled
            report = await s.grade({"test_add.py": TESTS}, "python3 test_add.py")
            assert report.verdict == "passed", report
