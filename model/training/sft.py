"""Supervised fine-tuning of a policy on conversations, framed exactly as the agentic generator frames its turns.

- Owns: reading and checking an SFT file (`read_conversations`: one JSON conversation a line, in the chat format
  Hugging Face templates take), rendering a conversation into ids and a loss mask (`render`), and the training
  loop (`sft`) with its summary, loss log and output directory.
- Guarantee: a conversation renders to the ids and mask the agentic environment builds for the same turns
  (model/env/episodes.py `turns_tokens`, model/tools/template.py for a template that renders tools); the loss
  falls on the policy's own tokens only (assistant content and tool calls, with the stop id that closes them).
  Every line is checked before any training starts. Deterministic given the seed and thread count.
- Does not: own the framing (model/policies/interface.py, model/policies/hf_chat.py), the tool-call text
  (model/tools/calls.py), the environment (model/env/agentic.py) or the CLI (ops/sft.py).

How messages map onto the environment's turns (model/env/agentic.py builds them from the same functions): a leading
`system` message is folded into the first user turn (its text, a blank line, the user's; the environment has no
system turn besides the template's tool schemas); the first `user` message is the task, or the task and a summary
(`fresh_context`), after the tool list where the template does not render the tools (`with_tool_list`: the
environment's `tools_text()`, or `COMPACT_TOOLS` for a compact list; a first message that already starts with it
is kept as it is); a later `user` message is an observation, except `SUMMARY_REQUEST` (the environment's user
turn asking for a summary) and any where the template renders tools (the template's user role); an `assistant`
message is a policy turn, its content then each call in the template's call style (`ToolCall.text`, one a line),
closed by the stop id (a Llama-style template takes one call a turn: a message of several calls is that many
turns, each answered by its tool message); a run of `tool` messages is one observation, laid out and cut to
`observation_tokens` as the environment lays out and cuts a turn's results (`observation_ids`). A conversation
with `tools`, `tool_calls` or `tool` messages is framed with the tool schemas where the template renders them (the
row's `tools`, else `TOOL_SCHEMAS`); one without is framed as the function-writing environment frames its episodes.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import structlog
import torch

from rlbus.messages.errors import RlbusError
from rlbus.model.env.agentic import (
    COMPACT_TOOLS,
    AgenticBudgets,
    compact_tool_list,
    observation_ids,
    with_tool_list,
)
from rlbus.model.env.episodes import EpisodeTokens, Turn, turns_tokens
from rlbus.model.env.summaries import SUMMARY_REQUEST
from rlbus.model.policies.interface import ChatTokenizer, Policy, resolve_device
from rlbus.model.tools.calls import TOOL_SCHEMAS, ToolCall, tools_text
from rlbus.model.tools.template import TemplateTools, template_tools

__all__ = ["SFT_LOG", "SFT_SUMMARY", "Conversation", "SFTConfig", "SFTError", "SFTResult", "read_conversations",
           "render", "sft"]

log = structlog.get_logger()

SFT_SUMMARY: Final = "sft.json"
SFT_LOG: Final = "sft_loss.jsonl"
"""The loss log: one JSON object a step (step, loss, lr)."""
ROLES: Final = ("system", "user", "assistant", "tool")
ROW_KEYS: Final = ("messages", "tools", "task_id", "meta")
MESSAGE_KEYS: Final[dict[str, tuple[str, ...]]] = {
    "system": ("role", "content"), "user": ("role", "content"),
    "assistant": ("role", "content", "tool_calls"), "tool": ("role", "content", "name")}
OBSERVATION_TOKENS: Final = AgenticBudgets().observation_tokens
"""`[generator.agentic] observation_tokens`' default: an observation turn's most tokens."""
ToolList = Literal["full", "compact"]
ToolSetting = Literal["auto", "full", "compact"]


class SFTError(RlbusError, ValueError):
    """An SFT file that cannot be trained on: the message names the file, the line and the key."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """One checked line of an SFT file: its messages (each a dict as read), tool schemas, id and where it came
    from (`source:line`, for errors found while rendering)."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    task_id: str
    source: str

    @property
    def uses_tools(self) -> bool:
        return self.tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in self.messages)


