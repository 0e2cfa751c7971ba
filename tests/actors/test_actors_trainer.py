"""Trainer and checkpointer on a real embedded bus, in process, fed by a synthetic rollout source: steps and
versions, rollouts acked only once a mark covers them, staleness drops with reasons, rejected uploads."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from helpers import Hosted, hosted, new_run
from helpers.rl_bus import HUB, ack_pending, connect, provision, publish_rollouts, until_acked, wait_for
from helpers.rollouts import sample_rollouts

from rlbus.actors.base import ActorId, ActorLimits, State
from rlbus.actors.checkpointer import Checkpointer, checkpoint_dir, durable_steps
from rlbus.actors.common.config import CheckpointerConfig, CheckpointerLaunch
from rlbus.actors.common.ledger import read_all, read_ledger
from rlbus.actors.trainer.actor import Trainer
from rlbus.actors.trainer.config import TrainerConfig, TrainerLaunch
from rlbus.actors.trainer.core import build_core
from rlbus.kernels.delta.state import apply_state_
from rlbus.messages.bus import Bus, digest
from rlbus.messages.schemas import CheckpointMark, Event, StateUploaded, TensorBlob, TrainStep, VersionReady
from rlbus.topology.network.regions import RegionSet

pytestmark = pytest.mark.anyio
LIMITS = ActorLimits(heartbeat_interval_s=0.5, drain_timeout_s=20.0)


@pytest.fixture
def run() -> str:
    return new_run()


@pytest.fixture
def hub(tmp_path: Path, run: str) -> Iterator[RegionSet]:
    """One embedded hub server granting the run's buckets."""
    rs = RegionSet.start(tmp_path / "nats", [HUB], HUB, run=run)
    try:
        yield rs
    finally:
        rs.stop()


async def trainer_on(rs: RegionSet, run: str, config: TrainerConfig,
                     launch: TrainerLaunch | None = None) -> tuple[Trainer, Bus]:
    bus = await connect(rs, run, "trainer", "hub-trainer-0")
    return Trainer(ActorId(run, HUB, "trainer", "hub-trainer-0"), bus, config, LIMITS, launch), bus


async def checkpointer_on(rs: RegionSet, run: str, launch: CheckpointerLaunch,
                          config: CheckpointerConfig | None = None) -> tuple[Checkpointer, Bus]:
    bus = await connect(rs, run, "checkpointer", "hub-checkpointer-0")
    return Checkpointer(ActorId(run, HUB, "checkpointer", "hub-checkpointer-0"), bus, config, LIMITS, launch), bus


async def test_trainer_steps_publishes_versions_and_acks_only_once_a_mark_covers(hub: RegionSet, run: str,
                                                                                 tmp_path: Path) -> None:
    """3 batches → steps 1-3, versions 0-3 whose blobs are the bf16 master; nothing is acked before the
    checkpointer marks step 2 (8 acked, 4 held), and the drain's checkpoint of step 3 acks the rest."""
    await provision(hub, run)
    config = TrainerConfig(lr=1e-3, batch_rollouts=4, staleness_versions=8)
    trainer, tbus = await trainer_on(hub, run, config, TrainerLaunch(checkpoint_interval=2, mark_wait_s=10))
    ckpt, cbus = await checkpointer_on(hub, run, CheckpointerLaunch(state_dir=str(tmp_path / "state"), drain_linger_s=0.2),
                                       CheckpointerConfig(keep=2))
    gen = await connect(hub, run, "generator")
    source = build_core("", lr=1e-3, seed=0).model
    rollouts = sample_rollouts(source, tasks=6, group_size=2, seed=1)
    try:
        async with anyio.create_task_group() as tg:
            hosted = await Hosted(tg, trainer).start()
            await publish_rollouts(gen, rollouts)
            steps = await wait_for(gen, TrainStep, lambda found: len(found) >= 3)
            uploads = await read_all(gen.js, gen.subjects.state_stream(), gen.subjects.state_uploads(), StateUploaded)
            assert [u.step for u in uploads] == [2] and len(uploads[0].consumed_rollout_ids) == 8
            assert await ack_pending(gen) == 12                    # no mark yet: nothing acked
            checkpointer = await Hosted(tg, ckpt).start()
            marks = await wait_for(gen, CheckpointMark, lambda found: len(found) >= 1)
            assert marks[0].step == 2 and list(marks[0].consumed_rollout_ids) == uploads[0].consumed_rollout_ids
            await until_acked(gen, 4)                             # steps 1-2 acked, step 3 held
            versions = await wait_for(gen, VersionReady, lambda found: len(found) >= 4)
            blob = await gen.get_object(gen.subjects.checkpoint_bucket(), versions[-1].object,
                                        expected_digest=versions[-1].digest)
            assert trainer.core is not None
            master = {k: v.detach().clone() for k, v in trainer.core.model.state_dict().items()}
            target = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in master.items()}
            apply_state_(target, blob)
            for name, value in master.items():
                assert torch.equal(target[name].view(torch.int16), value.to(torch.bfloat16).view(torch.int16))
            assert await hosted.stop() is State.STOPPED           # drain: checkpoint step 3, wait for its mark
            assert [m.step for m in await wait_for(gen, CheckpointMark, lambda found: len(found) >= 2)] == [2, 3]
            await until_acked(gen, 0)
            await checkpointer.stop()
        assert [s.step for s in steps] == [1, 2, 3] and [s.policy_version for s in steps] == [1, 2, 3]
        assert all(math.isfinite(s.loss) and len(s.rollout_ids) == 4 and s.staleness for s in steps)
        assert sorted(r for s in steps for r in s.rollout_ids) == sorted(r.rollout_id for r in rollouts)
        assert [v.version for v in versions] == [0, 1, 2, 3] and versions[0].model_config["d_model"] == 64
        assert durable_steps(tmp_path / "state") == [2, 3]
        assert (checkpoint_dir(tmp_path / "state", 3) / "mark.json").exists()
        result = await read_ledger(gen)
        assert result.clean and result.produced == 12 and result.trained == 12
    finally:
        for bus in (tbus, cbus, gen):
            await bus.close()


