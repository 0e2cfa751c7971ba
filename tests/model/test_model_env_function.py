"""The function-writing environment gives what model/env/episodes.py gives: the same turns, token layout, rewards and
end, on several built-in tasks, with the grade taken through the port; its state round-trips after each turn."""

from __future__ import annotations

import pytest

from rlbus.model.env import (
    FunctionEnvironment,
    decode_state,
    encode_state,
    state_context,
    state_tokens,
    summarized,
)
from rlbus.model.env.episodes import add_attempt, add_summary, context_ids, episode_tokens, start_episode
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.tasks.builtin import Task, eval_tasks
from rlbus.model.tasks.grading import GradeCase, GradeResult, case_for, extract_code

TOK = ByteTokenizer()
pytestmark = pytest.mark.anyio


class FakeGrader:
    """Passes exactly the canonical program; records the cases it was given."""

    def __init__(self, task: Task) -> None:
        self.reference = task.program(task.solution)
        self.cases: list[GradeCase] = []

    async def grade(self, case: GradeCase) -> GradeResult:
        self.cases.append(case)
        if case.code == self.reference:
            return GradeResult("passed", case.n_tests, case.n_tests, "")
        return GradeResult("failed", 1, case.n_tests, f"{case.entry_point}(1) returned None")


SCRIPTS = {
    "fails then passes": ["    return None\n", "```python\n    return None\n```", "{solution}"],
    "three failures": ["    return None\n", "oops", "    return 0\n"],
    "passes at once": ["{solution}"],
}


@pytest.mark.parametrize("script", list(SCRIPTS))
@pytest.mark.parametrize("task", eval_tasks(3, 4), ids=lambda t: t.task_id)
async def test_same_turns_tokens_and_rewards_as_episodes(task: Task, script: str) -> None:
    """Driving the environment and model/env/episodes.py with the same attempts gives equal turns, ids, masks,
    contexts, done and reward; the port grades the case model/tasks/grading.py builds."""
    env, port = FunctionEnvironment(TOK), FakeGrader(task)
    state, episode = env.start(task), start_episode(task, TOK)
    assert state.turns == episode.turns
    for text in SCRIPTS[script]:
        if state.done:
            break
        ids = [*TOK.encode(text.format(solution=task.solution)), TOK.stop_id]
        out = await env.step(state, ids, port)
        assert port.cases[-1] == case_for(task, extract_code(text.format(solution=task.solution)))
        result = await FakeGrader(task).grade(port.cases[-1])
        episode = add_attempt(episode, ids, result, TOK)
        state = out.state
        assert decode_state(encode_state(state)) == state
        assert state.turns == episode.turns and (state.done, state.reward) == (episode.done, episode.reward)
        assert out.observation == (episode.turns[-1] if episode.turns[-1].role == "observation" else None)
        assert state_tokens(state, TOK) == episode_tokens(episode, TOK)
        assert state_context(state, TOK) == context_ids(episode, TOK)
    assert state.done and state.verdict == ("failed" if script == "three failures" else "passed")
    assert state.reward == (0.0 if script == "three failures" else 1.0)
    with pytest.raises(ValueError, match="done"):
        await env.step(state, [TOK.stop_id], port)


async def test_summary_replaces_the_history_as_episodes_does() -> None:
    """A summary after a failed attempt leaves the prompt and the summary turn, as `add_summary` does; the
    next attempt follows it."""
    task = eval_tasks(3, 1)[0]
    env, port = FunctionEnvironment(TOK), FakeGrader(task)
    ids = [*TOK.encode("    return None\n"), TOK.stop_id]
    state = (await env.step(env.start(task), ids, port)).state
    episode = add_attempt(start_episode(task, TOK), ids, await FakeGrader(task).grade(port.cases[-1]), TOK)
    summary = [*TOK.encode("returning None fails"), TOK.stop_id]
    state, episode = summarized(state, summary), add_summary(episode, summary)
    assert state.turns == episode.turns and [t.role for t in state.turns] == ["user", "summary"]
    assert state_tokens(state, TOK) == episode_tokens(episode, TOK)
    after = (await env.step(state, [*TOK.encode(task.solution), TOK.stop_id], port)).state
    assert after.turns == add_attempt(episode, [*TOK.encode(task.solution), TOK.stop_id],
                                      GradeResult("passed", 1, 1, ""), TOK).turns and after.reward == 1.0
