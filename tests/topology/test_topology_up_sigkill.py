"""SIGKILL inside the real RL job: `rlbus up` on the tiny topology (feeder, generator, sandbox, trainer, publisher,
checkpointer as supervised processes) while one part is killed mid-run — the publisher process, or one of the
sandbox supervisor's pre-forked executors while the generator's programs are being graded. The run must go on
to its last step and end with exit 0 and a clean ledger: 0 lost, 0 trained twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import eventually_sync
from helpers.procs import cmdline, kind_pids

from rlbus.actors.sandbox.pool import STANDBY_NAME
from rlbus.ops.up import stop_leftovers
from rlbus.topology.examples import example_path

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

STEPS = 5
KILL_AT_STEP = 2


def _topology(tmp_path: Path) -> Path:
    """tiny.toml with a shorter pretraining (the policy only has to produce programs to grade)."""
    text = example_path("tiny").read_text().replace("steps = 30", "steps = 6").replace("eval_n = 8", "eval_n = 4")
    path = tmp_path / "tiny_kill.toml"
    path.write_text(text)
    return path


def _parent(pid: int) -> int:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def _live_pids(state: Path, kind: str, processes_mentioning: Callable[[str], list[int]]) -> set[int]:
    """The actor processes of `kind` of the run in `state`."""
    return kind_pids(state, kind, processes_mentioning)


def _actor_pid(state: Path, kind: str, processes_mentioning: Callable[[str], list[int]]) -> int:
    """The one live actor process of `kind` of the run in `state`."""
    pids = _live_pids(state, kind, processes_mentioning)
    assert len(pids) == 1, (kind, pids)
    return pids.pop()


def _eventually(predicate: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Poll `predicate` until it holds (True) or the hang guard runs out (False)."""
    try:
        return eventually_sync(predicate, timeout_s=timeout_s, poll_s=0.2)
    except AssertionError:
        return False


def _executors(sandbox_pid: int) -> list[int]:
    """The executors of a sandbox supervisor: its child processes running the executor's source (whatever
    jail wraps it: bwrap, setpriv + unshare, or the interpreter itself)."""
    return sorted(int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _parent(int(e.name)) == sandbox_pid
                  and STANDBY_NAME in cmdline(int(e.name)))


@pytest.mark.parametrize("victim", ["publisher", "sandbox-executor"])
def test_rlbus_up_sigkill_mid_run_loses_nothing(tmp_path: Path, victim: str,
                                                 processes_mentioning: Callable[[str], list[int]]) -> None:
    """SIGKILL the victim once the trainer has made 2 steps: the job still reaches step 5, exits 0, and the ledger
    is clean; a killed publisher is restarted by the supervisor (a new pid), a killed executor is replaced
    by its supervisor, which itself lives on (same pid)."""
    state = tmp_path / "state"
    cmd = [sys.executable, "-m", "rlbus.ops.cli", "up", str(_topology(tmp_path)), "--state-dir", str(state),
           "--steps", str(STEPS)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(f"v{KILL_AT_STEP} "):
                break
        else:
            raise AssertionError("the run ended before step 2:\n" + "".join(lines)[-3000:])
        sandbox = _actor_pid(state, "sandbox", processes_mentioning)
        if victim == "publisher":
            target = _actor_pid(state, "publisher", processes_mentioning)
        else:
            executors = _executors(sandbox)
            assert executors, "no executor process found under the sandbox supervisor"
            target = executors[0]
        os.kill(target, signal.SIGKILL)
        recovered = False
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(f"v{KILL_AT_STEP + 2} "):
                if victim == "publisher":                                      # restarted: a new process
                    recovered = _eventually(lambda: _live_pids(state, "publisher", processes_mentioning) - {target} != set())
                else:                                                          # the supervisor lived, replaced it
                    assert _actor_pid(state, "sandbox", processes_mentioning) == sandbox
                    recovered = _eventually(lambda: bool(_executors(sandbox)) and target not in _executors(sandbox))
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:                      # a failed assertion: drain it (SIGINT) before killing it
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        stop_leftovers(state)                        # what a killed `rlbus up` could not stop, by pid
    out = "".join(lines)
    assert code == 0, out[-4000:]
    assert recovered, out[-3000:]
    steps = int(out.split("optimizer steps ", 1)[1].split(",", 1)[0])
    assert steps >= STEPS
    assert "ledger (clean)" in out and "lost 0, trained twice 0" in out
    assert "tasks (clean): fed " in out and out.split("tasks (clean): fed ", 1)[1].split(",", 1)[0] != "0", out[-3000:]
    assert processes_mentioning(str(state)) == []
