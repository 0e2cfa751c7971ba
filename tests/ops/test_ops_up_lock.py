"""`rlbus up` holds its state directory: a second `rlbus up`, or `rlbus clean`, is refused before it touches anything;
the servers and actors a SIGKILLed `rlbus up` left running on it are stopped before the next one starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import eventually_sync

from rlbus.ops.cli import main
from rlbus.ops.up import hold_state_dir, leftover_processes
from rlbus.topology.network.servers import find_nats_server


def test_a_second_up_on_a_state_dir_in_use_is_refused_and_deletes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs on one state directory would put two servers on one JetStream store (a stream of the
    second lost its first message that way): the second is refused at once, naming the holder's pid,
    and even with --fresh it deletes nothing. Once the holder lets go, the directory is free again."""
    state = tmp_path / "state"
    held = hold_state_dir(state)
    try:
        (state / "streams").mkdir()
        assert main(["up", "tiny", "--state-dir", str(state), "--fresh", "--for", "1"]) == 2
        err = capsys.readouterr().err
        assert f"state directory {state.resolve()} is in use by another `rlbus up` (pid {os.getpid()})" in err
        assert "--state-dir" in err
        assert sorted(p.name for p in state.iterdir()) == ["streams", "up.lock"]
        (state / "nats").mkdir()
        assert main(["clean", "r", "--state-dir", str(state)]) == 2       # nor may `rlbus clean` delete it
        assert f"(pid {os.getpid()})" in capsys.readouterr().err and (state / "nats").is_dir()
    finally:
        held.close()
    assert main(["clean", "r", "--state-dir", str(state)]) == 0         # released: free again
    assert not state.exists()


def test_processes_a_killed_up_left_on_its_state_dir_are_stopped_before_the_next_one_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A SIGKILLed `rlbus up` cannot stop its nats-server, which would then share the JetStream store with the
    next run's. Taking the lock stops such a server (a real one, serving that store) and names it; a process
    that merely names the directory (here a sleeping Python, like an editor or a `tail -f`) is left alone."""
    state = tmp_path / "state"
    store = state / "nats" / "hub" / "store"
    store.mkdir(parents=True)
    server = subprocess.Popen([str(find_nats_server()), "-a", "127.0.0.1", "-p", "-1", "-js", "-sd", str(store)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(state / "logs")])
    try:
        # a child just past `exec` can show an empty command line for a moment (the kernel sets the new image's
        # arguments after the parent is woken)
        eventually_sync(lambda: leftover_processes(state), lambda found: found == [server.pid],
                        what="the server listed as a leftover", timeout_s=10, poll_s=0.05)
        held = hold_state_dir(state)
        held.close()
        assert server.wait(timeout=30) is not None                     # it was stopped (SIGTERM: a clean exit)
        assert bystander.poll() is None                                # not an rlbus process: untouched
        err = capsys.readouterr().err
        assert f"stopped 1 process(es) that a killed `rlbus up` on {state} had left running (pids {server.pid})" in err
        assert leftover_processes(state) == []
    finally:
        for proc in (server, bystander):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

