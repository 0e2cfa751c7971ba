"""The turn engine: a KV cache kept across an episode's turns samples what re-prefilling the whole history samples;
continuous batching (rows leave at the end of a turn, rejoin after their observation); the kv_cache_tokens cap;
weight swaps that keep the caches.

Why a tolerance and not bit equality: the cache computed the history's keys and values a token (or an observation)
at a time, in left-padded batches, where a re-prefill computes them in one matmul over the whole history; BLAS
blocks those reductions differently, so logits differ in their last bits. Greedy tokens must be identical and
logprobs within LOGP_ATOL; sampled tokens are identical too because each row draws from its own generator, as a
one-prompt `generate` does, and no drawn uniform here lands within 1e-5 of a boundary of the distribution.
"""

from __future__ import annotations

import pytest
import torch
from helpers.hf import build_family, random_state

from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.hf import HFPolicy
from rlbus.model.policies.interface import Policy
from rlbus.model.policies.transformer import ModelConfig, Transformer
from rlbus.model.sampling.engine import TurnEngine, TurnSample
from rlbus.model.sampling.generate import generate

torch.set_num_threads(1)
LOGP_ATOL = 1e-4
"""float32 logits of a tiny model differ by ~1e-6 between the cached and the re-prefilled forward (see above)."""


def _builtin(seed: int = 0) -> BuiltinPolicy:
    """Untied embeddings: a random tied model's greedy output just repeats its last token."""
    torch.manual_seed(seed)
    return BuiltinPolicy(Transformer(ModelConfig.tiny(vocab_size=300, max_seq_len=512, tie_embeddings=False))).eval()


class Episodes:
    """Rows of multi-turn episodes, driven through a TurnEngine and, turn by turn, through `generate` on the whole
    history with a twin of the row's generator (the re-prefill reference)."""

    def __init__(self, policy: Policy, *, temperature: float, budgets: list[int], turns: int, obs: int = 6,
                 seed: int = 0, **engine: object) -> None:
        self.policy, self.temperature, self.budgets, self.turns, self.obs = policy, temperature, budgets, turns, obs
        self.engine = TurnEngine(policy, temperature=temperature, **engine)  # type: ignore[arg-type]
        g = torch.Generator().manual_seed(seed)
        self.draw = lambda n: torch.randint(3, 250, (n,), generator=g).tolist()
        self.context = {row: self.draw(9 + 5 * row) for row in range(len(budgets))}
        self.refgen = {row: torch.Generator().manual_seed(100 + row) for row in range(len(budgets))}
        self.done: dict[int, int] = dict.fromkeys(self.context, 0)
        self.max_diff = 0.0
        self.mismatches: list[tuple[int, int]] = []
        self.joined_while_decoding = 0
        self.most_decoding = 0
        self.reused: dict[tuple[int, int], int] = {}
        """(row, turn) -> context ids the turn found cached."""

    def start(self) -> None:
        for row, ctx in self.context.items():
            self.engine.turn(row, ctx, self.budgets[row], seed=100 + row)

    def run(self) -> None:
        self.start()
        while self.engine.busy:
            ended = self.engine.step()
            self.most_decoding = max(self.most_decoding, len(self.engine.rows("decoding")))
            for turn in ended:
                self.check(turn.row, turn)

    def check(self, row: int, turn: TurnSample) -> None:
        ref = generate(self.policy, [self.context[row]], max_new_tokens=self.budgets[row],
                       temperature=self.temperature, generator=self.refgen[row], kv_dtype=self.engine.kv_dtype)[0]
        if ref.tokens.tolist() != turn.tokens:
            self.mismatches.append((row, self.done[row]))
        else:
            self.max_diff = max(self.max_diff, float((ref.logprobs - torch.tensor(turn.logprobs)).abs().max()))
        self.reused[row, self.done[row]] = turn.reused
        self.done[row] += 1
        self.context[row] = self.context[row] + turn.tokens + self.draw(self.obs)
        if self.done[row] < self.turns:
            self.joined_while_decoding += bool(self.engine.rows("decoding"))
            self.engine.turn(row, self.context[row], self.budgets[row])
        else:
            self.engine.close(row)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_turn_cache_samples_what_reprefill_samples_builtin(temperature: float) -> None:
    """Rows of unequal budgets (so they leave and rejoin at different steps) sample, turn after turn, the tokens and
    logprobs of a re-prefill of the whole history; only the new ids of each turn are prefilled."""
    ep = Episodes(_builtin(), temperature=temperature, budgets=[5, 8, 11], turns=4)
    ep.run()
    assert ep.mismatches == [] and ep.max_diff <= LOGP_ATOL
    assert ep.joined_while_decoding > 0 and ep.most_decoding == 3
    stats = ep.engine.stats
    first = sum(9 + 5 * row for row in range(3))
    assert stats.prefill_tokens == first + 3 * 3 * (1 + ep.obs)  # later turns: the last sampled id + the observation
    assert all((n > 0) == (t > 0) for (_, t), n in ep.reused.items()) and stats.sampled_tokens == 4 * (5 + 8 + 11)
    assert ep.engine.cached_tokens() == 0  # every row closed


