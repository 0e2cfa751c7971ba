"""The sandbox supervisor against a real server and real jails: verdicts with passed/total, isolation
facts checked from inside the snippet, bad requests, the concurrency quota, the circuit breaker,
an executor SIGKILLed mid-execution, and the actor as a real process (SIGTERM and SIGKILL)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO

import anyio
import pytest
from helpers import eventually, hosted
from msgspec.structs import replace
from nats.js.api import StreamConfig

from rlbus.actors.base import ActorId, ActorLimits, State
from rlbus.actors.common.sandbox_client import asserts_for, grade_result, request_for, run_in_sandbox
from rlbus.actors.sandbox.config import SandboxConfig, SandboxLaunch
from rlbus.actors.sandbox.pool import SANDBOX_UID, available_levels, descendants
from rlbus.actors.sandbox.supervisor import SandboxSupervisor
from rlbus.messages import codec
from rlbus.messages.bus import REASON_HEADER, Bus, ConnectOptions
from rlbus.messages.schemas import Event, SandboxLimits, SandboxRequest, SandboxResult
from rlbus.model.tasks.builtin import Task, eval_tasks
from rlbus.topology.network.servers import EmbeddedServer

pytestmark = pytest.mark.anyio
FAST = ActorLimits(heartbeat_interval_s=0.2, drain_timeout_s=2.0)
SMALL = SandboxConfig(pool_size=2, concurrency=2, cpu_seconds=2.0, wall_seconds=2.0, memory_mb=256,
                      max_processes=8, max_file_mb=1, max_open_files=32, max_output_kb=16)
LIMITS = SandboxLimits(cpu_seconds=2.0, wall_seconds=2.0, memory_mb=256, max_processes=8, max_file_mb=1,
                       max_open_files=32, max_output_kb=16)
BEST = available_levels()[0]
REPO = Path(__file__).resolve().parents[2]


async def _streams(bus: Bus) -> None:
    s = bus.subjects
    await bus.js.add_stream(StreamConfig(name=s.events_stream(), subjects=[s.all_events()]))
    await bus.js.add_stream(StreamConfig(name=s.dead_letter_stream(), subjects=[s.all_dead_letters()]))


@asynccontextmanager
async def serving(bus: Bus, config: SandboxConfig = SMALL, actor_id: str = "sb1",
                  launch: SandboxLaunch | None = None) -> AsyncIterator[SandboxSupervisor]:
    """A supervisor served in this process until the block ends."""
    async with hosted(SandboxSupervisor(ActorId(bus.subjects.run, "hub", "sandbox", actor_id), bus, config, FAST,
                                        launch)) as actor:
        yield actor


async def _role_bus(server: EmbeddedServer, role: str, run: str) -> Bus:
    cred = server.credential(role)
    return await Bus.connect(server.url, run=run, options=ConnectOptions(user=cred.user, password=cred.password))


def _req(code: str, tests: str = "", limits: SandboxLimits = LIMITS) -> SandboxRequest:
    return SandboxRequest(request_id=uuid.uuid4().hex, code=code, tests=tests, limits=limits)


def _uid_processes(uid: int) -> set[int]:
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    out.add(int(name))
            except OSError:
                pass
    return out


async def _no_leftovers(actor: SandboxSupervisor) -> None:
    """Wait (2 s at most) until no process runs below the pool's executors: the executor replies as soon
    as the snippet is done and kills what is left right after, before it reads the next request."""
    assert actor.pool is not None
    with anyio.fail_after(2.0):
        while any(ex.snippet_pids() for ex in actor.pool.executors()):
            await anyio.sleep(0.02)


async def _events(bus: Bus) -> list[Event]:
    """Every event stored so far on the run's EVENTS stream."""
    s = bus.subjects
    info = await bus.js.stream_info(s.events_stream())
    return [codec.decode_as(m.data, m.headers, Event)
            for m in [await bus.js.get_msg(s.events_stream(), seq=i) for i in range(1, info.state.last_seq + 1)]]


