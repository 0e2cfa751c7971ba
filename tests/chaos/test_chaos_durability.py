"""Durability with `sync_interval = "always"`: the running hub reports the setting; a SIGKILLed hub restarted
on its store keeps every acknowledged rollout and TrainStep; rollouts that come back (republished after a
lost publish ack, redelivered after lost consumer acks, or stored twice) are skipped by the trainer, never
trained again.

The trainer and checkpointer (real actors, in process) are stopped before the hub is killed: what is tested
here is the data; a trainer living through a hub restart is tests/chaos/test_chaos_trainer_hub_restart.py."""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import anyio
import nats.errors
import pytest
from helpers import eventually, hosted
from helpers.rl_bus import HUB, connect, until_acked, wait_for
from helpers.rollouts import sample_rollouts

from rlbus.actors.base import Actor, ActorId, ActorLimits
from rlbus.actors.checkpointer import Checkpointer
from rlbus.actors.common.config import CheckpointerConfig, CheckpointerLaunch
from rlbus.actors.common.ledger import read_all, read_ledger
from rlbus.actors.trainer.actor import Trainer
from rlbus.actors.trainer.config import TrainerConfig, TrainerLaunch
from rlbus.actors.trainer.core import build_core
from rlbus.messages.bus import Bus
from rlbus.messages.schemas import CheckpointMark, Rollout, TrainStep
from rlbus.messages.streams import ensure_consumer, trainer_consumer
from rlbus.topology.backends.launch import Launch, stream_settings
from rlbus.topology.file.load import load

pytestmark = [pytest.mark.anyio, pytest.mark.chaos]
T = TypeVar("T")
LIMITS = ActorLimits(heartbeat_interval_s=0.5, drain_timeout_s=20.0)
TOPOLOGY = """
run = "durable"

[[regions]]
name = "hub"
role = "hub"
actors = [{kind = "feeder"}, {kind = "generator"}, {kind = "sandbox"}, {kind = "trainer"}, {kind = "publisher"},
          {kind = "checkpointer"}]

[durability]
sync_interval = "always"
"""
"""A valid one-region run; only its servers and streams are launched: the test plays the generator and runs the
trainer and checkpointer in process."""


async def retrying(call: Callable[[], Awaitable[T]], timeout_s: float = 30) -> T:
    """`call()` until the bus answers again (the client reconnects to the restarted server on its own)."""
    return await eventually(call, lambda _: True, what="the bus answering again", timeout_s=timeout_s, poll_s=0.3,
                            ignoring=(nats.errors.Error, TimeoutError))


async def stored_ids(bus: Bus) -> Counter[str]:
    """How many times each rollout id is stored in the hub's ROLLOUTS."""
    s = bus.subjects
    return Counter(r.rollout_id for r in await read_all(bus.js, s.hub_rollouts_stream(), s.all_rollouts(), Rollout))


async def counted(actor: Actor, counter: str, at_least: int, timeout_s: float = 60) -> None:
    """Wait until the actor's counter reaches `at_least`."""
    with anyio.fail_after(timeout_s):
        while actor.counters.get(counter, 0) < at_least:
            await anyio.sleep(0.2)


def checkpointer(bus: Bus, state: Path) -> Checkpointer:
    """The real checkpointer, keeping durable copies under `state`."""
    launch = CheckpointerLaunch(state_dir=str(state), drain_linger_s=0.5)
    return Checkpointer(ActorId(bus.subjects.run, HUB, "checkpointer", "hub-checkpointer-0"), bus,
                        CheckpointerConfig(keep=2), LIMITS, launch)


def trainer(bus: Bus, state: Path) -> Trainer:
    """The real trainer on a fresh tiny model (no pretrained checkpoint), checkpointing every 2 steps."""
    config = TrainerConfig(lr=1e-3, batch_rollouts=4, staleness_versions=8)
    launch = TrainerLaunch(checkpoint_interval=2, state_dir=str(state), mark_wait_s=10, pretrained="")
    return Trainer(ActorId(bus.subjects.run, HUB, "trainer", "hub-trainer-0"), bus, config, LIMITS, launch)