@pytest.fixture(scope="module")
def hf_policy(tmp_path_factory: pytest.TempPathFactory) -> HFPolicy:
    path = build_family(tmp_path_factory.mktemp("hf"), "qwen2-untied", max_seq_len=256)
    policy = HFPolicy.load(path)
    policy.load_tensors_(random_state(policy, 1))
    return policy


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_turn_cache_samples_what_reprefill_samples_hf(hf_policy: HFPolicy, temperature: float) -> None:
    """The same on a Hugging Face policy (its DynamicCache rows taken out and batched again)."""
    ep = Episodes(hf_policy, temperature=temperature, budgets=[4, 7, 9], turns=3)
    ep.run()
    assert ep.mismatches == [] and ep.max_diff <= LOGP_ATOL
    assert ep.joined_while_decoding > 0 and all((n > 0) == (t > 0) for (_, t), n in ep.reused.items())


def test_summary_context_keeps_only_the_common_prefix() -> None:
    """A new context (task + summary) reuses the task's cached prefix, prefills the summary and samples what a
    fresh prefill of it samples; a reset row prefills everything."""
    policy = _builtin(1)
    engine = TurnEngine(policy, temperature=0)
    task, history, summary = list(range(10, 30)), list(range(40, 70)), list(range(80, 92))
    engine.turn("a", task + history, 6)
    first = engine.run()[0]
    engine.turn("a", task + summary, 6)
    turn = engine.run()[0]
    ref = generate(policy, [task + summary], max_new_tokens=6, temperature=0, kv_dtype=engine.kv_dtype)[0]
    assert turn.reused == len(task) and turn.tokens == ref.tokens.tolist() and first.reused == 0
    torch.testing.assert_close(torch.tensor(turn.logprobs), ref.logprobs, atol=LOGP_ATOL, rtol=0)
    engine.reset("a")
    engine.turn("a", task + summary + turn.tokens + [5, 6], 3)
    assert engine.run()[0].reused == 0


