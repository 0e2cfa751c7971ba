"""The built-in policy: the project's transformer (`model/policies/transformer.py`) and byte tokenizer behind `Policy`.

Owns: `BuiltinPolicy` (spec = the `ModelConfig` fields, the shape older manifests carry; loading a
`pretrain.pt`), and `config_dict` / `config_from_spec`.
Does not own: the network or the tokenizer themselves, sampling, or MTP speculation (`model/sampling/generate.py`
reaches the transformer through `BuiltinPolicy.transformer` for that).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlbus.model.policies.interface import Policy, PolicyCache, PolicyError, PolicyOutput, RowKV
from rlbus.model.policies.tokenizer import ByteTokenizer
from rlbus.model.policies.transformer import KVCache, ModelConfig, Transformer


def config_dict(config: ModelConfig) -> dict[str, Any]:
    """A ModelConfig as plain values (tuples as lists), as it travels in VersionReady and WeightManifest."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def config_from_spec(fields: Mapping[str, Any]) -> ModelConfig:
    """Inverse of `config_dict` (a `"policy": "builtin"` key is allowed).

    :raises PolicyError: the fields do not make a ModelConfig (unknown or missing fields, or sizes its own
        checks refuse).
    """
    values = {k: v for k, v in fields.items() if k != "policy"}
    if "moe_layers" in values:
        values["moe_layers"] = tuple(values["moe_layers"])
    try:
        return ModelConfig(**values)
    except (TypeError, ValueError) as err:
        raise PolicyError(f"manifest model_config {sorted(values)} is not a ModelConfig: {err}") from None


def estimated_params(config: ModelConfig) -> int:
    """Roughly how many parameters a `Transformer(config)` has (embeddings, attention, feed-forwards and
    experts, untied head, MTP heads), after checking every size is positive.

    :raises PolicyError: a size is not a positive integer.
    """
    sizes = {name: getattr(config, name) for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff",
                                                       "max_seq_len", "n_experts", "top_k")}
    bad = {name: v for name, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    if bad or not isinstance(config.mtp_heads, int) or config.mtp_heads < 0:
        raise PolicyError(f"sizes must be positive integers: {bad or {'mtp_heads': config.mtp_heads}}")
    d, ff = config.d_model, config.d_ff
    n_moe = len(config.moe_layers)
    layers = config.n_layers * 4 * d * d + 3 * d * ff * (config.n_layers - n_moe + n_moe * config.n_experts)
    heads = (0 if config.tie_embeddings else 1) + config.mtp_heads
    return config.vocab_size * d * (1 + heads) + layers


class BuiltinPolicy(Policy):
    """`Transformer` + `ByteTokenizer`. Keeps every feature of the transformer: MoE router replay, MTP heads
    (speculative decoding through `transformer`), MXFP8 sampling."""

    kind = "builtin"

    def __init__(self, model: Transformer, tokenizer: ByteTokenizer | None = None) -> None:
        self.module = model
        self.tokenizer = tokenizer or ByteTokenizer()

    @property
    def transformer(self) -> Transformer:
        return self.module  # type: ignore[return-value]

    @property
    def config(self) -> ModelConfig:
        return self.transformer.config

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> BuiltinPolicy:
        return cls(Transformer(config_from_spec(spec)))

    @classmethod
    def load(cls, path: Path) -> BuiltinPolicy:
        """A `pretrain.pt` (or the folder holding it), in eval mode.

        :raises PolicyError: no such file, or one that is not a pretrain checkpoint.
        """
        from rlbus.model.training.pretrain import CHECKPOINT_NAME, load_checkpoint

        file = path / CHECKPOINT_NAME if path.is_dir() else path
        if not file.is_file():
            raise PolicyError(f"{file}: no such file; expected a {CHECKPOINT_NAME} (run `rlbus pretrain`) or a "
                              f"Hugging Face directory with a config.json")
        try:
            model, tokenizer, _ = load_checkpoint(file)
        except (KeyError, RuntimeError, ValueError, EOFError, OSError, pickle.UnpicklingError) as err:
            first = (str(err).strip().splitlines() or [""])[0][:120]
            what = "not a" if isinstance(err, (KeyError, ValueError)) else "not a readable"   # read, but not ours
            raise PolicyError(f"{file}: {what} {CHECKPOINT_NAME} ({type(err).__name__}: {first}); expected "
                              f"the file `rlbus pretrain` or `rlbus up` writes") from None
        return cls(model, tokenizer)

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def moe(self) -> tuple[int, int] | None:
        return (len(self.config.moe_layers), self.config.top_k) if self.config.moe_layers else None

    @property
    def n_experts(self) -> int | None:
        return self.config.n_experts if self.config.moe_layers else None

    def forward(self, tokens: Tensor, *, cache: PolicyCache | None = None, attention_mask: Tensor | None = None,
                routing: Tensor | None = None) -> PolicyOutput:
        out = self.transformer(tokens, cache=cache, attention_mask=attention_mask,  # type: ignore[arg-type]
                               routing=routing, with_mtp=False)
        return PolicyOutput(out.logits, out.routing)

    def new_cache(self, batch: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        return self.transformer.new_cache(batch, max_len, dtype)

    def cache_from_rows(self, rows: list[RowKV], extra: int, dtype: torch.dtype | None = None) -> KVCache:
        return self.transformer.cache_from_rows(rows, extra, dtype)

    def shard_units(self) -> list[torch.nn.Module]:
        """The transformer blocks (the root keeps the embedding, which the tied head shares, and the final norm)."""
        return list(self.transformer.blocks)

    def spec(self) -> dict[str, Any]:
        return config_dict(self.config)

    def to_(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> BuiltinPolicy:
        self.module.to(device=device, dtype=dtype)  # the RoPE tables stay fp32 (Transformer._apply)
        return self


def fresh_config() -> ModelConfig:
    """The architecture of a policy started without a pretrained checkpoint (tests): tiny, byte vocabulary."""
    return ModelConfig.tiny(vocab_size=ByteTokenizer().vocab_size, max_seq_len=512)
