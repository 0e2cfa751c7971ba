"""A run that has ended, as a researcher meets it afterwards: `rlbus up tiny --record FILE` wrote the recording
as it went; `rlbus record`, `rlbus events` and `rlbus health --once` on the stopped run open it read-only
(its stored servers started again, no actor, stopped at the end: no nats-server is left); a second run with
the same pretraining settings reuses the pretrained base instead of pretraining again. The ended run is the
session's shared finished run (`finished_run`, tests/helpers/runs.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.runs import FINISHED_STEPS, PRETRAIN_STEPS, FinishedRun, tiny_topology

pytestmark = pytest.mark.slow


def _rlbus(*argv: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlbus.ops.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, check=False)


def _inspect(recording: Path, cwd: Path) -> dict[str, Any]:
    proc = _rlbus("replay", str(recording), "inspect", "--json", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout))


def _server_pids(state: Path) -> list[int]:
    """PIDs of every nats-server that ever served the hub's store, in start order (from its log)."""
    log = (state / "nats" / "hub" / "nats-server.log").read_text()
    return [int(line[1:].split("]", 1)[0]) for line in log.splitlines() if line.endswith("[INF] Starting nats-server")]


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def ended(finished_run: FinishedRun) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The shared finished run, which must have ended well; (its folder, its process)."""
    proc = finished_run.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return finished_run.base, proc


def test_up_records_the_run_as_it_goes(ended: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    """--record FILE: the file is complete when `rlbus up` ends and holds the run's TrainSteps and rollouts."""
    base, proc = ended
    assert f"rlbus up: recording the run's streams into {base / 'during.rlrec'}" in proc.stdout
    assert f"rlbus up: recording written to {base / 'during.rlrec'}" in proc.stdout
    summary = _inspect(base / "during.rlrec", base)
    assert summary["complete"] and summary["run"] == "tiny"
    assert summary["per_kind"]["train_step"] >= 4 and summary["per_kind"]["rollout"] >= 4 * 4   # batch of 4
    assert summary["events"]["stopped"] >= 6           # every actor's last word made it into the file


def test_up_writes_its_summary_as_one_json_object(ended: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    """--summary-json FILE on a run stopped by --steps: the steps, a clean ledger, every evaluation, and `base` and
    `final`, the starting policy (version 0) and the final checkpoint on the same held-out function-writing tasks,
    greedy (no samples), `final` the closing evaluation that final_eval.json holds."""
    base, proc = ended
    assert "summary JSON: summary.json" in proc.stdout
    doc = json.loads((base / "summary.json").read_text())
    assert doc["run"] == "tiny" and doc["steps"] >= FINISHED_STEPS and doc["final_version"] >= FINISHED_STEPS
    book = doc["ledger"]
    assert (book["lost"], book["trained_twice"], book["clean"]) == (0, 0, True) and book["trained"] >= 16, book
    assert [e["policy_version"] for e in doc["evaluations"]] == sorted(e["policy_version"] for e in doc["evaluations"])
    first, last = doc["base"], doc["final"]
    closing = json.loads((base / "D" / "final_eval.json").read_text())
    assert (first["policy_version"], last["policy_version"], last["step"]) == (0, closing["policy_version"],
                                                                           closing["step"])
    assert last["pass_at_1"] == closing["pass_at_1"] and last["n"] == closing["n"] == first["n"] == 4
    for scores in (first, last):
        assert scores["source"] == "builtin" and scores["samples"] == 0 and "mean_at_k" not in scores, scores
        assert scores["ci95"][0] <= scores["pass_at_1"] <= scores["ci95"][1] and "turns_mean" not in scores
        assert sum(level["n"] for level in scores["by_level"].values()) == 4, scores


def test_a_stopped_run_is_opened_read_only_and_its_servers_stopped_again(
        ended: tuple[Path, subprocess.CompletedProcess[str]], processes_mentioning: Callable[[str], list[int]]) -> None:
    """`rlbus record`, `rlbus events` and `rlbus health --once` on the ended run work (they used to answer
    "nothing listens ... is the run up?"), say on stderr that the run is stopped and opened read-only, read
    what the streams hold (the same TrainSteps and rollouts as the recording made while it ran), and leave no
    nats-server behind; --follow on a stopped run is refused with the reason."""
    base, _ = ended
    state = base / "D"
    started = _server_pids(state)
    proc = _rlbus("record", "--state-dir", str(state), "-o", str(base / "after.rlrec"), cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rlbus record: run 'tiny' is stopped: opened read-only from" in proc.stderr
    opened = _server_pids(state)[len(started):]
    assert len(opened) == 1 and not _alive(opened[0])       # it started the stored server, then stopped it
    during, after = _inspect(base / "during.rlrec", base), _inspect(base / "after.rlrec", base)
    assert after["per_kind"]["train_step"] == during["per_kind"]["train_step"] >= 4
    assert after["per_kind"]["rollout"] == during["per_kind"]["rollout"]

    proc = _rlbus("events", "--state-dir", str(state), "--since", "all", "--json", cwd=base)
    assert proc.returncode == 0 and "rlbus events: run 'tiny' is stopped: opened read-only" in proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {e["actor_id"] for e in events if e["event"] == "stopped"} >= {"hub-trainer-0", "hub-generator-0"}

    proc = _rlbus("health", "--state-dir", str(state), "--once", "--json", cwd=base)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    snapshot = json.loads(proc.stdout)
    assert snapshot["actors"] and {a["status"] for a in snapshot["actors"]} == {"stopped"}

    proc = _rlbus("events", "--state-dir", str(state), "--follow", cwd=base)
    assert proc.returncode == 2 and "is stopped" in proc.stderr and "--follow" in proc.stderr
    pids = _server_pids(state)
    assert len(pids) == len(started) + 3 and not any(_alive(pid) for pid in pids)   # record, events, health
    assert processes_mentioning(str(state)) == []


def test_a_second_run_with_the_same_pretraining_settings_reuses_the_base(
        ended: tuple[Path, subprocess.CompletedProcess[str]], processes_mentioning: Callable[[str], list[int]]) -> None:
    """The first run pretrained into the shared cache beside the state directories; a second run (another
    state directory, the same [pretrain] and evaluator seed) copies that base instead of pretraining, and
    says so; --no-pretrained-cache would pretrain afresh."""
    base, first = ended
    assert f"pretraining (tiny, {PRETRAIN_STEPS} steps, 2 threads) into {base / 'pretrained'}/" in first.stdout
    topology = tiny_topology(base / "tiny_second.toml", evaluator=False)   # the same [pretrain], no evaluator
    proc = _rlbus("up", str(topology), "--steps", "2", "--state-dir", str(base / "D2"), cwd=base)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cached = next(p for p in (base / "pretrained").iterdir() if p.is_dir())
    assert (f"rlbus up: reusing pretrained base {cached} (same settings as run 'tiny' in {base / 'D'})"
            in proc.stdout)
    assert "pretraining (" not in proc.stdout and "pretrain step" not in proc.stdout
    for run in ("D", "D2"):
        assert (base / run / "pretrained" / "pretrain.pt").read_bytes() == (cached / "pretrain.pt").read_bytes()
    assert processes_mentioning(str(base / "D2")) == []
