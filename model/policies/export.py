"""A policy written out as a Hugging Face directory that plain `transformers` loads (no rlbus code to read it).

Owns: `export_policy` (safetensors in the policy's dtype, config.json, generation_config.json, tokenizer files
with a chat template), the built-in transformer as a `LlamaForCausalLM` (`llama_config`, `llama_tensors`), the
byte tokenizer as tokenizer.json (`byte_tokenizer_files`), `ExportError`. transformers is imported lazily.
Does not: find or load checkpoints (ops/export.py, ops/eval.py), or read exports back (model/policies/hf.py).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor

from rlbus.model.policies.builtin import BuiltinPolicy
from rlbus.model.policies.interface import Policy, PolicyError
from rlbus.model.policies.tokenizer import SPECIAL_TOKENS, ByteTokenizer
from rlbus.model.policies.transformer import ModelConfig, SwiGLU, Transformer

LLAMA: Final = "LlamaForCausalLM"
WEIGHTS_NAME: Final = "model.safetensors"
RMS_NORM_EPS: Final = 1e-6
"""The built-in RMSNorm's eps (`model/policies/transformer.py` RMSNorm default)."""
BYTE_CHAT_TEMPLATE: Final = (
    "{{- '<|bos|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['user', 'assistant', 'observation', 'summary'] %}"
    "{{- raise_exception('rlbus byte-level chat roles are user, assistant, observation and summary') }}"
    "{%- endif %}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end_turn|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
"""The built-in conversation layout: `<|bos|>`, then per turn `<|role|>content<|end_turn|>`; the generation
prompt is `<|assistant|>` (`ByteTokenizer.prompt_ids`)."""
_HF_OWN: Final = ("config.json",)
"""Files `save_pretrained` writes that the policy's own copy must not replace (config.json carries the dtype)."""


class ExportError(PolicyError):
    """A policy that has no Hugging Face form here (or a target directory that cannot take one)."""


@dataclass(frozen=True, slots=True)
class Export:
    """What `export_policy` wrote."""

    path: Path
    architecture: str
    """The transformers class named in config.json."""
    parameters: int
    """Distinct parameters written (a tied embedding once)."""
    nbytes: int
    """Bytes of tensor data written."""
    dtype: torch.dtype
    files: list[str]
    dropped: list[str] = field(default_factory=list)
    """Tensors of the policy left out (MTP heads with `drop_mtp`)."""


def export_policy(policy: Policy, out_dir: Path, *, drop_mtp: bool = False) -> Export:
    """Write `policy` to `out_dir` as a Hugging Face directory, tensors in the dtype the policy holds them.

    A Hugging Face policy is written by its module's `save_pretrained` (safetensors) with its tokenizer files
    (`Policy.files`). A built-in dense policy becomes a `LlamaForCausalLM` (`llama_config`, `llama_tensors`) with
    the byte tokenizer as tokenizer.json (`byte_tokenizer_files`). Loaded back in float32 with `transformers`
    alone, the export's logits match the built-in policy's (float32, same weights) within 1e-4 absolute: the two
    compute RoPE differently (rlbus: float64 angles rounded to float32 tables; transformers: float32 inverse
    frequencies times positions), and that is the whole difference (with rlbus's tables swapped for transformers'
    the logits are equal). Measured on the tiny test models (logits up to ~7): 6e-6 to 1e-5 at 36 positions, 2e-5
    to 4e-5 at 115; it grows with the position. tests/ops/test_ops_export.py asserts 1e-4.
    The directory is written beside `out_dir` and renamed into place, so a failed export leaves nothing.

    :raises ExportError: a built-in policy with MoE layers (a Llama has no experts), one with MTP heads unless
        `drop_mtp`, an unknown policy kind, or an `out_dir` that exists and is not an empty directory.
    """
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir}: exists and is not an empty directory; choose a new directory (an export "
                          f"never overwrites files)")
    dropped: list[str] = []
    if isinstance(policy, BuiltinPolicy):
        config = policy.config
        _check_builtin(config, drop_mtp=drop_mtp)
        dropped = [name for name in policy.named_tensors() if name.startswith("mtp.")]
    elif policy.kind != "hf":
        raise ExportError(f"a {policy.kind or type(policy).__name__} policy has no Hugging Face form; expected a "
                          f"built-in or a Hugging Face policy")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if isinstance(policy, BuiltinPolicy):
            architecture, tensors = _write_builtin(policy, tmp)
        else:
            architecture, tensors = _write_hf(policy, tmp)
        files = sorted(p.name for p in tmp.iterdir())
        if out_dir.exists():
            out_dir.rmdir()                          # empty (checked above): the rename takes its place
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Export(out_dir, architecture, sum(t.numel() for t in tensors.values()),
                  sum(t.numel() * t.element_size() for t in tensors.values()), policy.dtype, files, dropped)


# ---- built-in -> Llama --------------------------------------------------------------------------------------
def _check_builtin(config: ModelConfig, *, drop_mtp: bool) -> None:
    if config.moe_layers:
        raise ExportError(f"layers {list(config.moe_layers)} are mixture-of-experts ({config.n_experts} experts, "
                          f"top {config.top_k}); a LlamaForCausalLM has no experts, so this policy has no Hugging "
                          f"Face form: keep the rlbus checkpoint (rlbus eval and rlbus up read it)")
    if config.mtp_heads and not drop_mtp:
        raise ExportError(f"the policy has {config.mtp_heads} multi-token-prediction heads, which a "
                          f"LlamaForCausalLM has no place for; pass --drop-mtp to export without them (next-token "
                          f"logits are unchanged: the heads only draft tokens for speculative decoding)")


