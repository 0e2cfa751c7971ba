"""rlbus.model.training: the math and loops that change weights.

- `loss`: RL losses as pure functions (advantages, importance weights, KL, length shaping).
- `pretrain`: continued pretraining of any policy; `corpus`: its decontaminated data.
"""
