"""A short `rlbus chaos` in CI: the 3-region RL run under actor SIGKILLs of several kinds, a leaf-server SIGKILL,
a partition and pauses; nothing lost, nothing trained twice, every kill done, and no process left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rlbus.ops.chaos.plan import ChaosSettings, plan_faults

pytestmark = pytest.mark.chaos

MINUTES = 0.8
KILLS = 5
KINDS = ["checkpointer", "evaluator", "feeder", "generator", "publisher", "sandbox", "trainer"]
SETTINGS = {"kills": KILLS, "server_kills": 1, "partitions": 1, "pauses": 2, "outage_s": 8.0, "pause_s": 3.0}


def _seed() -> int:
    """The first seed whose plan kills the trainer and a generator in the first half of the window: what they
    held comes back after the consumers' 60 s ack wait, so late kills would only lengthen the quiet period."""
    window = MINUTES * 60
    for seed in range(500):
        plan = plan_faults(ChaosSettings(duration_s=window, seed=seed, **SETTINGS), KINDS, ["eu", "us"])  # type: ignore[arg-type]
        early = {f.target for f in plan if f.kind == "actor_kill" and f.at_s < window / 2}
        if {"trainer", "generator"} <= early:
            return seed
    raise AssertionError("no seed kills the trainer and a generator early")


@pytest.mark.timeout(600)
def test_short_chaos_run_loses_nothing_and_trains_nothing_twice(tmp_path: Path,
                                                                processes_mentioning: Callable[[str], list[int]]) -> None:
    """`rlbus chaos --json` for 48 s of faults (4 actor kills, a leaf server down 8 s, a partition of 8 s, two
    pauses): exit 0, lost 0, trained twice 0, every kill done, training happened, no process left."""
    state = tmp_path / "state"
    args = ["--minutes", str(MINUTES), "--kills", str(KILLS), "--server-kills", "1", "--partitions", "1",
            "--pauses", "2", "--outage-s", "8", "--pause-s", "3", "--settle-s", "150", "--warmup-s", "240",
            "--seed", str(_seed()), "--state-dir", str(state), "--json"]
    proc = subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "chaos", *args], capture_output=True, text=True,
                          timeout=560, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["lost"] == 0 and result["duplicated"] == 0, result
    assert result["tasks_lost"] == 0 and result["tasks_fed"] > 0, result          # every fed task accounted for
    assert result["tasks_fed"] == (result["tasks_rolled_out"] + result["tasks_dead_lettered"]
                                   + result["tasks_pending"]), result
    assert result["kills"] >= KILLS and result["server_kills"] == 1 and result["partitions"] == 1, result["faults"]
    assert {"trainer", "generator"} <= set(result["killed_kinds"]), result["killed_kinds"]
    assert result["trained"] > 0 and result["steps"] > 0
    assert result["recovery"]["actor_kill"]["recovered"] == result["actor_kills"], result["faults"]
    assert json.loads((state / "chaos.json").read_text())["kills"] == result["kills"]
    assert processes_mentioning(str(state)) == []
