"""The chat tokenizer of a Hugging Face policy: a transformers fast tokenizer framed as its chat template frames turns.

- Owns: `HFChatTokenizer` (a `ChatTokenizer`), the framing cut out of a chat template, ChatML as the default, and
  `ToolFraming` (how a template that renders tools frames their schemas, calls and results, cut out the same way).
- Does not: read a model directory (model/policies/hf_checks.py) or run a model (model/policies/hf.py).
- `transformers` is only a type here: importing this module leaves it unloaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from rlbus.model.policies.interface import PolicyError, Role, default_prompt_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DEFAULT_CHAT_TEMPLATE: Final = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML (`<|im_start|>{role}\\n{content}<|im_end|>\\n`): the framing of a tokenizer without a chat template."""
TEMPLATE_ROLES: Final[dict[Role, str]] = {
    "user": "user",
    "assistant": "assistant",
    "observation": "user",  # test feedback is what the harness tells the policy: a user turn
    "summary": "assistant",  # the policy's own words about its history
}
_SENTINELS: Final = ("rlbusSentinelUserOne", "rlbusSentinelAssistantTwo", "rlbusSentinelUserThree")
_RESULTS: Final = ("rlbusSentinelToolFour", "rlbusSentinelToolFive")
_VERBATIM: Final = 'rlbusSentinel "quoted"\nline'
"""A tool result that shows whether the template renders results verbatim or as JSON strings."""
TemplateCallStyle = Literal["hermes", "llama"]


@dataclass(frozen=True, slots=True)
class ToolFraming:
    """How a chat template that renders tools frames them, as text cut out of its renderings.

    `system` is what precedes the first user header when the template is given the tool schemas (the system turn
    holding them, where the template puts it); a run of tool results is `header`, each result (a JSON string when
    `json_results`) joined by `between`, then `after` and the template's closing. `style` is how the template
    renders an assistant's tool call: Hermes `<tool_call>` blocks or a Llama-3.1 JSON turn. `ids` are the four
    texts' ids (special tokens spelled in them are those tokens), in that order.
    """

    style: TemplateCallStyle
    system: str
    header: str
    between: str
    after: str
    json_results: bool
    ids: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def one_line(err: BaseException | str) -> str:
    """An exception (or text) as one short line."""
    text = " ".join(str(err).split())
    return text if len(text) <= 240 else text[:237] + "..."