# ---- verdicts -------------------------------------------------------------------------------------
async def test_task_solutions_graded_with_passed_and_total(nats_server: EmbeddedServer, admin_bus: Bus) -> None:
    """Under the sandbox and generator roles: a canonical solution is ok 6/6, a wrong one failed 0/6, a
    partly right one counts exactly the asserts that hold; the isolation level is in result and status."""
    await _streams(admin_bus)
    run = admin_bus.subjects.run
    sandbox_bus = await _role_bus(nats_server, "sandbox", run)
    gen_bus = await _role_bus(nats_server, "generator", run)
    task = eval_tasks(7, n=1)[0]
    try:
        async with serving(sandbox_bus) as actor:
            good = await run_in_sandbox(gen_bus, "hub", request_for(task, task.solution, request_id="g1", limits=LIMITS),
                                        attempts=1)
            bad = await run_in_sandbox(gen_bus, "hub", request_for(task, f"```python\ndef {task.entry_point}(*a):\n"
                                                                         "    return None\n```", request_id="g2",
                                                                   limits=LIMITS), attempts=1)
            partial = await run_in_sandbox(gen_bus, "hub", _req(
                "def f(x):\n    return x * 2\n", "assert f(1) == 2\nassert f(2) == 5\nassert f(3) == 6\n"), attempts=1)
            status = await admin_bus.nc.request(admin_bus.subjects.service_status("sandbox", "sb1"), b"", timeout=2)
            assert actor.state in (State.READY, State.BUSY)
    finally:
        await sandbox_bus.close()
        await gen_bus.close()
    assert len(task.tests) == 6
    assert (good.verdict.status, good.verdict.passed, good.verdict.total) == ("ok", 6, 6)
    assert grade_result(good).passed and grade_result(good).reward == 1.0
    assert (bad.verdict.status, bad.verdict.passed, bad.verdict.total) == ("failed", 0, 6)
    assert grade_result(bad).status == "failed" and grade_result(bad).n_tests == 6
    assert (partial.verdict.status, partial.verdict.passed, partial.verdict.total) == ("failed", 2, 3)
    assert "line 2 of the tests: AssertionError" in partial.stderr
    assert good.isolation == bad.isolation == BEST
    heartbeat = json.loads(status.data)
    assert heartbeat["counters"][f"isolation_{BEST.replace('-', '_')}"] == 1
    assert heartbeat["gauges"]["isolation_level"] == {"bwrap": 3, "unshare": 2, "rlimits-only": 1}[BEST]
    started = [e for e in await _events(admin_bus) if e.actor_kind == "sandbox" and e.data.get("isolation")]
    assert started and started[0].data["isolation"] == BEST


async def test_source_tests_graded_in_the_sandbox_with_passed_and_total(admin_bus: Bus) -> None:
    """A `check(candidate)` test source is one test (ok 1/1, or failed 0/1 when check raises); a source of
    top-level asserts counts each, setup statements before them counting none."""
    await _streams(admin_bus)
    check = Task("c1", "file", 0, "def double(x):\n", "double", "    return 2 * x\n", (),
                 "METADATA = {}\n\ndef check(candidate):\n    assert candidate(2) == 4\n    assert candidate(0) == 0\n")
    asserts = Task("a1", "file", 0, "def double(x):\n", "double", "    return 2 * x\n", (),
                   "K = 3\nassert double(K) == 6\nassert double(1) == 2\nassert double(-1) == -2\n")
    async with serving(admin_bus):
        async def grade(task: Task, body: str) -> SandboxResult:
            return await run_in_sandbox(admin_bus, "hub", request_for(task, body, request_id=uuid.uuid4().hex,
                                                                      limits=LIMITS), attempts=1)
        good, bad = await grade(check, check.solution), await grade(check, "    return None\n")
        counted = await grade(asserts, "    return 2 * x if x > 0 else 0\n")
    assert (good.verdict.status, good.verdict.passed, good.verdict.total) == ("ok", 1, 1)
    assert grade_result(good).passed
    assert (bad.verdict.status, bad.verdict.passed, bad.verdict.total) == ("failed", 0, 1)
    assert grade_result(bad).status == "failed" and "of the tests: AssertionError" in grade_result(bad).feedback
    assert (counted.verdict.status, counted.verdict.passed, counted.verdict.total) == ("failed", 2, 3)
    assert grade_result(counted).n_tests == 3 and not grade_result(counted).passed


def test_asserts_for_one_assert_per_case() -> None:
    """A task's (args, expected) pairs become one assert each, checking value and type like model/tasks/harness.py."""
    src = asserts_for("f", [("(3,)", "8"), ("('ab',)", "'ba'")])
    ns: dict[str, object] = {}
    exec("def f(x):\n    return x[::-1] if isinstance(x, str) else x + 5\n", ns)
    exec(src, ns)
    assert src.count("\nassert ") == 2
    with pytest.raises(AssertionError):
        exec(asserts_for("f", [("(3,)", "8.0")]), ns)      # 8 == 8.0 but the type differs