def llama_config(config: ModelConfig, tokenizer: ByteTokenizer, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of the `LlamaForCausalLM` a built-in `config` maps onto: one key/value head per head, the
    SwiGLU width, RMSNorm eps 1e-6, the RoPE theta (as `rope_parameters` and, for transformers 4, `rope_theta`),
    tied embeddings as the built-in ties them, the context as `max_position_embeddings`."""
    from transformers import LlamaConfig

    values = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads, num_key_value_heads=config.n_heads,
        head_dim=config.d_model // config.n_heads, hidden_act="silu", max_position_embeddings=config.max_seq_len,
        rms_norm_eps=RMS_NORM_EPS, tie_word_embeddings=config.tie_embeddings, attention_bias=False, mlp_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.stop_id, pad_token_id=tokenizer.pad_id,
        architectures=[LLAMA], dtype=str(dtype).removeprefix("torch."),
    ).to_dict()
    values["rope_theta"] = float(config.rope_theta)
    return values


def llama_tensors(model: Transformer) -> dict[str, Tensor]:
    """The built-in transformer's tensors under `LlamaForCausalLM` names, in their dtype, contiguous on the CPU.

    qkv splits into q/k/v_proj along its rows (the rows are [q; k; v], each head's Dh rows together, as
    `LlamaAttention` views them); proj -> o_proj; SwiGLU gate/up/down -> mlp.gate/up/down_proj; the two RMSNorm
    weights per block -> input/post_attention_layernorm; the final norm -> model.norm; the untied head ->
    lm_head (a tied one is left out, as `save_pretrained` leaves it). MTP heads are not mapped. RoPE needs no
    permutation: `apply_rope` rotates the two halves of each head, as transformers' `rotate_half` does.
    """
    d = model.config.d_model
    out: dict[str, Tensor] = {"model.embed_tokens.weight": model.embed.weight}
    for i, block in enumerate(model.blocks):
        if not isinstance(block.ffn, SwiGLU):
            raise ExportError(f"layer {i} is mixture-of-experts; a LlamaForCausalLM has no experts")
        q, k, v = block.attn.qkv.weight.split(d, dim=0)
        prefix = f"model.layers.{i}."
        out |= {
            prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v, prefix + "self_attn.o_proj.weight": block.attn.proj.weight,
            prefix + "mlp.gate_proj.weight": block.ffn.gate.weight, prefix + "mlp.up_proj.weight": block.ffn.up.weight,
            prefix + "mlp.down_proj.weight": block.ffn.down.weight,
            prefix + "input_layernorm.weight": block.attn_norm.weight,
            prefix + "post_attention_layernorm.weight": block.ffn_norm.weight,
        }
    out["model.norm.weight"] = model.norm.weight
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head.weight
    return {name: t.detach().to("cpu").contiguous() for name, t in out.items()}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of `tokenizers`' ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_files(tokenizer: ByteTokenizer, max_seq_len: int) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json of the byte tokenizer.

    tokenizer.json: a BPE model without merges over the ByteLevel alphabet (byte b -> id b), a ByteLevel
    pre-tokenizer without prefix space and a ByteLevel decoder, so `encode` gives the UTF-8 bytes as ids, exactly
    `ByteTokenizer.encode`; the special tokens at 256.. as added special tokens (unlike `ByteTokenizer.encode`,
    a Hugging Face tokenizer turns text that spells one, such as "<|user|>", into that token). The chat template
    is `BYTE_CHAT_TEMPLATE`; eos `<|end_turn|>` (the stop of a policy turn), pad `<|pad|>`, bos `<|bos|>` (added
    by the template, not by `encode`).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if [backend.token_to_id(t) for t in SPECIAL_TOKENS] != [tokenizer.special_id(t) for t in SPECIAL_TOKENS]:
        raise AssertionError("special token ids of the exported tokenizer differ from ByteTokenizer's")
    specials = {"bos_token": "<|bos|>", "eos_token": "<|end_turn|>", "pad_token": "<|pad|>"}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "unk_token": None,
                "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
                "model_max_length": max_seq_len, "chat_template": BYTE_CHAT_TEMPLATE}
    return {"tokenizer.json": backend.to_str(pretty=True).encode(),
            "tokenizer_config.json": _json(settings), "special_tokens_map.json": _json(specials)}


def _write_builtin(policy: BuiltinPolicy, out: Path) -> tuple[str, dict[str, Tensor]]:
    from safetensors.torch import save_file

    tokenizer = policy.tokenizer
    if not isinstance(tokenizer, ByteTokenizer):
        raise ExportError(f"a built-in policy with tokenizer {type(tokenizer).__name__}; expected the byte tokenizer")
    tensors = llama_tensors(policy.transformer)
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / "config.json").write_bytes(_json(llama_config(policy.config, tokenizer, policy.dtype)))
    (out / "generation_config.json").write_bytes(_json({
        "bos_token_id": tokenizer.bos_id, "eos_token_id": list(tokenizer.stop_ids), "pad_token_id": tokenizer.pad_id,
    }))
    for name, data in byte_tokenizer_files(tokenizer, policy.max_seq_len).items():
        (out / name).write_bytes(data)
    return LLAMA, tensors


# ---- Hugging Face -------------------------------------------------------------------------------------------
def _write_hf(policy: Policy, out: Path) -> tuple[str, dict[str, Tensor]]:
    module: Any = policy.module
    module.save_pretrained(str(out))
    config = json.loads((out / "config.json").read_bytes())
    config["dtype"] = str(policy.dtype).removeprefix("torch.")     # the weights as written
    (out / "config.json").write_bytes(_json(config))
    for name, data in policy.files().items():
        if name not in _HF_OWN:
            (out / name).write_bytes(data)
    return str(type(module).__name__), policy.named_tensors()


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()
