"""Any environment runs through the generator's one loop: a toy environment written for the tests (tests/helpers/
toy_env.py, guess a digit) is registered under a verifier kind of its own and driven by the real generator on a real
nats-server, with no change to the generator. Its partial is saved mid-turn and resumed by another generator, and the
Rollouts are what the environment saw: the loss mask on exactly the ids it was handed, its observations masked, the
reward it gave, and behaviour logprobs that a forward pass at the sampling temperature reproduces."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import anyio
import nats.js.errors
import pytest
import torch
from helpers import eventually, hosted, new_run
from helpers.toy_env import KIND, GuessEnvironment, Tally

from rlbus.actors.base import ActorId, ActorLimits
from rlbus.actors.common.weight_source import LocalWeights
from rlbus.actors.generator.actor import Generator, GeneratorConfig, partial_key
from rlbus.actors.generator.loop import BasePlug, register_environment
from rlbus.messages import codec
from rlbus.messages.bus import Bus, ConnectOptions
from rlbus.messages.schemas import Rollout
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.messages.streams import StreamSettings, provision_hub, provision_region
from rlbus.messages.subjects import BucketScope
from rlbus.model.env import state_tokens
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.topology.network.server_config import ServerOptions
from rlbus.topology.network.servers import EmbeddedServer

pytestmark = pytest.mark.anyio
torch.set_num_threads(1)

RUN = new_run()
FAST = ActorLimits(heartbeat_interval_s=0.2, drain_timeout_s=3.0)
TOK = ByteTokenizer()
TEMPERATURE = 0.7
CONFIG = GeneratorConfig(group_size=2, temperature=TEMPERATURE, max_tokens=7, partial_every_tokens=3)


class Blocked(Tally):
    """A port that never answers: its generator stops mid-round, its partial saved before the round."""

    async def guess(self, target: int, digit: int) -> None:
        self.heard.append((target, digit))
        await anyio.sleep_forever()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    srv = EmbeddedServer.start(tmp_path_factory.mktemp("envs-js"), ServerOptions(
        name="envs", scope=BucketScope(runs=(RUN,), regions=("hub",))))
    try:
        yield srv
    finally:
        srv.stop()


async def connect(server: EmbeddedServer, role: str) -> Bus:
    cred = server.credential(role)
    return await Bus.connect(server.url, run=RUN, options=ConnectOptions(user=cred.user, password=cred.password))


@pytest.fixture
async def admin(server: EmbeddedServer) -> AsyncIterator[Bus]:
    bus = await connect(server, "admin")
    settings = StreamSettings.tiny()
    await provision_region(bus.nc, bus.subjects, "hub", domain=None, settings=settings)
    await provision_hub(bus.nc, bus.subjects, "hub", {"hub": None}, settings)
    try:
        yield bus
    finally:
        await bus.close()


def teacher_forced(model: Transformer, rollout: Rollout) -> torch.Tensor:
    """(T,) log-probability of each completion token at the sampling temperature, one plain forward pass."""
    ids = torch.tensor([*rollout.prompt_tokens.tolist(), *rollout.completion_tokens.tolist()])[None]
    with torch.no_grad():
        logits = model(ids, with_mtp=False).logits[0].float()
    P = len(rollout.prompt_tokens)
    return torch.log_softmax(logits / TEMPERATURE, dim=-1)[P - 1:-1].gather(-1, ids[0, P:, None])[:, 0]


def spans(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            out.append((start, i))
            start = None
    return out


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

    bus = await connect(server, "generator")
    async with hosted(generator("g1", bus), close=[bus]):
        await eventually(lambda: len(ports["g1"].heard), lambda n: n >= 1, what="g1 stepping its first round")
    saved = (await kv.get(partial_key(task.task_id))).value or b""
    assert saved                                             # the drafts, saved before the round g1 never finished
    bus = await connect(server, "generator")
    async with hosted(generator("g2", bus), close=[bus]) as heir:
        await eventually(lambda: heir.counters.get("tasks", 0), lambda n: n == 1, what="g2 publishing the group")
        counters = dict(heir.counters)
    assert counters["resumed"] == 1 and counters.get("partials_discarded", 0) == 0
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get(partial_key(task.task_id))

    stream = s.rollouts_stream("hub")
    info = await admin.js.stream_info(stream)
    group = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await admin.js.get_msg(stream, seq)
        group.append(codec.decode_as(msg.data, msg.headers, Rollout))
    group.sort(key=lambda r: r.group_index)
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
        torch.testing.assert_close(teacher_forced(model, r)[keep], torch.tensor(r.behaviour_logprobs.tolist())[keep],
                                   atol=1e-4, rtol=0)
        firsts.append(tally.heard[0])
    assert sorted(ports["g2"].heard) == sorted(replayed)      # the heir's port saw every guess, each once
    # the first round's turns are the drafts g1 sampled and saved, taken by g2 as they were
    assert ports["g1"].heard and all(ports["g1"].heard.count(h) <= firsts.count(h) for h in ports["g1"].heard)
