"""The chat tokenizer of a Hugging Face policy: a transformers fast tokenizer framed as its chat template frames turns.

- Owns: `HFChatTokenizer` (a `ChatTokenizer`), the framing cut out of a chat template, ChatML as the default.
- Does not: read a model directory (model/policies/hf_checks.py) or run a model (model/policies/hf.py).
- `transformers` is only a type here: importing this module leaves it unloaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

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
        return list(self.hf(text, add_special_tokens=False).input_ids) if text else []

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

