"""The agentic coding environment: tool calls parsed and run in order, malformed ones answered, budgets that end
an episode, observations cut to their budget, the reward from the workspace's grade, the loss mask on the policy's
turns only, the state round-tripping after every turn. The port is a fake over an in-memory dict of files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers.fake_workspace import FakeWorkspace
from helpers.hf import build_family

from rlbus.model.env import (
    SUBMIT_SCRIPT,
    AgenticBudgets,
    AgenticEnvironment,
    AgenticState,
    ToolCall,
    decode_state,
    encode_state,
    parse_turn,
    reference_script,
    scripted_ids,
    state_context,
    state_tokens,
)
from rlbus.model.env.agentic import NO_CALL
from rlbus.model.env.summaries import SUMMARY_REQUEST, fresh_context
from rlbus.model.policies.hf import HFPolicy
from rlbus.model.policies.interface import ChatTokenizer
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.tasks.repo import RepoTask, repo_task

TOK = ByteTokenizer()
pytestmark = pytest.mark.anyio


TASKS = [repo_task(level, seed) for level in (1, 2, 3) for seed in range(4)]


async def _play(env: AgenticEnvironment, task: RepoTask, script: tuple[str, ...],
                port: FakeWorkspace | None = None) -> tuple[AgenticState, FakeWorkspace]:
    port = port or FakeWorkspace(task)
    state = env.start(task, now=0.0)
    for turn in range(50):
        ids = scripted_ids(script, state, env.tokenizer)
        state = (await env.step(state, ids, port, now=float(turn))).state
        assert decode_state(encode_state(state)) == state == msgspec.json.decode(msgspec.json.encode(state),
                                                                                type=AgenticState)
        if state.done:
            return state, port
    raise AssertionError("the script never ended the episode")


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.task_id)
async def test_reference_script_solves_and_submit_at_once_fails(task: RepoTask) -> None:
    """Following the reference edit then submitting earns 1.0 (also for the task rebuilt from its verifier spec,
    whose reference comes from its id); submitting the repository as given earns 0.0. The state round-trips
    through msgpack and JSON after every turn."""
    env = AgenticEnvironment(TOK)
    solved, port = await _play(env, task, reference_script(task))
    assert (solved.reward, solved.verdict, solved.ended) == (1.0, "passed", "submit")
    assert port.graded == [task]
    assert solved.calls == task.reference and solved.policy_turns == len(task.reference) + 1
    assert reference_script(RepoTask.from_spec(task.verifier_spec())) == reference_script(task)
    failed, port = await _play(env, task, SUBMIT_SCRIPT)
    assert (failed.reward, failed.verdict, failed.ended, failed.policy_turns) == (0.0, "failed", "submit", 1)
    assert port.calls == []


async def test_partial_credit_rewards_the_fraction_of_tests_passed() -> None:
    """With `partial_credit` an unsolved repository passing one of its two hidden tests earns 0.5 (its verdict
    stays failed); without it, 0.0; a solved one earns 1.0 either way."""
    task = TASKS[0]
    partial = AgenticEnvironment(TOK, AgenticBudgets(partial_credit=True))
    half, _ = await _play(partial, task, SUBMIT_SCRIPT)
    assert (half.reward, half.verdict, half.grade and half.grade.n_passed) == (0.5, "failed", 1)
    solved, _ = await _play(partial, task, reference_script(task))
    assert (solved.reward, solved.verdict) == (1.0, "passed")


async def test_malformed_calls_are_answered_not_run() -> None:
    """Invalid JSON, an unknown tool, bad arguments and an unclosed tag each get an error line; only the valid
    call reaches the sandbox, and the episode goes on."""
    task = TASKS[0]
    env, port = AgenticEnvironment(TOK), FakeWorkspace(task)
    turn = ('<tool_call>\n{"name": "read_file", "arguments": {"path": \n</tool_call>'
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "read_file", "arguments": {"path": 3}}</tool_call>'
            '<tool_call>{"name": "list_files", "arguments": {"recursive": true}}</tool_call>'
            '<tool_call>["list_files"]</tool_call>'
            '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>'
            '<tool_call>{"name": "submit"')
    out = await env.step(env.start(task), [*TOK.encode(turn), TOK.stop_id], port)
    assert not out.state.done and out.observation is not None
    text = TOK.decode(out.observation.ids)
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
    assert [r.split(":")[0] for r in responses] == ["error"] * 5 + ["\n".join(sorted(task.files)), "error"]
    assert "not valid JSON" in responses[0] and "unknown tool 'rm_rf'" in responses[1]
    assert "path must be a string" in responses[2] and "unknown argument(s) recursive" in responses[3]
    assert "without its </tool_call>" in responses[6]
    assert port.calls == [("list_files", {"path": "."})] and out.state.tool_calls == 7


async def test_calls_after_submit_are_not_run() -> None:
    """An edit and a submit in one turn: the edit runs, the submit grades it, the call after it never runs."""
    task = TASKS[6]
    env, port = AgenticEnvironment(TOK), FakeWorkspace(task)
    turn = "".join(c.text() for c in (*task.reference, ToolCall("submit"), ToolCall("write_file", {
        "path": "x.py", "content": ""})))
    out = await env.step(env.start(task), [*TOK.encode(turn), TOK.stop_id], port)
    assert (out.state.reward, out.state.ended, out.state.tool_calls) == (1.0, "submit", len(task.reference) + 1)
    assert [name for name, _ in port.calls] == [c.name for c in task.reference] and "x.py" not in port.files


async def test_turn_without_a_call_is_reminded() -> None:
    """A turn with no tool call is answered with how to call one; nothing runs."""
    env, task = AgenticEnvironment(TOK), TASKS[1]
    out = await env.step(env.start(task), [*TOK.encode("I think the bug is in core."), TOK.stop_id],
                         FakeWorkspace(task))
    assert out.observation is not None and TOK.decode(out.observation.ids) == NO_CALL


async def test_thousands_of_calls_end_the_episode_at_the_budget() -> None:
    """5000 calls in one turn: exactly `max_tool_calls` run, then the episode ends and is graded."""
    task = TASKS[2]
    env, port = AgenticEnvironment(TOK, AgenticBudgets(max_tool_calls=40)), FakeWorkspace(task)
    turn = ToolCall("list_files", {}).text() * 5000
    out = await env.step(env.start(task), [*TOK.encode(turn), TOK.stop_id], port)
    assert out.state.done and out.state.ended == "tool_calls" and out.observation is None
    assert len(port.calls) == 40 and out.state.tool_calls == 40 and len(port.graded) == 1


@pytest.mark.parametrize(("budgets", "ended"), [
    (AgenticBudgets(max_turns=2), "turns"),
    (AgenticBudgets(wall_s=1.5), "wall"),
    (AgenticBudgets(max_tokens=3000, summary_tokens=0), "tokens"),
])
async def test_budgets_end_the_episode(budgets: AgenticBudgets, ended: str) -> None:
    """Turns, the wall clock handed in and the context's tokens each end an episode, which is then graded."""
    task = TASKS[3]
    env, port = AgenticEnvironment(TOK, budgets), FakeWorkspace(task)
    read = ToolCall("read_file", {"path": sorted(task.files)[-1]}).text()
    state = env.start(task, now=100.0)
    turns = 0
    while not state.done:
        ids = [*TOK.encode(read), TOK.stop_id][:max(1, env.room(state) - 1)]   # the turn and its closing fit
        state = (await env.step(state, ids, port, now=100.0 + turns)).state
        turns += 1
        assert turns < 20
    assert state.ended == ended and state.verdict == "failed" and len(port.graded) == 1
    assert turns == {"turns": 2, "wall": 3}.get(ended, turns)
    if ended == "tokens":
        # the observation that would have left no room for a turn is not added; the context stays in budget
        assert state.turns[-1].role == "assistant" and len(state_tokens(state, TOK).ids) <= 3000
        fresh = env.start(task)
        assert env.room(fresh) == 3000 - len(state_context(fresh, TOK)) > 0
    with pytest.raises(ValueError, match="done"):
        await env.step(state, [TOK.stop_id], port)