async def test_stale_and_unusable_groups_are_dropped_with_reasons(hub: RegionSet, run: str) -> None:
    """Bound 0: a group sampled at version 0 arriving after step 1 is 1 version behind and dropped, a group with
    a token outside the vocabulary is invalid; both are recorded in step 2, which trains the fresh groups."""
    await provision(hub, run)
    config = TrainerConfig(lr=1e-3, batch_rollouts=4, staleness_versions=0)
    trainer, tbus = await trainer_on(hub, run, config, TrainerLaunch(checkpoint_interval=100, mark_wait_s=0.5))
    gen = await connect(hub, run, "generator")
    source = build_core("", lr=1e-3, seed=0).model
    try:
        async with hosted(trainer):
            await publish_rollouts(gen, sample_rollouts(source, tasks=2, group_size=2, seed=1, tag="a"))
            await wait_for(gen, TrainStep, lambda found: len(found) >= 1)
            stale = sample_rollouts(source, tasks=1, group_size=2, seed=2, tag="old", versions=0)
            bad = sample_rollouts(source, tasks=1, group_size=2, seed=3, tag="bad", versions=1)
            bad[1] = msgspec.structs.replace(bad[1], completion_tokens=TensorBlob.of(
                [999] * len(bad[1].completion_tokens), "int32"))
            fresh = sample_rollouts(source, tasks=2, group_size=2, seed=4, tag="new", versions=1)
            await publish_rollouts(gen, stale + bad + fresh)
            steps = await wait_for(gen, TrainStep, lambda found: len(found) >= 2)
        step2 = steps[1]
        assert sorted(step2.rollout_ids) == sorted(r.rollout_id for r in fresh)
        reasons = {d.rollout_id: d.reason for d in step2.dropped}
        assert reasons == {"old-2-0-0": "stale: 1 versions behind (bound 0)",
                           "old-2-0-1": "stale: 1 versions behind (bound 0)",
                           "bad-3-0-0": "invalid: token id outside the vocabulary of 264",
                           "bad-3-0-1": "invalid: token id outside the vocabulary of 264"}
        assert step2.staleness == {"0": 4} and trainer.counters["dropped"] == 4
        result = await read_ledger(gen)
        assert result.clean and result.dropped == {"stale": 2, "invalid": 2} and result.trained == 8
    finally:
        await tbus.close()
        await gen.close()


async def test_checkpointer_rejects_a_digest_mismatch_and_marks_the_next_good_upload(hub: RegionSet, run: str,
                                                                                    tmp_path: Path) -> None:
    """A StateUploaded whose digest does not match its object → Event(incident), no mark, no directory;
    the next correct upload → CheckpointMark (msg id ckpt-<step>) and Event(checkpoint)."""
    await provision(hub, run)
    ckpt, cbus = await checkpointer_on(hub, run, CheckpointerLaunch(state_dir=str(tmp_path / "state"), drain_linger_s=0.2),
                                       CheckpointerConfig(keep=1))
    tr = await connect(hub, run, "trainer")
    s = tr.subjects
    try:
        async with hosted(ckpt):
            await tr.put_object(s.checkpoint_bucket(), "state-step-4-aaaa", b"state four")
            await tr.publish(s.state_uploads(), StateUploaded(step=4, policy_version=4, objects=["state-step-4-aaaa"],
                                                              digests=["sha256:" + "0" * 64]))
            await tr.put_object(s.checkpoint_bucket(), "state-step-6-aaaa", b"state six")
            await tr.publish(s.state_uploads(), StateUploaded(step=6, policy_version=6, objects=["state-step-6-aaaa"],
                                                              digests=[digest(b"state six")],
                                                              consumed_rollout_ids=["x-0"], parent_step=None))
            marks = await wait_for(tr, CheckpointMark, lambda found: len(found) >= 1)
        assert [(m.step, m.consumed_rollout_ids) for m in marks] == [(6, ["x-0"])]
        assert durable_steps(tmp_path / "state") == [6]
        assert (checkpoint_dir(tmp_path / "state", 6) / "state-step-6-aaaa").read_bytes() == b"state six"
        events = await read_all(tr.js, s.events_stream(), s.all_events(), Event)
        kinds = [(e.event, e.data.get("step")) for e in events if e.actor_kind == "checkpointer"]
        assert ("incident", "4") in kinds and ("checkpoint", "6") in kinds and ("checkpoint", "4") not in kinds
        assert ckpt.counters == {"rejected": 1, "marks": 1}
    finally:
        await cbus.close()
        await tr.close()



