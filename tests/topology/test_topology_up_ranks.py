"""A trainer of two ranks inside the real RL job: `rlbus up` on the `ranks` example (world_size = 2, FSDP2 over
gloo) with rank 1 SIGKILLed mid-run. The launcher tears the group down (the trainer too) and restarts both on a fresh
rendezvous; the run reaches its last step, exits 0, and the ledger shows 0 lost and 0 trained twice. `rlbus eval`'s
loader reads the sharded checkpoint, and a one-rank trainer core loads it with the trainer's own loader (2 -> 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from helpers.procs import kind_pids

from rlbus.actors.common.checkpoints import MARK_FILE, checkpoint_dir, durable_steps, read_durable_state
from rlbus.actors.trainer.actor import load_into
from rlbus.actors.trainer.core import build_core
from rlbus.messages.schemas import CheckpointMark
from rlbus.ops.eval import load_policy
from rlbus.ops.up import stop_leftovers
from rlbus.topology.examples import example_path

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

STEPS = 4
KILL_AT_STEP = 2


def _topology(tmp_path: Path, world_size: int) -> Path:
    """ranks.toml with a shorter pretraining (the policy only has to produce programs to grade)."""
    text = example_path("ranks").read_text().replace("steps = 30", "steps = 6").replace("eval_n = 8", "eval_n = 4")
    text = text.replace("world_size = 2", f"world_size = {world_size}")
    path = tmp_path / f"ranks{world_size}.toml"
    path.write_text(text)
    return path


def _run(cmd: list[str], on_line: Callable[[str], None] | None = None) -> tuple[int, str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line)
        return proc.wait(timeout=300), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _clean(out: str, steps: int) -> None:
    done = int(out.split("optimizer steps ", 1)[1].split(",", 1)[0])
    assert done >= steps, out[-3000:]
    assert "ledger (clean)" in out and "lost 0, trained twice 0" in out, out[-3000:]


def test_a_two_rank_trainer_survives_a_sigkill_of_rank_1_and_its_checkpoint_loads_at_one_rank(
        tmp_path: Path, processes_mentioning: Callable[[str], list[int]]) -> None:
    """SIGKILL rank 1 after step 2: both ranks restart (new pids), the run reaches step 4 with a clean ledger and
    leaves no process; a one-rank trainer core then loads the two-rank checkpoint."""
    state = tmp_path / "state"
    killed: list[int] = []

    def on_line(line: str) -> None:
        if line.startswith(f"v{KILL_AT_STEP} ") and not killed:
            ranks = kind_pids(state, "trainer_rank", processes_mentioning)
            assert len(ranks) == 1 and len(kind_pids(state, "trainer", processes_mentioning)) == 1, ranks
            killed.append(ranks.pop())
            os.kill(killed[0], signal.SIGKILL)

    cli = [sys.executable, "-m", "rlbus.ops.cli", "up"]
    try:
        code, out = _run([*cli, str(_topology(tmp_path, 2)), "--state-dir", str(state), "--steps", str(STEPS)],
                         on_line)
        assert code == 0, out[-4000:]
        assert killed, "the run ended before step 2:\n" + out[-3000:]
        _clean(out, STEPS)
        # the group went down and up together: the trainer taken down with rank 1, both restarted
        listed = subprocess.run([*cli[:-1], "events", "--state-dir", str(state), "--since", "all", "--json",
                                 "--kind", "crashed,restarted"], capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0, listed.stderr[-2000:]
        events = [json.loads(line) for line in listed.stdout.splitlines() if line.startswith("{")]
        seen = {(e["event"], e["actor_id"]) for e in events}
        assert {("crashed", "hub-trainer-0-rank1"), ("restarted", "hub-trainer-0-rank1"),
                ("crashed", "hub-trainer-0"), ("restarted", "hub-trainer-0")} <= seen, events
        assert processes_mentioning(str(state)) == []
        # `rlbus eval` and `rlbus export` read the newest durable checkpoint: a sharded one
        policy, label = load_policy(state)
        newest = max(durable_steps(state))
        assert f"checkpoint step {newest}" in label and policy.vocab_size > 0
        mark = json.loads((checkpoint_dir(state, newest) / MARK_FILE).read_text())
        assert len(mark["objects"]) > 2 and all(o.startswith("state-shard-") for o in mark["objects"]), mark
        # a one-rank trainer resumes from it (2 -> 1): the trainer's own loader, on the pretrained base
        files = read_durable_state(checkpoint_dir(state, newest), msgspec.json.decode(
            (checkpoint_dir(state, newest) / MARK_FILE).read_bytes(), type=CheckpointMark))
        core = build_core(str(state / "pretrained"), lr=1e-5, seed=0)
        meta = load_into(core, files)
        assert meta["step"] == newest and len(meta["consumed"]) > 0
        assert core.optimizer.state, "the AdamW state came back too"
    finally:
        stop_leftovers(state)
    assert processes_mentioning(str(state)) == []
