"""Tools in the policy's own chat-template format: a template that renders tools gets the schemas in its system
turn, its call style parsed (Hermes `<tool_call>` blocks, Llama-3.1 JSON turns) and the results in its tool role;
a template without tools keeps the tool list in the user turn. The two templates below are written here, modelled
on the tool sections of Qwen2.5's and Llama-3.1's; the tokenizer is a byte-level BPE trained on a few KB."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import pytest
from helpers.fake_workspace import FakeWorkspace
from helpers.hf import TEXTS, build_family

from rlbus.model.env import (
    AgenticEnvironment,
    AgenticState,
    ToolCall,
    reference_script,
    scripted_ids,
    state_tokens,
)
from rlbus.model.env.base import state_context
from rlbus.model.policies.hf import HFPolicy
from rlbus.model.policies.hf_chat import DEFAULT_CHAT_TEMPLATE, HFChatTokenizer
from rlbus.model.policies.hf_recipe import train_bpe_tokenizer
from rlbus.model.tasks.repo import RepoTask, repo_task
from rlbus.model.tools.calls import TOOL_SCHEMAS, TOOLS, parse_turn, tools_text
from rlbus.model.tools.template import TemplateTools

pytestmark = pytest.mark.anyio

QWEN_TOOLS: Final = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's kind: the schemas in the system turn as a <tools> block, Hermes calls, a run of tool results in one
user turn of <tool_response> blocks."""

