"""Any environment runs through the generator's one loop: a toy environment written for the tests (tests/helpers/
toy_env.py, guess a digit) is registered under a verifier kind of its own and driven by the real generator on a real
nats-server, with no change to the generator. Its partial is saved mid-turn and resumed by another generator, and the
Rollouts are what the environment saw: the loss mask on exactly the ids it was handed, its observations masked, the
reward it gave, and behaviour logprobs that a forward pass at the sampling temperature reproduces."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import nats.js.errors
import pytest
import torch
from helpers import eventually, hosted, new_run
from helpers.generator_bus import FAST, connect, provisioned, rollouts, server_fixture, spans, teacher_forced
from helpers.toy_env import KIND, GuessEnvironment, Tally

from rlbus.actors.base import ActorId
from rlbus.actors.common.weight_source import LocalWeights
from rlbus.actors.generator.actor import Generator, GeneratorConfig, partial_key
from rlbus.actors.generator.loop import BasePlug, register_environment
from rlbus.messages.bus import Bus
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.model.env import state_tokens
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.topology.network.servers import EmbeddedServer

pytestmark = pytest.mark.anyio
torch.set_num_threads(1)

RUN = new_run()
TOK = ByteTokenizer()
TEMPERATURE = 0.7
CONFIG = GeneratorConfig(group_size=2, temperature=TEMPERATURE, max_tokens=7, partial_every_tokens=3)


class Blocked(Tally):
    """A port that never answers: its generator stops mid-round, its partial saved before the round."""

    async def guess(self, target: int, digit: int) -> None:
        self.heard.append((target, digit))
        await anyio.sleep_forever()


server = server_fixture("envs", (RUN,))


@pytest.fixture
async def admin(server: EmbeddedServer) -> AsyncIterator[Bus]:
    made = await provisioned(server, RUN)
    try:
        yield made.admin
    finally:
        await made.admin.close()


async def test_a_toy_environment_runs_through_the_generator_and_resumes_mid_round(server: EmbeddedServer,
                                                                                   admin: Bus) -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(max_seq_len=256)).eval()
    ports = {"g1": Blocked(), "g2": Tally()}
    register_environment(KIND, lambda gen, message: BasePlug(gen, GuessEnvironment(gen.tokenizer),
                                                             int(message.verifier["target"]),
                                                             port=ports[gen.ident.actor_id]))
    s = admin.subjects
    task = TaskMessage(task_id="guess-7", prompt="", verifier={"kind": KIND, "target": "7"}, group_size=2,
                       region="hub")
    await admin.publish(s.tasks("hub"), task, msg_id=task.task_id)
    kv = await admin.js.key_value(s.partials_bucket("hub"))

    def generator(actor_id: str, bus: Bus) -> Generator:
        return Generator(ActorId(RUN, "hub", "generator", actor_id), bus, CONFIG, FAST,
                         weights=LocalWeights(model, version=3))

    bus = await connect(server, RUN, "generator")
    async with hosted(generator("g1", bus), close=[bus]):
        await eventually(lambda: len(ports["g1"].heard), lambda n: n >= 1, what="g1 stepping its first round")
    saved = (await kv.get(partial_key(task.task_id))).value or b""
    assert saved                                             # the drafts, saved before the round g1 never finished
    bus = await connect(server, RUN, "generator")
    async with hosted(generator("g2", bus), close=[bus]) as heir:
        await eventually(lambda: heir.counters.get("tasks", 0), lambda n: n == 1, what="g2 publishing the group")
        counters = dict(heir.counters)
    assert counters["resumed"] == 1 and counters.get("partials_discarded", 0) == 0
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get(partial_key(task.task_id))

    group = await rollouts(admin)
    assert [r.rollout_id for r in group] == ["guess-7-0", "guess-7-1"]
    env = GuessEnvironment(TOK)
    replayed: list[tuple[int, int]] = []
    firsts: list[tuple[int, int]] = []
    for r in group:
        completion, mask = r.completion_tokens.tolist(), r.loss_mask.tolist()
        assert r.prompt_tokens.tolist() == [*TOK.bos(), *state_tokens(env.start(7), TOK).ids[1:],
                                            *TOK.header("assistant")]
        # the environment replayed on the masked spans rebuilds the rollout token for token, with its reward
        state, tally = env.start(7), Tally()
        for start, end in spans(mask):
            assert 0 < end - start <= CONFIG.max_tokens
            state = (await env.step(state, completion[start:end], tally)).state
        replayed += tally.heard
        flat = state_tokens(state, TOK)
        assert flat.ids[:len(r.prompt_tokens) + len(completion)] == [*r.prompt_tokens.tolist(), *completion]
        assert state.done and r.reward == state.reward and len(spans(mask)) == len(state.guesses)
        assert r.verdict.status == ("ok" if state.reward == 1.0 else "failed")
        assert all(lp == 0.0 for lp, m in zip(r.behaviour_logprobs.tolist(), mask, strict=True) if not m)
        assert set(r.policy_versions.tolist()) == {3}
        keep = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(teacher_forced(model, r, TEMPERATURE)[keep], torch.tensor(r.behaviour_logprobs.tolist())[keep],
                                   atol=1e-4, rtol=0)
        firsts.append(tally.heard[0])
    assert sorted(ports["g2"].heard) == sorted(replayed)      # the heir's port saw every guess, each once
    # the first round's turns are the drafts g1 sampled and saved, taken by g2 as they were
    assert ports["g1"].heard and all(ports["g1"].heard.count(h) <= firsts.count(h) for h in ports["g1"].heard)
