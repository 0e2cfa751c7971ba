"""`rlbus bench sandbox`: per-execution overhead of the sandbox by isolation level.

Owns: the sandbox benchmark. One trivial snippet (`pass` plus one assert) is run many times at each
isolation level this machine offers: a pre-forked executor in bubblewrap (the supervisor's default:
per execution a fresh child with a non-root uid, no network, a private working directory, the
rlimits, and every process of it killed before the next), a fresh bubblewrap jail per execution,
a pre-forked executor under unshare + setpriv, and one with rlimits only. Times are the supervisor's
round trip to the executor (`ExecutorPool.execute`); `service_median_ms` adds the NATS request/reply
through a real `SandboxSupervisor` on an embedded server. The CPU time per execution (the jail's
processes plus the supervisor's side) is reported too: on a shared, loaded machine the wall time is
mostly waiting for a core. Nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

TARGET_MS = 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sandbox-runs", type=int, default=300,
                   help="sandbox: timed executions per pre-forked level (default 300; fresh jails run a tenth)")


def run(args: argparse.Namespace) -> dict[str, Any]:
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
    return "\n".join(lines)
