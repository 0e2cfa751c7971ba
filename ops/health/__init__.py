"""rlbus.ops.health.cli."""
