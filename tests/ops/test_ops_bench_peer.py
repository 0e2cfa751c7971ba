"""`rlbus bench peer --quick --json`: both arms (TRL's GRPOTrainer, then `rlbus up`'s actors) train the same built
policy for the same two optimizer steps (a number of steps, not a wall-clock budget: a slow machine takes longer,
and still steps), every snapshot and v0 are scored on the same held-out tasks, and the JSON holds every
key with values that agree with each other and with the curves; a PNG of both curves is written and nothing is
left running. No speed or learning is asserted (benchmarks report numbers; the suite checks outcomes)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rlbus.ops.bench.peer import table

pytestmark = pytest.mark.slow

KEYS = ("trl_rollouts_per_s", "rlbus_rollouts_per_s", "throughput_ratio", "trl_final_pass_at_1", "trl_final_ci95",
        "rlbus_final_pass_at_1", "rlbus_final_ci95", "rlbus_time_to_trl_final_s", "time_ratio", "trl_learned",
        "base_pass_at_1", "base_ci95")


def _holds(point: dict[str, object]) -> bool:
    low, high = point["ci95"]                                          # type: ignore[misc]
    return 0.0 <= low <= point["pass_at_1"] <= high <= 1.0            # type: ignore[operator]


def test_quick_peer_bench_reports_consistent_keys_for_both_arms(
        tmp_path: Path, processes_mentioning: Callable[[str], list[int]]) -> None:
    """Every key is present; finals and base are the curves' ends; the ratios follow from the arms' numbers."""
    work = tmp_path / "peer"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from rlbus.ops.cli import main; sys.exit(main())",
         "bench", "peer", "--quick", "--json", "--peer-dir", str(work)],
        cwd=tmp_path, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in ("trl: snapshot 1", "rlbus: snapshot 1", "scored v0", "fewer than the 2000"):
        assert line in proc.stderr, line                               # progress of each arm and each score
    result = json.loads(proc.stdout)
    assert set(KEYS) <= set(result)
    trl, rl = result["arms"]["trl"], result["arms"]["rlbus"]
    batch = result["matched"]["group_size"] * result["matched"]["tasks_per_step"]
    assert batch == 8 and result["matched"]["max_completion_tokens"] == 32          # --quick's smaller batch
    assert result["steps_per_arm"] == 2 and result["minutes"] is None                # --quick: steps, no budget
    for arm in (trl, rl):
        assert arm["optimizer_steps"] == 2 and arm["rollouts_trained"] == 2 * batch
        assert len(arm["curve"]) >= 2 and arm["curve"][0]["t_s"] == 0.0
        assert all(_holds(p) and p["n"] == result["held_out_n"] == 8 for p in arm["curve"])
        assert [p["t_s"] for p in arm["curve"]] == sorted(p["t_s"] for p in arm["curve"])
        assert arm["gen_tokens_per_s"] > 0
    assert trl["curve"][0] == rl["curve"][0]                           # one v0, scored once
    assert result["base_pass_at_1"] == trl["curve"][0]["pass_at_1"] and result["base_ci95"] == trl["curve"][0]["ci95"]
    assert result["trl_final_pass_at_1"] == trl["curve"][-1]["pass_at_1"]
    assert result["rlbus_final_ci95"] == rl["curve"][-1]["ci95"]
    assert result["trl_rollouts_per_s"] == trl["rollouts_per_s"]
    assert math.isclose(result["throughput_ratio"], rl["rollouts_per_s"] / trl["rollouts_per_s"])
    assert result["trl_learned"] == (result["trl_final_ci95"][0] > result["base_ci95"][1])
    versions = [p["version"] for p in rl["curve"][1:]]
    assert versions == sorted(versions) and versions[-1] == 2                        # the version two steps make
    if result["rlbus_time_to_trl_final_s"] is None:
        assert result["time_ratio_is_bound"]
    else:
        reached = next(p for p in rl["curve"][1:] if p["pass_at_1"] >= result["trl_final_pass_at_1"])
        assert result["rlbus_time_to_trl_final_s"] == reached["t_s"]
        assert math.isclose(result["time_ratio"], trl["wall_s"] / reached["t_s"], rel_tol=0.01)
    assert Path(result["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"kl_coef", "group_size", "temperature", "max_completion_tokens", "lr"} <= set(result["matched"])
    assert any("KL" in note for note in result["unmatched"])
    assert result["reference_dtype"] in {"bfloat16", "float32"}
    assert any(note.startswith("reference precision") for note in result["unmatched"])
    assert "throughput ratio" in table(result)
    assert processes_mentioning(str(work)) == []


@pytest.mark.parametrize("generators", [1, 2])
def test_rlbus_arm_topology_carries_the_matched_settings_and_validates(tmp_path: Path, generators: int) -> None:
    """The rlbus arm's topology trains with exactly the shared settings, publishes full snapshots, and
    `rlbus validate`'s rules find no error in it."""
    from rlbus.ops.bench.peer_rlbus import rlbus_topology
    from rlbus.ops.bench.peer_trl import Shared
    from rlbus.topology.file.rules import check

    shared = Shared(group_size=4, tasks_per_step=3, temperature=0.9, max_tokens=48, lr=2e-4, kl_coef=0.02,
                    grad_clip=1.0, seed=7)
    topology = rlbus_topology("peer", tmp_path / "state", tmp_path / "base", shared, generators=generators)
    g, t = topology.generator, topology.trainer
    assert (g.group_size, g.temperature, g.max_tokens, g.max_attempts) == (4, 0.9, 48, 1)
    assert (t.lr, t.lr_decay_steps, t.kl_coef, t.batch_rollouts, t.seed) == (2e-4, 0, 0.02, 12, 7)
    assert (t.drop_flat_groups, t.scale_by_std, t.aggregation) == (False, False, "token_mean")
    assert topology.weights.full_every == 1
    assert topology.policy.path == str((tmp_path / "base").resolve()) and topology.policy.dtype == "float32"
    [hub] = topology.regions
    assert [a.count for a in hub.actors if a.kind == "generator"] == [generators]
    assert [p for p in check(topology, local_cores=2) if p.severity == "error"] == []
