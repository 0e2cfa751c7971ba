"""The group state of a task in progress, as pure functions: chunks cut at stop tokens with routing kept
aligned, attempts and feedback in model/env/episodes.py's layout, summaries, version filling, the Rollout a
finished episode becomes, the partial's encoding (compressed when large), and a group grown after no pass."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from rlbus.actors.generator.group import (
    ZSTD_MAGIC,
    Attempt,
    PartialGroup,
    PartialLimits,
    SampledSummary,
    add_chunk,
    any_passed,
    base_context,
    build_rollout,
    check_partial,
    decode_partial,
    encode_partial,
    episode_of,
    fill_versions,
    flatten,
    grow_group,
    new_group,
    policy_text,
    published_episodes,
    record_attempt,
    record_summary,
)
from rlbus.messages import checks
from rlbus.messages.errors import BadMessage
from rlbus.messages.schemas import SandboxVerdict, TensorBlob
from rlbus.model.env.episodes import episode_tokens
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.tasks.builtin import eval_tasks

TOK = ByteTokenizer()
TASK = eval_tasks(5, n=1)[0]
END = TOK.end_turn_id
STOPS = (TOK.end_turn_id, TOK.eos_id)


def _failed(passed: int = 2) -> Attempt:
    return Attempt(status="failed", n_passed=passed, n_tests=6, feedback="f(1) returned 0, expected 1",
                   verdict=SandboxVerdict(passed=passed, total=6, status="failed"))


def test_fill_versions_takes_the_nearest_policy_version() -> None:
    """-1 (no policy token) becomes the version before it, or after it for a leading run."""
    assert fill_versions([-1, -1, 3, -1, 4, -1]) == [3, 3, 3, 3, 4, 4]
    assert fill_versions([-1, -1]) == [-1, -1]
    assert fill_versions([]) == []


def test_chunks_are_cut_after_the_first_stop_and_routing_stays_aligned() -> None:
    """A chunk keeps ids up to and including the first stop; routing rows cover context + kept ids."""
    ep = new_group(TASK, "t", 1, TOK, now=0.0).episodes[0]
    context = base_context(ep, TASK, TOK, 3)
    L = len(context)
    route = np.arange((L + 3) * 2).reshape(L + 3, 1, 2)
    kept = add_chunk(ep, [65, 66, 67], [-1.0, -2.0, -3.0], [4, 4, 4], route, L, stop_ids=STOPS, limit=10)
    assert kept == 3 and ep.draft_ids == [65, 66, 67] and not ep.draft_done
    assert ep.routing is not None and ep.routing.shape == (L + 3, 1, 2)
    route2 = np.arange((L + 7) * 2).reshape(L + 7, 1, 2) + 1000          # context now includes the draft
    kept = add_chunk(ep, [68, END, 70, 71], [-4.0, -5.0, -6.0, -7.0], [5, 5, 5, 5], route2, L + 3,
                     stop_ids=STOPS, limit=10)
    assert kept == 2 and ep.draft_ids == [65, 66, 67, 68, END] and ep.draft_done
    assert ep.draft_logprobs == [-1.0, -2.0, -3.0, -4.0, -5.0] and ep.draft_versions == [4, 4, 4, 5, 5]
    rows = ep.routing.numpy()
    assert rows.shape == (L + 5, 1, 2)
    np.testing.assert_array_equal(rows[:L + 3], route)                  # first fed: the earlier call's
    np.testing.assert_array_equal(rows[L + 3:], route2[L + 3:L + 5])
    other = new_group(TASK, "t", 1, TOK, now=0.0).episodes[0]
    add_chunk(other, [65, 66], [-1.0, -1.0], [0, 0], None, L, stop_ids=STOPS, limit=2)
    assert other.draft_done and other.routing is None                    # length limit


def test_attempts_follow_the_episode_layout_and_become_a_rollout() -> None:
    """Two graded attempts: the flattened ids are episode_tokens' ids, the next context is the episode's,
    the Rollout splits prompt/completion at the first <|assistant|> and masks exactly the sampled ids."""
    ep = new_group(TASK, "t", 1, TOK, now=0.0).episodes[0]
    first, second = [*TOK.encode("return 0"), END], TOK.encode("return x + 1")      # second: truncated
    ep.draft_ids, ep.draft_logprobs, ep.draft_versions = first, [-0.5] * len(first), [2] * len(first)
    record_attempt(ep, TASK, _failed(), TOK, 3)
    assert [t.role for t in ep.turns] == ["user", "assistant", "observation"] and not ep.draft_ids
    assert TOK.decode(ep.turns[2].ids) == "2/6 tests passed. f(1) returned 0, expected 1"
    assert flatten(ep, TOK).ids == episode_tokens(episode_of(ep, TASK, 3), TOK).ids
    assert base_context(ep, TASK, TOK, 3) == [*flatten(ep, TOK).ids, TOK.assistant_id]
    ep.draft_ids, ep.draft_logprobs, ep.draft_versions = second, [-0.25] * len(second), [3] * len(second)
    ep.draft_done = True
    record_attempt(ep, TASK, Attempt(status="passed", n_passed=6, n_tests=6, feedback="",
                                     verdict=SandboxVerdict(passed=6, total=6, status="ok")), TOK, 3)
    assert ep.done(3) and len(ep.turns) == 4                           # passed: no observation after it
    r = build_rollout(ep, task=TASK, task_id="t", group_index=1, group_size=4, tokenizer=TOK, region="eu",
                      generator_id="g", timings={"wall_s": 1.0})
    observation = [TOK.observation_id, *ep.turns[2].ids, END, TOK.assistant_id]
    assert r.prompt_tokens.tolist() == TOK.prompt_ids(TASK.prompt)
    assert r.completion_tokens.tolist() == [*first, *observation, *second]            # no closing end_turn
    assert r.loss_mask.tolist() == [1] * len(first) + [0] * len(observation) + [1] * len(second)
    assert r.behaviour_logprobs.tolist() == [-0.5] * len(first) + [0.0] * len(observation) + [-0.25] * len(second)
    assert r.policy_versions.tolist() == [2] * (len(first) + len(observation)) + [3] * len(second)
    assert (r.rollout_id, r.group_index, r.group_size, r.region, r.reward) == ("t-1", 1, 4, "eu", 1.0)
    assert r.verdict.status == "ok" and r.routing is None


def test_summary_replaces_the_history_and_closes_two_segments() -> None:
    """After a summary the episode reads prompt, <|summary|> and the summary; the Rollout's own tokens start
    there and train only on the attempts after it, and its segments keep what the summary replaced: the
    first attempt under the prompt, and the summary (all trained) under exactly what the policy read."""
    group = new_group(TASK, "t", 1, TOK, now=0.0)
    ep = group.episodes[0]
    ep.draft_ids, ep.draft_logprobs, ep.draft_versions = [*TOK.encode("x"), END], [-1.0, -1.0], [0, 0]
    record_attempt(ep, TASK, _failed(0), TOK, 3)
    before = base_context(ep, TASK, TOK, 3)
    summary = [*TOK.encode("tried x"), END]
    source = [*before, TOK.summary_id]
    record_summary(ep, TASK, SampledSummary(source=source, ids=summary, logprobs=[-0.5] * len(summary),
                                            versions=[1] * len(summary)), TOK)
    assert ep.summaries == 1 and len(ep.attempts) == 1 and [t.role for t in ep.turns] == ["user", "summary"]
    prefix = TOK.prompt_ids(TASK.prompt)[:-1]
    assert base_context(ep, TASK, TOK, 3) == [*prefix, TOK.summary_id, *summary, TOK.assistant_id]
    ep.draft_ids, ep.draft_logprobs, ep.draft_versions = [*TOK.encode("y"), END], [-2.0, -2.0], [1, 1]
    record_attempt(ep, TASK, _failed(1), TOK, 3)
    ep.draft_ids, ep.draft_logprobs, ep.draft_versions = [*TOK.encode("z"), END], [-3.0, -3.0], [1, 1]
    record_attempt(ep, TASK, _failed(1), TOK, 3)
    r = build_rollout(ep, task=TASK, task_id="t", group_index=0, group_size=1, tokenizer=TOK, region="hub",
                      generator_id="g", timings={})
    assert r.prompt_tokens.tolist() == [*prefix, TOK.summary_id]
    mask = r.loss_mask.tolist()
    assert mask[:len(summary) + 1] == [0] * (len(summary) + 1)           # summary and <|assistant|>
    assert sum(mask) == 4 and r.reward == 0.0
    first, written = r.segments
    assert first.prompt_tokens.tolist() == TOK.prompt_ids(TASK.prompt)
    assert first.loss_mask.tolist()[:2] == [1, 1] and sum(first.loss_mask.tolist()) == 2
    assert first.behaviour_logprobs.tolist()[:2] == [-1.0, -1.0]
    assert written.prompt_tokens.tolist() == source and written.completion_tokens.tolist() == summary
    assert written.loss_mask.tolist() == [1] * len(summary) and written.policy_versions.tolist() == [1] * len(summary)
    assert decode_partial(encode_partial(group)) == group                  # and the partial keeps them
    checks.check(r)                                                        # the segments are valid on the wire
    broken = msgspec.structs.replace(r, segments=[msgspec.structs.replace(written, loss_mask=TensorBlob.of([1], "uint8"))])
    with pytest.raises(BadMessage, match=r"segments\[0\]\.loss_mask"):
        checks.check(broken)


def test_partial_round_trips_and_large_ones_are_compressed() -> None:
    """encode/decode is lossless; past 64 KiB the value is zstd behind a magic prefix; junk is a ValueError."""
    state = new_group(TASK, "t", 2, TOK, now=5.0)
    state.episodes[0].draft_ids, state.episodes[0].draft_logprobs = [1, 2, 3], [-0.125, -1.5, -3.0]
    state.episodes[0].draft_versions = [7, 7, 8]
    assert decode_partial(encode_partial(state)) == state
    big = new_group(TASK, "t", 2, TOK, now=5.0)
    big.episodes[1].draft_ids = list(range(256)) * 100
    big.episodes[1].draft_logprobs = [-1.0] * 25600
    big.episodes[1].draft_versions = [3] * 25600
    data = encode_partial(big)
    assert data.startswith(ZSTD_MAGIC) and len(data) < 64 * 1024
    assert decode_partial(data) == big
    with pytest.raises(ValueError, match="not a partial group"):
        decode_partial(b"\x01\x02")


def test_policy_text_skips_ids_the_tokenizer_does_not_know() -> None:
    """Sampled ids past the tokenizer (a model's unused vocabulary) are dropped; the text stops at a stop."""
    assert policy_text([*TOK.encode("ab"), 400, *TOK.encode("c"), END, *TOK.encode("d")], TOK) == "abc"


def test_attempt_reward_gives_partial_credit_only_when_asked() -> None:
    """A pass is 1.0; a failed attempt with 3 of 6 tests passed earns 0.5 * 3/6 with credit 0.5, else 0."""
    from rlbus.actors.generator.group import Attempt, attempt_reward

    passed = Attempt(status="passed", n_passed=6, n_tests=6, feedback="")
    half = Attempt(status="failed", n_passed=3, n_tests=6, feedback="f(1) == 2 failed")
    broken = Attempt(status="error", n_passed=0, n_tests=0, feedback="no verdict")
    assert attempt_reward(passed) == 1.0 and attempt_reward(passed, 0.5) == 1.0
    assert attempt_reward(half) == 0.0 and attempt_reward(half, 0.5) == 0.25
    assert attempt_reward(broken, 0.5) == 0.0


def test_a_group_without_a_pass_grows_by_g_and_only_to_sizes_the_limits_allow() -> None:
    """grow_group adds prompt-only episodes and raises group_size; check_partial accepts a grown partial
    only at G, 2G, ... up to max_group_size, with as many episodes as its size."""
    state = new_group(TASK, "t", 2, TOK, now=0.0)
    for ep in state.episodes:
        ep.draft_ids, ep.draft_logprobs, ep.draft_versions = [*TOK.encode("return 0"), END], [-0.5] * 9, [0] * 9
        record_attempt(ep, TASK, _failed(), TOK, 1)
    assert state.finished(1) and not any_passed(state)
    grow_group(state, TASK, TOK, 2)
    assert state.group_size == 4 and len(state.episodes) == 4 and not state.finished(1)
    assert state.episodes[2].turns[0].ids == TOK.encode(TASK.prompt) and len(state.episodes[2].turns) == 1
    assert state.episodes[0].attempts and not state.episodes[3].attempts       # the first ones keep their attempts

    def limits(max_group_size: int) -> PartialLimits:
        return PartialLimits(group_size=2, max_group_size=max_group_size, max_attempts=1, max_tokens=16,
                             max_seq_len=1024, vocab_size=TOK.vocab_size, held_version=0)
    check_partial(state, TASK, "t", TOK, limits(4))
    check_partial(state, TASK, "t", TOK, limits(6))
    for refused in (0, 3):                        # growth off; a cap below the grown size
        with pytest.raises(ValueError, match="group size 4"):
            check_partial(state, TASK, "t", TOK, limits(refused))
    state.group_size = 3                          # not a multiple of G
    with pytest.raises(ValueError, match="group size 3"):
        check_partial(state, TASK, "t", TOK, limits(6))
    state.group_size = 6                          # size and episodes disagree
    with pytest.raises(ValueError, match="4 episodes for a group of 6"):
        check_partial(state, TASK, "t", TOK, limits(6))
    with pytest.raises(ValueError, match="at least 1"):
        grow_group(state, TASK, TOK, 0)
    ep = state.episodes[3]
    ep.draft_ids, ep.draft_logprobs, ep.draft_versions = [*TOK.encode("return 1"), END], [-0.5] * 9, [0] * 9
    record_attempt(ep, TASK, Attempt(status="passed", n_passed=6, n_tests=6, feedback="",
                                     verdict=SandboxVerdict(passed=6, total=6, status="ok")), TOK, 1)
    assert any_passed(state)


def test_a_grown_group_is_published_as_its_passes_and_failures_drawn_at_random() -> None:
    """published_episodes: G of a grown group, in order — its pass and G - 1 of its failures, the same ones
    every time (a republish after a crash sends the same rollouts); without a pass, the first G; with G or
    more passes, G - 1 of them and one failure."""
    def group(passing: set[int], size: int = 12, task_id: str = "t") -> PartialGroup:
        state = new_group(TASK, task_id, size, TOK, now=0.0)
        for g, ep in enumerate(state.episodes):
            ep.draft_ids, ep.draft_logprobs, ep.draft_versions = [*TOK.encode(f"return {g}"), END], [-0.5] * 9, [0] * 9
            ok = Attempt(status="passed", n_passed=6, n_tests=6, feedback="",
                         verdict=SandboxVerdict(passed=6, total=6, status="ok"))
            record_attempt(ep, TASK, ok if g in passing else _failed(), TOK, 1)
        return state

    def ids(state: PartialGroup, episodes: list) -> list[int]:
        return [state.episodes.index(ep) for ep in episodes]

    state = group({9})
    chosen = ids(state, published_episodes(state, 4))
    assert len(chosen) == 4 and 9 in chosen and chosen == sorted(chosen)
    assert chosen == ids(state, published_episodes(group({9}), 4))               # the same draw again
    draws = {tuple(ids(s, published_episodes(s, 4))) for s in (group({9}, task_id=f"t{k}") for k in range(12))}
    assert len(draws) > 1                                                         # seeded per task, not fixed
    none = group(set())
    assert ids(none, published_episodes(none, 4)) == [0, 1, 2, 3]
    many = group({8, 9, 10, 11})
    chosen = ids(many, published_episodes(many, 4))
    assert chosen[1:] == [8, 9, 10] and chosen[0] < 8                           # 3 passes and a failure
