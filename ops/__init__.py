"""rlbus.ops."""
