"""The `local` launch backend: one supervised OS process per actor instance.

Owns: starting each actor process (`python -m rlbus.ops.actor ...`), restarting a crashed or killed one
with exponential backoff within the restart policy (each restart an `Event(restarted)`), declaring it
`failed` once the policy is exhausted (an `Event(failed)`; the other actors go on — never a restart
loop), and stopping everything by PID: SIGTERM, a bounded drain, then SIGKILL. A restart group (the ranks of
one trainer, `ProcessSpec.group`) lives and dies together: when one member ends, the others are killed, and
all restart together (one restart count) on a fresh rendezvous port (`RENDEZVOUS_ENV`).
Does not: decide which actors exist (topology/backends/launch.py) or talk to actors (they use the bus).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

import anyio
import structlog

from rlbus.actors.trainer.config import RANK_ENV, RENDEZVOUS_ENV, TIMEOUT_ENV, WORLD_ENV

log = structlog.get_logger()

__all__ = ["RANK_ENV", "RENDEZVOUS_ENV", "TIMEOUT_ENV", "WORLD_ENV", "LocalSupervisor", "ProcessSpec",
           "RestartPolicy", "free_rendezvous", "send_event"]

GROUP_POLL_S: Final = 0.2

EventSink = Callable[[str, "ProcessSpec", str], Awaitable[None]]
"""Called as `sink(event_kind, spec, detail)` for `started`, `restarted`, `crashed` and `failed`."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """At most `max_restarts` restarts within `window_s`; delays double from `backoff_initial_s`."""

    max_restarts: int = 5
    window_s: float = 300.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0

    def delay(self, attempt: int) -> float:
        """Backoff before restart number `attempt` (1-based)."""
        return float(min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, attempt - 1)))


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One actor instance: its identity (for events and logs), the arguments of `actors/process.py`
    (`--kind ... --run ...`), its environment, and its Ray resource label (ray backend)."""

    actor_id: str
    kind: str
    region: str
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    resource: str = ""
    """Ray custom resource that places it, e.g. `region:eu` (ray backend only)."""
    netns: str = ""
    """Network namespace the process runs in (its region's shaped link, topology/network/links.py); empty: this one."""
    group: str = ""
    """Restart group (a trainer's actor id, for each of its ranks): its members stop and start together."""

    @property
    def argv(self) -> tuple[str, ...]:
        """The command line of the actor's own process (local backend); `ip netns exec` execs it, same pid."""
        prefix = ("ip", "netns", "exec", self.netns) if self.netns else ()
        return (*prefix, sys.executable, "-m", "rlbus.ops.actor", *self.args)


