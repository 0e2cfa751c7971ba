"""The session keys of `rlbus bench sandbox` at a small setting: every key is there with a positive value,
and the supervisor holds as many sessions as it may while their `run` calls queue. No speed is asserted."""

from __future__ import annotations

import math

import pytest

from rlbus.actors.sandbox.pool import available_levels
from rlbus.ops.bench.sandbox import SESSION_TARGETS_MS, sessions_bench

pytestmark = pytest.mark.anyio


async def test_session_keys_are_measured_through_a_real_supervisor() -> None:
    """open, first run, read and run medians are finite and positive; every one of the 3 sessions allowed is
    held and its queued run answered."""
    result = await sessions_bench(5, available_levels()[0], max_sessions=3)
    for key in (*SESSION_TARGETS_MS, "session_first_run_median_ms", "tool_run_p90_ms"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["tool_run_p90_ms"] >= result["tool_run_median_ms"]
    assert (result["sessions_sustained"], result["sessions_max"]) == (3, 3)
    assert result["sessions_queued_runs_s"] > 0 and result["session_targets_ms"] == SESSION_TARGETS_MS
