"""rlbus.model.sampling: generating from a policy.

- `generate`: batched sampling with a KV cache, in-flight weight swaps and MTP speculation.
- `summarize`: trajectories and self-summarisation of a history over its budget.
- `evaluate`: greedy held-out evaluation as pass@1 with a Wilson interval.
- `scores`: pass@1, mean@K and unbiased pass@k with bootstrap intervals from pass counts.
"""
