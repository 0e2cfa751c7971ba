"""rlbus.model."""
