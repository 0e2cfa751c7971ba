"""rlbus.kernels.delta: the lossless weight-delta codec, one policy version against another, bit exact.

- `codec`: the per-tensor encodings (full, sparse, bitmask, dense XOR), the choice by size, digests.
- `state`: a whole state dict as one blob against any base version, and its apply in place.
- `bitcode`: the numpy entropy-coding primitives (varints, bit fields, Rice / Exp-Golomb).
- `compiled`: numba twins of the hot loops (used when numba imports); `device`: the Triton change scan.
"""
