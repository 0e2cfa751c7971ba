"""A group resumed from a partial saved mid-turn, with the generator's turn cache on, samples what re-prefilling
every chunk samples. A generator on the toy environment (tests/helpers/toy_env.py) is stopped inside the second
sampling call of turn 2 (its weight source blocks before that call's first forward), so its partial holds one
stepped round and an open draft per episode; a second generator resumes that partial, its engine holding no row of
the group (it prefills each episode's context and draft, then keeps the rows' caches from chunk to chunk).

Greedy, for the built-in and a Hugging Face policy: the same task run with `turn_cache` on and off (re-prefill of
the whole context at every chunk) gives the same partial at the stop and the same rollouts, token for token, with
behaviour logprobs within LOGP_ATOL (the engine's documented tolerance: model/sampling/engine.py), and both
equal a forward pass of the final sequences. (Greedy, a group's episodes are alike: the test compares turns, not
episodes.)

Sampled (temperature > 0) on and off cannot agree token for token: `turn_cache` off samples each call with one
generator seeded from the call's seed (`generate`), on samples each row of a call with its own generator, seeded
from the call's seed and the row's index (`TurnEngine.open_turns`). Because that seeding is per call, whether the
row was cached or not, a sampled group resumed with the cache on draws what the uninterrupted group would have
(engine-level: tests/model/test_model_sampling_engine.py). Tested here: the heir continues the saved turns and
drafts as they were (tokens, logprobs, versions), and every behaviour logprob, before and after the resume, is a
forward pass's at the sampling temperature.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import torch
from helpers import eventually, hosted, new_run
from helpers.generator_bus import FAST, connect, provisioned, rollouts, server_fixture, spans
from helpers.hf import build_family, random_state
from helpers.toy_env import GuessEnvironment, Tally

from rlbus.actors.base import ActorId
from rlbus.actors.common.weight_source import LocalWeights
from rlbus.actors.generator.actor import Generator, GeneratorConfig, partial_key
from rlbus.actors.generator.loop import BasePlug, Group, register_environment
from rlbus.messages.bus import Bus
from rlbus.messages.schemas import Rollout
from rlbus.messages.schemas import Task as TaskMessage
from rlbus.model.env import state_context
from rlbus.model.policies.hf import HFPolicy
from rlbus.model.policies.interface import Policy, as_policy
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.topology.network.servers import EmbeddedServer

pytestmark = pytest.mark.anyio
torch.set_num_threads(1)

RUN = new_run()
KIND = "toy-guess-resume-v1"
TARGET = 7
LOGP_ATOL = 1e-4
"""model/sampling/engine.py: a kept cache's logits differ from a re-prefill's in the last bits."""
MAX_TOKENS, CHUNK, GROUP = 7, 3, 2
PORTS: dict[str, Tally] = {}
"""The port of each generator (by actor id); `Halting` reads its first generator's."""


class Halting(LocalWeights):
    """A fixed policy that blocks, until `release` is set, before the forward pass that starts the second sampling
    call of turn 2: the (CHUNK + 1)-th forward after every episode's first turn was stepped (a call samples at most
    CHUNK ids, one forward each, whichever way the generator samples). The generator is stopped there, its partial
    as the turns and chunks before saved it (`stopped_mid_turn` checks what it holds)."""

    def __init__(self, model: Policy, port: Tally) -> None:
        super().__init__(model, version=3)
        self.port, self.forwards = port, 0
        self.blocked, self.release = threading.Event(), threading.Event()

    def maybe_swap(self, step: int) -> int | None:
        if len(self.port.heard) >= GROUP:
            self.forwards += 1
            if self.forwards == CHUNK + 1:
                self.blocked.set()
                self.release.wait(timeout=60.0)   # a hang guard: the test sets it before stopping the generator
        return None


server = server_fixture("resume", (RUN,))


@pytest.fixture
async def admin(server: EmbeddedServer) -> AsyncIterator[Bus]:
    made = await provisioned(server, RUN)
    register_environment(KIND, lambda gen, message: BasePlug(gen, GuessEnvironment(gen.tokenizer),
                                                             int(message.verifier["target"]),
                                                             port=PORTS.setdefault(gen.ident.actor_id, Tally())))
    try:
        yield made.admin
    finally:
        await made.admin.close()


