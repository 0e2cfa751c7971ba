"""rlbus.model: the policy (transformer, generation with KV cache), RL losses.

Re-exports the public names of the transformer, generation, summarisation, quantisation and
losses; the tokenizer, tasks and pretraining are imported from their own modules.
"""

from __future__ import annotations

from rlbus.model.generate import (
    SampledSequence,
    SpeculativeStats,
    SwapHook,
    generate,
    left_pad,
    sample_next,
    speculative_generate,
)
from rlbus.model.loss import (
    Aggregation,
    LossTerms,
    aggregate,
    group_relative_advantages,
    k1_kl,
    length_penalty,
    lm_loss,
    rl_loss,
    shape_rewards,
    truncated_importance_weights,
)
from rlbus.model.quant import WeightQuant, quantized_copy, refresh_quantized
from rlbus.model.summarize import Summary, Trajectory, summarize_if_over_budget
from rlbus.model.transformer import KVCache, ModelConfig, ModelOutput, Transformer

__all__ = [
    "Aggregation",
    "KVCache",
    "LossTerms",
    "ModelConfig",
    "ModelOutput",
    "SampledSequence",
    "SpeculativeStats",
    "Summary",
    "SwapHook",
    "Trajectory",
    "Transformer",
    "WeightQuant",
    "aggregate",
    "generate",
    "group_relative_advantages",
    "k1_kl",
    "left_pad",
    "length_penalty",
    "lm_loss",
    "quantized_copy",
    "refresh_quantized",
    "rl_loss",
    "sample_next",
    "shape_rewards",
    "speculative_generate",
    "summarize_if_over_budget",
    "truncated_importance_weights",
]
