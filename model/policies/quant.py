"""Weight quantisation for sampling: a copy of the policy whose Linear weights hold MXFP8 values.

Owns `quantized_copy` and `refresh_quantized` (re-quantise after an in-place weight swap).
Does not own the MXFP8 format itself (`rlbus.kernels.mxfp8`).
"""

from __future__ import annotations

import copy
from typing import Literal, TypeAlias

import torch
from torch import nn

from rlbus.kernels.mxfp8 import mxfp8_roundtrip

WeightQuant: TypeAlias = Literal["none", "mxfp8"]


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
