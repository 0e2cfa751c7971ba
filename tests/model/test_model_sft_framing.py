"""Demonstrations train on what RL samples under: an episode of the scripted expert, run in a real sandbox by
`rlbus tasks demos`' own code, is replayed through the agentic environment (its recorded tool outputs answering the
same calls, a summary asked for where the demonstration has one, the episode restarted from the task and the
summary), and each of its rows renders for SFT to exactly the ids and loss mask of the environment's state for
that context: the built-in byte policy with a compact and a full tool list, and Hugging Face templates that render
the tools themselves (Qwen kind, Llama-3.1 kind)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import anyio
import msgspec
import pytest
from helpers.hf import build_family

from rlbus.actors.generator.config import AgenticSettings
from rlbus.model.env.agentic import AgenticEnvironment, AgenticState
from rlbus.model.env.base import state_tokens
from rlbus.model.env.episodes import EpisodeTokens
from rlbus.model.env.summaries import FRESH_HEAD, SUMMARY_REQUEST
from rlbus.model.policies.hf_checks import load_tokenizer
from rlbus.model.policies.interface import ChatTokenizer
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.tasks.repo import RepoTask, repo_task
from rlbus.model.tasks.repo_grade import GradeReport, TestReport
from rlbus.model.tools.calls import ToolCall, ToolOutcome
from rlbus.model.tools.template import TemplateTools
from rlbus.model.training.sft import read_conversations, render
from rlbus.ops.tasks_demos import byte_tokens, demo_budgets, run_demos

pytestmark = pytest.mark.anyio

TASK: Final = repo_task(1, 11)
BUDGETS: Final = demo_budgets(AgenticSettings(max_turns=20, observation_chars=400, observation_tokens=100,
                                              summary_tokens=160))
"""`[generator.agentic]` tight enough that a result is cut by characters, an observation by tokens and the expert's
summary shortened."""
SUMMARY_AT: Final = 2000


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One demonstration, its calls run in a real sandbox session, a summary step past `SUMMARY_AT` bytes."""
    run = anyio.run(run_demos, [TASK], 1, 2, SUMMARY_AT, byte_tokens, 1, BUDGETS, backend="asyncio")
    assert run.kept == 1 and len(run.rows) >= 2, run.failures
    path = tmp_path_factory.mktemp("demos") / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in run.rows))
    read_conversations(path)                      # the shared SFT format
    return run.rows


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    path = build_family(tmp_path_factory.mktemp("qwen"), "qwen2-tied")
    return load_tokenizer(path, json.loads((path / "config.json").read_text()))


