"""Exactly-once training under SIGKILL: the trainer and the checkpointer run as real supervised processes
(the local backend), a synthetic source feeds rollouts, one of them is killed mid-run; once every rollout is
consumed, the ledger must show nothing lost and nothing trained twice."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from helpers import eventually, new_run
from helpers.rl_bus import (
    HUB,
    connect,
    credentials_file,
    provision,
    publish_rollouts,
    read_kind,
    until_acked,
    wait_for,
)
from helpers.rollouts import sample_rollouts

from rlbus.actors.common.config import CheckpointerLaunch
from rlbus.actors.common.ledger import Ledger, final_lineage, read_ledger
from rlbus.actors.trainer.config import TrainerLaunch
from rlbus.actors.trainer.core import build_core
from rlbus.messages.bus import Bus
from rlbus.messages.schemas import CheckpointMark, TrainStep, VersionReady
from rlbus.topology.backends.local import LocalSupervisor, ProcessSpec, RestartPolicy
from rlbus.topology.network.regions import RegionSet

pytestmark = [pytest.mark.anyio, pytest.mark.chaos]
TRAINER, CHECKPOINTER = "hub-trainer-0", "hub-checkpointer-0"


@pytest.fixture
def run() -> str:
    return new_run()


@pytest.fixture
def hub(tmp_path: Path, run: str) -> Iterator[RegionSet]:
    rs = RegionSet.start(tmp_path / "nats", [HUB], HUB, run=run)
    try:
        yield rs
    finally:
        rs.stop()


def _spec(rs: RegionSet, run: str, kind: str, actor_id: str, settings: dict[str, Any],
          launch: TrainerLaunch | CheckpointerLaunch) -> ProcessSpec:
    args = ("--kind", kind, "--run", run, "--region", HUB, "--id", actor_id, "--url", rs.url(HUB), "--domain", HUB,
            "--role", kind, "--credentials", str(credentials_file(rs)), "--settings", json.dumps(settings),
            "--launch", msgspec.json.encode(launch).decode(), "--heartbeat-s", "0.5", "--drain-s", "15")
    return ProcessSpec(actor_id=actor_id, kind=kind, region=HUB, args=args,
                       env={"RLBUS_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"})


def _supervisor(rs: RegionSet, run: str, tmp_path: Path) -> LocalSupervisor:
    state = str(tmp_path / "state")
    trainer = {"lr": 1e-3, "batch_rollouts": 4, "staleness_versions": 8}
    specs = [_spec(rs, run, "trainer", TRAINER, trainer,
                   TrainerLaunch(checkpoint_interval=2, state_dir=state, resume_wait_s=60.0)),
             _spec(rs, run, "checkpointer", CHECKPOINTER, {"keep": 2}, CheckpointerLaunch(state_dir=state))]
    policy = RestartPolicy(max_restarts=2, window_s=120.0, backoff_initial_s=0.2, backoff_max_s=1.0)
    return LocalSupervisor(specs, policy=policy, log_dir=tmp_path / "logs", drain_timeout_s=20.0)


async def _until_all_consumed(bus: Bus, produced: int, timeout_s: float = 120) -> Ledger:
    """Re-read the ledger until every produced rollout is trained or dropped along the final lineage."""
    return await eventually(lambda: read_ledger(bus),
                            lambda ledger: ledger.produced == produced and not ledger.lost and not ledger.pending,
                            what="every rollout trained or dropped", timeout_s=timeout_s, poll_s=0.5)


def _check_marks(marks: list[CheckpointMark], steps: list[TrainStep]) -> None:
    """Each mark covers exactly the rollouts of the final lineage's steps up to its step."""
    lineage = final_lineage(steps)
    for mark in marks:
        covered = {r for s in lineage if s.step <= mark.step
                   for r in [*s.rollout_ids, *(d.rollout_id for d in s.dropped)]}
        assert set(mark.consumed_rollout_ids) == covered, mark.step


async def test_trainer_sigkill_resumes_from_the_newest_mark_and_trains_each_rollout_once(
        hub: RegionSet, run: str, tmp_path: Path) -> None:
    """SIGKILL the trainer after step 3 (mark 2 durable, step 3 not): the restart resumes from the newest mark,
    redoes the abandoned step from redelivered rollouts, numbers versions on; ledger: 0 lost, 0 trained twice."""
    await provision(hub, run)
    source = build_core("", lr=1e-3, seed=0).model
    first = sample_rollouts(source, tasks=6, group_size=2, seed=1, tag="a")
    second = sample_rollouts(source, tasks=6, group_size=2, seed=2, tag="b")
    sup = _supervisor(hub, run, tmp_path)
    gen = await connect(hub, run, "generator")
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            await publish_rollouts(gen, first)
            await wait_for(gen, TrainStep, lambda found: len(found) >= 3, timeout_s=120)
            victim = sup.pids()[TRAINER]
            os.kill(victim, signal.SIGKILL)
            killed_at = time.time()
            await publish_rollouts(gen, second)
            result = await _until_all_consumed(gen, produced=24)
            steps = await read_kind(gen, TrainStep)
            marks = await read_kind(gen, CheckpointMark)
            versions = await read_kind(gen, VersionReady)
            assert sup.actors[TRAINER].restarts == 1 and sup.pids()[TRAINER] != victim
            tg.cancel_scope.cancel()
        assert result.clean, (result.lost, result.trained_twice)
        assert result.trained == 24 and result.dropped == {}
        resumed = next(s for s in steps if s.created_at > killed_at)
        newest = max(m.step for m in marks if m.created_at < resumed.created_at)
        assert resumed.parent_checkpoint == newest and resumed.step == newest + 1
        assert [v.version for v in versions] == sorted({v.version for v in versions})   # only grow, never reused
        _check_marks(marks, steps)
        assert not sup.pids()
    finally:
        await gen.close()


async def test_checkpointer_sigkill_is_restarted_and_marks_resume(hub: RegionSet, run: str, tmp_path: Path) -> None:
    """SIGKILL the checkpointer after its first mark while the trainer keeps uploading: the restart marks the
    pending uploads in order, every rollout ends up acked, and the ledger is clean."""
    await provision(hub, run)
    source = build_core("", lr=1e-3, seed=0).model
    first = sample_rollouts(source, tasks=6, group_size=2, seed=1, tag="a")
    second = sample_rollouts(source, tasks=6, group_size=2, seed=2, tag="b")
    sup = _supervisor(hub, run, tmp_path)
    gen = await connect(hub, run, "generator")
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            await publish_rollouts(gen, first)
            await wait_for(gen, CheckpointMark, lambda found: len(found) >= 1, timeout_s=120)
            victim = sup.pids()[CHECKPOINTER]
            os.kill(victim, signal.SIGKILL)
            await publish_rollouts(gen, second)
            result = await _until_all_consumed(gen, produced=24)
            marks = await wait_for(gen, CheckpointMark, lambda found: bool(found) and found[-1].step == 6,
                                   timeout_s=60)
            await until_acked(gen, 0)                # mark 6 covers all 24: every rollout acked
            steps = await read_kind(gen, TrainStep)
            assert sup.actors[CHECKPOINTER].restarts == 1 and sup.actors[TRAINER].restarts == 0
            tg.cancel_scope.cancel()
        assert result.clean and result.trained == 24
        assert [m.step for m in marks] == [2, 4, 6]
        assert [s.step for s in steps] == [1, 2, 3, 4, 5, 6]
        _check_marks(marks, steps)
        assert sorted(p.name for p in (tmp_path / "state" / "checkpoints").iterdir()) == ["step-4", "step-6"]
        assert not sup.pids()
    finally:
        await gen.close()