def _check_message(m: Any, where: str, index: int, previous: str | None) -> None:
    key = f"messages[{index}]"
    if not isinstance(m, dict):
        raise SFTError(f"{where}: {key}: expected an object with role and content, got {type(m).__name__}")
    role = m.get("role")
    if "role" not in m:
        raise SFTError(f"{where}: {key}.role: missing; expected one of {', '.join(ROLES)}")
    if role not in ROLES:
        raise SFTError(f"{where}: {key}.role: expected one of {', '.join(ROLES)}, got {role!r}")
    allowed = MESSAGE_KEYS[role]
    for extra in m:
        if extra not in allowed:
            owner = next((r for r, keys in MESSAGE_KEYS.items() if extra in keys), "")
            why = f"only a {owner} message has it" if owner else f"a {role} message has {', '.join(allowed)}"
            raise SFTError(f"{where}: {key}.{extra}: not a key of a {role} message ({why})")
    if "content" not in m:
        raise SFTError(f"{where}: {key}.content: missing; expected a string")
    calls = m.get("tool_calls")
    if not isinstance(m["content"], str) and not (m["content"] is None and calls):
        raise SFTError(f"{where}: {key}.content: expected a string, got {type(m['content']).__name__}")
    if role == "tool" and "name" in m and not isinstance(m["name"], str):
        raise SFTError(f"{where}: {key}.name: expected a string, got {type(m['name']).__name__}")
    if "tool_calls" in m:
        if not isinstance(calls, list):
            raise SFTError(f"{where}: {key}.tool_calls: expected a list, got {type(calls).__name__}")
        for k, call in enumerate(calls):
            ck = f"{key}.tool_calls[{k}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise SFTError(f"{where}: {ck}.function: expected an object with name and arguments")
            if call.get("type", "function") != "function" or set(call) - {"type", "function", "id"}:
                raise SFTError(f"{where}: {ck}: expected {{\"type\": \"function\", \"function\": {{...}}}}")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise SFTError(f"{where}: {ck}.function.name: expected a tool name (a string)")
            if not isinstance(fn.get("arguments", {}), dict):
                raise SFTError(f"{where}: {ck}.function.arguments: expected an object, got "
                               f"{type(fn['arguments']).__name__}")
    if role == "system" and index != 0:
        raise SFTError(f"{where}: {key}.role: a system message must be the first message")
    if role == "tool" and previous not in ("assistant", "tool"):
        raise SFTError(f"{where}: {key}.role: a tool message must follow an assistant or tool message")
    if role != "system" and previous in (None, "system") and role != "user":
        raise SFTError(f"{where}: {key}.role: the first message (after a system one) must be a user message, got "
                       f"{role!r}")


def _check_row(row: Any, where: str) -> Conversation:
    if not isinstance(row, dict):
        raise SFTError(f"{where}: expected a JSON object with messages, got {type(row).__name__}")
    for key in row:
        if key not in ROW_KEYS:
            raise SFTError(f"{where}: {key}: not a key of a conversation (expected {', '.join(ROW_KEYS)})")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        what = "missing" if "messages" not in row else f"got {type(messages).__name__}" if not isinstance(
            messages, list) else "empty"
        raise SFTError(f"{where}: messages: {what}; expected a non-empty list of messages")
    previous: str | None = None
    for index, m in enumerate(messages):
        _check_message(m, where, index, previous)
        previous = m["role"]
    if not any(m["role"] == "assistant" for m in messages):
        raise SFTError(f"{where}: messages: no assistant message; nothing to train on")
    tools = row.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise SFTError(f"{where}: tools: expected a list of JSON schemas (objects)")
    if not isinstance(row.get("task_id", ""), str):
        raise SFTError(f"{where}: task_id: expected a string")
    if not isinstance(row.get("meta", {}), dict):
        raise SFTError(f"{where}: meta: expected an object")
    return Conversation(tuple(messages), tuple(tools) if tools is not None else None, row.get("task_id", ""), where)