async def test_the_wall_budget_cuts_off_a_turn_that_overruns_it() -> None:
    """One turn of six `run` calls under a 2.5 s wall budget, on a clock each call moves a second: three run
    (their timeouts capped by what is left of the budget), the other three are cut off, the episode ends "wall"
    and is graded once."""
    task = TASKS[1]
    env, port = AgenticEnvironment(TOK, AgenticBudgets(wall_s=2.5)), FakeWorkspace(task)
    turn = ToolCall("run", {"command": "sleep 1"}).text() * 6
    out = await env.step(env.start(task, now=100.0), [*TOK.encode(turn), TOK.stop_id], port, now=100.0,
                         clock=lambda: 100.0 + len(port.calls))
    assert out.state.done and out.state.ended == "wall" and out.observation is None
    assert [args["timeout_s"] for _, args in port.calls] == [2.5, 1.5, 0.5] and len(port.graded) == 1
    assert out.state.tool_calls == len(out.state.calls) == 3


async def test_a_full_context_is_summarised_and_the_episode_goes_on_in_its_workspace() -> None:
    """With summaries on, the context that would end the episode on tokens leaves it open and `needs_summary`;
    the summary replaces the history after the task (calls and spent budgets kept, the state round-trips), leaves
    room for a turn, and the reference edit made before it still earns 1.0. A summary past its plan is refused;
    with summaries off, or no room for one, the token budget ends the episode as before."""
    task = TASKS[1]
    edit, submit = (ids(text) for text in reference_script(task))
    env, port = AgenticEnvironment(TOK, AgenticBudgets(max_tokens=3000, summary_tokens=16)), FakeWorkspace(task)
    first = env.start(task)
    budgets = AgenticBudgets(max_tokens=len(state_context(first, TOK)) + len(edit) + 50, min_turn_tokens=64,
                             summary_tokens=16)    # the edit and its short observation fill it to under 64 left
    long = AgenticEnvironment(TOK, budgets)
    state = (await long.step(first, edit, port)).state
    assert not state.done and long.needs_summary(state) and not long.needs_summary(first)
    plan = long.summary_plan(state)
    assert plan is not None and plan.tokens == 16 and plan.keep == len(state_tokens(first, TOK).ids)
    with pytest.raises(ValueError, match="17 tokens"):
        long.summarize(state, ids("x" * 16))
    summary = ids("edited; submit next")[-16:]
    after = long.summarize(state, summary)
    assert [t.role for t in after.turns] == ["user", "summary"] and after.turns[1].ids == tuple(summary)
    assert (after.summaries, after.policy_turns, after.calls) == (1, 1, state.calls) and not long.needs_summary(after)
    assert decode_state(encode_state(after)) == after and long.room(after) >= 64
    done = (await long.step(after, submit, port)).state
    assert done.done and done.reward == 1.0 and done.ended == "submit"
    off = AgenticEnvironment(TOK, msgspec.structs.replace(budgets, summary_tokens=0))
    ended = (await off.step(first, edit, FakeWorkspace(task))).state
    assert ended.done and ended.ended == "tokens" and off.summary_plan(first) is None
    assert env.summary_plan(first) is not None


