"""rlbus.kernels: numeric kernels with torch references, and no knowledge of the bus or actors.

- `logprob`: per-token log-probabilities (and entropy) from logits; `_logprob_triton` is its Triton kernel.
- `mxfp8`: MXFP8 block quantisation; `_mxfp8_triton` is its Triton kernel.
- `delta/`: the lossless weight-delta codec (its own subpackage).
"""
