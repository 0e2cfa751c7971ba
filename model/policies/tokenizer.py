"""Byte-level tokenizer: ids 0-255 are the raw UTF-8 bytes, then a handful of special tokens.

Owns: text <-> ids, the special-token table and chat-turn framing helpers.
Does not own: anything learned (no merges, nothing downloaded) or episode loss masks (`episodes.py`).
`encode` never produces a special id, so any text (even one spelling "<|user|>") round-trips exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

N_BYTES: Final = 256
SPECIAL_TOKENS: Final[tuple[str, ...]] = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|summary|>",
    "<|end_turn|>",
)
"""Special tokens in id order, starting at id 256. Append new ones at the end (ids are stable)."""


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus `SPECIAL_TOKENS` at 256..; `vocab_size` is 264 (fits any model >= 264).

    The model's vocabulary may be larger (for example the transformer's default 512): ids past
    `vocab_size` are simply never produced by `encode` and never seen in training.
    """

    name: str = "byte-v1"

    @property
    def vocab_size(self) -> int:
        """Number of ids this tokenizer uses: 256 bytes + len(SPECIAL_TOKENS)."""
        return N_BYTES + len(SPECIAL_TOKENS)

    def special_id(self, token: str) -> int:
        """Id of a special token such as "<|user|>"; raises ValueError naming the known ones."""
        try:
            return N_BYTES + SPECIAL_TOKENS.index(token)
        except ValueError:
            raise ValueError(f"unknown special token {token!r}; known: {', '.join(SPECIAL_TOKENS)}") from None

    @property
    def bos_id(self) -> int:
        return self.special_id("<|bos|>")

    @property
    def eos_id(self) -> int:
        return self.special_id("<|eos|>")

    @property
    def pad_id(self) -> int:
        return self.special_id("<|pad|>")

    @property
    def user_id(self) -> int:
        return self.special_id("<|user|>")

    @property
    def assistant_id(self) -> int:
        return self.special_id("<|assistant|>")

    @property
    def observation_id(self) -> int:
        return self.special_id("<|observation|>")

    @property
    def summary_id(self) -> int:
        return self.special_id("<|summary|>")

    @property
    def end_turn_id(self) -> int:
        return self.special_id("<|end_turn|>")

    @property
    def stop_id(self) -> int:
        """The id that ends a policy turn (<|end_turn|>): pass it as `eos_id` to `generate`."""
        return self.end_turn_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a turn's text: <|end_turn|> and <|eos|>."""
        return (self.end_turn_id, self.eos_id)

    def bos(self) -> list[int]:
        """Start of a conversation: <|bos|>."""
        return [self.bos_id]

    def header(self, role: str) -> list[int]:
        """The ids before a turn's content: its role token (<|user|>, <|assistant|>, <|observation|>, <|summary|>)."""
        return [self.special_id(f"<|{role}|>")]

    def closing(self) -> list[int]:
        """The ids after a turn's content: <|end_turn|>."""
        return [self.end_turn_id]

    def is_special(self, token_id: int) -> bool:
        """True for ids of special tokens (>= 256)."""
        return token_id >= N_BYTES

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text` as ids; never emits special ids (text is data, not markup)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], *, specials: bool = False) -> str:
        """Ids back to text. Byte runs decode as UTF-8 (invalid sequences become U+FFFD).

        Special ids are dropped, or rendered as their names with `specials=True`. Ids past
        `vocab_size` raise ValueError. `decode(encode(t)) == t` for every str `t`.
        """
        parts: list[str] = []
        run = bytearray()
        for token_id in ids:
            if 0 <= token_id < N_BYTES:
                run.append(token_id)
                continue
            if not N_BYTES <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside the tokenizer's 0..{self.vocab_size - 1}")
            if run:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
            if specials:
                parts.append(SPECIAL_TOKENS[token_id - N_BYTES])
        if run:
            parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def prompt_ids(self, prompt: str) -> list[int]:
        """Start of an episode: `<|bos|><|user|>prompt<|end_turn|><|assistant|>`; the policy continues it."""
        return [self.bos_id, self.user_id, *self.encode(prompt), self.end_turn_id, self.assistant_id]

    def info(self) -> dict[str, object]:
        """What a checkpoint stores to rebuild this tokenizer: name, vocab size and the special table."""
        return {"name": self.name, "vocab_size": self.vocab_size, "special_tokens": list(SPECIAL_TOKENS)}

    @classmethod
    def from_info(cls, info: dict[str, object]) -> ByteTokenizer:
        """Rebuild from `info()`; raises ValueError when the stored table differs from this build's."""
        stored = info.get("special_tokens")
        if not isinstance(stored, Sequence) or list(stored) != list(SPECIAL_TOKENS):
            raise ValueError(
                f"checkpoint tokenizer specials {stored!r} differ from this build's {list(SPECIAL_TOKENS)}; "
                "use the rlbus version that wrote the checkpoint"
            )
        return cls(name=str(info.get("name", "byte-v1")))
