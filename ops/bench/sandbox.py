"""`rlbus bench sandbox`: per-execution overhead of the sandbox by isolation level.

- Owns: the sandbox benchmark (`run`): one trivial snippet run many times at each isolation level this
  machine offers, its wall and CPU time, the NATS round trip through a real supervisor, and session
  latencies (`sessions_bench`).
- Does not: assert speed.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

TARGET_MS = 10.0
SESSION_TARGETS_MS = {"session_open_median_ms": 50.0, "tool_read_median_ms": 5.0, "tool_run_median_ms": 10.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sandbox-runs", type=int, default=300,
                   help="sandbox: timed executions per pre-forked level (default 300; fresh jails run a tenth)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every isolation level this machine offers, then sessions, and return the numbers.

    One trivial snippet (`pass` plus one assert) is run many times at each isolation level: a pre-forked
    executor in bubblewrap (the supervisor's default: per execution a fresh child with a non-root uid, no
    network, a private working directory, the rlimits, and every process of it killed before the next), a
    fresh bubblewrap jail per execution, a pre-forked executor under unshare + setpriv, and one with rlimits
    only. Times are the supervisor's round trip to the executor (`ExecutorPool.execute`); `service_median_ms`
    adds the NATS request/reply through a real `SandboxSupervisor` on an embedded server. The CPU time per
    execution (the jail's processes plus the supervisor's side) is reported too: on a shared, loaded machine
    the wall time is mostly waiting for a core. Sessions, through NATS and a supervisor at the best level
    with the default `[sandbox]` quota: `session_open_median_ms` (open of a small workspace, over
    back-to-back open → run → close cycles, so the spare jails are used up faster than they are
    replenished), `session_first_run_median_ms` (that first `run`, which starts the session's jail when no
    spare was left), `tool_read_median_ms` (read_file of a small file), `tool_run_median_ms` (`run` of
    `true` in a session's own jail), and `sessions_sustained` (sessions one supervisor holds open, up to its
    `max_sessions`, while every one's `run` call queues under the quota and is answered).
    """
    import anyio

    runs = 60 if getattr(args, "quick", False) else getattr(args, "sandbox_runs", 300)
    return anyio.run(_run, runs, backend="asyncio")


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    n = len(ordered)
    return {"median_ms": round(ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2, 3),
            "p90_ms": round(ordered[min(n - 1, int(0.9 * n))], 3), "n": n}