async def test_a_requested_summary_goes_on_in_a_fresh_context_of_the_task_and_the_summary() -> None:
    """`summary_at_tokens`: once a turn brings the context to it, `request_summary` adds `SUMMARY_REQUEST` as a user
    turn; the next policy turn (the summary) runs no tool, and `restart` goes on from one user turn holding the task
    and the summary (`fresh_context`), calls and spent budgets kept, the state round-tripping; the edit made before
    it still earns 1.0. Nothing is asked before a first turn, below the threshold, twice, or right after a restart."""
    task = TASKS[1]
    edit, submit = (ids(text) for text in reference_script(task))
    first = AgenticEnvironment(TOK).start(task)
    at = len(state_context(first, TOK)) + len(edit)
    env, port = AgenticEnvironment(TOK, AgenticBudgets(summary_at_tokens=at)), FakeWorkspace(task)
    state = (await env.step(first, edit, port)).state
    below = AgenticEnvironment(TOK, AgenticBudgets(summary_at_tokens=len(state_context(state, TOK)) + 1))
    assert env.request_summary(first) is None and below.request_summary(state) is None
    asked = env.request_summary(state)
    assert asked is not None and asked.summarizing and asked.turns[:-1] == state.turns
    assert TOK.decode(asked.turns[-1].ids) == SUMMARY_REQUEST and asked.turns[-1].role == "user"
    assert env.request_summary(asked) is None and env.restart(asked) is None
    files = dict(port.files)
    summary = "edited the module; submit next"
    wrote = (await env.step(asked, ids(summary), port)).state
    assert wrote.turns[-1].role == "assistant" and not wrote.done and port.files == files
    assert (wrote.calls, wrote.tool_calls, wrote.policy_turns) == (state.calls, state.tool_calls, state.policy_turns)
    fresh = env.restart(wrote)
    assert fresh is not None and [t.role for t in fresh.turns] == ["user"] and env.restarted(fresh)
    assert TOK.decode(fresh.turns[0].ids) == fresh_context(env.render(task), summary)
    assert (fresh.summaries, fresh.summarizing, fresh.calls) == (1, False, state.calls)
    assert decode_state(encode_state(fresh)) == fresh and env.request_summary(fresh) is None
    assert not env.restarted(state)
    done = (await env.step(fresh, submit, port)).state
    assert done.done and done.reward == 1.0 and done.ended == "submit"


def ids(text: str) -> list[int]:
    return [*TOK.encode(text), TOK.stop_id]


