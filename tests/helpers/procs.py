"""Reading a run's actor processes from /proc: a process's command line, and the live actor processes of one
kind of a run (found through the `processes_mentioning` fixture, by the `--kind` argument of `rlbus.ops.actor`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def cmdline(pid: int) -> str:
    """The command line of `pid`, arguments joined by spaces; empty once it is gone."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kind_pids(state: Path, kind: str, processes_mentioning: Callable[[str], list[int]]) -> set[int]:
    """The live actor processes of `kind` of the run in `state`."""
    return {p for p in processes_mentioning(str(state)) if f"--kind {kind} " in cmdline(p) + " "}
