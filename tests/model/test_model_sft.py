"""Supervised fine-tuning data: a conversation renders to the ids and loss mask the agentic environment builds for
the same turns (the built-in byte tokenizer; a Hugging Face recipe directory whose template renders tools), and a
bad line is refused naming the file, the line and the key."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Final

import pytest
from helpers.fake_workspace import FakeWorkspace
from helpers.hf import build_family

from rlbus.model.env import AgenticEnvironment, state_tokens
from rlbus.model.env.agentic import NO_CALL, no_call_text
from rlbus.model.policies.hf import HFPolicy
from rlbus.model.policies.interface import ChatTokenizer
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.tasks.repo import repo_task
from rlbus.model.tools.calls import TOOL_SCHEMAS, ToolCall, outcome_text
from rlbus.model.tools.template import TemplateTools
from rlbus.model.training.sft import SFTError, read_conversations, render, rendered

pytestmark = pytest.mark.anyio

TASK: Final = repo_task(2, 1)
PATHS: Final = sorted(TASK.files)[:2]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return HFPolicy.load(build_family(tmp_path_factory.mktemp("sft"), "qwen2-tied")).tokenizer


@pytest.fixture(scope="module")
def llama_tokenizer() -> ChatTokenizer:
    """The Llama-3.1-kind tool template of the template-tools tests (a call is the whole turn, results in ipython
    turns as JSON strings)."""
    spec = importlib.util.spec_from_file_location("template_tools_tests",
                                                  Path(__file__).with_name("test_model_env_template_tools.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._tokenizer(module.LLAMA_TOOLS)  # type: ignore[no-any-return]


def _turns(style: str) -> list[tuple[str, list[ToolCall]]]:
    """The policy's turns: thinking aloud then calls (one a turn in the Llama style), the reference edit, a turn
    without a call, submit."""
    look = [ToolCall("list_files", {"path": "."}), *(ToolCall("read_file", {"path": p}) for p in PATHS)]
    first = [("Let me look first.", look)] if style == "hermes" else [("Let me look first.", [c]) for c in look]
    return [*first, ("", list(TASK.reference)), ("I think it is done.", []), ("", [ToolCall("submit")])]


def _turn_text(content: str, calls: list[ToolCall], style: str) -> str:
    """What the policy writes: its content then each call (Hermes); a Llama-style call is the whole turn."""
    if style == "llama" and calls:
        return calls[0].text("llama")
    return "\n".join([*([content] if content else []), *(c.text(style) for c in calls)])


async def _results(calls: list[ToolCall], port: FakeWorkspace) -> list[str]:
    return [outcome_text(c, await port.tool(c.name, dict(c.arguments))) for c in calls]


async def _play_and_write(tokenizer: ChatTokenizer) -> tuple[Any, AgenticEnvironment, dict[str, Any]]:
    """The same turns played through the environment and written as an SFT conversation."""
    env = AgenticEnvironment(tokenizer)
    tok = env.tokenizer
    style = env.call_style
    state, port, mirror = env.start(TASK), FakeWorkspace(TASK), FakeWorkspace(TASK)
    messages: list[dict[str, Any]] = [{"role": "user", "content": env.render(TASK)}]
    for content, calls in _turns(style):
        text = _turn_text(content, calls, style)
        state = (await env.step(state, [*tok.encode(text), tok.stop_id], port)).state
        messages.append({"role": "assistant", "content": content, **({"tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]} if calls
            else {})})
        if state.done:
            break
        if calls:
            messages += [{"role": "tool", "content": r} for r in await _results(calls, mirror)]
        elif env.templated:
            messages.append({"role": "user", "content": NO_CALL})
        else:
            messages.append({"role": "tool", "content": no_call_text(style)})
    assert state.done and state.reward == 1.0 and state.policy_turns == len(_turns(style))
    return state, env, {"messages": messages, "tools": list(TOOL_SCHEMAS), "task_id": TASK.task_id}


def _one(tmp_path: Path, row: dict[str, Any]) -> Any:
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(row) + "\n")
    [conversation] = read_conversations(path)
    return conversation


@pytest.mark.parametrize("which", ["builtin", "hf", "llama"])
async def test_a_conversation_renders_as_the_agentic_environment_lays_out_its_turns(
        tmp_path: Path, hf_tokenizer: ChatTokenizer, llama_tokenizer: ChatTokenizer, which: str) -> None:
    """An episode played through the agentic environment (thinking aloud, several calls in a turn or, Llama-style,
    one a turn, their results, a turn without a call and its reminder, submit), written as an SFT conversation,
    renders to exactly the environment's ids and loss mask: 1 on the assistant's tokens with their stop, 0 on the
    system turn with the schemas, the task, tool results, reminders and framing."""
    tokenizer = {"builtin": ByteTokenizer(), "hf": hf_tokenizer, "llama": llama_tokenizer}[which]
    state, env, row = await _play_and_write(tokenizer)
    assert isinstance(env.tokenizer, TemplateTools) == (which != "builtin")
    assert env.call_style == ("llama" if which == "llama" else "hermes")
    expected = state_tokens(state, env.tokenizer)
    got = render(_one(tmp_path, row), tokenizer)
    assert got.ids == expected.ids and got.loss_mask == expected.loss_mask
    policy_ids = [i for t in state.turns if t.role == "assistant" for i in t.ids]
    assert [i for i, m in zip(got.ids, got.loss_mask, strict=True) if m] == policy_ids
    if which == "hf":       # and it is what the chat template itself renders for these messages
        text = tokenizer.hf.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)  # type: ignore[attr-defined]
        assert tokenizer.decode(got.ids, specials=True) == text  # type: ignore[call-arg]


def test_a_system_message_is_folded_into_the_task_and_later_user_messages_are_observations(tmp_path: Path) -> None:
    """Without tools: a leading system message goes at the head of the first user turn, a later user message is an
    observation turn (the function-writing environment's feedback), and only assistant content is trained on."""
    tok = ByteTokenizer()
    conversation = _one(tmp_path, {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "add x and y"},
        {"role": "assistant", "content": "return x - y"}, {"role": "user", "content": "1 failed"},
        {"role": "assistant", "content": "return x + y"}]})
    got = render(conversation, tok)
    assert tok.decode(got.ids) == "Be brief.\n\nadd x and yreturn x - y1 failedreturn x + y"
    observation = tok.header("observation")
    assert any(got.ids[i:i + len(observation)] == observation for i in range(len(got.ids)))
    trained = [i for i, m in zip(got.ids, got.loss_mask, strict=True) if m]
    assert trained == [*tok.encode("return x - y"), tok.stop_id, *tok.encode("return x + y"), tok.stop_id]


