"""Hostile tool calls against a real supervisor at the best isolation level: paths outside the workspace
(`..`, absolute, links planted by `run` pointing outside or into another session), a FIFO, writes past the
size limits, a fork bomb, a setsid escape, network access, an output flood, an endless command, a
pathological search pattern, malformed messages and thousands of calls. Each case ends with
`assert_contained`: the supervisor answers a normal call, no process of the case is left, the closed
session's workspace is gone, and the canary files outside the workspace are unchanged."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import pytest
from helpers import eventually
from helpers.sandbox_sessions import assert_contained, marked, new_marker, serving, tree

from rlbus.actors.common.sessions import SandboxSession, SessionRefused, call_tool, open_session
from rlbus.actors.sandbox.supervisor import SandboxSupervisor
from rlbus.messages import codec
from rlbus.messages.bus import REASON_HEADER, Bus
from rlbus.messages.schemas import ToolResult

pytestmark = pytest.mark.anyio


@dataclass
class Scene:
    """A supervisor, a session under attack, a neighbour session, and canaries outside the workspace."""

    actor: SandboxSupervisor
    bus: Bus
    session: SandboxSession
    neighbour: SandboxSession
    marker: str
    canaries: dict[Path, bytes]

    @property
    def workspace(self) -> Path:
        assert self.actor.sessions is not None
        return self.actor.sessions.sessions[self.session.session_id].workspace.root

    @property
    def neighbour_dir(self) -> Path:
        assert self.actor.sessions is not None
        return self.actor.sessions.sessions[self.neighbour.session_id].workspace.root

    async def run(self, command: str, **args: object) -> ToolResult:
        return await self.session.tool("run", {"command": f"export {self.marker}=1\n{command}", **args})

    async def done(self) -> None:
        """The session's end: everything contained (see the module docstring), the neighbour untouched."""
        before = tree(self.neighbour_dir)
        await eventually(lambda: marked(self.marker), lambda pids: not pids, what="no process of the case left",
                         timeout_s=10)
        await assert_contained(self.actor, self.bus, self.session, self.marker, self.canaries)
        assert tree(self.neighbour_dir) == before == {"secret.txt": b"neighbour\n"}
        assert (await self.neighbour.tool("read_file", {"path": "secret.txt"})).output == "neighbour\n"


@asynccontextmanager
async def scene(bus: Bus, tmp_path: Path) -> AsyncIterator[Scene]:
    canary = tmp_path / "canary.txt"
    canary.write_bytes(b"outside\n")
    async with serving(bus) as actor:
        assert actor.sessions is not None
        beside = actor.sessions.root / "canary.txt"           # beside the workspaces, on the sandbox's side
        beside.write_bytes(b"beside\n")
        async with await SandboxSession.open(bus, "hub", {"secret.txt": b"neighbour\n"}) as neighbour:
            session = await SandboxSession.open(bus, "hub", {"a.txt": b"a\n"})
            yield Scene(actor, bus, session, neighbour, new_marker(), {canary: b"outside\n", beside: b"beside\n"})


def _refused(result: ToolResult, *words: str) -> None:
    assert (result.ok, result.status) == (False, "error"), result
    assert all(w in result.error for w in words), result.error


# ---- paths outside the workspace -----------------------------------------------------------------
async def test_dotdot_paths_are_refused(admin_bus: Bus, tmp_path: Path) -> None:
    """`..` in any file tool's path is refused naming it, whatever it would reach."""
    async with scene(admin_bus, tmp_path) as sc:
        up = f"../{sc.neighbour.session_id}/secret.txt"
        _refused(await sc.session.tool("read_file", {"path": up}), "'..' is not allowed")
        _refused(await sc.session.tool("write_file", {"path": "x/../../canary.txt", "content": "pwned"}), "'..'")
        _refused(await sc.session.tool("edit_file", {"path": up, "old": "neighbour", "new": "pwned"}), "'..'")
        _refused(await sc.session.tool("list_files", {"path": ".."}), "'..'")
        _refused(await sc.session.tool("search", {"pattern": ".", "path": "../"}), "'..'")
        _refused(await sc.session.tool("grade", {"files": {"../../canary.txt": "pwned"}, "command": "true"}), "'..'")
        with pytest.raises(SessionRefused, match=r"'\.\.' is not allowed"):
            await open_session(admin_bus, "hub", {"../../canary.txt": b"pwned"})
        await sc.done()


