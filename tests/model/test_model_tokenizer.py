"""Byte tokenizer: exact round trips, the special-token table, chat framing and checkpoint info."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlbus.model.policies.tokenizer import SPECIAL_TOKENS, ByteTokenizer

TOK = ByteTokenizer()


@pytest.mark.parametrize("text", ["", "def f(x):\n    return x + 1\n", "héllo wörld", "日本語 🙂\t\r\n",
                                  "<|user|> is plain text", "\x00\x7f"])
def test_round_trip_examples(text: str) -> None:
    """decode(encode(t)) == t for ASCII, accents, CJK, emoji, control bytes and special-looking text."""
    assert TOK.decode(TOK.encode(text)) == text


@given(st.text())
def test_round_trip_any_text(text: str) -> None:
    """Every Python string (any code points, surrogates excluded by UTF-8) round-trips exactly."""
    assert TOK.decode(TOK.encode(text)) == text


def test_ids_are_utf8_bytes() -> None:
    """Ids are the UTF-8 bytes: 'é' is 0xC3 0xA9, and encode never emits a special id."""
    assert TOK.encode("aé") == [97, 0xC3, 0xA9]
    assert all(i < 256 for i in TOK.encode("<|eos|><|assistant|>"))


def test_special_table() -> None:
    """Specials take ids 256.. in table order; vocab_size 264 fits the transformer's default 512."""
    assert (TOK.bos_id, TOK.eos_id, TOK.pad_id, TOK.user_id) == (256, 257, 258, 259)
    assert (TOK.assistant_id, TOK.observation_id, TOK.summary_id, TOK.end_turn_id) == (260, 261, 262, 263)
    assert TOK.vocab_size == 256 + len(SPECIAL_TOKENS) == 264
    assert TOK.stop_id == TOK.end_turn_id
    with pytest.raises(ValueError, match="unknown special token"):
        TOK.special_id("<|system|>")


def test_decode_specials() -> None:
    """Specials are dropped by default, named with specials=True; ids past the vocabulary raise."""
    ids = [TOK.bos_id, *TOK.encode("hi"), TOK.end_turn_id]
    assert TOK.decode(ids) == "hi"
    assert TOK.decode(ids, specials=True) == "<|bos|>hi<|end_turn|>"
    with pytest.raises(ValueError, match="outside"):
        TOK.decode([264])


def test_invalid_utf8_is_replaced() -> None:
    """A sampled byte run that is not UTF-8 decodes with U+FFFD instead of raising."""
    assert TOK.decode([0xC3, TOK.eos_id, 0x41]) == "\ufffdA"


def test_prompt_framing() -> None:
    """prompt_ids is <|bos|><|user|>text<|end_turn|><|assistant|>."""
    assert TOK.prompt_ids("hi") == [256, 259, 104, 105, 263, 260]


def test_info_round_trip() -> None:
    """from_info(info()) rebuilds the tokenizer; a different special table is refused."""
    assert ByteTokenizer.from_info(TOK.info()) == TOK
    with pytest.raises(ValueError, match="differ"):
        ByteTokenizer.from_info({"name": "byte-v1", "special_tokens": ["<|bos|>"]})
