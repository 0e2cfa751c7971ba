"""rlbus.ops.chaos.cli."""
