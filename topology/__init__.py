"""rlbus.topology."""
