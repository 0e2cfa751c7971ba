"""Multi-turn coding episodes: prompt, attempt, test feedback as an observation, retry (up to 3 attempts).

- Owns: the episode record (`Episode`: immutable; each step returns a new one), the token layout of an
  episode (`turns_tokens`) and its loss mask (1 on tokens the policy generated, 0 on prompt, observations
  and framing).
- Does not: sample (model/sampling/generate.py) or grade (model/tasks/grading.py); the generator actor
  drives both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

from rlbus.model.policies.interface import ChatTokenizer, Role, frame_turn
from rlbus.model.tasks.builtin import Task
from rlbus.model.tasks.grading import GradeResult

MAX_ATTEMPTS: Final = 3


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn. For policy roles, `ids` are the sampled ids verbatim; for others, the encoded text."""

    role: Role
    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Episode:
    """A task's conversation so far and the grade of every attempt (one per assistant turn)."""

    task: Task
    turns: tuple[Turn, ...]
    results: tuple[GradeResult, ...] = ()
    max_attempts: int = MAX_ATTEMPTS

    @property
    def attempts(self) -> int:
        return len(self.results)

    @property
    def passed(self) -> bool:
        return bool(self.results) and self.results[-1].passed

    @property
    def done(self) -> bool:
        """Finished when the last attempt passed or the attempt budget is spent."""
        return self.passed or self.attempts >= self.max_attempts

    @property
    def reward(self) -> float:
        """The last attempt's reward (1.0 if it passed every hidden test, else 0.0; 0.0 before any)."""
        return self.results[-1].reward if self.results else 0.0


@dataclass(frozen=True, slots=True)
class EpisodeTokens:
    """An episode flattened: ids (T,), loss_mask (T,) in {0, 1}, and the turn index of each token (-1: bos)."""

    ids: list[int]
    loss_mask: list[int]
    turn: list[int]


def start_episode(task: Task, tokenizer: ChatTokenizer, *, max_attempts: int = MAX_ATTEMPTS) -> Episode:
    """A fresh episode holding only the task's prompt as the user turn."""
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    return Episode(task, (Turn("user", tuple(tokenizer.encode(task.prompt))),), (), max_attempts)


def completion_text(ids: Sequence[int], tokenizer: ChatTokenizer) -> str:
    """The text of sampled ids, cut at the first stop id (<|end_turn|> or <|eos|> for the byte tokenizer); ids
    the tokenizer has no text for (embedding rows past its vocabulary) are skipped."""
    stops = tokenizer.stop_ids
    cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return tokenizer.decode([t for t in ids[:cut] if 0 <= t < tokenizer.vocab_size])


def add_attempt(episode: Episode, completion_ids: Sequence[int], result: GradeResult,
                tokenizer: ChatTokenizer) -> Episode:
    """Append an attempt (the sampled ids) and its grade; a failed, non-final attempt adds an observation."""
    if episode.done:
        raise ValueError(f"episode of task {episode.task.task_id} is done after {episode.attempts} attempts")
    turns = [*episode.turns, Turn("assistant", tuple(completion_ids))]
    results = (*episode.results, result)
    if not result.passed and len(results) < episode.max_attempts:
        turns.append(Turn("observation", tuple(tokenizer.encode(result.observation()))))
    return replace(episode, turns=tuple(turns), results=results)


def add_summary(episode: Episode, summary_ids: Sequence[int]) -> Episode:
    """Replace everything after the prompt with a policy-written summary turn (self-summarization)."""
    return replace(episode, turns=(episode.turns[0], Turn("summary", tuple(summary_ids))))


def turns_tokens(turns: Sequence[Turn], tokenizer: ChatTokenizer) -> EpisodeTokens:
    """Turns flattened (bos, then each turn framed); loss_mask is 1 exactly on the ids the policy sampled
    (assistant/summary content). Every environment's state is laid out by this (model/env/base.py).

    Layout (`model/policies/interface.py`, `ChatTokenizer`): bos, then per turn header(role) content
    closing, where role is user, assistant, observation or summary. An assistant (or summary) turn's content
    is exactly the ids the policy sampled, normally ending with its own stop id (then only the rest of the
    closing follows); a truncated one gets the whole closing, masked out. The context handed to the policy
    ends with header("assistant"). With the byte tokenizer: <|bos|> then per turn <|role|> content
    <|end_turn|>.
    """
    bos = tokenizer.bos()
    ids, mask, turn = list(bos), [0] * len(bos), [-1] * len(bos)
    for index, t in enumerate(turns):
        framed, framed_mask = frame_turn(tokenizer, t.role, t.ids)
        ids += framed
        mask += framed_mask
        turn += [index] * len(framed)
    return EpisodeTokens(ids, mask, turn)


def episode_tokens(episode: Episode, tokenizer: ChatTokenizer) -> EpisodeTokens:
    """Flatten an episode (`turns_tokens` of its turns)."""
    return turns_tokens(episode.turns, tokenizer)


def context_ids(episode: Episode, tokenizer: ChatTokenizer) -> list[int]:
    """What the policy continues for its next attempt: the episode so far, then the assistant header."""
    return [*episode_tokens(episode, tokenizer).ids, *tokenizer.header("assistant")]
