"""rlbus.actors."""
