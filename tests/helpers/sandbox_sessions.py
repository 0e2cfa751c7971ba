"""What the sandbox-session tests share: a supervisor served in this process at the best isolation level,
a generator-role bus, the processes a command left (found by a marker in their environment), and the
check every hostile case ends with."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from nats.js.api import StreamConfig

from helpers.hosting import hosted
from helpers.waiting import eventually
from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.common.sessions import SandboxSession
from rlbus.actors.sandbox.config import SandboxConfig, SandboxLaunch
from rlbus.actors.sandbox.pool import available_levels, descendants
from rlbus.actors.sandbox.supervisor import SandboxSupervisor
from rlbus.messages.bus import Bus, ConnectOptions
from rlbus.topology.network.servers import EmbeddedServer

BEST = available_levels()[0]
FAST = ActorLimits(heartbeat_interval_s=0.2, drain_timeout_s=2.0)
CONFIG = SandboxConfig(pool_size=1, concurrency=2, cpu_seconds=2.0, wall_seconds=2.0, memory_mb=256,
                       max_processes=16, max_file_mb=1, max_open_files=64, max_output_kb=16, max_sessions=4,
                       workspace_mb=4, max_lease_s=60.0)


async def provision(bus: Bus) -> None:
    """The streams a supervisor writes to (EVENTS, DLQ)."""
    s = bus.subjects
    await bus.js.add_stream(StreamConfig(name=s.events_stream(), subjects=[s.all_events()]))
    await bus.js.add_stream(StreamConfig(name=s.dead_letter_stream(), subjects=[s.all_dead_letters()]))


@asynccontextmanager
async def serving(bus: Bus, config: SandboxConfig = CONFIG, actor_id: str = "sb1",
                  level: str = BEST) -> AsyncIterator[SandboxSupervisor]:
    """A supervisor in region hub at `level` (the best one here), served in this process until the block ends."""
    await provision(bus)
    async with hosted(SandboxSupervisor(ActorId(bus.subjects.run, "hub", "sandbox", actor_id), bus, config, FAST,
                                        SandboxLaunch(isolation=level))) as actor:  # type: ignore[arg-type]
        yield actor


@asynccontextmanager
async def role_bus(server: EmbeddedServer, role: str, run: str) -> AsyncIterator[Bus]:
    cred = server.credential(role)
    bus = await Bus.connect(server.url, run=run, options=ConnectOptions(user=cred.user, password=cred.password))
    try:
        yield bus
    finally:
        await bus.close()


def new_marker() -> str:
    return f"RLBUS_MARK_{uuid.uuid4().hex[:12]}"


def marked(marker: str) -> set[int]:
    """Host pids whose environment holds `marker` (a command exports it; every child inherits it)."""
    found = set()
    needle = marker.encode()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if needle in Path(f"/proc/{name}/environ").read_bytes():
                    found.add(int(name))
            except OSError:
                pass
    return found


def _mounted(path: Path) -> bool:
    """True when something is mounted on `path` (the host's mount table)."""
    return any(line.split()[4] == str(path) for line in Path("/proc/self/mountinfo").read_text().splitlines())


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:].split()[0] != b"Z"


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry below `root` (links as their target, files as content), to compare before and after."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else ("dir" if p.is_dir() else p.read_bytes())
    return out


async def assert_contained(actor: SandboxSupervisor, bus: Bus, session: SandboxSession, marker: str,
                           canaries: dict[Path, bytes]) -> None:
    """The end of every hostile case: the supervisor answers a normal call, no process of the case is left,
    the closed session and its workspace are gone, and the files outside the workspace are unchanged."""
    normal = await session.tool("run", {"command": "echo alive"})
    assert (normal.ok, normal.output) == (True, "alive\n"), normal
    assert actor.sessions is not None
    jail = actor.sessions.sessions[session.session_id].jail
    workspace = actor.sessions.sessions[session.session_id].workspace.root
    jail_pids = [jail.process.pid, *descendants(jail.process.pid)] if jail is not None else []
    assert await session.close()
    await eventually(lambda: [p for p in jail_pids if _alive(p)], lambda alive: not alive,
                     what="the session's jail gone", timeout_s=10)
    assert marked(marker) == set()
    assert actor.sessions is not None
    assert session.session_id not in actor.sessions.sessions
    assert not workspace.exists() and not _mounted(workspace)
    for path, content in canaries.items():
        assert path.read_bytes() == content, path
