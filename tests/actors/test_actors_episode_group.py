"""A function group's partial and the loop's episodes, as pure functions: chunks cut at stop tokens with routing kept
aligned (the loop's `add_chunk`), attempts in model/env/episodes.py's layout and the tokens an episode is trained on
(`tail_segment`), a summary's segments kept in the partial and checked on the wire, version filling, the partial's
encoding (compressed when large), the sizes a grown group's partial may have, and the G of a grown group that are
published (`published`)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from helpers.function_partials import base_context, new_group, record_attempt

from rlbus.actors.generator.group import (
    ZSTD_MAGIC,
    Attempt,
    PartialLimits,
    SampledSummary,
    attempt_reward,
    check_partial,
    decode_partial,
    encode_partial,
    episode_of,
    fill_versions,
    flatten,
)
from rlbus.actors.generator.loop import BasePlug, Group, LoopEpisode, add_chunk, published, tail_segment
from rlbus.messages import checks
from rlbus.messages.errors import BadMessage
from rlbus.messages.schemas import Rollout, SandboxVerdict, TensorBlob
from rlbus.model.env import FunctionEnvironment, FunctionState, state_context, summarized
from rlbus.model.env.episodes import completion_text, episode_tokens
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.tasks.builtin import eval_tasks

TOK = ByteTokenizer()
TASK = eval_tasks(5, n=1)[0]
END = TOK.end_turn_id
STOPS = (TOK.end_turn_id, TOK.eos_id)


def _failed(passed: int = 2) -> Attempt:
    return Attempt(status="failed", n_passed=passed, n_tests=6, feedback="f(1) returned 0, expected 1",
                   verdict=SandboxVerdict(passed=passed, total=6, status="failed"))


PASSED = Attempt(status="passed", n_passed=6, n_tests=6, feedback="",
                 verdict=SandboxVerdict(passed=6, total=6, status="ok"))


def _fresh(max_attempts: int = 3) -> LoopEpisode:
    """An episode of the loop as a function-writing group starts it (the prompt only)."""
    return LoopEpisode(state=FunctionEnvironment(TOK, max_attempts=max_attempts).start(TASK))


def _answered(ep: LoopEpisode, ids: list[int], attempt: Attempt, logprob: float, version: int,
              max_attempts: int = 3) -> None:
    """`ids` as the episode's next policy turn graded by `attempt`, as the loop keeps it: the environment's state
    after the turn, the turn's logprobs and versions."""
    ep.state = FunctionEnvironment(TOK, max_attempts=max_attempts).record(ep.state, ids, attempt.grade()).state
    ep.logprobs.append([logprob] * len(ids))
    ep.versions.append([version] * len(ids))


def test_fill_versions_takes_the_nearest_policy_version() -> None:
    """-1 (no policy token) becomes the version before it, or after it for a leading run."""
    assert fill_versions([-1, -1, 3, -1, 4, -1]) == [3, 3, 3, 3, 4, 4]
    assert fill_versions([-1, -1]) == [-1, -1]
    assert fill_versions([]) == []


def test_chunks_are_cut_after_the_first_stop_and_routing_stays_aligned() -> None:
    """A chunk keeps ids up to and including the first stop; routing rows cover context + kept ids."""
    ep = _fresh()
    context = state_context(ep.state, TOK)
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
    other = _fresh()
    add_chunk(other, [65, 66], [-1.0, -1.0], [0, 0], None, L, stop_ids=STOPS, limit=2)
    assert other.draft_done and other.routing is None                    # length limit


