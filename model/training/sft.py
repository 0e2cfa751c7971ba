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

How messages map onto the environment's turns: a leading `system` message is folded into the first user turn
(its text, a blank line, the user's; the environment has no system turn besides the template's tool schemas); the
first `user` message is the task; a later `user` message is an observation (the template's user role where the
template renders tools); an `assistant` message is a policy turn, its content then each call in the template's
call style (`ToolCall.text`, one a line), closed by the stop id; a run of `tool` messages is one observation, laid
out as the environment lays out a turn's results. A conversation with `tools`, `tool_calls` or `tool` messages is
framed with the tool schemas where the template renders them (the row's `tools`, else `TOOL_SCHEMAS`); one
without is framed as the function-writing environment frames its episodes.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import structlog
import torch
import torch.nn.functional as F

from rlbus.messages.errors import RlbusError
from rlbus.model.env.episodes import EpisodeTokens, Turn, turns_tokens
from rlbus.model.policies.interface import ChatTokenizer, Policy, resolve_device
from rlbus.model.tools.calls import TOOL_SCHEMAS, ToolCall, response_text
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
NO_LIMIT: Final = 1 << 30
ToolList = Literal["full", "compact"]


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
    `tools` (else `TOOL_SCHEMAS`) when the conversation uses tools and the template renders them, else
    `tokenizer` itself."""
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


def _assistant_text(m: dict[str, Any], tok: ChatTokenizer, where: str) -> str:
    calls = [ToolCall(c["function"]["name"], dict(c["function"].get("arguments", {}))) for c in m.get("tool_calls") or ()]
    content = m["content"] or ""
    if isinstance(tok, TemplateTools) and tok.style == "llama" and calls:
        if len(calls) > 1:
            raise SFTError(f"{where}: tool_calls: {len(calls)} calls in one turn; this template's call style "
                           f"(Llama-3.1 JSON) takes one call a turn")
        return calls[0].text("llama")
    style = tok.style if isinstance(tok, TemplateTools) else "hermes"
    return "\n".join([*([content] if content else []), *(c.text(style) for c in calls)])


def turns_of(conversation: Conversation, tok: ChatTokenizer) -> list[Turn]:
    """The conversation as the environment's turns, for the tokenizer view `tok` (`framing`).

    :raises SFTError: a turn this template cannot frame (several calls in a Llama-style turn).
    """
    templated = isinstance(tok, TemplateTools)
    messages = list(conversation.messages)
    system = ""
    if messages[0]["role"] == "system":
        system = messages.pop(0)["content"] or ""
    turns: list[Turn] = []
    results: list[str] = []

    def flush() -> None:
        if results:
            ids = tok.results_ids(results, NO_LIMIT) if isinstance(tok, TemplateTools) else tok.encode(
                response_text(results))
            turns.append(Turn("observation", tuple(ids)))
            results.clear()

    for index, m in enumerate(messages):
        role, content = m["role"], m["content"] or ""
        if role != "tool":
            flush()
        if role == "tool":
            results.append(content)
        elif role == "assistant":
            text = _assistant_text(m, tok, f"{conversation.source}: messages[{index + bool(system)}]")
            turns.append(Turn("assistant", (*tok.encode(text), tok.stop_id)))
        elif not turns:
            turns.append(Turn("user", tuple(tok.encode(f"{system}\n\n{content}" if system else content))))
        else:
            turns.append(Turn("user" if templated else "observation", tuple(tok.encode(content))))
    flush()
    return turns


def render(conversation: Conversation, tokenizer: ChatTokenizer, tool_list: ToolList = "full") -> EpisodeTokens:
    """The conversation's ids and loss mask, as `turns_tokens` lays out the environment's turns (`turns_of`)."""
    tok = framing(conversation, tokenizer, tool_list)
    return turns_tokens(turns_of(conversation, tok), tok)


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
    tool_list: ToolList = "full"
    """How the generator lists the tools (`[generator.agentic] tool_list`): "compact" never uses template tools."""


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


def lr_at(step: int, steps: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup to `lr` over `warmup` steps, then cosine to `lr * min_ratio` at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    floor = lr * min_ratio
    return floor + 0.5 * (lr - floor) * (1 + math.cos(math.pi * min(1.0, frac)))


def rendered(conversations: Sequence[Conversation], tokenizer: ChatTokenizer, limit: int, tool_list: ToolList
             ) -> tuple[list[tuple[list[int], list[int]]], int, int]:
    """Each conversation's (ids, mask) cut to `limit` tokens, how many were cut, and how many were left out for
    having no assistant token within `limit`; every one rendered (and so checked) before any training.

    :raises SFTError: one `turns_of` refuses, or no conversation has an assistant token within `limit`.
    """
    out: list[tuple[list[int], list[int]]] = []
    cut = skipped = 0
    for c in conversations:
        flat = render(c, tokenizer, tool_list)
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
    from rlbus.model.training.pretrain import PretrainProgress

    if config.steps < 1 or config.batch_size < 1 or threads < 1 or not config.lr > 0:
        raise ValueError(f"steps ({config.steps}), batch size ({config.batch_size}) and threads ({threads}) must be "
                         f">= 1 and lr ({config.lr}) > 0")
    report = progress or (lambda _: None)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    policy.to_(device=resolve_device(device), dtype=torch.float32)
    tokenizer = policy.tokenizer
    data, truncated, skipped = rendered(conversations, tokenizer, policy.max_seq_len + 1, config.tool_list)
    module = policy.module
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.95))
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
        for group in optimizer.param_groups:
            group["lr"] = lr
        logits = policy.forward(inputs).logits.float()
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        loss = (per_token * w.reshape(-1)).sum() / w.sum().clamp_min(1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
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
