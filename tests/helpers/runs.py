"""Runs for tests: a fresh run id per test (subjects, streams and buckets of tests never collide), and the
finished `rlbus up` run that the tests reading a stopped run share (`finished_tiny_run`, the session fixture of
tests/conftest.py). Those tests only read its state directory; one that would change it copies it first."""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from rlbus.topology.examples import example_path

FINISHED_STEPS: Final = 4
"""Optimizer steps of the shared finished run."""
PRETRAIN_STEPS: Final = 6
"""Pretraining steps of the tiny policy of the shared finished run (tiny.toml has 30; the policy only has to
produce programs to grade)."""
MOVING_TRAINER: Final = """staleness_versions = 2
lr = 0.001
lr_decay_steps = 3
lr_final_ratio = 0.5

[trainer.length_penalty]
budget = 64
coef = 0.5
power = 1.0
"""
"""Trainer settings under which every step moves the bf16 weights and the learning rate falls every step (so a
replay must follow the schedule): the barely pretrained policy never passes a test (every reward 0, so zero
advantages and no update), but its completions differ in length, so shaped rewards differ within a group."""
EVALUATOR: Final = '''
[[regions.actors]]
kind = "evaluator"
'''


def new_run() -> str:
    """A fresh run id (`t` and 8 hex digits)."""
    return f"t{uuid.uuid4().hex[:8]}"


def tiny_topology(path: Path, *, evaluator: bool) -> Path:
    """tiny.toml with `PRETRAIN_STEPS` of pretraining, 4 held-out tasks and `MOVING_TRAINER`, written to `path`;
    `evaluator`: an evaluator in the hub too. With or without it the pretraining settings are the same (one
    cached base)."""
    text = example_path("tiny").read_text()
    if evaluator:
        text = text.replace('kind = "checkpointer"\n', 'kind = "checkpointer"\n' + EVALUATOR, 1)
    text = text.replace("steps = 30", f"steps = {PRETRAIN_STEPS}").replace("eval_n = 8", "eval_n = 4")
    text = text.replace("staleness_versions = 2\n", MOVING_TRAINER, 1)
    assert "coef = 0.5" in text, "tiny.toml's [trainer] no longer sets staleness_versions = 2"
    path.write_text(text)
    return path


@dataclass(frozen=True, slots=True)
class FinishedRun:
    """`rlbus up <tiny with an evaluator> --steps 4 --record during.rlrec --tensorboard tb --backend local
    --summary-json summary.json`, run to its end."""

    base: Path
    """The folder it ran in (its working directory): `D/` (the state), `during.rlrec`, `tb/` (TensorBoard event
    files), `summary.json`, `pretrained/` (the cache of pretrained bases beside the state directories)."""
    topology: Path
    """The topology file it ran (`base/tiny_finished.toml`)."""
    proc: subprocess.CompletedProcess[str]
    """Its exit status and output."""

    @property
    def state(self) -> Path:
        return self.base / "D"

    @property
    def recording(self) -> Path:
        return self.base / "during.rlrec"


def finished_tiny_run(base: Path) -> FinishedRun:
    """Run the shared finished run in `base` (a fresh folder) and return it, whatever its exit status."""
    topology = tiny_topology(base / "tiny_finished.toml", evaluator=True)
    argv = ["up", str(topology), "--steps", str(FINISHED_STEPS), "--state-dir", str(base / "D"),
            "--record", str(base / "during.rlrec"), "--tensorboard", "tb", "--backend", "local",
            "--summary-json", "summary.json"]
    proc = subprocess.run([sys.executable, "-m", "rlbus.ops.cli", *argv], capture_output=True, text=True,
                          timeout=600, cwd=base, check=False)
    return FinishedRun(base=base, topology=topology, proc=proc)