ISOLATION_CODE = '''
import os, resource, socket
def can_connect(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
def can_write(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return True
    except OSError:
        return False
'''


@pytest.mark.parametrize("level", [lv for lv in available_levels() if lv != "rlimits-only"] or ["none"])
async def test_isolation_facts_from_inside(admin_bus: Bus, tmp_path: Path, level: str) -> None:
    """Inside the snippet: non-root uid, no route to a port the test listens on, a private /tmp and working
    dir (a second run sees nothing of the first), no writes outside it, and the clamped rlimits."""
    if level == "none":
        pytest.skip("neither bubblewrap nor unshare works here: only rlimits")
    await _streams(admin_bus)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    marker = Path("/tmp") / f"rlbus-host-{uuid.uuid4().hex}"
    marker.write_text("host")
    repo_file = REPO / f"pwned-{uuid.uuid4().hex}"
    tests = f'''
assert os.getuid() != 0 and os.geteuid() != 0
assert not can_connect({port})
assert not os.path.exists({str(marker)!r})
assert can_write("here.txt") and can_write("/tmp/mine.txt")
assert not can_write("/usr/rlbus-x") and not can_write("/etc/rlbus-x") and not can_write({str(repo_file)!r})
assert not can_write("/rlbus-x")
assert resource.getrlimit(resource.RLIMIT_CPU) == (2, 3)
assert resource.getrlimit(resource.RLIMIT_AS) == (128 << 20, 128 << 20)
assert resource.getrlimit(resource.RLIMIT_NPROC)[0] >= 5 and resource.getrlimit(resource.RLIMIT_NPROC)[0] < 64
assert resource.getrlimit(resource.RLIMIT_FSIZE) == (1 << 20, 1 << 20)
assert resource.getrlimit(resource.RLIMIT_NOFILE) == (20, 20)
'''
    asked = SandboxLimits(cpu_seconds=9.0, wall_seconds=2.0, memory_mb=128, max_processes=4, max_file_mb=5,
                          max_open_files=20, max_output_kb=16)     # cpu and file size get clamped to SMALL
    second = '''
assert not os.path.exists("here.txt") and not os.path.exists("/tmp/mine.txt")
assert os.listdir(".") == []
'''
    try:
        async with serving(admin_bus, replace(SMALL, pool_size=1), launch=SandboxLaunch(isolation=level)) as actor:
            first = await run_in_sandbox(admin_bus, "hub", _req(ISOLATION_CODE, tests, asked), attempts=1)
            again = await run_in_sandbox(admin_bus, "hub", _req(ISOLATION_CODE, second, asked), attempts=1)
            await _no_leftovers(actor)
        listener.settimeout(0.01)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
        marker.unlink()
    assert first.isolation == level
    assert (first.verdict.status, first.verdict.passed, first.verdict.total) == ("ok", 11, 11), first.stderr
    assert (again.verdict.status, again.verdict.passed) == ("ok", 2), again.stderr
    assert not repo_file.exists()


# ---- requests the service must survive ------------------------------------------------------------
async def test_bad_requests_answered_and_dead_lettered(admin_bus: Bus) -> None:
    """Garbage and a request without a reply subject are dead-lettered with their reason; the garbage
    gets an error verdict; the service keeps answering."""
    await _streams(admin_bus)
    s = admin_bus.subjects
    async with serving(admin_bus) as actor:
        reply = await admin_bus.nc.request(s.sandbox("hub"), b"\x93not msgpack", timeout=5)
        await admin_bus.nc.publish(s.sandbox("hub"), codec.encode(_req("pass"))[0])   # no reply subject
        after = await run_in_sandbox(admin_bus, "hub", _req("x = 1", "assert x == 1"), attempts=1)
        assert actor.counters["bad_requests"] == 2
    answer = codec.decode_as(reply.data, reply.headers, SandboxResult)
    assert answer.verdict.status == "error" and "bad sandbox request" in answer.stderr
    assert (after.verdict.status, after.verdict.passed, after.verdict.total) == ("ok", 1, 1)
    info = await admin_bus.js.stream_info(s.dead_letter_stream())
    assert info.state.messages == 2
    first = await admin_bus.js.get_msg(s.dead_letter_stream(), seq=1)
    assert first.data == b"\x93not msgpack" and first.headers and first.headers[REASON_HEADER]