class HFChatTokenizer:
    """A transformers fast tokenizer as a `ChatTokenizer`; turns framed as the model's chat template frames them.

    The framing is cut out of the template once: a one-turn conversation with and without the generation
    prompt and a user/assistant/user conversation are rendered with sentinel contents, and the fixed text around
    them gives `bos()` (whatever precedes the first user header, such as a default system turn), each role's
    header and the closing, each tokenized once. Without a template, ChatML (`DEFAULT_CHAT_TEMPLATE`).
    Roles map as `TEMPLATE_ROLES` says. The closing must start with one special token, the stop.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, *, name: str, template_source: str) -> None:
        self.hf = tokenizer
        self._name = name
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._special = frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
        template = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
        bos, user, assistant, closing = _framing(tokenizer, template, template_source)
        self._template = template
        self._texts = (bos, user, assistant, closing)
        self._tool_framings: dict[str, ToolFraming | str] = {}
        self._bos = self._fixed(bos)
        self._headers = {"user": self._fixed(user), "assistant": self._fixed(assistant)}
        self._closing = self._fixed(closing)
        if not self._closing or self._closing[0] not in self._special:
            first = tokenizer.convert_ids_to_tokens(self._closing[:1])
            raise PolicyError(f"{template_source}: the chat template closes a turn with {closing!r}, whose first "
                              f"token {first} is not one special token; expected a closing that starts with a "
                              f"special token such as <|im_end|> (the stop of a policy turn)")
        self._stop = self._closing[0]
        eos = tokenizer.eos_token_id
        self._eos = self._stop if eos is None else int(eos)
        pad = tokenizer.pad_token_id
        self._pad = self._eos if pad is None else int(pad)

    def _fixed(self, text: str) -> list[int]:
        """Ids of template text: special tokens spelled in it are those tokens."""
        return list(self.hf(text, add_special_tokens=False, verbose=False).input_ids) if text else []

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def stop_id(self) -> int:
        return self._stop

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys((self._stop, self._eos)))

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def encode(self, text: str) -> list[int]:
        """Ids of `text` as data: a special token's spelling is split into ordinary tokens."""
        return list(self.hf(text, add_special_tokens=False, split_special_tokens=True).input_ids)

    def decode(self, ids: Iterable[int], *, specials: bool = False) -> str:
        """Text of ids; special ids dropped, or rendered as their text with `specials=True`."""
        return str(self.hf.decode(list(ids), skip_special_tokens=not specials, clean_up_tokenization_spaces=False))

    def bos(self) -> list[int]:
        return list(self._bos)

    def header(self, role: Role) -> list[int]:
        return list(self._headers[TEMPLATE_ROLES[role]])

    def closing(self) -> list[int]:
        return list(self._closing)

    def prompt_ids(self, prompt: str) -> list[int]:
        return default_prompt_ids(self, prompt)

    def tool_framing(self, schemas: Sequence[dict[str, Any]]) -> ToolFraming | str:
        """How the chat template frames tools given as `schemas` (OpenAI function JSON schemas), or why it does not
        (one line): it renders nothing different with them, puts them elsewhere than before the first user turn,
        renders tool results neither verbatim nor as JSON strings, or an assistant's tool call in no known style.
        Rendered with `tools_in_user_message=False` (Llama-3.1's switch that puts them in the system turn); cut once
        per schemas."""
        key = json.dumps(list(schemas), sort_keys=True)
        if key not in self._tool_framings:
            self._tool_framings[key] = _tool_framing(self.hf, self._template, self._texts, schemas, self._fixed)
        return self._tool_framings[key]


def _framing(tokenizer: PreTrainedTokenizerFast, template: str, source: str) -> tuple[str, str, str, str]:
    """(bos, user header, assistant header, closing) text of a chat template.

    :raises PolicyError: the template does not render, or its turns are not header + content + closing.
    """
    one, two, three = _SENTINELS

    def render(messages: list[tuple[str, str]], generation: bool) -> str:
        conversation = [{"role": role, "content": content} for role, content in messages]
        try:
            return str(tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                     add_generation_prompt=generation))
        except Exception as err:  # jinja2 errors of every kind, the template's raise_exception
            raise PolicyError(f"{source}: the chat template does not render ({type(err).__name__}: "
                              f"{one_line(err)}); expected one that renders user and assistant turns") from None

    single = render([("user", one)], False)
    prompt = render([("user", one)], True)
    full = render([("user", one), ("assistant", two), ("user", three)], False)

    def refuse(what: str) -> PolicyError:
        return PolicyError(f"{source}: the chat template {what}; expected turns rendered as header + content + "
                           f"closing (ChatML: <|im_start|>role\\n...<|im_end|>\\n)")

    if not prompt.startswith(single) or len(prompt) == len(single):
        raise refuse("adds no assistant header after the conversation with add_generation_prompt")
    assistant = prompt[len(single):]
    if any(full.count(s) != 1 for s in _SENTINELS):
        raise refuse("does not render each message's content verbatim once")
    before, rest = full.split(one)
    between, rest = rest.split(two)
    middle, after = rest.split(three)
    if not between.endswith(assistant):
        raise refuse(f"renders an assistant turn's header unlike its generation prompt {assistant!r}")
    closing = between[: len(between) - len(assistant)]
    if not closing or not middle.startswith(closing) or not after.startswith(closing):
        raise refuse(f"closes user and assistant turns differently ({closing!r})")
    user = middle[len(closing):]
    if not user or not before.endswith(user):
        raise refuse(f"renders the first user turn's header unlike a later one's ({user!r})")
    return before[: len(before) - len(user)], user, assistant, closing



