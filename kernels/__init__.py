"""rlbus.kernels."""