def read_conversations(path: Path) -> list[Conversation]:
    """Every conversation of the JSONL file `path` (blank lines skipped), each line checked.

    :raises SFTError: no such file, no conversation in it, or the first bad line, as `FILE:LINE: KEY: what`.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SFTError(f"{path}: cannot read ({type(err).__name__}: {err}); expected a JSONL file of "
                       f"conversations") from None
    out: list[Conversation] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise SFTError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
        out.append(_check_row(row, where))
    if not out:
        raise SFTError(f"{path}: no conversation; expected one JSON object with messages a line")
    return out


def framing(conversation: Conversation, tokenizer: ChatTokenizer, tool_list: ToolList = "full"
            ) -> ChatTokenizer:
    """The tokenizer view the environment frames this conversation with: the template's tool framing of the row's
    `tools` (else `TOOL_SCHEMAS`) when the conversation uses tools, the list is "full" and the template renders
    them, else `tokenizer` itself."""
    if tool_list != "full" or not conversation.uses_tools:
        return tokenizer
    base = tokenizer.base if isinstance(tokenizer, TemplateTools) else tokenizer
    if conversation.tools is None or list(conversation.tools) == list(TOOL_SCHEMAS):
        view = template_tools(base)
        return view if isinstance(view, TemplateTools) else base
    from rlbus.model.policies.hf_chat import HFChatTokenizer

    if not isinstance(base, HFChatTokenizer):
        return base
    frame = base.tool_framing(conversation.tools)
    return base if isinstance(frame, str) else TemplateTools(base, frame)


def tool_list_text(conversation: Conversation, tok: ChatTokenizer, tool_list: ToolList = "full") -> str:
    """The tool list the environment's first user turn starts with for this conversation and view `tok`
    (`AgenticEnvironment.tool_list_text`): none when the conversation uses no tools or the template renders them,
    `COMPACT_TOOLS` for a compact list, else `tools_text()` (the environment's tools; a row's other tools are listed
    only where the template renders them)."""
    if not conversation.uses_tools or isinstance(tok, TemplateTools):
        return ""
    if tool_list == "compact":
        return COMPACT_TOOLS
    return tools_text() if conversation.tools is None or list(conversation.tools) == list(TOOL_SCHEMAS) else ""


def _assistant_texts(m: dict[str, Any], tok: ChatTokenizer) -> list[str]:
    """The policy turns of an assistant message: its content then each call, in the view's call style; a Llama-style
    template takes one call a turn (its whole turn), so a message of k calls is k turns."""
    calls = [ToolCall(c["function"]["name"], dict(c["function"].get("arguments", {}))) for c in m.get("tool_calls") or ()]
    content = m["content"] or ""
    if isinstance(tok, TemplateTools) and tok.style == "llama" and calls:
        return [c.text("llama") for c in calls]
    style = tok.style if isinstance(tok, TemplateTools) else "hermes"
    return ["\n".join([*([content] if content else []), *(c.text(style) for c in calls)])]


def turns_of(conversation: Conversation, tok: ChatTokenizer, tool_list: ToolList = "full",
             observation_tokens: int = OBSERVATION_TOKENS) -> list[Turn]:
    """The conversation as the environment's turns, for the tokenizer view `tok` (`framing`).

    :raises SFTError: a Llama-style message of several calls not answered by one tool message each.
    """
    templated = isinstance(tok, TemplateTools)
    tools = tool_list_text(conversation, tok, tool_list)
    messages = list(conversation.messages)
    system = ""
    if messages[0]["role"] == "system":
        system = messages.pop(0)["content"] or ""
    turns: list[Turn] = []
    results: list[str] = []
    split: list[str] = []      # a Llama-style message's calls after the first, each a turn after the last's result

    def flush() -> None:
        if results:
            turns.append(Turn("observation", observation_ids(tok, results, observation_tokens, templated=templated)))
            results.clear()

    for index, m in enumerate(messages):
        role, content = m["role"], m["content"] or ""
        if role != "tool":
            flush()
            if split:
                raise SFTError(f"{conversation.source}: messages[{index + bool(system)}]: {len(split)} of a turn's "
                               f"calls have no tool message; this template's call style (Llama-3.1 JSON) answers "
                               f"each call before the next")
        if role == "tool":
            results.append(content)
            if split:
                flush()
                turns.append(Turn("assistant", (*tok.encode(split.pop(0)), tok.stop_id)))
        elif role == "assistant":
            first, *split = _assistant_texts(m, tok)
            turns.append(Turn("assistant", (*tok.encode(first), tok.stop_id)))
        elif not turns:
            text = f"{system}\n\n{content}" if system else content
            turns.append(Turn("user", tuple(tok.encode(text if text.startswith(tools) else with_tool_list(text, tools)))))
        else:
            turns.append(Turn("user" if templated or content == SUMMARY_REQUEST else "observation",
                              tuple(tok.encode(content))))
    flush()
    if split:
        raise SFTError(f"{conversation.source}: messages: the last turn's calls after the first have no tool message; "
                       f"this template's call style (Llama-3.1 JSON) answers each call before the next")
    return turns


def render(conversation: Conversation, tokenizer: ChatTokenizer, tool_list: ToolList = "full",
           observation_tokens: int = OBSERVATION_TOKENS) -> EpisodeTokens:
    """The conversation's ids and loss mask, as `turns_tokens` lays out the environment's turns (`turns_of`) for
    `[generator.agentic]` `tool_list` ("full" or "compact") and `observation_tokens`."""
    tok = framing(conversation, tokenizer, tool_list)
    return turns_tokens(turns_of(conversation, tok, tool_list, observation_tokens), tok)


@dataclass(frozen=True)
class SFTConfig:
    """The schedule of a fine-tuning run: AdamW at `lr` after a linear warmup, cosine to `lr * min_lr_ratio`."""

    steps: int = 100
    lr: float = 1e-4
    batch_size: int = 8
    warmup_steps: int = 5
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    tool_list: ToolSetting = "auto"
    """How the generator lists the tools (`[generator.agentic] tool_list`): "compact" never uses template tools,
    "auto" is "compact" for a policy whose context is under 4096 tokens (model/env/agentic.py
    `compact_tool_list`), else "full"."""
    observation_tokens: int = OBSERVATION_TOKENS
    """`[generator.agentic] observation_tokens`: an observation turn past it is cut, saying so, as the environment
    cuts it."""


@dataclass(frozen=True, slots=True)
class SFTResult:
    """What a run did: steps, first and final (mean of the last 10) losses, the learning rate of each step, the
    conversations trained on, cut at the context and left out, trained tokens, seconds, and the trained policy (in
    eval mode)."""

    steps: int
    first_loss: float
    final_loss: float
    losses: list[float]
    lrs: list[float]
    conversations: int
    truncated: int
    skipped: int
    """Conversations left out: no assistant token within the context."""
    trained_tokens: int
    train_s: float
    policy: Policy


def rendered(conversations: Sequence[Conversation], tokenizer: ChatTokenizer, limit: int, tool_list: ToolSetting,
             observation_tokens: int = OBSERVATION_TOKENS) -> tuple[list[tuple[list[int], list[int]]], int, int]:
    """Each conversation's (ids, mask) cut to `limit` tokens, how many were cut, and how many were left out for
    having no assistant token within `limit`; every one rendered (and so checked) before any training. `tool_list`
    "auto" is resolved for a policy of `limit - 1` tokens, as the generator resolves it.

    :raises SFTError: one `turns_of` refuses, or no conversation has an assistant token within `limit`.
    """
    out: list[tuple[list[int], list[int]]] = []
    cut = skipped = 0
    listing: ToolList = "full" if tool_list == "full" or not compact_tool_list(tool_list, limit - 1) else "compact"
    for c in conversations:
        flat = render(c, tokenizer, listing, observation_tokens)
        if len(flat.ids) > limit:
            cut += 1
        ids, mask = flat.ids[:limit], flat.loss_mask[:limit]
        if not any(mask[1:]):
            skipped += 1
            continue
        out.append((ids, mask))
    if not out:
        first = conversations[0].source.rsplit(":", 1)[0] if conversations else "the data"
        raise SFTError(f"{first}: no conversation has an assistant token within the policy's context of "
                       f"{limit - 1} tokens; use a policy with a longer context or shorter conversations")
    return out, cut, skipped


def sft(policy: Policy, conversations: Sequence[Conversation], config: SFTConfig, *, seed: int, threads: int,
        progress: Callable[[Any], None] | None = None, device: str = "cpu", start_step: int = 0) -> SFTResult:
    """Fine-tune `policy` in place on `conversations` for `config.steps` optimizer steps; each step a batch of
    conversations drawn in a seeded shuffled order (reshuffled each pass). The loss is the mean cross-entropy over
    the masked (policy) tokens of the batch. Progress goes to `progress` as `PretrainProgress` ("train" each step,
    counted from `start_step`).

    :raises SFTError: a conversation that cannot be rendered (`rendered`), before any step.
    :raises ValueError: steps, batch size or threads below 1.
    """
    from rlbus.model.training.pretrain import PretrainProgress, adamw, lr_at, weighted_ce_step

    if config.steps < 1 or config.batch_size < 1 or threads < 1 or not config.lr > 0:
        raise ValueError(f"steps ({config.steps}), batch size ({config.batch_size}) and threads ({threads}) must be "
                         f">= 1 and lr ({config.lr}) > 0")
    report = progress or (lambda _: None)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    policy.to_(device=resolve_device(device), dtype=torch.float32)
    tokenizer = policy.tokenizer
    data, truncated, skipped = rendered(conversations, tokenizer, policy.max_seq_len + 1, config.tool_list,
                                        config.observation_tokens)
    module = policy.module
    optimizer = adamw(module, config.lr, config.weight_decay)
    rng = random.Random(f"rlbus-sft:{seed}")
    order: list[int] = []
    losses: list[float] = []
    lrs: list[float] = []
    trained = 0
    start = time.monotonic()
    policy.train()
    for step in range(config.steps):
        batch = []
        for _ in range(min(config.batch_size, len(data))):
            if not order:
                order = list(range(len(data)))
                rng.shuffle(order)
            batch.append(data[order.pop()])
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_id, dtype=torch.long)
        weights = torch.zeros((len(batch), width))
        for r, (row, mask) in enumerate(batch):
            ids[r, : len(row)] = torch.tensor(row)
            weights[r, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
        inputs, targets, w = ids[:, :-1].to(policy.device), ids[:, 1:].to(policy.device), weights[:, 1:].to(
            policy.device)
        lr = lr_at(step, config.steps, config.lr, config.warmup_steps, config.min_lr_ratio)
        losses.append(weighted_ce_step(policy, optimizer, inputs, targets, w, lr, config.grad_clip))
        lrs.append(lr)
        trained += int(w.sum())
        elapsed = time.monotonic() - start
        report(PretrainProgress("train", start_step + step + 1, start_step + config.steps, elapsed, losses[-1], lr,
                                trained / elapsed))
    policy.eval()
    train_s = time.monotonic() - start
    final = sum(losses[-10:]) / len(losses[-10:])
    log.info("sft_trained", steps=config.steps, first_loss=losses[0], final_loss=final, seconds=round(train_s, 1))
    return SFTResult(config.steps, losses[0], final, losses, lrs, len(data), truncated, skipped, trained, train_s, policy)


def save(out_dir: Path, policy: Policy, result: SFTResult, summary: dict[str, Any]) -> Path:
    """Write the fine-tuned policy to `out_dir` in its input's format (a built-in `pretrain.pt`, or a Hugging Face
    model directory replaced atomically), with `sft.json` (`summary` and the losses), `loss.png` and the loss log
    `sft_loss.jsonl`. Returns the checkpoint (the `pretrain.pt`, or the folder)."""
    from rlbus.model.policies.builtin import BuiltinPolicy
    from rlbus.model.training.pretrain import (
        CHECKPOINT_NAME,
        LOSS_PLOT,
        PretrainConfig,
        _save,
        _save_hf,
        plot_losses,
    )

    document = {**summary, "steps": result.steps, "first_loss": result.first_loss, "final_loss": result.final_loss,
                "conversations": result.conversations, "truncated": result.truncated, "skipped": result.skipped,
                "trained_tokens": result.trained_tokens, "train_s": round(result.train_s, 2),
                "losses": result.losses}
    if isinstance(policy, BuiltinPolicy):
        out_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = out_dir / CHECKPOINT_NAME
        _save(checkpoint, policy.transformer, PretrainConfig(model=policy.config),
              {"seed": summary.get("seed", 0), "step": result.steps, "final": True, "sft": True})
        (out_dir / SFT_SUMMARY).write_text(json.dumps(document, indent=2) + "\n")
        plot_losses(out_dir / LOSS_PLOT, result.losses)
    else:
        checkpoint = out_dir
        _save_hf(out_dir, policy, document, SFT_SUMMARY)
    lines = (json.dumps({"step": k + 1, "loss": loss, "lr": lr})
             for k, (loss, lr) in enumerate(zip(result.losses, result.lrs, strict=True)))
    (out_dir / SFT_LOG).write_text("".join(f"{line}\n" for line in lines))
    return checkpoint