def _tool_framing(tokenizer: PreTrainedTokenizerFast, template: str, texts: tuple[str, str, str, str],
                  schemas: Sequence[dict[str, Any]], fixed: Callable[[str], list[int]]) -> ToolFraming | str:
    """`HFChatTokenizer.tool_framing`: conversations of sentinels rendered with and without the schemas, tool
    messages and a tool call, and the fixed text around the sentinels compared."""
    bos, _, assistant, closing = texts
    one, two, three = _SENTINELS
    tools = [dict(schema) for schema in schemas]

    def render(messages: list[dict[str, Any]], generation: bool, with_tools: bool = True) -> str:
        extra: dict[str, Any] = {"tools": tools, "tools_in_user_message": False} if with_tools else {}
        return str(tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=generation, **extra))

    turns = [{"role": "user", "content": one}, {"role": "assistant", "content": two}, {"role": "user", "content": three}]
    try:
        plain = render(turns, False, with_tools=False)
        full = render(turns, False)
    except Exception as err:  # jinja2 errors of every kind, the template's raise_exception
        return f"the chat template does not render tools ({type(err).__name__}: {one_line(err)})"
    if full == plain:
        return "the chat template renders nothing of the tools it is given"
    tail = plain[len(bos):]
    if not full.endswith(tail) or not (system := full[: len(full) - len(tail)]):
        return "the chat template renders the tools elsewhere than before the first user turn"
    head = full[: full.index(two) + len(two)] + closing

    def results(contents: Sequence[str]) -> str:
        messages = [*turns[:2], *({"role": "tool", "content": c} for c in contents)]
        rendered = render(messages, True)
        if not rendered.startswith(head) or not rendered.endswith(assistant):
            raise ValueError("tool results")
        return rendered[len(head): len(rendered) - len(assistant)]

    try:
        verbatim = results([_VERBATIM])
        json_results = _VERBATIM not in verbatim
        if json_results and json.dumps(_VERBATIM, ensure_ascii=False) not in verbatim:
            return "the chat template renders a tool result neither verbatim nor as a JSON string"
        four, five = (json.dumps(r) if json_results else r for r in _RESULTS)
        two_results, one_result = results(_RESULTS), results(_RESULTS[:1])
    except ValueError:
        return "the chat template renders tool results other than as turns after the assistant's"
    except Exception as err:
        return f"the chat template does not render tool results ({type(err).__name__}: {one_line(err)})"
    if two_results.count(four) != 1 or two_results.count(five) != 1:
        return "the chat template does not render each tool result once"
    header, rest = two_results.split(four)
    between, after = rest.split(five)
    if not header or one_result != header + four + after or not after.endswith(closing):
        return "the chat template frames one tool result unlike two, or closes them unlike other turns"
    style = _call_style(render, turns[0], str(schemas[0]["function"]["name"]), system)
    if style is None:
        return "the chat template renders a tool call in no known style (Hermes <tool_call> blocks, Llama-3.1 JSON)"
    after = after[: len(after) - len(closing)]
    ids = (tuple(fixed(system)), tuple(fixed(header)), tuple(fixed(between)), tuple(fixed(after)))
    return ToolFraming(style=style, system=system, header=header, between=between, after=after,
                       json_results=json_results, ids=ids)


def _call_style(render: Any, first: dict[str, Any], name: str, system: str) -> TemplateCallStyle | None:
    """How the template renders an assistant's call of tool `name`: Hermes `<tool_call>` or Llama-3.1
    `{"name": ..., "parameters": ...}`; failing that, Hermes when its tool instructions name `<tool_call>`."""
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}
    try:
        rendered = str(render([first, call], False))
    except Exception:  # a template that renders no tool_calls
        rendered = ""
    said = rendered[rendered.find(first["content"]):] if rendered else ""
    if "<tool_call>" in said:
        return "hermes"
    if '"parameters"' in said and f'"name": "{name}"' in said:
        return "llama"
    return "hermes" if "<tool_call>" in system else None