LLAMA_TOOLS: Final = (
    "{{- bos_token }}"
    "{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{%- if tools is not none and not tools_in_user_message %}"
    "{{- 'You have access to the following functions. To call a function, please respond with JSON for a function "
    "call. Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}. Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{%- endif %}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools_in_user_message and tools is not none %}"
    "{%- set first_user_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON "
    "for a function call with its proper arguments that best answers the given prompt.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{{- '{\"name\": \"' + tool_call.name + '\", \"parameters\": ' }}{{- tool_call.arguments | tojson }}{{- '}' }}"
    "{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama-3.1's kind: bos and a system turn that holds the schemas (indented JSON) when told
`tools_in_user_message=False` (else the first user turn does), a call as the whole assistant turn, each tool
result its own `ipython` turn, a string result rendered as JSON (a string is iterable to Jinja)."""

TEMPLATES: Final = {"qwen": QWEN_TOOLS, "llama": LLAMA_TOOLS}
LLAMA_SPECIALS: Final = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                         "<|python_tag|>"]


def _tokenizer(template: str) -> HFChatTokenizer:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=train_bpe_tokenizer(TEXTS, 400), eos_token="<|endoftext|>",
                                   pad_token="<|pad|>", bos_token="<|begin_of_text|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>", *LLAMA_SPECIALS],
                                   chat_template=template, clean_up_tokenization_spaces=False)
    return HFChatTokenizer(fast, name="test", template_source="test template")


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, HFChatTokenizer]:
    return {name: _tokenizer(template) for name, template in TEMPLATES.items()}


TASK: Final = repo_task(2, 1)


def _render(tok: HFChatTokenizer, messages: list[dict[str, Any]], *, generation: bool = False) -> str:
    return str(tok.hf.apply_chat_template(messages, tools=list(TOOL_SCHEMAS), tools_in_user_message=False,
                                          tokenize=False, add_generation_prompt=generation))


def _text(env: AgenticEnvironment, ids: list[int]) -> str:
    return env.tokenizer.decode(ids, specials=True)  # type: ignore[call-arg]


@pytest.mark.parametrize(("which", "style"), [("qwen", "hermes"), ("llama", "llama")])
def test_the_system_turn_holds_the_schemas_as_the_template_renders_them(
        tokenizers: dict[str, HFChatTokenizer], which: str, style: str) -> None:
    """The task's context is what the template renders for its user turn given the tool schemas: they are in the
    system turn (not in the user turn, which only lists the files), and the call style is recognised."""
    tok = tokenizers[which]
    env = AgenticEnvironment(tok)
    assert env.templated == "" and env.call_style == style and isinstance(env.tokenizer, TemplateTools)
    state = env.start(TASK)
    user = env.render(TASK)
    assert "<tools>" not in user and "submit" in user and "read_file" not in user
    expected = _render(tok, [{"role": "user", "content": user}], generation=True)
    assert _text(env, state_context(state, env.tokenizer)) == expected
    system = _text(env, env.tokenizer.bos())
    assert system == expected[: expected.index(user)].removesuffix(_text(env, tok.header("user")))
    for schema in TOOL_SCHEMAS:
        assert (json.dumps(schema, indent=4) if which == "llama" else json.dumps(schema)) in system


async def test_a_template_without_tools_keeps_the_tool_list_in_the_user_turn(
        tokenizers: dict[str, HFChatTokenizer]) -> None:
    """ChatML renders nothing of the tools it is given: the tool list stays in the user turn, calls are Hermes ones
    and results come back as <tool_response> blocks in the template's user turn, as before."""
    from transformers import PreTrainedTokenizerFast

    chatml = PreTrainedTokenizerFast(tokenizer_object=train_bpe_tokenizer(TEXTS, 400), eos_token="<|endoftext|>",
                                     additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                     chat_template=DEFAULT_CHAT_TEMPLATE)
    tok = HFChatTokenizer(chatml, name="chatml", template_source="chatml")
    env = AgenticEnvironment(tok)
    assert "renders nothing of the tools" in env.templated and env.tokenizer is tok and env.call_style == "hermes"
    assert tools_text() in env.render(TASK)
    port = FakeWorkspace(TASK)
    out = await env.step(env.start(TASK), [*tok.encode(ToolCall("list_files").text()), tok.stop_id], port)
    assert out.observation is not None and port.calls == [("list_files", {"path": "."})]
    listing = "\n".join(sorted(TASK.files))
    assert tok.decode(out.observation.ids) == f"<tool_response>\n{listing}\n</tool_response>"
    assert AgenticEnvironment(tokenizers["qwen"], tool_list="compact").templated == "the tool list is compact"


def test_a_template_that_puts_the_tools_in_the_user_turn_keeps_the_tool_list_there(
        tokenizers: dict[str, HFChatTokenizer]) -> None:
    """A Llama-kind template that always renders the tools into the first user turn (not the system turn) is not
    used for them, saying so: the user turn lists the tools as before, and calls are Hermes ones."""
    fixed = LLAMA_TOOLS.replace("{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true "
                                "%}{%- endif %}", "{%- set tools_in_user_message = true %}")
    assert fixed != LLAMA_TOOLS
    tok = _tokenizer(fixed)
    env = AgenticEnvironment(tok)
    assert "elsewhere than before the first user turn" in env.templated and env.call_style == "hermes"
    assert tools_text() in env.render(TASK) and env.tokenizer is tok
    assert AgenticEnvironment(tokenizers["llama"]).templated == ""


async def _play(env: AgenticEnvironment, task: RepoTask, script: tuple[str, ...]) -> tuple[AgenticState, FakeWorkspace]:
    port, state = FakeWorkspace(task), env.start(task)
    for _ in range(20):
        state = (await env.step(state, scripted_ids(script, state, env.tokenizer), port)).state
        if state.done:
            return state, port
    raise AssertionError("the script never ended the episode")


@pytest.mark.parametrize("which", ["qwen", "llama"])
async def test_calls_in_the_templates_style_are_parsed_and_run(tokenizers: dict[str, HFChatTokenizer],
                                                               which: str) -> None:
    """The reference edit written in the template's call style (Hermes blocks after some thinking aloud, or a
    Llama JSON turn) runs call by call and its submit earns 1.0."""
    env = AgenticEnvironment(tokenizers[which])
    script = reference_script(TASK)
    first = env.tokenizer.decode(scripted_ids(script, env.start(TASK), env.tokenizer))
    assert first.startswith("I will change" if which == "qwen" else '{"name": ')
    solved, port = await _play(env, TASK, script)
    assert (solved.reward, solved.ended, solved.calls) == (1.0, "submit", TASK.reference)
    assert [(n, a) for n, a in port.calls] == [(c.name, c.arguments) for c in TASK.reference]


async def test_a_llama_call_after_the_python_tag_is_run(tokenizers: dict[str, HFChatTokenizer]) -> None:
    """A Llama turn that opens with `<|python_tag|>` (the special token, or its text) is the call after it."""
    env = AgenticEnvironment(tokenizers["llama"])
    tok = env.tokenizer
    path = sorted(TASK.files)[0]
    call = ToolCall("read_file", {"path": path}).text("llama")
    for ids in (tok.hf(f"<|python_tag|>{call}", add_special_tokens=False).input_ids,  # type: ignore[attr-defined]
                tok.encode(f"<|python_tag|>{call}")):
        port = FakeWorkspace(TASK)
        out = await env.step(env.start(TASK), [*ids, tok.stop_id], port)
        assert port.calls == [("read_file", {"path": path})] and out.state.calls == (ToolCall("read_file", {
            "path": path}),)


@pytest.mark.parametrize("which", ["qwen", "llama"])
async def test_tool_results_are_framed_in_the_tool_role(tokenizers: dict[str, HFChatTokenizer], which: str) -> None:
    """After a turn of calls, the context is what the template renders for the conversation with the turn as the
    assistant's message and each result as a `tool` message (Qwen: <tool_response> blocks in one user turn; Llama:
    `ipython` turns, each result a JSON string)."""
    env = AgenticEnvironment(tokenizers[which])
    tok = env.tokenizer
    paths = sorted(TASK.files)[:2]
    calls = [ToolCall("read_file", {"path": p}) for p in paths]
    turn = "".join(c.text() for c in calls) if which == "qwen" else calls[0].text("llama")
    port = FakeWorkspace(TASK)
    state = env.start(TASK)
    out = await env.step(state, [*tok.encode(turn), tok.stop_id], port)
    results = [TASK.files[p] for p in (paths if which == "qwen" else paths[:1])]
    assert out.observation is not None and len(port.calls) == len(results)
    expected = _render(tokenizers[which], [{"role": "user", "content": env.render(TASK)},
                                           {"role": "assistant", "content": turn},
                                           *({"role": "tool", "content": r} for r in results)], generation=True)
    context = _text(env, state_context(out.state, tok))
    assert context == expected
    framed = _text(env, [*tok.header("observation"), *out.observation.ids, *tok.closing()])
    if which == "qwen":
        assert framed.startswith("<|im_start|>user\n<tool_response>\n") and framed.count("<tool_response>") == 2
    else:
        assert framed == f"<|start_header_id|>ipython<|end_header_id|>\n\n{json.dumps(results[0])}<|eot_id|>"


@pytest.mark.parametrize("which", ["qwen", "llama"])
async def test_loss_mask_covers_exactly_the_policy_turns_with_template_tools(
        tokenizers: dict[str, HFChatTokenizer], which: str) -> None:
    """With the schemas in the system turn and results in the tool role, mask 1 exactly on the ids of the assistant
    turns: the system turn, the task, tool results, reminders and framing are 0."""
    env = AgenticEnvironment(tokenizers[which])
    tok = env.tokenizer
    style = env.call_style
    port, state = FakeWorkspace(TASK), env.start(TASK)
    sampled: list[list[int]] = []
    for text in ("thinking", ToolCall("read_file", {"path": sorted(TASK.files)[0]}).text(style), '{"name": "x"'):
        ids = [*tok.encode(text), tok.stop_id]
        sampled.append(ids)
        state = (await env.step(state, ids, port)).state
    flat = state_tokens(state, tok)
    assert [t.role for t in state.turns] == ["user", *["assistant", "observation"] * 3]
    assert flat.ids[: len(tok.bos())] == tok.bos() and not any(flat.loss_mask[: len(tok.bos())])
    assert [i for i, m in zip(flat.ids, flat.loss_mask, strict=True) if m] == [i for ids in sampled for i in ids]
    for index, t in enumerate(state.turns):
        turn_mask = [m for m, k in zip(flat.loss_mask, flat.turn, strict=True) if k == index]
        assert any(turn_mask) == (t.role == "assistant")


@pytest.mark.parametrize(("which", "turn", "why"), [
    ("qwen", '<tool_call>\n{"name": "read_file", "arguments": {"path": \n</tool_call>', "not valid JSON"),
    ("qwen", '<tool_call>{"name": "list_files"', "without its </tool_call>"),
    ("llama", 'I will list them. {"name": "list_files", "parameters": {}}', "with no text before it"),
    ("llama", '{"name": "list_files", "parameters": {}}; {"name": "submit", "parameters": {}}', "no text after it"),
    ("llama", '{"name": "list_files", "parameters": {"path": ', "not valid JSON"),
    ("llama", '{"name": "rm_rf", "parameters": {}}', "unknown tool 'rm_rf'"),
    ("llama", '{"tool": "list_files"}', 'a tool call is a JSON object {"name": ..., "parameters": {...}}'),
])
async def test_an_unparseable_call_is_answered_saying_why(tokenizers: dict[str, HFChatTokenizer], which: str,
                                                          turn: str, why: str) -> None:
    """A call the template's style cannot parse runs nothing; its observation, in the tool role, says why."""
    env = AgenticEnvironment(tokenizers[which])
    tok = env.tokenizer
    port = FakeWorkspace(TASK)
    out = await env.step(env.start(TASK), [*tok.encode(turn), tok.stop_id], port)
    assert port.calls == [] and out.observation is not None and not out.state.done and out.state.tool_calls == 1
    shown = _text(env, [*tok.header("observation"), *out.observation.ids])
    assert shown.startswith(_text(env, tok.header("observation")))
    said = tok.decode(out.observation.ids)
    assert why in (json.loads(said) if which == "llama" else said) and "error: " in said


@pytest.mark.parametrize("which", ["qwen", "llama"])
async def test_a_turn_without_a_call_is_reminded_in_the_templates_style(tokenizers: dict[str, HFChatTokenizer],
                                                                        which: str) -> None:
    """A turn with no call is answered, in the tool role, with how this template's style calls a tool."""
    env = AgenticEnvironment(tokenizers[which])
    tok = env.tokenizer
    out = await env.step(env.start(TASK), [*tok.encode("I think the bug is in core."), tok.stop_id],
                         FakeWorkspace(TASK))
    assert out.observation is not None
    said = tok.decode(out.observation.ids)
    said = json.loads(said) if which == "llama" else said  # Llama's template shows a result as a JSON string
    assert ("<tool_call>" in said) == (which == "qwen") and ('"parameters"' in said) == (which == "llama")


def test_parse_turn_reads_each_style_only() -> None:
    """The same call in each style parses only in its own: a Hermes block is no Llama call, a Llama turn no Hermes
    block; the Llama parser takes `arguments` too, and arguments as a JSON string."""
    call = ToolCall("search", {"pattern": "def", "path": "."})
    assert parse_turn(call.text()) == [call] == parse_turn(call.text("llama"), "llama")
    assert parse_turn(call.text("llama")) == []
    [bad] = parse_turn(call.text(), "llama")
    assert "no text before it" in bad.problem  # type: ignore[union-attr]
    assert parse_turn('{"name": "search", "arguments": "{\\"pattern\\": \\"def\\"}"}', "llama") == [call]
    assert {s["function"]["name"] for s in TOOL_SCHEMAS} == set(TOOLS)


async def test_the_recipes_template_renders_tools_as_qwen25s_kind_and_its_calls_parse(tmp_path: Path) -> None:
    """A recipe directory's template renders a tool conversation exactly as the Qwen2.5-kind template above (same
    default system turn), so the agentic environment puts the schemas in its system turn; its saved
    `response_template` makes a plain AutoTokenizer (and TRL's GRPOTrainer, which then keeps it) parse a Hermes call;
    TRL finds the template tool-capable and prefix-preserving, so it trains on the template as it is."""
    from transformers import AutoTokenizer

    trl_templates = pytest.importorskip("trl.chat_template_utils")
    path = build_family(tmp_path, "qwen2-tied")
    hf = AutoTokenizer.from_pretrained(path)
    qwen = _tokenizer(QWEN_TOOLS).hf
    call = {"type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}
    conversation = [{"role": "user", "content": "fix it"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}]
    for tools in (list(TOOL_SCHEMAS), None):
        assert hf.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True) == (
            qwen.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True))
    env = AgenticEnvironment(HFPolicy.load(path).tokenizer)
    assert env.templated == "" and env.call_style == "hermes" and "<tools>" not in env.render(TASK)
    solved, _ = await _play(env, TASK, reference_script(TASK))
    assert (solved.reward, solved.calls) == (1.0, TASK.reference)
    prompt = hf.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True)
    said = ToolCall("read_file", {"path": "a.py"}).text()
    assert hf.parse_response(f"I will read it.\n{said}<|im_end|>", prefix=prompt) == {
        "role": "assistant", "content": "I will read it.", "tool_calls": [call]}
    assert trl_templates.supports_tool_calling(hf) and trl_templates.is_chat_template_prefix_preserving(hf)
