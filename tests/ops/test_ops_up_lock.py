"""`rlbus up` holds its state directory: a second `rlbus up`, or `rlbus clean`, is refused before it touches anything."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlbus.ops.cli import main
from rlbus.ops.up import hold_state_dir


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
