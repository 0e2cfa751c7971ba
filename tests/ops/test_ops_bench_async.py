"""`rlbus bench async --quick` runs both arms for the same number of optimizer steps with clean ledgers:
the sync arm trains only on rollouts of the version it holds (lockstep), and nothing is left running.
No speed is asserted (benchmarks report numbers; the suite checks outcomes)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from rlbus.ops.bench.async_pipeline import add_arguments, run, table

pytestmark = pytest.mark.slow


def test_quick_bench_runs_both_arms_to_the_same_step_with_clean_ledgers(
        tmp_path: Path, processes_mentioning: Callable[[str], list[int]]) -> None:
    """Both arms take N=2 steps of 4 rollouts; the sync arm's are all 0 versions behind; ledgers are clean."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    add_arguments(parser)
    state = tmp_path / "bench"
    result = run(parser.parse_args(["--quick", "--async-state-dir", str(state)]))
    assert {"speedup", "staleness", "steps", "arms"} <= set(result)
    assert result["speedup"] > 0 and result["steps"] == 2 and result["batch_rollouts"] == 4
    for arm in ("async", "sync"):
        numbers = result["arms"][arm]
        assert numbers["steps_taken"] >= 2
        assert numbers["rollouts_trained"] == 8               # 2 steps x 4 rollouts
        assert numbers["ledger"]["clean"], numbers["ledger"]
        assert numbers["ledger"]["lost"] == 0 and numbers["ledger"]["trained_twice"] == 0
        assert sum(numbers["staleness"].values()) == 8
        assert {"wall_s", "steps_per_s", "rollouts_per_s", "dropped"} <= set(numbers)
    assert result["arms"]["sync"]["staleness"] == {"0": 8}
    assert result["arms"]["sync"]["dropped_total"] == 0
    assert result["staleness"] == result["arms"]["async"]["staleness"]
    assert "speedup (sync / async wall-clock)" in table(result)
    assert (state / "sync" / "pretrained" / "pretrain.pt").exists()
    assert processes_mentioning(str(state)) == []


@pytest.mark.parametrize("arm", ["async", "sync"])
def test_both_arms_take_the_settings_examples_checkpoint_and_weights(tmp_path: Path, arm: str) -> None:
    """The bench runs the default run's checkpoint interval and weight publishing (single.toml: every version a
    full snapshot), not the tiny example's test settings, in both arms alike."""
    import msgspec

    from rlbus.ops.bench.async_pipeline import _topology
    from rlbus.topology.examples import example_path
    from rlbus.topology.file.schema import Topology

    single = msgspec.toml.decode(example_path("single").read_bytes(), type=Topology)
    tiny = msgspec.toml.decode(example_path("tiny").read_bytes(), type=Topology)
    topology = _topology(arm, "r", tmp_path, settings="single", tasks=4, generators=1)
    assert topology.checkpoint == single.checkpoint != tiny.checkpoint
    assert topology.weights == single.weights != tiny.weights
    assert topology.weights.full_every == 1
    assert _topology(arm, "r", tmp_path, settings="tiny", tasks=2, generators=1).weights == tiny.weights
