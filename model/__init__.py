"""rlbus.model: the policy (transformer, generation with KV cache), RL losses.

Re-exports the public names; the tokenizer, tasks and pretraining live in their own modules.
"""

from __future__ import annotations

from rlbus.model.transformer import KVCache, ModelConfig, ModelOutput, Transformer

__all__ = ["KVCache", "ModelConfig", "ModelOutput", "Transformer"]