@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Policy]:
    """Untied embeddings, and weights noised (`random_state`) so that the logits depend on the context: at the
    usual init a tiny model's attention is near uniform, and a wrong cached key moves no logprob by 1e-4."""
    torch.manual_seed(0)
    builtin = as_policy(Transformer(ModelConfig.tiny(max_seq_len=256, tie_embeddings=False)))
    hf = HFPolicy.load(build_family(tmp_path_factory.mktemp("hf"), "qwen2-untied", max_seq_len=256))
    for seed, policy in enumerate((builtin, hf)):
        policy.load_tensors_(random_state(policy, seed + 1))
    return {"builtin": builtin.eval(), "hf": hf.eval()}


@dataclass
class Resumed:
    saved: Group
    """The partial the first generator left (decoded)."""
    rollouts: list[Rollout]
    first: dict[str, int]
    heir: dict[str, int]
    """Counters of the first generator and of the heir."""


async def stop_and_resume(server: EmbeddedServer, admin: Bus, policy: Policy, *, task_id: str, turn_cache: bool,
                          temperature: float) -> Resumed:
    """The task sampled by a generator stopped by `Halting`, then by an heir from the partial the stopped one had
    saved (put back as it was read when it stopped, whatever its last call's save did meanwhile)."""
    s = admin.subjects
    config = GeneratorConfig(group_size=GROUP, temperature=temperature, max_tokens=MAX_TOKENS,
                             partial_every_tokens=CHUNK, turn_cache=turn_cache)
    task = TaskMessage(task_id=task_id, prompt="", verifier={"kind": KIND, "target": str(TARGET)}, group_size=GROUP,
                       region="hub")
    await admin.publish(s.tasks("hub"), task, msg_id=task.task_id)
    kv = await admin.js.key_value(s.partials_bucket("hub"))
    key = partial_key(task_id)

    def generator(name: str, bus: Bus, weights: LocalWeights) -> Generator:
        return Generator(ActorId(RUN, "hub", "generator", f"{task_id}-{name}"), bus, config, FAST, weights=weights)

    halting = Halting(policy, PORTS.setdefault(f"{task_id}-first", Tally()))
    bus = await connect(server, RUN, "generator")
    async with hosted(generator("first", bus, halting), close=[bus]) as first:
        try:
            await eventually(halting.blocked.is_set, what="the first generator in its stopping call", timeout_s=60)
            saved = (await kv.get(key)).value or b""
        finally:
            halting.release.set()     # its call goes on, then it is stopped
    assert saved
    await kv.put(key, saved)
    group = BasePlug(first, GuessEnvironment(first.tokenizer), TARGET).decode(saved, task_id, GROUP)
    bus = await connect(server, RUN, "generator")
    async with hosted(generator("heir", bus, LocalWeights(policy, version=3)), close=[bus]) as heir:
        await eventually(lambda: heir.counters.get("tasks", 0), lambda n: n == 1, what="the heir publishing",
                         timeout_s=60)
    assert heir.counters["resumed"] == 1 and heir.counters.get("partials_discarded", 0) == 0
    out = await rollouts(admin, task_id)
    assert [r.group_index for r in out] == [0, 1]
    return Resumed(group, out, dict(first.counters), dict(heir.counters))


def stopped_mid_turn(saved: Group) -> None:
    """The partial holds round 1 stepped and the first chunk of every episode's turn-2 draft."""
    assert saved.rounds == 1
    for ep in saved.episodes:
        assert not ep.done and len(ep.logprobs) == 1 and len(ep.draft_ids) == CHUNK and not ep.draft_done


def resumed_tokens(saved: Group, policy: Policy) -> int:
    """The ids of every resumed episode's context and draft: what an heir's engine, holding no row, prefills."""
    return sum(len(state_context(ep.state, policy.tokenizer)) + len(ep.draft_ids) for ep in saved.episodes)


def forward_logprobs(policy: Policy, rollout: Rollout, temperature: float) -> torch.Tensor:
    """(T,) log-probability of each completion id at the sampling temperature (1 when greedy), one forward pass."""
    ids = torch.tensor([*rollout.prompt_tokens.tolist(), *rollout.completion_tokens.tolist()])[None]
    with torch.no_grad():
        logits = policy(ids).logits[0].float()
    P = len(rollout.prompt_tokens)
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)[P - 1:-1].gather(-1, ids[0, P:, None])[:, 0]


