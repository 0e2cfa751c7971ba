"""`rlbus chaos --agentic`: agentic episodes (repository tasks, scripted tool calls, sandbox sessions) on a hub and a
leaf while a generator, a sandbox supervisor and the trainer are SIGKILLed mid-episode and the leaf's server is
SIGKILLed: nothing lost or trained twice, no session left open, every restored workspace equal to its snapshot,
no restart of an actor nobody killed; and the agentic figures' own accounting."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rlbus.actors.sandbox.sessions import ROOT_PREFIX
from rlbus.messages.schemas import Event
from rlbus.ops.chaos.agentic import (
    AGENTIC_KILL_KINDS,
    agentic_chaos_topology,
    agentic_verdict,
    is_agentic,
    kill_kinds,
    restore_checks,
    session_roots_left,
)
from rlbus.ops.chaos.plan import ChaosSettings, plan_faults
from rlbus.ops.chaos.report import exit_code, table
from rlbus.topology.examples import example_path
from rlbus.topology.file.load import load

MINUTES = 0.3
SETTINGS = {"kills": 4, "server_kills": 1, "partitions": 0, "pauses": 0, "outage_s": 8.0}
KINDS = list(AGENTIC_KILL_KINDS)


def _seed() -> int:
    """The first seed whose plan kills the trainer in the first third of the window: what it held comes back
    after the topology's redelivery wait (20 s), so a late kill would only lengthen the quiet period."""
    window = MINUTES * 60
    for seed in range(500):
        plan = plan_faults(ChaosSettings(duration_s=window, seed=seed, **SETTINGS), KINDS, ["eu"])  # type: ignore[arg-type]
        if any(f.kind == "actor_kill" and f.target == "trainer" and f.at_s < window / 3 for f in plan):
            return seed
    raise AssertionError("no seed kills the trainer early")


def _restored(equal: bool) -> Event:
    return Event(event="incident", data={"what": "workspace_restored", "equal": str(equal).lower()})


def test_restore_checks_count_only_restore_events() -> None:
    events = [_restored(True), _restored(False), _restored(True), Event(event="incident", data={"what": "other"})]
    assert restore_checks(events) == (3, 2)


def test_session_roots_left_are_those_of_the_given_pids(tmp_path: Path) -> None:
    for name in (f"{ROOT_PREFIX}41-abc", f"{ROOT_PREFIX}412-def", f"{ROOT_PREFIX}7-x", "other-41-y"):
        (tmp_path / name).mkdir()
    assert session_roots_left([41, 7], str(tmp_path)) == [str(tmp_path / f"{ROOT_PREFIX}41-abc"),
                                                          str(tmp_path / f"{ROOT_PREFIX}7-x")]
    assert session_roots_left([], str(tmp_path)) == []


def test_agentic_verdict_names_each_problem_and_fails_the_exit_code() -> None:
    clean = {"sessions_open": 0, "session_roots_left": [], "restores_checked": 3, "restores_equal": 3,
             "unplanned_restarts": 0, "sessions_opened": 9, "sandbox_errors": 1}
    assert agentic_verdict(clean) == []
    bad = {**clean, "sessions_open": 2, "session_roots_left": ["/dev/shm/x"], "restores_equal": 2,
           "unplanned_restarts": 1}
    wrong = agentic_verdict(bad)
    assert len(wrong) == 4 and "2 sessions still open" in wrong and "1 restarts of actors nobody killed" in wrong
    ledger = {"lost": 0, "duplicated": 0, "tasks_lost": 0}
    assert exit_code({**ledger, "agentic": {**clean, "wrong": []}}) == 0
    assert exit_code({**ledger, "agentic": {**bad, "wrong": wrong}}) == 1


def test_the_agentic_topology_kills_generators_sandboxes_and_the_trainer_mid_episode() -> None:
    """Every turn of its scripted episodes changes the workspace (so a kill mid-episode means a restore), the leaf
    has a generator and a sandbox of its own, and a first round of kills hits each kind once."""
    topology = agentic_chaos_topology()
    assert topology.generator.script == "edits" and topology.feeder.tasks.startswith("repo") and is_agentic(topology)
    assert not is_agentic(load(example_path("tiny")))
    assert {(i.region, i.kind) for i in topology.instances()} >= {("eu", "generator"), ("eu", "sandbox")}
    kinds = kill_kinds(topology, AGENTIC_KILL_KINDS)
    assert kinds == ["generator", "sandbox", "trainer"]
    plan = plan_faults(ChaosSettings(duration_s=MINUTES * 60, seed=0, **SETTINGS), kinds, ["eu"])  # type: ignore[arg-type]
    assert sorted(f.target for f in plan if f.kind == "actor_kill") == kinds
    assert [f.target for f in plan if f.kind == "server_kill"] == ["eu"]


@pytest.mark.chaos
@pytest.mark.timeout(400)
def test_short_agentic_chaos_run_is_clean(tmp_path: Path, processes_mentioning: Callable[[str], list[int]]) -> None:
    """`rlbus chaos --agentic --json` for 18 s of faults: exit 0; the ledger clean with training done; a generator,
    a sandbox supervisor and the trainer killed and the leaf's server killed and restarted; sessions were opened
    and none is open at the end nor left on disk; workspaces were restored and each equals its snapshot; the
    sandbox_error drops are the ledger's; no restart of an actor nobody killed; no process left."""
    state = tmp_path / "state"
    args = ["--agentic", "--minutes", str(MINUTES), "--kills", "4", "--server-kills", "1", "--partitions", "0",
            "--pauses", "0", "--outage-s", "8", "--settle-s", "150", "--warmup-s", "200", "--seed", str(_seed()),
            "--state-dir", str(state), "--json"]
    proc = subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "chaos", *args], capture_output=True, text=True,
                          timeout=380, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["lost"] == 0 and result["duplicated"] == 0 and result["tasks_lost"] == 0, result
    assert result["trained"] > 0 and result["produced_by_region"]["eu"] > 0, result
    assert result["killed_kinds"] == {"generator": 1, "sandbox": 1, "trainer": 1}, result["faults"]
    assert result["server_kills"] == 1, result["faults"]
    a = result["agentic"]
    assert a["sessions_opened"] > 0 and a["sessions_open"] == 0 and a["session_roots_left"] == [], a
    assert a["restores_checked"] >= 1 and a["restores_equal"] == a["restores_checked"], a
    assert a["sandbox_errors"] == result["dropped"].get("sandbox_error", 0), (a, result["dropped"])
    assert a["unplanned_restarts"] == 0 and result["unplanned_restarts"] == {} and a["wrong"] == [], result
    assert "restored workspaces equal to their snapshot" in table(result)
    assert processes_mentioning(str(state)) == []