async def test_sigkilled_hub_keeps_acked_rollouts_and_comebacks_are_not_trained_twice(tmp_path: Path) -> None:
    """sync_always on the hub; 12 acked rollouts and 3 steps survive a hub SIGKILL; a republish is deduped; lost
    consumer acks redeliver all 12 and a second copy of 4 is stored: the trainer skips all 16 and trains only new
    ones; ledger: 16 trained once each, nothing lost."""
    (tmp_path / "durable.toml").write_text(TOPOLOGY)
    topology = load(tmp_path / "durable.toml")
    state = tmp_path / "state"
    async with Launch.open(topology, state_dir=state) as launch:
        regions = launch.regions
        assert regions is not None
        jetstream = regions.servers[HUB].varz()["jetstream"]["config"]
        assert jetstream["sync_always"] is True                 # varz keeps sync_interval at its 2m default
        run = topology.run
        s = launch.admin.subjects
        source = build_core("", lr=1e-3, seed=0).model
        first = sample_rollouts(source, tasks=4, group_size=2, seed=1, tag="a")
        last = sample_rollouts(source, tasks=2, group_size=2, seed=2, tag="b")
        fresh = sample_rollouts(source, tasks=2, group_size=2, seed=3, tag="c")
        gen = await connect(regions, run, "generator")
        tbus = await connect(regions, run, "trainer", "hub-trainer-0")
        cbus = await connect(regions, run, "checkpointer", "hub-checkpointer-0")
        try:
            async with hosted(checkpointer(cbus, state)), hosted(trainer(tbus, state)):
                acks = await gen.publish_batch([(s.rollouts(HUB), r, r.rollout_id) for r in first])
                assert not any(a.duplicate for a in acks)
                await wait_for(gen, CheckpointMark, lambda found: len(found) >= 1, timeout_s=60)
                await until_acked(gen, 0)                      # mark 2 covers all 8: every ack sent
                acks = await gen.publish_batch([(s.rollouts(HUB), r, r.rollout_id) for r in last])
                assert not any(a.duplicate for a in acks)
                await wait_for(gen, TrainStep, lambda found: len(found) >= 3, timeout_s=60)
            # both drained: the trainer checkpointed step 3, the lingering checkpointer marked it, all 12 acked
            await wait_for(gen, CheckpointMark, lambda found: found[-1].step == 3, timeout_s=60)
            await until_acked(gen, 0)

            await anyio.to_thread.run_sync(regions.kill, HUB)          # SIGKILL, then the same store dir
            await anyio.to_thread.run_sync(regions.restart, HUB)
            stored = await retrying(lambda: stored_ids(gen))
            assert stored == Counter({r.rollout_id: 1 for r in first + last})
            steps = await retrying(lambda: read_all(gen.js, s.trainlog_stream(), s.trainlog(), TrainStep))
            assert [t.step for t in steps] == [1, 2, 3]
            again = await retrying(lambda: gen.publish_batch([(s.rollouts(HUB), r, r.rollout_id) for r in last]))
            assert all(a.duplicate for a in again)                 # a lost publish ack, retried: stored once
            assert await stored_ids(gen) == stored

            # every consumer ack lost: the trainer's consumer starts over from the first rollout
            await launch.admin.js.delete_consumer(s.hub_rollouts_stream(), s.durable("trainer"))
            await ensure_consumer(launch.admin.js, s.hub_rollouts_stream(),
                                  trainer_consumer(s, stream_settings(topology)))
            async with hosted(checkpointer(cbus, state)), hosted(trainer(tbus, state)) as second:
                assert isinstance(second, Trainer)
                await counted(second, "redelivered_consumed", 12)       # all 12 redelivered and skipped
                await until_acked(gen, 0)                                # ... and acked (mark 3 covers them)
                await gen.publish_batch([(s.rollouts(HUB), r, None) for r in last])   # no msg id: stored twice
                await gen.publish_batch([(s.rollouts(HUB), r, r.rollout_id) for r in fresh])
                steps = await wait_for(gen, TrainStep, lambda found: len(found) >= 4, timeout_s=60)
                assert second.resume_source == "ckpt" and second.counters["redelivered_consumed"] == 16
            assert sorted(steps[3].rollout_ids) == sorted(r.rollout_id for r in fresh)
            assert (await stored_ids(gen))[last[0].rollout_id] == 2
            book = await read_ledger(gen)
            assert book.trained_twice == [] and book.lost == [] and book.trained == 16 and book.produced == 16
        finally:
            for bus in (gen, tbus, cbus):
                await bus.close()