def assert_forward(policy: Policy, rollouts: list[Rollout], temperature: float) -> None:
    for r in rollouts:
        keep = torch.tensor(r.loss_mask.tolist(), dtype=torch.bool)
        torch.testing.assert_close(forward_logprobs(policy, r, temperature)[keep],
                                   torch.tensor(r.behaviour_logprobs.tolist())[keep], atol=LOGP_ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["builtin", "hf"])
async def test_a_group_resumed_mid_turn_with_the_turn_cache_samples_what_reprefill_samples(
        server: EmbeddedServer, admin: Bus, policies: dict[str, Policy], kind: str) -> None:
    """Greedy: the turn cache kept (before the stop, and in the heir after its one prefill) samples every turn's
    tokens and logprobs as re-prefilling every chunk does."""
    policy = policies[kind]
    kept = await stop_and_resume(server, admin, policy, task_id=f"resume-{kind}-kept", turn_cache=True,
                                 temperature=0.0)
    redone = await stop_and_resume(server, admin, policy, task_id=f"resume-{kind}-redone", turn_cache=False,
                                   temperature=0.0)
    stopped_mid_turn(kept.saved)
    stopped_mid_turn(redone.saved)
    # the cache was in use: before the stop its rows went on from chunk to chunk; the heir prefilled each episode's
    # context and draft once (its engine had no row of the group) and kept them after; off, no engine at all
    assert kept.first["reused_tokens"] > 0 and kept.heir["reused_tokens"] > 0
    assert kept.heir["prefill_tokens"] >= resumed_tokens(kept.saved, policy)
    assert redone.first["prefill_tokens"] == redone.heir["prefill_tokens"] == redone.heir["reused_tokens"] == 0
    for a, b in zip(kept.saved.episodes, redone.saved.episodes, strict=True):
        assert a.state.turns == b.state.turns and a.draft_ids == b.draft_ids
        torch.testing.assert_close(torch.tensor(a.draft_logprobs), torch.tensor(b.draft_logprobs),
                                   atol=LOGP_ATOL, rtol=0)
    for a, b in zip(kept.rollouts, redone.rollouts, strict=True):
        mask = a.loss_mask.tolist()
        assert a.prompt_tokens.tolist() == b.prompt_tokens.tolist()
        assert a.completion_tokens.tolist() == b.completion_tokens.tolist() and mask == b.loss_mask.tolist()
        assert len(spans(mask)) == 3 and a.reward == b.reward    # turn 2's rest and turn 3 sampled by the heir
        assert a.policy_versions.tolist() == b.policy_versions.tolist()
        keep = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(a.behaviour_logprobs.tolist())[keep],
                                   torch.tensor(b.behaviour_logprobs.tolist())[keep], atol=LOGP_ATOL, rtol=0)
    assert_forward(policy, kept.rollouts, 0.0)
    assert_forward(policy, redone.rollouts, 0.0)


@pytest.mark.parametrize("kind", ["builtin", "hf"])
async def test_a_sampled_group_resumed_mid_turn_with_the_turn_cache_continues_its_drafts(
        server: EmbeddedServer, admin: Bus, policies: dict[str, Policy], kind: str) -> None:
    """Temperature 0.7, turn cache on: the heir's episodes go on from the saved turns and drafts as they were, and
    every behaviour logprob, before and after the resume, is a forward pass's."""
    policy = policies[kind]
    resumed = await stop_and_resume(server, admin, policy, task_id=f"resume-{kind}-sampled", turn_cache=True,
                                    temperature=0.7)
    stopped_mid_turn(resumed.saved)
    assert resumed.heir["prefill_tokens"] >= resumed_tokens(resumed.saved, policy)
    assert resumed.heir["reused_tokens"] > 0
    for ep, r in zip(resumed.saved.episodes, resumed.rollouts, strict=True):
        completion, mask = r.completion_tokens.tolist(), r.loss_mask.tolist()
        (s1, e1), (s2, _) = spans(mask)[:2]
        turn1 = next(t.ids for t in ep.state.turns if t.role == "assistant")
        assert completion[s1:e1] == list(turn1)
        drafted = len(ep.draft_ids)
        assert completion[s2:s2 + drafted] == ep.draft_ids
        assert r.behaviour_logprobs.tolist()[s2:s2 + drafted] == ep.draft_logprobs
        assert r.policy_versions.tolist()[s2:s2 + drafted] == ep.draft_versions
    assert_forward(policy, resumed.rollouts, 0.7)
