"""rlbus.actors.sandbox.supervisor."""
