"""`rlbus up` runs the RL job itself on a tiny topology for a few optimizer steps, with the local and the
Ray backend, on the built-in policy and on a Hugging Face one built by a `[policy.recipe]`: exit 0, a summary,
a PNG, a clean ledger, a final evaluation, and no process left behind. The local run is the session's shared
finished run (`finished_run`, tests/helpers/runs.py: the same tiny topology with an evaluator, one step more)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.runs import FinishedRun, tiny_topology

from rlbus.ops.eval import load_policy

pytestmark = pytest.mark.slow

HF_POLICY = '''
[policy]
kind = "hf"
device = "cpu"

  [policy.recipe]
  architecture = "qwen2"
  size = "tiny"
'''
"""A tiny Qwen2-architecture Hugging Face model that `rlbus up` builds and pretrains (`[pretrain] steps`) first."""


def _hf_topology(tmp_path: Path) -> Path:
    """The shared finished run's tiny topology (a shorter pretraining, an evaluator) with the `HF_POLICY` recipe."""
    path = tiny_topology(tmp_path / "tiny_rl.toml", evaluator=True)
    path.write_text(path.read_text() + HF_POLICY)
    return path


PROGRESS = re.compile(r"^v(\d+) +step (\d+) +reward [\d.]+ kl +-?[\d.]+ loss +-?[\d.]+ staleness [\d.]+ dropped \d+ +"
                      r"[\d.]+ rollouts/s +pass@1 (-|[\d.]+@v\d+)$", re.M)
"""One progress line per optimizer step: version, step, reward, KL, loss, staleness, drops, throughput, pass rate."""
RAY_DAEMONS = ("raylet", "gcs_server", "ray::", "dashboard", "log_monitor", "monitor.py")


def _ray_daemons() -> set[int]:
    """PIDs of Ray's own processes on this machine (they do not name the state directory)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "ray" in cmdline and any(name in cmdline for name in RAY_DAEMONS):
                found.add(int(entry.name))
    return found


@pytest.mark.parametrize(("backend", "policy"), [("local", "builtin"), ("ray", "hf")])
def test_rlbus_up_trains_a_few_steps_and_stops_clean(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                     request: pytest.FixtureRequest, backend: str, policy: str,
                                                     processes_mentioning: Callable[[str], list[int]]) -> None:
    """`rlbus up --steps 3` (4 on the local run) pretrains, trains 3+ steps, ends with a summary, a clean ledger
    and a PNG; the built-in policy on the local backend, or on Ray a Hugging Face model the recipe builds (a
    model directory, through transformers; the Ray backend's placement is the same for either policy), and
    the final checkpoint is a policy of that kind with the base's spec (for Hugging Face: its config and
    tokenizer files). The two Hugging Face runs share the pretrained-base cache beside their state directories
    (the second reuses what the first pretrained)."""
    ray_before = _ray_daemons()
    if backend == "local":                        # `rlbus up --steps 4 --backend local`, shared with other tests
        finished: FinishedRun = request.getfixturevalue("finished_run")
        proc, state = finished.proc, finished.state
    else:
        root = tmp_path_factory.getbasetemp() / "up-rl-hf"
        root.mkdir(exist_ok=True)
        state = root / f"state-{backend}"
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        proc = subprocess.run(
            [sys.executable, "-m", "rlbus.ops.cli", "up", str(_hf_topology(tmp_path)), "--state-dir", str(state),
             "--steps", "3", "--backend", backend],
            capture_output=True, text=True, timeout=600, env=env)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "rlbus up: pretrained in" in out or (policy == "hf" and "rlbus up: reusing pretrained base" in out)
    assert "rlbus up: summary" in out and "optimizer steps" in out
    progress = PROGRESS.findall(out)
    assert [int(step) for _, step, _ in progress][:3] == [1, 2, 3], out[-3000:]
    assert "ledger (clean)" in out and "lost 0, trained twice 0" in out
    assert "tasks (clean): fed " in out and out.split("tasks (clean): fed ", 1)[1].split(",", 1)[0] != "0"
    assert "evaluator pass@1: v0" in out          # the evaluator graded the base version in the sandbox
    final = json.loads((state / "final_eval.json").read_text())   # the final checkpoint, scored after the run
    newest = max(int(d.name.removeprefix("step-")) for d in (state / "checkpoints").glob("step-*"))
    assert final["step"] == newest and final["n"] == 4 and final["base"]["source"] == "evaluator v0"
    trained, _ = load_policy(state / "checkpoints" / f"step-{newest}")
    base, _ = load_policy(state / "pretrained")
    assert trained.kind == base.kind == policy and trained.spec() == base.spec()
    assert f"final weights v{final['policy_version']} (checkpoint step {final['step']}" in out
    assert "versus v0 (the pretrained base, same tasks)" in out
    assert (state / "plots" / "progress.png").stat().st_size > 10_000
    assert (state / "pretrained" / ("config.json" if policy == "hf" else "pretrain.pt")).exists()
    assert processes_mentioning(str(state)) == []
    assert _ray_daemons() - ray_before == set()           # Ray's daemons (backend ray) are gone too