def test_swap_keeps_the_caches() -> None:
    """Weights swapped between two decoding steps: the tokens after the swap carry the new version and the
    logprobs of the new weights over the old weights' cache, as `generate`'s in-flight swap gives them."""
    policy, other = _builtin(2), _builtin(3)
    old = {k: v.clone() for k, v in policy.named_tensors().items()}
    new = {k: v.clone() for k, v in other.named_tensors().items()}
    prompts = [list(range(5, 25)), list(range(30, 41))]
    swap_at = 4

    def reference(prompt: list[int]) -> tuple[list[int], list[float], list[int]]:
        policy.load_tensors_(old)

        def hook(step: int) -> int | None:
            if step == swap_at:
                policy.load_tensors_(new)
                return 7
            return None
        out = generate(policy, [prompt], max_new_tokens=10, temperature=0, on_step=hook, kv_dtype=torch.float32)[0]
        return out.tokens.tolist(), out.logprobs.tolist(), out.versions.tolist()

    refs = [reference(p) for p in prompts]
    policy.load_tensors_(old)
    engine = TurnEngine(policy, temperature=0, kv_dtype=torch.float32)
    for row, prompt in enumerate(prompts):
        engine.turn(row, prompt, 10)
    turns = []
    for step in range(10):
        if step == swap_at:  # the prefill sampled token 0; step s samples token s
            policy.load_tensors_(new)
            engine.swap(7)
        turns += engine.step()
    assert not engine.busy
    for turn in sorted(turns, key=lambda t: t.row):
        tokens, logprobs, versions = refs[turn.row]
        assert turn.tokens == tokens and turn.versions == versions == [0] * swap_at + [7] * (10 - swap_at)
        torch.testing.assert_close(torch.tensor(turn.logprobs), torch.tensor(logprobs), atol=LOGP_ATOL, rtol=0)
    # Without the cache kept (everything re-prefilled under the new weights) the logprobs differ.
    fresh = generate(policy, [prompts[0] + refs[0][0][:swap_at]], max_new_tokens=1, temperature=0)[0]
    assert abs(float(fresh.logprobs[0]) - refs[0][1][swap_at]) > 1e-3


@pytest.mark.parametrize("kind", ["builtin", "hf"])
def test_rows_beyond_the_cache_cap_wait_and_resting_caches_are_evicted(request: pytest.FixtureRequest,
                                                                        kind: str) -> None:
    """A cap below what three rows need together: rows wait (never fail), at most two decode at once, resting
    caches are evicted for room and their rows re-prefill (joining beside rows that kept theirs), and every turn
    still samples what re-prefill samples."""
    policy = _builtin(4) if kind == "builtin" else request.getfixturevalue("hf_policy")
    ep = Episodes(policy, temperature=1.0, budgets=[6, 6, 6], turns=3, kv_cache_tokens=50)
    ep.run()
    stats = ep.engine.stats
    assert ep.mismatches == [] and ep.max_diff <= LOGP_ATOL
    assert ep.most_decoding == 2 and stats.waits > 0 and stats.evictions > 0
    assert min(ep.reused.values()) == 0 and sum(ep.done.values()) == 9
    with pytest.raises(ValueError, match="can never fit"):
        ep.engine.turn("big", list(range(3, 50)), 10, seed=0)


def test_max_batch_and_refusals() -> None:
    """max_batch bounds the rows decoding; a row cannot be asked twice; unseeded sampling is refused."""
    policy = _builtin(5)
    ep = Episodes(policy, temperature=1.0, budgets=[3, 4, 5, 6], turns=2, max_batch=2)
    ep.run()
    assert ep.mismatches == [] and ep.most_decoding == 2
    engine = TurnEngine(policy, temperature=1.0)
    engine.turn("r", [5, 6, 7], 4, seed=1)
    with pytest.raises(ValueError, match="queued"):
        engine.turn("r", [5, 6, 7], 4)
    with pytest.raises(ValueError, match="seed or generator"):
        engine.turn("s", [5, 6], 4)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.turn("t", [5] * 500, 20, seed=0)