def test_attempts_follow_the_episode_layout_and_become_a_rollout() -> None:
    """Two graded attempts: the partial's flattened ids are episode_tokens' ids, the next context is the episode's;
    the episode's trained tokens split prompt/completion at the first <|assistant|> and mask exactly the sampled
    ids, with their logprobs, and versions filled from the nearest sampled id."""
    ep = new_group(TASK, "t", 1, TOK, now=0.0).episodes[0]
    first, second = [*TOK.encode("return 0"), END], TOK.encode("return x + 1")      # second: truncated
    ep.draft_ids, ep.draft_logprobs, ep.draft_versions = first, [-0.5] * len(first), [2] * len(first)
    record_attempt(ep, TASK, _failed(), TOK, 3)
    assert [t.role for t in ep.turns] == ["user", "assistant", "observation"] and not ep.draft_ids
    assert TOK.decode(ep.turns[2].ids) == "2/6 tests passed. f(1) returned 0, expected 1"
    assert flatten(ep, TOK).ids == episode_tokens(episode_of(ep, TASK, 3), TOK).ids
    assert base_context(ep, TASK, TOK, 3) == [*flatten(ep, TOK).ids, TOK.assistant_id]
    loop = _fresh()
    _answered(loop, first, _failed(), -0.5, 2)
    _answered(loop, second, PASSED, -0.25, 3)
    state: FunctionState = loop.state   # type: ignore[assignment]
    assert state.done and state.reward == 1.0 and len(state.turns) == 4   # passed: no observation after it
    tail = tail_segment(loop, TOK)
    assert tail is not None
    observation = [TOK.observation_id, *ep.turns[2].ids, END, TOK.assistant_id]
    assert tail.prompt_tokens.tolist() == TOK.prompt_ids(TASK.prompt)
    assert tail.completion_tokens.tolist() == [*first, *observation, *second]            # no closing end_turn
    assert tail.loss_mask.tolist() == [1] * len(first) + [0] * len(observation) + [1] * len(second)
    assert tail.behaviour_logprobs.tolist() == [-0.5] * len(first) + [0.0] * len(observation) + [-0.25] * len(second)
    assert tail.policy_versions.tolist() == [2] * (len(first) + len(observation)) + [3] * len(second)
    assert tail.routing is None


def test_a_summarys_segments_are_kept_in_the_partial_and_checked_on_the_wire() -> None:
    """A summary as the loop takes it (the turns before it closed as a segment, the summary a segment of its own,
    the history replaced): the episode reads prompt, <|summary|> and the summary; its own tokens start there and
    train only on the attempts after it; its segments keep the first attempt under the prompt and the summary
    (all trained) under exactly what the policy read, a partial keeps them, and a Rollout's segments are checked
    on the wire."""
    ep = _fresh()
    _answered(ep, [*TOK.encode("x"), END], _failed(0), -1.0, 0)
    summary = [*TOK.encode("tried x"), END]
    source = [*state_context(ep.state, TOK), TOK.summary_id]
    written = SampledSummary(source=source, ids=summary, logprobs=[-0.5] * len(summary), versions=[1] * len(summary))
    closed = tail_segment(ep, TOK)
    assert closed is not None
    ep.segments += [closed, written.segment()]
    ep.state, ep.logprobs, ep.versions, ep.summaries = summarized(ep.state, summary), [], [], 1
    assert [t.role for t in ep.state.turns] == ["user", "summary"]
    prefix = TOK.prompt_ids(TASK.prompt)[:-1]
    assert state_context(ep.state, TOK) == [*prefix, TOK.summary_id, *summary, TOK.assistant_id]
    _answered(ep, [*TOK.encode("y"), END], _failed(1), -2.0, 1)
    _answered(ep, [*TOK.encode("z"), END], _failed(1), -3.0, 1)
    tail = tail_segment(ep, TOK)
    assert tail is not None and tail.prompt_tokens.tolist() == [*prefix, TOK.summary_id]
    mask = tail.loss_mask.tolist()
    assert mask[:len(summary) + 1] == [0] * (len(summary) + 1)           # summary and <|assistant|>
    assert sum(mask) == 4
    first, kept = ep.segments
    assert first.prompt_tokens.tolist() == TOK.prompt_ids(TASK.prompt)
    assert first.loss_mask.tolist()[:2] == [1, 1] and sum(first.loss_mask.tolist()) == 2
    assert first.behaviour_logprobs.tolist()[:2] == [-1.0, -1.0]
    assert kept.prompt_tokens.tolist() == source and kept.completion_tokens.tolist() == summary
    assert kept.loss_mask.tolist() == [1] * len(summary) and kept.policy_versions.tolist() == [1] * len(summary)
    group = new_group(TASK, "t", 1, TOK, now=0.0)
    group.episodes[0].segments, group.episodes[0].summaries = list(ep.segments), 1
    assert decode_partial(encode_partial(group)) == group                  # the partial keeps them
    r = Rollout(rollout_id="t-0", task_id="t", group_index=0, group_size=1, prompt_tokens=tail.prompt_tokens,
                completion_tokens=tail.completion_tokens, behaviour_logprobs=tail.behaviour_logprobs,
                policy_versions=tail.policy_versions, loss_mask=tail.loss_mask, segments=list(ep.segments))
    checks.check(r)                                                        # the segments are valid on the wire
    broken = msgspec.structs.replace(r, segments=[msgspec.structs.replace(kept, loss_mask=TensorBlob.of([1], "uint8"))])
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
    assert completion_text([*TOK.encode("ab"), 400, *TOK.encode("c"), END, *TOK.encode("d")], TOK) == "abc"


