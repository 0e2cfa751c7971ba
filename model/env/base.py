"""What every environment shares: the interface the generator drives, the sandbox ports, the per-turn state.

- Owns: `Environment` (start a task, take one policy turn), the ports an environment calls the sandbox through
  (`GradePort`, `WorkspacePort`, `SandboxPort`: both), `EnvState`, `StepOutcome`, the flattening of a state
  into ids and loss mask (`state_tokens`) and `summarized`.
- Guarantee: every method here is pure except the port calls it awaits.
- Does not: sample, open sessions or touch the bus (the generator opens the episode's sandbox session,
  implements the ports over the bus and hands them in); `ToolOutcome` lives in model/tools/calls.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from rlbus.model.env.episodes import EpisodeTokens, Turn, turns_tokens
from rlbus.model.policies.interface import ChatTokenizer
from rlbus.model.tasks.grading import GradeCase, GradeResult
from rlbus.model.tasks.repo import RepoTask
from rlbus.model.tasks.repo_grade import GradeReport
from rlbus.model.tools.calls import ToolOutcome


class GradePort(Protocol):
    """Grading a completion's code on a task's hidden tests (the function-writing environment)."""

    async def grade(self, case: GradeCase) -> GradeResult:
        """Run `case` (code and tests) in the sandbox. Bad code is a failed result, never a raise; a raise
        (no sandbox answered) leaves the episode's state as it was, so the turn can be taken again."""
        ...


class WorkspacePort(Protocol):
    """Calls into the episode's workspace, a sandbox session the generator opened for it."""

    async def tool(self, name: str, args: Mapping[str, Any]) -> ToolOutcome:
        """One tool call (`model/tools/calls.py` `TOOLS`: name and arguments already checked)."""
        ...

    async def grade_workspace(self, task: RepoTask) -> GradeReport:
        """Grade the workspace against `task`'s hidden tests (written last into a fresh copy, run by the sandbox's
        grade runner with the task's `stdlib_under_test`, `test_command` and `timeout_s`): the per-test report.
        The copy is the sandbox's; the workspace itself is left as it is."""
        ...


class SandboxPort(GradePort, WorkspacePort, Protocol):
    """Every sandbox call an environment makes."""


class EnvState(msgspec.Struct, frozen=True, kw_only=True, tag_field="env"):
    """An episode after some turns: the base of each environment's state (its `tag` names the environment).

    `turns` are rendered for the tokenizer the environment was built with: a policy turn's ids verbatim,
    the others the encoded text. `reward` and `verdict` are final once `done`. A msgspec Struct, so the state
    after every turn round-trips through msgpack or JSON and a partial rollout checkpoints it.
    """

    turns: tuple[Turn, ...]
    done: bool = False
    reward: float = 0.0
    verdict: str = ""


S = TypeVar("S", bound=EnvState)


@dataclass(frozen=True, slots=True)
class StepOutcome(Generic[S]):
    """One policy turn taken: the new state and the observation turn it added (None when none)."""

    state: S
    observation: Turn | None


class Environment(Protocol[S]):
    """What the generator drives: a task rendered for the policy, then one policy turn at a time."""

    @property
    def tokenizer(self) -> ChatTokenizer: ...

    def start(self, task: Any, *, now: float = 0.0) -> S:
        """The initial state: the task rendered as the first turns. `now` is the wall clock (seconds)."""
        ...

    async def step(self, state: S, policy_ids: Sequence[int], port: Any, *, now: float = 0.0) -> StepOutcome[S]:
        """Take the policy turn `policy_ids` (sampled ids, verbatim): run what it asks through `port` and
        return the new state. `now` is the wall clock, passed in so the logic stays pure.

        :raises ValueError: the episode is done.
        """
        ...


def state_tokens(state: EnvState, tokenizer: ChatTokenizer) -> EpisodeTokens:
    """A state's turns flattened as model/env/episodes.py lays them out: loss_mask 1 exactly on the ids the policy
    sampled (assistant and summary content); prompts, observations, tool results and framing 0."""
    return turns_tokens(state.turns, tokenizer)


def state_context(state: EnvState, tokenizer: ChatTokenizer) -> list[int]:
    """What the policy continues for its next turn: the state's tokens, then the assistant header."""
    return [*state_tokens(state, tokenizer).ids, *tokenizer.header("assistant")]


def summarized(state: S, summary_ids: Sequence[int]) -> S:
    """The state with everything after its first turn replaced by a policy-written summary turn (the
    self-summarisation of a long history, as model/env/episodes.py `add_summary`); the rest of the state is kept."""
    return msgspec.structs.replace(state, turns=(state.turns[0], Turn("summary", tuple(summary_ids))))


def refuse_done(state: EnvState) -> None:
    """:raises ValueError: `state` is done (no more turns)."""
    if state.done:
        raise ValueError(f"the episode is done ({state.verdict}); it takes no more turns")
