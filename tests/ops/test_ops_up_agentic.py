"""`rlbus up agentic`, shortened: the shipped example with the fewest pretraining steps, groups of two one-turn
episodes and one optimizer step runs to its end with clean ledgers; the generator ran every group it published
as an agentic group of built-in repository tasks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.topology.examples import example_path

pytestmark = pytest.mark.slow

SHORTER = {"steps = 100": "steps = 2", "eval_n = 20": "eval_n = 1", "group_size = 4": "group_size = 2",
           "max_turns = 4": "max_turns = 1", "max_tokens = 128": "max_tokens = 24", "batch_rollouts = 8":
           "batch_rollouts = 2", "concurrent_tasks = 2": "concurrent_tasks = 1", "backlog_per_region = 8":
           "backlog_per_region = 2"}
"""Lines of topology/examples/agentic.toml and what the short run puts instead (each occurs once)."""


def test_up_agentic_runs_repository_tasks_to_a_clean_end(tmp_path: Path) -> None:
    """One optimizer step on rollouts of repository tasks; both ledgers clean; the topology otherwise as shipped."""
    text = example_path("agentic").read_text()
    for line, shorter in SHORTER.items():
        assert text.count(f"\n{line}\n") == 1, line
        text = text.replace(f"\n{line}\n", f"\n{shorter}\n")
    topology = tmp_path / "agentic.toml"
    topology.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "rlbus.ops.cli", "up", str(topology), "--steps", "1",
                           "--state-dir", str(tmp_path / "D")], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rlbus up: reached the requested number of steps" in proc.stdout
    assert "ledger (clean)" in proc.stdout and "tasks (clean)" in proc.stdout, proc.stdout[-2000:]
    published = [json.loads(line) for line in (tmp_path / "D" / "logs" / "hub-generator-0.log").read_text().splitlines()
                 if '"group_published"' in line]
    assert published and all(p["kind"] == "agentic" and p["task_id"].startswith("repo-L") for p in published)
    assert all(p["rollouts"] == 2 and p["turns"] == 1 for p in published)