def test_attempt_reward_gives_partial_credit_only_when_asked() -> None:
    """A pass is 1.0; a failed attempt with 3 of 6 tests passed earns 0.5 * 3/6 with credit 0.5, else 0."""
    passed = Attempt(status="passed", n_passed=6, n_tests=6, feedback="")
    half = Attempt(status="failed", n_passed=3, n_tests=6, feedback="f(1) == 2 failed")
    broken = Attempt(status="error", n_passed=0, n_tests=0, feedback="no verdict")
    assert attempt_reward(passed) == 1.0 and attempt_reward(passed, 0.5) == 1.0
    assert attempt_reward(half) == 0.0 and attempt_reward(half, 0.5) == 0.25
    assert attempt_reward(broken, 0.5) == 0.0


def test_a_grown_groups_partial_is_resumed_only_at_sizes_the_limits_allow() -> None:
    """A group of G = 2 without a pass grown by G (two prompt-only episodes after the two graded ones):
    check_partial accepts it only at G, 2G, ... up to max_group_size, with as many episodes as its size."""
    state = new_group(TASK, "t", 4, TOK, now=0.0)
    for ep in state.episodes[:2]:
        ep.draft_ids, ep.draft_logprobs, ep.draft_versions = [*TOK.encode("return 0"), END], [-0.5] * 9, [0] * 9
        record_attempt(ep, TASK, _failed(), TOK, 1)
    assert not state.finished(1) and state.episodes[0].done(1)

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


def test_a_grown_group_is_published_as_its_passes_and_failures_drawn_at_random() -> None:
    """published: G of a grown group, in order — its pass and G - 1 of its failures, the same ones every time (a
    republish after a crash sends the same rollouts); without a pass, the first G; with G or more passes, G - 1 of
    them and one failure. (A pass as the plug counts it: a done episode with reward 1.)"""
    plug = BasePlug(None, FunctionEnvironment(TOK, max_attempts=1), TASK)  # type: ignore[arg-type]

    def group(passing: set[int], size: int = 12, task_id: str = "t") -> Group:
        episodes = [_fresh(max_attempts=1) for _ in range(size)]
        for g, ep in enumerate(episodes):
            _answered(ep, [*TOK.encode(f"return {g}"), END], PASSED if g in passing else _failed(), -0.5, 0,
                      max_attempts=1)
        return Group(task_id=task_id, group_size=size, episodes=episodes)

    def ids(state: Group, episodes: list[LoopEpisode]) -> list[int]:
        return [state.episodes.index(ep) for ep in episodes]

    state = group({9})
    chosen = ids(state, published(state, plug, 4))
    assert len(chosen) == 4 and 9 in chosen and chosen == sorted(chosen)
    assert chosen == ids(state, published(group({9}), plug, 4))                 # the same draw again
    draws = {tuple(ids(s, published(s, plug, 4))) for s in (group({9}, task_id=f"t{k}") for k in range(12))}
    assert len(draws) > 1                                                         # seeded per task, not fixed
    none = group(set())
    assert ids(none, published(none, plug, 4)) == [0, 1, 2, 3]
    many = group({8, 9, 10, 11})
    chosen = ids(many, published(many, plug, 4))
    assert chosen[1:] == [8, 9, 10] and chosen[0] < 8                           # 3 passes and a failure
