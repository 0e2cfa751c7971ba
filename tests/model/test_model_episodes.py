"""Multi-turn episodes: token layout, loss mask on policy tokens only, observations, the 3-attempt budget."""

from __future__ import annotations

import pytest

from rlbus.model.env.episodes import (
    add_attempt,
    add_summary,
    completion_text,
    context_ids,
    episode_tokens,
    start_episode,
)
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.tasks.builtin import HiddenTest, Task
from rlbus.model.tasks.grading import GradeResult

TOK = ByteTokenizer()
TASK = Task("t", "int", 1, "P", "f", "    return x\n", (HiddenTest("(1,)", "1"),))
FAIL = GradeResult("failed", 0, 1, "f(1) returned 2, expected 1")
PASS = GradeResult("passed", 1, 1, "")
BOS, EOS, USER, ASSIST, OBS, SUMMARY, END = 256, 257, 259, 260, 261, 262, 263


def test_context_of_a_fresh_episode_is_the_prompt() -> None:
    """A new episode's context is the tokenizer's prompt framing."""
    episode = start_episode(TASK, TOK)
    assert context_ids(episode, TOK) == TOK.prompt_ids("P") == [BOS, USER, ord("P"), END, ASSIST]


def test_failed_attempt_adds_observation_and_mask() -> None:
    """After a failure the observation follows; only the sampled ids (with their end_turn) have mask 1."""
    episode = add_attempt(start_episode(TASK, TOK), [ord("a"), END], FAIL, TOK)
    obs = [ord(c) for c in "0/1 tests passed. f(1) returned 2, expected 1"]
    flat = episode_tokens(episode, TOK)
    assert flat.ids == [BOS, USER, ord("P"), END, ASSIST, ord("a"), END, OBS, *obs, END]
    assert flat.loss_mask == [0, 0, 0, 0, 0, 1, 1, 0, *[0] * len(obs), 0]
    assert flat.turn == [-1, 0, 0, 0, 1, 1, 1, 2, *[2] * len(obs), 2]
    assert context_ids(episode, TOK) == [*flat.ids, ASSIST]
    assert not episode.done and episode.reward == 0.0


def test_truncated_sample_is_closed_but_not_trained() -> None:
    """A sample cut at max tokens (no end_turn) gets a closing end_turn with mask 0."""
    flat = episode_tokens(add_attempt(start_episode(TASK, TOK), [ord("a")], PASS, TOK), TOK)
    assert flat.ids[-3:] == [ASSIST, ord("a"), END]
    assert flat.loss_mask[-3:] == [0, 1, 0]


def test_three_attempts_then_done() -> None:
    """Three failures end the episode without a trailing observation; a fourth attempt is refused."""
    episode = start_episode(TASK, TOK)
    for _ in range(3):
        episode = add_attempt(episode, [ord("a"), END], FAIL, TOK)
    assert episode.done and episode.attempts == 3 and not episode.passed
    assert [t.role for t in episode.turns] == ["user", "assistant", "observation", "assistant", "observation",
                                              "assistant"]
    with pytest.raises(ValueError, match="done"):
        add_attempt(episode, [END], PASS, TOK)


def test_pass_ends_the_episode_with_reward() -> None:
    """A passing retry ends the episode with reward 1 and no observation after it."""
    episode = add_attempt(add_attempt(start_episode(TASK, TOK), [ord("a"), END], FAIL, TOK), [ord("b"), END],
                          PASS, TOK)
    assert episode.done and episode.passed and episode.reward == 1.0
    assert episode.turns[-1].role == "assistant" and sum(episode_tokens(episode, TOK).loss_mask) == 4


def test_summary_replaces_history_and_is_trained() -> None:
    """A summary keeps the prompt, drops the attempts, and its sampled ids carry mask 1."""
    episode = add_attempt(start_episode(TASK, TOK), [ord("a"), END], FAIL, TOK)
    flat = episode_tokens(add_summary(episode, [ord("s"), END]), TOK)
    assert flat.ids == [BOS, USER, ord("P"), END, SUMMARY, ord("s"), END]
    assert flat.loss_mask == [0, 0, 0, 0, 0, 1, 1]


def test_completion_text_stops_at_end_turn() -> None:
    """The code of a sample is its text before the first end_turn or eos."""
    assert completion_text([ord("o"), ord("k"), END, ord("z")], TOK) == "ok"
    assert completion_text([ord("o"), EOS], TOK) == "o"
