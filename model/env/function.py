"""The function-writing environment: model/env/episodes.py's episode (prompt, attempt, test feedback, retry) as an
`Environment`.

Owns: `FunctionState` (and `state_of`, an episode's) and `FunctionEnvironment`: the same turns, token layout and rewards as
model/env/episodes.py gives (`start_episode`, `add_attempt`), with the grade taken through a `GradePort`; `step` is
`case` (what grades an attempt), the port's grade, then `record` (the attempt and its feedback), and the generator
drives all three (actors/generator/function.py, the plug actors/generator/loop.py runs).
Does not own: the episode logic itself (model/env/episodes.py) or grading (the port; model/tasks/grading.py builds
the case it runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from rlbus.model.env.base import EnvState, GradePort, StepOutcome, refuse_done
from rlbus.model.env.episodes import MAX_ATTEMPTS, Episode, add_attempt, completion_text, start_episode
from rlbus.model.policies.interface import ChatTokenizer
from rlbus.model.tasks.builtin import Task
from rlbus.model.tasks.grading import GradeCase, GradeResult, case_for, extract_code

GRADE_TIMEOUT_S: Final = 1.0
"""Per-case time limit of the grade (model/tasks/grading.py's default)."""


class FunctionState(EnvState, frozen=True, kw_only=True, tag="function"):
    """A function-writing episode: its task, the grade of every attempt, the attempt budget."""

    task: Task
    results: tuple[GradeResult, ...] = ()
    max_attempts: int = MAX_ATTEMPTS

    def episode(self) -> Episode:
        """The model/env/episodes.py view of this state."""
        return Episode(self.task, self.turns, self.results, self.max_attempts)


def state_of(episode: Episode) -> FunctionState:
    """The state of a model/env/episodes.py episode (the inverse of `FunctionState.episode`)."""
    last = episode.results[-1].status if episode.results else ""
    return FunctionState(turns=episode.turns, done=episode.done, reward=episode.reward, verdict=last,
                         task=episode.task, results=episode.results, max_attempts=episode.max_attempts)


class FunctionEnvironment:
    """Write the function of a `model.tasks.Task`; each failed attempt is answered by its first test failure,
    up to `max_attempts` attempts. Reward: the last attempt's (1.0 when every hidden test passed)."""

    def __init__(self, tokenizer: ChatTokenizer, *, max_attempts: int = MAX_ATTEMPTS,
                 timeout_s: float = GRADE_TIMEOUT_S) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._tokenizer = tokenizer
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tokenizer

    def start(self, task: Task, *, now: float = 0.0) -> FunctionState:
        """The task's prompt as the user turn (`now` is unused: this environment has no wall budget)."""
        return state_of(start_episode(task, self._tokenizer, max_attempts=self.max_attempts))

    async def step(self, state: FunctionState, policy_ids: Sequence[int], port: GradePort, *,
                   now: float = 0.0) -> StepOutcome[FunctionState]:
        """Grade the attempt (`case`) through the port, then `record` it.

        :raises ValueError: the episode is done.
        """
        refuse_done(state)
        result = await port.grade(self.case(state, policy_ids))
        return self.record(state, policy_ids, result)

    def case(self, state: FunctionState, policy_ids: Sequence[int]) -> GradeCase:
        """What grades the attempt `policy_ids`: its code (the first fenced block, else all its text up to the
        stop) as the task's program, on every hidden test."""
        code = extract_code(completion_text(policy_ids, self._tokenizer))
        return case_for(state.task, code, timeout_s=self.timeout_s)

    def record(self, state: FunctionState, policy_ids: Sequence[int],
               result: GradeResult) -> StepOutcome[FunctionState]:
        """The attempt and its grade appended (model/env/episodes.py `add_attempt`): a failed attempt with attempts
        left adds its test feedback as the observation. Pure: the generator records a grade it got once for
        every identical attempt of a round.

        :raises ValueError: the episode is done.
        """
        refuse_done(state)
        new = state_of(add_attempt(state.episode(), policy_ids, result, self._tokenizer))
        added = new.turns[len(state.turns) + 1:]
        return StepOutcome(new, added[0] if added else None)