async def test_absolute_paths_are_refused(admin_bus: Bus, tmp_path: Path) -> None:
    """Absolute paths are refused by every file tool, even when they point into the workspace itself."""
    async with scene(admin_bus, tmp_path) as sc:
        canary = next(iter(sc.canaries))
        _refused(await sc.session.tool("read_file", {"path": str(canary)}), "absolute")
        _refused(await sc.session.tool("read_file", {"path": str(sc.workspace / "a.txt")}), "absolute")
        _refused(await sc.session.tool("write_file", {"path": str(canary), "content": "pwned"}), "absolute")
        _refused(await sc.session.tool("edit_file", {"path": "/etc/passwd", "old": "root", "new": "x"}), "absolute")
        _refused(await sc.session.tool("list_files", {"path": "/"}), "absolute")
        await sc.done()


async def test_links_planted_by_run_pointing_outside_are_not_followed(admin_bus: Bus, tmp_path: Path) -> None:
    """Links a command plants (to a host file, to /, as a directory on the way) are listed as links and
    refused by read, write, edit, search and grade-time copies; the files they point at are unchanged."""
    async with scene(admin_bus, tmp_path) as sc:
        canary = next(iter(sc.canaries))
        planted = await sc.run(f"ln -s {canary} leak && ln -s / root && mkdir d && ln -s {canary.parent} d/up")
        assert planted.ok and planted.exit_code == 0, planted
        assert "leak@" in (await sc.session.tool("list_files", {})).output.splitlines()
        _refused(await sc.session.tool("read_file", {"path": "leak"}), "symbolic link")
        _refused(await sc.session.tool("write_file", {"path": "leak", "content": "pwned"}), "symbolic link")
        _refused(await sc.session.tool("edit_file", {"path": "leak", "old": "outside", "new": "pwned"}), "link")
        _refused(await sc.session.tool("read_file", {"path": "root/etc/passwd"}), "root is a symbolic link")
        _refused(await sc.session.tool("write_file", {"path": "d/up/canary.txt", "content": "x"}), "d/up is a symbolic")
        _refused(await sc.session.tool("list_files", {"path": "d/up"}), "symbolic link")
        _refused(await sc.session.tool("search", {"pattern": "outside", "path": "leak"}), "symbolic link")
        found = await sc.session.tool("search", {"pattern": "outside"})
        assert found.exit_code == 1 and found.output == ""
        graded = await sc.session.grade({}, "cat leak; cat d/up/canary.txt; echo pwned > leak")
        assert graded.judged_by == "exit_code" and "outside" not in graded.log
        await sc.done()


async def test_links_into_another_session_are_not_followed(admin_bus: Bus, tmp_path: Path) -> None:
    """A link to the neighbour session's workspace (its host path) is refused at every step; the neighbour's
    files stay as they were."""
    async with scene(admin_bus, tmp_path) as sc:
        other = sc.neighbour_dir
        planted = await sc.run(f"ln -s {other} nb && ln -s {other}/secret.txt nbfile && ls {other}; true")
        assert planted.ok and "secret.txt" not in planted.output, planted
        _refused(await sc.session.tool("read_file", {"path": "nb/secret.txt"}), "nb is a symbolic link")
        _refused(await sc.session.tool("read_file", {"path": "nbfile"}), "symbolic link")
        _refused(await sc.session.tool("write_file", {"path": "nb/secret.txt", "content": "pwned"}), "symbolic")
        _refused(await sc.session.tool("write_file", {"path": "nbfile", "content": "pwned"}), "symbolic link")
        _refused(await sc.session.tool("list_files", {"path": "nb"}), "symbolic link")
        snap = await sc.session.snapshot()
        assert sorted(snap.files) == [] and "not captured (link or special file): nb" in snap.output
        await sc.done()