async def test_concurrency_quota_queues_the_rest(admin_bus: Bus) -> None:
    """With concurrency 1 (pool 2), three sleeping snippets run one after another: their intervals never
    overlap, and every one is answered ok."""
    await _streams(admin_bus)
    code = "import time\nstart = time.time()\ntime.sleep(0.3)\nprint(start, time.time())\n"
    results: list[SandboxResult] = []
    async with serving(admin_bus, replace(SMALL, concurrency=1)):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                async def one() -> None:
                    results.append(await run_in_sandbox(admin_bus, "hub", _req(code), attempts=1))
                tg.start_soon(one)
    assert [r.verdict.status for r in results] == ["ok"] * 3
    spans = sorted(tuple(map(float, r.stdout.split())) for r in results)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans


# ---- infrastructure failures ----------------------------------------------------------------------
async def _wait_for_comm(marker: str, timeout_s: float = 5.0) -> int:
    """Host pid of the process whose name (comm) is `marker`."""
    def named() -> int | None:
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if Path(f"/proc/{name}/comm").read_text().strip() == marker:
                        return int(name)
                except OSError:
                    pass
        return None

    return await eventually(named, lambda pid: pid is not None, what=f"a process named {marker}",
                            timeout_s=timeout_s, poll_s=0.02)


def _named(marker: str, seconds: float) -> str:
    """Snippet code that names its process `marker` (visible in the host's /proc) and sleeps."""
    return f"import ctypes, time\nctypes.CDLL(None).prctl(15, {marker.encode()!r}, 0, 0, 0)\ntime.sleep({seconds})\n"


def _executor_of(actor: SandboxSupervisor, pid: int) -> int:
    """The pool executor (host pid) that runs host process `pid`."""
    assert actor.pool is not None
    for ex in actor.pool.executors():
        if pid in ex.host_pids():
            return ex.executor_pid()
    raise AssertionError(f"{pid} belongs to no executor")


@pytest.mark.chaos
async def test_executor_sigkill_mid_execution(admin_bus: Bus) -> None:
    """SIGKILL the executor running a snippet: that request gets `crashed`, the executor is replaced, the
    other requests and the next one succeed, and every request gets exactly one reply."""
    await _streams(admin_bus)
    s = admin_bus.subjects
    marker = f"rb{uuid.uuid4().hex[:10]}"
    inbox = admin_bus.nc.new_inbox()
    replies: list[SandboxResult] = []
    sub = await admin_bus.nc.subscribe(inbox)
    async with serving(admin_bus) as actor:
        assert actor.pool is not None
        before = {ex.executor_pid() for ex in actor.pool.executors()}
        victim_req = _req(_named(marker, 1.5))
        others = [_req("x = 2", "assert x == 2") for _ in range(5)]
        for req in [victim_req, *others]:
            await admin_bus.nc.publish(s.sandbox("hub"), codec.encode(req)[0], reply=inbox)
        victim = await _wait_for_comm(marker)
        executor = _executor_of(actor, victim)
        os.kill(executor, signal.SIGKILL)
        with anyio.fail_after(15):
            async for msg in sub.messages:
                replies.append(codec.decode_as(msg.data, msg.headers, SandboxResult))
                if len(replies) == 6:
                    break
        with anyio.fail_after(10):
            while len(actor.pool.live) < 2:
                await anyio.sleep(0.05)
        after = {ex.executor_pid() for ex in actor.pool.executors()}
        nxt = await run_in_sandbox(admin_bus, "hub", _req("y = 3", "assert y == 3"), attempts=1)
        with anyio.move_on_after(0.5):                          # no late or duplicate replies
            async for msg in sub.messages:
                replies.append(codec.decode_as(msg.data, msg.headers, SandboxResult))
        assert actor.state in (State.READY, State.BUSY)
        assert actor.counters["executor_crashes"] == 1 and not actor.breaker.rejects()
        await _no_leftovers(actor)
    by_id = {r.request_id: r for r in replies}
    assert len(replies) == 6 and set(by_id) == {victim_req.request_id, *(r.request_id for r in others)}
    assert by_id[victim_req.request_id].verdict.status == "crashed"
    assert all(by_id[r.request_id].verdict.status == "ok" for r in others)
    assert executor in before and executor not in after and len(after) == 2
    assert nxt.verdict.status == "ok"
    assert not Path(f"/proc/{victim}").exists()