@pytest.fixture(scope="module")
def llama() -> ChatTokenizer:
    """The Llama-3.1-kind tool template of the template-tools tests (one call a turn, results in ipython turns)."""
    spec = importlib.util.spec_from_file_location("template_tools_tests",
                                                  Path(__file__).with_name("test_model_env_template_tools.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._tokenizer(module.LLAMA_TOOLS)  # type: ignore[no-any-return]


class Recorded:
    """A workspace port answering each call with the demonstration's recorded output for it, in order (a call the
    demonstration did not make fails the test); grading says passed, as the real grade did."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.answers: list[tuple[str, str]] = [(m["name"], m["content"]) for row in rows for m in row["messages"]
                                               if m["role"] == "tool"]

    async def tool(self, name: str, args: Mapping[str, Any]) -> ToolOutcome:
        called, text = self.answers.pop(0)
        assert called == name
        if text.startswith("error: "):
            return ToolOutcome(error=text.removeprefix("error: "))
        if name != "run":
            return ToolOutcome(output=text)
        head, _, output = text.partition("\n")
        if head == "timed out":
            return ToolOutcome(output=output, timed_out=True)
        return ToolOutcome(output=output, exit_code=int(head.removeprefix("exit code ")))

    async def grade_workspace(self, task: RepoTask) -> GradeReport:
        return GradeReport(verdict="passed", tests=(TestReport("test_hidden.HiddenTests.test_fixed", "passed"),))


def _policy_texts(message: dict[str, Any], env: AgenticEnvironment) -> list[str]:
    """What a policy writing this assistant message writes, a turn each: its note then its calls in the
    environment's call style; a Llama-style template's policy makes one call a turn (the call alone)."""
    calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]
    if env.call_style == "llama" and calls:
        return [c.text("llama") for c in calls]
    return ["\n".join([message["content"], *(c.text(env.call_style) for c in calls)])]


async def _replay(rows: list[dict[str, Any]], tokenizer: ChatTokenizer, tool_list: str
                  ) -> tuple[AgenticEnvironment, list[EpisodeTokens]]:
    """The environment's state at the end of each context: after its summary (before the restart), and at the end."""
    budgets = msgspec.structs.replace(BUDGETS, summary_at_tokens=1, max_tokens=1 << 20, observation_chars=1 << 20)
    env = AgenticEnvironment(tokenizer, budgets, tool_list=tool_list)  # type: ignore[arg-type]
    tok, port = env.tokenizer, Recorded(rows)
    state: AgenticState = env.start(TASK)
    contexts: list[EpisodeTokens] = []
    for k, row in enumerate(rows):
        assert (k > 0) == env.restarted(state)
        for m in row["messages"][1:]:
            if m["role"] == "user":
                assert m["content"] == SUMMARY_REQUEST
                asked = env.request_summary(state)
                assert asked is not None
                state = asked
            elif m["role"] == "assistant":
                for text in _policy_texts(m, env):
                    state = (await env.step(state, [*tok.encode(text), tok.stop_id], port)).state
                if (fresh := env.restart(state)) is not None:
                    contexts.append(state_tokens(state, tok))
                    state = fresh
    assert state.done and state.ended == "submit" and state.reward == 1.0 and not port.answers
    return env, [*contexts, state_tokens(state, tok)]


@pytest.mark.parametrize(("which", "tool_list"), [("builtin", "compact"), ("builtin", "full"), ("qwen", "full"),
                                                  ("llama", "full")])
async def test_every_row_of_a_demonstration_renders_as_the_environment_frames_that_context(
        rows: list[dict[str, Any]], qwen: ChatTokenizer, llama: ChatTokenizer, tmp_path: Path, which: str,
        tool_list: str) -> None:
    """Row k renders to the ids and mask of the environment's k-th context: the tool list where the policy's
    framing has it (the head of the user turn, or the template's system turn), tool results cut by characters and
    observations by tokens as the environment cuts them, the summary request as a user turn and the summary as a
    trained policy turn, then the fresh context of the task and the summary; a Llama-style template's two-call turn
    as two turns."""
    tokenizer = {"builtin": ByteTokenizer(), "qwen": qwen, "llama": llama}[which]
    env, contexts = await _replay(rows, tokenizer, tool_list)
    assert isinstance(env.tokenizer, TemplateTools) == (which != "builtin")
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversations = read_conversations(path)
    assert len(conversations) == len(contexts) >= 2
    for k, (conversation, expected) in enumerate(zip(conversations, contexts, strict=True)):
        got = render(conversation, tokenizer, tool_list, BUDGETS.observation_tokens)  # type: ignore[arg-type]
        assert got.ids == expected.ids, f"context {k}"
        assert got.loss_mask == expected.loss_mask, f"context {k}"
    tok = env.tokenizer
    first, texts = tok.decode(contexts[0].ids), [tok.decode(c.ids) for c in contexts]
    assert (env.tool_list_text in first) and (env.tool_list_text == "") == (which != "builtin")
    assert SUMMARY_REQUEST in first and all(FRESH_HEAD in text for text in texts[1:])
    summary = tok.encode(rows[0]["messages"][-1]["content"])
    trained = [i for i, m in zip(contexts[0].ids, contexts[0].loss_mask, strict=True) if m]
    assert trained[-len(summary) - 1:] == [*summary, tok.stop_id], "the summary is trained on"
    assert any("[output truncated:" in m["content"] for row in rows for m in row["messages"] if m["role"] == "tool")
    assert any("[observation truncated to" in text for text in texts)
    if which == "qwen":       # uncut, each row is what the chat template itself renders for its messages
        for row, conversation in zip(rows, conversations, strict=True):
            text = tokenizer.decode(render(conversation, tokenizer, "full", 1 << 30).ids, specials=True)  # type: ignore[call-arg]
            assert text == tokenizer.hf.apply_chat_template(  # type: ignore[attr-defined]
                row["messages"], tools=row["tools"], tokenize=False)