async def test_a_fifo_planted_by_run_is_refused_without_blocking(admin_bus: Bus, tmp_path: Path) -> None:
    """Reading or writing a FIFO a command made is refused at once (nothing opens it and waits)."""
    async with scene(admin_bus, tmp_path) as sc:
        assert (await sc.run("mkfifo pipe")).exit_code == 0
        with anyio.fail_after(10):
            _refused(await sc.session.tool("read_file", {"path": "pipe"}), "not a regular file")
            _refused(await sc.session.tool("write_file", {"path": "pipe", "content": "x"}), "not a regular file")
            assert (await sc.session.tool("search", {"pattern": "x"})).exit_code == 1
        await sc.done()


# ---- sizes -----------------------------------------------------------------------------------------
async def test_writes_past_the_size_limits_are_refused(admin_bus: Bus, tmp_path: Path) -> None:
    """A write past the file-size limit, or one making the workspace too large, is refused and writes
    nothing; a command's file stops at the file-size limit (RLIMIT_FSIZE), and its files at the workspace's
    (a tmpfs of that size, when the supervisor is root)."""
    async with scene(admin_bus, tmp_path) as sc:
        limit = sc.actor.config.max_file_mb << 20
        _refused(await sc.session.tool("write_file", {"path": "big", "content": "x" * (limit + 1)}), "file-size limit")
        assert "big" not in (await sc.session.tool("list_files", {})).output
        grown = await sc.run(f"head -c {2 * limit} /dev/zero > big; echo exit $?")
        assert grown.ok and "exit 0" not in grown.output
        assert (sc.workspace / "big").stat().st_size <= limit
        quota = sc.actor.config.workspace_mb << 20
        filled = await sc.run(f"for i in $(seq {quota // limit + 2}); do head -c {limit} /dev/zero > fill$i; done")
        if os.geteuid() == 0:                      # the workspace is a tmpfs of its own: the command gets ENOSPC
            assert "No space left on device" in filled.output, filled
            assert sum(f.stat().st_size for f in sc.workspace.iterdir()) <= quota
        _refused(await sc.session.tool("write_file", {"path": "more", "content": "x" * (limit // 2)}), "past its limit")
        assert not (sc.workspace / "more").exists()
        await sc.done()


# ---- processes -----------------------------------------------------------------------------------
async def test_fork_bomb_through_run_is_contained(admin_bus: Bus, tmp_path: Path) -> None:
    """A fork bomb hits the process limit and the wall timeout; nothing of it is left."""
    async with scene(admin_bus, tmp_path) as sc:
        bombed = await sc.run("bomb() { bomb | bomb & }; bomb; sleep 30", timeout_s=1.5)
        assert (bombed.ok, bombed.status) == (False, "timeout"), bombed
        await sc.done()


async def test_setsid_escape_through_run_is_contained(admin_bus: Bus, tmp_path: Path) -> None:
    """A process that starts its own session and outlives its command is killed with the call's jail."""
    async with scene(admin_bus, tmp_path) as sc:
        escaped = await sc.run("setsid sleep 600 < /dev/null > /dev/null 2>&1 & disown; echo started")
        assert (escaped.ok, escaped.output) == (True, "started\n"), escaped
        await sc.done()


async def test_a_command_cannot_harm_the_jail_it_runs_in(admin_bus: Bus, tmp_path: Path) -> None:
    """Signals to the jail's pid 1, reading its memory or fds, or leaving a process stopped do nothing to it:
    the next call runs in the same jail."""
    async with scene(admin_bus, tmp_path) as sc:
        assert sc.actor.sessions is not None
        assert (await sc.run("true")).ok
        jail = sc.actor.sessions.sessions[sc.session.session_id].jail
        assert jail is not None
        tried = await sc.run("kill -KILL 1; kill -STOP 1; kill -TERM 1; head -c 16 /proc/1/mem; ls /proc/1/fd; "
                             "sleep 60 & kill -STOP $!; echo tried")
        assert tried.ok and tried.output.endswith("tried\n") and "0\n1\n" not in tried.output, tried
        assert sc.actor.sessions.sessions[sc.session.session_id].jail is jail
        await sc.done()


async def test_network_access_through_run_fails(admin_bus: Bus, tmp_path: Path) -> None:
    """A command cannot reach a host listener on loopback: the connection fails, nothing arrives."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        async with scene(admin_bus, tmp_path) as sc:
            tried = await sc.run(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected; "
                                 f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 1)\" "
                                 f"&& echo connected")
            assert tried.ok and "connected" not in tried.output, tried
            with pytest.raises(TimeoutError):
                listener.accept()
            await sc.done()
    finally:
        listener.close()


async def test_output_flood_through_run_is_cut_and_killed(admin_bus: Bus, tmp_path: Path) -> None:
    """A command writing without end is killed at the output cap; the result is the capped output, marked."""
    async with scene(admin_bus, tmp_path) as sc:
        flooded = await sc.run("yes flood & yes >&2 flood2; wait")
        assert (flooded.ok, flooded.status, flooded.truncated) == (False, "output_limit", True), flooded.error
        assert len(flooded.output.encode()) <= sc.actor.config.max_output_kb << 10
        await sc.done()


async def test_endless_command_is_killed_at_its_timeout(admin_bus: Bus, tmp_path: Path) -> None:
    """An endless command is killed at its own timeout, and a timeout past the supervisor's is cut to it."""
    async with scene(admin_bus, tmp_path) as sc:
        spun = await sc.run("while :; do :; done", timeout_s=0.5)
        assert (spun.ok, spun.status, spun.exit_code) == (False, "timeout", None)
        assert "0.5 s" in spun.error
        slept = await sc.run("sleep 3600", timeout_s=3600)
        assert slept.status == "timeout" and f"{sc.actor.config.wall_seconds:g} s" in slept.error
        await sc.done()


async def test_pathological_search_pattern_only_meets_the_timeout(admin_bus: Bus, tmp_path: Path) -> None:
    """A catastrophically backtracking pattern runs jailed: it times out while the supervisor keeps answering."""
    async with scene(admin_bus, tmp_path) as sc:
        await sc.session.tool("write_file", {"path": "s.txt", "content": "a" * 40 + "!\n"})
        async with anyio.create_task_group() as tg:
            out: list[ToolResult] = []

            async def slow() -> None:
                out.append(await sc.session.tool("search", {"pattern": "(a+)+$"}))

            tg.start_soon(slow)
            listed = await sc.neighbour.tool("list_files", {})     # answered while the search runs
            assert listed.ok and not out
        assert out[0].status == "timeout", out
        await sc.done()


# ---- malformed calls -----------------------------------------------------------------------------
async def test_unknown_tool_and_misshapen_args_get_an_error(admin_bus: Bus, tmp_path: Path) -> None:
    """An unknown tool, a missing, unknown or mistyped argument each get ok=false with a clear error."""
    async with scene(admin_bus, tmp_path) as sc:
        _refused(await sc.session.tool("rm_rf", {}), "unknown tool 'rm_rf'", "list_files")
        _refused(await sc.session.tool("read_file", {}), "missing argument 'path'")
        _refused(await sc.session.tool("read_file", {"path": "a.txt", "mode": "w"}), "unknown argument 'mode'")
        _refused(await sc.session.tool("read_file", {"path": ["a.txt"]}), "'path' must be a string")
        _refused(await sc.session.tool("read_file", {"path": "a.txt", "start_line": True}), "must be an integer")
        _refused(await sc.session.tool("run", {"command": "true", "timeout_s": -1}), "timeout_s must be positive")
        _refused(await sc.session.tool("run", {"command": "true", "timeout_s": "9"}), "'timeout_s' must be a number")
        _refused(await sc.session.tool("grade", {"files": {"t.py": 3}, "command": "true"}), "file texts")
        _refused(await sc.session.tool("search", {"pattern": "(unclosed"}), "not a valid regular expression")
        await sc.done()


async def test_a_tool_call_whose_args_are_not_a_map_is_dead_lettered(admin_bus: Bus, tmp_path: Path) -> None:
    """A ToolCall whose args are a string (the model's invalid JSON passed through) is answered with an error
    and dead-lettered with its reason; the session goes on."""
    async with scene(admin_bus, tmp_path) as sc:
        s = admin_bus.subjects
        raw = msgspec.msgpack.encode({"kind": "tool_call", "schema": 1, "session_id": sc.session.session_id,
                                      "call_id": "c1", "tool": "read_file", "args": '{"path": "a.txt"'})
        reply = await admin_bus.nc.request(s.session_calls("hub", "sb1"), raw, timeout=10)
        answer = codec.decode_as(reply.data, reply.headers, ToolResult)
        _refused(answer, "bad tool call message", "args")
        dead = await admin_bus.js.get_msg(s.dead_letter_stream(), seq=1)
        assert dead.data == raw and dead.headers and "args" in dead.headers[REASON_HEADER]
        assert (await sc.session.tool("read_file", {"path": "a.txt"})).output == "a\n"
        await sc.done()


async def test_garbage_on_session_subjects_is_dead_lettered(admin_bus: Bus, tmp_path: Path) -> None:
    """Bytes that are no message, on the open subject and on the calls subject, are answered with an error
    and dead-lettered; so is a message of the wrong kind."""
    async with scene(admin_bus, tmp_path) as sc:
        s = admin_bus.subjects
        opened = await admin_bus.nc.request(s.session_open("hub"), b"\x93garbage", timeout=10)
        assert "bad session request" in codec.decode(opened.data, opened.headers).error  # type: ignore[attr-defined]
        called = await admin_bus.nc.request(s.session_calls("hub", "sb1"), b"{not json", timeout=10)
        _refused(codec.decode_as(called.data, called.headers, ToolResult), "bad tool call message")
        wrong = codec.encode(ToolResult(session_id="x", call_id="y", ok=True))[0]
        kinded = await admin_bus.nc.request(s.session_calls("hub", "sb1"), wrong, timeout=10)
        _refused(codec.decode_as(kinded.data, kinded.headers, ToolResult), "expected ToolCall or SessionClose")
        info = await admin_bus.js.stream_info(s.dead_letter_stream())
        assert info.state.messages == 3 and sc.actor.counters["bad_requests"] == 3
        await sc.done()


async def test_thousands_of_tool_calls_in_one_session(admin_bus: Bus, tmp_path: Path) -> None:
    """2000 calls in one session, 64 in flight, are all answered ok (the supervisor keeps up; ending the
    episode is the environment's budget); the file holds one of the values written."""
    async with scene(admin_bus, tmp_path) as sc:
        results: list[ToolResult] = []
        limiter = anyio.CapacityLimiter(64)

        async def one(i: int) -> None:
            async with limiter:
                tool, args = (("write_file", {"path": "n.txt", "content": str(i)}) if i % 2
                              else ("read_file", {"path": "a.txt"}))
                results.append(await call_tool(admin_bus, "hub", sc.session.session_id, tool, args, timeout_s=60))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(2000):
                    tg.start_soon(one, i)
        assert len(results) == 2000 and all(r.ok for r in results)
        assert sc.actor.counters["tool_calls"] >= 2000
        last = (await sc.session.tool("read_file", {"path": "n.txt"})).output
        assert int(last) % 2 == 1 and int(last) < 2000
        await sc.done()