GOOD: Final = {"role": "user", "content": "hi"}
ANSWER: Final = {"role": "assistant", "content": "ok"}


@pytest.mark.parametrize(("line", "key"), [
    ("{not json", "not JSON"),
    (json.dumps([GOOD, ANSWER]), "expected a JSON object"),
    (json.dumps({"messages": []}), "messages: empty"),
    (json.dumps({"conversation": [GOOD, ANSWER]}), "conversation: not a key of a conversation"),
    (json.dumps({"messages": [GOOD]}), "messages: no assistant message"),
    (json.dumps({"messages": [GOOD, {"role": "bot", "content": "x"}]}), "messages[1].role: expected one of"),
    (json.dumps({"messages": [GOOD, {"content": "x"}]}), "messages[1].role: missing"),
    (json.dumps({"messages": [GOOD, {"role": "assistant"}]}), "messages[1].content: missing"),
    (json.dumps({"messages": [GOOD, {"role": "assistant", "content": 3}]}), "messages[1].content: expected a string"),
    (json.dumps({"messages": [GOOD, {**ANSWER, "tool_calls": {"name": "x"}}]}), "messages[1].tool_calls: expected a list"),
    (json.dumps({"messages": [{**GOOD, "tool_calls": []}, ANSWER]}), "messages[0].tool_calls: not a key of a user "
                                                                     "message (only a assistant message has it)"),
    (json.dumps({"messages": [GOOD, {**ANSWER, "name": "x"}]}), "messages[1].name: not a key of a assistant"),
    (json.dumps({"messages": [GOOD, {**ANSWER, "tool_calls": [{"function": {"arguments": {}}}]}]}),
     "messages[1].tool_calls[0].function.name"),
    (json.dumps({"messages": [GOOD, {**ANSWER, "tool_calls": [{"function": {"name": "run", "arguments": "ls"}}]}]}),
     "messages[1].tool_calls[0].function.arguments: expected an object"),
    (json.dumps({"messages": [{"role": "tool", "content": "x"}, ANSWER]}), "messages[0].role: a tool message must"),
    (json.dumps({"messages": [ANSWER]}), "messages[0].role: the first message"),
    (json.dumps({"messages": [GOOD, ANSWER, {"role": "system", "content": "x"}]}),
     "messages[2].role: a system message must be the first"),
    (json.dumps({"messages": [GOOD, ANSWER], "tools": {"a": 1}}), "tools: expected a list"),
])
def test_a_bad_line_is_refused_naming_the_file_the_line_and_the_key(tmp_path: Path, line: str, key: str) -> None:
    """The first bad line of a file is refused before anything else, in one line: FILE:LINE: KEY: what is wrong."""
    path = tmp_path / "data.jsonl"
    good = json.dumps({"messages": [GOOD, ANSWER]})
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(SFTError) as err:
        read_conversations(path)
    said = str(err.value)
    assert said.startswith(f"{path}:3: ") and key in said and "\n" not in said


def test_a_conversation_with_no_assistant_token_within_the_context_is_left_out(tmp_path: Path) -> None:
    """Cut at the context, a conversation keeps its first tokens; one whose assistant turn starts past the context is
    left out and counted, and a file of only such conversations is refused."""
    tok = ByteTokenizer()
    short = {"messages": [GOOD, ANSWER]}
    long = {"messages": [{"role": "user", "content": "x" * 100}, ANSWER]}
    path = tmp_path / "data.jsonl"
    path.write_text(f"{json.dumps(short)}\n{json.dumps(long)}\n")
    conversations = read_conversations(path)
    data, cut, skipped = rendered(conversations, tok, 40, "full")
    assert (len(data), cut, skipped) == (1, 1, 1) and data[0] == (render(conversations[0], tok).ids,
                                                                 render(conversations[0], tok).loss_mask)
    with pytest.raises(SFTError, match="no conversation has an assistant token within the policy's context of 39"):
        rendered(conversations[1:], tok, 40, "full")
