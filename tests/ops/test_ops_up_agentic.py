"""`rlbus up agentic`, shortened: the shipped example with its recipe cut to two pretraining steps (no phases, no
demonstrations), groups of two one-turn episodes, one held-out task and one optimizer step runs to its end with
clean ledgers; the generator ran every group it published as an agentic group of built-in repository tasks; the
evaluations print and `--summary-json` holds the agentic scores of the starting policy and the final checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.topology.examples import example_path

pytestmark = pytest.mark.slow

SHORTER = {"group_size = 4": "group_size = 2", "max_turns = 8": "max_turns = 1", "samples = 4": "samples = 2",
           "max_tokens = 128": "max_tokens = 24", "batch_rollouts = 8": "batch_rollouts = 2",
           "concurrent_tasks = 2": "concurrent_tasks = 1", "backlog_per_region = 8": "backlog_per_region = 2",
           "n_tasks = 8": "n_tasks = 1"}
"""Lines of topology/examples/agentic.toml and what the short run puts instead (each occurs once)."""
PRETRAIN = "[pretrain]\nsteps = 2\neval_n = 1\nmax_seq_len = 2048\n\n"
"""What the short run puts in place of the example's [pretrain] tables (phases and demonstrations)."""


def test_up_agentic_runs_repository_tasks_to_a_clean_end(tmp_path: Path) -> None:
    """One optimizer step on rollouts of repository tasks; both ledgers clean; the topology otherwise as shipped.
    The closing summary prints the final checkpoint's agentic scores (pass@1, mean@2 and pass@2, what an episode
    costs) and draws accuracy against cost and the pass@1 and pass@k curves; the summary JSON holds the steps, the
    ledger, and `base` and `final` with the same keys and the same two samples per task, one of each on a built-in
    repository task."""
    text = example_path("agentic").read_text()
    for line, shorter in SHORTER.items():
        assert text.count(f"\n{line}\n") == 1, line
        text = text.replace(f"\n{line}\n", f"\n{shorter}\n")
    head, rest = text.split("\n[pretrain]\n")
    text = f"{head}\n{PRETRAIN}[launch]\n{rest.split('[launch]', 1)[1]}"
    topology = tmp_path / "agentic.toml"
    topology.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "up", str(topology), "--steps", "1",
                           "--state-dir", str(tmp_path / "D"), "--summary-json", "summary.json"],
                          capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rlbus up: reached the requested number of steps" in proc.stdout
    assert "ledger (clean)" in proc.stdout and "tasks (clean)" in proc.stdout, proc.stdout[-2000:]
    published = [json.loads(line) for line in (tmp_path / "D" / "logs" / "hub-generator-0.log").read_text().splitlines()
                 if '"group_published"' in line]
    assert published and all(p["kind"] == "agentic" and p["task_id"].startswith("repo-L") for p in published)
    assert all(p["rollouts"] == 2 and p["turns"] == 1 for p in published)
    assert "final weights v1: pass@1 " in proc.stdout and "; mean@2 " in proc.stdout, proc.stdout[-2000:]
    assert " policy tokens" in proc.stdout.split("rlbus up: summary")[1], proc.stdout[-2000:]
    png = tmp_path / "D" / "plots" / "accuracy_cost.png"
    assert f"accuracy against cost: {png}" in proc.stdout and png.read_bytes()[:4] == b"\x89PNG"
    curves = png.with_name("pass_at_k.png")
    assert f"pass@1 and pass@k per version: {curves}" in proc.stdout and curves.read_bytes()[:4] == b"\x89PNG"
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["steps"] == 1 and doc["final_version"] == 1, doc
    book = doc["ledger"]
    assert book["lost"] == 0 and book["trained_twice"] == 0 and book["trained"] == 2 <= book["produced"], book
    base, final = doc["base"], doc["final"]
    assert (base["policy_version"], final["policy_version"], final["step"]) == (0, 1, 1), doc
    for scores in (base, final):
        assert scores["source"] == "repo:1:heldout" and scores["n"] == 1 and scores["samples"] == 2, scores
        assert set(scores["pass_at_k"]) == set(scores["pass_at_k_ci95"]) == {"1", "2"}, scores
        assert 0 <= scores["mean_at_k"] <= 1 and scores["ci95"][0] <= scores["pass_at_1"] <= scores["ci95"][1]
        assert scores["turns_mean"] == 1 and 1 <= scores["policy_tokens_mean"] <= 24, scores
        assert set(scores["by_level"]) == {"repo/1"} and "tool_calls_mean" in scores and "wall_s_mean" in scores
