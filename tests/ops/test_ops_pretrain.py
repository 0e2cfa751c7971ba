"""Pretraining progress as a person or a log file sees it: `rlbus pretrain` in a subprocess whose stdout is a
pipe (no TTY) prints a step line at the first step, every PROGRESS_EVERY steps and the last, and no line
twice; on a terminal the step line is rewritten in place. `rlbus up` prints through the same printer."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

from rlbus.model.training.pretrain import PretrainProgress
from rlbus.ops.pretrain import PROGRESS_EVERY, PretrainPrinter

STEP = re.compile(r"^step +(\d+)/(\d+)  loss [\d.]+", re.MULTILINE)


def test_off_a_tty_pretraining_prints_a_line_every_few_steps_and_none_twice(tmp_path: Path) -> None:
    """25 steps of the tiny preset with checkpoints every 10 steps, stdout a pipe: step lines 1, 10, 20, 25,
    the intermediate checkpoints each named once with their step, the final one once, nothing repeated."""
    script = ("import sys, dataclasses\n"
              "from rlbus.model.training import pretrain as m\n"
              "original = m.PretrainConfig.preset\n"
              "m.PretrainConfig.preset = classmethod(lambda cls, name, **kw: dataclasses.replace("
              "original(name, **kw), checkpoint_every=10))\n"
              "from rlbus.ops.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", script, "pretrain", "--config", "tiny", "--steps", "25",
                           "--eval-n", "2", "--threads", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line and not line.startswith("{")]
    assert [int(step) for step, _ in STEP.findall(proc.stdout)] == [1, 10, 20, 25]
    assert len(lines) == len(set(lines)), proc.stdout
    checkpoints = [line for line in lines if line.startswith("checkpoint at step")]
    assert checkpoints == [f"checkpoint at step 10/25: {tmp_path / 'pretrain.pt'}",
                           f"checkpoint at step 20/25: {tmp_path / 'pretrain.pt'}",
                           f"checkpoint at step 25/25 (final): {tmp_path / 'pretrain.pt'}"]
    assert "\r" not in proc.stdout


def test_on_a_tty_the_step_line_is_rewritten_in_place() -> None:
    """Every step rewrites one line (carriage return); the line is ended before the next message."""
    out = io.StringIO()
    printer = PretrainPrinter(out, prefix="  pretrain ", tty=True)
    steps = PROGRESS_EVERY + 3
    for step in range(1, steps + 1):
        printer(PretrainProgress("train", step, steps, float(step), 2.0, 1e-3, 100.0))
        if step == 2:
            printer(PretrainProgress("checkpoint", 2, steps, 2.0, note="ck.pt"))
    printer(PretrainProgress("eval", steps, steps, 9.0, note="greedy pass@1 on 2 held-out tasks"))
    text = out.getvalue()
    assert text.count("\r") == steps and text.count("\r  pretrain step") == steps
    assert re.search(r"\r  pretrain step +2/13  loss 2\.0000 [^\r\n]*\n  pretrain checkpoint at step 2/13: ck\.pt\n"
                     r"\r  pretrain step +3/13 ", text)
    assert re.search(r"\r  pretrain step +13/13  loss 2\.0000 [^\r\n]* 13\.0s\n"
                     r"  pretrain eval: greedy pass@1 on 2 held-out tasks  \(9\.0s\)\n$", text)