@pytest.mark.chaos
async def test_breaker_opens_on_repeated_crashes_then_closes(admin_bus: Bus) -> None:
    """Two executor crashes in a row open the breaker (an incident event; requests answered `error` at
    once); after the cool-down a request runs again and closes it."""
    await _streams(admin_bus)
    launch = SandboxLaunch(breaker_failures=2, breaker_cooldown_s=1.0)
    async with serving(admin_bus, SMALL, launch=launch) as actor:
        assert actor.pool is not None
        for i in range(2):
            marker = f"rk{i}{uuid.uuid4().hex[:8]}"
            async with anyio.create_task_group() as tg:
                crashed: list[SandboxResult] = []

                async def ask(m: str = marker, into: list[SandboxResult] = crashed) -> None:
                    into.append(await run_in_sandbox(admin_bus, "hub", _req(_named(m, 1.5)), attempts=1))
                tg.start_soon(ask)
                os.kill(_executor_of(actor, await _wait_for_comm(marker)), signal.SIGKILL)
            assert crashed[0].verdict.status == "crashed"
        refused = await run_in_sandbox(admin_bus, "hub", _req("pass"), attempts=1)
        assert actor.breaker.rejects()
        await anyio.sleep(1.2)
        with anyio.fail_after(10):
            while len(actor.pool.live) < 2:
                await anyio.sleep(0.05)
        healed = await run_in_sandbox(admin_bus, "hub", _req("pass", "assert True"), attempts=1)
        assert not actor.breaker.rejects()
    assert refused.verdict.status == "error" and "circuit breaker" in refused.stderr
    assert healed.verdict.status == "ok"
    details = [e.detail for e in await _events(admin_bus) if e.event == "incident"]
    assert any("breaker open" in d for d in details) and any("breaker closed" in d for d in details)


# ---- the actor as a process -------------------------------------------------------------------------
def _actor_process(server: EmbeddedServer, run: str, actor_id: str, log: IO[bytes]) -> subprocess.Popen[bytes]:
    settings = {k: getattr(SMALL, k) for k in ("pool_size", "concurrency", "cpu_seconds", "wall_seconds",
                                               "memory_mb", "max_processes", "max_file_mb", "max_open_files",
                                               "max_output_kb")}
    cred = server.credential("sandbox")
    env = {**os.environ, "RLBUS_NATS_USER": cred.user, "RLBUS_NATS_PASSWORD": cred.password}
    return subprocess.Popen([sys.executable, "-m", "rlbus.ops.actor", "--kind", "sandbox", "--run", run,
                             "--region", "hub", "--id", actor_id, "--url", server.url, "--role", "sandbox",
                             "--settings", json.dumps(settings), "--heartbeat-s", "0.2", "--drain-s", "2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=log)


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, id="sigterm"), pytest.param(signal.SIGKILL, id="sigkill")])
async def test_actor_process_leaves_no_jail_behind(nats_server: EmbeddedServer, admin_bus: Bus,
                                                   sig: signal.Signals, tmp_path: Path) -> None:
    """`python -m rlbus.ops.actor --kind sandbox` serves requests; after SIGTERM (clean stop) or SIGKILL,
    none of its jails or executors is left."""
    await _streams(admin_bus)
    log = (tmp_path / "actor.log").open("wb")
    proc = _actor_process(nats_server, admin_bus.subjects.run, "sbp", log)
    try:
        with anyio.fail_after(30):
            while True:
                try:
                    result = await run_in_sandbox(admin_bus, "hub", _req("z = 1", "assert z == 1"),
                                                  timeout_s=2, attempts=1)
                    break
                except Exception:
                    assert proc.poll() is None, (tmp_path / "actor.log").read_text()[-2000:]
        assert result.verdict.status == "ok"
        jail_pids = set(descendants(proc.pid))
        assert any(os.stat(f"/proc/{p}").st_uid == SANDBOX_UID for p in jail_pids if Path(f"/proc/{p}").exists())
        proc.send_signal(sig)
        code = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=15))
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        with anyio.fail_after(5):
            while any(Path(f"/proc/{p}").exists() for p in jail_pids):
                await anyio.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