async def test_observations_are_cut_to_their_budget_saying_so() -> None:
    """A long result is cut to `observation_chars`, the observation to `observation_tokens`, each with a notice;
    a run's timeout is capped by the budget."""
    task = TASKS[4]
    port = FakeWorkspace(task)
    env = AgenticEnvironment(TOK, AgenticBudgets(observation_chars=100, observation_tokens=4000, run_timeout_s=5.0))
    turn = ToolCall("run", {"command": "yes", "timeout_s": 999}).text()
    out = await env.step(env.start(task), [*TOK.encode(turn), TOK.stop_id], port)
    assert out.observation is not None
    text = TOK.decode(out.observation.ids)
    assert text == ("<tool_response>\nexit code 0\n" + "x" * 88
                    + "\n[output truncated: 10012 characters, the first 100 shown]\n</tool_response>")
    assert port.calls == [("run", {"command": "yes", "timeout_s": 5.0})]
    nan = '<tool_call>{"name": "run", "arguments": {"command": "yes", "timeout_s": NaN}}</tool_call>'
    await env.step(env.start(task), [*TOK.encode(nan), TOK.stop_id], port)
    assert port.calls[-1] == ("run", {"command": "yes", "timeout_s": 5.0})
    env = AgenticEnvironment(TOK, AgenticBudgets(observation_chars=100_000, observation_tokens=64))
    out = await env.step(env.start(task), [*TOK.encode(turn), TOK.stop_id], port)
    assert out.observation is not None and len(out.observation.ids) == 64
    assert TOK.decode(out.observation.ids).endswith("\n[observation truncated to 64 tokens]")


def test_parse_accepts_arguments_as_a_json_string() -> None:
    """Arguments given as a JSON string (as some models write them) are decoded; defaults are filled."""
    calls = parse_turn('<tool_call>{"name": "search", "arguments": "{\\"pattern\\": \\"def\\"}"}</tool_call>')
    assert calls == [ToolCall("search", {"path": ".", "pattern": "def"})]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return HFPolicy.load(build_family(tmp_path_factory.mktemp("hf"), "qwen2-tied")).tokenizer


@pytest.mark.parametrize("which", ["byte", "qwen2"])
async def test_loss_mask_covers_exactly_the_policy_turns(which: str, request: pytest.FixtureRequest) -> None:
    """On the byte tokenizer and a Qwen2 chat template, mask 1 exactly on the ids of the assistant turns: the
    prompt, tool results, reminders and framing are 0; the context ends with the assistant header."""
    tok: ChatTokenizer = TOK if which == "byte" else request.getfixturevalue("qwen2")
    task = TASKS[5]
    env, port = AgenticEnvironment(tok, tool_list="compact"), FakeWorkspace(task)
    state = env.start(task)
    sampled: list[list[int]] = []
    for text in ("thinking", ToolCall("read_file", {"path": sorted(task.files)[0]}).text(), '<tool_call>{"x"'):
        ids = [*tok.encode(text), tok.stop_id]
        sampled.append(ids)
        state = (await env.step(state, ids, port)).state
    flat = state_tokens(state, tok)
    assert [t.role for t in state.turns] == ["user", *["assistant", "observation"] * 3]
    masked = [i for i, m in zip(flat.ids, flat.loss_mask, strict=True) if m]
    assert masked == [i for ids in sampled for i in ids]
    for index, t in enumerate(state.turns):
        turn_mask = [m for m, k in zip(flat.loss_mask, flat.turn, strict=True) if k == index]
        assert any(turn_mask) == (t.role == "assistant")
    assert state_context(state, tok)[-len(tok.header("assistant")):] == tok.header("assistant")


def test_state_decodes_only_from_a_state() -> None:
    """Garbage bytes or a state of an unknown environment do not decode."""
    with pytest.raises(msgspec.DecodeError):
        decode_state(b"\x93garbage")
    with pytest.raises(msgspec.DecodeError):
        decode_state(msgspec.msgpack.encode({"env": "chess", "turns": []}))


def test_hf_rendering_matches_a_qwen_template_tool_turn(qwen2: Any, tmp_path: Path) -> None:
    """Tool results in the observation role are what a Qwen2.5-style template renders for consecutive `tool`
    messages: <|im_start|>user\\n<tool_response>\\n...\\n</tool_response>\\n<tool_response>...<|im_end|>."""
    from rlbus.model.policies.interface import frame_turn
    from rlbus.model.tools.calls import response_text

    template = ("{%- for message in messages %}{%- if message.role == 'tool' %}"
                "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}"
                "{%- endif %}{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
                "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
                "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
                "{%- endif %}{%- endfor %}")
    rendered = qwen2.hf.apply_chat_template([{"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}],
                                            chat_template=template, tokenize=False)
    ids, _ = frame_turn(qwen2, "observation", qwen2.encode(response_text(["A", "B"])))
    assert qwen2.decode(ids, specials=True) == rendered
