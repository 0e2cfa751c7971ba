"""`rlbus bench sandbox` at its smallest setting (`--sandbox-runs 1`): the JSON carries every documented key
with sane values, the table names each level, and neither run leaves a process or a temp directory behind.
No speed is asserted (benchmarks report numbers; the suite checks outcomes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from helpers.ops import json_in

from rlbus.actors.sandbox.pool import LEVELS, available_levels
from rlbus.ops.bench.sandbox import TARGET_MS

SMALLEST = ("--sandbox-runs", "1")
"""One timed execution per level (plus the bench's fixed warm-ups and ten fresh jails); `--quick` is 60."""


def _session_members(sid: int) -> list[int]:
    """PIDs of this machine's live processes (not zombies) in session `sid`, from /proc/PID/stat."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        state, _ppid, _pgrp, session = stat[stat.rindex(b")") + 2:].split()[:4]
        if int(session) == sid and state != b"Z":
            found.append(int(name))
    return found


def _bench(tmp_path: Path, processes_mentioning: Callable[[str], list[int]], *extra: str) -> str:
    """Run `rlbus bench sandbox` in its own session with its temp files under `tmp_path`; return its stdout
    once it has exited 0 and nothing it started is left: no process in its session (executors, jails),
    none naming `tmp_path` (the embedded nats-server's store), no leftover store directory."""
    cmd = [sys.executable, "-m", "rlbus.ops.cli", "bench", "sandbox", *SMALLEST, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)          # hang guard only
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)                # its own process group: stop by its pid
        proc.communicate()
        raise
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    assert _session_members(proc.pid) == []
    assert processes_mentioning(str(tmp_path)) == []
    assert list(tmp_path.glob("rlbus-bench-sandbox-*")) == []
    return out


def test_bench_sandbox_json_reports_every_level_this_machine_offers(
        tmp_path: Path, processes_mentioning: Callable[[str], list[int]]) -> None:
    """`--json` reports the best level in use, a positive isolated median when it isolates, and one row per level."""
    result = json_in(_bench(tmp_path, processes_mentioning, "--json"))
    levels = available_levels()
    assert {"isolation", "isolated_median_ms", "isolated_p90_ms", "isolated_cpu_ms", "target_ms",
            "fresh_bwrap_median_ms", "unshare_median_ms", "rlimits_only_median_ms", "service_median_ms",
            "levels", "cpu_count", "load_avg_1m"} <= set(result)
    assert result["isolation"] in LEVELS and result["isolation"] == levels[0]
    if result["isolation"] in ("bwrap", "unshare"):
        assert isinstance(result["isolated_median_ms"], float) and result["isolated_median_ms"] > 0
        assert result["isolated_p90_ms"] >= result["isolated_median_ms"]
        assert result["isolated_cpu_ms"] >= 0
    else:                                                  # rlimits only: nothing counts as isolated
        assert result["isolated_median_ms"] is None and result["isolated_p90_ms"] is None
    assert result["target_ms"] == TARGET_MS
    expected_rows = {f"{level}-preforked" for level in levels} | {"service-nats"}
    expected_rows |= {"bwrap-fresh"} if "bwrap" in levels else set()
    assert set(result["levels"]) == expected_rows
    for name, row in result["levels"].items():
        assert row["median_ms"] > 0 and row["p90_ms"] >= row["median_ms"], (name, row)
        assert row["n"] == (10 if name == "bwrap-fresh" else 1), (name, row)
        if name.endswith("-preforked"):
            assert row["jail_cpu_ms"] >= 0 and row["supervisor_cpu_ms"] >= 0, (name, row)
    assert result["service_median_ms"] == result["levels"]["service-nats"]["median_ms"]
    assert result["fresh_bwrap_median_ms"] == result["levels"].get("bwrap-fresh", {}).get("median_ms")
    assert result["cpu_count"] == os.cpu_count()


def test_bench_sandbox_prints_a_table_without_json(
        tmp_path: Path, processes_mentioning: Callable[[str], list[int]]) -> None:
    """Without `--json` it prints the table: the level in use, a row per level and the isolated median line."""
    out = _bench(tmp_path, processes_mentioning)
    levels = available_levels()
    assert f"sandbox per-execution overhead (trivial snippet; isolation in use: {levels[0]};" in out
    lines = out.splitlines()
    assert any(line.startswith("level") and "median ms" in line and "p90 ms" in line for line in lines)
    for row in [f"{level}-preforked" for level in levels] + ["service-nats"]:
        assert any(line.startswith(row) for line in lines), row
    assert "isolated (pre-forked, fully isolated) median: " in out
    assert f"(target <= {TARGET_MS:g} ms)" in out
    assert not out.lstrip().startswith("{")