async def test_stopping_both_together_marks_the_trainers_drain_checkpoint(hub: RegionSet, run: str,
                                                                        tmp_path: Path) -> None:
    """SIGTERM-like cancellation of trainer and checkpointer at once: the trainer's drain uploads step 1, the
    lingering checkpointer marks it, and the trainer acks its rollouts before it stops."""
    await provision(hub, run)
    trainer, tbus = await trainer_on(hub, run, TrainerConfig(lr=1e-3, batch_rollouts=4),
                                     TrainerLaunch(checkpoint_interval=10))
    ckpt, cbus = await checkpointer_on(hub, run, CheckpointerLaunch(state_dir=str(tmp_path / "state")))
    gen = await connect(hub, run, "generator")
    source = build_core("", lr=1e-3, seed=0).model
    try:
        async with anyio.create_task_group() as tg:
            await Hosted(tg, ckpt).start()
            await Hosted(tg, trainer).start()
            await publish_rollouts(gen, sample_rollouts(source, tasks=2, group_size=2, seed=1))
            await wait_for(gen, TrainStep, lambda found: len(found) >= 1)
            assert await ack_pending(gen) == 4
            tg.cancel_scope.cancel()
        assert trainer.state is State.STOPPED and ckpt.state is State.STOPPED
        assert [m.step for m in await wait_for(gen, CheckpointMark, lambda found: len(found) >= 1)] == [1]
        assert trainer.counters["acked"] == 4
        await until_acked(gen, 0)
    finally:
        for bus in (tbus, cbus, gen):
            await bus.close()


async def test_a_new_trainer_resumes_from_the_durable_copy_when_ckpt_lost_the_state(hub: RegionSet, run: str,
                                                                                  tmp_path: Path) -> None:
    """Mark 2 durable, the CKPT object deleted: a new trainer loads the checkpointer's copy from disk (digest
    checked), continues at step 2 with the same weights, and numbers its version after the last VersionReady."""
    await provision(hub, run)
    state = str(tmp_path / "state")
    config = TrainerConfig(lr=1e-3, batch_rollouts=4)
    launch = TrainerLaunch(checkpoint_interval=2, state_dir=state, mark_wait_s=2)
    first, bus1 = await trainer_on(hub, run, config, launch)
    ckpt, cbus = await checkpointer_on(hub, run, CheckpointerLaunch(state_dir=state, drain_linger_s=0.2))
    gen = await connect(hub, run, "generator")
    source = build_core("", lr=1e-3, seed=0).model
    try:
        async with anyio.create_task_group() as tg:
            checkpointer = await Hosted(tg, ckpt).start()
            hosted = await Hosted(tg, first).start()
            await publish_rollouts(gen, sample_rollouts(source, tasks=4, group_size=2, seed=1))
            marks = await wait_for(gen, CheckpointMark, lambda found: len(found) >= 1)
            await hosted.stop()
            assert first.core is not None
            weights = {k: v.clone() for k, v in first.core.model.state_dict().items()}
            store = await bus1.js.object_store(bus1.subjects.checkpoint_bucket())   # the trainer role may
            await store.delete(marks[0].objects[0])
            second, bus2 = await trainer_on(hub, run, config, launch)
            resumed = await Hosted(tg, second).start()
            versions = await wait_for(gen, VersionReady, lambda found: len(found) >= 4)   # announced once resumed
            assert second.resume_source == "disk" and second.step == 2 and second.version == 3
            assert second.core is not None
            assert all(torch.equal(weights[k], v) for k, v in second.core.model.state_dict().items())
            assert [v.version for v in versions] == [0, 1, 2, 3] and versions[-1].step == 2
            await resumed.stop()
            await checkpointer.stop()
        await bus2.close()
    finally:
        for bus in (bus1, cbus, gen):
            await bus.close()
