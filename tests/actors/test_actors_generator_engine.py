"""The generator's turn engine on a real agentic group (real NATS, real sandbox supervisor): sampled turns cut
into several chunks reuse the episode's cached keys and values from chunk to chunk and turn to turn, their
behaviour logprobs are the trainer's recomputation (within 1e-4: the cache was filled a token at a time), an
episode's row is closed as soon as the episode ends (before its group publishes), and the turns are sampled by
the engine driver (continuous batching). With `speculative`, the policy's MTP heads
draft (acceptance counted in the heartbeat) and the logprobs are still the trainer's."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import eventually, new_run
from helpers.generator_bus import Env, env_fixture, rollouts, server_fixture
from test_actors_generator_agentic import generator, message, sessions_open, supervisor, tiny_model

from rlbus.actors.generator.actor import GeneratorConfig
from rlbus.actors.generator.config import AgenticSettings
from rlbus.actors.generator.loop import Group, GroupLoop
from rlbus.actors.trainer.core import TrainerCore, rollout_batch
from rlbus.model.policies.interface import as_policy
from rlbus.model.tasks.repo import repo_task

pytestmark = pytest.mark.anyio
torch.set_num_threads(1)

RUNS = (new_run(), new_run())


server = server_fixture("engine", RUNS)
env = env_fixture(RUNS)


async def test_agentic_turns_reuse_the_episode_cache_and_score_as_the_trainer_does(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    task = repo_task(1, 21)
    config = GeneratorConfig(group_size=2, max_tokens=12, partial_every_tokens=4, sandbox_timeout_s=20.0,
                             agentic=AgenticSettings(max_turns=2))
    assert config.turn_cache and config.continuous_batching
    at_publish: list[int] = []
    publish = GroupLoop._publish

    async def publishing(self: GroupLoop, group: Group) -> None:
        engine = self.gen._engine
        assert engine is not None
        at_publish.append(len(engine.rows("resting")))
        await publish(self, group)

    monkeypatch.setattr(GroupLoop, "_publish", publishing)
    async with supervisor(env) as sandbox, generator(env, model, config) as actor:
        await env.admin.publish(env.admin.subjects.tasks("hub"), message(task), msg_id=task.task_id)

        async def done() -> bool:
            return actor.counters.get("tasks", 0) == 1
        await eventually(done, timeout_s=60, what="the group published")
        engine = actor._engine
        assert engine is not None and engine.rows("resting") == [] and engine.rows("queued") == []
        assert actor.gauges["engine_rows"] == 0
        counters = dict(actor.counters)
        driver = actor._driver
        await eventually(lambda: sessions_open(sandbox), lambda n: n == 0, what="every session closed", timeout_s=10)
    assert at_publish == [0]               # each episode's row closed when it ended, before the group published
    assert driver is not None and driver.requests > 0 and driver.steps >= engine.stats.decode_steps
    assert actor._decoded == (engine.stats.decode_steps, engine.stats.decode_rows)   # what batch_rows is made of
    # 2 episodes x 2 turns x 3 chunks: each chunk after an episode's first prefills only its new ids
    assert counters["prefill_tokens"] > 0 and counters["reused_tokens"] > 4 * counters["prefill_tokens"], counters
    assert engine.stats.decode_steps > 0 and engine.stats.evictions == 0
    group = await rollouts(env)
    assert len(group) == 2 and all(r.timings["turns"] == 2 for r in group)
    core = TrainerCore(as_policy(copy.deepcopy(model)), as_policy(copy.deepcopy(model)), lr=0.0)
    batch = rollout_batch(group)
    with torch.no_grad():
        logp = core.logprobs(core.policy, batch)
    assert int(batch.mask.sum()) == counters["tokens"]
    torch.testing.assert_close(logp[batch.mask], batch.behaviour[batch.mask], atol=1e-4, rtol=0)


async def test_speculative_turns_count_their_acceptance_and_score_as_the_trainer_does(env: Env) -> None:
    model = tiny_model(mtp_heads=2)
    task = repo_task(1, 22)
    config = GeneratorConfig(group_size=2, max_tokens=12, sandbox_timeout_s=20.0, speculative=True,
                             agentic=AgenticSettings(max_turns=2))
    async with supervisor(env) as sandbox, generator(env, model, config) as actor:
        await env.admin.publish(env.admin.subjects.tasks("hub"), message(task), msg_id=task.task_id)

        async def done() -> bool:
            return actor.counters.get("tasks", 0) == 1
        await eventually(done, timeout_s=60, what="the group published")
        counters, gauges = dict(actor.counters), dict(actor.gauges)
        await eventually(lambda: sessions_open(sandbox), lambda n: n == 0, what="every session closed", timeout_s=10)
    assert counters["mtp_drafted"] > 0 and counters["prefill_tokens"] == 0, counters    # the heads drafted
    assert gauges["mtp_acceptance"] == counters["mtp_accepted"] / counters["mtp_drafted"]     # one version held
    group = await rollouts(env)
    assert len(group) == 2
    core = TrainerCore(as_policy(copy.deepcopy(model)), as_policy(copy.deepcopy(model)), lr=0.0)
    batch = rollout_batch(group)
    with torch.no_grad():
        logp = core.logprobs(core.policy, batch)
    torch.testing.assert_close(logp[batch.mask], batch.behaviour[batch.mask], atol=1e-4, rtol=0)
