"""Numerics of a policy: MXFP8 weight copies for sampling, and the trainer's precision applied to a module.

Owns `quantized_copy` and `refresh_quantized` (re-quantise after an in-place weight swap), `QuantLinear`,
and `set_numerics` (forward precision of expert or all Linear layers, router-replay plausibility threshold).
Does not own the number formats or the quantised product (`rlbus.kernels.mxfp8`, `nvfp4`, `quantmm`).
"""

from __future__ import annotations

import copy
from typing import Literal, TypeAlias

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
    every layer that has one. Returns the number of Linear layers at a quantised precision.

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