@dataclass(slots=True)
class Supervised:
    """The live record of one supervised actor."""

    spec: ProcessSpec
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    recent: deque[float] = field(default_factory=deque)
    state: str = "starting"
    """starting | running | restarting | failed | stopped | exited"""
    last_exit: int | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class LocalSupervisor:
    """Runs and supervises actor processes until cancelled; then stops them all by PID."""

    def __init__(self, specs: Sequence[ProcessSpec], *, policy: RestartPolicy, log_dir: Path,
                 on_event: EventSink | None = None, drain_timeout_s: float = 15.0) -> None:
        self.actors = {spec.actor_id: Supervised(spec) for spec in specs}
        self.policy = policy
        self.log_dir = log_dir
        self.on_event = on_event
        self.drain_timeout_s = drain_timeout_s
        self._stopping = False

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start every actor, supervise until cancelled, then stop all of them (shielded, bounded)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            async with anyio.create_task_group() as tg:
                self._start_all()
                task_status.started()
                for entry in self.actors.values():
                    if not entry.spec.group:
                        tg.start_soon(self._supervise, entry)
                for members in self._groups().values():
                    tg.start_soon(self._supervise_group, members)
        finally:
            with anyio.CancelScope(shield=True):
                await self.stop()

    def _groups(self) -> dict[str, list[Supervised]]:
        groups: dict[str, list[Supervised]] = {}
        for entry in self.actors.values():
            if entry.spec.group:
                groups.setdefault(entry.spec.group, []).append(entry)
        return groups

    def _start_all(self) -> None:
        """Start every actor: a group's members share one fresh rendezvous."""
        rendezvous = {group: free_rendezvous() for group in self._groups()}
        for entry in self.actors.values():
            self._start(entry, rendezvous.get(entry.spec.group, ""))

    def _start(self, entry: Supervised, rendezvous: str = "") -> None:
        spec = entry.spec
        env = {**os.environ, **spec.env, "RLBUS_RESTARTS": str(entry.restarts)}
        if rendezvous:
            env[RENDEZVOUS_ENV] = rendezvous
        out: IO[bytes] = (self.log_dir / f"{spec.actor_id}.log").open("ab")
        try:
            entry.process = subprocess.Popen(list(spec.argv), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            out.close()
        entry.state = "running"
        log.info("actor_process_started", actor=spec.actor_id, kind=spec.kind, pid=entry.process.pid,
                 restarts=entry.restarts)

    async def _supervise(self, entry: Supervised) -> None:
        await self._emit("started", entry, f"pid {entry.pid}")
        while True:
            assert entry.process is not None
            code = await anyio.to_thread.run_sync(entry.process.wait, abandon_on_cancel=True)
            entry.last_exit = code
            if self._stopping:
                return
            if code == 0:
                entry.state = "exited"
                log.info("actor_process_exited", actor=entry.spec.actor_id)
                return
            how = _how(code)
            log.warning("actor_process_crashed", actor=entry.spec.actor_id, how=how)
            await self._emit("crashed", entry, how)
            if not self._may_restart(entry):
                entry.state = "failed"
                log.error("actor_process_failed", actor=entry.spec.actor_id, restarts=entry.restarts)
                await self._emit("failed", entry, f"{how}; {len(entry.recent)} restarts within "
                                                  f"{self.policy.window_s:.0f}s exhausted the restart policy")
                return
            entry.state = "restarting"
            entry.restarts += 1
            await anyio.sleep(self.policy.delay(len(entry.recent)))
            if self._stopping:
                return
            self._start(entry)
            await self._emit("restarted", entry, f"{how}; restart {entry.restarts}, pid {entry.pid}")

    async def _supervise_group(self, members: list[Supervised]) -> None:
        """Follow a restart group: the first member to end takes the others down (SIGKILL: a group with a
        dead rank cannot go on), then all restart together on a fresh rendezvous, within the restart policy
        (counted on the group's first member, the trainer)."""
        lead = members[0]
        for entry in members:
            await self._emit("started", entry, f"pid {entry.pid}")
        while True:
            ended = await self._first_exit(members)
            if self._stopping:
                return
            code = ended.process.returncode if ended.process is not None else None
            ended.last_exit = code
            if code == 0 and ended is lead:
                for entry in members:
                    _signal(entry, signal.SIGTERM)
                    entry.state = "exited"
                log.info("actor_group_exited", group=lead.spec.group)
                return
            how = _how(code)
            log.warning("actor_process_crashed", actor=ended.spec.actor_id, how=how, group=lead.spec.group)
            await self._emit("crashed", ended, how)
            for entry in members:                   # the survivors cannot go on without it
                if entry is not ended and entry.process is not None and entry.process.poll() is None:
                    _signal(entry, signal.SIGKILL)
                    await anyio.to_thread.run_sync(entry.process.wait)
                    await self._emit("crashed", entry, f"group member {ended.spec.actor_id} ended ({how})")
            if not self._may_restart(lead):
                for entry in members:
                    entry.state = "failed"
                    await self._emit("failed", entry, f"{how} in group {lead.spec.group}; {len(lead.recent)} "
                                                      f"restarts within {self.policy.window_s:.0f}s exhausted "
                                                      f"the restart policy")
                return
            for entry in members:
                entry.state = "restarting"
                entry.restarts += 1
            await anyio.sleep(self.policy.delay(len(lead.recent)))
            if self._stopping:
                return
            rendezvous = free_rendezvous()
            for entry in members:
                self._start(entry, rendezvous)
                await self._emit("restarted", entry, f"{how} ({ended.spec.actor_id}); group restart "
                                                     f"{entry.restarts}, pid {entry.pid}")

    def _may_restart(self, entry: Supervised) -> bool:
        """Whether the restart policy allows `entry` (a group: its first member) another restart now; if so, the
        restart is counted in its window (`recent`), whose length then sets the backoff."""
        now = time.monotonic()
        while entry.recent and now - entry.recent[0] > self.policy.window_s:
            entry.recent.popleft()
        if len(entry.recent) >= self.policy.max_restarts:
            return False
        entry.recent.append(now)
        return True

    async def _first_exit(self, members: list[Supervised]) -> Supervised:
        """The first member whose process has ended (polled: a group is a handful of processes)."""
        while True:
            for entry in members:
                if entry.process is None or entry.process.poll() is not None:
                    return entry
            await anyio.sleep(GROUP_POLL_S)

    async def _emit(self, kind: str, entry: Supervised, detail: str) -> None:
        await send_event(self.on_event, kind, entry.spec, detail)

    async def stop(self) -> None:
        """SIGTERM every live actor process, wait up to the drain timeout, then SIGKILL survivors."""
        self._stopping = True
        deadline = time.monotonic() + self.drain_timeout_s
        leads = {m[0].spec.actor_id for m in self._groups().values()}
        # a group's other ranks serve their trainer's drain (its last checkpoint is a collective): they stop
        # after it, when it tells them (or on SIGTERM once it is gone)
        first = [e for e in self.actors.values() if not e.spec.group or e.spec.actor_id in leads]
        for phase in (first, [e for e in self.actors.values() if e not in first]):
            live = [e for e in phase if e.process is not None and e.process.poll() is None]
            for entry in live:
                _signal(entry, signal.SIGTERM)
            for entry in live:
                assert entry.process is not None
                remaining = max(0.1, deadline - time.monotonic())
                try:
                    await anyio.to_thread.run_sync(entry.process.wait, remaining)
                except subprocess.TimeoutExpired:
                    log.warning("actor_process_drain_timeout", actor=entry.spec.actor_id, pid=entry.pid)
                    _signal(entry, signal.SIGKILL)
                    await anyio.to_thread.run_sync(entry.process.wait)
        for entry in self.actors.values():
            if entry.state not in ("failed", "exited"):
                entry.state = "stopped"

    def pids(self) -> dict[str, int]:
        """PIDs of the live actor processes, by actor id."""
        return {a: e.pid for a, e in self.actors.items()
                if e.process is not None and e.process.poll() is None and e.pid is not None}


async def send_event(sink: EventSink | None, kind: str, spec: ProcessSpec, detail: str) -> None:
    """Tell the sink (bounded); an unreachable bus must not stop supervision, so failures are logged."""
    if sink is None:
        return
    try:
        with anyio.fail_after(5):
            await sink(kind, spec, detail)
    except Exception as err:
        log.warning("supervisor_event_not_sent", event_kind=kind, error=repr(err))


def free_rendezvous(host: str = "127.0.0.1") -> str:
    """`host:port` with a port free on `host` now (the group's rank 0 binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"{host}:{sock.getsockname()[1]}"


def _how(code: int | None) -> str:
    """How a process ended, from its exit status."""
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {0 if code is None else code}"


def _signal(entry: Supervised, signum: signal.Signals) -> None:
    if entry.process is None or entry.process.poll() is not None:
        return
    try:
        os.kill(entry.process.pid, signum)
    except ProcessLookupError:
        return
