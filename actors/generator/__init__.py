"""rlbus.actors.generator.actor."""
