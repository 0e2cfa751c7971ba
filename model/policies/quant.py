"""Numerics of a policy: MXFP8 weight copies for sampling, and the trainer's precision applied to a module.

Owns `quantized_copy` and `refresh_quantized` (re-quantise after an in-place weight swap), `QuantLinear`,
the quantised forward of fused experts (transformers' Qwen3-MoE keeps each layer's experts as two 3-D
parameters, not Linear layers), and `set_numerics` (forward precision of expert or all Linear layers,
router-replay plausibility threshold).
Does not own the number formats or the quantised product (`rlbus.kernels.mxfp8`, `nvfp4`, `quantmm`).
"""

from __future__ import annotations

import copy
from typing import Any, Final, Literal, TypeAlias

import torch
from torch import Tensor, nn

from rlbus.kernels.mxfp8 import mxfp8_roundtrip
from rlbus.kernels.quantmm import Precision, check_precision, quant_linear

WeightQuant: TypeAlias = Literal["none", "mxfp8"]
PrecisionScope: TypeAlias = Literal["experts", "all"]


@torch.no_grad()
def refresh_quantized(target: nn.Module, source: nn.Module) -> None:
    """Copy source's parameters and buffers into target, every nn.Linear weight through MXFP8
    quantise -> dequantise (embeddings, norms and a tied output head stay exact)."""
    quantized = {f"{name}.weight" for name, mod in source.named_modules() if isinstance(mod, nn.Linear)}
    target_params = dict(target.named_parameters())
    for name, p in source.named_parameters():
        target_params[name].copy_(mxfp8_roundtrip(p) if name in quantized else p)


def quantized_copy(model: nn.Module, scheme: WeightQuant = "mxfp8") -> nn.Module:
    """A deep copy of model in eval mode whose Linear weights are MXFP8 round-tripped."""
    if scheme not in ("none", "mxfp8"):
        raise ValueError(f"unknown weight_quant {scheme!r}; expected 'none' or 'mxfp8'")
    clone = copy.deepcopy(model).eval()
    if scheme == "mxfp8":
        refresh_quantized(clone, model)
    return clone


class QuantLinear(nn.Linear):
    """An nn.Linear whose product is `quant_linear` at `precision` (no bias: none of our layers has one).

    Made by swapping the class of an existing nn.Linear, so parameter objects and names stay: an
    optimizer holding them and the weight codec naming them see no change.
    """

    precision: Precision = "bf16"

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is not None:
            raise ValueError("QuantLinear takes bias-free Linear layers only")
        return quant_linear(x, self.weight, self.precision)


def _fused_experts_forward(self: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' eager forward of fused experts (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)), each
    expert's two products through `quant_linear` at `self.precision`: hidden_states (N, H), top_k_index and
    top_k_weights (N, k) -> (N, H)."""
    out = torch.zeros_like(hidden_states)
    for e in top_k_index.unique().tolist():
        if not 0 <= e < self.num_experts:
            continue
        token, slot = torch.nonzero(top_k_index == e, as_tuple=True)
        gate, up = quant_linear(hidden_states[token], self.gate_up_proj[e], self.precision).chunk(2, dim=-1)
        y = quant_linear(self.act_fn(gate) * up, self.down_proj[e], self.precision)
        out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out


_FUSED: Final[dict[type, type]] = {}
"""Fused-experts class -> its quantised subclass (made once per class)."""


def _is_fused_experts(mod: nn.Module) -> bool:
    w = getattr(mod, "gate_up_proj", None)
    return isinstance(w, nn.Parameter) and w.dim() == 3 and hasattr(mod, "down_proj") and hasattr(mod, "act_fn")


def _quantise_fused(mod: nn.Module, precision: Precision) -> int:
    """Class-swap fused experts to their quantised subclass at `precision` (back, for bf16); returns the Linear
    layers that makes quantised (two per expert)."""
    base = next(c for c in type(mod).__mro__ if c not in _FUSED.values())
    if precision == "bf16":
        mod.__class__ = base
        mod.__dict__.pop("precision", None)
        return 0
    if base not in _FUSED:
        _FUSED[base] = type(f"Quant{base.__name__}", (base,), {"forward": _fused_experts_forward})
    mod.__class__ = _FUSED[base]
    mod.precision = precision
    return 2 * int(mod.gate_up_proj.shape[0])


def _is_expert(name: str) -> bool:
    return ".experts." in f".{name}."


def _skipped(name: str) -> bool:
    """Layers that keep full precision under every scope: routers and the output head."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("router", "lm_head")


def set_numerics(
    module: nn.Module, precision: str = "bf16", scope: str = "experts", replay_threshold: float = 0.0
) -> int:
    """Apply a forward precision to module's expert Linear layers (scope "experts") or to every Linear
    but routers and the output head (scope "all"), and the router-replay plausibility threshold to
    every layer that has one. Fused experts are expert layers under either scope. Returns the number of
    Linear layers at a quantised precision (a fused expert counts two: gate-up and down).

    :raises ValueError: an unknown precision or scope, or a threshold outside [0, 1].
    """
    precision = check_precision(precision)
    if scope not in ("experts", "all"):
        raise ValueError(f"unknown precision_scope {scope!r}; expected 'experts' or 'all'")
    if not 0.0 <= replay_threshold <= 1.0:
        raise ValueError(f"router_replay_threshold {replay_threshold} must be in [0, 1]")
    quantised = 0
    for name, mod in module.named_modules():
        if hasattr(mod, "replay_threshold"):
            mod.replay_threshold = float(replay_threshold)
        if _is_fused_experts(mod):
            quantised += _quantise_fused(mod, precision)
            continue
        if not isinstance(mod, nn.Linear):
            continue
        chosen = precision != "bf16" and (_is_expert(name) if scope == "experts" else not _skipped(name))
        if chosen:
            mod.__class__ = QuantLinear
            mod.precision = precision  # type: ignore[assignment]
            quantised += 1
        elif isinstance(mod, QuantLinear):
            mod.__class__ = nn.Linear
            del mod.precision
    return quantised


NUMERICS_KEY = "numerics"
"""The key of a policy spec (`Policy.spec`, as the trainer publishes it) under which its forward precision
travels, so that every actor that builds the policy from the spec runs the same forward."""


def numerics_spec(precision: str, scope: str) -> dict[str, dict[str, str]]:
    """What the trainer adds to its policy spec: nothing for bf16 (older specs stay equal), else
    {"numerics": {"precision": ..., "scope": ...}}."""
    check_precision(precision)
    return {} if precision == "bf16" else {NUMERICS_KEY: {"precision": precision, "scope": scope}}


def apply_spec_numerics(module: nn.Module, numerics: object) -> None:
    """`set_numerics` from a spec's "numerics" value.

    :raises ValueError: the value is not a {"precision", "scope"} table of known values.
    """
    if not isinstance(numerics, dict) or set(numerics) != {"precision", "scope"}:
        raise ValueError(f"policy spec key {NUMERICS_KEY!r} must be a table of precision and scope, got {numerics!r}")
    set_numerics(module, str(numerics["precision"]), str(numerics["scope"]))
