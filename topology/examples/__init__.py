"""rlbus.topology.examples."""