def test_generate_drop_in_finds_each_context_row_by_its_cached_prefix() -> None:
    """`TurnEngine.generate` takes `generate`'s call: a chunk's continuation reuses its row's cache (found by prefix,
    no keys), greedy output equals `generate` on the whole context, the swap hook versions the tokens, and rows whose
    cache the cap evicts are forgotten."""
    policy = _builtin(6)
    engine = TurnEngine(policy, temperature=0, kv_cache_tokens=200)
    prompt = list(range(20, 60))
    contexts = [[*prompt, 5, 6], [*prompt, 7], list(range(100, 130))]
    first = engine.generate(contexts, max_new_tokens=4, seed=0)
    nexts = [c + s.tokens.tolist() + [9, 9] for c, s in zip(contexts, first, strict=True)]
    second = engine.generate(nexts, max_new_tokens=5, seed=0, version=2, on_step=lambda step: 3 if step == 2 else None)
    assert engine.stats.reused_tokens == sum(len(c) + 3 for c in contexts)   # all but the last sampled id
    assert all(s.versions.tolist() == [0] * 4 for s in first)
    for context, out in zip(nexts, second, strict=True):
        ref = generate(policy, [context], max_new_tokens=5, temperature=0, kv_dtype=engine.kv_dtype)[0]
        assert out.tokens.tolist() == ref.tokens.tolist() and out.versions.tolist() == [2, 2, 3, 3, 3]
        torch.testing.assert_close(out.logprobs, ref.logprobs, atol=LOGP_ATOL, rtol=0)
    engine.generate([list(range(140, 260))], max_new_tokens=4, seed=1)   # needs room: older rows are dropped
    assert engine.stats.evictions > 0 and len(engine.rows("resting")) < 4
    sampling = TurnEngine(policy, temperature=1.0, kv_cache_tokens=100)   # a generator's seeds are 64-bit hashes
    assert len(sampling.generate([[5, 6, 7]], max_new_tokens=2, seed=2**64 - 1)[0].tokens) == 2


def test_a_call_draws_the_same_whether_its_rows_were_cached_or_not() -> None:
    """Sampled, a `generate` call continuing cached rows draws what a fresh engine (a generator that resumed the
    group from its partial, holding none of its rows) draws for the same contexts and seed: each row samples a
    call with a generator seeded from the call's seed and the context's index, not one carried from its last call."""
    policy = _builtin(8)
    contexts = [list(range(20, 50)), list(range(60, 85))]
    kept = TurnEngine(policy, temperature=1.0, kv_cache_tokens=400)
    first = kept.generate(contexts, max_new_tokens=6, seed=11)
    nexts = [c + s.tokens.tolist() + [9, 9] for c, s in zip(contexts, first, strict=True)]
    again = kept.generate(nexts, max_new_tokens=8, seed=12)
    fresh = TurnEngine(policy, temperature=1.0, kv_cache_tokens=400).generate(nexts, max_new_tokens=8, seed=12)
    assert kept.stats.reused_tokens > 0
    for a, b in zip(again, fresh, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=LOGP_ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["builtin", "hf"])
def test_rows_that_fit_alone_but_not_together_in_the_context_join_one_after_the_other(
        request: pytest.FixtureRequest, kind: str) -> None:
    """A row with a long cached prefix and a row with a long new context, each within the model's context but not
    right-aligned in one cache: the second waits for the first's turn instead of failing, and both sample what
    `generate` on their whole contexts samples."""
    policy = _builtin(7) if kind == "builtin" else request.getfixturevalue("hf_policy")
    limit = policy.max_seq_len
    engine = TurnEngine(policy, temperature=0, kv_cache_tokens=4 * limit)
    first = engine.generate([list(range(3, 3 + limit // 2))], max_new_tokens=4, seed=0)[0]
    grown = [*range(3, 3 + limit // 2), *first.tokens.tolist(), 9, 9]
    fresh = [(7 * i) % 200 + 3 for i in range(limit - limit // 4)]
    budget = limit - len(fresh)
    assert engine.stats.waits == 0 and len(grown) + budget <= limit
    out = engine.generate([grown, fresh], max_new_tokens=budget, seed=0)
    assert engine.stats.waits > 0
    for context, sample in zip([grown, fresh], out, strict=True):
        ref = generate(policy, [context], max_new_tokens=budget, temperature=0, kv_dtype=engine.kv_dtype)[0]
        assert sample.tokens.tolist() == ref.tokens.tolist()
        torch.testing.assert_close(sample.logprobs, ref.logprobs, atol=LOGP_ATOL, rtol=0)
