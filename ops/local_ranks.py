"""N trainer ranks as processes on loopback, for `rlbus bench trainer` and the trainer-rank tests.

- Owns: `LocalGroup` (start `world_size` rank processes each running a "module:function" target with its
  `RankSpec` in the environment; wait, kill and close them by PID), `rank_main` (a rank process's entry),
  `free_port`.
- Does not: build, shard or step a trainer (actors/trainer/ranks.py), or talk to the bus.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from rlbus.actors.trainer.ranks import RankSpec


def free_port() -> int:
    """A TCP port free on loopback just now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class RankResult:
    """How one rank process of a `LocalGroup` ended."""

    rank: int
    returncode: int | None
    """None: still running when `wait` gave up."""
    result: Any
    """The target's return value (its JSON), None when it returned none or failed."""
    error: str
    """The last lines of its stderr."""


_ENTRY: Final = "from rlbus.ops.local_ranks import rank_main; rank_main()"


class LocalGroup:
    """`world_size` rank processes on loopback, each running `target` ("module:function", called as
    fn(spec, job) in the rank's process, its return value JSON) with its `RankSpec` in the environment. Stopped
    by PID (SIGKILL) on `close`. Used by tests and `rlbus bench trainer`."""

    def __init__(self, world_size: int, target: str, job: Mapping[str, Any], *, timeout_s: float = 60.0,
                 threads: int = 1, env: Mapping[str, str] | None = None) -> None:
        self.world_size = world_size
        self.target = target
        self.job = dict(job)
        self.timeout_s = timeout_s
        self.threads = threads
        self.env = dict(env or {})
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="rlbus-ranks-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ranks: list[int] = []
        """The rank of each process, in start order."""

    def __enter__(self) -> LocalGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spec(self, rank: int) -> RankSpec:
        return RankSpec(rank=rank, world_size=self.world_size, addr="127.0.0.1", port=self.port,
                        timeout_s=self.timeout_s)

    def start(self, ranks: Sequence[int] | None = None) -> None:
        """Start the rank processes (`ranks`: only these, to leave others out)."""
        root = Path(self._dir.name)
        for rank in range(self.world_size) if ranks is None else ranks:
            env = {**os.environ, **self.env, **self.spec(rank).env(), "RLBUS_TORCH_THREADS": str(self.threads),
                   "OMP_NUM_THREADS": str(self.threads)}
            with (root / f"job-{rank}.json").open("w") as job:
                json.dump({"target": self.target, "job": self.job}, job)
            with (root / f"job-{rank}.json").open("rb") as stdin, (root / f"out-{rank}").open("wb") as out, \
                    (root / f"err-{rank}").open("wb") as err:
                self.procs.append(subprocess.Popen([sys.executable, "-c", _ENTRY], stdin=stdin, stdout=out,
                                                   stderr=err, env=env))
            self.ranks.append(rank)

    def kill(self, rank: int) -> None:
        """SIGKILL one rank's process (by its PID)."""
        proc = self.procs[self.ranks.index(rank)]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)

    def wait(self, timeout_s: float, ranks: Sequence[int] | None = None) -> list[RankResult]:
        """Wait up to `timeout_s` for every process to end (or those of `ranks`); -> each rank's result, in start
        order (returncode None: still running)."""
        deadline = time.monotonic() + timeout_s
        for rank, proc in zip(self.ranks, self.procs, strict=True):
            if ranks is not None and rank not in ranks:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return [self._result(rank, proc) for rank, proc in zip(self.ranks, self.procs, strict=True)]

    def _result(self, rank: int, proc: subprocess.Popen[bytes]) -> RankResult:
        root = Path(self._dir.name)
        out = (root / f"out-{rank}").read_text(errors="replace").strip().splitlines()
        err = (root / f"err-{rank}").read_text(errors="replace").strip().splitlines()
        result = None
        if proc.returncode == 0 and out:
            with contextlib.suppress(ValueError):
                result = json.loads(out[-1])
        return RankResult(rank=rank, returncode=proc.returncode, result=result, error="\n".join(err[-30:]))

    def close(self) -> None:
        """SIGKILL every rank still running (by PID), reap them, remove the scratch folder."""
        for rank in self.ranks:
            self.kill(rank)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._dir.cleanup()


def rank_main() -> None:
    """A `LocalGroup` process: read {"target", "job"} from stdin, call target(spec, job) with the `RankSpec` of
    the environment, print its return value as the last line of stdout (JSON), and exit 0 at once."""
    import importlib

    request = json.loads(sys.stdin.read())
    spec = RankSpec.from_env()
    if spec is None:
        spec = RankSpec(rank=0, world_size=1, addr="127.0.0.1", port=0)
    torch.set_num_threads(int(os.environ.get("RLBUS_TORCH_THREADS", "1")))
    module, _, name = request["target"].partition(":")
    fn = getattr(importlib.import_module(module), name)
    result = fn(spec, request["job"])
    sys.stdout.flush()
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)         # no interpreter teardown: a broken group's destructors can abort after the result is out
