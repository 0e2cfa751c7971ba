"""A toy environment written against model/env/base.py `Environment` only: guess a digit, told "higher" or "lower".

It exists to show that the generator drives any environment through its interface: a test registers it under a
verifier kind of its own (actors/generator/loop.py `register_environment`) with no change to the generator.
`Tally` is its port: it records every guess the environment hands it, so a test sees what the environment saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgspec

from rlbus.model.env.base import EnvState, StepOutcome, refuse_done
from rlbus.model.env.episodes import Turn, completion_text
from rlbus.model.policies.interface import ChatTokenizer

KIND: Final = "toy-guess-v1"
MAX_GUESSES: Final = 3


class GuessState(EnvState, frozen=True, kw_only=True, tag="toy-guess"):
    """The digit to guess and the guesses so far (-1: a turn without a digit)."""

    target: int
    guesses: tuple[int, ...] = ()


class Tally:
    """The port: every (target, guess) handed to it, in order."""

    def __init__(self) -> None:
        self.heard: list[tuple[int, int]] = []

    async def guess(self, target: int, digit: int) -> None:
        self.heard.append((target, digit))


def hint(target: int, digit: int) -> str:
    if digit < 0:
        return "No digit in your answer. Answer with one digit."
    return "higher" if digit < target else "lower"


class GuessEnvironment:
    """Guess the task's digit (an int 0..9) in at most MAX_GUESSES turns; reward 1.0 for a right guess, else 0.0.
    A wrong guess is answered by an observation turn ("higher", "lower", or no digit)."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tokenizer

    def start(self, task: int, *, now: float = 0.0) -> GuessState:
        prompt = f"I picked a digit from 0 to 9. Guess it; you have {MAX_GUESSES} tries."
        return GuessState(turns=(Turn("user", tuple(self._tokenizer.encode(prompt))),), target=task)

    async def step(self, state: GuessState, policy_ids: Sequence[int], port: Tally, *,
                   now: float = 0.0) -> StepOutcome[GuessState]:
        refuse_done(state)
        text = completion_text(policy_ids, self._tokenizer)
        digit = next((int(c) for c in text if c in "0123456789"), -1)
        await port.guess(state.target, digit)
        turns = (*state.turns, Turn("assistant", tuple(policy_ids)))
        guesses = (*state.guesses, digit)
        if digit == state.target or len(guesses) >= MAX_GUESSES:
            right = digit == state.target
            done = msgspec.structs.replace(state, turns=turns, guesses=guesses, done=True, reward=float(right),
                                           verdict="passed" if right else "failed")
            return StepOutcome(done, None)
        observation = Turn("observation", tuple(self._tokenizer.encode(hint(state.target, digit))))
        return StepOutcome(msgspec.structs.replace(state, turns=(*turns, observation), guesses=guesses), observation)
