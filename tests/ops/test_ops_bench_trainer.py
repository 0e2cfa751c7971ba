"""`rlbus bench trainer --quick` runs world sizes 1 and 2 on the tiny built-in and Qwen2 policies and reports
every key; at 2 ranks each rank holds half the parameters and optimizer state (tensor bytes are counted, so
this holds exactly). No speed is asserted (benchmarks report numbers; the suite checks outcomes)."""

from __future__ import annotations

import argparse

import pytest

from rlbus.ops.bench.trainer import add_arguments, run, table

pytestmark = pytest.mark.slow


def test_quick_bench_reports_both_world_sizes_and_halves_the_state_per_rank() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    add_arguments(parser)
    result = run(parser.parse_args(["--quick"]))
    for key in ("memory_per_rank_ratio", "memory_per_rank_ratio_hf", "step_speedup", "step_speedup_hf",
                "publish_gather_s", "publish_gather_s_hf", "rss_rise_ratio", "rss_rise_ratio_hf"):
        assert result[key] > 0, key
    for policy in ("builtin", "hf"):
        one, two = result[policy]["1"], result[policy]["2"]
        assert len(two["ranks"]) == 2 and one["params"] == two["params"]
        for rank in two["ranks"]:
            for part in ("params", "optimizer"):
                half = one["ranks"][0]["at_step"][part] / 2   # dim-0 shards of odd sizes round up
                assert abs(rank["at_step"][part] - half) <= 0.02 * half, (policy, rank["rank"], part)
        assert two["ranks"][1]["at_publish"]["buffers"] == 0      # only the leader holds the published version
    assert "memory_per_rank_ratio" in table(result)
