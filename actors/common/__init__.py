"""rlbus.actors.common."""
