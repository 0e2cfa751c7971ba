"""Hugging Face model directories built on the spot, for machines without downloads.

Owns: `train_bpe_tokenizer` (byte-level BPE on local text) and `build_hf_dir` (a randomly initialised Llama,
Qwen2, Qwen3 or Qwen3-MoE of a size preset, saved with its tokenizer, a ChatML chat template with Qwen2.5's tool
sections and the matching `response_template`). Special tokens:
`<|endoftext|>` (the eos: end of a document), `<|im_start|>` / `<|im_end|>` (ChatML turns: `<|im_end|>` is the
stop of a policy turn), `<|pad|>`. Does not: train the model (`model/training/pretrain.py`) or download anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final, Literal

from rlbus.model.policies.hf_chat import DEFAULT_CHAT_TEMPLATE

Architecture = Literal["qwen2", "llama", "qwen3", "qwen3_moe"]
Size = Literal["tiny", "small", "m30"]

SPECIAL_TOKENS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
"""Ids 0..3 of every tokenizer `train_bpe_tokenizer` trains, in this order."""
EOS_TOKEN: Final = "<|endoftext|>"
STOP_TOKEN: Final = "<|im_end|>"
PAD_TOKEN: Final = "<|pad|>"

CHATML_TEMPLATE: Final = DEFAULT_CHAT_TEMPLATE
"""ChatML, as Qwen2 and Qwen3 chat models use it (without their tool and reasoning extras)."""

_QWEN_TOOLS_TEMPLATE: Final = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- elif default_system is defined %}{{- default_system + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- elif default_system is defined %}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML with Qwen2.5's tool sections: given `tools`, a system turn holding them as a `<tools>` block and how to
call one; an assistant's `tool_calls` as Hermes `<tool_call>` blocks; a run of `tool` messages as one user turn of
`<tool_response>` blocks. Without tools it renders as ChatML (and the default system turn, when set)."""

RESPONSE_TEMPLATE: Final[dict[str, Any]] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
"""How `tokenizer.parse_response` (transformers >= 5.13; TRL's GRPOTrainer with tools) reads an assistant turn of the
recipe's template: its text and its Hermes `<tool_call>` blocks, the calls as `{"type": "function", "function":
{"name", "arguments"}}`."""


_ARCHITECTURES: Final[dict[str, str]] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

_SIZES: Final[dict[str, dict[str, int]]] = {
    # ~0.1M parameters (+ 64 per vocabulary entry and tied/untied head): unit tests.
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "moe_intermediate_size": 64},
    # ~0.75M parameters in the blocks (the built-in small preset's shape), ~1M with a vocabulary of 2048:
    # pretrains in minutes and trains by RL on 2 CPU cores.
    "small": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 384, "moe_intermediate_size": 96},
    # ~25M parameters in the blocks, ~30M with a vocabulary of 8192 (Qwen2-like: GQA 8/4 heads).
    "m30": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
            "intermediate_size": 1536, "moe_intermediate_size": 384},
}


def chat_template(system_prompt: str | None = None) -> str:
    """The ChatML template with Qwen2.5's tool sections; with `system_prompt`, one that opens with that system turn
    when the conversation has none (as Qwen2's templates do with "You are a helpful assistant.")."""
    if system_prompt is None:
        return _QWEN_TOOLS_TEMPLATE
    return "{%- set default_system = " + repr(system_prompt) + " %}" + _QWEN_TOOLS_TEMPLATE


QWEN2_SPLIT: Final = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                      r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
"""The pre-tokenizer split of Qwen2's tokenizers (letters, single digits, punctuation runs, newlines, spaces)."""


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` of at most `vocab_size` ids trained on `texts`.

    Ids 0..3 are `SPECIAL_TOKENS`; the 256 byte symbols are always in the vocabulary, so any text encodes.
    Deterministic for the same texts and size.

    :raises ValueError: `vocab_size` leaves no room for the specials and the byte alphabet.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size < floor:
        raise ValueError(f"vocab_size {vocab_size} must be >= {floor} (the specials and the 256 byte symbols)")
    tokenizer = Tokenizer(models.BPE())
    # Qwen2's own normaliser and split (transformers' Qwen2Tokenizer rebuilds exactly these around the file's
    # vocabulary), so `AutoTokenizer.from_pretrained` on the directory encodes as rlbus does, for every family.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer)
    return tokenizer


def _config(architecture: str, size: str, *, vocab_size: int, tie_embeddings: bool, max_seq_len: int,
            ids: dict[str, int]) -> Any:
    """The transformers config of `architecture` at preset `size`, fp32, sdpa."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    shape = dict(_SIZES[size])
    moe_width = shape.pop("moe_intermediate_size")
    common: dict[str, Any] = {
        **shape,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_seq_len,
        "tie_word_embeddings": tie_embeddings,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "dtype": "float32",
    }
    match architecture:
        case "llama":
            return LlamaConfig(**common)
        case "qwen2":
            return Qwen2Config(**common, use_sliding_window=False)
        case "qwen3":
            return Qwen3Config(**common, use_sliding_window=False)
        case "qwen3_moe":
            return Qwen3MoeConfig(**common, use_sliding_window=False, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=moe_width, decoder_sparse_step=1, mlp_only_layers=[],
                                  norm_topk_prob=True)
    raise ValueError(f"architecture {architecture!r}: expected one of {', '.join(_ARCHITECTURES)}")


def build_hf_dir(
    out_dir: Path,
    *,
    architecture: Architecture = "qwen2",
    texts: Iterable[str],
    vocab_size: int = 512,
    size: Size = "tiny",
    tie_embeddings: bool | None = None,
    max_seq_len: int = 512,
    seed: int = 0,
    system_prompt: str | None = None,
) -> Path:
    """Write a complete Hugging Face directory of a randomly initialised model to `out_dir`; returns it.

    The tokenizer is trained on `texts` (`train_bpe_tokenizer`); the config's `vocab_size` is `vocab_size`
    (at least the tokenizer's size). `tie_embeddings` defaults to what the family's small models do (Qwen2 and
    Qwen3 tie, Llama and Qwen3-MoE do not). `system_prompt` makes the chat template open with that system turn
    when a conversation has none. The same arguments (and seed) write the same files.

    :raises ValueError: an unknown architecture or size, or a vocabulary too small.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    if architecture not in _ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}: expected one of {', '.join(_ARCHITECTURES)}")
    if size not in _SIZES:
        raise ValueError(f"size {size!r}: expected one of {', '.join(_SIZES)}")
    tokenizer = train_bpe_tokenizer(texts, vocab_size)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    tied = architecture in ("qwen2", "qwen3") if tie_embeddings is None else tie_embeddings
    config = _config(architecture, size, vocab_size=max(vocab_size, tokenizer.get_vocab_size()),
                     tie_embeddings=tied, max_seq_len=max_seq_len, ids=ids)
    config.architectures = [_ARCHITECTURES[architecture]]
    rng = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.set_rng_state(rng)
    model.generation_config = GenerationConfig(
        eos_token_id=[ids[STOP_TOKEN], ids[EOS_TOKEN]], pad_token_id=ids[PAD_TOKEN], bos_token_id=None,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=["<|im_start|>", STOP_TOKEN],
        chat_template=chat_template(system_prompt),
        response_template=RESPONSE_TEMPLATE,
        model_max_length=max_seq_len,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)
    return out_dir
