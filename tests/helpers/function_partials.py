"""Function-writing partials built as a generator saves them, for tests that put one in a PARTIALS bucket or hand
one to `check_partial`: `new_group` (G episodes holding only the prompt), `record_attempt` (a done draft graded),
`base_context` (what an episode's next attempt continues). The layout is actors/generator/group.py's
`PartialGroup`; the turns are model/env/function.py's."""

from __future__ import annotations

from rlbus.actors.generator.group import Attempt, EpisodeState, PartialGroup, TurnState, function_state
from rlbus.model.env import FunctionEnvironment, state_context
from rlbus.model.env.episodes import Turn
from rlbus.model.policies.interface import ChatTokenizer
from rlbus.model.tasks.builtin import Task


def fresh_episode(task: Task, tokenizer: ChatTokenizer) -> EpisodeState:
    """An episode as the function-writing environment starts it (the prompt as the user turn)."""
    return EpisodeState(turns=[TurnState(role=t.role, ids=list(t.ids))
                               for t in FunctionEnvironment(tokenizer).start(task).turns])


def new_group(task: Task, task_id: str, group_size: int, tokenizer: ChatTokenizer, *, now: float) -> PartialGroup:
    """G fresh episodes holding only the prompt."""
    return PartialGroup(task_id=task_id, group_size=group_size, started_at=now,
                        episodes=[fresh_episode(task, tokenizer) for _ in range(group_size)])


def record_attempt(ep: EpisodeState, task: Task, attempt: Attempt, tokenizer: ChatTokenizer,
                   max_attempts: int) -> None:
    """Turn the done draft into an assistant turn (with its logprobs and versions) graded by `attempt`, followed
    by what `FunctionEnvironment.record` adds (an observation when it failed and attempts are left); clear the
    draft."""
    env = FunctionEnvironment(tokenizer, max_attempts=max_attempts)
    new = env.record(function_state(ep, task, max_attempts), ep.draft_ids, attempt.grade()).state
    n = len(ep.turns)
    assert new.turns[n] == Turn("assistant", tuple(ep.draft_ids))
    ep.turns.append(TurnState(role="assistant", ids=list(ep.draft_ids), logprobs=list(ep.draft_logprobs),
                              versions=list(ep.draft_versions)))
    ep.turns.extend(TurnState(role=turn.role, ids=list(turn.ids)) for turn in new.turns[n + 1:])
    ep.attempts.append(attempt)
    ep.draft_ids, ep.draft_logprobs, ep.draft_versions, ep.draft_done = [], [], [], False


def base_context(ep: EpisodeState, task: Task, tokenizer: ChatTokenizer, max_attempts: int) -> list[int]:
    """What the next attempt continues: the episode so far, then the assistant header (draft not included)."""
    return state_context(function_state(ep, task, max_attempts), tokenizer)
