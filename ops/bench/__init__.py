"""rlbus.ops.bench.cli."""
