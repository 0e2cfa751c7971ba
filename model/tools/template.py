"""Tools in the policy's own chat-template format: the schemas in the system turn, results in the tool role.

Owns: `TemplateTools` (a `ChatTokenizer` over a Hugging Face chat tokenizer whose template renders tools: its bos
is what the template puts before the first user turn when given `TOOL_SCHEMAS`, its observation turns are the
template's tool role, and it knows the template's `CallStyle`) and `template_tools` (that view of a tokenizer, or
None where the template renders no tools).
Does not own: cutting the framing out of a template (model/policies/hf_chat.py `ToolFraming`), the tools, their
schemas or parsing (model/tools/calls.py), or the episode (model/env/agentic.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from rlbus.model.policies.hf_chat import HFChatTokenizer, ToolFraming
from rlbus.model.policies.interface import ChatTokenizer, Role, default_prompt_ids
from rlbus.model.tools.calls import TOOL_SCHEMAS, CallStyle


class TemplateTools:
    """A chat tokenizer framed as its template frames tools; everything else is the tokenizer's own.

    `bos()` holds the system turn with the tool schemas as the template renders it; `header("observation")` is the
    tool role's header, and an observation's content is the results as `results_ids` lays them out (joined and
    closed as the template joins and closes a run of `tool` messages), so a framed observation turn decodes to
    what the template renders for those messages. Other roles keep the tokenizer's framing.
    """

    def __init__(self, base: HFChatTokenizer, framing: ToolFraming) -> None:
        self.base = base
        self.framing = framing
        self._bos, self._header, self._between, self._after = framing.ids

    @property
    def style(self) -> CallStyle:
        """How the template writes a tool call (the parser of the policy's turns)."""
        return self.framing.style

    @property
    def hf(self) -> Any:
        return self.base.hf

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def pad_id(self) -> int:
        return self.base.pad_id

    @property
    def eos_id(self) -> int:
        return self.base.eos_id

    @property
    def stop_id(self) -> int:
        return self.base.stop_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.base.stop_ids

    def is_special(self, token_id: int) -> bool:
        return self.base.is_special(token_id)

    def encode(self, text: str) -> list[int]:
        return self.base.encode(text)

    def decode(self, ids: Iterable[int], *, specials: bool = False) -> str:
        return self.base.decode(ids, specials=specials)

    def bos(self) -> list[int]:
        return list(self._bos)

    def header(self, role: Role) -> list[int]:
        return list(self._header) if role == "observation" else self.base.header(role)

    def closing(self) -> list[int]:
        return self.base.closing()

    def prompt_ids(self, prompt: str) -> list[int]:
        return default_prompt_ids(self, prompt)

    def results_ids(self, results: Sequence[str], limit: int) -> list[int]:
        """The content of an observation turn answering with `results`: each encoded as data (as a JSON string
        where the template renders results so), joined by the template's text between two tool messages, then its
        text after the last; at most `limit` ids, cut before that last text, saying so."""
        parts: list[int] = []
        for k, result in enumerate(results):
            if k:
                parts += self._between
            parts += self.encode(json.dumps(result, ensure_ascii=False) if self.framing.json_results else result)
        if len(parts) + len(self._after) <= limit:
            return [*parts, *self._after]
        notice = self.encode(f"\n[observation truncated to {limit} tokens]")
        return [*parts[: max(limit - len(notice) - len(self._after), 0)], *notice, *self._after]


def template_tools(tokenizer: ChatTokenizer) -> TemplateTools | str:
    """`tokenizer` framed as its chat template frames `TOOL_SCHEMAS` and tool results, or why it cannot be (one
    line): not a Hugging Face chat tokenizer (the built-in byte one), or a template that renders no tools
    (`HFChatTokenizer.tool_framing`)."""
    if isinstance(tokenizer, TemplateTools):
        return tokenizer
    if not isinstance(tokenizer, HFChatTokenizer):
        return f"{tokenizer.name} has no chat template"
    framing = tokenizer.tool_framing(TOOL_SCHEMAS)
    return TemplateTools(tokenizer, framing) if isinstance(framing, ToolFraming) else framing