def _cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its reaped children (utime, stime, cutime, cstime from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


async def _run(runs: int) -> dict[str, Any]:
    import time

    from rlbus.actors.sandbox.pool import ExecutorPool, ExecutorProcess, available_levels, build_jail
    from rlbus.messages.schemas import SandboxLimits

    limits = {"cpu_seconds": 2.0, "memory_mb": 256, "max_processes": 16, "max_file_mb": 8, "max_open_files": 64,
              "wall_seconds": 5.0, "max_output_kb": 64}
    assert set(limits) == set(SandboxLimits.__struct_fields__)
    request = {"id": "bench", "code": "pass\n", "tests": "assert 1 + 1 == 2\n", "limits": limits}
    levels = available_levels()
    out: dict[str, Any] = {"levels": {}}

    for level in levels:
        pool = ExecutorPool(build_jail(level), 1)
        await pool.start()
        try:
            for _ in range(20):
                await pool.execute(request, 30)
            executor = pool.executors()[0].executor_pid()
            samples = []
            cpu0, own0 = _cpu_s(executor), time.process_time()
            for _ in range(runs):
                t0 = time.perf_counter()
                result = await pool.execute(request, 30)
                samples.append((time.perf_counter() - t0) * 1000)
                assert result["status"] == "ok", result
            cpu_ms = (_cpu_s(executor) - cpu0) / runs * 1000
            own_ms = (time.process_time() - own0) / runs * 1000
        finally:
            await pool.aclose()
        out["levels"][f"{level}-preforked"] = {**_stats(samples), "jail_cpu_ms": round(cpu_ms, 3),
                                               "supervisor_cpu_ms": round(own_ms, 3)}

    if "bwrap" in levels:
        jail = build_jail("bwrap")
        samples = []
        for _ in range(max(10, runs // 10)):
            t0 = time.perf_counter()
            ex = await ExecutorProcess.start(jail)
            result = await ex.execute(request, 30)
            await ex.close()
            samples.append((time.perf_counter() - t0) * 1000)
            assert result["status"] == "ok", result
        out["levels"]["bwrap-fresh"] = _stats(samples)

    out["levels"]["service-nats"] = await _service(runs, levels[0])
    sessions = await sessions_bench(runs, levels[0])
    best = levels[0]
    isolated = best in ("bwrap", "unshare")
    table = out["levels"]
    return {
        "isolation": best,
        "isolated_median_ms": table[f"{best}-preforked"]["median_ms"] if isolated else None,
        "isolated_p90_ms": table[f"{best}-preforked"]["p90_ms"] if isolated else None,
        "isolated_cpu_ms": (round(table[f"{best}-preforked"]["jail_cpu_ms"]
                                  + table[f"{best}-preforked"]["supervisor_cpu_ms"], 3) if isolated else None),
        "target_ms": TARGET_MS,
        "fresh_bwrap_median_ms": table.get("bwrap-fresh", {}).get("median_ms"),
        "unshare_median_ms": table.get("unshare-preforked", {}).get("median_ms"),
        "rlimits_only_median_ms": table.get("rlimits-only-preforked", {}).get("median_ms"),
        "service_median_ms": table["service-nats"]["median_ms"],
        **sessions,
        "levels": table,
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


async def _service(runs: int, level: str) -> dict[str, float]:
    """Request/reply through a SandboxSupervisor on an embedded nats-server (what a generator waits)."""
    import time

    from rlbus.actors.common.sandbox_client import run_in_sandbox
    from rlbus.actors.sandbox.config import SandboxConfig, SandboxLaunch
    from rlbus.messages.schemas import SandboxRequest
    from rlbus.ops.local_sandbox import local_sandbox

    samples: list[float] = []
    async with local_sandbox("bench-sandbox", SandboxConfig(pool_size=1, concurrency=1),
                             SandboxLaunch(isolation=level)) as bus:
        for i in range(20 + runs):
            req = SandboxRequest(request_id=f"bench-{i}", code="pass\n", tests="assert 1 + 1 == 2\n")
            t0 = time.perf_counter()
            result = await run_in_sandbox(bus, "hub", req, attempts=1)
            if i >= 20:
                samples.append((time.perf_counter() - t0) * 1000)
            assert result.verdict.status == "ok", result
    return _stats(samples)


async def sessions_bench(runs: int, level: str, *, max_sessions: int | None = None) -> dict[str, Any]:
    """Session open, read and run latency, and the sessions one supervisor holds while their runs queue
    (the default `[sandbox]`; `max_sessions` lowers that one bound, for a quick check)."""
    import time

    import anyio

    from rlbus.actors.common.sessions import SessionRefused, call_tool, close_session, open_session
    from rlbus.actors.sandbox.config import SandboxConfig, SandboxLaunch
    from rlbus.ops.local_sandbox import local_sandbox

    files = {"pkg/__init__.py": b"", "pkg/mod.py": b"def f(x):\n    return x\n" * 20, "README": b"bench\n"}
    config = SandboxConfig() if max_sessions is None else SandboxConfig(max_sessions=max_sessions)
    n = max(runs, 5)
    opens: list[float] = []
    firsts: list[float] = []
    reads: list[float] = []
    jailed: list[float] = []
    async with local_sandbox("bench-sandbox", config, SandboxLaunch(isolation=level)) as bus:   # type: ignore[arg-type]
        for i in range(5 + n):                   # back to back: spares are used up faster than they are made
            t0 = time.perf_counter()
            sid = await open_session(bus, "hub", files, lease_s=60)
            t1 = time.perf_counter()
            first = await call_tool(bus, "hub", sid, "run", {"command": "true"})
            if i >= 5:
                opens.append((t1 - t0) * 1000)
                firsts.append((time.perf_counter() - t1) * 1000)
            assert first.ok, first
            await close_session(bus, "hub", sid)
        sid = await open_session(bus, "hub", files, lease_s=60)
        for samples, tool, args in ((reads, "read_file", {"path": "pkg/mod.py"}), (jailed, "run", {"command": "true"})):
            for i in range(5 + n):
                t0 = time.perf_counter()
                result = await call_tool(bus, "hub", sid, tool, args)
                if i >= 5:
                    samples.append((time.perf_counter() - t0) * 1000)
                assert result.ok, result
        await close_session(bus, "hub", sid)
        held: list[str] = []
        try:
            while len(held) < config.max_sessions + 1:
                held.append(await open_session(bus, "hub", files, lease_s=120))
        except SessionRefused:
            pass
        answered = 0
        t0 = time.perf_counter()

        async def one(session_id: str) -> None:
            nonlocal answered
            result = await call_tool(bus, "hub", session_id, "run", {"command": "echo ok"}, timeout_s=300)
            answered += result.ok and result.output == "ok\n"

        async with anyio.create_task_group() as tg:
            for session_id in held:
                tg.start_soon(one, session_id)
        queued_s = time.perf_counter() - t0
        for session_id in held:
            await close_session(bus, "hub", session_id)
    return {"session_open_median_ms": _stats(opens)["median_ms"],
            "session_first_run_median_ms": _stats(firsts)["median_ms"],
            "tool_read_median_ms": _stats(reads)["median_ms"],
            "tool_run_median_ms": _stats(jailed)["median_ms"], "tool_run_p90_ms": _stats(jailed)["p90_ms"],
            "sessions_sustained": answered if answered == len(held) else 0, "sessions_max": config.max_sessions,
            "sessions_concurrency": config.concurrency, "sessions_queued_runs_s": round(queued_s, 3),
            "session_targets_ms": dict(SESSION_TARGETS_MS)}


def table(result: dict[str, Any]) -> str:
    lines = [f"sandbox per-execution overhead (trivial snippet; isolation in use: {result['isolation']}; "
             f"{result['cpu_count']} cores, load {result['load_avg_1m']})",
             f"{'level':<26}{'median ms':>11}{'p90 ms':>9}{'n':>6}{'CPU ms (jail+supervisor)':>27}"]
    for name, row in result["levels"].items():
        cpu = f"{row['jail_cpu_ms']:.2f} + {row['supervisor_cpu_ms']:.2f}" if "jail_cpu_ms" in row else ""
        lines.append(f"{name:<26}{row['median_ms']:>11.2f}{row['p90_ms']:>9.2f}{row['n']:>6}{cpu:>27}")
    iso = result["isolated_median_ms"]
    lines.append(f"isolated (pre-forked, fully isolated) median: "
                 f"{'n/a' if iso is None else f'{iso:.2f} ms'} (target <= {result['target_ms']:g} ms)")
    for key, target in result["session_targets_ms"].items():
        lines.append(f"{key}: {result[key]:.2f} ms (target <= {target:g} ms)")
    lines.append(f"session_first_run_median_ms: {result['session_first_run_median_ms']:.2f} ms")
    lines.append(f"sessions_sustained: {result['sessions_sustained']} open sessions (max_sessions "
                 f"{result['sessions_max']}), their run calls queued under concurrency {result['sessions_concurrency']} "
                 f"and answered in {result['sessions_queued_runs_s']:.2f} s")
    return "\n".join(lines)
